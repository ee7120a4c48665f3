"""vLLM's compilation_config and its two top-level flags, as far as a mini_engine run has them: which
decode batch sizes are captured as CUDA graphs, and which token counts as piecewise ones. (That a
step pads to the next captured size and a larger one runs eager, with the eager path's tokens, is
checked on CUDA in tests/runner/test_cuda_graph.py and tests/runner/test_piecewise_graph.py.)"""
import dataclasses
import warnings

import pytest
import torch

from mini_engine import CompilationConfig
from mini_engine.compilation_config import PIECEWISE_MAX_TOKENS, default_capture_sizes
from mini_engine.config import EngineConfig
from mini_engine.runner.cuda_graph import CUDAGraphRunner
from mini_engine.runner.model_runner import ModelRunner
from mini_engine.serve import parse_args


def sizes(checkpoint, **kwargs) -> tuple[int, ...]:
    return EngineConfig(checkpoint, device="cpu", **kwargs).cuda_graph_sizes


def pieces(checkpoint, **kwargs) -> tuple[int, ...]:
    return EngineConfig(checkpoint, device="cpu", **kwargs).piecewise_graph_sizes


def test_the_default_ladder_reaches_max_num_seqs(tiny_checkpoint):
    assert sizes(tiny_checkpoint) == tuple(default_capture_sizes(256)) == (1, 2, 4, 8, *range(16, 257, 16))
    assert sizes(tiny_checkpoint, max_num_seqs=20) == (1, 2, 4, 8, 16, 20)
    assert sizes(tiny_checkpoint, compilation_config={}) == sizes(tiny_checkpoint)


@pytest.mark.parametrize("given", [dict(max_cudagraph_capture_size=40),
                                   dict(compilation_config={"max_cudagraph_capture_size": 40}),
                                   dict(compilation_config=CompilationConfig(max_cudagraph_capture_size=40))])
def test_max_capture_size_cuts_the_ladder(tiny_checkpoint, given):
    assert sizes(tiny_checkpoint, **given) == (1, 2, 4, 8, 16, 32, 40)


def test_max_capture_size_above_max_num_seqs_stops_there(tiny_checkpoint):
    assert sizes(tiny_checkpoint, max_num_seqs=24, max_cudagraph_capture_size=512) == (1, 2, 4, 8, 16, 24)


def test_no_decode_graph_holds_more_rows_than_a_step_has_tokens(tiny_checkpoint):
    """A decode row is a token: with max_num_batched_tokens under max_num_seqs, the ladder ends at
    the budget (it went on to max_num_seqs, graphs no step could use), as vLLM's."""
    assert sizes(tiny_checkpoint, max_num_seqs=64, max_num_batched_tokens=20) == (1, 2, 4, 8, 16, 20)
    given = dict(max_num_seqs=64, max_num_batched_tokens=20, cudagraph_capture_sizes=[4, 32],
                 compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    with pytest.warns(UserWarning, match=r"\[32\] are above max_num_batched_tokens=20"):
        assert sizes(tiny_checkpoint, **given) == (4,)


@pytest.mark.parametrize("given", [dict(cudagraph_capture_sizes=[8, 1, 4, 4]),
                                   dict(compilation_config={"cudagraph_capture_sizes": (4, 8, 1)}),
                                   dict(cudagraph_capture_sizes=[1, 4, 8], max_cudagraph_capture_size=8)])
def test_given_sizes_are_captured_sorted_once(tiny_checkpoint, given):
    assert sizes(tiny_checkpoint, **given) == (1, 4, 8)


def test_sizes_above_max_num_seqs_are_dropped_with_a_warning(tiny_checkpoint):
    given = dict(max_num_seqs=16, cudagraph_capture_sizes=[2, 16, 32, 64])
    with pytest.warns(UserWarning, match=r"\[32, 64\] are above max_num_seqs=16"):
        assert sizes(tiny_checkpoint, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}, **given) == (2, 16)
    # With piecewise graphs (the default) they are those graphs' token counts.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sizes(tiny_checkpoint, **given) == (2, 16)
        assert pieces(tiny_checkpoint, **given) == (2, 16, 32, 64)
    with pytest.warns(UserWarning, match=r"\[64\] are above max_num_batched_tokens=40"):
        assert pieces(tiny_checkpoint, max_num_batched_tokens=40, **given) == (2, 16, 32)
    # The bound named is the one that holds: 16 rows of 2 tokens here.
    with pytest.warns(UserWarning, match=r"\[64\] are above max_num_seqs x max_model_len=32"):
        assert pieces(tiny_checkpoint, max_model_len=2, **given) == (2, 16, 32)
    # Where no given size is a decode batch, a warning says no decode graph is captured.
    with pytest.warns(UserWarning, match=r"\[32, 64\] are above max_num_seqs=16.*so none at all"):
        assert sizes(tiny_checkpoint, max_num_seqs=16, cudagraph_capture_sizes=[32, 64]) == ()


