"""Stopping the server with nothing in flight takes no wait of its own (no timing asserted: CI is
loaded): the idle engine thread sleeps on its inbox with no timeout and is woken by the stop
message (no poll, no join running out), and uvicorn does not enter its graceful wait for
connections when the only connection left is an idle keep-alive one."""

from __future__ import annotations

import logging
import queue

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from writescope import LLM  # noqa: E402
from writescope.serve.app import ServerState, build_app  # noqa: E402
from writescope.serve.async_engine import AsyncEngine  # noqa: E402
from writescope.serve.server import ServerThread  # noqa: E402
from serve_helpers import MODEL, WAIT_S, wait_until  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, device="cpu", progress=False, max_model_len=512, prefill_chunk_tokens=16)


class SpyInbox(queue.SimpleQueue):
    """The engine's inbox, recording the timeout of each blocking ``get`` (``get_nowait`` is C's own)."""

    def __init__(self):
        self.gets: list[tuple[bool, float | None]] = []

    def get(self, block=True, timeout=None):
        self.gets.append((block, timeout))
        return super().get(block, timeout)


def test_an_idle_engine_sleeps_on_its_inbox_and_the_stop_wakes_it(llm):
    engine = AsyncEngine(llm, max_num_seqs=2, max_queue=2)
    engine._inbox = inbox = SpyInbox()
    engine.start()
    wait_until(lambda: inbox.gets, "the engine thread to wait on its inbox")
    engine.shutdown(timeout=WAIT_S)  # a safety net: the stop message ends the wait, not the timeout
    assert not engine._thread.is_alive() and engine.error is None
    assert inbox.gets == [(True, None)]  # one blocking wait, with no timeout: woken by "stop", no poll
    assert llm.cache.active_slots == []


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_stop_with_an_idle_keep_alive_client_takes_no_graceful_wait(llm):
    """A client that keeps its connection open (httpx, the openai client) after its request: the stop
    closes it at once; uvicorn neither waits for connections nor runs out its graceful timeout."""
    state = ServerState(MODEL)
    engine = AsyncEngine(llm, max_num_seqs=2, max_queue=2)
    state.ready(engine, llm.tokenizer)
    srv = ServerThread(build_app(state))  # its Config set uvicorn's log levels: INFO is raised after it
    log = logging.getLogger("uvicorn.error")
    records, level = Records(), log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    try:
        srv.start()
        with httpx.Client(timeout=WAIT_S) as client:
            r = client.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            srv.stop()  # the client's connection is still open (keep-alive)
    finally:
        log.removeHandler(records)
        log.setLevel(level)
    assert not srv.thread.is_alive() and not engine._thread.is_alive() and llm.cache.active_slots == []
    text = "\n".join(records.messages)
    assert "Shutting down" in text and "Application shutdown complete" in text, text  # the records were seen
    assert "Waiting for connections to close" not in text and "graceful shutdown exceeded" not in text, text
