"""A checkpoint's generation_config.json sets the sampling parameters a request leaves unset, as
vLLM's --generation-config auto (its default) does: Qwen3's asks for temperature 0.6, top_p 0.95,
top_k 20, where SamplingParams alone would sample at temperature 1 from the whole vocabulary."""
import json
import os
import shutil

import pytest

from mini_engine.config import EngineConfig
from mini_engine.sampling_params import SamplingParams

QWEN3_GENERATION_CONFIG = {"bos_token_id": 1, "do_sample": True, "eos_token_id": [2, 3], "pad_token_id": 1,
                           "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def with_generation_config(tiny_checkpoint: str, folder, generation_config: dict) -> str:
    path = str(folder)
    shutil.copytree(tiny_checkpoint, path, dirs_exist_ok=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation_config, f)
    return path


def test_auto_takes_the_checkpoints_sampling_fields(tiny_checkpoint, tmp_path):
    path = with_generation_config(tiny_checkpoint, tmp_path, QWEN3_GENERATION_CONFIG)
    config = EngineConfig(path, device="cpu", num_kv_blocks=8)
    assert config.sampling_defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert config.model_config.eos_token_ids == (2, 3)
    params = config.default_sampling_params(max_tokens=5)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.6, 20, 0.95, 5)
    # What the caller gives wins over the checkpoint's.
    params = config.default_sampling_params(temperature=0.0, top_k=-1)
    assert (params.temperature, params.top_k, params.top_p) == (0.0, -1, 0.95)


def test_none_and_a_folder(tiny_checkpoint, tmp_path):
    path = with_generation_config(tiny_checkpoint, tmp_path / "model", QWEN3_GENERATION_CONFIG)
    config = EngineConfig(path, device="cpu", num_kv_blocks=8, generation_config="none")
    assert config.sampling_defaults == {}
    assert config.default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    config = EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8, generation_config=str(other))
    assert config.sampling_defaults == {"temperature": 0.3}
    # A checkpoint without the file: SamplingParams' own defaults.
    assert EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8).sampling_defaults == {}


def test_bad_generation_config_is_a_clear_error(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"generation_config must be 'auto', 'none' \(or vLLM's 'vllm'\) or a folder"):
        EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8, generation_config="nonsense")
    path = with_generation_config(tiny_checkpoint, tmp_path, {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be in \(0, 1\]"):
        EngineConfig(path, device="cpu", num_kv_blocks=8)
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json: not a JSON object"):
        EngineConfig(path, device="cpu", num_kv_blocks=8)


def test_generate_without_params_samples_as_the_generation_config_says(tiny_checkpoint, tmp_path):
    from mini_engine import LLM
    greedy = with_generation_config(tiny_checkpoint, tmp_path / "greedy", {"temperature": 0.0})
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    llm = LLM(greedy, device="cpu", num_kv_blocks=16)
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0), use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)] == expected
    # The same checkpoint read with generation_config="none" samples at temperature 1.
    llm = LLM(greedy, device="cpu", num_kv_blocks=16, generation_config="none")
    assert llm.get_default_sampling_params() == SamplingParams()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)] != expected


def test_repetition_penalty_and_min_p_are_read_as_vllm_reads_them(tiny_checkpoint, tmp_path):
    """vLLM's get_diff_sampling_param also takes repetition_penalty and min_p (Qwen2.5's
    generation_config.json asks for repetition_penalty 1.05)."""
    path = with_generation_config(tiny_checkpoint, tmp_path, {"repetition_penalty": 1.05, "min_p": 0.05,
                                                              "temperature": 0.7})
    config = EngineConfig(path, device="cpu", num_kv_blocks=8)
    assert config.sampling_defaults == {"repetition_penalty": 1.05, "min_p": 0.05, "temperature": 0.7}
    params = config.default_sampling_params(repetition_penalty=1.0)
    assert (params.repetition_penalty, params.min_p, params.temperature) == (1.0, 0.05, 0.7)
    bad = with_generation_config(tiny_checkpoint, tmp_path / "bad", {"repetition_penalty": 0})
    with pytest.raises(ValueError, match="generation_config.json: repetition_penalty must be"):
        EngineConfig(bad, device="cpu", num_kv_blocks=8)


