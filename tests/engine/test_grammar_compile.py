"""Grammars compile off the step loop (vLLM's WAITING_FOR_FSM): while one compiles its request
waits and the others run; once compiled it runs as it would have; a compile that fails or a
request aborted meanwhile ends that request alone, with every KV block back."""
import threading
import time

import pytest

from mini_engine import LLM, SamplingParams
from mini_engine.engine.sequence import SequenceStatus
from mini_engine.structured_outputs import GrammarCompiler, StructuredOutputsParams

pytest.importorskip("xgrammar")

CHOICES = ["yes", "no", "maybe so"]
PLAIN = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def choice_params(**kwargs) -> SamplingParams:
    return SamplingParams(**({"temperature": 0, "max_tokens": 20} | kwargs),
                          structured_outputs=StructuredOutputsParams(choice=CHOICES))


@pytest.fixture
def held_compiles(monkeypatch):
    """Every compile waits for the event first; the list counts the compiles started."""
    release, started = threading.Event(), []
    compile_now = GrammarCompiler.compile_now

    def held(self, kind, text):
        started.append((kind, text))
        assert release.wait(30), "the test never released the compile"
        return compile_now(self, kind, text)
    monkeypatch.setattr(GrammarCompiler, "compile_now", held)
    yield release, started
    release.set()


def run_until_done(engine, request_ids: set[str]) -> dict[str, list[int]]:
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.seq.request_id, []).extend(out.new_token_ids)
    assert set(tokens) >= request_ids
    return tokens


@pytest.fixture(scope="module")
def unhurried(tokenized_model) -> list[list[int]]:
    """The outputs of the three requests below from an engine whose compiles nobody holds."""
    outputs = LLM(tokenized_model, device="cpu", num_kv_blocks=64).generate(
        ["Hi", "Hello", "Hey"], [PLAIN, choice_params(), PLAIN], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_others_run_while_a_grammar_compiles(tokenized_model, unhurried, held_compiles):
    release, started = held_compiles
    engine = LLM(tokenized_model, device="cpu", num_kv_blocks=64).engine
    engine.add_request("Hi", PLAIN, "before")
    structured = engine.add_request("Hello", choice_params(), "structured")
    engine.add_request("Hey", PLAIN, "after")         # behind the compiling request in the queue
    done = {}
    while {"before", "after"} - done.keys():
        for out in engine.step():
            if out.finished:
                done[out.seq.request_id] = out.seq.output_token_ids
    assert started and structured.status == SequenceStatus.WAITING and structured.num_computed_tokens == 0
    assert engine.compiling == {"structured"}
    release.set()
    run_until_done(engine, {"structured"})
    assert [done["before"], structured.output_token_ids, done["after"]] == unhurried
    assert engine.tokenizer.decode(structured.output_token_ids) in CHOICES
    assert engine.num_free_blocks == engine.block_manager.num_blocks and not engine.compiling


def test_a_spec_compiles_once_for_every_request_that_sends_it(tokenized_model, held_compiles):
    release, started = held_compiles
    llm = LLM(tokenized_model, device="cpu", num_kv_blocks=64)
    release.set()
    outputs = llm.generate(["Hello", "Hi"], choice_params(n=3, temperature=1.0, seed=1), use_tqdm=False)
    assert len(started) == 1
    assert all(c.text in CHOICES for out in outputs for c in out.outputs)


def test_a_request_aborted_while_its_grammar_compiles(tokenized_model, held_compiles):
    release, _ = held_compiles
    engine = LLM(tokenized_model, device="cpu", num_kv_blocks=64).engine
    engine.add_request("Hello", choice_params(), "structured")
    engine.add_request("Hi", PLAIN, "plain")
    engine.step()
    engine.abort_request("structured")
    release.set()
    tokens = run_until_done(engine, {"plain"})
    assert "structured" not in tokens and len(tokens["plain"]) == PLAIN.max_tokens
    assert engine.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.compiling and not engine.needs_last_token and not engine.requests


def test_a_grammar_that_fails_to_compile_ends_its_request_alone(tokenized_model, monkeypatch):
    """What check() cannot find (it parses the spec; the compile is xgrammar's) still ends only
    the request it belongs to."""
    def fails(self, kind, text):
        raise ValueError("structured_outputs: no such luck")
    monkeypatch.setattr(GrammarCompiler, "compile_now", fails)
    engine = LLM(tokenized_model, device="cpu", num_kv_blocks=64).engine
    structured = engine.add_request("Hello", choice_params(), "structured")
    engine.add_request("Hi", PLAIN, "plain")
    tokens = run_until_done(engine, {"structured", "plain"})
    assert structured.finish_reason == "abort" and tokens["structured"] == []
    assert len(tokens["plain"]) == PLAIN.max_tokens
    assert engine.num_free_blocks == engine.block_manager.num_blocks and not engine.compiling


def test_with_only_a_compiling_request_a_step_returns_nothing(tokenized_model, held_compiles):
    """Nothing can run: the step waits a moment for the compile (it does not spin), returns no
    output and changes nothing; once the compile is done the request runs."""
    release, _ = held_compiles
    engine = LLM(tokenized_model, device="cpu", num_kv_blocks=64).engine
    structured = engine.add_request("Hello", choice_params(), "structured")
    start = time.monotonic()
    assert [engine.step() for _ in range(3)] == [[], [], []]
    assert time.monotonic() - start >= 0.1
    assert structured.status == SequenceStatus.WAITING and engine.num_free_blocks == engine.block_manager.num_blocks
    release.set()
    run_until_done(engine, {"structured"})
    assert engine.tokenizer.decode(structured.output_token_ids) in CHOICES


def test_a_compiled_request_keeps_its_place_in_the_queue(tokenized_model, held_compiles):
    """Two sequences at a time: the plain requests behind the compiling one run first, but once
    compiled it goes before the plain one that came after it (FCFS)."""
    release, _ = held_compiles
    engine = LLM(tokenized_model, device="cpu", num_kv_blocks=64, max_num_seqs=2).engine
    structured = engine.add_request("Hello", choice_params(), "structured")
    engine.add_request("Hi", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), "short")
    engine.add_request("Ho", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), "long")
    engine.add_request("Hey", PLAIN, "last")
    started = []
    while engine.has_unfinished_requests():
        if not release.is_set() and {"short", "long"} <= {seq.request_id for seq in engine.scheduler.running}:
            release.set()
            # The compile must end before "short" does (two steps), or "last" takes the free
            # place by rights; on a busy machine the compile thread could lose that race.
            structured.grammar_compiling.result(timeout=30)
        started += [r for r in (seq.request_id for seq in engine.scheduler.running) if r not in started]
        engine.step()
    assert started == ["short", "long", "structured", "last"]


