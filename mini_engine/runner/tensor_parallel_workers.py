"""Ranks 1..N-1 of tensor parallelism: a process each, each with a ModelRunner over its share of
the model, that runs every step rank 0's runner launches, on the same rows.

Rank 0 (the engine's process) sends each step's rows down a pipe before it launches the step
itself; a worker launches them as they come and never reads its tokens back: its sampled tokens,
drawn from the same gathered logits with the same seeds, equal rank 0's and stay on its device,
where its next decode step takes its input tokens from them as rank 0's does. The collectives
inside the step (NCCL's, on the GPUs' streams) keep the ranks in step; the hosts only queue work.
Everything the ranks run at start-up (the KV pool's sizing, the graphs' capture) is the same
sequence of steps on each, so their collectives pair up."""
import logging
import multiprocessing
import os
import pickle
import weakref
from multiprocessing.connection import Connection

from mini_engine.config import EngineConfig
from mini_engine.distributed import TensorParallel, free_port

logger = logging.getLogger("mini_engine.runner")


def worker_main(config: EngineConfig, tp: TensorParallel, port: int, conn: Connection) -> None:
    from mini_engine.runner.model_runner import ModelRunner
    try:
        runner = ModelRunner(config, tp, port)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed to start", tp.rank)
        raise
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            # Rank 0's process is gone, and the process group's destruction would wait for it
            # forever: this process ends without it.
            os._exit(1)
        rows = pickle.loads(message)
        if rows is None:
            runner.shutdown()
            return
        try:
            runner.launch(rows)
        except Exception:
            # The same rows failed the same way on rank 0, whose engine reports it to the request.
            logger.exception("tensor-parallel rank %d: a step failed", tp.rank)


class TensorParallelWorkers:
    """Rank 0's handle on the other ranks' processes."""

    def __init__(self, config: EngineConfig):
        """Starts ranks 1..N-1; they block until rank 0 joins the process group on `self.port`."""
        self.port = free_port()
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

    def send(self, rows) -> None:
        message = pickle.dumps(rows, protocol=pickle.HIGHEST_PROTOCOL)
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
