"""vLLM's cache_salt on /v1/completions, /v1/chat/completions and /v1/responses: carried to the
engine process, whose prefix cache then serves a prompt's blocks only to requests of the same salt,
as usage's cached_tokens shows (--enable-prompt-tokens-details; blocks of 16, so a 40-token
prompt found again has its first 32 tokens cached). vLLM's check: null is no salt, "" or a
non-string a 400."""
import httpx
import pytest

from tests.server.conftest import MODEL_NAME, launched_server

SALT_ERROR = "Parameter 'cache_salt' must be a non-empty string if provided."


@pytest.fixture(scope="module")
def salted_server(tiny_model, tmp_path_factory):
    with launched_server(tiny_model, tmp_path_factory.mktemp("cache-salt-log"),
                         options=("--enable-prompt-tokens-details",)) as handle:
        yield handle


@pytest.fixture
def served(salted_server):
    yield salted_server
    salted_server.check_idle_and_alive()


def prompt_ids(first: int) -> list[int]:
    """40 token ids no other test sends, so that no other test's blocks are hit."""
    return list(range(first, first + 40))


def send(server, route: str, body: dict) -> dict:
    r = httpx.post(server.base_url + route, json={"model": MODEL_NAME, "temperature": 0} | body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def completion(server, prompt: list[int], **salt) -> tuple[int, str]:
    """The prompt tokens the cache served, and the text."""
    body = send(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "ignore_eos": True} | salt)
    return body["usage"]["prompt_tokens_details"]["cached_tokens"], body["choices"][0]["text"]


def test_completions_hit_only_under_the_same_salt(served):
    prompt = prompt_ids(100)
    runs = [completion(served, prompt, **salt) for salt in
            ({"cache_salt": "a"}, {"cache_salt": "a"}, {"cache_salt": "b"}, {}, {}, {"cache_salt": None})]
    assert [cached for cached, _ in runs] == [0, 32, 0, 0, 32, 32]
    assert len({text for _, text in runs}) == 1


def test_chat_and_responses_carry_the_salt(served):
    content = "Salted chat: " + "the quick brown fox jumps over the lazy dog, " * 3
    chat = [send(served, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                                  "max_tokens": 2, "cache_salt": salt})["usage"]
            for salt in ("x", "x", "y")]
    hit = (chat[0]["prompt_tokens"] - 1) // 16 * 16
    assert hit >= 32
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in chat] == [0, hit, 0]
    # The same prompt through the Responses API (its chat request): the chat's salts' blocks, or none.
    responses = [send(served, "/v1/responses", {"input": content, "max_output_tokens": 2, "cache_salt": salt})
                 for salt in ("x", "z")]
    assert [r["usage"]["input_tokens_details"]["cached_tokens"] for r in responses] == [hit, 0]


def test_beam_search_steps_run_under_the_salt(served):
    """A salted beam search's steps leave the prompt's blocks under its salt alone."""
    prompt = prompt_ids(200)
    send(served, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "n": 2, "use_beam_search": True,
                                     "cache_salt": "beams"})
    assert completion(served, prompt)[0] == 0
    assert completion(served, prompt, cache_salt="beams")[0] == 32


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 1}),
])
@pytest.mark.parametrize("salt", ["", 7, ["a"]])
def test_a_bad_salt_is_a_400_naming_it(served, route, body, salt):
    r = httpx.post(served.base_url + route, json={"model": MODEL_NAME, "cache_salt": salt} | body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "cache_salt" and SALT_ERROR in error["message"]