def test_overrides_replace_the_checkpoints_defaults_or_stand_alone(tiny_checkpoint, tmp_path):
    """vLLM's --override-generation-config: merged over generation_config's fields, or with "none"
    (vLLM's "vllm") the only defaults."""
    path = with_generation_config(tiny_checkpoint, tmp_path, QWEN3_GENERATION_CONFIG)
    config = EngineConfig(path, device="cpu", num_kv_blocks=8, override_generation_config={"temperature": 0.7,
                                                                                          "min_p": 0.05})
    assert config.sampling_defaults == {"temperature": 0.7, "top_k": 20, "top_p": 0.95, "min_p": 0.05}
    params = config.default_sampling_params(top_p=0.5)
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.7, 20, 0.5, 0.05)
    for none in ("none", "vllm"):
        config = EngineConfig(path, device="cpu", num_kv_blocks=8, generation_config=none,
                              override_generation_config={"top_k": 5})
        assert config.sampling_defaults == {"top_k": 5}


@pytest.mark.parametrize("overrides,match", [
    ({"max_tokens": 8}, r"sets \['max_tokens'\]; it takes the sampling defaults"),
    ({"max_new_tokens": 0}, "override_generation_config: max_tokens must be"),
    ({"temperature": -1}, "override_generation_config: temperature must be"),
    ({"top_k": "many"}, "override_generation_config: "),
    ([("temperature", 1.0)], "override_generation_config must be a dict"),
])
def test_bad_overrides_are_clear_errors(tiny_checkpoint, overrides, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8, override_generation_config=overrides)


def test_the_server_takes_the_flag_as_json():
    from mini_engine.serve import parse_args
    args = parse_args(["--override-generation-config", '{"temperature": 0.2}', "--generation-config", "vllm"])
    assert (args.override_generation_config, args.generation_config) == ({"temperature": 0.2}, "vllm")


def test_an_override_may_replace_a_value_the_file_gets_wrong(tiny_checkpoint, tmp_path):
    path = with_generation_config(tiny_checkpoint, tmp_path, {"temperature": "hot", "top_k": 20})
    with pytest.raises(ValueError, match="generation_config.json: "):
        EngineConfig(path, device="cpu", num_kv_blocks=8)
    config = EngineConfig(path, device="cpu", num_kv_blocks=8, override_generation_config={"temperature": 0.3})
    assert config.sampling_defaults == {"temperature": 0.3, "top_k": 20}


@pytest.mark.parametrize("field", ["top_k", "top_p"])
def test_a_bool_is_no_number_of_tokens_or_mass(tiny_checkpoint, field):
    """JSON's true would pass Python's int check (top_k=True sampled as top-1)."""
    with pytest.raises(ValueError, match=f"override_generation_config: {field} must be"):
        EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8, override_generation_config={field: True})
    with pytest.raises(ValueError, match=f"{field} must be"):
        SamplingParams(**{field: True})


def test_the_draft_model_keeps_no_override(tiny_checkpoint):
    config = EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8, override_generation_config={"top_k": 3},
                          speculative_config={"method": "draft_model", "model": tiny_checkpoint,
                                              "num_speculative_tokens": 2})
    assert config.sampling_defaults == {"top_k": 3} and config.draft_model_config().sampling_defaults == {}


def test_max_new_tokens_is_the_offline_default_and_the_servers_cap(tiny_checkpoint, tmp_path):
    """vLLM reads generation_config's max_new_tokens (a file's, or --override-generation-config's) as
    LLM's default max_tokens, and its server caps every request's max_tokens with it."""
    from types import SimpleNamespace

    from mini_engine.server.app import DEFAULT_COMPLETION_MAX_TOKENS, OpenAIServer
    path = with_generation_config(tiny_checkpoint, tmp_path, {"temperature": 0.6, "max_new_tokens": 12})
    config = EngineConfig(path, device="cpu", num_kv_blocks=8)
    assert config.sampling_defaults == {"temperature": 0.6, "max_tokens": 12} and config.max_new_tokens == 12
    assert config.default_sampling_params().max_tokens == 12
    assert config.default_sampling_params(max_tokens=40).max_tokens == 40     # offline, what a caller sets stands
    server = SimpleNamespace(config=config)
    cap = OpenAIServer.max_tokens
    assert [cap(server, asked, lambda: 30) for asked in (None, 5, 12, 100)] == [12, 5, 12, 12]
    overridden = EngineConfig(path, device="cpu", num_kv_blocks=8, override_generation_config={"max_new_tokens": 40})
    assert cap(SimpleNamespace(config=overridden), None, lambda: DEFAULT_COMPLETION_MAX_TOKENS) == 16
    plain = SimpleNamespace(config=EngineConfig(tiny_checkpoint, device="cpu", num_kv_blocks=8))
    assert plain.config.max_new_tokens is None and cap(plain, 100, lambda: 16) == 100
