"""Decode stages whose MoE block hands its CPU share to the native expert worker, captured whole
(moe/async_experts.py ``captured_into``, engine/replay_hooks.py, native/flag_worker.py ``JobSlot``).

Without CUDA, :class:`HookCapture` stands in for a CUDA graph's split between host and device: at
the capture the block's host calls register as replay hooks instead of running, and each replay
runs the hooks first and then the stage's work (which on the CPU also runs its Python: the block
then takes the captured form again, reading its job from the slot the hook wrote). The logits must
equal the eager ones bit for bit (the same split, kernel and order), and the worker must run one
job per MoE layer and pass (plus one per capture's warm-up), none at a capture.
"""

from __future__ import annotations

import pytest
import torch
from helpers import teacher_forced_decode_logits

from writescope import LLM
from writescope.engine import replay_hooks
from writescope.models.graphs import StageGraphs, _clone, _copy, expert_path
from writescope.moe import async_experts, cpu_experts
from writescope.native import flag_worker

D = 16
PROMPT_LENS = [70, 33, 5, 48]
STEPS = 4

needs_kernel = pytest.mark.skipif(not cpu_experts.kernel_available(), reason="the host-expert kernel does not build here")


class HookCapture:
    """A CUDA graph's semantics on the CPU: a warm-up run, a capture whose host calls register
    (its work runs too, on the CPU, with no job named: its outputs are dropped), and replays that
    run the hooks, then the work, into static outputs."""

    def __init__(self, fn, inputs, pool):
        self.fn, self.static, self.pool = fn, tuple(t.clone() for t in inputs), pool
        fn(*self.static)  # the warm-up, eager
        with replay_hooks.collecting() as self.hooks:
            self.out = _clone(fn(*self.static))

    def replay(self, inputs):
        for s, t in zip(self.static, inputs):
            if s.data_ptr() != t.data_ptr():
                s.copy_(t)
        for hook in self.hooks:
            hook()
        with replay_hooks.collecting(replaying=self.hooks):  # the work's own host calls are the graph's: not run again
            _copy(self.out, self.fn(*self.static))
        return self.out


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _half_on_host(llm: LLM, share: float) -> list:
    g = torch.Generator().manual_seed(2)
    blocks = []
    for layer in llm.model.model.layers:
        b = layer.mlp_module
        b.offload_experts(torch.randperm(b.cfg.num_experts, generator=g)[: b.cfg.num_experts // 2].tolist())
        if b.host_pack is not None and llm.model.lm_head.weight.device.type == "cuda":
            b.pack()
        b.stream_share = share
        blocks.append(b)
    return blocks


_decode_logits = teacher_forced_decode_logits


@needs_kernel
@pytest.mark.parametrize("micro_batches", ["1", "2"])
def test_whole_stages_with_the_expert_worker_give_the_eager_logits(micro_batches, monkeypatch):
    monkeypatch.setenv(async_experts.ENV, "on")
    monkeypatch.setenv(async_experts.GRAPH_ENV, "on")
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", micro_batches)
    runs = {}
    for mode in ("eager", "graphs"):
        llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D, dtype="bfloat16")
        _half_on_host(llm, 0.5)
        graphs = None
        if mode == "graphs":
            graphs = llm.model.decode.graphs = StageGraphs(HookCapture)
            llm.model.decode._graphs_checked = True
        logits = _decode_logits(llm, _prompts(llm.config.vocab_size), STEPS)
        worker = llm.expert_worker.running
        assert worker is not None and worker.done_value() == flag_worker.int32(worker.seq)
        runs[mode] = (logits, worker.totals()[0], graphs)
        llm.expert_worker.close()
    (ref, jobs_ref, _), (got, jobs, graphs) = runs["eager"], runs["graphs"]
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    whole = [(shape, k) for shape, v in graphs._shapes.items() for k in v if isinstance(k[1], tuple) and k[1][:1] == ("async",)]
    assert whole, "no stage was captured with its worker job"
    assert all(not isinstance(k[0], tuple) for _, k in whole)  # whole stages, not cut ones
    hooks = sum(len(g.hooks) for v in graphs._shapes.values() for g in v.values())
    assert hooks == len(whole)  # one job hand-over per captured stage
    assert jobs == jobs_ref + len(whole)  # the warm-ups' jobs; none at a capture


@needs_kernel
def test_the_switch_off_or_no_worker_yet_leaves_the_stage_uncaptured(monkeypatch):
    monkeypatch.setenv(async_experts.ENV, "on")
    monkeypatch.setenv(async_experts.GRAPH_ENV, "on")
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D, dtype="bfloat16")
    b = _half_on_host(llm, 0.5)[0]
    assert b.graph_key(4) is None  # no worker running yet: the first pass starts it eagerly
    x = torch.randn(4, b.gate.weight.shape[1]).to(torch.bfloat16)
    with torch.no_grad():
        b(x)
    key = b.graph_key(4)
    assert key is not None and key[0] == "async" and key[3] == llm.expert_worker.running.flags.data_ptr()
    monkeypatch.setenv(async_experts.OUTPUT_ENV, "copy")  # the sum copied, not read in place: another graph
    assert b.graph_key(4) != key and b.graph_key(4)[2] is False
    monkeypatch.delenv(async_experts.OUTPUT_ENV)
    assert expert_path(key) == "worker" and expert_path(()) == "device"  # the stage keeps one graph per path
    monkeypatch.delenv(async_experts.GRAPH_ENV)
    assert async_experts.graph_wanted() and b.graph_key(4) == key  # on by default (run 61)
    monkeypatch.setenv(async_experts.GRAPH_ENV, "off")
    assert b.graph_key(4) is None
    monkeypatch.setenv(async_experts.GRAPH_ENV, "sometimes")
    with pytest.raises(ValueError, match="WRITESCOPE_GRAPH_EXPERTS"):
        b.graph_key(4)
    monkeypatch.setenv(async_experts.GRAPH_ENV, "on")
    old = llm.expert_worker.running
    llm.expert_worker.close()
    with torch.no_grad():
        b(x)  # a new worker: the graphs of the old one are not replayed
    new = llm.expert_worker.running
    assert new is not old and b.graph_key(4)[3] == new.flags.data_ptr() != key[3]  # the old worker lives on in `old`
    llm.expert_worker.close()


