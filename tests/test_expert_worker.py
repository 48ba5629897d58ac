"""The native host-expert worker (writescope/moe/expert_worker.py, expert_worker.h over
native/flag_worker.h): results, order, errors and shutdown on the host; on CUDA (gpu marker) the
hand-offs through the stream.

Two references for every job:
- exact: :func:`cpu_experts.host_experts_forward` (the same kernel, the same path) on the job's
  assignments grouped as the worker groups them (ascending slot, tokens ascending within one),
  its rows summed per token in fp32 in that order: the worker's y must be equal, bit for bit;
- float64 SwiGLU experts, rw * down(silu(gate(x)) * up(x)) summed per token: relative Frobenius
  error at most 1e-2 for bf16 (h and each weighted row are rounded to bf16, relative 2^-9 each;
  measured about 2.5e-3) and 1e-5 for fp32 (measured about 1.5e-7).
Nothing here depends on timing: a job that must not have run is one whose ready flag is not set.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from writescope.moe import cpu_experts

pytestmark = pytest.mark.skipif(not cpu_experts.kernel_available(), reason="no C++ compiler for the host-expert kernel")

E_HOST, E_ALL = 6, 10  # slots 0..5 on the host; the other experts of a token's top-k are device ones (-1)
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def needs(path: str) -> None:
    if path in ("avx512bf16", "amx-emulated") and cpu_experts.best_path() == "portable":
        pytest.skip(f"this CPU lacks AVX512-BF16 (needed by {path})")


def experts(D, I, dtype, E=E_HOST, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype), (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)


def job(T, K, D, dtype, seed=1, host_share=0.6):
    """x [T, D], slot [T, K] (distinct experts per token out of E_ALL, those past E_HOST or not
    drawn for the host -1: some tokens have no CPU assignment), rw [T, K] float32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    slot = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        picks = torch.randperm(E_ALL, generator=g)[:K]
        keep = torch.rand(K, generator=g) < host_share
        slot[t] = torch.where((picks < E_HOST) & keep, picks, torch.full_like(picks, -1)).int()
    rw = torch.rand(T, K, generator=g) + 0.1
    return x, slot, rw


def grouped_reference(x, slot, rw, w13, w2, threads=2):
    """host_experts_forward on the assignments grouped by slot, its rows summed per token in fp32
    in ascending slot order (what the worker must give exactly)."""
    T, K = slot.shape
    rows = sorted((int(slot[t, k]), t, k) for t in range(T) for k in range(K) if slot[t, k] >= 0)
    y = torch.zeros(T, x.shape[1], dtype=torch.float32)
    if not rows:
        return y
    slots = sorted({s for s, _, _ in rows})
    counts = [sum(1 for s, _, _ in rows if s == sl) for sl in slots]
    xg = x[[t for _, t, _ in rows]].contiguous()
    rg = torch.stack([rw[t, k] for _, t, k in rows])
    yg = cpu_experts.host_experts_forward(xg, counts, w13, w2, slots, rg, threads=threads)
    for (_, t, _), row in zip(rows, yg):
        y[t] += row.float()
    return y


def f64_reference(x, slot, rw, w13, w2):
    I = w2.shape[2]
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(slot.shape[0]):
        for k in range(slot.shape[1]):
            s = int(slot[t, k])
            if s < 0:
                continue
            h = x[t].double() @ w13[s].double().t()
            y[t] += rw[t, k].double() * ((F.silu(h[:I]) * h[I:]) @ w2[s].double().t())
    return y


def rel(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def run_one(w, x, slot, rw, w13, w2):
    """One job through submit/consume into fresh (NaN-filled) buffers; returns y."""
    y = torch.full((x.shape[0], x.shape[1]), float("nan"))
    w.consume(w.submit(x, slot, rw, w13, w2, y))
    return y


@pytest.fixture
def worker():
    from writescope.moe.expert_worker import ExpertWorker

    w = ExpertWorker(2, torch.device("cpu"))
    yield w
    w.close()


@pytest.mark.parametrize("K", [1, 2, 6, 8])
@pytest.mark.parametrize("T", [1, 15, 16, 17])
def test_results_equal_the_grouped_kernel_and_float64(worker, monkeypatch, T, K):
    """The portable path (forced): bf16 tokens, top-K of 1 to 8, some assignments on the device."""
    monkeypatch.setenv(cpu_experts.ENV, "portable")
    D, I = 64, 48
    w13, w2 = experts(D, I, torch.bfloat16)
    x, slot, rw = job(T, K, D, torch.bfloat16, seed=T * 10 + K)
    y = run_one(worker, x, slot, rw, w13, w2)
    assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2))
    if (slot >= 0).any():
        assert rel(y, f64_reference(x, slot, rw, w13, w2)) <= TOL[torch.bfloat16]
    assert torch.all(y[(slot < 0).all(1)] == 0)  # tokens with no CPU assignment: exactly 0
    (secs, nbytes, n_exp), = worker.take_done()
    distinct = len(set(slot[slot >= 0].tolist()))
    assert n_exp == distinct and nbytes == distinct * (w13[0].numel() + w2[0].numel()) * 2 and secs >= 0


