"""Module-scoped fixtures shared by the serve API test files (test_serve_api.py,
test_serve_echo.py): the served tiny model, an independent reference instance of it, its greedy
reference completion and the loopback server. Import the fixture names into a test module to use
them (each module gets its own instances)."""

from __future__ import annotations

import pytest

from writescope import LLM, SamplingParams
from serve_helpers import MODEL, start_server, stop_server

MAX_LEN = 2048
PROMPT = "hello"
NEW = 24  # greedy reference length
NEVER = "\x00never\x00"  # a stop string the model does not produce
CHAT = [{"role": "user", "content": "hi"}]


def served_llm() -> LLM:
    return LLM(MODEL, device="cpu", progress=False, max_model_len=MAX_LEN, prefill_chunk_tokens=16)


@pytest.fixture(scope="module")
def llm():
    """The served model (owned by the server's engine thread once it starts)."""
    return served_llm()


@pytest.fixture(scope="module")
def ref_llm():
    """An independent instance for references (same preset and seed: the same weights)."""
    return served_llm()


@pytest.fixture(scope="module")
def greedy(ref_llm):
    out = ref_llm.generate([PROMPT], SamplingParams(max_tokens=NEW))[0]
    assert out.finish_reason == "length"  # the references need all NEW tokens
    return out


@pytest.fixture(scope="module")
def server(llm):
    srv = start_server(llm, MODEL)
    yield srv
    stop_server(srv, llm)
