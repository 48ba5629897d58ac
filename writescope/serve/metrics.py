"""The server's Prometheus metrics (``GET /metrics``), named as vLLM's under a ``writescope:``
prefix. One registry per server, so several servers (tests) in one process do not collide.

| metric | kind | what |
|---|---|---|
| ``writescope:num_requests_running`` | gauge | requests holding KV (prefilling or decoding) |
| ``writescope:num_requests_waiting`` | gauge | requests queued for admission |
| ``writescope:prompt_tokens_total`` | counter | prompt tokens prefilled |
| ``writescope:generation_tokens_total`` | counter | tokens generated |
| ``writescope:request_success_total{finished_reason}`` | counter | finished requests (stop, length, abort, error) |
| ``writescope:request_refused_total{status}`` | counter | requests to `/v1/*` answered with an error before reaching the engine (400, 401, 404, 405, 413, 503) |
| ``writescope:time_to_first_token_seconds`` | histogram | arrival to first token |
| ``writescope:inter_token_latency_seconds`` | histogram | between consecutive tokens of a request |
| ``writescope:e2e_request_latency_seconds`` | histogram | arrival to the last token |
| ``writescope:kv_cache_tokens{region}`` | gauge | KV tokens held, per region (``device`` under ``resident``; ``window``, ``compute``, ``load`` for the partitioned policies, last layer) |
| ``writescope:deployed_r`` | gauge | compute-region share of the placed blocks (partitioned policies; NaN with none placed) |
| ``writescope:cpu_attention_busy_fraction`` | gauge | CPU attention seconds / wall seconds since the last sample (partitioned policies) |
| ``writescope:link_streamed_bytes_per_second`` | gauge | load-region bytes streamed to the GPU / wall seconds since the last sample |
| ``writescope:link_busy_fraction`` | gauge | those bytes' link seconds at the calibrated B / wall seconds (``writescope``; NaN without a roofline) |
| ``writescope:pinned_registered_bytes_total`` | counter | host bytes page-locked (``cudaHostRegister``) for KV and staging |
| ``writescope:pinned_register_seconds_total`` | counter | seconds of those registrations: the engine thread, and so every running request, waits for them |
| ``writescope:pinned_reused_bytes_total`` | counter | page-locked bytes the pool lent again instead of registering (kvcache/pinned_pool.py) |
| ``writescope:pinned_pool_idle_bytes`` | gauge | page-locked bytes the pool keeps for the next requests |
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from writescope.engine.request import StepOutput
from writescope.kvcache import pinned
from writescope.kvcache.inplace import InplaceKVCache

PREFIX = "writescope:"
_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class ServeMetrics:
    """Counters, gauges and histograms, updated by the engine thread (prometheus-client's
    metrics are thread-safe) and rendered by :meth:`render`."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge(PREFIX + "num_requests_running", "Requests holding KV (prefilling or decoding).", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting for admission.", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.", ["finished_reason"],
                                       registry=r)
        self.refused = Counter(PREFIX + "request_refused", "Requests answered with an error before reaching the engine, by HTTP status.",
                               ["status"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Seconds from arrival to the first token.",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Seconds between consecutive tokens of a request.",
                             buckets=_LATENCY, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Seconds from arrival to the last token.",
                             buckets=_LATENCY, registry=r)
        self.kv_tokens = Gauge(PREFIX + "kv_cache_tokens", "KV tokens held, per region.", ["region"], registry=r)
        self.deployed_r = Gauge(PREFIX + "deployed_r", "Compute-region share of the placed KV blocks.", registry=r)
        self.cpu_busy = Gauge(PREFIX + "cpu_attention_busy_fraction", "CPU attention seconds per wall second since the last sample.",
                              registry=r)
        self.link_rate = Gauge(PREFIX + "link_streamed_bytes_per_second", "Load-region bytes streamed per wall second.", registry=r)
        self.link_busy = Gauge(PREFIX + "link_busy_fraction", "Link seconds (calibrated B) per wall second since the last sample.",
                               registry=r)
        self.pinned_registered = Counter(PREFIX + "pinned_registered_bytes", "Host bytes page-locked for KV and staging.", registry=r)
        self.pinned_register_s = Counter(PREFIX + "pinned_register_seconds", "Seconds the engine thread spent page-locking host memory.",
                                         registry=r)
        self.pinned_reused = Counter(PREFIX + "pinned_reused_bytes", "Page-locked bytes lent again by the pool instead of registered.",
                                     registry=r)
        self.pinned_idle = Gauge(PREFIX + "pinned_pool_idle_bytes", "Page-locked bytes the pool keeps for the next requests.", registry=r)
        self._pinned_seen = {k: pinned.STATS[k] for k in ("register_bytes", "register_s", "reused_bytes")}  # counters count from here
        self._last: tuple[float, float, int] | None = None  # (wall clock, CPU seconds, streamed bytes) at the last sample
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(reason)

    def observe(self, out: StepOutput, e2e_s: float | None) -> None:
        """Count one engine output (``e2e_s``: the request's latency when it finished)."""
        if out.ttft_s is not None:
            self.ttft.observe(out.ttft_s)
            self.prompt_tokens.inc(out.prompt_tokens)
        for gap in out.itl_s:
            self.itl.observe(gap)
        if out.new_token_ids:
            self.generation_tokens.inc(len(out.new_token_ids))
        if out.finished:
            self.request_success.labels(out.finish_reason).inc()
            if e2e_s is not None:
                self.e2e.observe(e2e_s)

    def sample_engine(self, core, now: float | None = None) -> None:
        """Gauges from the engine's state (called by the engine thread between steps; ``now``:
        the wall clock in seconds, ``time.perf_counter()`` by default)."""
        sch, cache = core.scheduler, core.llm.cache
        self.running.set(len(sch.active))
        self.waiting.set(len(sch.waiting))
        slots = [r.slot for r in sch.active if r.slot is not None]
        if isinstance(cache, InplaceKVCache):
            placed = [cache.placement(s) for s in slots]
            for region in ("window", "compute", "load"):
                self.kv_tokens.labels(region).set(sum(p[region] for p in placed))
            comp, load = sum(p["compute"] for p in placed), sum(p["load"] for p in placed)
            self.deployed_r.set(comp / (comp + load) if comp + load else float("nan"))
            self._sample_busy(cache, time.perf_counter() if now is None else now)
        else:
            self.kv_tokens.labels("device").set(sum(cache.seq_len(s) for s in slots))
        self._sample_pinned()

    def _sample_pinned(self) -> None:
        """The pinned-memory counters by what this process did since the last sample."""
        for key, counter in (("register_bytes", self.pinned_registered), ("register_s", self.pinned_register_s),
                             ("reused_bytes", self.pinned_reused)):
            now = pinned.STATS[key]
            if now > self._pinned_seen[key]:
                counter.inc(now - self._pinned_seen[key])
            self._pinned_seen[key] = now
        self.pinned_idle.set(pinned.POOL.idle_bytes)

    def _sample_busy(self, cache: InplaceKVCache, now: float) -> None:
        """The CPU attention's and the link's busy fractions since the last sample."""
        st = cache.decoder.stats
        cur = (now, st.cpu_seconds, st.streamed_bytes)
        last, self._last = self._last, cur
        if last is None or now <= last[0]:
            return
        wall = now - last[0]
        moved = cur[2] - last[2]
        self.cpu_busy.set((cur[1] - last[1]) / wall)
        self.link_rate.set(moved / wall)
        roofline = getattr(cache.policy, "roofline", None)  # B: link seconds per token of one layer
        self.link_busy.set(moved / cache.spec.token_bytes * roofline.b / wall if roofline is not None else float("nan"))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
