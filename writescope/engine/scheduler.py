"""The continuous-batching scheduler: which request prefills this step, which decode, and
admission against the KV cache's capacity (the waiting queue and the running batch).

Single-threaded: the engine thread (:mod:`writescope.engine.runner`) owns it. One request
prefills at a time (chunk by chunk, between the decode steps of the running ones); a waiting
request is admitted, first come first served, when the running batch has room (``max_num_seqs``)
and its KV fits beside theirs (``fits``). A request whose KV cannot fit even alone is refused.
An offline batch (``LLM.generate``) is admitted whole instead (:meth:`Scheduler.admit_all`): all
its requests prefill before any decodes, then they decode together.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

from writescope.engine.request import FINISHED, PREFILLING, RUNNING, WAITING, Request
from writescope.errors import ArgError, plural


class Scheduler:
    """Waiting, prefilling and running requests.

    Args:
        max_num_seqs: requests holding KV at once (prefilling + running), >= 1.
        max_model_len: tokens one request may reach (prompt + max_tokens).
        eos_token_ids: end-of-sequence ids (a request stops at one unless ``ignore_eos``).
        fits: ``fits(capacities)`` -> None when KV for requests of these capacities (tokens each)
            fits at once, else why not (a sentence naming the memory).

    Raises:
        ValueError: max_num_seqs < 1.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, eos_token_ids, fits: Callable[[list[int]], str | None]):
        if max_num_seqs < 1:
            raise ArgError(f"max_num_seqs must be >= 1, got {max_num_seqs}", "max_num_seqs")
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.eos = frozenset(eos_token_ids)
        self.fits = fits
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # at most one, but an offline batch (admit_all) prefills whole
        self.running: list[Request] = []

    # ------------------------------------------------------------ queue
    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse a request that could never run: empty, or beyond ``max_model_len``, or whose KV
        cannot fit even alone.

        Raises:
            ArgError: naming the limit (``max_model_len`` or the memory) and what to change.
        """
        if prompt_len < 1:
            raise ArgError("the prompt is empty (0 tokens): give at least one token", "prompt")
        if prompt_len + max_tokens > self.max_model_len:
            raise ArgError(
                f"the prompt has {plural(prompt_len, 'token')} + max_tokens {max_tokens:,} = {prompt_len + max_tokens:,}, "
                f"beyond this server's max_model_len of {plural(self.max_model_len, 'token')}: shorten the prompt or lower max_tokens",
                "max_tokens", "max_model_len",
            )
        why = self.fits([prompt_len + max_tokens])
        if why is not None:
            raise ArgError(f"the request's KV cache cannot fit: {why}", "max_tokens")

    def check_group(self, prompt_len: int, max_tokens: int, n: int) -> None:
        """Refuse ``n`` choices of one prompt (checked alone with :meth:`check`) whose KV could
        never be held at once: ``min(n, max_num_seqs)`` of them (those that may run together)
        must fit beside each other with nothing else running. Fewer fit now: they wait, as any
        request does.

        Raises:
            ArgError: naming ``n`` and the memory.
        """
        together = min(n, self.max_num_seqs)
        if together > 1:
            why = self.fits([prompt_len + max_tokens] * together)
            if why is not None:
                raise ArgError(f"the KV cache of n={n} choices ({together} running at once) cannot fit: {why}: lower n or "
                               "max_tokens", "n")

    def add(self, req: Request) -> None:
        """Queue a request (checked with :meth:`check` first)."""
        req.status = WAITING
        self.waiting.append(req)

    @property
    def active(self) -> list[Request]:
        """Requests holding KV (or about to): the prefilling ones, then the running ones."""
        return self.prefilling + self.running

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def find(self, request_id: str) -> Request | None:
        for r in (*self.active, *self.waiting):
            if r.request_id == request_id:
                return r
        return None

    # ------------------------------------------------------------ one step
    def next_prefill(self) -> tuple[Request | None, list[Request]]:
        """(the request to prefill a chunk of this step or None, requests refused now).

        The prefilling request goes on; else the head of the queue is admitted (becomes
        ``prefilling``) when fewer than ``max_num_seqs`` requests hold KV and its KV fits beside
        theirs. A head that does not fit waits for a running request to finish; one that cannot
        fit with nothing else running is refused (its ``error`` set)."""
        refused: list[Request] = []
        while not self.prefilling and self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            why = self.fits([r.capacity for r in self.running] + [head.capacity])
            if why is None:
                self.prefilling.append(self.waiting.popleft())
                head.status = PREFILLING
            elif not self.running:
                self.waiting.popleft()
                head.error = f"its KV cache cannot fit: {why}"
                refused.append(head)
            else:
                break
        return (self.prefilling[0] if self.prefilling else None), refused

    def admit_all(self) -> list[Request]:
        """Admit every waiting request at once, whatever ``max_num_seqs`` and without ``fits``
        (an offline batch: ``LLM.generate`` checked that its KV fits as a whole); returns them,
        in their order. They prefill before any decodes (:class:`~writescope.engine.runner.EngineCore`
        with ``offline=True``)."""
        admitted = list(self.waiting)
        self.waiting.clear()
        for r in admitted:
            r.status = PREFILLING
        self.prefilling.extend(admitted)
        return admitted

    def prefilled(self, req: Request) -> None:
        """A prefilling request's prompt is cached and its first token sampled: it decodes. (Added
        to ``running`` before it leaves ``prefilling``: a thread reading :attr:`active` meanwhile,
        the server's admission, sees it once or twice, never not at all.)"""
        req.status = RUNNING
        self.running.append(req)
        self.prefilling.remove(req)

    def stop_reason(self, req: Request) -> str | None:
        """``stop`` (an end token unless ignore_eos, a stop token, or a stop string completed by
        the last token: ``req.stops``), ``length`` (max_tokens or max_model_len reached), or
        None: go on. A stop string completed by the last allowed token is ``stop``."""
        sp, last = req.params, req.output_ids[-1]
        if (last in self.eos and not sp.ignore_eos) or last in sp.stop_token_ids:
            return "stop"
        if req.stops is not None and req.stops.stopped:
            return "stop"
        if len(req.output_ids) >= sp.max_tokens or len(req.prompt_ids) + len(req.output_ids) >= self.max_model_len:
            return "length"
        return None

    def remove(self, req: Request) -> None:
        """Take a request out of the queue or the batch (it finished, was cancelled or failed)."""
        if req in self.prefilling:
            self.prefilling.remove(req)
        elif req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = FINISHED
