"""Run the bench grid: for each (batch, context, policy) prefill random prompts, decode N steps,
and collect what the table and plots show (docs/DESIGN.md section 7 compares these policies).

Per configuration (one row):
- ``prefill_tok_s``, ``decode_tok_s``, ``tpot_ms`` (median over requests) from the engine; the
  report compares ``step_tok_s`` = batch / TPOT; ``extra["release_ms"]``: freeing the batch's KV
  after its last token (``LLM.release_s``); ``extra["issue_ms"]``, ``extra["wait_ms"]``: the
  main thread's median issue and wait per decode step, and ``extra["step_ms"]`` each step in order
  (the time before it since the last tokens were sampled, ``extra["between_ms"]``, plus its issue
  and wait: TPOT is about their mean);
- ``attn_ms_per_layer``: median time of one layer's decode attention (the cache's ``attend``;
  on CUDA between timing events on the stream, no synchronisation added, so the step runs as in
  ``generate``; without CUDA the wall time);
- ``r_deployed``: placed CPU share at the end (compute / (compute + load) tokens of the batch);
- ``gbs``: KV bytes one layer's attention reads per step / ``attn_ms_per_layer``; ``bound_ms``
  = the host-resident part of those bytes (compute and load regions, from the placement; 0 for
  ``resident``, whose KV is all on the device) / the split's rate (both paths at once: :mod:`writescope.bench.bounds`, measured in
  the same run by ``writescope bench``) and ``frac_of_bound`` = bound / measured; ``step_bound_ms``
  and ``stream_step_bound_ms``: the whole step's KV over the split's rate and over streaming
  alone's (the link); ``host_expert_bytes`` and ``joint_step_bound_ms``: where routed experts
  live in host memory, a decode step's expected hit host expert bytes (uniform routing:
  :func:`~writescope.scheduler.expert_work.expected_host_expert_bytes`), and the step's host KV
  and those bytes over the split's rate (issue 16's joint bound); ``tpot_bound_ms`` is the one a
  TPOT is compared with.
A configuration that does not fit (the engine's capacity check, or the device running out of
memory) becomes a row with ``fits = False`` and the reason; the grid goes on.

With ``repeats`` R > 1 every configuration is measured R times, the policies of one (batch,
context) taking turns (R passes over them, so a slow spell of the machine falls on all of them),
one row per run (``extra["repeat"]``); :mod:`writescope.bench.report` gives the figures of each
configuration's run of median TPOT (all from that one run: ``report.median_run``) and the spread
of each, and the interval of each ratio from the repeats' min and max.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

from writescope.bench import switches
from writescope.bench.bounds import Rates
from writescope.engine.llm import LLM
from writescope.engine.prompts import TooLong
from writescope.engine.sampling import SamplingParams
from writescope.engine.timing import stamp_seconds
from writescope.kvcache import pinned
from writescope.kvcache.inplace import InplaceKVCache, _micro_batches
from writescope.scheduler.expert_work import expected_host_expert_bytes
from writescope.scheduler.placement import micro_batched
from writescope.scheduler.policies import StaticPolicy, parse_policy


@dataclass
class BenchRow:
    batch: int
    context: int
    policy: str
    fits: bool = True
    reason: str = ""
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    tpot_ms: float = 0.0
    attn_ms_per_layer: float = 0.0
    r_deployed: float | None = None
    kv_bytes_per_layer: int = 0
    gbs: float = 0.0
    bound_ms: float = 0.0
    frac_of_bound: float = 0.0
    step_bound_ms: float = 0.0
    stream_step_bound_ms: float = 0.0
    host_expert_bytes: float = 0.0  # expected weight bytes of the hit routed experts in host memory, per decode step
    joint_step_bound_ms: float = 0.0  # the step's host KV and host expert bytes over both paths at once (issue 16)
    prepare_ms_per_layer: float = 0.0  # monolithic: re-layout into pinned staging
    prepare_gbs: float = 0.0  # monolithic: bytes re-laid out per second of prepare
    extra: dict = field(default_factory=dict)

    @property
    def tpot_bound_ms(self) -> float:
        """The bound a TPOT is compared with: the joint bound where routed experts live in host
        memory (``joint_step_bound_ms``), else the step's KV bound (``step_bound_ms``); 0 without one."""
        return self.joint_step_bound_ms if self.joint_step_bound_ms > 0 else self.step_bound_ms

    @property
    def step_tok_s(self) -> float:
        """Decode tokens per second of the decode steps, ``batch / TPOT`` (0 without a TPOT): what
        the report compares. The engine's ``decode_tok_s`` of rows measured before 2026-12-01 also
        holds the freeing of the finished requests' pinned KV after the last step (up to 2 s at 16 x 32K
        on the H200 machine, half of an 8-step row), so the report does not use it."""
        return self.batch * 1e3 / self.tpot_ms if self.tpot_ms > 0 else 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BenchRow":
        """A row as :meth:`to_dict` wrote it (a saved grid, for ``--resume``); unknown keys are
        refused, missing ones take their defaults (a file written before a field existed)."""
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise ValueError(f"a saved bench row has fields this version does not know: {sorted(extra)}")
        return cls(**d)