@pytest.mark.parametrize("path", ["portable", "avx512bf16", "amx-emulated"])
def test_each_path_equals_the_kernel_on_the_same_path(worker, monkeypatch, path):
    """WRITESCOPE_EXPERT_ISA forces the path (the worker takes it at submit, as forward does);
    amx-emulated: D and I multiples of 32. Skipped without AVX512-BF16."""
    needs(path)
    monkeypatch.setenv(cpu_experts.ENV, path)
    D, I = 96, 64
    w13, w2 = experts(D, I, torch.bfloat16)
    assert cpu_experts.path_for(torch.bfloat16, D, I) == path
    for T, K in ((17, 8), (16, 2), (1, 6)):
        x, slot, rw = job(T, K, D, torch.bfloat16, seed=T + K)
        y = run_one(worker, x, slot, rw, w13, w2)
        assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2)), (path, T, K)
        assert rel(y, f64_reference(x, slot, rw, w13, w2)) <= TOL[torch.bfloat16]


def test_fp32_tokens(worker):
    D, I = 80, 40
    w13, w2 = experts(D, I, torch.float32)
    x, slot, rw = job(15, 6, D, torch.float32, seed=3)
    y = run_one(worker, x, slot, rw, w13, w2)
    assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2))
    assert rel(y, f64_reference(x, slot, rw, w13, w2)) <= TOL[torch.float32]


def test_no_cpu_assignment_and_no_tokens(worker):
    """All -1: y exactly 0 (written over NaN), nothing computed; T = 0 works too."""
    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    x, _, rw = job(5, 4, D, torch.bfloat16)
    y = run_one(worker, x, torch.full((5, 4), -1, dtype=torch.int32), rw, w13, w2)
    assert torch.equal(y, torch.zeros(5, D))
    y0 = run_one(worker, x[:0], torch.empty(0, 4, dtype=torch.int32), rw[:0], w13, w2)
    assert y0.shape == (0, D)
    assert [(nb, n) for _, nb, n in worker.take_done()] == [(0, 0), (0, 0)]
    assert worker.totals()[:1] == (2,)


def test_duplicate_slots_across_tokens(worker):
    """Every token on the same two host experts (and one of them twice for one token: the rows
    are summed): each expert's weights read once for all its tokens."""
    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    x, _, rw = job(17, 3, D, torch.bfloat16, seed=9)
    slot = torch.tensor([[4, 1, -1]] * 17, dtype=torch.int32)
    slot[3] = torch.tensor([1, 1, 4], dtype=torch.int32)
    y = run_one(worker, x, slot, rw, w13, w2)
    assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2))
    assert rel(y, f64_reference(x, slot, rw, w13, w2)) <= TOL[torch.bfloat16]
    (_, nbytes, n_exp), = worker.take_done()
    assert n_exp == 2 and nbytes == 2 * (w13[0].numel() + w2[0].numel()) * 2


def test_several_jobs_queued_run_in_order(worker):
    """Jobs submitted before any is consumed run in order; each gives its own result; the done
    log has one entry per job, in order; finished jobs' tensors are released at the next submit."""
    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    jobs = [job(T, K, D, torch.bfloat16, seed=20 + T) for T, K in ((16, 8), (1, 1), (17, 2), (15, 6))]
    ys = [torch.full((j[0].shape[0], D), float("nan")) for j in jobs]
    seqs = [worker.submit(*j, w13, w2, y) for j, y in zip(jobs, ys)]
    assert seqs == [1, 2, 3, 4]
    worker.consume(seqs[-1])
    assert worker.done_value() == 4
    for (x, slot, rw), y in zip(jobs, ys):
        assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2))
    assert [n for _, _, n in worker.take_done()] == [len(set(j[1][j[1] >= 0].tolist())) for j in jobs]
    worker.consume(worker.submit(*jobs[0], w13, w2, ys[0]))
    assert [v for v, _ in worker._inflight] == [5]


