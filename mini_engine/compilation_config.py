"""vLLM's compilation_config, for the part of it that a mini_engine run has: its CUDA graphs.
mini_engine compiles nothing with torch.compile, so vLLM's compile settings are read and ignored
(with a warning), and its optimization levels (-O, EngineConfig.optimization_level) set only the
default cudagraph_mode: -O0 none, -O1 PIECEWISE, -O2 and -O3 FULL_AND_PIECEWISE
(OPTIMIZATION_LEVEL_MODES).

cudagraph_mode, as vLLM's:
- "FULL_AND_PIECEWISE" (the default, as vLLM's): each decode-only step replays a graph of its whole
  step (runner/cuda_graph.py); every other step of few enough tokens replays piecewise graphs, the
  forward between attentions, with attention eager (runner/piecewise_graph.py);
- "FULL_DECODE_ONLY": the decode graphs only; other steps run eager;
- "PIECEWISE": piecewise graphs for every step, decode steps too;
- "NONE": no graphs (as enforce_eager). vLLM's "FULL" also captures mixed steps whole: read here as
  FULL_AND_PIECEWISE, with a warning.

Which sizes are captured, as vLLM's three ways of saying it:
- cudagraph_capture_sizes: these sizes (rows of a decode graph, tokens of a piecewise one);
- max_cudagraph_capture_size: the default ladders up to this size;
- neither: the default ladder up to max_num_seqs, and for the piecewise graphs on to
  PIECEWISE_MAX_TOKENS (mixed steps have more tokens than rows: default_piecewise_sizes).
A step pads to the smallest captured size that holds it; a larger one runs eager. Decode graphs
are captured at sizes up to max_num_seqs (no decode step has more rows), piecewise ones up to the
most tokens a step can have (max_num_batched_tokens, and max_num_seqs rows of max_model_len).
Fewer sizes take less start-up time and less memory (benchmarks/NOTES.md, entries 68 and 69, have
what each costs on the H200)."""
import numbers
import os
import sys
import warnings
from dataclasses import dataclass, fields

CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE")
DEFAULT_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"
WITH_DECODE_GRAPHS = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
WITH_PIECEWISE_GRAPHS = ("FULL_AND_PIECEWISE", "PIECEWISE")
# The default piecewise ladder past the decode graphs' sizes: every 16th token count to 256, then
# every PIECEWISE_STEP-th to PIECEWISE_MAX_TOKENS. A mixed step's GPU time reaches an eager step's
# host time (~10 ms on the H200) only at several thousand tokens, but each size is
# num_hidden_layers + 1 more graphs to capture.
PIECEWISE_STEP = 256
PIECEWISE_MAX_TOKENS = 2048
# vLLM's -O levels, as far as they set cudagraph_mode (the rest of what they set is torch.compile's).
OPTIMIZATION_LEVEL_MODES = {0: "NONE", 1: "PIECEWISE", 2: "FULL_AND_PIECEWISE", 3: "FULL_AND_PIECEWISE"}
# vLLM's torch.compile settings (and older spellings of its graph switches): accepted, not used.
TORCH_COMPILE_FIELDS = ("level", "mode", "backend", "compile_sizes", "custom_ops", "splitting_ops", "use_inductor",
                        "inductor_compile_config", "inductor_passes", "pass_config", "compile_mm_encoder",
                        "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "full_cuda_graph", "use_cudagraph",
                        "debug_dump_path", "cache_dir", "compile_cache_save_format", "use_inductor_graph_partition",
                        "cudagraph_specialize_lora", "dynamic_shapes_config", "local_cache_dir", "fast_moe_cold_start")


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, 8, then every 16th size, and max_size itself. Steps of 16 rather than vLLM's 8:
    between two sizes a step pads at most 15 rows, which cost less on the H200 than the start-up
    time and memory of twice the graphs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_size] + list(range(16, max_size, 16))
    return sizes + [max_size]


