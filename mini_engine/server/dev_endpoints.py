"""vLLM's development routes, which RL trainers that serve their rollouts call between training
steps: POST /pause[?mode=abort|wait|keep&clear_cache=true], POST /resume, GET /is_paused (vLLM's
pause_generation: while paused, requests wait), POST /reset_prefix_cache[?reset_external=true]
(the host tier's blocks too), POST /sleep?level=1|2, POST /wake_up[?tags=weights&tags=kv_cache],
GET /is_sleeping (level 2, which discards the weights, is refused: no route here loads new
ones). As in vLLM they exist only where the environment asks for them
(VLLM_SERVER_DEV_MODE=1): they change what every client's next request finds. Each runs in the
engine process between two steps (engine_process.ENGINE_CALLS): sleep and a reset are refused
(409) while requests run, as LLM.sleep and LLM.reset_prefix_cache refuse them offline; sleep needs
the server started with --enable-sleep-mode (400). While the engine sleeps, generation requests
get a 503 until /wake_up."""
import os

from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse

from mini_engine.server.engine_process import pause_mode
from mini_engine.server.protocol import error_response

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
# vLLM's: where it is set, POST /start_profile and /stop_profile run torch.profiler in the engine's
# process (LLMEngine.start_profile) and write its trace there.
PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"


def dev_mode() -> bool:
    return os.environ.get(DEV_MODE_ENV, "0").strip().lower() in ("1", "true")


def profiling() -> bool:
    return bool(os.environ.get(PROFILER_DIR_ENV))


async def engine_call(call, *args) -> tuple[object, JSONResponse | None]:
    """(result, None), or (None, the error response): a bad argument 400, "not now" 409."""
    try:
        return await call(*args), None
    except ValueError as e:
        return None, error_response(str(e), 400)
    except RuntimeError as e:
        return None, error_response(str(e), 409)


def add_dev_routes(app: FastAPI, async_engine) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_external: bool = False):      # vLLM's: the host tier's too
        reset, error = await engine_call(async_engine.call, "reset_prefix_cache", reset_external)
        if error is not None:
            return error
        if not reset:
            return error_response("the prefix cache was not reset: requests are running", 409)
        return JSONResponse({"reset": True})

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True, wait_for_inflight_requests: bool | None = None):
        """vLLM's: no step runs until /resume, and requests sent meanwhile wait for it (mode: what
        becomes of the unfinished ones; AsyncLLM.pause_generation)."""
        mode = pause_mode(mode, wait_for_inflight_requests)
        _, error = await engine_call(async_engine.call, "pause_generation", mode, clear_cache)
        return error or JSONResponse({"is_paused": True})

    @app.post("/resume")
    async def resume():
        _, error = await engine_call(async_engine.call, "resume_generation")
        return error or JSONResponse({"is_paused": False})

    @app.get("/is_paused")
    async def is_paused():
        paused, error = await engine_call(async_engine.call, "is_paused")
        return error or JSONResponse({"is_paused": paused})

    @app.post("/sleep")
    async def sleep(level: int = 1):
        if level == 2:      # its weights would be gone for good: nothing here loads new ones
            return error_response("sleep level 2 discards the weights, and this server has no route that "
                                           "loads new ones: use level 1", 400)
        _, error = await engine_call(async_engine.sleep, level)
        return error or JSONResponse({"is_sleeping": True})

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)):
        _, error = await engine_call(async_engine.wake_up, tags)
        return error or JSONResponse({"is_sleeping": async_engine.asleep})

    @app.get("/is_sleeping")
    async def is_sleeping():
        sleeping, error = await engine_call(async_engine.call, "is_sleeping")
        return error or JSONResponse({"is_sleeping": sleeping})


def add_profile_routes(app: FastAPI, async_engine) -> None:
    """POST /start_profile, then POST /stop_profile: the engine's steps between them in a Chrome
    trace under $VLLM_TORCH_PROFILER_DIR (its path in the response). 409 out of order."""
    @app.post("/start_profile")
    async def start_profile():
        _, error = await engine_call(async_engine.call, "start_profile")
        return error or JSONResponse({"profiling": True})

    @app.post("/stop_profile")
    async def stop_profile():
        path, error = await engine_call(async_engine.call, "stop_profile")
        if error is not None:
            return error
        if isinstance(path, list):      # data parallelism: a trace an engine; `trace` keeps one engine's shape
            return JSONResponse({"profiling": False, "trace": path[0], "traces": path})
        return JSONResponse({"profiling": False, "trace": path})
