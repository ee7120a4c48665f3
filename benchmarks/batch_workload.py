"""bench.py's workload as a batch runner's input: `python benchmarks/batch_workload.py requests.jsonl`,
then `python -m mini_engine.run_batch -i requests.jsonl -o results.jsonl --max-model-len 2048`.

Each of the 256 requests is a /v1/completions line with bench.py's prompt (token ids), max_tokens,
temperature 0.6, no top-k or top-p, and ignore_eos: the batch runner's summary line (completion
tok/s) then stands beside bench.py's, the difference being what the HTTP layer and the engine's
process cost."""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import make_workload  # noqa: E402


def batch_lines(num_seqs: int | None = None, temperature: float = 0.6) -> list[dict]:
    prompts, max_tokens = make_workload(num_seqs)
    return [{"custom_id": f"bench-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": prompt, "max_tokens": n, "temperature": temperature, "top_p": 1.0, "top_k": -1,
                      "ignore_eos": True}}
            for i, (prompt, n) in enumerate(zip(prompts, max_tokens))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", help="the input file to write for run_batch")
    parser.add_argument("--num-seqs", type=int, default=None, help="the workload's first N requests")
    args = parser.parse_args()
    with open(args.output, "w") as f:
        for line in batch_lines(args.num_seqs):
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