def test_a_job_waits_for_its_ready_flag():
    """Through the raw binding with flags of its own: a job whose ready flag is not set does not
    run (its y stays NaN, its done flag unset); set, it runs."""
    from writescope.moe.expert_worker import ExpertWorker

    w = ExpertWorker(1, "cpu")
    ext = cpu_experts._extension()
    try:
        D, I = 64, 32
        w13, w2 = experts(D, I, torch.bfloat16)
        x, slot, rw = job(4, 2, D, torch.bfloat16, host_share=1.0)
        y = torch.full((4, D), float("nan"))
        flags = torch.zeros(3, dtype=torch.int32)
        w._w.submit(x, slot, rw, w13, w2, y, -1, flags, 0, 1, 1, 1)
        assert not ext.wait_flag(flags, 1, 1, 0.05) and int(flags[1]) == 0 and torch.isnan(y).all()
        flags[0] = 1
        assert ext.wait_flag(flags, 1, 1, 60.0)
        assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2))
    finally:
        w.close()


def test_bad_arguments_are_refused_at_submit(worker):
    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    x, slot, rw = job(3, 2, D, torch.bfloat16)
    y = torch.zeros(3, D)
    bad_slot = slot.clone()
    bad_slot[1, 0] = E_HOST
    with pytest.raises(ValueError, match=r"slots \[6\] outside \[-1, 6\)"):
        worker.submit(x, bad_slot, rw, w13, w2, y)
    bad_slot[1, 0] = -2
    with pytest.raises(ValueError, match=r"slots \[-2\] outside"):
        worker.submit(x, bad_slot, rw, w13, w2, y)
    with pytest.raises(ValueError, match="slot must be a contiguous int32"):
        worker.submit(x, slot.long(), rw, w13, w2, y)
    with pytest.raises(ValueError, match="rw must be a contiguous float32"):
        worker.submit(x, slot, rw.double(), w13, w2, y)
    with pytest.raises(ValueError, match=r"y must be a contiguous float32 \[3, 64\]"):
        worker.submit(x, slot, rw, w13, w2, y.bfloat16())
    with pytest.raises(ValueError, match="x, w13 and w2 must have one dtype"):
        worker.submit(x.float(), slot, rw, w13, w2, y)
    with pytest.raises(ValueError, match="shapes do not match"):
        worker.submit(x[:, :32].contiguous(), slot, rw, w13, w2, y[:, :32].contiguous())
    with pytest.raises(ValueError, match="x must be in host memory"):
        worker.submit(x.to("meta"), slot, rw, w13, w2, y)
    with pytest.raises(ValueError, match="w13 must be a torch.Tensor"):
        worker.submit(x, slot, rw, None, w2, y)
    assert worker.seq == 0 and not worker._inflight  # nothing was queued
    y = run_one(worker, x, slot, rw, w13, w2)  # the worker goes on
    assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2))
    from writescope.moe.expert_worker import ExpertWorker

    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        ExpertWorker(0, "cpu")
    with pytest.raises(ValueError, match="dtype must be"):
        worker.buffers(1, 1, 8, torch.float16)


def test_a_path_this_cpu_lacks_is_refused_at_submit(worker, monkeypatch):
    if cpu_experts.best_path() == "amx":
        pytest.skip("this CPU has every path")
    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    x, slot, rw = job(2, 2, D, torch.bfloat16)
    monkeypatch.setenv(cpu_experts.ENV, "amx")
    with pytest.raises(RuntimeError, match="'amx' was asked for"):
        worker.submit(x, slot, rw, w13, w2, torch.zeros(2, D))
    monkeypatch.setenv(cpu_experts.ENV, "auto")
    assert worker.seq == 0
    worker.consume(worker.submit(x, slot, rw, w13, w2, torch.zeros(2, D)))


def test_an_error_in_the_worker_poisons_y_is_raised_and_the_worker_goes_on(worker, monkeypatch):
    """A slot out of range that only the worker sees (on CUDA the device writes slot after
    submit; here the argument check is bypassed): y is NaN, consume raises the error, and the
    next job runs."""
    import writescope.moe.expert_worker as ew

    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    x, slot, rw = job(5, 3, D, torch.bfloat16)
    bad = slot.clone()
    bad[2, 1] = 7
    monkeypatch.setattr(ew, "_check", lambda *a: None)
    y = torch.zeros(5, D)
    seq = worker.submit(x, bad, rw, w13, w2, y)
    with pytest.raises(RuntimeError, match=r"host-expert worker: slot 7 of token 2 \(k = 1\) outside \[-1, 6\)"):
        worker.consume(seq)
    assert torch.isnan(y).all() and worker.done_value() == seq
    worker.check()  # taken: raised once
    monkeypatch.undo()
    y = run_one(worker, x, slot, rw, w13, w2)
    assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2))
    assert [n for _, _, n in worker.take_done()] == [0, len(set(slot[slot >= 0].tolist()))]


