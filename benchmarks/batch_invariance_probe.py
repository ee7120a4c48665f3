"""Which of a Qwen3-MoE decode step's ops give a row other bits when the batch around it grows (run on the GPU;
benchmarks/NOTES.md, entry 55)? Each op on 5..200 rows against the same rows inside 256. Attention is not probed."""
import torch
import torch.nn.functional as F

from mini_engine import LLM
from mini_engine.kernels.fused_moe import fused_moe
from mini_engine.kernels.moe_router import route
from mini_engine.model.random_checkpoint import QWEN3_30B_A3B, write_random_checkpoint
path = write_random_checkpoint("/tmp/diag-moe", QWEN3_30B_A3B | {"num_hidden_layers": 2}, std=0.06, seed=1, device="cuda")
llm = LLM(path, num_kv_blocks=64, enforce_eager=True)
model = llm.engine.runner.model
layer = model.layers[0]
attn, moe = layer.self_attn, layer.mlp
torch.manual_seed(0)
def check(name, f, width, rows=(5, 8, 13, 16, 33, 64, 200)):
    x = torch.randn(256, width, device="cuda", dtype=torch.bfloat16)
    full = f(x[:256])
    for n in rows:
        part = f(x[:n])
        part = part if isinstance(part, torch.Tensor) else part[0]
        ref = full if isinstance(full, torch.Tensor) else full[0]
        d = (part.float() - ref[:n].float()).abs().max().item()
        print(f"{name:28s} rows {n:3d} vs 256: max diff {d:.3g}{'' if d == 0 else '  <-- differs'}")
with torch.inference_mode():
    check("qkv_proj (cuBLAS)", lambda x: attn.qkv_proj(x)[0], 2048)
    check("o_proj", lambda x: attn.o_proj(x, residual=torch.zeros(x.shape[0], 2048, device='cuda', dtype=torch.bfloat16)), 4096)
    check("router (Triton)", lambda x: route(x, moe.gate.weight, 8, True)[0], 2048)
    check("router (cuBLAS ref)", lambda x: F.linear(x, moe.gate.weight), 2048)
    def experts(x):
        w, ids = route(x, moe.gate.weight, 8, True)
        return fused_moe(x, moe.experts.w13_weight, moe.experts.w2_weight, w, ids)
    check("fused_moe (router+experts)", experts, 2048)
    P = torch.randn(256 * 8, 2048, device="cuda", dtype=torch.bfloat16)
    def pairs(x):
        return P[:x.shape[0] * 8].view(-1, 8, 2048).sum(1, dtype=torch.float32)
    check("sum over k (torch)", pairs, 2048)
    check("lm_head", lambda x: model.compute_logits(x), 2048)
