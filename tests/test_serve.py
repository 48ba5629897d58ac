"""``writescope serve`` (writescope/serve/): a real loopback server over the tiny preset, started
and stopped in the tests. Concurrent streaming clients get offline ``generate``'s greedy tokens;
the official ``openai`` client works; bad requests get a 4xx and the server stays up; a client
that disconnects frees its KV; /metrics parses and counts what was served."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")


from writescope import LLM, SamplingParams  # noqa: E402
from writescope.serve.app import ServerState, build_app  # noqa: E402
from writescope.serve.async_engine import AsyncEngine  # noqa: E402
from writescope.serve.server import ServerThread  # noqa: E402
from serve_helpers import WAIT_S, held_engine, metrics, start_server, stop_server, wait_until  # noqa: E402

MODEL = "tiny-qwen3-moe"
MAX_LEN = 2048
TEXTS = [f"def f{i}(x):\n    return " + "x + 1 " * i for i in range(24)]


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, device="cpu", progress=False, max_model_len=MAX_LEN, prefill_chunk_tokens=16)


@pytest.fixture(scope="module")
def offline(llm):
    """Greedy references, computed before any server owns the model."""
    return llm.generate(TEXTS, SamplingParams(max_tokens=12))


@pytest.fixture(scope="module")
def hello(llm):
    """The greedy 5-token reference for "hello" (the openai client test)."""
    return llm.generate(["hello"], SamplingParams(max_tokens=5))[0]


@pytest.fixture(scope="module")
def server(llm, offline, hello):
    srv = start_server(llm, MODEL)
    yield srv
    stop_server(srv, llm)


def sse(lines) -> list[dict]:
    """The JSON events of a server-sent-event body, checking it ends with [DONE]."""
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


# ---------------------------------------------------------------- equality under concurrency
def test_concurrent_streaming_clients_match_offline_generate(server, offline):
    async def one(client, i):
        body = {"model": MODEL, "prompt": TEXTS[i], "max_tokens": 12, "temperature": 0, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            events = sse([ln async for ln in r.aiter_lines()])
        ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
        text = "".join(c["text"] for e in events for c in e["choices"])
        assert [("usage" in e) for e in events] == [False] * (len(events) - 1) + [True]  # usage once, in its own last event
        assert events[-1]["choices"] == []
        return ids, text, {**events[-2], "usage": events[-1]["usage"]}

    async def main():
        async with httpx.AsyncClient(timeout=WAIT_S) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(TEXTS))))

    results = asyncio.run(main())
    assert server.engine.core.steps > 0
    for (ids, text, last), ref in zip(results, offline):
        assert ids == ref.token_ids
        assert text == ref.text
        assert last["choices"][0]["finish_reason"] == ref.finish_reason
        assert last["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": len(ref.token_ids),
                                 "total_tokens": len(ref.prompt_token_ids) + len(ref.token_ids)}
    wait_until(lambda: server.engine.snapshot()["kv_slots"] == 0, "the KV slots to be freed")


def test_non_streaming_completion_and_token_prompt(server, offline):
    ref = offline[3]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": ref.prompt_token_ids, "max_tokens": 12,
                                                         "temperature": 0, "return_token_ids": True}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["token_ids"] == ref.token_ids
    assert body["choices"][0]["text"] == ref.text
    assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


# ---------------------------------------------------------------- the official client
def test_openai_client(server, hello):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=WAIT_S, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    c = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0)
    assert c.choices[0].text == hello.text and c.choices[0].finish_reason == hello.finish_reason
    assert c.usage.completion_tokens == len(hello.token_ids) and c.usage.prompt_tokens == len(hello.prompt_token_ids)
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(model=MODEL, prompt="hello", max_tokens=5,
                                                                              temperature=0, stream=True) if ch.choices)
    assert streamed == c.choices[0].text
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens


# ---------------------------------------------------------------- bad requests
BAD = [
    ("empty prompt", {"prompt": ""}, 400, "empty"),
    ("negative max_tokens", {"max_tokens": -3}, 400, "max_tokens"),
    ("huge max_tokens", {"max_tokens": 10**9}, 400, "max_model_len of 2,048 tokens"),
    ("prompt too long", {"prompt": list(range(5, 5 + MAX_LEN))}, 400, "max_model_len"),
    ("unknown model", {"model": "gpt-9"}, 404, "gpt-9"),
    ("max_tokens as a string", {"max_tokens": "10"}, 400, "max_tokens"),
    ("prompt as a number", {"prompt": 5}, 400, "prompt"),
    ("temperature out of range", {"temperature": 5}, 400, "temperature"),
    ("token id outside the vocabulary", {"prompt": [1, 99999]}, 400, "vocabulary"),
    ("n above 16", {"n": 17}, 400, "n: Input should be less than or equal to 16"),
    ("five stop strings", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop: at most 4 stop strings"),
    ("a list of prompts", {"prompt": ["a", "b"]}, 400, "one prompt per request"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_requests_get_4xx(server, case):
    _, change, status, words = case
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **change}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_a_prompt_too_long_is_named_as_the_prompt(server):
    """The 400 names the field to change: the prompt (or the chat's messages) when it leaves no room
    for any new token, max_tokens when the prompt fits but the two together do not."""
    body = {"model": MODEL, "prompt": list(range(5, 5 + MAX_LEN)), "max_tokens": 4}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    body = {"model": MODEL, "prompt": list(range(5, 5 + MAX_LEN - 2)), "max_tokens": 4}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 4 * MAX_LEN}], "max_tokens": 4}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "max_model_len" in r.json()["error"]["message"]  # the engine's check, not a size limit of the body


def test_malformed_bodies_and_the_server_stays_up(server):
    url = server.url
    r = httpx.post(url + "/v1/completions", content=b'{"model": "tiny', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "still here", "max_tokens": 2}, timeout=WAIT_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_unknown_paths_and_methods_get_openai_errors_naming_the_routes(server):
    """404 and 405 (starlette's own) in OpenAI's error shape, saying what exists."""
    r = httpx.get(server.url + "/foo")
    err = r.json()["error"]
    assert r.status_code == 404 and err["code"] == 404 and err["type"] == "invalid_request_error", r.text
    assert err["message"] == ("unknown path /foo; the API: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, "
                              "GET /health, GET /metrics")
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["Allow"] == "POST", r.text
    assert r.json()["error"]["message"] == "no route GET /v1/completions: POST it"
    r = httpx.post(server.url + "/health")
    assert r.status_code == 405 and r.json()["error"]["message"] == "no route POST /health: GET it", r.text


def test_a_json_body_without_its_content_type_is_named(server):
    """curl -d sends a form's Content-Type: the body is not read as JSON, and the 400 says which header to send."""
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "it came as Content-Type application/x-www-form-urlencoded" in msg, r.text
    assert "send the header 'Content-Type: application/json'" in msg
    r = httpx.post(server.url + "/v1/completions", json=[1, 2])  # JSON, but not an object: no word of the header
    assert r.status_code == 400 and "Content-Type" not in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert r.status_code == 200, r.text


def test_api_key_and_loading_health():
    """A server whose model has not loaded: /health is 503; with --api-key, /v1/* wants the key."""
    state = ServerState(MODEL, api_key="s3cret")
    with ServerThread(build_app(state)) as srv:
        assert httpx.get(srv.url + "/health").status_code == 503
        body = {"model": MODEL, "prompt": "hi"}
        assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        r = httpx.post(srv.url + "/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 503 and "Retry-After" in r.headers  # past the key: the model is loading
        assert httpx.get(srv.url + "/metrics").status_code == 200  # not behind the key, as vLLM's


# ---------------------------------------------------------------- admission and cancellation
def test_disconnected_client_frees_its_kv(server):
    before = metrics(server.url)
    abort_key = ("writescope:request_success_total", (("finished_reason", "abort"),))
    body = {"model": MODEL, "prompt": "a long one", "max_tokens": MAX_LEN - 100, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=WAIT_S) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            # the iterator held: the for loop's own one, dropped at its break, would close the connection there
            # (httpcore closes an unfinished response's socket), and under load the server's abort then freed
            # the slot before the read below (seen once in a local full run)
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    break  # one token in: the slot is taken before the first token is published
            assert server.engine.snapshot()["kv_slots"] == 1
        # leaving the stream's block hangs up
    wait_until(lambda: server.engine.snapshot()["kv_slots"] == 0 and server.engine.snapshot()["running"] == 0,
               "the disconnected request's KV to be freed")
    wait_until(lambda: metrics(server.url)[abort_key] == before[abort_key] + 1, "the abort to be counted")


def _held_engine(llm, server, max_num_seqs: int, max_queue: int):
    """A server state over a second engine on the module's model whose steps wait for the returned
    event (set it to let them run); once the module's server is idle, as they share the model."""
    return held_engine(llm, max_num_seqs, max_queue, idle=server)


def test_full_queue_gets_503_with_retry_after(llm, server):
    """An engine whose steps are held: the batch's one place and --max-queue 2 take three requests
    (a burst is not admitted at once, but only those past the batch's places count as waiting),
    and the fourth is refused."""
    state, engine, release = _held_engine(llm, server, max_num_seqs=1, max_queue=2)
    body = {"model": MODEL, "prompt": "queued", "max_tokens": 3}
    with ServerThread(build_app(state)) as srv:
        results: list = []
        threads = [threading.Thread(target=lambda: results.append(httpx.post(srv.url + "/v1/completions", json=body, timeout=WAIT_S)))
                   for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: engine.snapshot()["waiting"] == 3, "three requests to be taken")
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1" and "--max-queue 2" in r.json()["error"]["message"]
        release.set()
        for t in threads:
            t.join(WAIT_S)
        assert [x.status_code for x in results] == [200, 200, 200]
    assert llm.cache.active_slots == []


def test_max_queue_0_takes_requests_while_a_batch_place_is_free(llm, server):
    """--max-queue 0: no request waits; one is taken while a place of --max-num-seqs is free (n=2 on
    an idle server of 2 places too), the next gets 503 with Retry-After while they run."""
    state, engine, release = _held_engine(llm, server, max_num_seqs=2, max_queue=0)
    body = {"model": MODEL, "prompt": "no queue", "max_tokens": 3}
    with ServerThread(build_app(state)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={**body, "n": 3}, timeout=WAIT_S)
        assert r.status_code == 400 and "n must be in [1, 2], got 3" in r.text and "(--max-num-seqs 2 + --max-queue 0)" in r.text, r.text
        results: list = []
        both = threading.Thread(target=lambda: results.append(httpx.post(srv.url + "/v1/completions", json={**body, "n": 2},
                                                                         timeout=WAIT_S)))
        both.start()
        wait_until(lambda: engine.snapshot()["waiting"] + engine.snapshot()["running"] >= 2, "n=2 to be taken")
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
        assert "of the 2 places in the batch are taken (--max-num-seqs 2; --max-queue 0: no request waits)" in r.text
        release.set()
        both.join(WAIT_S)
        assert results[0].status_code == 200 and len(results[0].json()["choices"]) == 2, results[0].text
        for _ in range(2):  # idle again: each is taken at once
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=WAIT_S).status_code == 200
    assert llm.cache.active_slots == []


def test_engine_failure_fails_the_request_alone(server, monkeypatch):
    core = server.engine.core
    real = core._prefill_chunk

    def prefill(req):
        if req.prompt_ids == server.state.tokenizer.encode("boom"):
            raise RuntimeError("injected failure")
        return real(req)

    monkeypatch.setattr(core, "_prefill_chunk", prefill)
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 3}, timeout=WAIT_S)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "fine", "max_tokens": 3}, timeout=WAIT_S)
    assert r.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


