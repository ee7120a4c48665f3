"""The Qwen3 decoder (transformers' Qwen3ForCausalLM, and Qwen3MoeForCausalLM, whose layers' MLPs
are mixtures of experts: layers/moe.py), over a flat batch of tokens."""
import torch
from torch import nn

from mini_engine.config import ModelConfig
from mini_engine.distributed import TensorParallel
from mini_engine.kernels.rotary_kv import rope_cos_sin_cache
from mini_engine.layers.activation import SiluAndMul
from mini_engine.layers.attention import Attention, AttentionMetadata
from mini_engine.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from mini_engine.layers.layernorm import RMSNorm
from mini_engine.layers.linear import Linear, NormedPackedLinear, RowParallelLinear
from mini_engine.layers.lora import LoRAStep
from mini_engine.layers.moe import FusedExperts, Qwen3SparseMoeBlock
from mini_engine.layers.pooler import ClassificationHead
from mini_engine.layers.rotary_embedding import QKNormRopeKVWrite


class Qwen3Attention(nn.Module):
    def __init__(self, config: ModelConfig, kernels: frozenset[str], cos_sin_cache: torch.Tensor, tp: TensorParallel):
        super().__init__()
        # This rank's heads (all of them without tensor parallelism), and their share of the KV cache.
        h, hkv, d = tp.shard(config.num_attention_heads), tp.shard(config.num_key_value_heads), config.head_dim
        skinny = "linear" in kernels
        # The layer's input_layernorm lives here, folded into the QKV projection.
        self.qkv_proj = NormedPackedLinear(config.hidden_size, [h * d, hkv * d, hkv * d], config.attention_bias,
                                           config.rms_norm_eps, skinny, tp)
        self.o_proj = RowParallelLinear(h * d, config.hidden_size, config.attention_bias, skinny, tp)
        self.qk_norm_rope = QKNormRopeKVWrite(h, hkv, d, config.rms_norm_eps, cos_sin_cache,
                                              use_triton="rope_kv" in kernels)
        self.attn = Attention(d, use_triton="attention" in kernels)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """hidden + attention(input_layernorm(hidden)), written into hidden."""
        q = self.before_attention(hidden, positions, meta.slot_mapping)
        return self.after_attention(self.attn(q, meta), hidden)

    def before_attention(self, hidden: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                         q_out: torch.Tensor | None = None) -> torch.Tensor:
        """The queries, [T, heads, head_dim] (in q_out when given); the keys and values go to the cache."""
        qkv, norm_input = self.qkv_proj(hidden)
        return self.qk_norm_rope(qkv, positions, self.attn.k_cache, self.attn.v_cache, slot_mapping, norm_input,
                                 q_out)

    def after_attention(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attn_out.flatten(1), residual=hidden)


