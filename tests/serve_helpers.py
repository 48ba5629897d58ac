"""Shared pieces of the loopback-server tests (test_serve.py, test_serve_api.py); imported after
``pytest.importorskip`` of the serve extra."""

from __future__ import annotations

import threading

import httpx
from prometheus_client.parser import text_string_to_metric_families

from writescope.serve.app import ServerState, build_app
from writescope.serve.async_engine import AsyncEngine
from writescope.serve.server import ServerThread

WAIT_S = 120  # safety net only: every wait polls a condition


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
