"""transformers' own Qwen3ForCausalLM, loaded from the same safetensors files: the oracle."""
import functools

import torch

transformers = __import__("pytest").importorskip("transformers")


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    model = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


@torch.inference_mode()
def hf_logits(path: str, token_ids: list[int]) -> torch.Tensor:
    return hf_model(path)(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(path: str, token_ids: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([token_ids])
    # With pad_token_id and no mask, generate would mask out every prompt token equal to the pad id.
    out = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()
