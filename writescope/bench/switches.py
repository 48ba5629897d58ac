"""Per-row environment switches of ``writescope bench``: ``POLICY@NAME=VALUE+NAME=VALUE``.

A grid row may run a policy under other settings of the switches that are read when a cache is
made or on every forward, so variants compare in one process on the loaded weights (one model
load, one random KV fill per row) instead of one process each, e.g.
``--policies "static:0.5,static:0.5@WRITESCOPE_MICRO_BATCHES=2,gpu@WRITESCOPE_MOE_KERNEL=grouped"``.

Besides the environment switches a row may set the engine's ``expert_stream_share`` (a float in
[0, 1], or ``auto``: the device's default and, under ``writescope``, its per-step split), so fixed
expert splits compare with the joint roofline's in one process:
``--policies "writescope,writescope@expert_stream_share=0,writescope@expert_stream_share=0.5"``.

A row's policy is set (``LLM.set_policy``) under its switches, so what is read then follows the
row: ``WRITESCOPE_CPU_THREADS`` gives the CPU attention worker its threads and, unless the engine
was given ``expert_threads`` (``--expert-threads``), the native host-expert worker too (a running
one made with another count or another CPU team is made again on its next use:
moe/async_experts.py ``WorkerHandle.refresh``), e.g.
``--policies "writescope,writescope@WRITESCOPE_CPU_THREADS=14"`` leaves two more cores free of both.

Limits: the device-memory plan made at load stands (a switch that needs more device memory, such
as more ping-pong buffers, is not re-planned, and may not fit where the default does); adaptive
policies keep the roofline calibrated at load under the default switches; the CUDA graphs switch
is read once per model, so it is not offered here.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator

from writescope.engine.arguments import parse_share


PER_ROW = ("WRITESCOPE_MICRO_BATCHES", "WRITESCOPE_MOE_KERNEL", "WRITESCOPE_LOAD_READ", "WRITESCOPE_LOAD_STREAM", "WRITESCOPE_LOAD_COPIES",
           "WRITESCOPE_PINGPONG_BUFFERS", "WRITESCOPE_GPU_ATTENTION", "WRITESCOPE_CPU_TUNING", "WRITESCOPE_CPU_PARTIAL", "WRITESCOPE_CPU_THREADS", "WRITESCOPE_CPU_PIN",
           "WRITESCOPE_HUGE_PAGES", "WRITESCOPE_CPU_PREREAD", "WRITESCOPE_EXPERT_WORKER",
           "WRITESCOPE_EXPERT_BALANCE", "WRITESCOPE_CPU_TEAM",
           "WRITESCOPE_GRAPH_SPLIT", "WRITESCOPE_GRAPH_EXPERTS", "WRITESCOPE_EXPERT_OUTPUT", "WRITESCOPE_LINK_FIXED")  # read when a policy is set (its cache, its CPU workers) or on every forward


SETTINGS = ("expert_stream_share",)  # engine settings a row may set (not environment variables)


def settings(switches: dict[str, str]) -> tuple[dict[str, str], dict[str, float | None]]:
    """A row's switches split into environment switches and engine settings (parsed)."""
    env = {k: v for k, v in switches.items() if k not in SETTINGS}
    return env, {k: parse_share(v) for k, v in switches.items() if k in SETTINGS}


def _readers() -> dict[str, Callable[[], object]]:
    from writescope.engine.switches import readers

    every = readers()
    return {name: every[name] for name in PER_ROW}


def split(entry: str) -> tuple[str, dict[str, str]]:
    """``"static:0.5@A=1+B=x"`` -> ``("static:0.5", {"A": "1", "B": "x"})``; no ``@``: no switches.

    Raises:
        ValueError: an assignment without ``=`` or with an empty name (names the entry).
    """
    policy, _, rest = entry.partition("@")
    switches: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split("+"))):
        name, eq, value = part.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"policy {entry!r}: switch {part!r} is not NAME=VALUE (e.g. static:0.5@WRITESCOPE_MICRO_BATCHES=2)")
        switches[name.strip()] = value.strip()
    return policy.strip(), switches


def check(entry: str) -> None:
    """Check an entry's switches before any work: known names, values their readers accept.

    Raises:
        ValueError: an unknown switch (names the ones offered), or a bad value (the reader's message).
    """
    _, switches = split(entry)
    try:
        switches, _ = settings(switches)
    except ValueError as e:
        raise ValueError(f"policy {entry!r}: {e}") from None
    readers = _readers()
    for name in switches:
        if name not in readers:
            import difflib

            close = difflib.get_close_matches(name, [*readers, *SETTINGS], n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"policy {entry!r}: {name} is not a per-row switch; {hint}use {', '.join(readers)} or {', '.join(SETTINGS)}")
    with applied(switches):
        for name in switches:
            try:
                readers[name]()
            except ValueError as e:
                raise ValueError(f"policy {entry!r}: {e}") from None


@contextmanager
def applied(switches: dict[str, str]) -> Iterator[None]:
    """The environment with ``switches`` set, restored afterwards (also on errors)."""
    old = {k: os.environ.get(k) for k in switches}
    os.environ.update(switches)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
