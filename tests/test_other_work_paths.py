"""O kept per expert path (writescope/scheduler/other_work.py: ``expert_path``), and the balance
asking for O under the path its placement is expected to take (ExpertWork.expected_link_share)."""

from __future__ import annotations

import types

import pytest
import torch

from writescope.engine import timing
from writescope.kvcache.spec import Roofline
from writescope.scheduler import other_work as ow
from writescope.scheduler.expert_work import ExpertWork
from writescope.scheduler.roofline import WriteScopePolicy, roofline_share

# run 63's calibration on an H100 host, Qwen3-30B-A3B (benchmarks/results/gpu_decode_h200_run63_variants_qwen3_4x16k.json)
QWEN3 = Roofline(a=1.7038e-08, b=3.8003e-08, c_cpu=2.788e-04, c_gpu=1.3336e-04, b_alone=3.7228e-08, c_gpu_alone=1.4954e-04)


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _step(meter, clock, gap, layers=4, batch=4, box=None, share=None):
    """One decode step; its MoE passes (after layer 0's attention) set ``box["share"]`` to ``share``."""
    for layer in range(layers):
        meter.begin(layer, batch)
        if box is not None:
            box["share"] = share
        clock.t += 1.0
        meter.end(layer)
        clock.t += gap if layer < layers - 1 else 5.0


@pytest.mark.parametrize(("share", "path"), [(None, ""), (0.0, "cpu"), (0.49, "cpu"), (0.5, "link"), (1.0, "link")])
def test_expert_path_of_a_link_share(share, path):
    assert ow.expert_path(share) == path


def test_path_signature_keeps_the_old_key_without_host_experts():
    assert ow.path_signature("", "") == "" and ow.path_signature("A=1", "") == "A=1"
    assert ow.path_signature("", "cpu") == "experts=cpu" and ow.path_signature("A=1", "link") == "A=1,experts=link"


def test_o_is_kept_per_expert_path_and_read_under_the_last_step_s_by_default(monkeypatch):
    """Steps whose host experts the CPU computed and steps whose experts the link read feed two
    estimates; ``seconds(batch)`` reads the one of the last step's path."""
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    box = {"share": None}
    m = ow.OtherWork(torch.device("cpu"), warm=100, every=1, expert_link_share=lambda: box["share"])
    _step(m, clock, 9.0)  # the first step at a batch size: not measured
    _step(m, clock, 0.8, box=box, share=1.0)  # the link read the experts
    _step(m, clock, 0.8, box=box, share=1.0)
    _step(m, clock, 0.2, box=box, share=0.0)  # the CPU computed them
    _step(m, clock, 0.6, batch=16)  # the next batch's first step ends the last one at batch 4
    assert m.seconds(4, "link") == pytest.approx(0.8) and m.seconds(4, "cpu") == pytest.approx(0.2)
    assert m.path(4) == "cpu" and m.seconds(4) == pytest.approx(0.2)
    assert m.seconds(4, "") is None  # steps with host experts never feed the key of those without