@dataclass
class BenchConfig:
    batches: list[int]
    contexts: list[int]
    policies: list[str]
    steps: int = 8
    window: int = 256
    # what the bounds are computed from; `writescope bench` measures them in its run (bench/bounds.py)
    rates: Rates = field(default_factory=lambda: Rates(86.0, 55.0, source="docs/HARDWARE.md's H200 figures"))
    seed: int = 0
    progress: bool = True
    warmup: bool = True  # one short unmeasured run per batch size and policy first
    kv_fill: str = "prefill"  # "random": prompts' KV written as seeded random values, no prefill (decode-only grids)
    repeats: int = 1  # runs of every configuration (rows each); the report's spread and noise intervals come from them


class _TimedAttend:
    """Wraps a cache's ``attend_begin`` / ``attend_end`` (and ``attend``) to time decode calls
    (all query lengths 1) without changing what they do: on CUDA by a pair of timing events on
    the current stream, one at the begin and one after the end (no synchronisation added; read
    once the run is over: :meth:`seconds`), without CUDA by the wall clock (the calls are
    synchronous there). A layer's time runs from its first launch to its merge, so it includes
    its waits for streamed blocks and for the CPU partial, and in a micro-batched step (two
    halves, models/decode_step.py) the other half's work issued in between: then a row's GB/s
    (the whole batch's bytes over one half's span) is not a read rate, and only TPOT compares."""

    def __init__(self, cache, device: torch.device):
        self.cache, self.device, self.times, self.events = cache, device, [], []
        self.inner_begin, self.inner_end = cache.attend_begin, cache.attend_end
        cache.attend_begin, cache.attend_end = self.begin, self.end  # instance attributes; attend calls these

    def begin(self, layer_id, q, k, v, batch, scale, sliding_window=None, prefill_attn=None):
        if not all(n == 1 for n in batch.query_lens):
            return self.inner_begin(layer_id, q, k, v, batch, scale, sliding_window, prefill_attn)
        start = time.perf_counter() if self.device.type != "cuda" else torch.cuda.Event(enable_timing=True)
        if not isinstance(start, float):
            start.record()
        return _Timed(self.inner_begin(layer_id, q, k, v, batch, scale, sliding_window, prefill_attn), start)

    def end(self, handle):
        if not isinstance(handle, _Timed):
            return self.inner_end(handle)
        out = self.inner_end(handle.inner)
        if isinstance(handle.start, float):
            self.times.append(time.perf_counter() - handle.start)
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.events.append((handle.start, end))
        return out

    def seconds(self) -> list[float]:
        """Each timed call's seconds (waits for the last event on CUDA)."""
        if self.events:
            self.events[-1][1].synchronize()
            self.times += [a.elapsed_time(b) / 1e3 for a, b in self.events]
            self.events = []
        return self.times

    def remove(self) -> None:
        del self.cache.attend_begin, self.cache.attend_end  # the class's methods again


class _Timed:
    __slots__ = ("inner", "start")

    def __init__(self, inner, start):
        self.inner, self.start = inner, start


