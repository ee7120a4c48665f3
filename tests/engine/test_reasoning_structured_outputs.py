"""Structured outputs after the thought (vLLM's reasoning_parser "qwen3"): the output thinks
freely until it writes </think>, then holds to its grammar from the grammar's start; a prompt that
closed the thought (enable_thinking=False) holds it from the first token; without the parser
nothing changes. The random model ends its thought where a logit_bias on </think> makes it."""
import pytest
import torch

from mini_engine import LLM, SamplingParams
from mini_engine.reasoning import THINK_END, THINK_START, ThinkTokens
from mini_engine.structured_outputs import StructuredOutputsParams
from mini_engine.tokenizer import load_tokenizer
from tests.server.conftest import write_tiny_model

pytest.importorskip("xgrammar")

CHOICES = ["yes", "no", "maybe so"]
OPENED, CLOSED = "\n<think>\n", "\n<think>\n\n</think>\n\n"      # prompt ends as Qwen3's templates write them
PROMPTS = ["Hello", "Größe 你好", "The quick brown fox", "def add(a, b):"] * 2


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory) -> str:
    """The engine tests' tiny model, with Qwen3's two tags as tokens of their own."""
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3-thinking")), added_tokens=(THINK_START, THINK_END))


@pytest.fixture(scope="module")
def think(thinking_model) -> ThinkTokens:
    return ThinkTokens.from_tokenizer(load_tokenizer(thinking_model))


def reasoning_llm(model: str, **kwargs) -> LLM:
    # fp32 and 16-token blocks, so that a tight pool preempts and a recompute draws the same tokens.
    return LLM(model, device="cpu", dtype="float32", block_size=16, reasoning_parser="qwen3",
               **({"num_kv_blocks": 256} | kwargs))


def choice_params(think: ThinkTokens, seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(**({"temperature": 1.0, "seed": seed, "max_tokens": 60, "logit_bias": {think.end: 8}}
                             | kwargs), structured_outputs=StructuredOutputsParams(choice=CHOICES))


def grammar_allows(llm: LLM, token_ids: list[int]) -> bool:
    compiler = llm.engine.grammar_compiler
    spec = StructuredOutputsParams(choice=CHOICES)
    grammar = compiler.matcher(compiler.compile(spec).result(), sorted(llm.engine.eos_token_ids))
    return all(grammar.accept(t) for t in token_ids)


def answers(tokens: list[int], think: ThinkTokens) -> list[int]:
    """What follows the thought: the tokens after the first </think>."""
    assert think.end in tokens, "the thought did not end"
    return tokens[tokens.index(think.end) + 1:]


def test_a_thought_the_prompt_opened_is_free_and_the_answer_holds_to_the_grammar(thinking_model, think):
    """Each output: a thought of any tokens, </think>, then one of the choices and EOS. The same
    outputs from a pool so small that sequences are preempted and recomputed mid-thought."""
    roomy = reasoning_llm(thinking_model)
    prompts = [p * 8 + OPENED for p in PROMPTS]
    params = [choice_params(think, seed) for seed in range(len(prompts))]
    outputs = [o.outputs[0] for o in roomy.generate(prompts, params, use_tqdm=False)]
    free_thoughts = 0
    for completion in outputs:
        answer = answers(completion.token_ids, think)
        assert completion.finish_reason == "stop"
        assert roomy.tokenizer.decode(answer) in CHOICES and grammar_allows(roomy, answer)
        thought = completion.token_ids[:completion.token_ids.index(think.end)]
        free_thoughts += bool(thought) and not grammar_allows(roomy, thought[:1])
    assert free_thoughts >= 3, "the thoughts should begin with tokens the grammar would not allow"
    tight = reasoning_llm(thinking_model, num_kv_blocks=8)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)] == \
        [c.token_ids for c in outputs]
    assert tight.engine.num_preemptions > 0
    assert tight.engine.num_free_blocks == tight.engine.block_manager.num_blocks


def test_the_first_token_may_open_a_thought(thinking_model, think):
    """A prompt with no thought of its own: <think> may come first, beside what the grammar allows
    (the biases make both tags likelier than anything else wherever they may come)."""
    llm = reasoning_llm(thinking_model)
    params = [choice_params(think, seed, logit_bias={think.start: 100, think.end: 100}) for seed in range(4)]
    for out in llm.generate(PROMPTS[:4], params, use_tqdm=False):
        tokens = out.outputs[0].token_ids
        assert tokens[0] == think.start and llm.tokenizer.decode(answers(tokens, think)) in CHOICES
    # Unbiased, an output either opens a thought first or is held from its first token.
    for out in llm.generate(PROMPTS, [choice_params(think, seed, logit_bias={}) for seed in range(len(PROMPTS))],
                            use_tqdm=False):
        tokens = out.outputs[0].token_ids
        if tokens[0] != think.start:
            assert grammar_allows(llm, tokens) and llm.tokenizer.decode(tokens) in CHOICES


