"""The continuous-batching engine: one :meth:`EngineCore.step` at a time over a loaded ``LLM``'s
model and KV cache.

One step = at most one prefill chunk (``prefill_chunk_tokens`` prompt tokens) of one request,
then one decode step of every running request, the one whose prompt just finished included.
Requests join the decode batch when their prompt is cached and leave it when they finish; a
finished, cancelled or failed request frees its cache slot at once. A request whose prefill,
allocation or sampling raises fails alone (``finish_reason == "error"``); an exception in the
batch's decode forward fails the requests of that batch (their KV may be half written), and the
engine goes on with new requests. Greedy outputs equal ``LLM.generate``'s for the same prompts
(same model, cache and sampler; tests/test_engine_runner.py).

Stop strings and logprobs are per request and cost nothing to the others: a request with
``params.stop`` has its output decoded here, token by token, and stops at the first stop string
(:mod:`writescope.engine.stop_strings`; its outputs carry the text, ``StepOutput.text``); a
batch with a request asking for ``params.logprobs`` samples through
:func:`~writescope.engine.sampling.sample_with_logprobs` (the logprobs come back in the
sampler's one read-back), any other batch through :func:`~writescope.engine.sampling.sample`.

Offline (``offline=True``, what ``LLM.generate`` drives): the batch is admitted whole
(:meth:`EngineCore.admit_all`: the policy told the batch size, then every slot allocated), the
first step prefills every prompt (``llm._prefill``: chunks packed across the requests) and
samples their first tokens, and every later step is one decode step of the whole batch (requests
queued meanwhile wait for the batch to end, then are admitted whole in turn), so the batch
decodes together (TPOT over a full batch, as the paper measures it). Errors are raised to
the caller then (the batch fails as a whole), and an r(L) trace (``r_trace``) is recorded under
a partitioned policy.

Not thread-safe: one thread owns it (:class:`writescope.serve.async_engine.AsyncEngine`).
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch
from tqdm import tqdm

from writescope.attention.metadata import ForwardBatch
from writescope.budget.memory import available_memory
from writescope.engine.logprobs import TokenLogprobs
from writescope.engine.prefill_order import group_passes, layered
from writescope.engine.prompts import check_token_ids
from writescope.engine.request import FINISHED, Request, StepOutput
from writescope.engine.sampling import SamplingParams, sample, sample_with_logprobs
from writescope.engine.scheduler import Scheduler
from writescope.engine.stop_strings import StopStrings
from writescope.kvcache.inplace import InplaceKVCache

DECODE_HOST_STEPS = 4096  # decode steps whose main-thread timings are kept (EngineCore.decode_host)
PROGRESS_MIN_PROMPT_TOKENS = 2048  # show a prefill progress bar from this many prompt tokens


class EngineCore:
    """A scheduler and the model runner over ``llm`` (an :class:`~writescope.engine.llm.LLM`).

    Args:
        llm: the loaded model, its cache (any policy), tokenizer and ``prefill_chunk_tokens``.
            Do not call ``llm.generate`` while this engine holds requests.
        max_num_seqs: requests holding KV at once (default: the plan's ``max_batch`` under a
            VRAM budget, else 32). Not used offline (the batch is admitted whole).
        offline: ``LLM.generate``'s batch mode (see the module docstring): admitted whole,
            prefilled together, decoded together; errors raised; the r(L) trace recorded.

    Attributes:
        r_trace: offline under a partitioned policy, one point (:meth:`_r_point`) after the
            prefill and one per decode step; else None.

    Raises:
        ValueError: max_num_seqs < 1, or above the budget plan's ``max_batch``.
    """

    def __init__(self, llm, max_num_seqs: int | None = None, *, offline: bool = False):
        self.llm = llm
        self.offline = offline
        self.r_trace: list[dict] | None = [] if offline and isinstance(llm.cache, InplaceKVCache) else None
        # per decode step, the main thread's (seconds issuing the step, seconds then waiting for its logits);
        # the last DECODE_HOST_STEPS only (a server's engine lives as long as the server)
        self.decode_host: deque[tuple[float, float]] = deque(maxlen=DECODE_HOST_STEPS)
        # per decode step, the seconds before it was issued since the last tokens were sampled (a prefill's or the
        # last decode step's, while requests ran: not across an idle engine): the engine's and its caller's work
        # between steps, which TPOT counts and decode_host does not
        self.decode_between: deque[float] = deque(maxlen=DECODE_HOST_STEPS)
        self._sampled_at: float | None = None  # when the last tokens were sampled
        planned = llm.max_batch if llm.vram_plan is not None else None  # sequences the budget plan was sized for
        if max_num_seqs is None:
            max_num_seqs = planned or 32
        if planned is not None and max_num_seqs > planned and not offline:
            raise ValueError(f"max_num_seqs {max_num_seqs} is above the VRAM budget plan's {planned} sequences: "
                             "load the model with max_batch >= max_num_seqs")
        self.scheduler = Scheduler(max_num_seqs, llm.max_model_len, llm.config.eos_token_ids, self._kv_fits)
        self._ids = itertools.count()
        self.steps = 0

    # ------------------------------------------------------------ requests
    def make_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     checked: bool = False) -> Request:
        """A checked request, not queued yet (safe to call from another thread: it reads only
        the configuration and free memory). Its sampling seed, unless ``params.seed``: the
        model's seed + its number among this engine's requests (0, 1, ...). ``checked``: the
        caller checked it already (``LLM.generate`` checks its batch as a whole).

        Raises:
            ArgError: an id outside the vocabulary, an empty prompt, prompt + max_tokens beyond
                ``max_model_len``, or KV that cannot fit even alone.
        """
        if not checked:
            self.check(prompt_ids, params.max_tokens)
        n = next(self._ids)
        req = Request(request_id if request_id is not None else f"req-{n}", list(prompt_ids), params)
        if params.stop:
            req.stops = StopStrings(self.llm.tokenizer.decode, params.stop, params.include_stop_str_in_output)
        if params.logprobs is not None:
            req.logprobs = []
        if not params.greedy:
            req.generator = torch.Generator(device=self.llm.device)
            req.generator.manual_seed(params.seed if params.seed is not None else self.llm.seed + n)
        return req

    def check(self, prompt_ids: list[int], max_tokens: int) -> None:
        """Refuse a request of ``prompt_ids`` and ``max_tokens`` new tokens that could never run
        (what :meth:`make_request` checks; safe to call from another thread, as it is).

        Raises:
            ArgError: an id outside the vocabulary, an empty prompt, prompt + max_tokens beyond
                ``max_model_len``, or KV that cannot fit even alone.
        """
        check_token_ids([prompt_ids], self.llm.config.vocab_size, "prompt")
        self.scheduler.check(len(prompt_ids), max_tokens)

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

    def admit_all(self) -> list[Request]:
        """Admit every queued request at once (offline): the policy is told the batch (these and
        any other requests holding KV) before any prompt is placed, then a slot is allocated for
        each, in order. An allocation that fails raises; the slots allocated so far stay with
        their requests (:meth:`abort_all` frees them)."""
        cache = self.llm.cache
        admitted = self.scheduler.admit_all()
        if isinstance(cache, InplaceKVCache):
            cache.expect_batch(len(cache.active_slots) + sum(r.slot is None for r in admitted))
        for r in admitted:
            if r.slot is None:
                r.slot = cache.allocate(r.capacity, prompt_len=len(r.prompt_ids))
        return admitted

    # ------------------------------------------------------------ one step
    def step(self) -> list[StepOutput]:
        """One prefill chunk (if a request is prefilling or can be admitted), then one decode
        step of the running requests. Returns one output per request that got tokens or
        finished in this step. Offline: the whole batch's prefill, or one decode step.

        Raises:
            Exception: offline, whatever the prefill or the decode step raised (the requests
                keep their KV until :meth:`abort_all`).
        """
        self.steps += 1
        if self.offline:
            if self.scheduler.waiting and not self.scheduler.active:
                self.admit_all()
            if self.scheduler.prefilling:
                return self._prefill_all()
        new: dict[Request, list[int]] = {}
        finished: dict[Request, StepOutput] = {}
        req, refused = self.scheduler.next_prefill() if not self.offline else (None, [])
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
                if self.offline:
                    raise
                for r in running:
                    r.error = f"decode step failed: {type(e).__name__}: {e}"
                    finished[r] = self._finish(r, "error", new.pop(r, []))
            else:
                for r, t in zip(running, toks):
                    new.setdefault(r, []).append(t)
                    reason = self.scheduler.stop_reason(r)
                    if reason is not None:
                        finished[r] = self._finish(r, reason, new.pop(r))
        if not self.scheduler.running:  # idle until the next request: not counted as time between steps
            self._sampled_at = None
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
        toks, lps = self._sample(logits, [req])
        if self._sampled_at is None:  # the first tokens since the engine was idle: decode steps count from here
            self._sampled_at = time.perf_counter()
        self._append(req, toks[0], lps[0])
        return toks[0]

    def _prefill_all(self) -> list[StepOutput]:
        """Offline: prefill every admitted prompt (``llm._prefill``, which ``writescope bench
        --kv-fill random`` replaces), sample each first token, record the trace's first point;
        the requests that go on decode from the next step."""
        reqs = list(self.scheduler.prefilling)
        logits = self.llm._prefill([r.prompt_ids for r in reqs], [r.slot for r in reqs])
        toks, lps = self._sample(logits, reqs)
        self._sampled_at = time.perf_counter()
        for r, t, lp in zip(reqs, toks, lps):
            r.num_prefilled = len(r.prompt_ids)
            self._append(r, t, lp)
            self.scheduler.prefilled(r)
        if self.r_trace is not None:
            self.r_trace.append(self._r_point(0, reqs))
        outs = []
        for r, t in zip(reqs, toks):
            reason = self.scheduler.stop_reason(r)
            outs.append(self._finish(r, reason, [t]) if reason is not None else self._output(r, [t]))
        return outs

    def _decode(self, running: list[Request]) -> list[int]:
        """One decode step of ``running`` (each with its last token as input); returns one new
        token per request (appended to its ``output_ids``)."""
        llm = self.llm
        t0 = time.perf_counter()
        batch = ForwardBatch.build([r.slot for r in running], [1] * len(running), [r.context_len for r in running], llm.device)
        inp = torch.tensor([r.output_ids[-1] for r in running], device=llm.device)
        logits = llm.model(inp, batch, llm.cache)
        t1 = time.perf_counter()  # the step is issued; sampling reads the logits back (waits for the device)
        toks, lps = self._sample(logits, running)
        t2 = time.perf_counter()
        self.decode_host.append((t1 - t0, t2 - t1))
        self.decode_between.append(t0 - self._sampled_at if self._sampled_at is not None else 0.0)
        self._sampled_at = t2
        for r, t, lp in zip(running, toks, lps):
            self._append(r, t, lp)
        if self.r_trace is not None:
            self.r_trace.append(self._r_point(len(running[0].output_ids) - 1, running))
        if llm.step_hook is not None:
            llm.step_hook()
        return toks

    @staticmethod
    def _sample(logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per request (and its logprobs where asked; else None). Without logprobs in
        the batch this is :func:`sample` (looked up at call time: benchmarks/policy_consistency.py
        replaces it)."""
        params, gens = [r.params for r in reqs], [r.generator for r in reqs]
        if all(p.logprobs is None for p in params):
            return sample(logits, params, gens), [None] * len(reqs)
        return sample_with_logprobs(logits, params, gens)

    def _append(self, req: Request, tok: int, logprobs: TokenLogprobs | None = None) -> None:
        now = time.perf_counter()
        req.output_ids.append(tok)
        if req.logprobs is not None:
            req.logprobs.append(logprobs)
        if req.stops is not None:
            req.stops.push(tok)
        if req.last_token_at is None:
            req.first_token_at = now
            req.pending_ttft = now - req.arrival
        else:
            req.pending_itl.append(now - req.last_token_at)
        req.last_token_at = now

    # ------------------------------------------------------------ outputs
    def _output(self, req: Request, toks: list[int], reason: str | None = None) -> StepOutput:
        """The output of ``toks`` (this step's new tokens, the newest of ``req.output_ids``) with
        the latencies since the last one, the text they add (stop strings) and their logprobs."""
        text = req.stops.take(final=reason is not None) if req.stops is not None else None
        lps = tuple(req.logprobs[len(req.logprobs) - len(toks):]) if req.logprobs is not None else None
        out = StepOutput(req.request_id, tuple(toks), reason, req.error, len(req.prompt_ids), len(req.output_ids),
                         req.pending_ttft, tuple(req.pending_itl), text, lps, req.stop_reason if reason is not None else None)
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
            if isinstance(self.llm.cache, InplaceKVCache):
                req.kv_placement = self.llm.cache.placement(slot)  # RequestOutput.kv_placement
            try:
                self.llm.cache.free(slot)
            except Exception as e:  # noqa: BLE001 - the request is over either way; say why its KV was not freed
                req.error = (req.error + "; " if req.error else "") + f"freeing its KV failed: {type(e).__name__}: {e}"
        return self._output(req, toks or [], reason)

    def _r_point(self, step: int, reqs: list[Request]) -> dict:
        """One point of the r(L) trace: after ``step`` decode steps of ``reqs``, the mean placed
        tokens per sequence L, the policy's target share r(L) (monolithic: the share the CPU
        attends), the share placed on the CPU side and, with the joint roofline's expert split
        (``llm.expert_work``), the host experts streamed and computed on the CPU since the last
        point (``experts_streamed``, ``experts_cpu``; not at step 0, whose counts are the prefill's)."""
        cache = self.llm.cache
        placed = [cache.placement(r.slot) for r in reqs]
        comp, load = sum(p["compute"] for p in placed), sum(p["load"] for p in placed)
        L = (comp + load) / max(1, len(reqs))
        pol = cache.policy  # monolithic places everything on the CPU side and splits when reading: its read share
        target = pol.read_share(int(L)) if getattr(pol, "monolithic", False) else pol.cpu_share(int(L))
        point = {"step": step, "L": L, "target": target, "deployed": comp / (comp + load) if comp + load else None}
        work = getattr(self.llm, "expert_work", None)
        if work is not None:
            counts = work.take_counts()
            if step > 0:
                point["experts_streamed"], point["experts_cpu"] = counts
        return point

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