# ---------------------------------------------------------------- metrics
def test_metrics_count_what_was_served(server):
    wait_until(lambda: server.engine.snapshot()["running"] == 0, "the server to be idle")
    before = metrics(server.url)
    usages = []
    for i, stream in enumerate([False, True, False]):
        body = {"model": MODEL, "prompt": TEXTS[i], "max_tokens": 4 + i, "ignore_eos": True, "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {})}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 200
        usages.append(r.json()["usage"] if not stream else sse(r.text.splitlines())[-1]["usage"])
    refused = [httpx.post(server.url + "/v1/completions", json=body, timeout=WAIT_S).status_code
               for body in ({"model": "nope", "prompt": "hi"}, {"model": MODEL, "prompt": 5})]
    assert refused == [404, 400]
    wait_until(lambda: server.engine.snapshot()["running"] == 0, "the requests to finish")
    after = metrics(server.url)

    def delta(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert delta("writescope:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("writescope:generation_tokens_total") == sum(u["completion_tokens"] for u in usages) == 4 + 5 + 6
    assert delta("writescope:request_success_total", (("finished_reason", "length"),)) == 3
    assert [delta("writescope:request_refused_total", (("status", c),)) for c in ("404", "400")] == [1, 1]
    assert delta("writescope:time_to_first_token_seconds_count") == 3
    assert delta("writescope:e2e_request_latency_seconds_count") == 3
    assert delta("writescope:inter_token_latency_seconds_count") == 3 + 4 + 5
    assert after[("writescope:num_requests_running", ())] == 0
    assert after[("writescope:kv_cache_tokens", (("region", "device"),))] == 0


# ---------------------------------------------------------------- the command line
def test_max_queue_0_counts_a_request_admitted_this_step_once(llm, server):
    """A request the scheduler admitted is still among the submitted ids until its first step is
    published: while that step runs, one place of two is taken, not two."""
    wait_until(lambda: server.engine.snapshot()["running"] == 0, "the module server to be idle")  # they share the model
    engine = AsyncEngine(llm, max_num_seqs=2, max_queue=0)
    inside, release = threading.Event(), threading.Event()
    real = engine.core._prefill_chunk

    def held_prefill(req):  # the first request's first step: admitted, running
        inside.set()
        release.wait(WAIT_S)
        return real(req)

    engine.core._prefill_chunk = held_prefill
    engine.start()
    ids = llm.tokenizer.encode("one place of two")

    async def both():
        first = engine.submit(ids, SamplingParams(max_tokens=2))
        for _ in range(WAIT_S * 100):  # a bound, not a timing: the step comes at once
            if inside.is_set():
                break
            await asyncio.sleep(0.01)
        assert inside.is_set(), "the first request's prefill never ran"
        second = engine.submit(ids, SamplingParams(max_tokens=2))  # QueueFull here before the fix
        release.set()
        return [[o async for o in first], [o async for o in second]]

    try:
        outs = asyncio.run(both())
    finally:
        release.set()
        engine.shutdown()
    assert all(o and o[-1][1].finished for o in outs)


def test_cli_refuses_bad_flags_before_binding(capsys):
    from writescope.cli.main import main

    assert main(["serve", "--model", MODEL, "--max-queue", "-1"]) == 2
    assert "--max-queue must be >= 0, got -1" in capsys.readouterr().err
    assert main(["serve", "--model", MODEL, "--port", "70000"]) == 2
    assert "--port" in capsys.readouterr().err
    for bad in ("-1", "nan", "1e6"):
        assert main(["serve", "--model", MODEL, "--shutdown-grace", bad]) == 2
        assert f"--shutdown-grace must be seconds from 0 to 86400, got {float(bad)}" in capsys.readouterr().err


@pytest.fixture
def no_listening(monkeypatch):
    """The server must not start: uvicorn's ``Server.run`` fails the test."""
    import uvicorn

    def run(*args, **kwargs):
        raise AssertionError("the server started listening")

    monkeypatch.setattr(uvicorn.Server, "run", run)


REFUSED = [  # what LLM would refuse once the server listens, refused before: (flags, environment, words)
    (["--policy", "bogus"], {}, "unknown policy 'bogus'"),
    (["--model", "no-such-model"], {}, "--model 'no-such-model' is neither a checkpoint directory nor a preset"),
    (["--model", "/no/such/dir"], {}, "--model '/no/such/dir': no checkpoint directory there"),
    (["--device", "tpu"], {}, "unknown device 'tpu'"),
    (["--dtype", "int3"], {}, "int3"),
    (["--vram-budget", "lots"], {}, "--vram-budget: 'lots' is not a size"),
    ([], {"WRITESCOPE_CPU_ATTENTION": "flsh"}, "WRITESCOPE_CPU_ATTENTION='flsh'"),
    ([], {"WRITESCOPE_CPU_ATTENTION": "kernel", "WRITESCOPE_CPU_ISA": "avx9"}, "WRITESCOPE_CPU_ISA='avx9'"),
    ([], {"WRITESCOPE_GPU_ATTENTION": "cudnn"}, "WRITESCOPE_GPU_ATTENTION='cudnn'"),
    (["--max-model-len", "10000000"], {}, "--max-model-len 10000000 must be in [1, "),
    (["--vram-budget", "1MiB"], {}, "a GPU budget of 0.001 GiB is below the minimum of"),  # the plan, as LLM makes it
]


@pytest.mark.parametrize("flags, env, words", REFUSED, ids=["policy", "preset", "directory", "device", "dtype", "vram-budget",
                                                             "cpu-attention", "cpu-isa", "gpu-attention", "max-model-len",
                                                             "vram-budget-too-small"])
def test_cli_refuses_what_llm_would_before_listening(capsys, monkeypatch, no_listening, flags, env, words):
    from writescope.cli.main import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    argv = ["serve", "--model", MODEL, "--port", "0", *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("writescope serve: error: ") and words in err and "Error: " not in err, err


def test_cli_help_says_what_max_queue_0_does(capsys):
    from writescope.cli.main import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "0: none wait: a request is taken while one of the --max-num-seqs places is free" in " ".join(capsys.readouterr().out.split())


def test_cli_load_failure_stops_the_server(capsys):
    """The model loads after the server binds (so /health can say 503): a load that fails stops it,
    exit 2, saying why in the command's flags, without the exception's class."""
    from writescope.cli.main import main

    argv = ["serve", "--model", MODEL, "--device", "cpu", "--vram-budget", "1MiB", "--port", "0", "--log-level", "warning"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("writescope serve: error: a GPU budget of 0.001 GiB is below the minimum"), err
    assert "raise --vram-budget, lower --max-num-seqs or --max-model-len" in err and "PlanDoesNotFit" not in err


def test_serve_says_the_vram_budget_plan_on_the_cpu_too(capsys):
    """With --vram-budget, serve prints the budget's line as generate does; on the CPU, worded as
    generate words it there (the split only shows where the experts would live), before the
    ready line. The model load (serve's own, after the server listens) runs here without uvicorn."""
    import argparse
    import types

    from writescope.cli import serve as serve_cli
    from writescope.cli.main import main

    parser = argparse.ArgumentParser()
    serve_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", MODEL, "--device", "cpu", "--vram-budget", "2GiB", "--max-model-len", "512",
                              "--max-num-seqs", "2", "--port", "0"])
    state = ServerState(MODEL)
    serve_cli._load(args, state, types.SimpleNamespace(started=True, should_exit=False, servers=[]))
    try:
        assert state.load_error is None and state.engine is not None, state.load_error
        out = capsys.readouterr().out.splitlines()
    finally:
        state.engine.shutdown()
    budget = [line for line in out if "VRAM budget" in line]
    assert len(budget) == 1 and budget[0].startswith("writescope serve: VRAM budget 2.00 GiB: "), out
    assert "(the device is the CPU here: the split only shows where they would live)" in budget[0], budget
    assert out.index(budget[0]) < next(i for i, line in enumerate(out) if " ready on http" in line)
    assert main(["generate", "--model", MODEL, "--device", "cpu", "--vram-budget", "2GiB", "--prompt", "hi",
                 "--max-new-tokens", "1", "--quiet"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "VRAM budget" in line]
    assert said == [budget[0].removeprefix("writescope serve: ")], said  # the same words as generate's


def test_chat_template_from_tokenizer_config(tmp_path):
    from writescope.serve.chat_template import ChatTemplate

    msgs = [{"role": "user", "content": "hi"}]
    assert ChatTemplate.for_model(str(tmp_path)).render(msgs) == "user: hi\nassistant:"  # no tokenizer_config.json
    tpl = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tpl, "bos_token": "<s>",
                                                                 "eos_token": {"content": "</s>"}}))
    assert ChatTemplate.for_model(str(tmp_path)).render(msgs) == "<s><|user|>hi</s><|assistant|>"
    bad = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        bad.render(msgs)


def test_busy_fractions_from_the_decoder_s_totals():
    """/metrics' CPU and link busy fractions: the CPU attention's seconds and the streamed bytes
    (at the calibrated B) per wall second between two samples."""
    import types

    import torch

    from writescope.config import KVLayout
    from writescope.kvcache.inplace import InplaceKVCache
    from writescope.kvcache.spec import PartitionSpec, Roofline
    from writescope.scheduler.roofline import WriteScopePolicy
    from writescope.serve.metrics import ServeMetrics

    spec = PartitionSpec(KVLayout(2, 16, 16, False), 1, torch.float32, window=8)
    cache = InplaceKVCache(spec, WriteScopePolicy(Roofline(a=1e-8, b=2e-8)), "cpu")
    core = types.SimpleNamespace(scheduler=types.SimpleNamespace(active=[], waiting=[]), llm=types.SimpleNamespace(cache=cache))
    m = ServeMetrics()
    try:
        m.sample_engine(core, now=10.0)  # the first sample only starts the clock
        st = cache.decoder._stats
        st.cpu_seconds += 0.25
        st.streamed_bytes += 1000 * spec.token_bytes
        m.sample_engine(core, now=11.0)
        get = m.registry.get_sample_value
        assert get("writescope:cpu_attention_busy_fraction") == pytest.approx(0.25)
        assert get("writescope:link_streamed_bytes_per_second") == pytest.approx(1000 * spec.token_bytes)
        assert get("writescope:link_busy_fraction") == pytest.approx(1000 * 2e-8)
    finally:
        cache.close()


def test_metrics_count_pinned_memory(monkeypatch):
    """/metrics' pinned-memory counters follow this process's page-locking from the server's
    start (through a pool over a fake registration: the CPU has none), and the pool's idle bytes."""
    import types

    import torch

    from writescope.kvcache import pinned
    from writescope.kvcache.pinned_pool import PinnedPool
    from writescope.serve.metrics import ServeMetrics

    live = {}
    pool = PinnedPool(lambda p, n: live.__setitem__(p, n) or 0, lambda p: live.pop(p) and 0, 64 << 20, lambda: None, pinned.STATS)
    monkeypatch.setattr(pinned, "POOL", pool)
    core = types.SimpleNamespace(scheduler=types.SimpleNamespace(active=[], waiting=[]),
                                 llm=types.SimpleNamespace(cache=types.SimpleNamespace(seq_len=lambda s: 0)))
    pinned.unpin(pinned.host_empty((1 << 20,), torch.uint8, pin=True))  # before the server: not counted
    m = ServeMetrics()
    a = pinned.host_empty((1 << 20,), torch.uint8, pin=True)  # lent again
    b = pinned.host_empty((3 << 20,), torch.uint8, pin=True)  # registered
    pinned.unpin(a)
    m.sample_engine(core)
    get = m.registry.get_sample_value
    assert get("writescope:pinned_registered_bytes_total") == 3 << 20
    assert get("writescope:pinned_reused_bytes_total") == 1 << 20
    assert get("writescope:pinned_register_seconds_total") >= 0
    assert get("writescope:pinned_pool_idle_bytes") == 1 << 20
    pinned.unpin(b)
    m.sample_engine(core)
    assert get("writescope:pinned_pool_idle_bytes") == 4 << 20 and get("writescope:pinned_registered_bytes_total") == 3 << 20


def test_a_batch_of_one_prompt_is_that_prompt(server):
    """``["hi"]`` (and ``[[ids]]``), as OpenAI clients send one prompt, gives that prompt's answer."""
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    one = httpx.post(server.url + "/v1/completions", json={**body, "prompt": "hi"}, timeout=WAIT_S).json()
    listed = httpx.post(server.url + "/v1/completions", json={**body, "prompt": ["hi"]}, timeout=WAIT_S).json()
    assert listed["choices"][0]["text"] == one["choices"][0]["text"]


@pytest.mark.parametrize("signame, words", [("SIGINT", "stopped (Ctrl-C)"), ("SIGTERM", "stopped (SIGTERM)")])
def test_ctrl_c_stops_the_server_gracefully_and_quietly(signame, words):
    """The signal with a streamed request in flight: the request finishes within the grace (~300
    tokens: a second or so here; the grace is 600 s in this test) with finish_reason "length" and ``[DONE]`` (never
    "abort"; a request still running when the grace ends gets a 503: test_serve_shutdown.py),
    uvicorn stops and hands the signal back; the command says it stopped and exits 0, with no
    traceback and no request failed."""
    import os
    import signal
    import subprocess
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start():
        proc = subprocess.Popen([sys.executable, "-m", "writescope", "serve", "--model", MODEL, "--device", "cpu", "--port", "0",
                                 "--shutdown-grace", "600"],  # the stream ends within the grace however loaded this machine is
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        seen: list[str] = []
        reader = threading.Thread(target=lambda: seen.extend(iter(proc.stdout.readline, "")), daemon=True)
        reader.start()
        try:
            wait_until(lambda: any(" ready on http" in line for line in seen) or proc.poll() is not None, "the server to be ready")
        except BaseException:
            proc.kill()
            raise
        return proc, seen, reader

    proc, seen, reader = start()
    if proc.poll() is not None and "ModuleNotFoundError" in "".join(seen):
        # once in a clean CI run the fresh process could not import a module of uvicorn's (h11._headers,
        # whose file was there): the environment's, not the server's; a second failure still fails
        reader.join(WAIT_S)
        proc, seen, reader = start()
    try:
        assert any(" ready on http" in line for line in seen), "".join(seen)
        url = next(line for line in seen if " ready on http" in line).split(" ready on ")[1].split()[0]
        events: list[str] = []
        assert not url.endswith(":0"), url  # the port --port 0 picked
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 300, "ignore_eos": True, "stream": True, "temperature": 0}

        def stream():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=WAIT_S) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        wait_until(lambda: len(events) >= 2, "the stream to start")
        at_signal = len(events)
        proc.send_signal(getattr(signal, signame))
        client.join(WAIT_S)
        proc.wait(timeout=WAIT_S)
        reader.join(WAIT_S)
        assert events[-1] == "data: [DONE]" and '"finish_reason": "length"' in events[-2], events[-3:]
        assert len(events) > at_signal + 1  # tokens came after the signal (the stream is a few of its ~300 tokens in)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(seen)
    assert proc.returncode == 0, text
    assert "Waiting for application shutdown" in text and f"writescope serve: {words}\n" in text and "Traceback" not in text, text
    assert "graceful shutdown exceeded" not in text, text