@pytest.mark.parametrize("prompt_end, bias", [("", {"start": -100}), (CLOSED, {})], ids=["no thought", "closed"])
def test_an_output_that_does_not_think_is_held_from_its_first_token(thinking_model, think, prompt_end, bias):
    """One that does not open a thought (the bias keeps <think> away), or whose prompt closed it
    (Qwen3's enable_thinking=False): an engine's without the parser, token for token."""
    prompts = [p + prompt_end for p in PROMPTS[:4]]
    params = [choice_params(think, seed, logit_bias={getattr(think, tag): b for tag, b in bias.items()})
              for seed in range(4)]
    with_parser = reasoning_llm(thinking_model).generate(prompts, params, use_tqdm=False)
    without = LLM(thinking_model, device="cpu", dtype="float32", block_size=16, num_kv_blocks=256).generate(
        prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in with_parser] == [o.outputs[0].token_ids for o in without]
    assert all(o.outputs[0].text in CHOICES for o in with_parser)


def test_without_the_parser_the_grammar_holds_from_the_first_token(thinking_model, think):
    llm = LLM(thinking_model, device="cpu", dtype="float32", num_kv_blocks=256)
    params = [choice_params(think, seed, logit_bias={think.start: 100, think.end: 100}) for seed in range(4)]
    for out in llm.generate([p + OPENED for p in PROMPTS[:4]], params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.text in CHOICES and not {think.start, think.end} & set(completion.token_ids)


def test_a_thought_cut_short_by_max_tokens_is_all_the_output(thinking_model, think):
    llm = reasoning_llm(thinking_model)
    params = SamplingParams(temperature=0, max_tokens=8, logit_bias={think.end: -100},
                            structured_outputs=StructuredOutputsParams(choice=CHOICES))
    completion = llm.generate("Hello" + OPENED, params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 8
    assert not grammar_allows(llm, completion.token_ids)
    assert not llm.engine.needs_last_token and llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_the_bitmask_lets_the_opening_tag_through(thinking_model, think):
    """The grammar's bitmask with one token more, the word's sign bit included, and no other bit."""
    llm = reasoning_llm(thinking_model)
    llm.generate("Hi", choice_params(think, 0), use_tqdm=False)        # makes the engine's compiler
    compiler = llm.engine.grammar_compiler
    compiled = compiler.compile(StructuredOutputsParams(choice=CHOICES)).result()
    plain = compiler.matcher(compiled, [2]).next_token_bitmask().clone()
    for token in (think.start, 31, 32, 63):
        grammar = compiler.matcher(compiled, [2])
        with_token = grammar.next_token_bitmask(token)
        allowed = {t for t in range(32 * len(plain)) if (int(with_token[t // 32]) >> (t % 32)) & 1}
        before = {t for t in range(32 * len(plain)) if (int(plain[t // 32]) >> (t % 32)) & 1}
        assert allowed == before | {token} and token not in before
        assert torch.equal(grammar.next_token_bitmask(), plain), "the next call starts from the grammar's again"


@pytest.mark.parametrize("prompt_end, tag", [
    (CLOSED, "end"), ("</think>", "end"), (OPENED, "start"), ("<think>", "start"), ("</think> x", None),
    ("plain text", None), ("<think>a</think>\n\n<|im_end|>\n<|im_start|>assistant\n", None),
])
def test_the_tag_a_prompt_ends_with(thinking_model, think, prompt_end, tag):
    tokenizer = load_tokenizer(thinking_model)
    assert think.prompt_tag(tokenizer, tokenizer.encode("Hi " + prompt_end).ids) == (tag and getattr(think, tag))


def test_the_parser_needs_both_tags_as_tokens(tokenized_model):
    with pytest.raises(ValueError, match="needs <think> and </think> as tokens"):
        LLM(tokenized_model, device="cpu", num_kv_blocks=16, reasoning_parser="qwen3")
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        LLM(tokenized_model, device="cpu", num_kv_blocks=16, reasoning_parser="deepseek_r1")