def prefill_batch(llm, ids: list[list[int]], slots: list[int]) -> torch.Tensor:
    """Chunked prefill of all ``ids`` (prompt token ids, one list per request) into their cache
    ``slots``: each forward pass takes up to ``llm.prefill_chunk_tokens`` tokens, packed across
    the requests in order; under a partitioned policy groups of passes run layer by layer
    (engine/prefill_order.py; ``llm.prefill_order`` ``chunk``, or ``resident``: each pass through
    every layer in turn); a progress bar from PROGRESS_MIN_PROMPT_TOKENS tokens (with
    ``llm.progress``). Returns the last prompt token's logits, ``[batch, vocab]``. Sets
    ``llm.prefill_chunks``: per pass, or per group of passes run layer by layer, ``requests``
    (indices into ``ids``), ``tokens``, ``passes`` and ``end_s`` (host seconds from the start
    when its layers were issued; no synchronisation is added, so a pass that waits shows in the
    next ones)."""
    order = llm.prefill_order  # read once at load (LLM), as the budget plan counted it
    n_layers, total = llm.config.num_layers, sum(map(len, ids))
    passes, starts = pack_passes([len(p) for p in ids], llm.prefill_chunk_tokens)
    # layer by layer only where the cache would otherwise read earlier KV back (resident: all on the device already)
    keeps = hasattr(llm.cache, "keeping_prefill_kv")
    groups = group_passes(passes) if order == "layer" and keeps else [[k] for k in range(len(passes))]
    t_start, chunks = time.perf_counter(), []
    llm.prefill_chunks = chunks
    bar = tqdm(total=total, desc="prefill", unit="tok", disable=not llm.progress or total < PROGRESS_MIN_PROMPT_TOKENS)
    last_logits: list[torch.Tensor | None] = [None] * len(ids)

    def built(k: int):
        rows = passes[k]
        chunk = [t for (i, take), s in zip(rows, starts[k]) for t in ids[i][s : s + take]]
        batch = ForwardBatch.build([slots[i] for i, _ in rows], [t for _, t in rows], starts[k], llm.device)
        return torch.tensor(chunk, device=llm.device), batch

    def finished(k: int, logits: torch.Tensor) -> None:
        for r, ((i, take), s) in enumerate(zip(passes[k], starts[k])):
            if s + take == len(ids[i]):
                last_logits[i] = logits[r]

    for group in groups:
        if len(group) > 1 and layered(group, passes):
            tokens = sum(t for k in group for _, t in passes[k])

            def step(layer: int, tokens: int = tokens, n: int = len(group)) -> None:  # the bar moves a layer's share of the group's tokens
                bar.set_postfix_str(f"layer {layer + 1}/{n_layers} of {n} passes", refresh=False)
                bar.update(tokens * (layer + 1) // n_layers - tokens * layer // n_layers)

            for k, logits in zip(group, llm.model.forward_by_layer([built(k) for k in group], llm.cache, layer_callback=step)):
                finished(k, logits)
            chunks.append({"requests": sorted({i for k in group for i, _ in passes[k]}), "tokens": tokens, "passes": len(group),
                           "end_s": time.perf_counter() - t_start})
            continue
        for k in group:
            step = lambda layer: bar.set_postfix_str(f"layer {layer + 1}/{n_layers}", refresh=False)  # noqa: E731
            input_ids, batch = built(k)
            finished(k, llm.model(input_ids, batch, llm.cache, layer_callback=step))
            bar.update(len(input_ids))
            chunks.append({"requests": [i for i, _ in passes[k]], "tokens": len(input_ids), "passes": 1,
                           "end_s": time.perf_counter() - t_start})
    bar.close()
    return torch.stack(last_logits)  # type: ignore[arg-type]


def pack_passes(lengths: list[int], chunk_tokens: int) -> tuple[list[list[tuple[int, int]]], list[list[int]]]:
    """The passes of a chunked prefill of prompts of ``lengths`` tokens: each takes up to
    ``chunk_tokens`` tokens, packed across the prompts in order. Returns per pass its
    ``(prompt, new tokens)`` rows and, per row, the tokens of that prompt before the pass."""
    done = [0] * len(lengths)
    passes, starts = [], []
    while any(d < n for d, n in zip(done, lengths)):
        budget, rows, before = chunk_tokens, [], []
        for i, n in enumerate(lengths):
            take = min(n - done[i], budget)
            if take > 0:
                rows.append((i, take))
                before.append(done[i])
                budget -= take
            if budget == 0:
                break
        for i, take in rows:
            done[i] += take
        passes.append(rows)
        starts.append(before)
    return passes, starts
