"""Host calls that a CUDA graph's replays make before the graph's work (models/graphs.py).

A graph holds device work only. A stage whose work includes a host call made every pass (the
native expert worker is handed its job: moe/async_experts.py ``captured_into``) registers that
call with :func:`on_replay` while it is captured; each replay of the graph then calls it first, on
the thread that replays, before the graph is queued. It lives here, not in models/graphs.py,
because the MoE block (below the models package) asks :func:`capturing`.
"""

from __future__ import annotations

from typing import Callable

_hooks: list | None = None  # while a stage is captured: the calls its replays make first
_replaying: list | None = None  # the tests' stand-in for a replay: the hooks the capture registered
_next = 0


def capturing() -> bool:
    """Whether a stage is being captured now (models/graphs.py ``CudaCapture``): host calls made
    now would not be made by its replays, so they register with :func:`on_replay` instead."""
    return _hooks is not None


def on_replay(fn: Callable[[], None]) -> Callable[[], None]:
    """Have every replay of the graph being captured call ``fn()`` first (not called at the
    capture itself). Returns the hook the replays call: ``fn``, or, where a test re-runs a
    captured stage's Python as its replay (``collecting(replaying=...)``), the hook the capture
    registered in this place, whose state (a job slot) the captured work uses.

    Raises:
        RuntimeError: no capture is in progress (:func:`capturing`).
    """
    global _next
    if _hooks is None:
        raise RuntimeError("on_replay called outside a stage's capture")
    if _replaying is not None:
        fn, _next = _replaying[_next], _next + 1
        return fn
    _hooks.append(fn)
    return fn


class collecting:
    """``with collecting() as hooks:`` the calls registered by :func:`on_replay` inside the block
    go to the list ``hooks`` (one capture; not nested). ``replaying``: the hooks of an earlier
    capture of the same work, handed back in order instead (tests re-running a stage's Python as
    its replay, on the CPU: tests/test_graph_experts.py).

    Raises:
        RuntimeError: a capture is already collecting.
    """

    def __init__(self, replaying: list | None = None):
        self.replaying = replaying

    def __enter__(self) -> list:
        global _hooks, _replaying, _next
        if _hooks is not None:
            raise RuntimeError("a stage capture is already collecting replay hooks")
        self.hooks = _hooks = []
        _replaying, _next = self.replaying, 0
        return self.hooks

    def __exit__(self, *exc) -> None:
        global _hooks, _replaying
        _hooks = _replaying = None
