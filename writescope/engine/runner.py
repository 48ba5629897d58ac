"""The continuous-batching engine: one :meth:`EngineCore.step` at a time over a loaded ``LLM``'s
model and KV cache.

One step = at most one prefill chunk (``prefill_chunk_tokens`` prompt tokens) of one request,
then one decode step of every running request, the one whose prompt just finished included.
Requests join the decode batch when their prompt is cached and leave it when they finish; a
finished, cancelled or failed request frees its cache slot at once. A request whose prefill,
allocation or sampling raises fails alone (``finish_reason == "error"``); an exception in the
batch's decode forward fails the requests of that batch (their KV may be half written), and the
engine goes on with new requests. Greedy outputs equal ``LLM.generate``'s for the same prompts
(same model, cache and sampler; tests/test_scheduler_engine.py).

Not thread-safe: one thread owns it (:class:`writescope.serve.async_engine.AsyncEngine`).
"""

from __future__ import annotations

import itertools
import time

import torch

from writescope.attention.metadata import ForwardBatch
from writescope.engine.llm import available_memory
from writescope.engine.prompts import check_token_ids
from writescope.engine.request import FINISHED, Request, StepOutput
from writescope.engine.sampling import SamplingParams, sample
from writescope.engine.scheduler import Scheduler
from writescope.kvcache.inplace import InplaceKVCache