def default_piecewise_sizes(decode_max: int, top: int) -> list[int]:
    """The decode ladder up to decode_max, then on by 16 to 256 and by PIECEWISE_STEP to top, top
    itself last (PIECEWISE_MAX_TOKENS, or max_cudagraph_capture_size, capped at the most tokens a
    step can have)."""
    sizes = default_capture_sizes(min(decode_max, top))
    on = [*range(16, 257, 16), *range(256 + PIECEWISE_STEP, top + 1, PIECEWISE_STEP)]
    sizes += [n for n in on if sizes[-1] < n <= top]
    return sizes if sizes[-1] == top else sizes + [top]


def padded_size(sizes: tuple[int, ...] | list[int], num_rows: int) -> int | None:
    """The smallest of the ascending sizes that holds num_rows: the captured size a decode step of
    num_rows pads to; None above the largest."""
    return next((size for size in sizes if size >= num_rows), None)


def _warn(message: str) -> None:
    """A warning shown at the caller's line: the first frame outside mini_engine, the dataclass
    __init__ that called into it and runpy, as Python 3.12's skip_file_prefixes would; the engine's
    own line where there is none (a run of `python -m mini_engine...`)."""
    package, level = os.path.dirname(os.path.abspath(__file__)) + os.sep, 1
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith((package, "<frozen"))
                                 or (frame.f_code.co_filename == "<string>" and frame.f_code.co_name == "__init__")):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level + 1 if frame is not None else 2)     # (1 would be this function)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_sizes(sizes, name: str) -> list[int]:
    if not isinstance(sizes, (list, tuple)) or not all(_is_int(s) and s >= 1 for s in sizes):
        raise ValueError(f"{name} must be a list of integers >= 1, got {sizes!r}")
    return sorted(set(int(s) for s in sizes))


def _check_max_size(value, name: str) -> int:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


