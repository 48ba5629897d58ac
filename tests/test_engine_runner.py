"""The continuous-batching engine (writescope/engine/scheduler.py, runner.py): requests joining
and leaving the decode batch between steps give the same greedy tokens as ``LLM.generate``;
admission, cancellation and failures free the KV; a failing request fails alone; ``LLM.generate``
runs on it offline (the batch prefilled whole, then decoded together); 1,000 requests in a row
leave memory flat."""

from __future__ import annotations

import gc
import os
import resource

import pytest
from helpers import run_short_requests, short_request_engine

from writescope import LLM, SamplingParams
from writescope.engine.runner import EngineCore
from writescope.engine.scheduler import Scheduler
from writescope.errors import ArgError

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 9, 30, 1, 12)]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-qwen3-moe", device="cpu", progress=False, prefill_chunk_tokens=7, max_model_len=256)


def drain(core: EngineCore, later: list | None = None, after_steps: int = 3) -> dict:
    """Run until idle; ``later`` requests are added after ``after_steps`` steps. Returns
    {request_id: (token ids, last output)}."""
    got: dict = {}
    steps = 0
    while core.has_work() or later:
        for o in core.step():
            ids, _ = got.get(o.request_id, ([], None))
            got[o.request_id] = (ids + list(o.new_token_ids), o)
        steps += 1
        if later and steps >= after_steps:
            for r in later:
                core.add(r)
            later = None
    return got


@pytest.mark.parametrize("policy", ["resident", "static:0.5"])
def test_joining_requests_match_offline_generate(llm, policy):
    llm.set_policy(policy, window=8)
    try:
        sp = SamplingParams(max_tokens=20, ignore_eos=True)
        ref = llm.generate(prompt_token_ids=PROMPTS, sampling_params=sp)
        core = EngineCore(llm, max_num_seqs=3)  # fewer seats than requests: some wait for others to finish
        reqs = [core.make_request(p, sp) for p in PROMPTS]
        for r in reqs[:2]:
            core.add(r)
        got = drain(core, later=reqs[2:])
        for r, o in zip(reqs, ref):
            assert got[r.request_id][0] == o.token_ids, r.request_id
            assert got[r.request_id][1].finish_reason == "length"
            assert got[r.request_id][1].output_tokens == 20
        assert llm.cache.active_slots == []
    finally:
        llm.set_policy("resident")


def test_sampled_request_uses_its_seed(llm):
    sp = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    ref = llm.generate(prompt_token_ids=[PROMPTS[1]], sampling_params=sp)[0]
    core = EngineCore(llm)
    req = core.make_request(PROMPTS[1], sp)
    core.add(req)
    core.add(core.make_request(PROMPTS[0], SamplingParams(max_tokens=5)))  # a greedy neighbour in the batch
    assert drain(core)[req.request_id][0] == ref.token_ids


def test_stop_tokens_and_eos(llm):
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = llm.generate(prompt_token_ids=[PROMPTS[3]], sampling_params=sp)[0].token_ids
    core = EngineCore(llm)
    req = core.make_request(PROMPTS[3], SamplingParams(max_tokens=20, stop_token_ids=(ref[4],)))
    core.add(req)
    ids, last = drain(core)[req.request_id]
    assert ids == ref[: ref.index(ref[4]) + 1] and last.finish_reason == "stop"


def test_max_num_seqs_bounds_the_batch(llm):
    core = EngineCore(llm, max_num_seqs=2)
    for p in PROMPTS:
        core.add(core.make_request(p, SamplingParams(max_tokens=4, ignore_eos=True)))
    most = 0
    while core.has_work():
        core.step()
        most = max(most, len(core.scheduler.active), len(llm.cache.active_slots))
    assert most == 2 and llm.cache.active_slots == []


def test_abort_frees_the_slot(llm):
    core = EngineCore(llm)
    a = core.make_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    b = core.make_request(PROMPTS[1], SamplingParams(max_tokens=5, ignore_eos=True))
    core.add(a)
    core.add(b)
    for _ in range(4):
        core.step()
    assert len(llm.cache.active_slots) == 2
    out = core.abort(a.request_id)
    assert out.finish_reason == "abort" and a.slot is None and len(llm.cache.active_slots) == 1
    assert core.abort(a.request_id) is None  # finished already: nothing to do
    drain(core)
    assert llm.cache.active_slots == []
    waiting = core.make_request(PROMPTS[2], SamplingParams(max_tokens=5))
    core.add(waiting)
    assert core.abort(waiting.request_id).finish_reason == "abort" and not core.has_work()


def test_a_failing_request_fails_alone(llm, monkeypatch):
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    ref = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=sp)
    core = EngineCore(llm)
    reqs = [core.make_request(p, sp) for p in PROMPTS[:3]]
    real = core._prefill_chunk

    def prefill(req):
        if req is reqs[1]:
            raise RuntimeError("injected")
        return real(req)

    monkeypatch.setattr(core, "_prefill_chunk", prefill)
    for r in reqs:
        core.add(r)
    got = drain(core)
    bad = got[reqs[1].request_id][1]
    assert bad.finish_reason == "error" and "injected" in bad.error
    for i in (0, 2):
        assert got[reqs[i].request_id][0] == ref[i].token_ids
    assert llm.cache.active_slots == []