class Qwen3MLP(nn.Module):
    def __init__(self, config: ModelConfig, kernels: frozenset[str], tp: TensorParallel):
        super().__init__()
        i = tp.shard(config.intermediate_size)
        skinny = "linear" in kernels
        # The layer's post_attention_layernorm lives here, folded into the gate/up projection.
        self.gate_up_proj = NormedPackedLinear(config.hidden_size, [i, i], False, config.rms_norm_eps, skinny, tp)
        self.down_proj = RowParallelLinear(i, config.hidden_size, False, skinny, tp)
        self.act = SiluAndMul(config.rms_norm_eps, use_triton="silu_and_mul" in kernels)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + mlp(post_attention_layernorm(hidden)), written into hidden."""
        return self.down_proj(self.act(*self.gate_up_proj(hidden)), residual=hidden)


class Qwen3DecoderLayer(nn.Module):
    """transformers' layer computes h = h + attn(norm1(h)), then h = h + mlp(norm2(h)). Here each norm
    is folded into the projection after it and each residual add into the projection before it,
    so a layer is 7 launches: qkv, qk-norm/rope/kv-write, attention, o_proj(+h), gate_up, SwiGLU,
    down(+h); at few rows also decode attention's split reduce and down_proj's split-K sum. Under
    tensor parallelism o_proj and down_proj each add one all-reduce (layers/linear.py).
    A Qwen3-MoE checkpoint's sparse layers take a Qwen3SparseMoeBlock for the MLP."""

    def __init__(self, config: ModelConfig, kernels: frozenset[str], cos_sin_cache: torch.Tensor,
                 tp: TensorParallel, sparse: bool = False):
        super().__init__()
        self.self_attn = Qwen3Attention(config, kernels, cos_sin_cache, tp)
        self.mlp = Qwen3SparseMoeBlock(config, kernels, tp) if sparse else Qwen3MLP(config, kernels, tp)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.mlp(self.self_attn(hidden, positions, meta))


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name -> (packed parameter name, shard index)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    # checkpoint name -> our name, where a module moved
    renamed_modules = {
        "self_attn.q_norm.": "self_attn.qk_norm_rope.q_norm_", "self_attn.k_norm.": "self_attn.qk_norm_rope.k_norm_",
        "input_layernorm.": "self_attn.qkv_proj.norm_", "post_attention_layernorm.": "mlp.gate_up_proj.norm_",
    }
    # the same, in a Qwen3-MoE checkpoint's sparse layers (whose experts' tensors the loader maps
    # through layers.moe.FusedExperts)
    renamed_modules_sparse = renamed_modules | {"post_attention_layernorm.": "mlp.norm."}

    def __init__(self, config: ModelConfig, kernels: frozenset[str] = frozenset(), tp: TensorParallel = TensorParallel(),
                 lm_head: bool = True):
        """lm_head False: an embedding model's (runner "pooling"), whose output is the final hidden
        states; a checkpoint's lm_head.weight is then not loaded (Qwen3-Embedding has none). A
        sequence classifier (config.num_labels) has a `score` head instead, which the pooler applies."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.kernels = kernels
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        # fp32 whatever the model's dtype: positions up to 40k need the precision before the cast.
        cos_sin_cache = rope_cos_sin_cache(config.head_dim, config.max_positions, config.rope_theta,
                                           yarn=config.rope_scaling)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, kernels, cos_sin_cache, tp, config.is_sparse_layer(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, "rms_norm" in kernels)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp) if lm_head else None
        if lm_head and config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.score = ClassificationHead(config.hidden_size, config.num_labels) if config.num_labels else None
        self.lora_step: LoRAStep | None = None             # with enable_lora (enable_lora())

    def materialize(self, device: torch.device) -> None:
        """Once built on the meta device (ModelRunner.start, so that weights held quantized never
        take full-precision memory; hold_quantized_weights put those on `device` already): every
        tensor still on meta becomes an empty one on `device`, for the loader to fill, and what the
        constructor computed with values, rope's table, is computed again. Every parameter is then
        loaded (load_model refuses a checkpoint that lacks one), the norms' weights too: nothing
        else held a value from construction."""
        cos_sin_cache = rope_cos_sin_cache(self.config.head_dim, self.config.max_positions, self.config.rope_theta,
                                           device, yarn=self.config.rope_scaling)
        for layer in self.layers:
            layer.self_attn.qk_norm_rope.cos_sin_cache = cos_sin_cache       # one table for all layers
            attn = layer.self_attn.attn
            attn.k_cache = attn.v_cache = torch.empty_like(attn.k_cache, device=device)
        # Keyed by the meta tensor, so that what modules share (a tied lm_head) stays shared, which
        # nn.Module.to_empty would not keep.
        made: dict[int, torch.Tensor] = {}
        for module in self.modules():
            for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
                if tensor.is_meta:
                    if id(tensor) not in made:
                        empty = torch.empty_like(tensor, device=device)
                        made[id(tensor)] = (nn.Parameter(empty, tensor.requires_grad)
                                            if isinstance(tensor, nn.Parameter) else empty)
                    setattr(module, name, made[id(tensor)])

    def renames(self, name: str) -> dict[str, str]:
        """The renamed_modules that apply to our tensor `name` (without "model."): a sparse layer's own."""
        layer = name.split(".")[1] if name.startswith("layers.") else None
        if layer is not None and layer.isdigit() and self.config.is_sparse_layer(int(layer)):
            return self.renamed_modules_sparse
        return self.renamed_modules

    def fold_norm_weights(self) -> None:
        """Once the checkpoint is loaded: each layer norm's weight into the projection after it."""
        for module in self.modules():
            if isinstance(module, NormedPackedLinear):
                module.fold_norm_weight()

    def quantize_fp8(self, use_triton: bool) -> None:
        """quantization="fp8" over a bf16 checkpoint, once it is loaded and its norms folded: every
        decoder projection's weight to fp8 blocks, a Qwen3-MoE layer's experts included (the
        embedding, lm_head and the MoE router stay). use_triton: the projections' kernel (the
        experts take the grouped GEMM's, where their bf16 products would)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.quantize_weight_fp8(use_triton)
            elif isinstance(module, FusedExperts):
                module.quantize_weight_fp8()

    def lora_modules(self) -> dict[str, Linear]:
        """The projections a LoRA adapter may change, by our name ("layers.0.self_attn.qkv_proj"):
        every layer's attention projections and a dense MLP's (a Qwen3-MoE layer's experts take none)."""
        modules = {}
        for i, layer in enumerate(self.layers):
            modules |= {f"layers.{i}.self_attn.qkv_proj": layer.self_attn.qkv_proj,
                        f"layers.{i}.self_attn.o_proj": layer.self_attn.o_proj}
            if isinstance(layer.mlp, Qwen3MLP):
                modules |= {f"layers.{i}.mlp.gate_up_proj": layer.mlp.gate_up_proj,
                            f"layers.{i}.mlp.down_proj": layer.mlp.down_proj}
        return modules

    def checkpoint_names(self, module_name: str) -> list[str]:
        """The checkpoint's projections that our module holds, in its shard order:
        "layers.0.self_attn.qkv_proj" -> [...q_proj, ...k_proj, ...v_proj]."""
        parent, _, name = module_name.rpartition(".")
        shards = sorted((index, source) for source, (packed, index) in self.packed_modules_mapping.items()
                        if packed == name)
        return [f"{parent}.{source}" for _, source in shards] or [module_name]

    def enable_lora(self, max_loras: int, max_rank: int) -> dict[str, Linear]:
        """Gives every LoRA-able projection max_loras empty slots; returns them by name."""
        weight = self.embed_tokens.weight
        self.lora_step = LoRAStep(max_loras, weight.dtype, weight.device, use_triton="lora" in self.kernels)
        modules = self.lora_modules()
        for module in modules.values():
            module.enable_lora(self.lora_step, max_rank)
        return modules

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                lora_slots: torch.Tensor | None = None,
                embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Returns the final hidden states, [T, hidden]. lora_slots: with enable_lora, each token's
        adapter slot ([T] int32, -1: none). embeds: (token indices [E], their embeddings [E, hidden])
        in place of their token ids' (prompts given as embeddings)."""
        if self.lora_step is not None:
            self.lora_step.begin(lora_slots)
        hidden = self.embed_tokens(input_ids)       # the residual stream, updated in place by each layer
        if embeds is not None:
            hidden.index_copy_(0, embeds[0], embeds[1])
        for layer in self.layers:
            hidden = layer(hidden, positions, meta)
        return self.norm(hidden)

    def forward_piece(self, k: int, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      hidden: torch.Tensor, attn_out: torch.Tensor, q_out: torch.Tensor) -> None:
        """Piece k of forward, of num_hidden_layers + 1, as piecewise CUDA graphs capture them
        (runner/piecewise_graph.py): everything between layer k-1's attention and layer k's. The
        first embeds input_ids into hidden; each after it finishes layer k-1 from its attention's
        output, attn_out; each but the last leaves layer k's queries in q_out. hidden, the residual
        stream, is updated in place; the final norm is not a piece's. Without LoRA or prompt
        embeddings, which forward's callers apply around the layers."""
        if k == 0:
            hidden.copy_(self.embed_tokens(input_ids))
        else:
            layer = self.layers[k - 1]
            out = layer.mlp(layer.self_attn.after_attention(attn_out, hidden))
            if out.data_ptr() != hidden.data_ptr():     # (every projection adds its residual in place)
                hidden.copy_(out)
        if k < len(self.layers):
            self.layers[k].self_attn.before_attention(hidden, positions, slot_mapping, q_out)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden] -> [T, vocab] (every rank's, under tensor parallelism); into `out` when given."""
        return self.lm_head.logits(hidden, out)
