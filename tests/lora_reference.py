"""LoRA adapters written by PEFT itself (get_peft_model, save_pretrained) over the tiny checkpoints,
and PEFT's PeftModel over transformers' Qwen3 reading them back: the oracle for enable_lora."""
import functools
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(base: str, folder: str, seed: int, targets=ALL_TARGETS, r: int = 4, alpha: float = 8,
                  **lora_options) -> str:
    """A PEFT adapter of random pairs (init_lora_weights=False: B is not zero, so the adapter
    changes the model) at folder. targets: module names, or PEFT's regex over full names."""
    if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        targets = targets if isinstance(targets, str) else list(targets)
        config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                                 **lora_options)
        peft.get_peft_model(model, config).save_pretrained(folder)
    return folder


@functools.lru_cache(maxsize=None)
def peft_model(base: str, adapter: str | None):
    """transformers' model of base, with PEFT's adapter from `adapter` (None: the base alone)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()


@torch.inference_mode()
def peft_logits(base: str, adapter: str | None, token_ids: list[int]) -> torch.Tensor:
    return peft_model(base, adapter)(input_ids=torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def peft_greedy(base: str, adapter: str | None, token_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([token_ids])
    out = peft_model(base, adapter).generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                             pad_token_id=0)
    return out[0, len(token_ids):].tolist()
