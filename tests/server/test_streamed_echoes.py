"""echo=true in a stream, choice by choice: the prompt goes before a choice's first tokens, and a
sibling completion whose tokens come before its prompt's log-probabilities (which the prompt's
first completion brings) is held, then sent whole, nothing lost or repeated."""
from mini_engine.layers.sampler import SampleLogprobs
from mini_engine.server.app import Echo, Prompts, StreamedEchoes
from mini_engine.server.async_engine import RequestDelta
from mini_engine.server.logprobs_json import LogprobsJSON

PROMPT_LOGPROBS = [None, SampleLogprobs(-1.0, [(7, -0.5)], 2), SampleLogprobs(-2.0, [(8, -0.1)], 3)]


def delta(token: int, finish: str | None = None, prompt_logprobs=None, logprobs: bool = True) -> RequestDelta:
    return RequestDelta(f"<{token}>", [token], [SampleLogprobs(-0.25, [(token, -0.25)])] if logprobs else None,
                        finish, 3, 1, prompt_logprobs=prompt_logprobs)


def echoes(drop_output: bool = False) -> StreamedEchoes:
    echo = Echo("abc", [1, 2, 3], ["a", "b", "c"], drop_output)
    return StreamedEchoes(Prompts([[1, 2, 3]], 2, [echo], logprobs_json=LogprobsJSON(None)))


def test_a_sibling_ahead_of_the_prompts_logprobs_is_held_then_sent_whole():
    streamed = echoes()
    assert streamed.ready([(1, delta(10))]) == []
    assert streamed.ready([(1, delta(11))]) == []
    out = streamed.ready([(0, delta(20, prompt_logprobs=PROMPT_LOGPROBS)), (1, delta(12, "length"))])
    assert [k for k, _ in out] == [0, 1]
    held = out[1][1]
    assert (held.text, held.token_ids, held.finish_reason, len(held.logprobs)) == ("<10><11><12>", [10, 11, 12],
                                                                                    "length", 3)
    json = LogprobsJSON(None)
    first, logprobs, offset = streamed.first(1, held, json)
    assert first.text == "abc<10><11><12>" and streamed.sent[1]
    assert logprobs["tokens"] == ["a", "b", "c", "token_id:10", "token_id:11", "token_id:12"]
    assert logprobs["token_logprobs"] == [None, -1.0, -2.0, -0.25, -0.25, -0.25]
    assert logprobs["text_offset"] == [0, 1, 2, 3, 14, 25] and offset == 36
    # Sent, a choice's deltas pass straight through.
    later = delta(13)
    assert streamed.ready([(1, later)]) == [(1, later)]


def test_without_logprobs_nothing_waits():
    streamed = echoes()
    first = delta(10, logprobs=False)
    assert streamed.ready([(1, first)]) == [(1, first)]
    sent, logprobs, _ = streamed.first(1, first, LogprobsJSON(None))
    assert sent.text == "abc<10>" and logprobs is None


def test_max_tokens_0_echoes_the_prompt_alone():
    streamed = echoes(drop_output=True)
    (k, only), = streamed.ready([(0, delta(20, "length", prompt_logprobs=PROMPT_LOGPROBS))])
    sent, logprobs, _ = streamed.first(k, only, LogprobsJSON(None))
    assert (sent.text, sent.token_ids, sent.num_output_tokens, sent.finish_reason) == ("abc", [], 0, "length")
    assert logprobs["tokens"] == ["a", "b", "c"] and logprobs["token_logprobs"] == [None, -1.0, -2.0]


def test_once_the_first_completion_has_gone_out_a_sibling_is_not_held():
    """Its prompt's log-probabilities will never come (the first completion brought none)."""
    streamed = echoes()
    (k, first), = streamed.ready([(0, delta(20))])
    streamed.first(k, first, LogprobsJSON(None))
    sibling = delta(10)
    assert streamed.ready([(1, sibling)]) == [(1, sibling)]


def test_a_held_sibling_whose_last_delta_has_no_tokens_still_waits():
    """A grammar's dead end ends a completion with a delta of no tokens and no logprobs: the
    sibling still waits for its prompt's log-probabilities, and keeps the ones it has."""
    streamed = echoes()
    assert streamed.ready([(1, delta(10))]) == []
    assert streamed.ready([(1, RequestDelta("", [], None, "stop", 3, 1))]) == []
    out = dict(streamed.ready([(0, delta(20, "length", prompt_logprobs=PROMPT_LOGPROBS))]))
    assert out[1].token_ids == [10] and len(out[1].logprobs) == 1 and out[1].finish_reason == "stop"
