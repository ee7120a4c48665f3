"""vLLM's `tokenizer` option (`--tokenizer`): a checkpoint folder without tokenizer files runs text
prompts and chats with another folder's tokenizer and chat template, exactly as the same weights
beside their own; a folder without tokenizer.json, or a tokenizer larger than the model's
vocabulary, is refused at start-up."""
import json
import os
import shutil

import pytest
from tokenizers import Tokenizer

from mini_engine import LLM, SamplingParams
from mini_engine.config import EngineConfig
from tests.server.conftest import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The tiny served model, and its weights and config.json alone in another folder."""
    whole = write_tiny_model(str(tmp_path_factory.mktemp("with-tokenizer")))
    weights = str(tmp_path_factory.mktemp("weights-only"))
    for name in os.listdir(whole):
        if name.endswith(".safetensors") or name == "config.json":
            shutil.copy(os.path.join(whole, name), weights)
    return whole, weights


def test_weights_without_a_tokenizer_run_text_with_another_folders(folders):
    whole, weights = folders
    bare = LLM(weights, device="cpu", num_kv_blocks=64)
    assert bare.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer.json"):
        bare.generate(["Hello"], GREEDY, use_tqdm=False)
    borrowed = LLM(weights, device="cpu", num_kv_blocks=64, tokenizer=whole)
    own = LLM(whole, device="cpu", num_kv_blocks=64)
    prompts = ["The quick brown fox", "Größe"]
    got = borrowed.generate(prompts, GREEDY, use_tqdm=False)
    expected = own.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    conversation = [{"role": "user", "content": "Hi!"}]
    assert borrowed.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].text == \
        own.chat(conversation, GREEDY, use_tqdm=False)[0].outputs[0].text


def test_a_tokenizer_folder_without_tokenizer_json_is_refused(folders, tmp_path):
    _, weights = folders
    with pytest.raises(ValueError, match="no tokenizer.json there"):
        EngineConfig(weights, device="cpu", num_kv_blocks=8, tokenizer=str(tmp_path))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(folders, tmp_path):
    whole, weights = folders
    tokenizer = Tokenizer.from_file(os.path.join(whole, "tokenizer.json"))
    vocab_size = json.load(open(os.path.join(weights, "config.json")))["vocab_size"]
    tokenizer.add_tokens([f"extra-{i}" for i in range(vocab_size - tokenizer.get_vocab_size() + 1)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=rf"has token id {vocab_size}, past the model's vocab_size of {vocab_size}"):
        LLM(weights, device="cpu", num_kv_blocks=8, tokenizer=str(tmp_path))


def test_an_empty_tokenizer_is_the_models_own(folders):
    whole, _ = folders
    assert EngineConfig(whole, device="cpu", num_kv_blocks=8, tokenizer="").tokenizer_path == whole


def test_the_server_takes_the_flag():
    from mini_engine.serve import parse_args
    assert parse_args(["--tokenizer", "/some/folder"]).tokenizer == "/some/folder"


def test_without_an_eos_in_config_json_the_tokenizers_is_the_stop(folders, tmp_path):
    """vLLM stops at the tokenizer's eos_token; here config.json's and generation_config.json's come
    first, and the tokenizer's (tokenizer_config.json's eos_token) where neither names one."""
    whole, weights = folders
    config = json.load(open(os.path.join(weights, "config.json")))
    del config["eos_token_id"]
    no_eos = tmp_path / "no-eos"
    shutil.copytree(weights, no_eos)
    (no_eos / "config.json").write_text(json.dumps(config))
    im_end = Tokenizer.from_file(os.path.join(whole, "tokenizer.json")).token_to_id("<|im_end|>")
    assert EngineConfig(str(no_eos), device="cpu", num_kv_blocks=8).model_config.eos_token_ids == ()
    borrowed = EngineConfig(str(no_eos), device="cpu", num_kv_blocks=8, tokenizer=whole)
    assert borrowed.model_config.eos_token_ids == (im_end,)
    llm = LLM(str(no_eos), device="cpu", num_kv_blocks=64, tokenizer=whole)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8, logit_bias={im_end: 100.0}),
                       use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == ([im_end], "stop")
