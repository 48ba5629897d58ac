"""G tracked from decode steps: the link timer (moe/link_timing.py), the joint roofline following it,
and the path that times the fused kernels' in-place reads on CUDA."""

import math
from types import SimpleNamespace

import pytest
import torch

from writescope.moe import async_experts
from writescope.moe.link_timing import LinkTimer, link_expert_count
from writescope.scheduler.expert_work import PROBE_EVERY, ExpertWork, expected_hit_experts
from writescope.scheduler.roofline import OnlineEstimate


class FakeEvent:
    """A timing event whose clock the test sets: ``at`` ms when recorded, ``done`` when passed."""

    clock = 0.0

    def __init__(self):
        self.at, self.done = None, False

    def record(self):
        self.at = FakeEvent.clock

    def query(self):
        return self.done

    def elapsed_time(self, end):
        return end.at - self.at


def _passed(timer, count=4):
    """One timing of ``count`` experts, its end passed (to use up the timer's first)."""
    timer.finish(timer.start(torch.tensor(count)), 1000)
    timer._pending[1].done = True
    return timer.collect()


def test_the_timer_times_one_layer_step_in_every_and_collects_without_waiting():
    timer = LinkTimer(every=3, event=FakeEvent)
    assert _passed(timer) is None  # the first timing is not used (a first call may compile)
    assert [timer.wants() for _ in range(3)] == [False, False, True]
    FakeEvent.clock = 10.0
    start = timer.start(torch.tensor(4))
    FakeEvent.clock = 12.5
    timer.finish(start, expert_nbytes=1000)
    assert not any(timer.wants() for _ in range(6))  # one in flight: no other timed
    assert timer.collect() is None  # its end has not passed: no wait, nothing yet
    timer._pending[1].done = True
    assert timer.collect() == (pytest.approx(2.5e-3), 4000)
    assert timer.collect() is None  # collected once
    assert [timer.wants() for _ in range(3)] == [False, False, True]


def test_a_timing_that_read_nothing_or_one_expert_or_was_dropped_gives_nothing():
    timer = LinkTimer(every=1, event=FakeEvent)
    _passed(timer)
    assert timer.wants()
    assert _passed(timer, 0) is None and _passed(timer, 1) is None  # nothing read; one: the launches weigh too much
    assert _passed(timer, 2) is not None
    big = LinkTimer(every=1, event=FakeEvent, min_bytes=4000)  # one expert of at least min_bytes is used
    _passed(big)
    for n, nbytes, used in ((1, 4000, True), (1, 3999, False), (0, 10**9, False), (2, 1, True)):
        big.finish(big.start(torch.tensor(n)), nbytes)
        big._pending[1].done = True
        assert (big.collect() is not None) == used, (n, nbytes)
    assert LinkTimer(every=1, event=FakeEvent, min_experts=1)._first
    one = LinkTimer(every=1, event=FakeEvent, min_experts=1)
    _passed(one)
    assert _passed(one, 1) is not None
    assert timer.wants()
    timer.finish(timer.start(torch.tensor(3)), 1000)
    timer.drop()
    assert timer.collect() is None and timer.wants()


def test_a_timing_whose_start_passed_while_the_kernels_were_issued_is_left_out_and_counted():
    timer = LinkTimer(every=1, event=FakeEvent)
    _passed(timer)
    start = timer.start(torch.tensor(4))
    start.done = True  # the device reached the start before this thread had issued the kernels
    timer.finish(start, 1000)
    timer._pending[1].done = True
    assert timer.collect() is None and timer.issue_bound == 1 and timer._pending is None
    assert _passed(timer) is not None and timer.issue_bound == 1  # the device behind the thread: used


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="every must be >= 1, got 0"):
        LinkTimer(every=0)


@pytest.mark.parametrize("tokens", [1, 15, 16, 17])
def test_the_count_is_the_hit_host_experts_the_link_reads(tokens):
    g = torch.Generator().manual_seed(tokens)
    E, hosted = 16, 6
    slot_of = torch.full((E,), hosted, dtype=torch.long)
    slot_of[torch.arange(0, E, 2)[:hosted]] = torch.arange(hosted)  # even experts 0..10 in host memory
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(tokens)])
    for share in (0.0, 0.5, 1.0):
        _, link = async_experts.partition(ids, slot_of, hosted, share, None)
        want = sum(1 for e in set(ids.flatten().tolist()) if link[e] < hosted)
        assert int(link_expert_count(ids, link, hosted)) == want
    assert int(link_expert_count(ids[:0], slot_of, hosted)) == 0  # no tokens


