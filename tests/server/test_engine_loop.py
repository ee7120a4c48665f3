"""The engine process's loop (server/engine_process.py EngineLoop), in this process with a stand-in
engine: a request whose output cannot be processed ends alone, with an error, and the others go on."""
import queue

from mini_engine.detokenizer import IncrementalDetokenizer
from mini_engine.engine.engine import StepOutput
from mini_engine.engine.sequence import Sequence
from mini_engine.sampling_params import SamplingParams
from mini_engine.server.engine_process import EngineLoop, RequestState
from tests.server.conftest import train_tokenizer


class StandInEngine:
    def __init__(self):
        self.aborted = []

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)


def test_a_request_whose_text_fails_ends_alone():
    tokenizer = train_tokenizer()
    loop = EngineLoop(StandInEngine(), queue.Queue())
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    seqs = [Sequence(str(i), [1, 2, 3], params) for i in range(3)]
    for seq in seqs:
        loop.states[seq.request_id] = RequestState(IncrementalDetokenizer.for_request(tokenizer, params))

    def fails(*args, **kwargs):
        raise RuntimeError("a tokenizer that cannot decode this")
    loop.states["1"].detokenizer.update_until_stop = fails
    token = tokenizer.token_to_id("a")
    deltas, _ = loop.process([StepOutput(seq, [token], False) for seq in seqs])
    deltas = {d.request_id: d for d in deltas}
    assert deltas["1"].finish_reason == "error" and "detokenize" in deltas["1"].error
    assert "RuntimeError: a tokenizer that cannot decode this" in deltas["1"].error
    assert loop.engine.aborted == ["1"] and set(loop.states) == {"0", "2"}
    assert [deltas[i].finish_reason for i in ("0", "2")] == [None, None]
    assert [deltas[i].text for i in ("0", "2")] == ["a", "a"]
    later, step_tokens = loop.process([StepOutput(seqs[i], [token], False) for i in (0, 2)])
    assert step_tokens == 2
    assert [(d.request_id, d.text, d.num_output_tokens) for d in later] == [("0", "a", 2), ("2", "a", 2)]
