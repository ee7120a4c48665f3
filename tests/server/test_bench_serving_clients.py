"""bench_serving's load generators: several processes each send their share, and the results come
back in the workload's order, each request with exactly its max_tokens."""
import pytest

from bench_serving import run_clients
from tests.server.conftest import MODEL_NAME


@pytest.mark.parametrize("clients", [1, 3])
def test_results_come_back_in_workload_order(served, clients):
    prompts = [[5 + i] * (3 + i) for i in range(7)]     # every request told apart by its prompt's length
    max_tokens = [2 + (i * 3) % 5 for i in range(7)]
    results, wall, _ = run_clients(served.base_url, MODEL_NAME, prompts, max_tokens, float("inf"), 0.0, 0, clients)
    assert [r.num_prompt_tokens for r in results] == [len(p) for p in prompts]
    assert [r.num_output_tokens for r in results] == max_tokens and all(r.ok for r in results)
    assert [r.client for r in results] == [i % clients for i in range(7)]      # each process sent its share
    assert wall >= max(r.latency for r in results)      # from the first send to the last reply
    served.check_idle_and_alive()
