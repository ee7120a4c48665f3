"""transformers' own Qwen3ForCausalLM (or Qwen3MoeForCausalLM), loaded from the same safetensors files: the oracle."""
import functools

import torch

transformers = __import__("pytest").importorskip("transformers")


def rounded_kv_eager_attention(cache_dtype: torch.dtype):
    """transformers' eager attention over keys and values rounded to cache_dtype as an fp8 KV cache
    stores them (saturated at the format's largest value, vLLM's unscaled fp8 cache): the oracle
    for kv_cache_dtype "fp8" and "fp8_e5m2". Its cache keeps the unrounded values, and rounding
    them again at every step gives the same fp8 values."""
    from mini_engine.kernels.rotary_kv import to_cache_dtype_ref
    from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

    def attention(module, query, key, value, *args, **kwargs):
        key, value = (to_cache_dtype_ref(x, cache_dtype).to(x.dtype) for x in (key, value))
        return eager_attention_forward(module, query, key, value, *args, **kwargs)
    return attention


# kv_cache_dtype -> the attn_implementation that reads K and V as that cache stores them
ATTENTION_BY_KV_CACHE_DTYPE = {"auto": "eager", "fp8": "fp8_kv_eager", "fp8_e5m2": "fp8_e5m2_kv_eager"}
for name, dtype in (("fp8_kv_eager", torch.float8_e4m3fn), ("fp8_e5m2_kv_eager", torch.float8_e5m2)):
    transformers.AttentionInterface.register(name, rounded_kv_eager_attention(dtype))
    # and eager's causal mask: a name without a mask function gets no mask at all
    transformers.AttentionMaskInterface.register(name, transformers.masking_utils.eager_mask)


@functools.lru_cache(maxsize=None)
def hf_model(path: str, kv_cache_dtype: str = "auto"):
    """kv_cache_dtype "fp8" or "fp8_e5m2": attention reads keys and values rounded to that fp8
    format (rounded_kv_eager_attention)."""
    attention = ATTENTION_BY_KV_CACHE_DTYPE[kv_cache_dtype]
    # Qwen3ForCausalLM, or Qwen3MoeForCausalLM for a Qwen3-MoE checkpoint, as config.json says
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
    return model.eval()


@torch.inference_mode()
def hf_logits(path: str, token_ids: list[int], kv_cache_dtype: str = "auto") -> torch.Tensor:
    return hf_model(path, kv_cache_dtype)(torch.tensor([token_ids])).logits[0].float()


@torch.inference_mode()
def hf_greedy(path: str, token_ids: list[int], max_new_tokens: int, kv_cache_dtype: str = "auto") -> list[int]:
    ids = torch.tensor([token_ids])
    # With pad_token_id and no mask, generate would mask out every prompt token equal to the pad id.
    out = hf_model(path, kv_cache_dtype).generate(ids, attention_mask=torch.ones_like(ids),
                                                  max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(token_ids):].tolist()
