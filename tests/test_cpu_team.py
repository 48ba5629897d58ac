"""One CPU team for the native workers (writescope/native/team.py, native/flag_worker.h's Executor):
the CPU attention worker and the host-expert worker, built in two extension modules, run their jobs
on one thread in submit order; closing one worker, or the team, leaves nothing waiting forever; the
engine's split decode step gives the same tokens with one team and with a thread per worker.
Nothing here depends on timing: a job that must not have run is one whose ready flag is not set,
or one queued behind such a job."""

from __future__ import annotations

import gc

import pytest
import torch

from writescope.attention import cpu_kernel
from writescope.moe import cpu_experts
from writescope.native import team as team_mod
from writescope.native.team import CpuTeam, engine_team

pytestmark = pytest.mark.skipif(not (cpu_kernel.kernel_available() and cpu_experts.kernel_available()),
                                reason="no C++ compiler for the native kernels")

D, I = 64, 32


def _attention_job(gen, lengths=(5, 0, 300)):
    q = torch.randn(len(lengths), 1, 16, 64, generator=gen).bfloat16()
    kv = []
    for n in lengths:
        lat = torch.randn(1, n + 3, 64, generator=gen).bfloat16()[:, :n] if n else None
        kv.append(None if lat is None else (lat, lat[..., :48]))
    out = (torch.full((len(lengths), 1, 16, 48), float("nan")), torch.full((len(lengths), 1, 16), float("nan")))
    return q, kv, out


def _submit_attention(w, q, kv, out, flags, value):
    """The raw binding: ready flags[0], done flags[1], both to reach ``value``."""
    rows = [r for r, x in enumerate(kv) if x is not None]
    w._w.submit(q, [kv[r][0] for r in rows], [kv[r][1] for r in rows], rows, cpu_kernel.CHUNK, 0.125, -1, out[0], out[1], flags, 0, value, 1, value)


def _expert_job(gen, T=4, E=4):
    w13 = (torch.randn(E, 2 * I, D, generator=gen) / D**0.5).bfloat16()
    w2 = (torch.randn(E, D, I, generator=gen) / I**0.5).bfloat16()
    x = torch.randn(T, D, generator=gen).bfloat16()
    slot = torch.tensor([[t % E, -1] for t in range(T)], dtype=torch.int32)
    rw = torch.rand(T, 2, generator=gen) + 0.1
    return x, slot, rw, w13, w2, torch.full((T, D), float("nan"))


def _expert_reference(x, slot, rw, w13, w2):
    y = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        s = int(slot[t, 0])
        yg = cpu_experts.host_experts_forward(x[t:t + 1].contiguous(), [1], w13, w2, [s], rw[t, :1].contiguous(), threads=2)
        y[t] += yg[0].float()
    return y


@pytest.mark.parametrize("maker", ["attention", "experts"])
def test_two_modules_workers_run_on_one_thread_in_submit_order(maker):
    """A team made by either extension runs both workers' jobs: an expert job whose inputs are
    there waits behind an attention job submitted before it whose q is not; each gives what its
    own kernel gives; the team's thread ran every job, in submit order."""
    from writescope.attention.cpu_worker import NativeWorker
    from writescope.moe.expert_worker import ExpertWorker

    ext = cpu_kernel._extension() if maker == "attention" else cpu_experts._extension()
    team = CpuTeam(ext)
    att, exp = NativeWorker(2, torch.device("cpu"), team=team), ExpertWorker(2, "cpu", team=team)
    try:
        assert att.team is team and exp.team is team and att._w.shared and exp._w.shared
        att.trace(True)
        exp.trace(True)
        gen = torch.Generator().manual_seed(0)
        a1, a2 = _attention_job(gen), _attention_job(gen)
        e1 = _expert_job(gen)
        fa, fe = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        _submit_attention(att, *a1, fa, 1)
        exp._w.submit(*e1, -1, fe, 0, 1, 1, 1)
        _submit_attention(att, *a2, fa, 2)
        fe[0] = 1  # the experts' inputs are there, but they queue behind attention job 1
        assert not exp._ext.wait_flag(fe, 1, 1, 0.05) and torch.isnan(e1[5]).all()
        fa[0] = 1
        assert exp._ext.wait_flag(fe, 1, 1, 30.0) and att._ext.wait_flag(fa, 1, 1, 30.0)
        assert int(fa[1]) == 1 and torch.isnan(a2[2][0]).all()  # attention job 2 waits for its q
        fa[0] = 2
        assert att._ext.wait_flag(fa, 1, 2, 30.0)
        for q, kv, (o, lse) in (a1, a2):
            ro, rl = cpu_kernel.attend(q, kv, 0.125, threads=2)
            assert torch.equal(o, ro) and torch.equal(lse, rl)
        assert torch.equal(e1[5], _expert_reference(*e1[:5]))
        assert team.tasks_run == 3
        ta, te = att.take_trace(), exp.take_trace()
        taken = sorted([(t[1], "a", t[0]) for t in ta] + [(t[1], "e", t[0]) for t in te])
        assert [(k, v) for _, k, v in taken] == [("a", 1), ("e", 1), ("a", 2)]
    finally:
        att.close()
        exp.close()
        team.close()


