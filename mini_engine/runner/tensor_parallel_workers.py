"""Ranks 1..N-1 of tensor parallelism: a process each, each with a ModelRunner over its share of
the model, that runs every step rank 0's runner launches, on the same rows.

Rank 0 (the engine's process) sends each step's rows down a pipe before it launches the step
itself; a worker launches them as they come and never reads its tokens back: its sampled tokens,
drawn from the same gathered logits with the same seeds, equal rank 0's and stay on its device,
where its next decode step takes its input tokens from them as rank 0's does. The collectives
inside the step (NCCL's, on the GPUs' streams) keep the ranks in step; the hosts only queue work.
Everything the ranks run at start-up (the KV pool's sizing, the graphs' capture) is the same
sequence of steps on each, so their collectives pair up.

LoRA adapters cross the pipe too: a worker reads no adapter file. Had each rank read its own, a
folder deleted or damaged between rank 0's read and a worker's would fail the step on that worker
alone, and the ranks' collectives would no longer pair up. Rank 0 reads (and re-reads, under
max_cpu_loras) where a failure ends only the adapter's requests (LLMEngine.read_adapters), and
sends each worker the host copy its slots load (WorkerAdapters); every rank then loads the same
copy, even of an adapter whose files changed in between.

Between steps, rank 0 may also ask every worker's runner to do what its own does (RunnerCall):
load_weights' receive_weights, whose tensors then come by broadcast over the process group, and
sleep mode's sleep and wake_up."""
import dataclasses
import logging
import multiprocessing
import os
import pickle
import signal
import weakref
from collections import OrderedDict
from multiprocessing.connection import Connection

from mini_engine.config import EngineConfig
from mini_engine.distributed import TensorParallel, free_port
from mini_engine.lora import AdapterCache, LoRAAdapter
from mini_engine.runner.batch import BatchRow
from mini_engine.sampling_params import SamplingParams

logger = logging.getLogger("mini_engine.runner")


# BatchRow's fields, in the order a row travels as a tuple. block_table_array (the engine's padded
# copy of block_table) stays behind: a worker pads block_table itself.
ROW_FIELDS = tuple(f.name for f in dataclasses.fields(BatchRow))
PARAMS, TABLE_ARRAY = ROW_FIELDS.index("params"), ROW_FIELDS.index("block_table_array")


class WorkerAdapters:
    """Rank 0's record of the LoRA adapters the workers hold in host memory (their AdapterCache,
    which reads no file): at most capacity (max_cpu_loras, as rank 0 holds), the one least recently
    run dropped. Before each step the workers are sent rank 0's copy of each of the step's adapters
    they lack, or hold an older read of: whatever the step's slots may load, since the engine has
    each of a step's adapters in rank 0's slots or host memory (LoRAAdapters.prepare). One in rank
    0's slots alone is in every rank's slots (the ranks' tables agree), and no worker needs it."""

    def __init__(self, source: AdapterCache, capacity: int):
        self.source = source                    # rank 0's
        self.capacity = capacity                # >= max_loras: a step's adapters all stay
        self.held: OrderedDict[int, LoRAAdapter] = OrderedDict()

    def update(self, rows: list[BatchRow]) -> tuple[list[int], list[LoRAAdapter]] | None:
        """(ids the workers drop, adapters they take) for this step's rows; None: nothing changes."""
        dropped, sent = [], []
        for lora_id in dict.fromkeys(row.lora_request.lora_int_id for row in rows if row.lora_request is not None):
            adapter = self.source.resident(lora_id)
            if adapter is None:
                continue
            if self.held.get(lora_id) is not adapter:
                self.held[lora_id] = adapter
                sent.append(adapter)
            self.held.move_to_end(lora_id)
        while len(self.held) > self.capacity:
            dropped.append(self.held.popitem(last=False)[0])
        return (dropped, sent) if dropped or sent else None


@dataclasses.dataclass(frozen=True, slots=True)
class RunnerCall:
    """A message that is no step: the worker's runner runs method(*args), as rank 0's runner does
    (vLLM's collective_rpc, between steps)."""
    method: str
    args: tuple = ()


def take_adapters(message: tuple, cache: AdapterCache | None) -> None:
    """A worker's side of WorkerAdapters: its cache drops and takes what rank 0 sent with the step."""
    adapters = message[3]
    if adapters is None:
        return
    dropped, sent = adapters
    for lora_id in dropped:
        cache.drop(lora_id)
    for adapter in sent:
        cache.put(adapter)