def complete_cells(cfg: BenchConfig, rows: list[BenchRow]) -> list[BenchRow]:
    """Of saved ``rows``, those of the (batch, context) cells of ``cfg`` that hold every policy's
    every repeat, in the grid's order: what a resumed grid keeps (a cell's policies are compared in
    one run, so a cell cut short by an interrupted run is measured again whole)."""
    by = {(r.batch, r.context, r.extra.get("repeat", 0), r.policy): r for r in rows}
    keep = []
    for b in cfg.batches:
        for c in cfg.contexts:
            keys = [(b, c, rep, p) for rep in range(cfg.repeats) for p in cfg.policies]
            if all(k in by for k in keys):
                keep += [by[k] for k in keys]
    return keep


def policy_turn(policies: list[str], repeat: int) -> list[str]:
    """The order the policies take their turns in run ``repeat`` of a cell: rotated by one place
    each repeat, so that no policy always runs right after the same one (run 41: at DSV2 4 x 8K,
    where a step is bound by the thread that issues it, ``gpu`` issued 6-10 ms faster than
    ``static:0``, the same placement and code, in both repeats while it ran first each time)."""
    k = repeat % len(policies) if policies else 0
    return policies[k:] + policies[:k]


def needs_split_warm_up(entry: str, batch: int) -> bool:
    """Whether the grid row ``entry`` at ``batch`` sequences gets a second warm-up at its longest
    context: its decode steps may split into two micro-batches (``WRITESCOPE_MICRO_BATCHES`` 2 or
    ``auto``, its own switch or the process's; scheduler/placement.py ``micro_batched``) and its
    policy may place KV on the CPU (not ``resident``, ``gpu`` or ``static:0``).

    A step splits only when it has a CPU part (kvcache/inplace.py ``decode_groups``), and at the
    warm-up's short context ``writescope`` places none, so the half-batch CUDA graphs were captured
    in the row's first measured step (run 65: 500 ms of a 170 ms step at DSV2 16 x 32K, 1.5 s at
    Qwen3 16 x 32K). The second warm-up runs the row's own entry (policy, switches, settings) at
    its batch and the grid's longest context, so its steps place, route their experts and split as
    the row's will (under ``auto``: or not), and capture the same graphs.

    Raises:
        ValueError: a bad switch or setting value (the reader's message, without the policy's name).
    """
    base, row = switches.split(entry)
    env, _ = switches.settings(row)
    with switches.applied(env):
        wanted = _micro_batches()
    if not micro_batched(wanted, batch):
        return False
    try:
        parsed = parse_policy(base)
    except ValueError:  # writescope or monolithic without a roofline here: they may place a CPU share
        return True
    return parsed is not None and not (isinstance(parsed, StaticPolicy) and parsed.share == 0)


