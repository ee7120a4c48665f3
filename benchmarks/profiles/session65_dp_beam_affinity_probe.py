import sys, httpx, json
sys.path.insert(0, "/work/main")
from tests.server.conftest import launched_server
from bench_serving import metric_per_engine as per_engine
import pathlib
model = "/tmp/rb/model"
prompt = [(7 * i) % 400 + 20 for i in range(320)]
for dp in ("1", "2"):
    with launched_server(model, pathlib.Path(f"/tmp/aff/log{dp}"), options=("--data-parallel-size", dp, "--device", "cpu")) as s:
        r = httpx.post(s.base_url + "/v1/completions", timeout=300, json={"prompt": prompt, "use_beam_search": True, "n": 4, "max_tokens": 16, "ignore_eos": True})
        assert r.status_code == 200, r.text
        print("dp", dp, "hit rate by engine", per_engine(s.base_url, "prefix_cache_hit_rate"),
              "requests by engine", per_engine(s.base_url, "request_success_total"))