def _work(e, g, timer=None):
    policy = SimpleNamespace(roofline=SimpleNamespace(b=1e-9, c_cpu=0.0, c_gpu=0.0), a=SimpleNamespace(value=1e-9),
                             c=SimpleNamespace(value=0.0))
    work = ExpertWork(e=e, g=g, host_fraction=0.5, expert_bytes=1000, num_experts=64, top_k=6,
                      decoder=SimpleNamespace(last_split=(0, 0)), policy=policy)
    work.link_timer = timer
    return work


BLOCK = SimpleNamespace(cfg=SimpleNamespace(num_experts=64, top_k=6), host_experts=frozenset(range(32)),
                        host_pack=SimpleNamespace(expert_nbytes=1000))


def test_the_split_follows_the_link_measured_in_steps():
    """G at attach as fast as the CPU: about half streamed; the steps then time the link 100x
    slower: the split streams none (one would take longer than the CPU's 25)."""
    work = _work(1e-9, 1e-9, timer=object())
    assert 0.0 < work.share_for(16, BLOCK) < 1.0
    for _ in range(12):
        work.observe_link(1e-4, 1000)  # 100x the seed's seconds per byte
    assert work.g_link.value == pytest.approx(1e-7, rel=0.05) and work.link_samples == 12
    assert work.g == 1e-9  # the value at attach is kept (reports)
    assert work.share_for(16, BLOCK) == 0.0
    work.observe_link(0.0, 1000)  # not a measurement
    work.observe_link(1e-3, 0)
    work.observe_link(float("nan"), 1000)
    assert work.link_samples == 12


def test_a_split_that_streams_none_probes_the_link_where_steps_time_it():
    m = round(expected_hit_experts(16, 64, 6) * 0.5)
    timed, untimed = _work(1e-12, 1e-6, timer=object()), _work(1e-12, 1e-6)
    got = [timed.share_for(16, BLOCK) for _ in range(PROBE_EVERY)]
    assert got[:-1] == [0.0] * (PROBE_EVERY - 1) and got[-1] == pytest.approx(2 / m)  # two: one is not timed
    assert timed.probing  # the block times the probe whatever the timer's turn
    timer = LinkTimer(every=1000, event=FakeEvent)
    timed.link_timer = timer
    assert async_experts._link_timer(SimpleNamespace(expert_work=timed), got[-1]) is timer and not timed.probing
    assert timed.share_for(16, BLOCK) == 0.0  # and then none again
    for _ in range(PROBE_EVERY - 1):  # with the one above, PROBE_EVERY in a row that streamed none
        timed.share_for(16, BLOCK)
    assert timed.probing
    timed.share_for(16, BLOCK)
    assert not timed.probing  # a probe not timed where it ran does not force a timing on a later choice
    assert all(untimed.share_for(16, BLOCK) == 0.0 for _ in range(2 * PROBE_EVERY))  # nothing would measure it


def test_only_a_decode_steps_positive_float_share_is_timed():
    timer = LinkTimer(every=1, event=FakeEvent)
    work = _work(1e-9, 1e-9, timer)
    block = SimpleNamespace(expert_work=work)
    assert async_experts._link_timer(block, 0.0) is None
    assert async_experts._link_timer(block, torch.tensor(0.5, dtype=torch.float64)) is None  # a captured pass's share
    work.decoder.last_split = None  # a prefill
    assert async_experts._link_timer(block, 0.5) is None
    work.decoder.last_split = (0, 0)
    assert async_experts._link_timer(block, 0.5) is timer
    assert async_experts._link_timer(SimpleNamespace(expert_work=None), 0.5) is None