def test_no_host_experts_keeps_o_under_the_switches_alone(monkeypatch, tmp_path):
    """Without host experts (share None) the key is what it was before paths (a store written then is read)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    m = ow.OtherWork(torch.device("cpu"), warm=100, every=1, store_key="k", expert_link_share=lambda: None)
    for gap in (9.0, 0.3, 0.3):
        _step(m, clock, gap)
    m.save()
    assert ("", 4) in ow.stored("k") and m.path(4) == ""
    again = ow.OtherWork(torch.device("cpu"), store_key="k")
    assert again.seconds(4) == pytest.approx(0.3)


def test_o_per_path_is_kept_for_a_later_process(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    m = ow.OtherWork(torch.device("cpu"), warm=100, every=1, store_key="k", expert_link_share=lambda: 0.0)
    for gap in (9.0, 0.25, 0.25):
        _step(m, clock, gap)
    m.save()
    assert ("experts=cpu", 4) in ow.stored("k")
    again = ow.OtherWork(torch.device("cpu"), store_key="k")
    assert again.seconds(4, "cpu") == pytest.approx(0.25) and again.seconds(4, "link") is None


def test_paused_steps_note_no_path(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    m = ow.OtherWork(torch.device("cpu"), warm=100, every=1, expert_link_share=lambda: 1.0)
    with m.paused():
        _step(m, clock, 0.5)
    assert m.path(4) == ""


def test_blocks_link_share_is_the_mean_over_blocks_holding_host_experts():
    a = types.SimpleNamespace(host_experts=frozenset({1}), link_share_last=0.0)
    b = types.SimpleNamespace(host_experts=frozenset({2}), link_share_last=1.0)
    c = types.SimpleNamespace(host_experts=frozenset(), link_share_last=1.0)  # no host experts: not counted
    d = types.SimpleNamespace(host_experts=frozenset({3}), link_share_last=None)  # no pass yet
    share = ow.blocks_link_share([a, b, c, d])
    assert share() == pytest.approx(0.5)
    assert ow.blocks_link_share([c])() is None and ow.blocks_link_share([d])() is None


def _work(policy, **kw):
    # Qwen3-30B-A3B: 128 experts, top-8, half in host memory, 9.4 MB an expert; E about 13 ns/byte
    # (77 GB/s, run 62's CPU experts), G the link's 55 GB/s
    return ExpertWork(e=1.3e-11, g=1.8e-11, host_fraction=0.5, expert_bytes=9_437_184, num_experts=128, top_k=8, policy=policy, **kw)


def test_expected_link_share_follows_the_link_s_load_and_records_nothing():
    policy = WriteScopePolicy(QWEN3)
    policy.prefetch_tokens = 65536  # two 64 MiB buffers of 2 KiB tokens
    work = _work(policy)
    long = work.expected_link_share(4, 4 * 16384)  # the link busy with the next layer's KV: the CPU takes them
    short = work.expected_link_share(4, 4 * 256)
    assert long == 0.0 and short > long
    assert not work.observed and work.n_streamed == work.n_computed == 0
    work.in_place_below = 8
    assert work.expected_link_share(4, 4 * 16384) == 1.0  # such passes read their host experts in place
    work.balance = "alone"
    work.in_place_below = 0
    assert work.expected_link_share(4, 4 * 16384) == short == work.expected_link_share(4, 0)


class Meter:
    """The meter's interface as the policy reads it, O per path given."""

    def __init__(self, per_path):
        self.per_path, self.asked = per_path, []

    def seconds(self, batch, path=None):
        self.asked.append(path)
        return self.per_path.get(path)

    def link(self, batch):
        return 0.0

    def in_step_c(self, threads, batch):
        return None

    def in_step_a(self, threads):
        return None


def test_the_balance_reads_o_under_the_path_its_placement_expects():
    """Run 63, Qwen3 4 x 16K (an H100 host): the meter held 2.9-3.6 ms, O of the warm-up's steps whose
    experts the link read, and the balance placed r 0, 1.32x slower than a share of 0.4; the steps
    whose CPU computed the experts spent about 1.5 ms a layer outside attention. Under the path its
    placement expects (the CPU: the link is busy with the KV) the balance places a share."""
    meter = Meter({"link": 3.59e-3, "cpu": 1.5e-3})
    policy = WriteScopePolicy(QWEN3)
    policy.attach(meter, 15, 1, prefetch_tokens=65536)
    policy.experts = _work(policy)
    policy.expect_batch(4)
    r = policy.cpu_share(16384)
    assert meter.asked[-1] == "cpu"
    L = 4 * 16384
    c_link = min(QWEN3.c_gpu, 0.15e-3)
    assert r == pytest.approx(roofline_share(L, QWEN3.a, QWEN3.b, QWEN3.c_cpu + 1.5e-3, c_link))
    assert 0.15 < r < 0.35
    # the same placement under the link's O (what one estimate per batch gave): none
    assert roofline_share(L, QWEN3.a, QWEN3.b, QWEN3.c_cpu + 3.59e-3, c_link) == 0.0
    # no expert work attached: the last step's path (None: the meter's default)
    policy.experts = None
    policy.cpu_share(16384)
    assert meter.asked[-1] is None