def test_closing_one_worker_leaves_the_team_to_the_other():
    from writescope.attention.cpu_worker import NativeWorker
    from writescope.moe.expert_worker import ExpertWorker

    team = CpuTeam(cpu_experts._extension())
    att, exp = NativeWorker(1, torch.device("cpu"), team=team), ExpertWorker(2, "cpu", team=team)
    gen = torch.Generator().manual_seed(1)
    q, kv, out = _attention_job(gen, (17,))
    att.consume(att.submit(q, kv, 0.125, out))
    att.close()
    for _ in range(2):
        x, slot, rw, w13, w2, y = _expert_job(gen)
        exp.consume(exp.submit(x, slot, rw, w13, w2, y))
        assert torch.equal(y, _expert_reference(x, slot, rw, w13, w2))
    with pytest.raises(RuntimeError, match="CPU attention worker is closed"):
        att.submit(q, kv, 0.125, out)
    exp.close()
    assert team.tasks_run == 3
    team.close()


def test_a_closed_team_gives_up_waiting_jobs_and_refuses_new_ones():
    """Closing the team: a job still waiting for its inputs gives up (done flag set, outputs NaN,
    the error raised by its worker); later submits are refused, naming the team; the workers then
    close without waiting."""
    from writescope.moe.expert_worker import ExpertWorker

    team = CpuTeam(cpu_kernel._extension())
    exp = ExpertWorker(1, "cpu", team=team)
    gen = torch.Generator().manual_seed(2)
    x, slot, rw, w13, w2, y = _expert_job(gen)
    exp._w.submit(x, slot, rw, w13, w2, y, -1, exp.flags, 0, 1, 1, 1)  # its ready flag stays 0
    team.close()
    assert int(exp.flags[1]) == 1 and torch.isnan(y).all()
    with pytest.raises(RuntimeError, match="closed while a job waited for its inputs"):
        exp.check()
    with pytest.raises(RuntimeError, match="its CPU team is closed"):
        exp.submit(x, slot, rw, w13, w2, torch.zeros(x.shape))
    exp.close()


def test_engine_team_is_shared_while_held(monkeypatch):
    """The same team for the same CPUs while one is held and not closed, from either module; other
    CPUs, a closed team or none held: a new one."""
    monkeypatch.setattr(team_mod, "_team", None)
    monkeypatch.delenv(team_mod.ENV, raising=False)
    ext = cpu_kernel._extension()
    t1 = engine_team(ext)
    assert t1 is not None and engine_team(cpu_experts._extension(), []) is t1
    t0 = engine_team(ext, [0])
    assert t0 is not t1 and t0.cpus == [0] and engine_team(ext, [0]) is t0
    t0.close()
    t3 = engine_team(ext, [0])
    assert t3 is not t0 and not t3.closed
    del t1, t0, t3
    gc.collect()
    t2 = engine_team(ext)
    assert t2 is not None and t2.tasks_run == 0  # none held: a new team
    monkeypatch.setenv(team_mod.ENV, "own")
    assert engine_team(ext) is None
    monkeypatch.setenv(team_mod.ENV, "two")
    with pytest.raises(ValueError, match="WRITESCOPE_CPU_TEAM='two'"):
        engine_team(ext)