def test_the_piecewise_ladder_goes_on_past_max_num_seqs(tiny_checkpoint):
    """Mixed steps have more tokens than rows: the default piecewise ladder is the decode one, then
    every 16th count to 256 and every 256th to PIECEWISE_MAX_TOKENS, ending at
    max_num_batched_tokens where that is lower."""
    ladder = (*default_capture_sizes(256), *range(512, PIECEWISE_MAX_TOKENS + 1, 256))
    assert pieces(tiny_checkpoint) == ladder and ladder[-1] == 2048
    assert pieces(tiny_checkpoint, max_num_seqs=20) == (1, 2, 4, 8, 16, 20, *range(32, 257, 16), *ladder[20:])
    assert pieces(tiny_checkpoint, max_num_batched_tokens=1000) == (*ladder[:22], 1000)
    assert pieces(tiny_checkpoint, max_num_seqs=8, max_num_batched_tokens=8) == (1, 2, 4, 8)
    # max_cudagraph_capture_size ends both ladders (as vLLM's), the piecewise one past max_num_seqs,
    # and keeps the piecewise ladder's spacing.
    assert pieces(tiny_checkpoint, max_num_seqs=8, max_cudagraph_capture_size=40) == (1, 2, 4, 8, 16, 32, 40)
    assert sizes(tiny_checkpoint, max_num_seqs=8, max_cudagraph_capture_size=40) == (1, 2, 4, 8)
    assert pieces(tiny_checkpoint, max_cudagraph_capture_size=2048) == ladder
    assert pieces(tiny_checkpoint, max_cudagraph_capture_size=3000) == (*ladder, 2304, 2560, 2816, 3000)
    # No step has more tokens than max_num_seqs rows of max_model_len.
    assert pieces(tiny_checkpoint, max_num_seqs=2, max_model_len=100) == (1, 2, *range(16, 193, 16), 200)


def test_no_graphs(tiny_checkpoint):
    assert sizes(tiny_checkpoint, cudagraph_capture_sizes=[]) == ()
    assert pieces(tiny_checkpoint, cudagraph_capture_sizes=[]) == ()
    assert sizes(tiny_checkpoint, compilation_config={"cudagraph_mode": "none"}) == ()
    assert pieces(tiny_checkpoint, compilation_config={"cudagraph_mode": "none"}) == ()


@pytest.mark.parametrize("mode, decode, piecewise", [("FULL_AND_PIECEWISE", True, True),
                                                     ("full_decode_only", True, False), ("PIECEWISE", False, True)])
def test_each_mode_captures_its_graphs(tiny_checkpoint, mode, decode, piecewise):
    given = dict(max_num_seqs=8, max_num_batched_tokens=16, compilation_config={"cudagraph_mode": mode})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sizes(tiny_checkpoint, **given) == ((1, 2, 4, 8) if decode else ())
        assert pieces(tiny_checkpoint, **given) == ((1, 2, 4, 8, 16) if piecewise else ())


def test_vllms_full_mode_captures_mixed_steps_piecewise_here(tiny_checkpoint):
    with pytest.warns(UserWarning, match="captures those piecewise"):
        config = EngineConfig(tiny_checkpoint, device="cpu", max_num_seqs=8, max_num_batched_tokens=16,
                              compilation_config={"cudagraph_mode": "FULL"})
    assert config.cuda_graph_sizes == (1, 2, 4, 8) and config.piecewise_graph_sizes == (1, 2, 4, 8, 16)


def test_torch_compile_settings_are_ignored_with_a_warning(tiny_checkpoint):
    with pytest.warns(UserWarning, match=r"\['custom_ops', 'level'\] are vLLM's torch.compile settings") as shown:
        got = sizes(tiny_checkpoint, max_num_seqs=8, compilation_config={"level": 3, "custom_ops": ["all"],
                                                                          "max_cudagraph_capture_size": 4})
    assert got == (1, 2, 4)
    assert shown[0].filename == __file__         # the warning points at the caller's line, not at the engine's