def run_grid(llm: LLM, cfg: BenchConfig, roofline=None, on_row=None, done: list[BenchRow] | None = None) -> list[BenchRow]:
    """Every (batch, context, policy) of ``cfg`` on the loaded ``llm``, ``cfg.repeats`` times;
    one row each run, in the order batch, context, repeat, then the policies as
    :func:`policy_turn` rotates them for that repeat. ``on_row(rows)`` is called
    with the rows so far after each run (to save partial results of a long grid). ``done``: rows
    of an earlier run of this grid (``--resume``); its complete cells (:func:`complete_cells`) are
    kept and not measured again, and each row carries the bound rates of its own run
    (``extra["bound_rates_gbs"]``).

    Raises:
        ValueError: ``cfg.repeats`` below 1.
    """
    if cfg.repeats < 1:
        raise ValueError(f"repeats (--repeats) must be >= 1, got {cfg.repeats}")
    kept = complete_cells(cfg, done or [])
    skip = {(r.batch, r.context) for r in kept}
    keys = [(b, c, r, p) for b in cfg.batches for c in cfg.contexts for r in range(cfg.repeats) for p in policy_turn(cfg.policies, r)]
    grid = [k for k in keys if k[:2] not in skip]
    if cfg.warmup:  # first uses cost extra: pay them unmeasured, at every batch size of the grid,
        # since CUDA graphs are captured per decode token count (models/graphs.py): a warm-up at
        # batch 1 left the first row of every other batch size to capture them in its timed steps
        short, longest = min(cfg.contexts + [2 * cfg.window]), max(cfg.contexts)
        for b in dict.fromkeys(b for b, _, _, _ in grid):
            for p in dict.fromkeys(cfg.policies):
                run_one(llm, BenchConfig([b], [short], [p], steps=2, window=cfg.window, warmup=False, kv_fill=cfg.kv_fill),
                        b, short, p, roofline)
                if longest > short and needs_split_warm_up(p, b):  # its half-batch graphs, captured unmeasured
                    run_one(llm, BenchConfig([b], [longest], [p], steps=2, window=cfg.window, warmup=False, kv_fill=cfg.kv_fill),
                            b, longest, p, roofline)
        if getattr(llm, "other_work", None) is not None:  # its steps capture graphs: no fixed cost of theirs places a row
            llm.other_work.forget_in_step_c()
    rows = list(kept)
    bar = tqdm(grid, desc="bench", unit="config", disable=not cfg.progress)
    for b, c, r, p in bar:
        bar.set_postfix_str(f"batch {b} context {c} {p}" + (f" run {r + 1}/{cfg.repeats}" if cfg.repeats > 1 else ""), refresh=True)
        rows.append(run_one(llm, cfg, b, c, p, roofline))
        rows[-1].extra["repeat"] = r
        rows[-1].extra["bound_rates_gbs"] = {"split": cfg.rates.split_gbs(), "stream": cfg.rates.stream_gbs(), "source": cfg.rates.source}
        if on_row is not None:
            on_row(rows)
    bar.close()
    if not kept:
        return rows
    order: dict = {}  # the grid's order, kept cells in their places (a key's first place where a batch repeats)
    for k in keys:
        order.setdefault(k, len(order))
    return sorted(rows, key=lambda x: order.get((x.batch, x.context, x.extra.get("repeat", 0), x.policy), len(order)))


def random_kv_prefill(llm: LLM, seed: int):
    """A stand-in for ``LLM._prefill``: every prompt token's KV in every layer written through
    the cache (so the policy routes it as a prefill would) as seeded normal values of the model's
    KV shape, and random last-token logits. Decode then does the same work as after a real
    prefill (the values do not change it), without the prefill's time."""

    def prefill(ids: list[list[int]], slots: list[int]) -> torch.Tensor:
        lay, dev, dt = llm.config.kv_layout, llm.device, llm.dtype
        g = torch.Generator(device=dev).manual_seed(seed)
        for slot, p in zip(slots, ids):
            for layer in range(llm.config.num_layers):
                k = torch.randn(len(p), lay.kv_heads, lay.k_dim, generator=g, device=dev, dtype=dt)
                v = None if lay.shared_kv else torch.randn(len(p), lay.kv_heads, lay.v_dim, generator=g, device=dev, dtype=dt)
                llm.cache.write(slot, layer, k, v)
        return torch.randn(len(ids), llm.config.vocab_size, generator=g, device=dev, dtype=torch.float32)

    return prefill


def link_copies(copy_timers: list | None) -> dict | None:
    """The link's rate inside decode steps from the decoder's ``copy_timers`` ((start, end, bytes)
    of each ping-pong fill, stamped on the copy stream after the fill's wait for its buffer: the
    copies alone, under whatever else reads host memory meanwhile, such as the CPU's attention and
    experts): ``link_copy_gbs`` (bytes over the fills' summed seconds), ``link_copy_ms`` per fill
    and ``fills``. None without a timed fill (nothing streamed, or no CUDA: the copies then are
    plain ``torch.cat``)."""
    done = [(a, b, n) for a, b, n in copy_timers or () if isinstance(b, float) or b.query()]  # CUDA: completed ones only
    seconds = sum(stamp_seconds(a, b) for a, b, _ in done)
    if not done or not seconds > 0:
        return None
    nbytes = sum(n for _, _, n in done)
    return {"link_copy_gbs": nbytes / seconds / 1e9, "link_copy_ms": seconds / len(done) * 1e3, "fills": len(done)}