def test_close():
    """close() with nothing queued, after jobs, twice; a closed worker refuses jobs; a job whose
    inputs never came gives up at close (done flag set, y NaN, the error raised by close)."""
    from writescope.moe.expert_worker import ExpertWorker

    ExpertWorker(1, "cpu").close()
    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    x, slot, rw = job(3, 2, D, torch.bfloat16)
    w = ExpertWorker(2, "cpu")
    ys = [torch.zeros(3, D) for _ in range(3)]
    for y in ys:
        w.submit(x, slot, rw, w13, w2, y)
    w.close()  # finishes the queued jobs
    assert w.done_value() == 3
    for y in ys:
        assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2))
    w.close()
    with pytest.raises(RuntimeError, match="host-expert worker is closed"):
        w.submit(x, slot, rw, w13, w2, ys[0])

    w = ExpertWorker(1, "cpu")
    y = torch.zeros(3, D)
    w._w.submit(x, slot, rw, w13, w2, y, -1, w.flags, 0, 1, 1, 1)  # ready stays 0
    with pytest.raises(RuntimeError, match="closed while a job waited for its inputs"):
        w.close()
    assert int(w.flags[1]) == 1 and torch.isnan(y).all()


def test_sequence_numbers_wrap(worker):
    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    x, slot, rw = job(4, 2, D, torch.bfloat16)
    worker.seq = 2**31 - 2
    for _ in range(3):
        y = run_one(worker, x, slot, rw, w13, w2)
        assert torch.equal(y, grouped_reference(x, slot, rw, w13, w2))
    assert worker.seq == 2**31 + 1 and worker.done_value() == -(2**31) + 1


def test_buffers_are_cached_by_shape(worker):
    a = worker.buffers(16, 8, 64, torch.bfloat16)
    assert [tuple(t.shape) for t in a] == [(16, 64), (16, 8), (16, 8), (16, 64)]
    assert [t.dtype for t in a] == [torch.bfloat16, torch.int32, torch.float32, torch.float32]
    assert not any(t.is_pinned() for t in a)  # no CUDA: plain host tensors
    assert all(u is v for u, v in zip(a, worker.buffers(16, 8, 64, torch.bfloat16)))
    b = worker.buffers(1, 8, 64, torch.bfloat16)
    assert b[0].shape == (1, 64) and b[0] is not a[0]
    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    x, slot, rw = job(16, 8, D, torch.bfloat16)
    bx, bslot, brw, by = worker.buffers(16, 8, D, torch.bfloat16)
    bx.copy_(x), bslot.copy_(slot), brw.copy_(rw)
    worker.consume(worker.submit(bx, bslot, brw, w13, w2, by))
    assert torch.equal(by, grouped_reference(x, slot, rw, w13, w2))


def test_submit_buffers_takes_only_the_workers_own_sets(worker):
    """The decode path's submit (no Python checks of the buffers) gives what submit gives; a set
    the worker does not hold, or no longer holds (past BUFFER_SETS shapes), is refused; weights
    that do not match are refused by the native check; the worker goes on."""
    from writescope.moe.expert_worker import BUFFER_SETS

    D, I = 64, 32
    w13, w2 = experts(D, I, torch.bfloat16)
    x, slot, rw = job(5, 3, D, torch.bfloat16, seed=4)
    bufs = worker.buffers(5, 3, D, torch.bfloat16)
    for b, t in zip(bufs, (x, slot, rw)):
        b.copy_(t)
    worker.consume(worker.submit_buffers(bufs, w13, w2))
    assert torch.equal(bufs[3], grouped_reference(x, slot, rw, w13, w2))
    mine = tuple(t.clone() for t in bufs)
    with pytest.raises(ValueError, match="buffers"):
        worker.submit_buffers(mine, w13, w2)
    with pytest.raises(RuntimeError, match="do not match"):
        worker.submit_buffers(bufs, w13[:, :, :32], w2)
    for T in range(6, 6 + BUFFER_SETS):  # as many newer shapes as are kept: the first set is let go
        worker.buffers(T, 3, D, torch.bfloat16)
    with pytest.raises(ValueError, match="still holds"):
        worker.submit_buffers(bufs, w13, w2)
    again = worker.buffers(5, 3, D, torch.bfloat16)
    assert again is not bufs
    for b, t in zip(again, (x, slot, rw)):
        b.copy_(t)
    worker.consume(worker.submit_buffers(again, w13, w2))
    assert torch.equal(again[3], bufs[3])