def test_refused_before_queueing(llm):
    core = EngineCore(llm)
    with pytest.raises(ArgError, match="max_model_len of 256 tokens"):
        core.make_request(PROMPTS[0], SamplingParams(max_tokens=252))
    with pytest.raises(ArgError, match="empty"):
        core.make_request([], SamplingParams(max_tokens=2))
    with pytest.raises(ArgError, match="outside the model's vocabulary"):
        core.make_request([5, 10**6], SamplingParams(max_tokens=2))
    core.make_request(PROMPTS[0], SamplingParams(max_tokens=251))  # exactly at the limit


def test_admission_waits_for_room_and_refuses_what_never_fits():
    from writescope.engine.request import Request
    from writescope.engine.scheduler import Scheduler

    sch = Scheduler(4, 100, [2], fits=lambda caps: None if sum(caps) <= 50 else f"{sum(caps)} > 50 tokens")
    reqs = [Request(f"r{i}", [5] * n, SamplingParams(max_tokens=10)) for i, n in enumerate((20, 20, 45))]
    for r in reqs:
        sch.add(r)
    assert sch.next_prefill() == (reqs[0], [])
    sch.prefilled(reqs[0])
    assert sch.next_prefill() == (None, [])  # 30 + 30 > 50: r1 waits for r0
    sch.remove(reqs[0])
    assert sch.next_prefill() == (reqs[1], [])
    sch.remove(reqs[1])
    req, refused = sch.next_prefill()  # r2 (55 tokens) cannot fit even alone
    assert req is None and refused == [reqs[2]] and "55 > 50 tokens" in reqs[2].error


# ------------------------------------------------------------------ LLM.generate on the engine
def spy_forward(llm, monkeypatch, fail_at_decode: int | None = None) -> list[list[int]]:
    """Records every forward pass's query lengths (one per sequence); with ``fail_at_decode``,
    the forward of that decode step (1-based; all query lengths 1) raises."""
    real, seen = llm.model.forward, []

    def forward(ids, batch, cache, *a, **kw):
        seen.append(list(batch.query_lens))
        if fail_at_decode is not None and sum(1 for q in seen if set(q) == {1}) == fail_at_decode:
            raise RuntimeError("injected decode failure")
        return real(ids, batch, cache, *a, **kw)

    real_by_layer = llm.model.forward_by_layer

    def by_layer(passes, cache, *a, **kw):  # prefill passes run layer by layer (engine/prefill_order.py): each pass once
        seen.extend(list(batch.query_lens) for _, batch in passes)
        return real_by_layer(passes, cache, *a, **kw)

    monkeypatch.setattr(llm.model, "forward", forward)
    monkeypatch.setattr(llm.model, "forward_by_layer", by_layer)
    return seen


def test_generate_prefills_the_whole_batch_then_decodes_it_together(llm, monkeypatch):
    """generate runs on EngineCore (offline): every prompt is prefilled (chunks of at most
    prefill_chunk_tokens = 7, packed across the requests) before the first decode step, and then
    each decode step takes every request still running, as before the engine."""
    prompts, max_tokens = [PROMPTS[1], PROMPTS[2], PROMPTS[0]], (5, 2, 3)
    seen = spy_forward(llm, monkeypatch)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=[SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])
    prefill, decode = seen[:-4], seen[-4:]
    assert decode == [[1, 1, 1], [1, 1], [1], [1]]  # request 1 leaves after 2 tokens, request 2 after 3
    assert sum(map(sum, prefill)) == sum(map(len, prompts)) and all(sum(q) <= 7 for q in prefill)
    assert [len(o.token_ids) for o in outs] == list(max_tokens) and [o.request_id for o in outs] == [outs[0].request_id + i for i in range(3)]
    assert len({o.metrics.ttft_s for o in outs}) == 1 and all(o.metrics.tpot_s > 0 and o.metrics.decode_tok_s > 0 for o in outs)
    assert llm.cache.active_slots == []
    # the decode phase ends with its last token: (5 + 2 + 3 - 3) tokens over the TPOT x 4 intervals of the longest
    # request; freeing the slots after it is timed apart (release_s)
    longest = outs[0].metrics
    assert longest.decode_tok_s == pytest.approx(7 / (longest.tpot_s * 4))


@pytest.mark.parametrize("policy", ["resident", "static:0.5"])
def test_generate_raises_what_a_step_raises_and_frees_every_slot(llm, monkeypatch, policy):
    llm.set_policy(policy, window=8)
    try:
        sp = SamplingParams(max_tokens=6, ignore_eos=True)
        ref = [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=sp)]
        spy_forward(llm, monkeypatch, fail_at_decode=2)
        with pytest.raises(RuntimeError, match="injected decode failure"):
            llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=sp)
        assert llm.cache.active_slots == []
        monkeypatch.undo()
        assert [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=sp)] == ref
    finally:
        llm.set_policy("resident")


