"""Shared fixtures: tiny random Qwen3 (and Qwen3-MoE) checkpoints written as safetensors, in the exact layout of
a Hugging Face checkpoint, which both mini_engine and transformers load."""
import pytest
import torch

from mini_engine.model.random_checkpoint import write_random_checkpoint

TINY_BASE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
    "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "bos_token_id": 1, "eos_token_id": 2,
}

# Tied and untied, with and without attention bias, GQA ratios 2, 4 and 1.
TINY_CONFIGS = {
    "tied-gqa2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, attention_bias=False),
    "untied-bias-gqa4": dict(hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                             num_key_value_heads=2, head_dim=8, tie_word_embeddings=False, attention_bias=True),
    "untied-mha": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2, head_dim=32, tie_word_embeddings=False, attention_bias=False),
    # Qwen3-MoE: layers 0 and 2 sparse (8 experts, 2 a token, renormalised), layer 1 dense
    # (mlp_only_layers); and every layer sparse, 3 of 6 experts a token, not renormalised.
    "moe-mixed": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=False),
    "moe-top3": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=48,
                     intermediate_size=96, moe_intermediate_size=40, num_experts=6, num_experts_per_tok=3,
                     norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                     head_dim=12, tie_word_embeddings=True, attention_bias=False),
}


def tiny_config(name: str) -> dict:
    return TINY_BASE | TINY_CONFIGS[name]


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    made = {}

    def make(name: str) -> str:
        if name not in made:
            path = str(tmp_path_factory.mktemp(name))
            made[name] = write_random_checkpoint(path, tiny_config(name), dtype=torch.float32, std=0.3)
        return made[name]
    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_factory) -> str:
    return checkpoint_factory("tied-gqa2")