def test_replay_hooks_only_inside_a_capture():
    with pytest.raises(RuntimeError, match="outside"):
        replay_hooks.on_replay(lambda: None)
    assert not replay_hooks.capturing()
    with replay_hooks.collecting() as hooks:
        assert replay_hooks.capturing()
        replay_hooks.on_replay(print)
        with pytest.raises(RuntimeError, match="already"), replay_hooks.collecting():
            pass
    assert hooks == [print] and not replay_hooks.capturing()


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 0.7, 1.0])
def test_partition_reads_a_tensor_share_as_the_float(share):
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 16, (7, 2), generator=g)
    slot_of = torch.full((16,), 8, dtype=torch.long)
    slot_of[torch.arange(0, 16, 2)] = torch.arange(8)
    want = async_experts.partition(ids, slot_of, 8, share, 3)
    got = async_experts.partition(ids, slot_of, 8, torch.tensor(share, dtype=torch.float64), 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@needs_kernel
def test_a_slot_is_named_again_only_after_its_last_job(monkeypatch):
    from writescope.moe.expert_worker import ExpertWorker

    w = ExpertWorker(1, "cpu")
    try:
        slot = w.job_slot()
        assert slot.value is None and w.job_slot().host is not slot.host
        pack_w13 = torch.zeros(2, 8, 4, dtype=torch.bfloat16)
        pack_w2 = torch.zeros(2, 4, 4, dtype=torch.bfloat16)
        bufs = w.buffers(1, 1, 4, torch.bfloat16)
        bufs[1].fill_(-1)
        slot.set(w.post_buffers(bufs, pack_w13, pack_w2))  # its inputs not marked ready: it waits
        monkeypatch.setattr(flag_worker, "WAIT_SECONDS", 0.2)
        with pytest.raises(RuntimeError, match="did not finish job"):
            slot.set(slot.value + 1)
        w.release(slot)  # as after a replay that failed: the job runs on the buffers as they are
        w.consume_slot(slot)
        slot.set(w.post_buffers(bufs, pack_w13, pack_w2))
        w.mark_ready(slot)
        w.consume_slot(slot)  # the job runs once ready; the slot is free again
        w.release(slot)  # its ready flag was set: nothing to do
        assert int(slot.host[0]) == slot.value and w.done_value() == slot.value == w.seq
    finally:
        w.close()


def test_a_worker_error_inside_a_capture_reaches_the_caller():
    """A job's error raised by a check inside a stage's capture is the caller's (the check cleared
    it): not taken for a failed capture that would leave the stage eager and the error unseen."""
    graphs = StageGraphs(HookCapture)

    def stage(x):
        raise flag_worker.WorkerError("host-expert worker: a job failed")

    with pytest.raises(flag_worker.WorkerError, match="a job failed"):
        graphs.run(1, 0, 4, ("async",), stage, (torch.zeros(2),))
    assert not graphs.failed and graphs.captured == 0


@needs_kernel
def test_job_slots_come_back_when_their_graph_goes(monkeypatch):
    import gc

    from writescope.moe.expert_worker import ExpertWorker

    monkeypatch.setattr(flag_worker, "SLOT_CHUNK", 2)
    w = ExpertWorker(1, "cpu")
    try:
        a, b = w.job_slot(), w.job_slot()
        with pytest.raises(RuntimeError, match="job slots are all in use"):
            w.job_slot()
        a_host = a.host
        del a
        gc.collect()
        c = w.job_slot()  # a's index again
        assert c.host.ctypes.data == a_host.ctypes.data and c.value is None and b.value is None
    finally:
        w.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_whole_stages_with_the_expert_worker_on_cuda(monkeypatch):
    """On CUDA: stages captured whole with the worker's job handed over at each replay give the
    logits of the cut stages (``WRITESCOPE_GRAPH_EXPERTS=off``) within what two such runs differ
    by; every job is consumed, and one hand-over hook per captured stage."""
    monkeypatch.setenv(async_experts.ENV, "on")
    monkeypatch.setenv("WRITESCOPE_MICRO_BATCHES", "2")
    prompts = _prompts(4096)
    out = {}
    for mode in ("off", "off again", "on"):
        monkeypatch.setenv(async_experts.GRAPH_ENV, mode.split()[0])
        llm = LLM("tiny-mixtral", device="cuda", dtype="bf16", progress=False, policy="static:0.5", window=D)
        _half_on_host(llm, 0.5)
        out[mode] = _decode_logits(llm, prompts, 6, device="cuda")
        torch.cuda.synchronize()
        graphs = llm.model.decode.graphs
        whole = [k for v in graphs._shapes.values() for k in v if isinstance(k[1], tuple) and k[1][:1] == ("async",)]
        assert bool(whole) == (mode == "on") and graphs.replayed > graphs.captured > 0
        if mode == "on":
            assert sum(len(getattr(g, "hooks", ())) for v in graphs._shapes.values() for g in v.values()) == len(whole)
        w = llm.expert_worker.running
        assert w is not None and w.totals()[0] > 0 and w.done_value() == flag_worker.int32(w.seq)
        llm.expert_worker.close()
        del llm
    scale = out["off"].abs().max().item()
    eager = (out["off again"] - out["off"]).abs().max().item()
    torch.testing.assert_close(out["on"], out["off"], atol=max(0.02 * scale, 1.5 * eager), rtol=0)


def test_a_re_run_capture_hands_back_the_captured_hooks_in_order():
    """The tests' replay re-runs a stage's Python: on_replay then returns the hook registered at
    the capture in the same place (its slot), registering nothing new."""
    a, b = object(), object()
    with replay_hooks.collecting() as hooks:
        assert replay_hooks.on_replay(a) is a and replay_hooks.on_replay(b) is b
    with replay_hooks.collecting(replaying=hooks) as new:
        assert replay_hooks.on_replay(object()) is a and replay_hooks.on_replay(object()) is b
    assert hooks == [a, b] and new == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_replay_waits_for_its_own_job_when_the_host_names_the_next_one_early(monkeypatch):
    """The host is a replay ahead: it names the next job in the slot while the previous replay's
    work still runs (its job already done, so the slot's guard lets it). That replay's wait must
    still wait for its own job (the latch its ready-flag kernel wrote), not the next one, which
    would stall the stream until the wait gives up and flags a timeout."""
    from writescope.attention import flag_kernels
    from writescope.moe.expert_worker import ExpertWorker

    monkeypatch.setattr(flag_kernels, "MAX_POLLS", 3_000_000)  # seconds, not tens: a wrong wait gives up soon
    w = ExpertWorker(1, "cuda")
    try:
        w13 = torch.zeros(2, 8, 4, dtype=torch.bfloat16, pin_memory=True)
        w2 = torch.zeros(2, 4, 4, dtype=torch.bfloat16, pin_memory=True)
        bufs = w.buffers(1, 1, 4, torch.bfloat16)
        bufs[1].fill_(-1)  # no expert: the job only sets its done flag
        slot = w.job_slot()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            w.mark_ready(slot)
            torch.cuda._sleep(100_000_000)  # tens of ms: the host names the next job meanwhile
            w.consume_slot(slot)
        for _ in range(4):
            slot.set(w.post_buffers(bufs, w13, w2))
            graph.replay()
        torch.cuda.synchronize()
        w.check()  # no timeout flagged
        assert w.done_value() == flag_worker.int32(w.seq) and w.seq == 4
    finally:
        w.close()