def test_output_view_is_y_without_cuda_and_only_for_the_workers_own_sets(worker):
    bufs = worker.buffers(3, 2, 64, torch.bfloat16)
    assert worker.output_view(bufs, torch.device("cpu")) is bufs[3]
    with pytest.raises(ValueError, match="still holds"):
        worker.output_view(tuple(t.clone() for t in bufs), torch.device("cpu"))


@pytest.mark.gpu
def test_on_cuda_y_read_in_place_equals_y_copied_and_outlives_its_set():
    """The add reading y in place through :meth:`output_view` (one view per set) gives what the
    copy gives, behind queued device work; a set let go (past BUFFER_SETS shapes) while that add is
    still queued stays alive until the stream passes it."""
    from writescope.moe.expert_worker import BUFFER_SETS, ExpertWorker

    D, I = 128, 64
    w13, w2 = experts(D, I, torch.bfloat16)
    w = ExpertWorker(4, torch.device("cuda"))
    try:
        for T, K in ((16, 8), (1, 2), (17, 6)):
            x, slot, rw = job(T, K, D, torch.bfloat16, seed=T)
            bufs = w.buffers(T, K, D, torch.bfloat16)
            for b, t in zip(bufs, (x, slot, rw)):
                b.copy_(t.cuda(), non_blocking=True)
            w.consume(w.submit_buffers(bufs, w13, w2))
            view = w.output_view(bufs, torch.device("cuda"))
            assert view.is_cuda and view.data_ptr() == bufs[3].data_ptr() and w.output_view(bufs, torch.device("cuda")) is view
            copied = torch.zeros(T, D, device="cuda").add_(bufs[3].to("cuda", non_blocking=True))
            torch.cuda._sleep(50_000_000)  # the add below still queued when its set is let go
            in_place = torch.zeros(T, D, device="cuda").add_(view)
            del view
            for extra in range(BUFFER_SETS):  # newer shapes: this set is let go, an event keeps it
                w.buffers(100 + extra, K, D, torch.bfloat16)
            assert any(old is bufs for _, old in w._retired)
            del bufs
            time.sleep(0.01)  # the copy of y has completed: without the retired set, torch may lend its bytes again
            junk = [torch.full((T, D), 7.0, pin_memory=True) for _ in range(8)]  # written by the host at once
            torch.cuda.synchronize()
            del junk
            assert torch.equal(in_place, copied)
            assert torch.equal(in_place.cpu(), grouped_reference(x, slot, rw, w13, w2))
        w.check()
    finally:
        w.close()


@pytest.mark.gpu
def test_on_cuda_the_stream_hands_the_inputs_over_and_waits_for_y():
    """x, slot and rw copied from device tensors into the pinned buffers on the current stream
    behind queued device work; submit and consume return without the host waiting; y moved to
    the device after the stream's wait equals the reference."""
    from writescope.moe.expert_worker import ExpertWorker

    D, I = 128, 64
    w13, w2 = experts(D, I, torch.bfloat16)
    w = ExpertWorker(4, torch.device("cuda"))
    try:
        for T, K in ((16, 8), (1, 2), (17, 6)):
            x, slot, rw = job(T, K, D, torch.bfloat16, seed=T)
            x_dev, slot_dev, rw_dev = x.cuda(), slot.cuda(), rw.cuda()
            bx, bslot, brw, by = w.buffers(T, K, D, torch.bfloat16)
            assert all(t.is_pinned() for t in (bx, bslot, brw, by))
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)  # device time ahead of the hand-off
            bx.copy_(x_dev, non_blocking=True)
            bslot.copy_(slot_dev, non_blocking=True)
            brw.copy_(rw_dev, non_blocking=True)
            seq = w.submit(bx, bslot, brw, w13, w2, by)
            w.consume(seq)
            y_dev = by.to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert w.done_value() == seq
            assert torch.equal(y_dev.cpu(), grouped_reference(x, slot, rw, w13, w2))
            assert rel(y_dev.cpu(), f64_reference(x, slot, rw, w13, w2)) <= TOL[torch.bfloat16]
        w.check()
    finally:
        w.close()
