"""The engine thread: one background thread owns the model and runs :class:`EngineCore` steps;
HTTP handlers (on the asyncio event loop) talk to it through thread-safe queues.

Handler -> engine: :meth:`AsyncEngine.submit` and :meth:`AsyncEngine.cancel` put messages on an
inbox (``queue.SimpleQueue``); the thread takes them between steps, and blocks on the inbox when
it has nothing to run (no polling). Engine -> handler: each request's :class:`StepOutput`\\ s go to
its :class:`RequestStream`, an ``asyncio.Queue`` fed with ``loop.call_soon_threadsafe``.

A request with ``n`` choices (``SamplingParams.n``) is ``n`` engine requests of one prompt,
expanded as ``LLM.generate`` expands them (:mod:`writescope.engine.choices`: choice i samples
with ``seed + i`` when a seed is given), submitted and cancelled together: they take ``n`` places
in the waiting queue (all or none), and their outputs come on one stream, tagged with their index.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import traceback

from writescope.engine.choices import expand
from writescope.engine.request import StepOutput
from writescope.engine.runner import EngineCore
from writescope.engine.sampling import SamplingParams
from writescope.errors import ArgError, plural


class QueueFull(Exception):
    """The waiting queue holds ``max_queue`` requests: try again later (HTTP 503)."""


class EngineDead(Exception):
    """The engine thread stopped (shut down, or a fatal error): no new requests."""


class RequestStream:
    """The outputs of one HTTP request's ``n`` choices (engine requests ``request_ids``, choice
    ``i`` is ``request_ids[i]``), read on the event loop that submitted it: ``queue`` holds
    ``(choice index, StepOutput)``."""

    def __init__(self, request_ids: list[str], loop: asyncio.AbstractEventLoop):
        self.request_ids = list(request_ids)
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, StepOutput]] = asyncio.Queue()
        self.arrival = time.perf_counter()
        self._open = len(self.request_ids)  # choices not finished yet (read on the loop)

    @property
    def n(self) -> int:
        return len(self.request_ids)

    def put(self, index: int, out: StepOutput) -> None:
        """From the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, out))
        except RuntimeError:  # the loop is closed: nobody is reading
            pass

    async def queued(self) -> list[tuple[int, StepOutput]]:
        """What the queue holds now, in order: at least one output (waits for it)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def seen(self, out: StepOutput) -> bool:
        """Count ``out`` (taken from ``queue``); True once every choice has finished."""
        self._open -= out.finished
        return self._open == 0

    async def __aiter__(self):
        """``(index, output)`` until every choice has finished (the last output of each has
        ``finish_reason``)."""
        while self._open:
            index, out = await self.queue.get()
            self.seen(out)
            yield index, out


class AsyncEngine:
    """The engine thread over ``llm`` (an :class:`~writescope.engine.llm.LLM`, owned from now on).

    Args:
        llm: the loaded model and cache.
        max_num_seqs: requests holding KV at once (see :class:`EngineCore`).
        max_queue: requests that may wait for admission; beyond, :meth:`submit` raises QueueFull.
            0: none wait: a request is taken while a place in the batch (``max_num_seqs``) is free,
            else refused with QueueFull.
        metrics: a :class:`~writescope.serve.metrics.ServeMetrics`, or None.

    Raises:
        ValueError: max_queue < 0, or a bad max_num_seqs.
    """

    def __init__(self, llm, *, max_num_seqs: int | None = None, max_queue: int = 256, metrics=None):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.llm = llm
        self.core = EngineCore(llm, max_num_seqs)
        self.max_queue = max_queue
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[RequestStream, int]] = {}  # request id -> (its stream, its choice); engine thread only
        self._lock = threading.Lock()
        self._waiting: set[str] = set()  # submitted, not admitted yet (under _lock)
        self._ids = itertools.count()
        self._alive = False
        self.error: str | None = None  # why the thread died
        self._thread = threading.Thread(target=self._loop, name="writescope-engine", daemon=True)

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.core.scheduler.max_num_seqs

    def start(self) -> None:
        self._alive = True
        self._thread.start()

    # ------------------------------------------------------------ handler side
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request :meth:`submit` would refuse as one that could never run (not for a
        full queue): what takes time for a long prompt (its ids checked against the vocabulary).
        Safe to call from any thread, so an HTTP handler runs it off the event loop, then submits
        with ``checked=True``.

        Raises:
            EngineDead: the engine stopped.
            ArgError: ``n`` above ``max_num_seqs + max_queue`` (the places a request may take: its
                choices could never all be taken), a stop token id outside the vocabulary, a request that could never run (see
                :meth:`EngineCore.check`), or ``n`` choices whose KV could never be held at once
                (:meth:`Scheduler.check_group`).
        """
        if not self._alive:
            raise EngineDead(self.error or "the engine is shut down")
        n = params.n
        limit = self.max_num_seqs + self.max_queue
        if n > limit:
            raise ArgError(f"n must be in [1, {limit}], got {n}: each choice takes one of the {limit} places of this server "
                           f"(--max-num-seqs {self.max_num_seqs} + --max-queue {self.max_queue})", "n")
        vocab = self.core.llm.config.vocab_size
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ArgError(f"stop_token_ids has token id {bad}, outside the model's vocabulary of {vocab:,} ids [0, {vocab}): "
                           f"use ids below {vocab} (it could never be generated)", "stop_token_ids")
        self.core.check(prompt_ids, params.max_tokens)
        if n > 1:
            self.core.scheduler.check_group(len(prompt_ids), params.max_tokens, n)

    def submit(self, prompt_ids: list[int], params: SamplingParams, checked: bool = False) -> RequestStream:
        """Queue the ``params.n`` choices of one prompt (call on the event loop); returns their
        stream. Choice ``i`` samples with ``params.seed + i`` when a seed is given (else each its
        own engine seed), so the choices differ under sampling and are reproducible.
        ``checked``: :meth:`check` passed already for this prompt and ``params`` (not done again).

        Raises:
            EngineDead: the engine stopped.
            ArgError: what :meth:`check` refuses (unless ``checked``).
            QueueFull: fewer than ``n`` places are left of ``max_num_seqs + max_queue``, less the
                requests running or not admitted yet.
        """
        if not self._alive:
            raise EngineDead(self.error or "the engine is shut down")
        if not checked:
            self.check(prompt_ids, params)
        n = params.n
        choices = expand(params)
        reqs = [self.core.make_request(prompt_ids, p, request_id=f"req-{next(self._ids)}", checked=True)
                for p in choices]  # checked above (the choices are the same request)
        stream = RequestStream([r.request_id for r in reqs], asyncio.get_running_loop())
        stream.arrival = reqs[0].arrival
        with self._lock:  # queued under the lock: the engine thread, as it ends, answers what is in its inbox then
            if not self._alive:
                raise EngineDead(self.error or "the engine is shut down")
            # the batch's places, less those held or promised (submitted, not admitted yet: the scheduler
            # admits one a step, so a burst sits in _waiting while places are free); a request
            # admitted this step is in both until _publish prunes the waiting ids: counted once
            held = len({r.request_id for r in list(self.core.scheduler.active)} | self._waiting)
            if held + n > self.max_num_seqs + self.max_queue:  # those past the batch's places wait
                if not self.max_queue:  # no waiting queue
                    why = (f"{min(held, self.max_num_seqs)} of the {self.max_num_seqs} places in the batch are taken (--max-num-seqs "
                           f"{self.max_num_seqs}; --max-queue 0: no request waits)")
                else:
                    why = f"{plural(max(0, held - self.max_num_seqs), 'request')} already wait for admission (--max-queue {self.max_queue})"
                raise QueueFull(why + (f", no room for n={n} more" if n > 1 else "") + ": try again later")
            self._waiting.update(r.request_id for r in reqs)
            self._inbox.put(("add", reqs, stream))
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request (its KV is freed by the engine thread); unknown ids are ignored."""
        self._inbox.put(("abort", [request_id], None))

    def cancel(self, stream: RequestStream) -> None:
        """Cancel every choice of ``stream`` (finished ones are ignored); their KV is freed."""
        self._inbox.put(("abort", stream.request_ids, None))

    def shutdown(self, timeout: float | None = 60.0) -> None:
        """Cancel every request, free their KV and stop the thread (waits up to ``timeout`` s)."""
        self._alive = False
        if self._thread.is_alive():
            self._inbox.put(("stop", None, None))
            self._thread.join(timeout)

    def snapshot(self) -> dict:
        """Counts for /health and tests (read from another thread: approximate while steps run)."""
        sch = self.core.scheduler
        with self._lock:
            waiting = len(self._waiting)
        return {"running": len(sch.active), "waiting": waiting, "kv_slots": len(self.llm.cache.active_slots),
                "steps": self.core.steps, "alive": self._thread.is_alive()}

    # ------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        try:
            stop = False
            while not stop:
                msgs = [] if self.core.has_work() else [self._inbox.get()]
                while True:
                    try:
                        msgs.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                outs: list[StepOutput] = []
                for kind, a, b in msgs:
                    if kind == "add":
                        for i, req in enumerate(a):
                            self._streams[req.request_id] = (b, i)
                            self.core.add(req)
                    elif kind == "abort":
                        for rid in a:
                            out = self.core.abort(rid)
                            if out is not None:
                                outs.append(out)
                    else:
                        stop = True
                if stop:
                    outs += self.core.abort_all()
                elif self.core.has_work():
                    outs += self.core.step()
                self._publish(outs)
        except BaseException as e:  # noqa: BLE001 - fatal: fail every request, say why
            self.error = f"the engine thread failed: {type(e).__name__}: {e}"
            traceback.print_exc()
            self._alive = False
            try:
                self._publish(self.core.abort_all())
            finally:
                for rid, (s, i) in list(self._streams.items()):
                    s.put(i, StepOutput(rid, finish_reason="error", error=self.error))
                self._streams.clear()
        finally:
            self._answer_the_inbox()

    def _answer_the_inbox(self) -> None:
        """As the thread ends: requests submitted but not taken yet (in the inbox: submitted
        during the last step) end too, "abort" (or "error" when the thread failed); a submit from
        now on raises EngineDead."""
        with self._lock:
            self._alive = False
            pending = []
            while True:
                try:
                    pending.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, reqs, _ in pending:
                if kind == "add":
                    self._waiting.difference_update(r.request_id for r in reqs)
        reason = "error" if self.error is not None else "abort"
        for kind, reqs, stream in pending:
            if kind == "add":
                for i, req in enumerate(reqs):
                    stream.put(i, StepOutput(req.request_id, finish_reason=reason, error=self.error,
                                             prompt_tokens=len(req.prompt_ids)))

    def _publish(self, outs: list[StepOutput]) -> None:
        sch = self.core.scheduler
        waiting_now = {r.request_id for r in sch.waiting}
        with self._lock:
            self._waiting &= waiting_now | {rid for rid in self._waiting if rid not in self._streams}
        if self.metrics is not None:  # the gauges first: a client that has its last token sees them current
            self.metrics.sample_engine(self.core)
        for out in outs:
            stream, index = self._streams.get(out.request_id, (None, 0))
            if self.metrics is not None:
                e2e = time.perf_counter() - stream.arrival if out.finished and stream is not None else None
                self.metrics.observe(out, e2e)
            if stream is not None:
                stream.put(index, out)
                if out.finished:
                    del self._streams[out.request_id]