@pytest.mark.parametrize("as_level", ["optimization_level", "compilation_config"])
def test_an_optimization_level_as_vllms_dash_o(tiny_checkpoint, as_level):
    """vLLM's -O0 turns CUDA graphs off, -O1 captures piecewise graphs only, -O2 and -O3 both kinds
    (what else they set is torch.compile's): as optimization_level (vLLM's), or as compilation_config
    given a number (older vLLMs' -O)."""
    given = dict(max_num_seqs=8, max_num_batched_tokens=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sizes(tiny_checkpoint, **given, **{as_level: 0}) == pieces(tiny_checkpoint, **given,
                                                                           **{as_level: 0}) == ()
        assert sizes(tiny_checkpoint, **given, **{as_level: 1}) == ()
        assert pieces(tiny_checkpoint, **given, **{as_level: 1}) == (1, 2, 4, 8, 16)
        for level in (2, 3):
            assert sizes(tiny_checkpoint, **given, **{as_level: level}) == (1, 2, 4, 8)
            assert pieces(tiny_checkpoint, **given, **{as_level: level}) == (1, 2, 4, 8, 16)
    with pytest.raises(ValueError, match="must be 0 to 3, got 4"):
        sizes(tiny_checkpoint, **{as_level: 4})


def test_a_levels_mode_is_a_default_that_compilation_config_overrides(tiny_checkpoint):
    """As vLLM's: what the user sets wins over the level's defaults, and the level's mode holds for
    what the user leaves (-O1 -cc.max_cudagraph_capture_size=8 is piecewise graphs up to 8)."""
    given = dict(max_num_seqs=8, max_num_batched_tokens=16, optimization_level=1)
    assert sizes(tiny_checkpoint, **given, compilation_config={"max_cudagraph_capture_size": 4}) == ()
    assert pieces(tiny_checkpoint, **given, compilation_config={"max_cudagraph_capture_size": 4}) == (1, 2, 4)
    both = dict(given, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})
    assert sizes(tiny_checkpoint, **both) == (1, 2, 4, 8) and pieces(tiny_checkpoint, **both) == ()
    with pytest.raises(ValueError, match="give the level once"):
        sizes(tiny_checkpoint, **dict(given, compilation_config=2))


def test_a_valid_config_warns_of_nothing(tiny_checkpoint):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sizes(tiny_checkpoint, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY",
                                                   "cudagraph_capture_sizes": [1, 2], "max_cudagraph_capture_size": 2})


@pytest.mark.parametrize("given, error", [
    (dict(compilation_config={"cudagraph_mode": "SOMETIMES"}), "cudagraph_mode must be one of"),
    (dict(compilation_config={"capture_sizes": [1]}), r"unknown fields \['capture_sizes'\]"),
    (dict(compilation_config="FULL"), "must be a dict"),
    (dict(cudagraph_capture_sizes=[0, 4]), "cudagraph_capture_sizes must be a list of integers >= 1"),
    (dict(cudagraph_capture_sizes=[1.5]), "must be a list of integers"),
    (dict(cudagraph_capture_sizes=[True]), "must be a list of integers"),
    (dict(compilation_config={"cudagraph_capture_sizes": 8}), "must be a list of integers"),
    (dict(max_cudagraph_capture_size=0), "max_cudagraph_capture_size must be an integer >= 1"),
    (dict(compilation_config={"max_cudagraph_capture_size": 8.0}), "must be an integer >= 1"),
    (dict(cudagraph_capture_sizes=[1, 2, 4], max_cudagraph_capture_size=8), "is not the largest of"),
    (dict(cudagraph_capture_sizes=[], max_cudagraph_capture_size=8), "is not the largest of"),
    (dict(cudagraph_capture_sizes=[1], compilation_config={"cudagraph_capture_sizes": [1]}), "give it once"),
    (dict(max_cudagraph_capture_size=8, compilation_config={"max_cudagraph_capture_size": 8}), "give it once"),
])
def test_bad_values_fail_before_the_model_loads(tiny_checkpoint, given, error):
    with pytest.raises(ValueError, match=error):
        sizes(tiny_checkpoint, **given)


def test_a_copy_of_the_config_keeps_its_sizes(tiny_checkpoint):
    """The draft model's config is the target's, replaced (enforce_eager until it shares the pool):
    its sizes are worked out again from the same options."""
    config = EngineConfig(tiny_checkpoint, device="cpu", max_cudagraph_capture_size=24)
    copy = dataclasses.replace(config, enforce_eager=True)
    assert copy.cuda_graph_sizes == config.cuda_graph_sizes == (1, 2, 4, 8, 16, 24)
    assert copy.piecewise_graph_sizes == config.piecewise_graph_sizes == (1, 2, 4, 8, 16, 24)


def test_the_server_takes_vllms_flags():
    args = parse_args(["--cudagraph-capture-sizes", "1", "2", "4", "--max-cudagraph-capture-size", "4",
                       "--compilation-config", '{"cudagraph_mode": "FULL_DECODE_ONLY"}'])
    assert args.cudagraph_capture_sizes == [1, 2, 4] and args.max_cudagraph_capture_size == 4
    assert args.compilation_config == {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert parse_args(["-O3"]).optimization_level == 3
    given = parse_args(["-cc", '{"max_cudagraph_capture_size": 8}']).compilation_config
    assert given == {"max_cudagraph_capture_size": 8}
    assert parse_args([]).cudagraph_capture_sizes is None


def test_a_step_pads_to_the_next_captured_size_and_a_larger_one_has_no_graph(tiny_checkpoint):
    runner = ModelRunner(EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8, max_model_len=100))
    graphs = CUDAGraphRunner(runner.model, (3, 10), torch.device("cpu"), runner.sampled_tokens,
                             runner.take_prev_tokens, None)
    assert [graphs.graph_size(n, 1) for n in (1, 3, 4, 10, 11, 16)] == [3, 3, 10, 10, None, None]
    assert graphs.graph_size(2, 2) is None       # a row of two tokens: not a decode-only step