def split_parts(decoder, timers: list | None, attention_s: list[float], bytes_per_token: int) -> dict | None:
    """Where a row's decode attention calls went, per call (a layer of the batch, or of one half
    in a micro-batched step), from ``timers`` (the decoder's ``gpu_timers`` of the row), in ms,
    over the calls with a CPU part (``calls_with_cpu``; all of
    them without one): ``attention`` (from the call's first launch to its merge, the mean of
    ``attention_s``), ``gpu_part`` (the device's window and load-region work before it waits for
    the CPU partial: on CUDA, events on the compute stream, including its waits for streamed
    blocks), ``cpu`` (the CPU worker's attention), and the CPU's in-step rate
    (``cpu_ns_per_token``, ``cpu_gbs`` of KV read, ``bytes_per_token`` per layer). ``attention``
    minus the larger of the two sides is the hand-over between them. With
    early copies on (``WRITESCOPE_LOAD_COPIES``) and blocks streamed, also the row's fills copied early and
    used (``early_fills``) and copied again (``early_fills_wasted``). None when no call was timed, or when the calls
    timed and the decoder's do not pair up."""
    timers = timers or []
    if not attention_s or len(timers) != len(attention_s):
        return None
    with_cpu = [i for i, (_, has_cpu) in enumerate(timers) if has_cpu]
    pick = with_cpu or list(range(len(timers)))
    gpu = [decoder.gpu_seconds(timers[i][0]) for i in pick]
    st = decoder.stats
    out = {"calls": len(attention_s), "calls_with_cpu": len(with_cpu),
           "attention": sum(attention_s[i] for i in pick) / len(pick) * 1e3, "gpu_part": sum(gpu) / len(gpu) * 1e3}
    if with_cpu and st.cpu_tokens > 0 and st.cpu_seconds > 0 and st.cpu_parts > 0:
        out["cpu"] = st.cpu_seconds / st.cpu_parts * 1e3
        out["cpu_ns_per_token"] = st.cpu_seconds / st.cpu_tokens * 1e9
        out["cpu_gbs"] = st.cpu_tokens * bytes_per_token / st.cpu_seconds / 1e9
    if getattr(decoder, "copies_early", False) and st.streamed_copies > 0:  # a row that streamed nothing copied nothing early
        out["early_fills"], out["early_fills_wasted"] = st.early_fills, st.early_fills_wasted
    return out


def expert_split(work, trace: list[dict] | None) -> dict | None:
    """What the joint roofline's per-step expert split (``work``: an
    :class:`~writescope.scheduler.expert_work.ExpertWork`, or None) did over a run's decode steps,
    from its r(L) ``trace``: hit host experts streamed and computed on the CPU per decode step,
    and the rates it balanced them with at the end (E as the CPU's GB/s of expert weights, G as
    the link's, tracked from the decode steps' timings where ``link_samples`` > 0, and at attach
    ``link_attach_gbs``; ``link_issue_bound``, timings left out since the device waited for the
    issuing thread: moe/link_timing.py), and the CPU call's fixed ms; ``expected``: the counts are the split's expectation, as
    on the native expert worker, whose split is made on the device); None without a split or
    without decode steps."""
    points = [p for p in trace or () if "experts_streamed" in p]
    if work is None or not points:
        return None
    return {"steps": len(points), "streamed_per_step": sum(p["experts_streamed"] for p in points) / len(points),
            "cpu_per_step": sum(p["experts_cpu"] for p in points) / len(points),
            "streamed_steps": [p["experts_streamed"] for p in points],  # each decode step's, in order
            "cpu_gbs": 1e-9 / work.e.value, "link_gbs": 1e-9 / work.g_link.value, "cpu_call_ms": work.call * 1e3,
            "link_attach_gbs": 1e-9 / work.g, "link_samples": getattr(work, "link_samples", 0),
            "link_issue_bound": getattr(getattr(work, "link_timer", None), "issue_bound", 0),
            "expected": bool(getattr(work, "expected", False)),
            "link_kv_gbs": 1e-9 / work.g_kv if getattr(work, "g_kv", None) else None,
            "link_read_gbs": 1e-9 / work.g_read if getattr(work, "g_read", None) else None}


