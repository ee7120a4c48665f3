"""The fused LoRA kernel (kernels="lora", kernels/lora.py) inside the model, on the GPU or through
Triton's interpreter: a mixed batch's logits and greedy tokens (fp32) equal the PyTorch path's,
which tests/engine/test_lora.py holds to PEFT's PeftModel."""
import random

import pytest
import torch

pytest.importorskip("triton")
from mini_engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from mini_engine.config import EngineConfig, ModelConfig  # noqa: E402
from mini_engine.lora import write_random_adapter  # noqa: E402
from mini_engine.runner.batch import BatchRow  # noqa: E402
from mini_engine.runner.model_runner import ModelRunner  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def base_and_loras(checkpoint_factory, tmp_path_factory):
    base = checkpoint_factory("untied-bias-gqa4")       # its q/k/v read the normed input: both norm paths
    root = tmp_path_factory.mktemp("lora-kernel")
    mc = ModelConfig.from_pretrained(base)
    folders = [write_random_adapter(str(root / str(i)), mc, rank, seed=i, dtype=torch.float32, std=0.3)
               for i, rank in enumerate((4, 8))]
    return base, [LoRARequest(f"random-{i}", i + 1, f) for i, f in enumerate(folders)]


def mixed_batch_logits(base: str, loras: list[LoRARequest], kernels: str) -> torch.Tensor:
    runner = ModelRunner(EngineConfig(base, device=DEVICE, num_kv_blocks=64, block_size=4, enable_lora=True,
                                      max_loras=2, max_lora_rank=8, kernels=kernels, dtype="float32"))
    rng = random.Random(0)
    rows, next_block = [], 0
    for n, lora in zip((1, 6, 17, 9), (loras[0], None, loras[1], loras[0])):
        blocks = list(range(next_block, next_block + -(-n // 4)))
        next_block += len(blocks)
        rows.append(BatchRow([rng.randrange(3, 256) for _ in range(n)], 0, blocks, True, GREEDY, lora_request=lora))
    with torch.inference_mode():
        t, meta = runner.prepare_inputs(rows)
        return runner.model.compute_logits(runner.model(t.input_ids, t.positions, meta, t.lora_slots)).float()


def test_logits_equal_the_pytorch_path(base_and_loras):
    base, loras = base_and_loras
    fused = mixed_batch_logits(base, loras, "lora")
    plain = mixed_batch_logits(base, loras, "none")
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    # The adapters matter (a kernel that added nothing would fail): their rows move, the base row not.
    base_only = mixed_batch_logits(base, [None, None], "none")
    moved = (fused - base_only).abs().amax(dim=1)
    assert (moved[:1] > 0.1).all() and (moved[1:7] == 0).all() and (moved[7:] > 0.1).all()


def test_greedy_tokens_equal_the_pytorch_path(base_and_loras):
    """Prefill and decode steps, adapters and the base model mixed, one adapter swapped through a
    slot (max_loras=1)."""
    base, loras = base_and_loras
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    choices = [[None, *loras][i % 3] for i in range(len(prompts))]
    tokens = {}
    for kernels in ("lora", "none"):
        llm = LLM(base, device=DEVICE, enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64,
                  kernels=kernels, dtype="float32")
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=choices)
        tokens[kernels] = [o.outputs[0].token_ids for o in outputs]
        assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    assert tokens["lora"] == tokens["none"]
