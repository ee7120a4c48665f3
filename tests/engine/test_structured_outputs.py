"""Structured outputs: every token a grammar's matcher allows, the whole output what the grammar
asks (a choice, a regex, a JSON schema), the rows beside untouched, whatever the scheduler does
(async or not, preemption, n completions); bad specs refused before anything runs."""
import json
import re

import pytest
import torch

from mini_engine import LLM, SamplingParams
from mini_engine.layers.penalties import apply_grammar_bitmask
from mini_engine.structured_outputs import StructuredOutputsParams

pytest.importorskip("xgrammar")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CHOICES = ["yes", "no", "maybe so", "Größe 😀"]
REGEX = r"[0-9]{3}-[a-z]{2}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["ok", "kind"], "additionalProperties": False}
PROMPTS = ["Hello", "Größe 你好", "The quick brown fox", "def add(a, b):"]


@pytest.fixture(scope="module")
def llm(tokenized_model):
    return LLM(tokenized_model, device=DEVICE, num_kv_blocks=256)


def structured(kind: str, **params) -> SamplingParams:
    spec = {"choice": StructuredOutputsParams(choice=CHOICES), "regex": StructuredOutputsParams(regex=REGEX),
            "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
            "any json": StructuredOutputsParams(json_object=True)}[kind]
    return SamplingParams(**({"temperature": 0, "max_tokens": 40} | params), structured_outputs=spec)


def check(kind: str, text: str, finish_reason: str):
    if kind == "choice":
        assert text in CHOICES and finish_reason == "stop"
    elif kind == "regex":
        assert re.fullmatch(REGEX, text) and finish_reason == "stop"
    elif kind == "json":
        value = json.loads(text)
        assert finish_reason == "stop" and set(value) == {"ok", "kind"}
        assert isinstance(value["ok"], bool) and value["kind"] in ("cat", "dog")


def tokens_allowed(llm, spec: StructuredOutputsParams, token_ids: list[int]) -> bool:
    """Every token of the output, through a fresh matcher of the same grammar."""
    compiler = llm.engine.grammar_compiler
    grammar = compiler.matcher(compiler.compile(spec).result(), sorted(llm.engine.eos_token_ids))
    return all(grammar.accept(t) for t in token_ids)


@pytest.mark.parametrize("kind", ["choice", "regex", "json"])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_outputs_are_what_the_grammar_asks(llm, kind, temperature):
    params = structured(kind, temperature=temperature, seed=7)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        completion = out.outputs[0]
        check(kind, completion.text, completion.finish_reason)
        assert tokens_allowed(llm, params.structured_outputs, completion.token_ids)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_grammar_cut_short_has_only_allowed_tokens(llm):
    """Any JSON object, cut short by max_tokens: every token written is one the grammar allows."""
    params = structured("any json", max_tokens=5)
    completion = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert completion.text.startswith("{") and completion.finish_reason == "length"
    assert tokens_allowed(llm, params.structured_outputs, completion.token_ids)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_rows_beside_a_grammar_are_untouched(tokenized_model, async_scheduling):
    """Structured and plain requests in one batch: each plain output is the one it has alone, and
    each structured output is the one it has alone (a mask reaches its own row only)."""
    llm = LLM(tokenized_model, device=DEVICE, num_kv_blocks=256, async_scheduling=async_scheduling)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kinds = ["choice", "regex", "json", None]
    params = [structured(kind) if kind else plain for kind in kinds]
    together = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, p, out in zip(PROMPTS, params, together):
        alone = llm.generate(prompt, p, use_tqdm=False)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids
    for kind, out in zip(kinds, together):
        if kind:
            check(kind, out.outputs[0].text, out.outputs[0].finish_reason)
    assert not llm.engine.needs_last_token and llm.engine.in_flight is None


def test_preemption_keeps_the_grammars_place(tokenized_model):
    """A pool too small for the batch preempts and recomputes sequences, all structured here: each
    output is still the one an unhurried engine gives (seeded draws, so the same tokens; in fp32,
    since a recompute's bf16 sums on CUDA may tip a near-tie of a draw)."""
    roomy = LLM(tokenized_model, device=DEVICE, dtype="float32", num_kv_blocks=256, block_size=16)
    tight = LLM(tokenized_model, device=DEVICE, dtype="float32", num_kv_blocks=12,
                block_size=16)     # CUDA's 64-token blocks would fit all
    prompts = [p * 12 for p in PROMPTS]
    params = [structured("any json", max_tokens=40, temperature=1.0, seed=i) for i in range(len(prompts))]
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.num_preemptions > 0 and got == expected
    assert all(tokens_allowed(tight, params[0].structured_outputs, tokens) for tokens in got)