def too_long_reason(e: TooLong, steps: int) -> str:
    """``e``'s message with its advice in bench's flags: a request is --context tokens, then
    ``steps`` + 1 decoded (the engine's max_tokens), so --context shortens the prompt and --steps
    lowers max_tokens."""
    if e.prompt_fits is not None:
        ways = [f"use a shorter --context (bench adds --steps + 1 = {steps + 1} tokens)"]
    elif e.max_tokens_fits is not None:
        ways = [f"use fewer --steps (bench decodes --steps + 1 tokens after the context: at most {e.max_tokens_fits:,} fit)"]
    else:
        ways = []
    if e.can_raise:
        ways.append("raise max_model_len")
    return f"{e.problem}: " + (", or ".join(ways) or "use a shorter --context and fewer --steps")


def run_one(llm: LLM, cfg: BenchConfig, batch: int, context: int, policy: str, roofline=None) -> BenchRow:
    row = BenchRow(batch, context, policy)
    g = torch.Generator().manual_seed(cfg.seed + 1000 * batch + context)
    vocab = llm.config.vocab_size
    prompts = torch.randint(3, vocab, (batch, context), generator=g).tolist()
    params = SamplingParams(max_tokens=cfg.steps + 1, ignore_eos=True)
    timer = None
    base, env = switches.split(policy)  # POLICY@NAME=VALUE+...: the row's own switches, for its cache and its forwards
    if env:
        row.extra["switches"] = env
    env, settings = switches.settings(env)
    share = settings.get("expert_stream_share", llm.expert_stream_share_at_load)  # a row without its own: the run's
    pinned_before = dict(pinned.STATS)
    try:
        with switches.applied(env):
            if share != llm.expert_stream_share_given:  # set_policy below attaches the per-step split for it
                llm.set_expert_stream_share(share, attach=False)
            llm.set_policy(base, cfg.window, roofline=roofline)
            timer = _TimedAttend(llm.cache, llm.device)
            if isinstance(llm.cache, InplaceKVCache):  # each call's GPU part timed too (events, no synchronisation)
                llm.cache.decoder.time_gpu, llm.cache.decoder.gpu_timers = True, []
                llm.cache.decoder.copy_timers = []
            progress, llm.progress = llm.progress, False
            if cfg.kv_fill == "random":
                llm._prefill = random_kv_prefill(llm, cfg.seed + batch + context)  # an instance attribute: removed below
            try:
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
                work = llm.expert_work  # this row's per-step expert split (a restored share below attaches another)
            finally:
                llm.progress = progress
                llm.__dict__.pop("_prefill", None)
    except (ValueError, RuntimeError, torch.OutOfMemoryError) as e:
        reason = too_long_reason(e, cfg.steps) if isinstance(e, TooLong) else str(e).split("\n")[0]
        row.fits, row.reason = False, reason[:300]
        if llm.device.type == "cuda":
            torch.cuda.empty_cache()
        return row
    finally:
        if timer is not None:
            timer.remove()
        decoder = getattr(llm.cache, "decoder", None) if isinstance(llm.cache, InplaceKVCache) else None
        timers = decoder.gpu_timers if decoder is not None else None
        copy_timers = decoder.copy_timers if decoder is not None else None
        if decoder is not None:  # what comes after the row (another generate on this cache) is not timed
            decoder.time_gpu, decoder.gpu_timers, decoder.copy_timers = False, None, None
    if llm.decode_host:  # the main thread's issue and wait per decode step (a wait near 0: issue-bound)
        row.extra["issue_ms"] = statistics.median(i for i, _ in llm.decode_host) * 1e3
        row.extra["wait_ms"] = statistics.median(w for _, w in llm.decode_host) * 1e3
        # each step in order: the seconds before it since the last tokens were sampled, and its issue + wait with them
        # (TPOT is a mean over the steps, so one slow step moves it: format_slow_steps)
        # (decode_host and decode_between keep the last DECODE_HOST_STEPS steps: past that, step_ms is the last ones)
        row.extra["between_ms"] = [round(b * 1e3, 3) for b in llm.decode_between]
        row.extra["step_ms"] = [round((b + i + w) * 1e3, 3) for b, (i, w) in zip(llm.decode_between, llm.decode_host)]
    row.extra["release_ms"] = llm.release_s * 1e3  # freeing the batch's KV after its last token (not in TPOT)
    # page-locking and unlocking host memory from this row's set_policy (which closes the last row's cache)
    # to its end: the wall seconds of the CUDA calls and their bytes (all 0 without CUDA)
    row.extra["pinned"] = {k: pinned.STATS[k] - pinned_before[k] for k in pinned.STATS}
    other = llm.other_work.seconds(batch) if getattr(llm, "other_work", None) is not None else None
    if other is not None:  # O at this batch under the path of the row's last step's host experts, after this row
        row.extra["other_work_ms"] = other * 1e3  # (scheduler/other_work.py)
        if llm.other_work.path(batch):
            row.extra["other_work_path"] = llm.other_work.path(batch)
    split = expert_split(work, llm.r_trace)
    if split is not None:
        row.extra["expert_split"] = split
    m = outs[0].metrics
    row.prefill_tok_s, row.decode_tok_s = (0.0 if cfg.kv_fill == "random" else m.prefill_tok_s), m.decode_tok_s
    row.extra["kv_fill"] = cfg.kv_fill
    row.tpot_ms = statistics.median(o.metrics.tpot_s for o in outs) * 1e3
    times = timer.seconds()
    if times:
        row.attn_ms_per_layer = statistics.median(times) * 1e3
    itemsize = llm.dtype.itemsize
    mean_ctx = context + cfg.steps / 2  # tokens cached on average over the decode steps
    row.kv_bytes_per_layer = int(batch * mean_ctx * llm.config.kv_layout.bytes_per_token(itemsize))
    if row.attn_ms_per_layer > 0:
        row.gbs = row.kv_bytes_per_layer / (row.attn_ms_per_layer / 1e3) / 1e9
    placed = [o.kv_placement for o in outs if o.kv_placement is not None]
    host_share = 0.0  # of the KV in host memory (the compute and load regions); 0 with every byte on the device
    if placed:
        comp = sum(x["compute"] for x in placed)
        load = sum(x["load"] for x in placed)
        every = comp + load + sum(x["window"] for x in placed)
        host_share = (comp + load) / every if every else 0.0
        row.r_deployed = comp / (comp + load) if comp + load else None
        cache = llm.cache
        if isinstance(cache, InplaceKVCache):
            st = cache.decoder.stats
            parts = split_parts(cache.decoder, timers, times, llm.config.kv_layout.bytes_per_token(itemsize))
            if parts:
                row.extra["split_parts"] = parts
            link = link_copies(copy_timers)
            if link:
                row.extra["link_copies"] = link
            row.prepare_ms_per_layer = st.prepare_seconds / max(1, st.layer_steps) * 1e3
            if st.prepare_seconds > 0:
                row.prepare_gbs = st.prepared_bytes / st.prepare_seconds / 1e9
            if getattr(cache.policy, "monolithic", False):
                read = cache.policy.read_share(context)  # the split the monolithic cache read with
                row.r_deployed = read
    host_bytes = row.kv_bytes_per_layer * host_share  # what the bounds count: the KV read from host memory
    if host_bytes > 0:
        row.bound_ms = host_bytes / (cfg.rates.split_gbs() * 1e9) * 1e3
        row.frac_of_bound = row.bound_ms / row.attn_ms_per_layer if row.attn_ms_per_layer > 0 else 0.0
        row.step_bound_ms = host_bytes * llm.config.num_layers / (cfg.rates.split_gbs() * 1e9) * 1e3
        row.stream_step_bound_ms = host_bytes * llm.config.num_layers / (cfg.rates.stream_gbs() * 1e9) * 1e3
    row.host_expert_bytes = expected_host_expert_bytes(getattr(llm, "_moe_blocks", []), batch)
    if row.host_expert_bytes > 0 and cfg.rates.split_gbs() > 0:
        kv = host_bytes * llm.config.num_layers
        row.joint_step_bound_ms = (kv + row.host_expert_bytes) / (cfg.rates.split_gbs() * 1e9) * 1e3
    return row
