"""The host experts' split made on the device, and the whole MoE block with the CPU's share on the
native expert worker (moe/async_experts.py), against the old path and the all-device result."""

from __future__ import annotations

import pytest
import torch

from writescope import LLM, SamplingParams
from writescope.engine.threads import usable_cpus
from writescope.moe import async_experts
from writescope.moe.block import SparseMoeBlock
from writescope.moe.cpu_experts import kernel_available


def _old_split(ids: torch.Tensor, host: set[int], share: float, min_tokens: int | None) -> set[int]:
    """The experts the CPU computes as SparseMoeBlock._split_forward chooses them, read on the host."""
    counts = torch.bincount(ids.flatten(), minlength=64).tolist()
    hit = [e for e in host if counts[e]]
    small = [e for e in hit if min_tokens is None or counts[e] < min_tokens]
    by_tokens = sorted(small, key=lambda e: (-counts[e], e))
    k = round(share * len(by_tokens))
    return set(by_tokens[k:])


@pytest.mark.parametrize("tokens", [1, 4, 15, 16, 17, 64])
@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.6, 1.0])
@pytest.mark.parametrize("min_tokens", [None, 2, 4])
def test_partition_matches_the_old_split(tokens, share, min_tokens):
    E, K = 64, 6
    g = torch.Generator().manual_seed(tokens * 7 + int(share * 100))
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    # skewed routing too: a few experts take most tokens
    ids[: tokens // 2, 0] = 3
    host = set(torch.randperm(E, generator=g)[: E // 2].tolist()) | {3}
    slot_of = torch.full((E,), len(host), dtype=torch.long)
    for s, e in enumerate(sorted(host)):
        slot_of[e] = s
    cpu_slot, link_slot_of = async_experts.partition(ids, slot_of, len(host), share, min_tokens)
    want = _old_split(ids, host, share, min_tokens)
    got = {e for e in range(E) if link_slot_of[e] == len(host) and e in host and (ids == e).any()}
    assert got == want
    assert cpu_slot.dtype == torch.int32 and cpu_slot.shape == ids.shape
    for t in range(tokens):
        for k in range(K):
            e = int(ids[t, k])
            assert int(cpu_slot[t, k]) == (int(slot_of[e]) if e in want else -1)
    # the link keeps every other host expert's slot; device experts stay past the last slot
    for e in range(E):
        if e not in want:
            assert int(link_slot_of[e]) == int(slot_of[e])


def test_partition_rounds_the_share_as_python_does():
    # 90 small host experts at share 0.35: 31.499999999999996 in float64 (31), 31.5 in float32 (32)
    E = 128
    ids = torch.arange(90).view(90, 1)
    slot_of = torch.arange(E).clamp(max=100)
    _, link = async_experts.partition(ids, slot_of, 100, 0.35, None)
    assert int((link[:90] < 100).sum()) == round(0.35 * 90) == 31


def test_partition_of_nothing():
    ids = torch.empty(0, 4, dtype=torch.long)
    slot_of = torch.tensor([0, 2, 1, 2])
    cpu_slot, link = async_experts.partition(ids, slot_of, 2, 0.0, None)
    assert cpu_slot.shape == (0, 4) and torch.equal(link, slot_of)


def test_switch_is_checked(monkeypatch):
    monkeypatch.setenv(async_experts.ENV, "sometimes")
    with pytest.raises(ValueError, match="WRITESCOPE_EXPERT_WORKER='sometimes'"):
        async_experts.worker_wanted(torch.device("cpu"))
    monkeypatch.setenv(async_experts.ENV, "auto")
    assert not async_experts.worker_wanted(torch.device("cpu"))
    monkeypatch.setenv(async_experts.ENV, "on")
    assert async_experts.worker_wanted(torch.device("cpu"))


needs_kernel = pytest.mark.skipif(not kernel_available(), reason="the host-expert kernel does not build here")


def _offload_half(llm) -> list[SparseMoeBlock]:
    blocks = [m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)]
    g = torch.Generator().manual_seed(1)
    for b in blocks:
        b.offload_experts(torch.randperm(b.cfg.num_experts, generator=g)[: b.cfg.num_experts // 2].tolist())
    return blocks


def _paths_agree(b, monkeypatch, make_x, token_counts) -> None:
    """The block with the worker path on equals it off (the old path), for each token count."""
    for tokens in token_counts:
        x = make_x(tokens)
        monkeypatch.setenv(async_experts.ENV, "off")
        with torch.no_grad():
            ref = b(x)
        monkeypatch.setenv(async_experts.ENV, "on")
        assert b.takes_async(x.dtype, x.device, tokens)
        with torch.no_grad():
            got = b(x)
        # fp32 sums in another order, one bf16 rounding of the result
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2"])
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_block_on_the_worker_equals_the_old_path(preset, share, monkeypatch):
    llm = LLM(preset, progress=False, dtype="bfloat16")
    blocks = _offload_half(llm)
    b = blocks[0]
    b.stream_share = share
    D = b.gate.weight.shape[1]
    _paths_agree(b, monkeypatch, lambda t: torch.randn(t, D, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16), (1, 3, 16, 17))
    llm.expert_worker.close()


@needs_kernel
def test_no_tokens_no_job(monkeypatch):
    monkeypatch.setenv(async_experts.ENV, "on")
    llm = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16")
    b = _offload_half(llm)[0]
    x = torch.empty(0, b.gate.weight.shape[1], dtype=torch.bfloat16)
    with torch.no_grad():
        assert b(x).shape == x.shape
    assert llm.expert_worker.running is None or llm.expert_worker.running.seq == 0


@needs_kernel
def test_whole_model_on_the_worker_gives_the_same_tokens(monkeypatch):
    monkeypatch.setenv(async_experts.ENV, "on")
    prompts = [list(range(3, 3 + n)) for n in (40, 9, 23)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16")
    want = [o.token_ids for o in ref.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16")
    for b in _offload_half(llm):
        b.stream_share = 0.5
    worker_jobs = []
    real = async_experts.forward_into

    def counted(*a, **k):
        worker_jobs.append(real(*a, **k))
        return worker_jobs[-1]

    monkeypatch.setattr(async_experts, "forward_into", counted)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert worker_jobs, "no pass took the worker path"
    assert got == want
    llm.expert_worker.close()


@needs_kernel
def test_no_worker_means_the_old_path(monkeypatch):
    monkeypatch.setenv(async_experts.ENV, "off")
    llm = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16")
    b = _offload_half(llm)[0]
    assert not b.takes_async(torch.bfloat16, torch.device("cpu"), 4)
    monkeypatch.setenv(async_experts.ENV, "on")
    assert b.takes_async(torch.bfloat16, torch.device("cpu"), 4)
    assert not b.takes_async(torch.bfloat16, torch.device("cpu"), 10_000)  # prefill-sized: the old path
    assert llm.host_experts_in_decode().endswith("on the native expert worker, split on the device (no host wait)")
    monkeypatch.setenv(async_experts.ENV, "off")
    assert "worker" not in llm.host_experts_in_decode()
    monkeypatch.setenv(async_experts.ENV, "on")
    b.host_kernel = False
    assert not b.takes_async(torch.bfloat16, torch.device("cpu"), 4)
    assert "worker" not in llm.host_experts_in_decode()  # one block off the worker: the words say the old path


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
@pytest.mark.parametrize("share", [0.0, 0.5])
def test_block_on_the_worker_equals_the_old_path_on_cuda(preset, share, monkeypatch):
    llm = LLM(preset, device="cuda", dtype="bfloat16", progress=False)
    b = _offload_half(llm)[0]
    b.pack()
    b.stream_share = share
    D = b.gate.weight.shape[1]
    _paths_agree(b, monkeypatch, lambda t: torch.randn(t, D, device="cuda", dtype=torch.bfloat16), (1, 4, 16, 17))
    llm.expert_worker.close()


def test_output_switch_is_checked(monkeypatch):
    monkeypatch.setenv(async_experts.OUTPUT_ENV, "mapped")
    with pytest.raises(ValueError, match="WRITESCOPE_EXPERT_OUTPUT"):
        async_experts.output_in_place()
    monkeypatch.setenv(async_experts.OUTPUT_ENV, "copy")
    assert not async_experts.output_in_place()
    monkeypatch.delenv(async_experts.OUTPUT_ENV)
    assert async_experts.output_in_place()


@pytest.mark.gpu
@pytest.mark.parametrize("graph", ["on", "off"])
def test_the_expert_sum_read_in_place_equals_the_copy_on_cuda(graph, monkeypatch):
    """``WRITESCOPE_EXPERT_OUTPUT`` in-place and copy give the same tokens, eagerly and with the
    stage captured (each form its own graph: the key holds it)."""
    monkeypatch.setenv(async_experts.ENV, "on")
    monkeypatch.setenv(async_experts.GRAPH_ENV, graph)
    prompts = [list(range(3, 3 + n)) for n in (40, 9, 23)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    llm = LLM("tiny-qwen3-moe", device="cuda", dtype="bfloat16", progress=False)
    for b in _offload_half(llm):
        b.pack()
        b.stream_share = 0.0
    got = {}
    for form in ("copy", "in-place", "copy"):
        monkeypatch.setenv(async_experts.OUTPUT_ENV, form)
        got.setdefault(form, []).append([o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)])
    assert got["copy"][0] == got["copy"][1] == got["in-place"][0]
    llm.expert_worker.close()


@pytest.mark.gpu
def test_the_worker_path_does_not_wait_on_the_host(monkeypatch):
    monkeypatch.setenv(async_experts.ENV, "on")
    llm = LLM("tiny-qwen3-moe", device="cuda", dtype="bfloat16", progress=False)
    b = _offload_half(llm)[0]
    b.pack()
    b.stream_share = 0.5
    x = torch.randn(8, b.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = b(x)  # first call: the worker starts and the Triton kernels compile
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = b(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)
    llm.expert_worker.close()


@pytest.mark.gpu
def test_the_in_place_read_of_host_experts_is_measured_on_cuda():
    """G of the asynchronous path: the fused kernels reading host experts in place, seconds per
    byte, positive and finite."""
    from writescope.scheduler.expert_work import measure_link_expert_cost

    llm = LLM("tiny-mixtral", device="cuda", dtype="bfloat16", progress=False)
    b = _offload_half(llm)[0]
    b.pack()
    g = measure_link_expert_cost(b)
    assert g is not None and 0 < g < 1e-6  # above 1 MB/s


@pytest.mark.gpu
def test_writescope_measures_the_in_place_read_when_it_attaches_on_cuda():
    """``writescope`` with host experts on the asynchronous path measures the fused kernels' in-place
    read at attach (G), and decodes with it."""
    from helpers import half_experts_budget
    from writescope.kvcache.spec import Roofline

    llm = LLM("tiny-qwen3-moe", device="cuda", dtype="bfloat16", progress=False, window=16, max_batch=2, policy="static:0.5",
              vram_budget=half_experts_budget("tiny-qwen3-moe", torch.bfloat16, 2))
    llm.set_policy("writescope", roofline=Roofline(a=1e-9, b=1e-3, c_cpu=0.0, c_gpu=0.0))  # a slow link: the split attaches
    work = llm.expert_work
    assert work is not None and work.g_read is not None and work.g_read > 0 and work.g == max(work.g_kv, work.g_read)
    out = llm.generate(prompt_token_ids=[[5, 6, 7] * 12], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.gpu
def test_whole_model_on_the_worker_gives_the_same_tokens_on_cuda(monkeypatch):
    monkeypatch.setenv(async_experts.ENV, "on")
    prompts = [list(range(3, 3 + n)) for n in (40, 9, 23)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = LLM("tiny-mixtral", device="cuda", dtype="bfloat16", progress=False)
    want = [o.token_ids for o in ref.generate(prompt_token_ids=prompts, sampling_params=params)]
    del ref
    llm = LLM("tiny-mixtral", device="cuda", dtype="bfloat16", progress=False)
    for b in _offload_half(llm):
        b.pack()
        b.stream_share = 0.5
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == want
    llm.expert_worker.close()


def test_share_for_chooses_from_the_expected_hits_before_routing():
    from types import SimpleNamespace

    from writescope.scheduler.expert_work import ExpertWork, expected_hit_experts

    policy = SimpleNamespace(roofline=SimpleNamespace(b=1e-9, c_cpu=0.0, c_gpu=0.0), a=SimpleNamespace(value=1e-9),
                             c=SimpleNamespace(value=0.0))
    decoder = SimpleNamespace(last_split=(0, 0))  # a decode step
    block = SimpleNamespace(cfg=SimpleNamespace(num_experts=64, top_k=6), host_experts=frozenset(range(32)),
                            host_pack=SimpleNamespace(expert_nbytes=1000))
    m = round(expected_hit_experts(4, 64, 6) * 32 / 64)

    def work(e, g):
        return ExpertWork(e=e, g=g, host_fraction=0.5, expert_bytes=1000, num_experts=64, top_k=6, decoder=decoder, policy=policy)

    fast_cpu, slow_cpu, even = work(1e-12, 1e-6), work(1e-6, 1e-12), work(1e-9, 1e-9)
    assert fast_cpu.share_for(4, block) == 0.0 and fast_cpu.expected
    assert slow_cpu.share_for(4, block) == 1.0
    assert 0.0 < even.share_for(4, block) < 1.0  # as fast as each other: about half each
    assert sum(even.take_counts()) == m  # the expected hits, counted as such
    decoder.last_split = None  # a prefill: the block's fixed share applies
    assert even.share_for(4, block) is None


@needs_kernel
@pytest.mark.parametrize("finishes", [True, False])
def test_an_error_after_submit_waits_for_the_job_before_it_propagates(finishes, monkeypatch):
    """The device work after the worker's submit fails: the job is waited for (its cached buffers
    are free again) before the error propagates, and the next pass works. Where it does not finish
    in time (``finishes`` False) its worker is closed (no later job may reuse its buffers) and the
    next pass gets a new worker instead of a "closed" error."""
    from writescope.moe.expert_worker import ExpertWorker

    monkeypatch.setenv(async_experts.ENV, "on")
    llm = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16")
    b = _offload_half(llm)[0]
    b.stream_share = 0.0
    x = torch.randn(4, b.gate.weight.shape[1], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    real = async_experts._reference_into

    def boom(*a, **k):
        raise RuntimeError("the device work failed")

    monkeypatch.setattr(async_experts, "_reference_into", boom)
    if not finishes:
        monkeypatch.setattr(ExpertWorker, "wait_host", lambda self, seq: False)  # as if it ran past the wait
    with torch.no_grad(), pytest.raises(RuntimeError, match="device work failed"):
        b(x)
    first = llm.expert_worker.running
    assert first is not None and first.seq >= 1 and first.closed == (not finishes)
    if finishes:
        assert first.done_value() == first.seq  # waited for, not left running
    monkeypatch.setattr(async_experts, "_reference_into", real)
    with torch.no_grad():
        y = b(x)
    second = llm.expert_worker.running
    assert torch.isfinite(y.float()).all() and not second.closed
    assert (second is first) == finishes and (finishes or second.seq == 1)
    llm.expert_worker.close()


needs_two_cpus = pytest.mark.skipif(usable_cpus() < 2, reason="WRITESCOPE_CPU_THREADS=2 needs two CPUs this process may use")


@needs_two_cpus
def test_worker_handle_threads_follow_the_attention_default_unless_fixed(monkeypatch):
    """``threads=None`` (no ``--expert-threads``): each refresh reads ``WRITESCOPE_CPU_THREADS`` as it
    is then (a bench row's switch), and ``.threads`` says so; a fixed count ignores it. No worker
    is started here."""
    cpu = torch.device("cpu")
    monkeypatch.setenv("WRITESCOPE_CPU_THREADS", "2")
    follow, fixed = async_experts.WorkerHandle(None, cpu), async_experts.WorkerHandle(3, cpu)
    assert follow.threads == 2 and fixed.threads == 3  # before any refresh: as the environment is now
    follow.refresh([])
    fixed.refresh([])
    assert follow.threads == 2 and fixed.threads == 3
    monkeypatch.setenv("WRITESCOPE_CPU_THREADS", "1")
    follow.refresh([])
    fixed.refresh([])
    assert follow.threads == 1 and fixed.threads == 3
    monkeypatch.delenv("WRITESCOPE_CPU_THREADS")
    follow.refresh([])
    assert follow.threads == torch.get_num_threads()  # unset: torch's count (all of it without CUDA)
    monkeypatch.setenv("WRITESCOPE_CPU_THREADS", "0")
    with pytest.raises(ValueError, match="WRITESCOPE_CPU_THREADS"):
        follow.refresh([5])
    assert follow.threads == torch.get_num_threads() and follow.team_cpus == []  # a bad value changes nothing


@needs_kernel
@needs_two_cpus
def test_worker_handle_remakes_a_worker_whose_thread_count_no_longer_follows(monkeypatch):
    """A running worker made under ``WRITESCOPE_CPU_THREADS=2`` is kept by a refresh under 2 and
    closed by one under 1 (made again with 1 on next use); one with a fixed count is kept."""
    cpu = torch.device("cpu")
    monkeypatch.setenv(async_experts.ENV, "on")
    monkeypatch.setenv("WRITESCOPE_CPU_THREADS", "2")
    follow, fixed = async_experts.WorkerHandle(None, cpu), async_experts.WorkerHandle(2, cpu)
    try:
        first, kept = follow.get(), fixed.get()  # made before any refresh: the count as it is now
        assert first is not None and kept is not None and first.threads == 2 and kept.threads == 2
        follow.refresh([])
        fixed.refresh([])
        assert follow.running is first and not first.closed and fixed.running is kept
        monkeypatch.setenv("WRITESCOPE_CPU_THREADS", "1")
        follow.refresh([])
        fixed.refresh([])
        assert first.closed and follow.running is None and follow.threads == 1
        assert fixed.running is kept and not kept.closed and fixed.threads == 2
        second = follow.get()
        assert second is not first and second.threads == follow.threads == 1
        monkeypatch.setenv("WRITESCOPE_CPU_THREADS", "2")  # the environment alone (no refresh) changes nothing
        assert follow.get() is second and follow.threads == 1
    finally:
        follow.close()
        fixed.close()


@needs_two_cpus
@pytest.mark.parametrize("expert_threads", [None, 2])
def test_a_bench_row_s_cpu_threads_reach_the_expert_worker(expert_threads, monkeypatch):
    """A bench row's ``WRITESCOPE_CPU_THREADS`` is in the environment when its policy is set
    (bench/runner.py ``run_one``), so the expert worker takes the attention's count for the row,
    and the load's again after it; ``--expert-threads`` (``expert_threads``) holds."""
    from writescope.bench import switches

    monkeypatch.delenv("WRITESCOPE_CPU_THREADS", raising=False)
    llm = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16", policy="static:0.5", window=16, expert_threads=expert_threads)
    at_load = llm.expert_worker.threads
    assert at_load == (expert_threads or torch.get_num_threads())
    policy, row = switches.split("static:0.5@WRITESCOPE_CPU_THREADS=1")
    with switches.applied(row):
        llm.set_policy(policy, 16)
        assert llm.attention_threads == 1 and llm.expert_worker.threads == (expert_threads or 1)
    llm.set_policy(policy, 16)  # a row without the switch
    assert llm.expert_worker.threads == at_load