@pytest.mark.parametrize("worker", ["on", "off"])
def test_the_engine_s_steps_note_the_path_their_host_experts_took(worker, monkeypatch):
    """Whole decode steps: the CPU computing every host expert is the ``cpu`` path, the link
    reading every one the ``link`` path, on the native worker and on the old path alike."""
    from writescope import LLM, SamplingParams
    from writescope.moe import async_experts
    from writescope.moe.block import SparseMoeBlock
    from writescope.moe.cpu_experts import kernel_available

    if worker == "on" and not kernel_available():
        pytest.skip("the host-expert kernel does not build here")
    monkeypatch.setenv(async_experts.ENV, worker)
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, dtype="bfloat16")
    blocks = [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]
    g = torch.Generator().manual_seed(1)
    for b in blocks:
        b.offload_experts(torch.randperm(b.cfg.num_experts, generator=g)[: b.cfg.num_experts // 2].tolist())
    prompts = [list(range(3, 43)), list(range(5, 55))]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for share, path in ((0.0, "cpu"), (1.0, "link")):
        for b in blocks:
            b.stream_share = share
        llm.generate(prompt_token_ids=prompts, sampling_params=params)
        assert llm.other_work.path(2) == path
    if llm.expert_worker is not None:
        llm.expert_worker.close()


def test_a_step_that_captured_graphs_is_not_measured(monkeypatch):
    """Later steps capture graphs too (a new policy's or expert path's stages): their gaps are not O."""
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    count = {"n": 0}
    m = ow.OtherWork(torch.device("cpu"), warm=100, every=1, captures=lambda: count["n"])
    _step(m, clock, 9.0)  # the first step at a batch size: never measured
    _step(m, clock, 0.2)
    m.begin(0, 4)  # a step that captures: its gaps take in the captures
    count["n"] += 3
    clock.t += 1.0
    m.end(0)
    clock.t += 7.0
    m.begin(1, 4)
    m.end(1)
    _step(m, clock, 0.2)
    _step(m, clock, 0.2)
    assert m.seconds(4) == pytest.approx(0.2)


def test_the_engine_gives_the_meter_its_graph_count():
    from writescope import LLM

    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16)
    assert llm.other_work.captures is not None and llm.other_work.captures() == 0  # no graphs without CUDA


def test_the_path_is_read_within_its_step_not_after_a_prefill_that_follows(monkeypatch):
    """The online engine issues a prefill chunk between two decode steps; its MoE passes (experts
    with many tokens, streamed) must not decide the path of the decode step before it."""
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    box = {"share": None}
    m = ow.OtherWork(torch.device("cpu"), warm=100, every=1, expert_link_share=lambda: box["share"])
    _step(m, clock, 9.0, box=box, share=0.0)  # the first step: not measured, sets the top layer
    for _ in range(2):
        _step(m, clock, 0.2, box=box, share=0.0)
        box["share"] = 1.0  # a prefill chunk's passes, before the next decode step begins
    _step(m, clock, 0.2, box=box, share=0.0)
    m.save()
    assert m.path(4) == "cpu" and m.seconds(4, "cpu") == pytest.approx(0.2) and m.seconds(4, "link") is None


def test_a_later_process_reads_o_under_the_path_its_blocks_expect(monkeypatch, tmp_path):
    """Before any step at a batch size in this process, O kept by an earlier one is read under the
    path the blocks' configuration expects (the last step's path is not kept)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    m = ow.OtherWork(torch.device("cpu"), warm=100, every=1, store_key="k", expert_link_share=lambda: 1.0)
    for gap in (9.0, 0.7, 0.7):
        _step(m, clock, gap, batch=4)
    m.save()
    again = ow.OtherWork(torch.device("cpu"), store_key="k")
    assert again.seconds(4) is None  # no expectation given: the key of no host experts
    again.expected_link_share = lambda batch: 1.0 if batch < 16 else 0.0
    assert again.seconds(4) == pytest.approx(0.7)
    again.expected_link_share = lambda batch: 0.0
    assert again.seconds(4) is None


def test_blocks_expected_share_follows_each_block_s_configuration():
    def block(in_place, share, slots=True):
        return types.SimpleNamespace(host_experts=frozenset({1}), reads_host_experts_in_place=lambda tokens: in_place,
                                     stream_share=share, stream_min_tokens=1 if slots else None)

    assert ow.blocks_expected_share([block(True, 0.0), block(False, 0.0)])(4) == pytest.approx(0.5)
    assert ow.blocks_expected_share([block(False, 2.0)])(4) == 1.0
    assert ow.blocks_expected_share([block(False, 1.0, slots=False)])(4) == 0.0
    assert ow.blocks_expected_share([types.SimpleNamespace(host_experts=frozenset())])(4) is None
