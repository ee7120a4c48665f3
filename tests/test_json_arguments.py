"""vLLM's JSON CLI arguments given key by key (mini_engine/json_arguments.py), as the server and the
batch runner read them."""
import pytest

from mini_engine.json_arguments import expand_json_arguments
from mini_engine.serve import json_option_flags, parse_args

FLAGS = {"--compilation-config": "--compilation-config", "-cc": "--compilation-config",
         "-O": "--compilation-config", "--hf-overrides": "--hf-overrides"}


def test_keys_one_by_one_equal_the_whole_json():
    args = parse_args(["--speculative-config.method", "ngram", "--speculative-config.num_speculative_tokens=4",
                       "--max-num-seqs", "8"])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4} and args.max_num_seqs == 8
    assert parse_args(["-cc.cudagraph_mode=NONE"]).compilation_config == {"cudagraph_mode": "NONE"}
    assert parse_args(["-cc.max_cudagraph_capture_size", "64"]).compilation_config == {"max_cudagraph_capture_size": 64}


def test_nested_keys_lists_and_json_values():
    args = parse_args(["--hf-overrides.rope_scaling.rope_type", "yarn", "--hf-overrides.rope_scaling.factor", "4.0",
                       "--compilation-config.cudagraph_capture_sizes+", "1",
                       "--compilation-config.cudagraph_capture_sizes+=2,8",
                       "--override-generation-config.temperature", "0.7"])
    assert args.hf_overrides == {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert args.compilation_config == {"cudagraph_capture_sizes": [1, 2, 8]}
    assert args.override_generation_config == {"temperature": 0.7}
    assert parse_args(["--compilation-config.cudagraph_capture_sizes", "[1, 2]"]).compilation_config == {
        "cudagraph_capture_sizes": [1, 2]}


def test_keys_are_merged_over_the_whole_json_wherever_it_stands():
    argv = ["--compilation-config.cudagraph_mode", "NONE", "--port", "9000",
            "--compilation-config", '{"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 8, "x": {"a": 1}}',
            "--compilation-config.x.b", "2"]
    assert expand_json_arguments(argv, FLAGS) == [
        "--port", "9000", "--compilation-config",
        '{"cudagraph_mode": "NONE", "max_cudagraph_capture_size": 8, "x": {"a": 1, "b": 2}}']
    for whole in (["-cc={\"a\": 1}"], ["-cc", '{"a": 1}'], ["-O", '{"a": 1}'], ['-O{"a": 1}']):
        assert expand_json_arguments([*whole, "-cc.b", "2"], FLAGS) == ["--compilation-config", '{"a": 1, "b": 2}']


def test_a_command_line_without_keys_is_left_as_it_is():
    argv = ["--compilation-config", '{"a": 1}', "-O3", "--model", "m.cc.x"]
    assert expand_json_arguments(argv, FLAGS) == argv
    assert parse_args(["-O3"]).optimization_level == 3 and parse_args(["-O3"]).compilation_config is None
    # vLLM's -O is the optimization level, apart from compilation_config: a level and keys together.
    args = parse_args(["-O1", "-cc.max_cudagraph_capture_size", "8"])
    assert args.optimization_level == 1 and args.compilation_config == {"max_cudagraph_capture_size": 8}


@pytest.mark.parametrize("argv, error", [
    (["--compilation-config.cudagraph_mode"], "expected a value after it"),
    (["--compilation-config..mode", "x"], "a key is empty"),
    (["--compilation-config", "3", "--compilation-config.cudagraph_mode", "NONE"], "keys need a JSON object"),
    (["-O.cudagraph_mode=NONE"], "invalid int value"),      # as vLLM's: keys go to -cc
    (["--hf-overrides.a", "1", "--hf-overrides.a.b", "2"], "'a' is already given a value, not keys"),
    (["--hf-overrides.a", "1", "--hf-overrides.a+", "2"], "not a list"),
])
def test_bad_keys_are_the_parsers_errors(argv, error, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert error in capsys.readouterr().err


def test_every_json_engine_option_takes_keys():
    flags = json_option_flags()
    assert {"--compilation-config", "-cc", "--speculative-config", "--hf-overrides",
            "--override-generation-config", "--pooler-config"} <= set(flags) and "-O" not in flags
    assert set(flags.values()) == {"--compilation-config", "--speculative-config", "--hf-overrides",
                                   "--override-generation-config", "--pooler-config"}


def test_the_batch_runner_takes_keys_too(tmp_path):
    from mini_engine.run_batch import parse_args as batch_args
    requests = tmp_path / "in.jsonl"
    requests.write_text("")
    args = batch_args(["-i", str(requests), "-o", str(tmp_path / "out.jsonl"), "--speculative-config.method", "ngram",
                       "--speculative-config.num_speculative_tokens", "2"])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}


def test_the_last_whole_value_counts_as_argparse_would_take_it():
    argv = ["--compilation-config", '{"a": 1}', "--compilation-config", '{"b": 2}', "-cc.c", "3"]
    assert expand_json_arguments(argv, FLAGS) == ["--compilation-config", '{"a": 1}', "--compilation-config",
                                                  '{"b": 2, "c": 3}']
    assert parse_args(argv).compilation_config == {"b": 2, "c": 3}
    # An attached short value keeps an "=" of its own; options after "--" stay positional.
    assert expand_json_arguments(['-O{"x": "a=b"}', "-cc.y", "1", "--", "-cc.z"], FLAGS) == [
        "--compilation-config", '{"x": "a=b", "y": 1}', "--", "-cc.z"]


def test_abbreviated_flags_are_refused(capsys):
    """argparse would take `--compilation-conf` for `--compilation-config`, which the keys' merge
    cannot see: as vLLM's parser, this one takes no abbreviations."""
    with pytest.raises(SystemExit):
        parse_args(["--compilation-conf", '{"a": 1}', "-cc.c", "3"])
    assert "unrecognized arguments" in capsys.readouterr().err
