"""Shared pieces of the loopback-server tests (test_serve.py, test_serve_api.py, test_serve_echo.py):
the server, waits, and requests to it; imported after ``pytest.importorskip`` of the serve extra."""

from __future__ import annotations

import json
import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from writescope.serve.app import ServerState, build_app
from writescope.serve.async_engine import AsyncEngine
from writescope.serve.server import ServerThread

WAIT_S = 120  # safety net only: every wait polls a condition
MODEL = "tiny-qwen3-moe"  # the preset the requests below name


def start_server(llm, model: str) -> ServerThread:
    """A loopback server for ``llm`` (8 seats, a queue of 64), ready; ``.engine`` and ``.state`` set."""
    state = ServerState(model)
    engine = AsyncEngine(llm, max_num_seqs=8, max_queue=64)
    state.ready(engine, llm.tokenizer)
    srv = ServerThread(build_app(state)).start()
    srv.engine, srv.state = engine, state
    return srv


def stop_server(srv, llm) -> None:
    """Stop it and check the engine thread ended and every slot was freed."""
    srv.stop()
    assert not srv.engine._thread.is_alive() and llm.cache.active_slots == []


def wait_until(cond, what: str) -> None:
    ev = threading.Event()
    for _ in range(int(WAIT_S / 0.02)):
        if cond():
            return
        ev.wait(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def metrics(url: str) -> dict:
    """{(sample name, labels): value} of /metrics, parsed by prometheus-client."""
    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=WAIT_S)


def complete(server, **body) -> dict:
    r = post(server, "/v1/completions", **body)
    assert r.status_code == 200, r.text
    return r.json()


def sse(text: str) -> list[dict]:
    """The JSON events of a server-sent-event body, checking it ends with exactly one [DONE]."""
    data = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]" and data.count("[DONE]") == 1, data[-3:]
    return [json.loads(d) for d in data[:-1]]


def stream(server, path: str = "/v1/completions", **body) -> list[dict]:
    r = post(server, path, stream=True, **body)
    assert r.status_code == 200, r.text
    return sse(r.text)


def per_choice(events: list[dict], chat: bool = False) -> dict[int, dict]:
    """{index: {"text", "finish" (list of finish reasons seen), "ids", "logprobs" (chunks' logprobs), "texts" (running),
    "stop_reason" (list of the non-null stop reasons seen)}}."""
    out: dict[int, dict] = {}
    for e in events:
        for c in e["choices"]:
            s = out.setdefault(c["index"], {"text": "", "finish": [], "ids": [], "logprobs": [], "texts": [],
                                                "stop_reason": []})
            s["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            s["texts"].append(s["text"])
            s["ids"] += c.get("token_ids", [])
            if c["finish_reason"] is not None:
                s["finish"].append(c["finish_reason"])
            if c["logprobs"] is not None:
                s["logprobs"].append(c["logprobs"])
            if c.get("stop_reason") is not None:
                s["stop_reason"].append(c["stop_reason"])
    return out


def held_engine(llm, max_num_seqs: int, max_queue: int, idle=None):
    """A server state over a new engine on ``llm`` whose steps wait for the returned event (set it
    to let them run): ``(state, engine, release)``. ``idle``: a module server sharing the model,
    waited for until it runs nothing."""
    state = ServerState(MODEL)
    engine = AsyncEngine(llm, max_num_seqs=max_num_seqs, max_queue=max_queue)
    release, real = threading.Event(), engine.core.step

    def held_step():
        release.wait(WAIT_S)
        return real()

    engine.core.step = held_step
    state.ready(engine, llm.tokenizer)
    if idle is not None:
        wait_until(lambda: idle.engine.snapshot()["running"] == 0, "the module server to be idle")
    return state, engine, release