class EngineCore:
    """A scheduler and the model runner over ``llm`` (an :class:`~writescope.engine.llm.LLM`).

    Args:
        llm: the loaded model, its cache (any policy), tokenizer and ``prefill_chunk_tokens``.
            Do not call ``llm.generate`` while this engine holds requests.
        max_num_seqs: requests holding KV at once (default: the plan's ``max_batch`` under a
            VRAM budget, else 32).

    Raises:
        ValueError: max_num_seqs < 1, or above the budget plan's ``max_batch``.
    """

    def __init__(self, llm, max_num_seqs: int | None = None):
        self.llm = llm
        plan = llm.vram_plan
        if max_num_seqs is None:
            max_num_seqs = plan.max_batch if plan is not None else 32
        if plan is not None and max_num_seqs > plan.max_batch:
            raise ValueError(f"max_num_seqs {max_num_seqs} is above the VRAM budget plan's {plan.max_batch} sequences: "
                             "load the model with max_batch >= max_num_seqs")
        self.scheduler = Scheduler(max_num_seqs, llm.max_model_len, llm.config.eos_token_ids, self._kv_fits)
        self._ids = itertools.count()
        self.steps = 0

    # ------------------------------------------------------------ requests
    def make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """A checked request, not queued yet (safe to call from another thread: it reads only
        the configuration and free memory).

        Raises:
            ArgError: an id outside the vocabulary, an empty prompt, prompt + max_tokens beyond
                ``max_model_len``, or KV that cannot fit even alone.
        """
        check_token_ids([prompt_ids], self.llm.config.vocab_size, "prompt")
        self.scheduler.check(len(prompt_ids), params.max_tokens)
        n = next(self._ids)
        req = Request(request_id if request_id is not None else f"req-{n}", list(prompt_ids), params)
        if not params.greedy:
            req.generator = torch.Generator(device=self.llm.device)
            req.generator.manual_seed(params.seed if params.seed is not None else self.llm.seed + n)
        return req

    def add(self, req: Request) -> None:
        """Queue a request from :meth:`make_request`; it runs in a later :meth:`step`."""
        self.scheduler.add(req)

    def abort(self, request_id: str) -> StepOutput | None:
        """Cancel a request wherever it is and free its KV; None if it is unknown or finished."""
        req = self.scheduler.find(request_id)
        return None if req is None else self._finish(req, "abort")

    def abort_all(self) -> list[StepOutput]:
        """Cancel every request (shutdown)."""
        return [self._finish(r, "abort") for r in (*self.scheduler.active, *self.scheduler.waiting)]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------ one step
    def step(self) -> list[StepOutput]:
        """One prefill chunk (if a request is prefilling or can be admitted), then one decode
        step of the running requests. Returns one output per request that got tokens or
        finished in this step."""
        self.steps += 1
        new: dict[Request, list[int]] = {}
        finished: dict[Request, StepOutput] = {}
        req, refused = self.scheduler.next_prefill()
        for r in refused:
            finished[r] = self._finish(r, "error")
        if req is not None:
            try:
                tok = self._prefill_chunk(req)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                req.error = f"prefill failed: {type(e).__name__}: {e}"
                finished[req] = self._finish(req, "error")
            else:
                if tok is not None:
                    new[req] = [tok]
                    reason = self.scheduler.stop_reason(req)
                    if reason is None:
                        self.scheduler.prefilled(req)
                    else:
                        finished[req] = self._finish(req, reason, new.pop(req))
        running = list(self.scheduler.running)
        if running:
            try:
                toks = self._decode(running)
            except Exception as e:  # noqa: BLE001 - the batch's KV may be half written: its requests fail
                for r in running:
                    r.error = f"decode step failed: {type(e).__name__}: {e}"
                    finished[r] = self._finish(r, "error", new.pop(r, []))
            else:
                for r, t in zip(running, toks):
                    new.setdefault(r, []).append(t)
                    reason = self.scheduler.stop_reason(r)
                    if reason is not None:
                        finished[r] = self._finish(r, reason, new.pop(r))
        outs = list(finished.values())
        outs += [self._output(r, toks) for r, toks in new.items()]
        return outs

    def _prefill_chunk(self, req: Request) -> int | None:
        """Cache the next chunk of ``req``'s prompt (allocating its slot first); returns its first
        token once the whole prompt is cached, else None."""
        llm, cache = self.llm, self.llm.cache
        if req.slot is None:
            if isinstance(cache, InplaceKVCache):
                cache.expect_batch(len(self.scheduler.active))
            req.slot = cache.allocate(req.capacity, prompt_len=len(req.prompt_ids))
        start = req.num_prefilled
        take = min(llm.prefill_chunk_tokens, len(req.prompt_ids) - start)
        batch = ForwardBatch.build([req.slot], [take], [start], llm.device)
        logits = llm.model(torch.tensor(req.prompt_ids[start : start + take], device=llm.device), batch, cache)
        req.num_prefilled += take
        if req.num_prefilled < len(req.prompt_ids):
            return None
        tok = sample(logits, [req.params], [req.generator])[0]
        self._append(req, tok)
        return tok

    def _decode(self, running: list[Request]) -> list[int]:
        """One decode step of ``running`` (each with its last token as input); returns one new
        token per request (appended to its ``output_ids``)."""
        llm = self.llm
        batch = ForwardBatch.build([r.slot for r in running], [1] * len(running), [r.context_len for r in running], llm.device)
        inp = torch.tensor([r.output_ids[-1] for r in running], device=llm.device)
        logits = llm.model(inp, batch, llm.cache)
        toks = sample(logits, [r.params for r in running], [r.generator for r in running])
        for r, t in zip(running, toks):
            self._append(r, t)
        if llm.step_hook is not None:
            llm.step_hook()
        return toks

    def _append(self, req: Request, tok: int) -> None:
        now = time.perf_counter()
        req.output_ids.append(tok)
        if req.last_token_at is None:
            req.pending_ttft = now - req.arrival
        else:
            req.pending_itl.append(now - req.last_token_at)
        req.last_token_at = now

    # ------------------------------------------------------------ outputs
    def _output(self, req: Request, toks: list[int], reason: str | None = None) -> StepOutput:
        """The output of ``toks`` (this step's new tokens) with the latencies since the last one."""
        out = StepOutput(req.request_id, tuple(toks), reason, req.error, len(req.prompt_ids), len(req.output_ids),
                         req.pending_ttft, tuple(req.pending_itl))
        req.pending_ttft, req.pending_itl = None, []
        return out

    def _finish(self, req: Request, reason: str, toks: list[int] | None = None) -> StepOutput:
        """Remove ``req`` from the scheduler, free its slot, and return its last output."""
        if req.status == FINISHED:
            return self._output(req, toks or [], req.finish_reason)
        self.scheduler.remove(req)
        req.finish_reason = reason
        if req.slot is not None:
            slot, req.slot = req.slot, None
            try:
                self.llm.cache.free(slot)
            except Exception as e:  # noqa: BLE001 - the request is over either way; say why its KV was not freed
                req.error = (req.error + "; " if req.error else "") + f"freeing its KV failed: {type(e).__name__}: {e}"
        return self._output(req, toks or [], reason)

    # ------------------------------------------------------------ capacity
    def _kv_fits(self, capacities: list[int]) -> str | None:
        """None when KV for sequences of ``capacities`` tokens (the running ones, then the
        newcomer) fits at once, else why not. Under a VRAM budget the plan was sized for
        ``max_batch`` sequences of ``max_model_len`` tokens (the scheduler's limits); otherwise
        free memory is checked as ``LLM.generate`` checks it."""
        llm, cache = self.llm, self.llm.cache
        if llm.vram_plan is not None:
            return None
        try:
            if isinstance(cache, InplaceKVCache):
                dev_free = available_memory(llm.device) if llm.device.type == "cuda" else None
                cache.check_capacity(capacities, dev_free, available_memory(torch.device("cpu")), llm.pinned_budget)
                return None
            # the contiguous cache allocates per request and free memory already excludes what the
            # others hold: only the newest (the last capacity) is still to be had
            need = cache.bytes_for(capacities[-1])
            free = available_memory(llm.device)
            if free is not None and need > 0.9 * free:
                return (f"{need / 2**30:.2f} GiB of KV needed but {free / 2**30:.2f} GiB is free on {llm.device}: "
                        "use fewer or shorter requests")
        except ValueError as e:
            return str(e)
        return None