def test_n_completions_each_follow_the_grammar(llm):
    out = llm.generate("Hello", structured("choice", temperature=5.0, seed=3, n=6), use_tqdm=False)[0]
    assert len(out.outputs) == 6
    for completion in out.outputs:
        check("choice", completion.text, completion.finish_reason)
    assert len({c.text for c in out.outputs}) > 1


def test_a_stop_token_of_the_request_ends_the_grammar(llm):
    """The grammar's end may be a stop token of the request's own, not only EOS."""
    stop = llm.tokenizer.token_to_id("<|endoftext|>")
    params = structured("choice", stop_token_ids=[stop], logit_bias={stop: 100})
    completion = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert completion.text in CHOICES and completion.finish_reason == "stop"
    assert completion.token_ids[-1] == stop


@pytest.mark.parametrize("spec, match", [
    (dict(json={"type": "object", "properties": 5}), "properties must be an object"),
    (dict(regex="(ab"), "parenthesis"),
    (dict(grammar='root ::= "a" |'), "EBNF"),
])
def test_bad_specs_are_refused_before_anything_runs(llm, spec, match):
    """What only the grammar's parser finds: the whole batch refused, nothing left running."""
    params = [SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, structured_outputs=spec)]
    with pytest.raises(ValueError, match=match):
        llm.generate(["Hello", "Hi"], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


@pytest.mark.parametrize("spec, match", [
    (dict(choice=[]), "non-empty list"), (dict(choice="yes"), "non-empty list"),
    (dict(regex="a", choice=["b"]), "exactly one"), (dict(), "exactly one"),
    (dict(json_object="no"), "true or false"), (dict(json=5), "JSON schema"),
])
def test_bad_params_are_refused_when_made(spec, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**spec)
    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=spec)


def test_a_schema_keeps_its_key_order(llm):
    """xgrammar writes an object's properties in the schema's order: a reasoning field before the
    answer stays before it, given as a dict or as text."""
    schema = {"type": "object", "properties": {"reasoning": {"const": "r"}, "answer": {"const": 1}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    for given in (schema, json.dumps(schema)):
        params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(
            json=given, disable_any_whitespace=True))
        assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].text == '{"reasoning": "r", "answer": 1}'


def test_special_tokens_and_ids_past_the_tokenizer_are_never_text(tokenized_model):
    """Inside a JSON string any text may come, but not a special token (<|im_start|>, ...: control
    tokens, which the output's text leaves out), nor an id past the tokenizer's (the model's vocab
    may be larger: Qwen3's 151,936 against 151,669)."""
    from mini_engine.structured_outputs import GrammarCompiler
    from mini_engine.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(tokenized_model)
    size = tokenizer.get_vocab_size()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    end = tokenizer.token_to_id("<|im_end|>")
    compiler = GrammarCompiler(tokenizer, size + 40, [end])
    grammar = compiler.matcher(compiler.compile(StructuredOutputsParams(json={"type": "string"})).result(), [end])
    assert all(grammar.accept(t) for t in tokenizer.encode('"ab').ids)
    bitmask = grammar.next_token_bitmask()
    allowed = {t for t in range(size + 40) if (int(bitmask[t // 32]) >> (t % 32)) & 1}
    assert len(allowed) > size // 2 and special and not allowed & special and max(allowed) < size


def test_a_grammar_whose_end_the_request_bans_ends_without_a_stray_token(llm):
    """min_tokens bans EOS, the grammar's only way on once a choice is written: nothing is left to
    sample, so that draw is dropped and the output ends on the choice (its text whole)."""
    params = structured("choice", min_tokens=8, logprobs=1)
    completion = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert completion.text in CHOICES and completion.finish_reason == "stop"
    assert llm.tokenizer.decode(completion.token_ids) == completion.text
    assert len(completion.logprobs) == len(completion.token_ids)
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_without_a_tokenizer_structured_outputs_are_refused(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, device="cpu", num_kv_blocks=16)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(structured_outputs={"regex": "a"}), use_tqdm=False)


def test_the_bitmask_against_a_loop_over_tokens():
    """apply_grammar_bitmask against its definition, on random bitmasks (negative words too: bit
    31 set) and a vocabulary that ends inside a word."""
    generator = torch.Generator().manual_seed(0)
    vocab, rows = 100, torch.tensor([0, 2, 3])
    logits = torch.randn(4, vocab, generator=generator)
    bitmasks = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 4), generator=generator, dtype=torch.int64).to(torch.int32)
    expected = logits.clone()
    for j, row in enumerate(rows.tolist()):
        for token in range(vocab):
            if not (int(bitmasks[j, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    apply_grammar_bitmask(logits, (rows, bitmasks))
    assert torch.equal(logits, expected) and torch.isinf(logits[0]).any() and not torch.isinf(logits[1]).any()