@dataclass(slots=True)
class CompilationConfig:
    """As vLLM's (vllm.config.CompilationConfig), its CUDA-graph fields: cudagraph_mode (one of
    CUDAGRAPH_MODES; vLLM's "FULL" is read as "FULL_AND_PIECEWISE", with a warning);
    cudagraph_capture_sizes; max_cudagraph_capture_size."""
    cudagraph_mode: str = DEFAULT_CUDAGRAPH_MODE
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None

    @classmethod
    def resolve(cls, given: "dict | int | CompilationConfig | None",
                level: int | None = None) -> "CompilationConfig":
        """given as vLLM takes it: a dict of its fields, a CompilationConfig, or (as older vLLMs took
        -O) an int, an optimization level. level: vLLM's optimization level (-O), which sets the
        default cudagraph_mode as vLLM's does (OPTIMIZATION_LEVEL_MODES; the rest of what a level
        sets is torch.compile's); a cudagraph_mode given in `given` wins. Checked here, so that a
        bad value fails before the model loads."""
        if _is_int(given):
            if level is not None:
                raise ValueError("compilation_config is given as an optimization level and optimization_level too: "
                                 "give the level once")
            given, level = None, given
        if level is not None and (not _is_int(level) or not 0 <= level <= 3):
            raise ValueError(f"optimization_level (-O) must be 0 to 3, got {level!r}")
        default_mode = DEFAULT_CUDAGRAPH_MODE if level is None else OPTIMIZATION_LEVEL_MODES[level]
        if given is None:
            return cls(default_mode)
        if isinstance(given, CompilationConfig):
            given = {f.name: getattr(given, f.name) for f in fields(cls)}
        if not isinstance(given, dict):
            raise ValueError(f"compilation_config must be a dict of vLLM's fields (or an optimization level, 0 to "
                             f"3), got {given!r}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(given) - set(known) - set(TORCH_COMPILE_FIELDS))
        if unknown:
            raise ValueError(f"compilation_config: unknown fields {unknown}; this engine takes {known} "
                             f"(and ignores vLLM's torch.compile fields)")
        ignored = sorted(set(given) & set(TORCH_COMPILE_FIELDS))
        if ignored:
            _warn(f"compilation_config: {ignored} are vLLM's torch.compile settings, which mini_engine does not "
                  "use (it has no torch.compile); ignored")
        mode = given.get("cudagraph_mode")
        mode = default_mode if mode is None else str(mode).upper()
        if mode == "FULL":
            _warn("compilation_config: cudagraph_mode FULL also captures steps with prompt tokens whole in vLLM; "
                  "mini_engine captures those piecewise, attention eager (FULL_AND_PIECEWISE)")
            mode = "FULL_AND_PIECEWISE"
        elif mode not in CUDAGRAPH_MODES:
            raise ValueError(f"compilation_config: cudagraph_mode must be one of {CUDAGRAPH_MODES} or FULL, "
                             f"got {given.get('cudagraph_mode')!r}")
        return cls(mode).merged(given.get("cudagraph_capture_sizes"), given.get("max_cudagraph_capture_size"),
                                "compilation_config: ")

    def merged(self, capture_sizes: list[int] | None, max_capture_size: int | None,
               where: str = "") -> "CompilationConfig":
        """This config with cudagraph_capture_sizes and max_cudagraph_capture_size given apart from
        it (EngineConfig's own: vLLM's --cudagraph-capture-sizes and --max-cudagraph-capture-size),
        each of which may be given there or here, not both. where: how errors name them."""
        for name, value in (("cudagraph_capture_sizes", capture_sizes),
                            ("max_cudagraph_capture_size", max_capture_size)):
            if value is not None and getattr(self, name) is not None:
                raise ValueError(f"{name} is given both on its own and in compilation_config: give it once")
        if capture_sizes is not None:
            capture_sizes = _check_sizes(capture_sizes, where + "cudagraph_capture_sizes")
        if max_capture_size is not None:
            max_capture_size = _check_max_size(max_capture_size, where + "max_cudagraph_capture_size")
        return CompilationConfig(self.cudagraph_mode,
                                 self.cudagraph_capture_sizes if capture_sizes is None else capture_sizes,
                                 self.max_cudagraph_capture_size if max_capture_size is None else max_capture_size)

    def capture_sizes(self, max_rows: int, max_rows_name: str = "max_num_seqs") -> tuple[int, ...]:
        """The decode graphs' batch sizes, ascending; () for none. max_rows: the most rows a decode
        step can have (max_rows_name: what sets it, for the warning)."""
        if self.cudagraph_mode not in WITH_DECODE_GRAPHS:
            return ()
        self.check_agreement()
        sizes, max_size = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if sizes is None:
            return tuple(default_capture_sizes(min(max_size or max_rows, max_rows)))
        kept = tuple(s for s in sizes if s <= max_rows)
        dropped = [s for s in sizes if s > max_rows]
        # (In FULL_AND_PIECEWISE they are the piecewise graphs' token counts, unless none is left here.)
        if dropped and (self.cudagraph_mode == "FULL_DECODE_ONLY" or not kept):
            _warn(f"cudagraph_capture_sizes {dropped} are above {max_rows_name}={max_rows}, the most rows a decode "
                  "step has: no decode graph is captured at them" + ("" if kept else " (so none at all)"))
        return kept

    def piecewise_sizes(self, max_num_seqs: int, max_tokens: int,
                        max_tokens_name: str = "max_num_batched_tokens") -> tuple[int, ...]:
        """The piecewise graphs' token counts, ascending; () for none. max_tokens: the most tokens a
        step can have (max_tokens_name: what sets it, for the warning)."""
        if self.cudagraph_mode not in WITH_PIECEWISE_GRAPHS:
            return ()
        self.check_agreement()
        sizes, max_size = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if sizes is not None:
            dropped = [s for s in sizes if s > max_tokens]
            if dropped:
                _warn(f"cudagraph_capture_sizes {dropped} are above {max_tokens_name}={max_tokens}, the most tokens a "
                      "step has: not captured")
            return tuple(s for s in sizes if s <= max_tokens)
        return tuple(default_piecewise_sizes(max_num_seqs, min(max_size or PIECEWISE_MAX_TOKENS, max_tokens)))

    def check_agreement(self) -> None:
        sizes, max_size = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if sizes is not None and max_size is not None and (not sizes or sizes[-1] != max_size):
            raise ValueError(f"max_cudagraph_capture_size {max_size} is not the largest of cudagraph_capture_sizes "
                             f"{sizes}: give one of them, or both in agreement")