class StepEncoder:
    """Rank 0's side of the pipe: each step's rows as tuples of their fields, each request's
    SamplingParams sent once and named by a number after that. 256 decode rows pickle in ~0.9 ms and
    unpickle into rows in ~0.5 ms, where the dataclasses took ~5 ms and ~4 ms (2-core CI machine).
    With LoRA (adapters set), the adapters the workers must take before the step (WorkerAdapters)."""

    def __init__(self, max_params: int):
        self.max_params = max_params
        self.keys: dict[int, tuple[int, SamplingParams]] = {}    # id(params) -> (number, params kept alive)
        self.next_key = 0
        self.adapters: WorkerAdapters | None = None

    def encode(self, rows: list[BatchRow]) -> tuple[bool, dict[int, SamplingParams], list[tuple], tuple | None]:
        """(reset, new params by number, rows, adapters): reset tells the worker to forget the
        numbers it knows, which bounds both tables by the params of requests still running;
        adapters, WorkerAdapters.update's (None without LoRA)."""
        reset = len(self.keys) > self.max_params
        if reset:
            self.keys.clear()
        new: dict[int, SamplingParams] = {}
        encoded = []
        for row in rows:
            values = [getattr(row, name) for name in ROW_FIELDS]
            values[PARAMS] = self.key(row.params, new)
            values[TABLE_ARRAY] = None
            encoded.append(tuple(values))
        return reset, new, encoded, None if self.adapters is None else self.adapters.update(rows)

    def key(self, params: SamplingParams | None, new: dict[int, SamplingParams]) -> int:
        if params is None:
            return -1
        known = self.keys.get(id(params))
        if known is not None and known[1] is params:
            return known[0]
        key, self.next_key = self.next_key, self.next_key + 1
        self.keys[id(params)] = (key, params)
        new[key] = params
        return key


def decode_rows(message: tuple, params: dict[int, SamplingParams]) -> list[BatchRow]:
    """A worker's side: the step's rows, from StepEncoder.encode's message and the params table it keeps."""
    reset, new, encoded, _ = message
    if reset:
        params.clear()
    params.update(new)
    rows = []
    for values in encoded:
        row = BatchRow(*values)
        row.params = params[values[PARAMS]] if values[PARAMS] >= 0 else None
        rows.append(row)
    return rows


def worker_main(config: EngineConfig, tp: TensorParallel, port: int, conn: Connection) -> None:
    from mini_engine.runner.model_runner import ModelRunner
    # Ctrl-C reaches every process of the terminal's group: rank 0 handles it, and tells this rank to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        runner = ModelRunner(config, tp, port)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed to start", tp.rank)
        raise
    if runner.lora is not None:
        # This rank's adapters are rank 0's copies (WorkerAdapters), never read here.
        runner.lora.cache = AdapterCache(config.model_config, config.max_lora_rank, None, reads_files=False)
    params: dict[int, SamplingParams] = {}
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            # Rank 0's process is gone, and the process group's destruction would wait for it
            # forever: this process ends without it.
            os._exit(1)
        if message is None:
            runner.shutdown()
            return
        try:
            if isinstance(message, RunnerCall):
                getattr(runner, message.method)(*message.args)
                continue
            take_adapters(message, None if runner.lora is None else runner.lora.cache)
            runner.launch(decode_rows(message, params))
        except Exception:
            # Where the step failed, rank 0 may have gone on, or stopped elsewhere: out of step, this
            # rank ends (rank 0 refuses every later step).
            logger.exception("tensor-parallel rank %d: a step (or a call of rank 0's) failed", tp.rank)
            os._exit(1)


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks' processes."""

    def __init__(self, config: EngineConfig):
        """Starts ranks 1..N-1; they block until rank 0 joins the process group on `self.port`."""
        self.port = free_port()
        # Twice the requests that can run at once: reset only once many have come and gone.
        self.encoder = StepEncoder(2 * config.max_num_seqs)
        ctx = multiprocessing.get_context("spawn")      # CUDA cannot be used in a forked child
        self.conns: list[Connection] = []
        self.processes: list[multiprocessing.Process] = []
        for rank in range(1, config.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(target=worker_main, name=f"mini_engine-tp{rank}",
                                  args=(config, TensorParallel(rank, config.tensor_parallel_size), self.port, theirs))
            process.start()
            theirs.close()
            self.conns.append(ours)
            self.processes.append(process)
        # Once the workers were told to stop, or were never started: at exit at the latest.
        self.finalizer = weakref.finalize(self, end_workers, self.conns, self.processes)

    def share_adapters(self, source: AdapterCache, capacity: int) -> None:
        """With LoRA: rank 0's AdapterCache, whose copies the workers take (WorkerAdapters)."""
        self.encoder.adapters = WorkerAdapters(source, capacity)

    def send(self, rows: list[BatchRow]) -> None:
        message = pickle.dumps(self.encoder.encode(rows), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(message)

    def call(self, method: str, *args) -> None:
        """Has every worker's runner run method(*args) (a RunnerCall) once it has run the steps sent before."""
        message = pickle.dumps(RunnerCall(method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(message)

    def stop(self) -> None:
        """Tells each worker to shut its runner down once it has run the steps sent before."""
        message = pickle.dumps(None)
        for conn in self.conns:
            try:
                conn.send_bytes(message)
            except OSError:
                pass                # that worker is gone already

    def join(self) -> None:
        """Waits for the workers' processes to end (terminating any that outlives the wait)."""
        self.finalizer()

    def terminate(self) -> None:
        for process in self.processes:
            process.terminate()
        self.finalizer()


def end_workers(conns: list[Connection], processes: list[multiprocessing.Process], timeout: float = 60.0) -> None:
    for process in processes:
        process.join(timeout)
        if process.is_alive():
            process.terminate()
            process.join()
    for conn in conns:
        conn.close()
