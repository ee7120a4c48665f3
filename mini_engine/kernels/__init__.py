"""Kernels: each file holds a plain PyTorch reference (`*_ref`, the CPU path and the test oracle)
and, beside it, the fused Triton kernel that replaces it on CUDA."""
import importlib.util

KERNEL_NAMES = ("attention", "rms_norm", "rope_kv", "silu_and_mul", "sampler", "linear", "prev_tokens", "fused_moe",
                "fp8_linear", "lora", "awq_linear")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_kernels(spec: str, device_type: str) -> frozenset[str]:
    """Turn EngineConfig.kernels into the set of kernel names to run as Triton."""
    spec = spec.strip().lower()
    if spec == "none":
        return frozenset()
    if spec == "auto":
        return frozenset(KERNEL_NAMES) if device_type == "cuda" and triton_available() else frozenset()
    names = frozenset(s.strip() for s in spec.split(",") if s.strip())
    unknown = names - set(KERNEL_NAMES)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; choose from {KERNEL_NAMES}, 'auto' or 'none'")
    if names and not triton_available():
        raise ValueError(f"kernels {sorted(names)} need triton, which is not installed")
    return names