def test_the_last_output_is_not_held_up_by_another_compile(tokenized_model, monkeypatch):
    """A step that has outputs to return (here the end of a structured request) returns them at
    once, though nothing else can run while another grammar compiles."""
    release, waits = threading.Event(), []
    compile_now = GrammarCompiler.compile_now

    def held_for_regex(self, kind, text):
        if kind == "regex":
            assert release.wait(30)
        return compile_now(self, kind, text)
    monkeypatch.setattr(GrammarCompiler, "compile_now", held_for_regex)
    engine = LLM(tokenized_model, device="cpu", num_kv_blocks=64).engine
    engine.wait_for_a_grammar = lambda: waits.append(len(engine.requests))
    engine.add_request("Hello", choice_params(), "choice")
    while not engine.scheduler.running:
        engine.step()
    engine.add_request("Hi", SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-9]+"}), "regex")
    ended = False
    waits.clear()
    while not ended:
        outputs = engine.step()
        ended = any(out.finished for out in outputs)
        assert not (outputs and waits), "a step with outputs waited for a compile"
        waits.clear()
    release.set()
    run_until_done(engine, {"regex"})


def test_an_abort_calls_off_a_compile_nobody_else_waits_for(tokenized_model, held_compiles):
    """Aborted before its turn on the compiler's thread, a compile never runs; a later request
    with the same spec has it compiled then."""
    release, started = held_compiles
    engine = LLM(tokenized_model, device="cpu", num_kv_blocks=64).engine
    engine.add_request("Hello", SamplingParams(max_tokens=4, structured_outputs={"regex": "[0-9]+"}), "busy")
    engine.add_request("Hi", choice_params(), "gone")
    engine.add_request("Hey", choice_params(), "shares")         # the same spec: the compile stays
    engine.abort_request("gone")
    engine.add_request("Yo", SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]+"}), "alone")
    engine.abort_request("alone")
    release.set()
    run_until_done(engine, {"busy", "shares"})
    assert [kind for kind, _ in started] == ["regex", "grammar"], "the aborted regex never compiled"
    again = engine.add_request("Yo", SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]+"}), "again")
    run_until_done(engine, {"again"})
    text = engine.tokenizer.decode(again.output_token_ids)
    assert again.finish_reason in ("stop", "length") and text.isalpha() and text.islower()
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_a_failed_compile_is_tried_again_for_the_next_request(tokenized_model, monkeypatch):
    """A compile that failed (for want of memory, say) is not kept: the next request with the
    same spec compiles it again, and runs."""
    compile_now, calls = GrammarCompiler.compile_now, []

    def fails_once(self, kind, text):
        calls.append(kind)
        if len(calls) == 1:
            raise MemoryError("no room")
        return compile_now(self, kind, text)
    monkeypatch.setattr(GrammarCompiler, "compile_now", fails_once)
    engine = LLM(tokenized_model, device="cpu", num_kv_blocks=64).engine
    first = engine.add_request("Hello", choice_params(), "first")
    run_until_done(engine, {"first"})
    second = engine.add_request("Hello", choice_params(), "second")
    run_until_done(engine, {"second"})
    assert first.finish_reason == "abort" and len(calls) == 2
    assert engine.tokenizer.decode(second.output_token_ids) in CHOICES