def test_a_stop_as_the_engine_starts_stops_it_too():
    """``ServerState.ready`` after the server began to stop (``closing``: Ctrl-C while the model
    loaded) shuts the engine down at once, so no engine thread outlives the server."""
    from writescope.serve.app import ServerState

    class Engine:
        metrics = None
        calls: list = []

        def start(self):
            self.calls.append("start")

        def shutdown(self, timeout=None):
            self.calls.append(("shutdown", timeout))

    state = ServerState(MODEL, closing=True)
    engine = Engine()
    state.ready(engine, tokenizer=None)
    assert engine.calls == ["start", ("shutdown", 0)] and state.engine is engine
    open_state, other = ServerState(MODEL), Engine()
    other.calls = []
    open_state.ready(other, tokenizer=None)
    assert other.calls == ["start"]


def test_a_chunked_body_is_held_to_the_size_limit(server, monkeypatch):
    """A body sent without Content-Length (chunked) is counted as it arrives: past the limit a 413,
    and under it the request is served as a sized one is."""
    import writescope.serve.app as app

    monkeypatch.setattr(app, "MAX_BODY_BYTES", 4096)  # read by the guard on each request
    big = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "x" * 10_000}).encode()

    def chunks(b):
        for i in range(0, len(b), 1000):
            yield b[i : i + 1000]

    r = httpx.post(server.url + "/v1/completions", content=chunks(big), headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert r.status_code == 413 and "more than 4,096 bytes" in r.json()["error"]["message"], r.text
    small = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    r = httpx.post(server.url + "/v1/completions", content=chunks(small), headers={"content-type": "application/json"}, timeout=WAIT_S)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_a_tiny_temperature_samples_greedily_and_fails_no_one(server):
    """logits / 1e-38 overflows: such a temperature is greedy (as vLLM below 1e-5), not a failed step."""
    for t in (1.2e-38, 1e-300, 9e-6):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5, "temperature": t},
                       timeout=WAIT_S)
        assert r.status_code == 200, (t, r.text)
    greedy = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5, "temperature": 0},
                        timeout=WAIT_S)
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


def test_a_seed_torch_cannot_take_is_refused_naming_it(server):
    for seed, n in ((2**64, 1), (2**64 - 1, 2), (-2**63 - 1, 1)):
        r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed, "n": n,
                                                             "temperature": 1}, timeout=WAIT_S)
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
        assert "seed must be an integer in [-2**63, 2**64 - n]" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 2**64 - 2, "n": 2,
                                                         "temperature": 1}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
