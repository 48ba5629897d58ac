"""A stop of ``writescope serve`` with requests in flight (writescope/serve/server.py): they may
finish within the grace period (``grace_s``); those still running when it ends are failed, 503
(streamed: an error event, then ``[DONE]``), never a 200 with the engine's internal finish reason
"abort". The engine's steps are held by an event, so what is in flight when the stop comes, and
when the grace ends, is set by the test, not by timing."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from writescope import LLM  # noqa: E402
from writescope.serve.app import ServerState, build_app  # noqa: E402
from writescope.serve.async_engine import AsyncEngine  # noqa: E402
from writescope.serve.server import ServerThread  # noqa: E402
from serve_helpers import MODEL, WAIT_S, held_engine, sse, wait_until  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, device="cpu", progress=False, max_model_len=1024, prefill_chunk_tokens=16)


def held_server(llm, grace_s: float):
    """A server (not started) over an engine whose steps wait for the returned event."""
    state, engine, release = held_engine(llm, 4, 4)
    return ServerThread(build_app(state), grace_s=grace_s), state, engine, release


def send_both(srv, max_tokens: int) -> tuple[dict, list[threading.Thread]]:
    """A whole and a streamed completion, sent from threads; their responses land in the dict."""
    got: dict = {}
    body = {"model": MODEL, "prompt": "in flight", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}

    def send(stream: bool):
        got[stream] = httpx.post(srv.url + "/v1/completions", json={**body, "stream": stream}, timeout=WAIT_S)

    threads = [threading.Thread(target=send, args=(s,)) for s in (False, True)]
    for t in threads:
        t.start()
    return got, threads


def taken(engine, n: int):
    return lambda: engine.snapshot()["waiting"] + engine.snapshot()["running"] == n


def stop_while_held(srv, engine, release, max_tokens: int, until, what: str) -> dict:
    """Start the server, send a whole and a streamed completion of ``max_tokens`` while the
    engine's steps are held, stop the server once both are taken, let the steps go once ``until()``
    (``what``), and wait for the requests and the stop to end; the responses by ``stream``."""
    srv.start()
    try:
        got, threads = send_both(srv, max_tokens=max_tokens)
        wait_until(taken(engine, 2), "both requests to be taken")
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        wait_until(until, what)
    finally:
        release.set()
    for t in (*threads, stopper):
        t.join(WAIT_S)
    return got


def test_requests_in_flight_finish_within_the_grace(llm):
    srv, state, engine, release = held_server(llm, grace_s=WAIT_S)
    got = stop_while_held(srv, engine, release, 3, lambda: state.closing, "the stop to begin")
    assert not srv.thread.is_alive() and not engine._thread.is_alive()
    assert got[False].status_code == 200, got[False].text
    assert got[False].json()["choices"][0]["finish_reason"] == "length"
    assert got[True].status_code == 200
    finishes = [c["finish_reason"] for e in sse(got[True].text) for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    assert state.stopped is None and state.failed_at_stop == 0
    assert llm.cache.active_slots == []


def test_requests_still_running_when_the_grace_ends_get_503(llm):
    """Grace 0: the requests (held: they cannot have finished) are failed as the stop begins:
    the whole one with a 503 error body, the stream (its 200 already sent) with an error event of
    code 503, then [DONE]; no "abort" reaches the client."""
    srv, state, engine, release = held_server(llm, grace_s=0)
    got = stop_while_held(srv, engine, release, 500, lambda: state.stopped is not None, "the grace to end")
    assert not srv.thread.is_alive() and not engine._thread.is_alive()
    whole = got[False]
    assert whole.status_code == 503, whole.text
    err = whole.json()["error"]
    assert err["type"] == "service_unavailable" and err["code"] == 503
    assert err["message"].startswith("the server is shutting down: the request was cancelled before it finished"), err
    assert "still running 0 s after the server was asked to stop" in err["message"], err
    streamed = got[True]
    assert streamed.status_code == 200  # sent before the stop
    events = sse(streamed.text)  # ends with exactly one [DONE]
    assert "error" in events[-1] and events[-1]["error"]["code"] == 503, events[-1]
    assert events[-1]["error"]["message"] == err["message"]
    assert not [c for e in events[:-1] for c in e["choices"] if c["finish_reason"] is not None]
    assert "abort" not in whole.text + streamed.text
    assert state.failed_at_stop == 2
    assert llm.cache.active_slots == []


def test_a_failed_engine_thread_fails_its_requests_with_500(llm):
    """The engine thread dying ends its requests (internally "abort"): the client gets 500 naming
    the failure, not a 200 with finish_reason "abort" (nor no answer: the streamed request is
    submitted while the failing step runs, so it is still in the engine's inbox when it dies)."""
    state = ServerState(MODEL)
    engine = AsyncEngine(llm, max_num_seqs=4, max_queue=4)
    inside, release = threading.Event(), threading.Event()

    def failing_step():
        inside.set()
        release.wait(WAIT_S)
        raise RuntimeError("injected engine failure")

    engine.core.step = failing_step
    state.ready(engine, llm.tokenizer)
    body = {"model": MODEL, "prompt": "in flight", "max_tokens": 5}
    got: dict = {}

    def send(stream: bool):
        got[stream] = httpx.post(srv.url + "/v1/completions", json={**body, "stream": stream}, timeout=WAIT_S)

    with ServerThread(build_app(state)) as srv:
        threads = [threading.Thread(target=send, args=(False,)), threading.Thread(target=send, args=(True,))]
        threads[0].start()
        wait_until(inside.is_set, "the first request's step")
        threads[1].start()
        wait_until(taken(engine, 2), "the second request to be submitted")
        release.set()
        for t in threads:
            t.join(WAIT_S)
        assert got[False].status_code == 500, got[False].text
        assert "injected engine failure" in got[False].json()["error"]["message"]
        last = sse(got[True].text)[-1]
        assert last["error"]["code"] == 500 and "injected engine failure" in last["error"]["message"], last
        assert "abort" not in got[False].text + got[True].text
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=WAIT_S)
        assert r.status_code == 503 and "injected engine failure" in r.json()["error"]["message"], r.text
    assert state.failed_at_stop == 0 and llm.cache.active_slots == []