def test_engine_under_a_vram_budget_seats_the_plans_max_batch():
    """Under a VRAM budget the continuous engine seats the plan's max_batch (its default
    max_num_seqs, and the most it accepts); generate's offline batch is not bound by it."""
    llm = LLM("tiny-qwen3-moe", device="cpu", progress=False, vram_budget="1TiB", max_batch=2, max_model_len=256)
    assert EngineCore(llm).scheduler.max_num_seqs == 2
    with pytest.raises(ValueError, match="max_num_seqs 3 is above the VRAM budget plan's 2 sequences"):
        EngineCore(llm, max_num_seqs=3)
    assert len(llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=SamplingParams(max_tokens=2))) == 3


# ------------------------------------------------------------------ many requests
def _rss_bytes() -> int:
    """Resident set size of this process (bytes), from /proc (Linux), else the peak RSS."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("policy", ["resident", "static:0.5"])
def test_a_thousand_sequential_requests_leave_memory_flat_and_free_every_slot(policy):
    """1,000 short requests one after another (prompts of 4-12 tokens, 1-6 new tokens: D-windows
    evicted under static:0.5) after 100 unmeasured ones (allocator and caches
    warmed): every cache slot is freed, the engine holds no request, and the process grew by
    fewer than 200 Python objects tracked by the GC (a leaked request would leave at least
    1,000: itself, its lists) and under 16 MiB of RSS (0.6 MiB seen on the CPU)."""
    llm, core = short_request_engine("cpu", policy)
    run_short_requests(core, 100)
    gc.collect()
    objects, rss = len(gc.get_objects()), _rss_bytes()
    run_short_requests(core, 1000)
    gc.collect()
    assert llm.cache.active_slots == [] and not core.has_work() and not core.scheduler.active
    if policy != "resident":
        assert llm.cache.evicted_blocks > 0 and not llm.cache._seqs
    assert len(gc.get_objects()) - objects < 200
    assert _rss_bytes() - rss < 16 * 2**20
    llm.set_policy("resident")


def test_n_choices_must_fit_together():
    """``n`` choices of one prompt: those that may run at once (at most max_num_seqs) must fit
    beside each other, else the request is refused naming ``n``; more wait their turn."""
    seen = []

    def fits(caps):
        seen.append(list(caps))
        return "two sequences at most" if len(caps) > 2 else None

    s = Scheduler(2, 100, [], fits)
    s.check_group(10, 5, 8)  # 8 choices, 2 at a time: fits
    assert seen[-1] == [15, 15]
    s3 = Scheduler(3, 100, [], fits)
    with pytest.raises(ArgError, match=r"n=3 choices \(3 running at once\) cannot fit: two sequences at most") as e:
        s3.check_group(10, 5, 3)
    assert e.value.names == ("n",)
    count = len(seen)
    s3.check_group(10, 5, 1)  # one choice: checked by check() alone
    assert len(seen) == count


class _Clock:
    """A stand-in for the engine's ``time`` (its ``perf_counter``): each reading 1 ms after the
    last, and ``jump`` seconds more where a test says, so nothing depends on the real clock or load."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1e-3
        return self.now

    def jump(self, seconds: float) -> None:
        self.now += seconds


def test_the_time_before_each_decode_step_counts_the_work_between_steps(llm, monkeypatch):
    """``decode_between``: a decode step's time since the last tokens were sampled holds what runs
    between steps (here a step hook after each step that moves the clock 5 s)."""
    from writescope.engine import runner

    clock = _Clock()
    monkeypatch.setattr(runner, "time", clock)
    llm.step_hook = lambda: clock.jump(5.0)
    try:
        llm.generate(prompt_token_ids=[PROMPTS[0], PROMPTS[2]], sampling_params=SamplingParams(max_tokens=5, ignore_eos=True))
    finally:
        llm.step_hook = None
    assert len(llm.decode_between) == len(llm.decode_host) == 4  # the first token comes from the prefill
    assert llm.decode_between[0] < 5.0 and all(b >= 5.0 for b in llm.decode_between[1:])


def test_the_time_before_a_decode_step_leaves_out_an_idle_engine(llm, monkeypatch):
    """Online, the first decode step of a request that arrives after the engine idled counts from
    its prefill's token, not from the last request's (a clock that jumps 1000 s while idle)."""
    from writescope.engine import runner

    clock = _Clock()
    monkeypatch.setattr(runner, "time", clock)
    core = EngineCore(llm)
    for p in PROMPTS[:2]:
        core.add(core.make_request(p, SamplingParams(max_tokens=4, ignore_eos=True)))
        drain(core)
        clock.jump(1000.0)  # idle before the next request
    assert len(core.decode_between) == 6 and 0 <= max(core.decode_between) < 1000