def test_a_finished_timing_reaches_g_when_the_next_layer_starts(monkeypatch):
    timer = LinkTimer(every=1, event=FakeEvent)
    _passed(timer)
    work = _work(1e-9, 1e-9, timer)
    block = SimpleNamespace(expert_work=work)
    worker = SimpleNamespace(take_done=lambda: [])
    assert timer.wants()
    FakeEvent.clock = 0.0
    start = timer.start(torch.tensor(2))
    FakeEvent.clock = 1.0
    timer.finish(start, 1000)
    async_experts.observe_done(block, worker)
    assert work.link_samples == 0  # not passed yet
    timer._pending[1].done = True
    monkeypatch.setattr(async_experts.replay_hooks, "capturing", lambda: True)
    async_experts.observe_done(block, worker)
    assert work.link_samples == 0 and timer._pending is not None  # no event queried inside a capture
    monkeypatch.setattr(async_experts.replay_hooks, "capturing", lambda: False)
    async_experts.observe_done(block, worker)
    assert work.link_samples == 1 and work.g_link.value == pytest.approx(1e-9 + 0.3 * (1e-3 / 2000 - 1e-9))


@pytest.mark.gpu
def test_decode_steps_time_the_in_place_read_on_cuda():
    """``writescope`` on the asynchronous path with a split that streams: its decode steps time the
    fused kernels' in-place reads, and G follows them (positive and finite)."""
    from helpers import half_experts_budget
    from writescope import LLM, SamplingParams
    from writescope.kvcache.spec import Roofline

    llm = LLM("tiny-qwen3-moe", device="cuda", dtype="bfloat16", progress=False, window=16, max_batch=2, policy="static:0.5",
              vram_budget=half_experts_budget("tiny-qwen3-moe", torch.bfloat16, 2))
    llm.set_policy("writescope", roofline=Roofline(a=1e-9, b=1e-3, c_cpu=0.0, c_gpu=0.0))  # a slow link: the split attaches
    work = llm.expert_work
    assert work is not None and work.link_timer is not None
    work.link_timer.every, work.link_timer.min_experts = 1, 1  # a tiny batch hits few host experts
    work.e = OnlineEstimate(1.0, alpha=0.0)  # a CPU so slow that every host expert is streamed, and timed (E never moves)
    llm.generate(prompt_token_ids=[[5, 6, 7] * 12, [8, 9] * 10], sampling_params=SamplingParams(max_tokens=8, ignore_eos=True))
    # the tiny model's device may run ahead of the issuing thread: such timings are left out and counted
    assert work.link_samples + work.link_timer.issue_bound > 0
    assert 0 < work.g_link.value and math.isfinite(work.g_link.value)  # no rate bound: no timing test


@pytest.mark.gpu
def test_cuda_events_tell_a_window_the_device_ran_behind_the_thread_from_one_it_waited_in():
    """Real events, with no timing: a stream held on a pinned flag (the device behind the issuing
    thread) keeps the timing; a stream that has passed the start before finish (synchronised
    here) leaves it out."""
    from writescope.attention.flag_kernels import device_view, wait_flag

    flags = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    flags_dev = device_view(flags, torch.device("cuda"))
    timer = LinkTimer(every=1, min_experts=1)
    timer._first = False
    x = torch.randn(256, 256, device="cuda")
    count = torch.tensor(3, device="cuda")
    y = x @ x  # cuBLAS set up before the stream is held
    timer._count = torch.zeros((), dtype=torch.int64, pin_memory=True)  # and the timer's pinned count (a page-locked allocation)
    torch.cuda.synchronize()
    # Nothing between the wait and the host's store may wait for the stream: a copy from pageable
    # memory (torch.tensor(..., device="cuda")) would block this thread until the wait gave up.
    wait_flag(flags_dev, 0, 1, 1)  # the stream waits here until the host sets flags[0]
    start = timer.start(count)
    y = x @ x
    timer.finish(start, 1000)
    flags[0] = 1
    torch.cuda.synchronize()
    assert int(flags[1]) == 0  # the wait did not give up
    got = timer.collect()
    assert got is not None and got[1] == 3000 and got[0] > 0 and timer.issue_bound == 0
    start = timer.start(count)
    torch.cuda.synchronize()  # the device has passed the start: as if it waited for this thread
    y = x @ y
    timer.finish(start, 1000)
    torch.cuda.synchronize()
    assert timer.collect() is None and timer.issue_bound == 1
