"""Diagnostic (session 63): which live allocations keep a self-drafting engine's freed memory reserved after sleep(1)."""
import os, sys, tempfile, collections
import torch
from mini_engine import LLM, SamplingParams
from mini_engine.model.random_checkpoint import QWEN3_0_6B, write_random_checkpoint

variant = sys.argv[1] if len(sys.argv) > 1 else "draft"
folder = tempfile.mkdtemp()
b = write_random_checkpoint(os.path.join(folder, "b"), QWEN3_0_6B | {"num_hidden_layers": 8}, std=0.06, seed=1, device="cuda")
torch.cuda.memory._record_memory_history(max_entries=200000)
spec = {"model": b, "num_speculative_tokens": 4} if variant == "draft" else None
llm = LLM(b, num_kv_blocks=512, enable_sleep_mode=True, speculative_config=spec)
llm.generate([[5, 6, 7] * 30, list(range(100, 400))], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
torch.cuda.synchronize()
r0, a0 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
llm.sleep(level=1)
r1, a1 = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
print(f"{variant}: reserved {r0/2**30:.3f} -> {r1/2**30:.3f} GiB, allocated {a0/2**30:.3f} -> {a1/2**30:.3f} GiB")
snap = torch.cuda.memory._snapshot()
rows = []
for seg in snap["segments"]:
    active = [blk for blk in seg["blocks"] if blk["state"] == "active_allocated"]
    free = sum(blk["size"] for blk in seg["blocks"] if blk["state"] != "active_allocated")
    if active and free > 4 * 2**20:
        rows.append((free, seg["total_size"], seg.get("segment_pool_id"), active))
rows.sort(key=lambda r: -r[0])
print(f"segments held by live blocks: {len(rows)}, their free bytes {sum(r[0] for r in rows)/2**30:.3f} GiB")
for free, total, pool, active in rows[:8]:
    print(f"  segment {total/2**20:.1f} MiB pool {pool}, free {free/2**20:.1f} MiB, {len(active)} live blocks:")
    for blk in sorted(active, key=lambda x: -x["size"])[:4]:
        frames = [f"{f['filename'].split('mini_engine/')[-1]}:{f['line']} {f['name']}" for f in blk.get("frames", [])
                  if "mini_engine" in f["filename"]][:4]
        print(f"     {blk['size']/2**20:8.2f} MiB  {' < '.join(frames)}")
