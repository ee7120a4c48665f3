"""Does cuBLASLt have a faster kernel for the decode projections than the one cuBLAS picks?

torch calls cuBLAS with its heuristic's first choice. cuBLASLt's heuristic can be asked for its
top N algorithms for a shape; this script times each of them (through ctypes, in a CUDA graph of
28 weights so that each product reads its weight from HBM, as in the model) against torch's
F.linear and the in-place residual add (addmm_, beta = 1), for the four projections at the
captured batch sizes. It only measures; nothing in the engine uses it. Needs CUDA.

    PYTHONPATH=. python benchmarks/cublaslt_algos.py [--rows 64 128 256] [--top 32]
"""
import argparse
import ctypes
import sys

import torch
import torch.nn.functional as F

from benchmarks.decode_sweep import LAYERS, PROJECTIONS, time_us

CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF = 68, 0, 14
DESC_TRANSA, DESC_TRANSB, PREF_MAX_WORKSPACE_BYTES = 3, 4, 1
OP_N, OP_T = 0, 1


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt that torch itself loaded (found in this process's memory map)."""
    torch.mm(torch.ones(8, 8, device="cuda"), torch.ones(8, 8, device="cuda"))
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublasLt" in line}
    if not paths:
        raise RuntimeError("libcublasLt is not loaded")
    return ctypes.CDLL(sorted(paths)[0])


def check(status: int, what: str):
    if status != 0:
        raise RuntimeError(f"{what}: cublasStatus {status}")


class LtMatmul:
    """y[m, n] (+)= x[m, k] @ w[n, k]^T in bf16 with fp32 accumulation, as cuBLAS's column-major
    D[n, m] = op(W)[n, k] op(X)[k, m] with W transposed: the 'TN' layout torch uses."""

    def __init__(self, lib, handle, m: int, n: int, k: int, workspace: torch.Tensor):
        self.lib, self.handle, self.workspace = lib, handle, workspace
        self.desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            v = ctypes.c_int(op)
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), ctypes.sizeof(v)), "trans")
        self.a, self.b, self.d = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), CUDA_R_16BF, ctypes.c_uint64(k),
                                             ctypes.c_uint64(n), ctypes.c_int64(k)), "A")
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), CUDA_R_16BF, ctypes.c_uint64(k),
                                             ctypes.c_uint64(m), ctypes.c_int64(k)), "B")
        check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.d), CUDA_R_16BF, ctypes.c_uint64(n),
                                             ctypes.c_uint64(m), ctypes.c_int64(n)), "D")

    def algos(self, top: int) -> list[HeuristicResult]:
        pref = ctypes.c_void_p()
        check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        size = ctypes.c_uint64(self.workspace.numel())
        check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size),
                                                            ctypes.sizeof(size)), "workspace")
        results = (HeuristicResult * top)()
        count = ctypes.c_int()
        check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.a, self.b, self.d, self.d, pref,
                                                      top, results, ctypes.byref(count)), "heuristic")
        return [results[i] for i in range(count.value) if results[i].state == 0]

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, beta: float, algo: HeuristicResult):
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(beta)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(alpha), ctypes.c_void_p(w.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(beta), ctypes.c_void_p(y.data_ptr()), self.d,
            ctypes.c_void_p(y.data_ptr()), self.d, ctypes.byref(algo.algo), ctypes.c_void_p(self.workspace.data_ptr()),
            ctypes.c_size_t(algo.workspace_size), stream), "matmul")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 192, 256])
    ap.add_argument("--top", type=int, default=32)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("cublaslt_algos.py needs CUDA", file=sys.stderr)
        return 2
    lib = load_cublaslt()
    handle = ctypes.c_void_p()
    check(lib.cublasLtCreate(ctypes.byref(handle)), "create")
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; us a product, 28 weights from HBM")
    # o_proj and down_proj add into the residual stream (beta = 1), as the model does
    adds = {"o": True, "down": True, "qkv": False, "gate_up": False}
    total_gain = 0.0
    for name, (n, k) in PROJECTIONS.items():
        ws = [torch.randn(n, k, device="cuda").to(torch.bfloat16) / k ** 0.5 for _ in range(LAYERS)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            y = torch.zeros(m, n, device="cuda", dtype=torch.bfloat16)
            beta = 1.0 if adds[name] else 0.0
            if adds[name]:
                torch_us = time_us(lambda: [y.addmm_(x, w.t()) for w in ws]) / LAYERS
            else:
                torch_us = time_us(lambda: [torch.mm(x, w.t(), out=y) for w in ws]) / LAYERS
            lt = LtMatmul(lib, handle, m, n, k, workspace)
            ref = F.linear(x, ws[0]).float()
            times = []
            for i, algo in enumerate(lt.algos(args.top)):
                y.zero_()
                lt(x, ws[0], y, 0.0, algo)
                if (y.float() - ref).abs().max().item() > 0.05:
                    print(f"  {name} m={m} algo {i}: WRONG")
                    continue
                try:
                    us = time_us(lambda algo=algo: [lt(x, w, y, beta, algo) for w in ws]) / LAYERS
                except RuntimeError as e:
                    print(f"  {name} m={m} algo {i}: {e}")
                    continue
                times.append((us, i, algo.waves_count))
            times.sort()
            first = next((t for t in times if t[1] == 0), None)
            best = times[0]
            total_gain += max(0.0, torch_us - best[0])
            print(f"  {name:<8} m={m:3d}: torch {torch_us:6.2f}  lt #0 {first[0] if first else float('nan'):6.2f}  "
                  f"best {best[0]:6.2f} (#{best[1]}, waves {best[2]:.2f}) of {len(times)}; "
                  f"next {', '.join(f'{t[0]:.2f}(#{t[1]})' for t in times[1:4])}")
    print(f"sum over the shapes above of (torch - best): {total_gain:.2f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