@pytest.mark.parametrize("mode", ["one", "own"])
def test_a_split_step_with_cpu_experts_gives_the_same_tokens_on_one_team(mode, monkeypatch):
    """A decode whose CPU attends part of the KV and computes the host experts (share 0): the same
    tokens as the model without a split; under ``one`` both workers run on one team, whose thread
    ran every job of both; under ``own`` each worker has its own thread."""
    from writescope import LLM, SamplingParams
    from writescope.moe import async_experts
    from writescope.moe.block import SparseMoeBlock

    monkeypatch.setenv(async_experts.ENV, "on")
    monkeypatch.setenv(team_mod.ENV, mode)
    prompts = [list(range(3, 3 + n)) for n in (40, 9, 23)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16", window=16)
    want = [o.token_ids for o in ref.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16", policy="static:0.5", window=16)
    g = torch.Generator().manual_seed(1)
    for b in (m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)):
        b.offload_experts(torch.randperm(b.cfg.num_experts, generator=g)[: b.cfg.num_experts // 2].tolist())
        b.stream_share = 0.0
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    att, exp = llm.cache.decoder.worker, llm.expert_worker.running
    assert att is not None and exp is not None, "a worker did not run"
    assert got == want
    if mode == "one":
        assert att.team is exp.team is not None
        assert att.team.tasks_run == att.totals()[0] + exp.totals()[0] > att.totals()[0]
    else:
        assert att.team is None and exp.team is None
    llm.expert_worker.close()


@pytest.mark.gpu
def test_one_team_on_cuda_gives_the_tokens_of_a_thread_per_worker(monkeypatch):
    """On CUDA (the stream hands each job its inputs through the ready flags and waits on the done
    flags): a split decode with CPU experts gives the same tokens with one team as with a thread
    per worker (the same kernels, the same paths: bit for bit), and the team's thread ran every job."""
    from writescope import LLM, SamplingParams
    from writescope.moe import async_experts
    from writescope.moe.block import SparseMoeBlock

    monkeypatch.setenv(async_experts.ENV, "on")
    prompts = [list(range(3, 3 + n)) for n in (40, 9, 23)]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    tokens = {}
    for mode in ("own", "one"):
        monkeypatch.setenv(team_mod.ENV, mode)
        # a team of its own: a live one left by an earlier test's engine would count that engine's jobs too
        # (it did when the whole gpu-marked suite ran in one process, run 62)
        monkeypatch.setattr(team_mod, "_team", None)
        llm = LLM("tiny-mixtral", device="cuda", dtype="bfloat16", progress=False, policy="static:0.5", window=16)
        g = torch.Generator().manual_seed(1)
        for b in (m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)):
            b.offload_experts(torch.randperm(b.cfg.num_experts, generator=g)[: b.cfg.num_experts // 2].tolist())
            b.pack()
            b.stream_share = 0.0
        tokens[mode] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        att, exp = llm.cache.decoder.worker, llm.expert_worker.running
        assert att is not None and exp is not None, "a worker did not run"
        if mode == "one":
            assert att.team is exp.team is not None
            assert att.team.tasks_run == att.totals()[0] + exp.totals()[0] > att.totals()[0]
        llm.expert_worker.close()
        del llm, att, exp
    assert tokens["one"] == tokens["own"]


def test_pinned_workers_share_the_attention_workers_cpus_whoever_starts_first(monkeypatch):
    """Under ``WRITESCOPE_CPU_PIN=on`` the team runs on the attention worker's CPUs even where the
    expert worker starts first (a prefill pass of few tokens takes the expert worker before any
    decode step has a CPU attention part); a policy set under other settings gives the expert
    worker a team of the new ones."""
    import os

    from writescope import LLM, SamplingParams
    from writescope.attention.cpu_worker import worker_cpus
    from writescope.moe import async_experts
    from writescope.moe.block import SparseMoeBlock

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs this process may use")
    monkeypatch.setenv(async_experts.ENV, "on")
    monkeypatch.setenv("WRITESCOPE_CPU_PIN", "on")
    llm = LLM("tiny-qwen3-moe", progress=False, dtype="bfloat16", policy="static:0.5", window=16, cpu_threads=1, expert_threads=1)
    g = torch.Generator().manual_seed(1)
    for b in (m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)):
        b.offload_experts(torch.randperm(b.cfg.num_experts, generator=g)[: b.cfg.num_experts // 2].tolist())
        b.stream_share = 0.0
    exp = llm.expert_worker.get()  # the expert worker first
    want = worker_cpus(1)
    assert want and exp.team.cpus == want
    llm.generate(prompt_token_ids=[list(range(3, 40)), list(range(5, 30))], sampling_params=SamplingParams(max_tokens=6, ignore_eos=True))
    att = llm.cache.decoder.worker
    assert att is not None and att.team is exp.team and exp.team.pinned
    monkeypatch.setenv("WRITESCOPE_CPU_PIN", "off")
    llm.set_policy("static:0.5", 16)  # a bench row's switch: the running expert worker is made again, unpinned
    assert llm.expert_worker.running is None and llm.expert_worker.get().team.cpus == []
    monkeypatch.setenv(team_mod.ENV, "own")
    llm.set_policy("static:0.5", 16)
    assert llm.expert_worker.running is None and llm.expert_worker.get().team is None
    llm.expert_worker.close()
