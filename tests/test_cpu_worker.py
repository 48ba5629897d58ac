"""The native CPU attention worker (writescope/attention/cpu_worker.py, cpu_worker.h): results,
order, shutdown and errors on the host; on CUDA (gpu marker) the hand-offs through the stream.
The worker is also the default CPU part of every split decode step, so every policy test runs it."""

from __future__ import annotations

import pytest
import torch

from writescope.attention import cpu_kernel
from writescope.attention.cpu_worker import NativeWorker

pytestmark = pytest.mark.skipif(not cpu_kernel.kernel_available(), reason="no C++ compiler for the CPU attention kernel")


def _batch(lengths, gen, H=1, G=16, dk=64, dv=48):
    q = torch.randn(len(lengths), H, G, dk, generator=gen).bfloat16()
    kv = []
    for n in lengths:
        if n == 0:
            kv.append(None)
            continue
        lat = torch.randn(H, n + 3, dk, generator=gen).bfloat16()[:, :n]
        kv.append((lat, lat[..., :dv]))
    return q, kv


def _out(q, dv):
    B, H, G, _ = q.shape
    return torch.full((B, H, G, dv), float("nan")), torch.full((B, H, G), float("nan"))


def test_jobs_wait_for_their_q_run_in_order_and_equal_the_inline_call():
    """Jobs queued before their q is 'ready' do not start; once it is, each gives exactly what
    one inline call gives (same path, same threads), in submission order."""
    gen = torch.Generator().manual_seed(0)
    w = NativeWorker(2, torch.device("cpu"))
    ext = cpu_kernel._extension()
    try:
        flags = torch.zeros(2, dtype=torch.int32)
        jobs = [(*_batch([5, 0, 300], gen), None) for _ in range(3)]
        outs = []
        for i, (q, kv, _) in enumerate(jobs):  # the raw binding: the ready flag stays 0 until set below
            rows = [r for r, x in enumerate(kv) if x is not None]
            o = _out(q, 48)
            w._w.submit(q, [kv[r][0] for r in rows], [kv[r][1] for r in rows], rows, cpu_kernel.CHUNK, 0.125, -1, o[0], o[1], flags, 0, i + 1, 1, i + 1)
            outs.append(o)
        assert not ext.wait_flag(flags, 1, 1, 0.05) and int(flags[1]) == 0  # nothing ran: no q yet
        flags[0] = 2  # q of jobs 1 and 2
        assert ext.wait_flag(flags, 1, 2, 30.0) and int(flags[1]) == 2
        assert torch.isnan(outs[2][0]).all()  # job 3 still waits
        flags[0] = 3
        assert ext.wait_flag(flags, 1, 3, 30.0)
        for (q, kv, _), (o, lse) in zip(jobs, outs):
            ro, rl = cpu_kernel.attend(q, kv, 0.125, threads=2)
            assert torch.equal(o, ro) and torch.equal(lse, rl)
        jobs_done, secs, keys = w.totals()
        assert jobs_done == 3 and keys == 3 * 305 and secs > 0
    finally:
        w.close()


def test_submit_and_consume_through_the_wrapper():
    gen = torch.Generator().manual_seed(1)
    w = NativeWorker(3, torch.device("cpu"))
    try:
        for _ in range(4):  # one sequence number per job, the outputs as attend's
            q, kv = _batch([17, 256, 1], gen)
            out = _out(q, 48)
            seq = w.submit(q, kv, 0.2, out)
            w.consume(seq)
            assert w.done_value() == seq
            ro, rl = cpu_kernel.attend(q, kv, 0.2, threads=3)
            assert torch.equal(out[0], ro) and torch.equal(out[1], rl)
        done = w.take_done()
        assert [(keys, batch) for _, keys, batch in done] == [(17 + 256 + 1, 3)] * 4 and w.take_done() == []  # each job once
    finally:
        w.close()


def test_pinned_worker_leaves_the_lowest_cpu_and_gives_the_same_results(monkeypatch):
    """WRITESCOPE_CPU_PIN=on: the worker runs on the process's CPUs but the lowest when its
    threads fit there (else it is not pinned), and its results equal the inline call's."""
    import os

    from writescope.attention.cpu_worker import worker_cpus

    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("WRITESCOPE_CPU_PIN", "on")
    assert worker_cpus(len(allowed)) == []  # no CPU to leave: not pinned
    if len(allowed) < 2:
        pytest.skip("one CPU: nothing to pin to")
    assert worker_cpus(1) == allowed[1:]
    gen = torch.Generator().manual_seed(5)
    w = NativeWorker(1, torch.device("cpu"))
    try:
        assert w.cpus == allowed[1:]
        q, kv = _batch([40, 0, 1], gen)
        out = _out(q, 48)
        w.consume(w.submit(q, kv, 0.3, out))
        assert w._w.pinned and w.submits == 1 and w.submit_wall_ns > 0
        ro, rl = cpu_kernel.attend(q, kv, 0.3, threads=1)
        assert torch.equal(out[0], ro) and torch.equal(out[1], rl)
    finally:
        w.close()
    monkeypatch.setenv("WRITESCOPE_CPU_PIN", "off")
    assert worker_cpus(1) == []
    monkeypatch.setenv("WRITESCOPE_CPU_PIN", "yes")
    with pytest.raises(ValueError, match="WRITESCOPE_CPU_PIN"):
        worker_cpus(1)


def test_sequence_numbers_wrap_modulo_2_to_the_32():
    """Past 2^31 jobs the flag values wrap to negative int32s; waits and releases still order them."""
    from writescope.attention.cpu_worker import _int32, _reached

    assert _int32(2**31 - 1) == 2**31 - 1 and _int32(2**31) == -(2**31) and _int32(2**32 + 5) == 5
    assert _reached(_int32(2**31), _int32(2**31 - 1)) and not _reached(_int32(2**31 - 1), _int32(2**31))
    gen = torch.Generator().manual_seed(5)
    w = NativeWorker(2, torch.device("cpu"))
    try:
        w.seq = 2**31 - 2  # the next jobs' values: 2^31 - 1, then -2^31, -2^31 + 1
        for _ in range(3):
            q, kv = _batch([50, 3000], gen)
            out = _out(q, 48)
            seq = w.submit(q, kv, 0.1, out)
            w.consume(seq)
            ro, _ = cpu_kernel.attend(q, kv, 0.1, threads=2)
            assert torch.equal(out[0], ro), seq
        assert w.seq == 2**31 + 1 and [v for v, *_ in w._inflight] == [_int32(2**31 + 1)]  # the older jobs released at submit
    finally:
        w.close()


def test_a_failed_job_poisons_its_outputs_and_is_raised():
    """A job that fails in the kernel (the TEST_FAIL tuning stands for a failed allocation) writes
    NaN, never stale numbers, and its error is raised by the next consume; later jobs run."""
    gen = torch.Generator().manual_seed(6)
    w = NativeWorker(1, torch.device("cpu"))
    ext = cpu_kernel._extension()
    q, kv = _batch([40], gen)
    try:
        old = ext.set_tuning(1 << 20)
        try:
            out = (torch.zeros(1, 1, 16, 48), torch.zeros(1, 1, 16))
            seq = w.submit(q, kv, 0.1, out)
            with pytest.raises(RuntimeError, match="TEST_FAIL"):
                w.consume(seq)
            assert torch.isnan(out[0]).all() and torch.isnan(out[1]).all()
        finally:
            ext.set_tuning(old)
        out = _out(q, 48)
        w.consume(w.submit(q, kv, 0.1, out))
        assert torch.isfinite(out[0]).all()
    finally:
        w.close()


def test_tensors_off_the_host_are_refused():
    q, kv = _batch([8], torch.Generator().manual_seed(7))
    meta = [(kv[0][0].to("meta"), kv[0][1].to("meta"))]
    assert not cpu_kernel.usable(q, meta)
    with pytest.raises(RuntimeError, match="must be in host memory"):
        cpu_kernel.attend(q, meta, 0.1)
    o, lse = cpu_kernel.attend(q, [(kv[0][0][:, :0], kv[0][1][:, :0]), None][:1], 0.1)  # no keys at all: the value width still holds
    assert o.shape == (1, 1, 16, 48) and torch.all(lse == float("-inf"))


def test_bad_inputs_are_refused_at_submit_and_the_worker_goes_on():
    gen = torch.Generator().manual_seed(2)
    w = NativeWorker(1, torch.device("cpu"))
    try:
        q, kv = _batch([9], gen)
        with pytest.raises(RuntimeError, match="out_o must be contiguous fp32"):
            w.submit(q, kv, 0.1, (torch.empty(1, 1, 16, 8), torch.empty(1, 1, 16)))
        out = _out(q, 48)
        w.consume(w.submit(q, kv, 0.1, out))
        assert torch.isfinite(out[0]).all()
    finally:
        w.close()


def test_close_with_a_job_whose_q_never_came():
    """Closing does not hang on a job still waiting for its q: the job gives up, sets its done
    flag and leaves an error that check() raises; a closed worker refuses new jobs."""
    gen = torch.Generator().manual_seed(3)
    w = NativeWorker(1, torch.device("cpu"))
    q, kv = _batch([40], gen)
    out = _out(q, 48)
    rows = [0]
    w._w.submit(q, [kv[0][0]], [kv[0][1]], rows, cpu_kernel.CHUNK, 0.1, -1, out[0], out[1], w.flags, 0, 1, 1, 1)  # ready stays 0
    w._w.close()
    assert int(w.flags[1]) == 1
    with pytest.raises(RuntimeError, match="closed while a job waited for its q"):
        w.check()
    with pytest.raises(RuntimeError, match="worker is closed"):
        w.submit(q, kv, 0.1, out)
    w.close()  # twice: a no-op


def test_a_device_side_error_waits_for_the_native_job(monkeypatch):
    """An error after the CPU part was queued leaves decode only once the job is done (the
    caller may free the sequences it reads), and the error raised is that one."""
    from writescope.attention.metadata import ForwardBatch
    from writescope.config import KVLayout
    from writescope.kvcache.inplace import InplaceKVCache
    from writescope.kvcache.spec import PartitionSpec
    from writescope.scheduler.policies import StaticPolicy

    monkeypatch.setenv("WRITESCOPE_CPU_WORKER", "native")
    layout, D = KVLayout(2, 32, 32, False), 8
    cache = InplaceKVCache(PartitionSpec(layout, 1, torch.bfloat16, window=D), StaticPolicy(1.0), "cpu")
    g = torch.Generator().manual_seed(0)
    slot = cache.allocate(64, prompt_len=40)
    cache.write(slot, 0, torch.randn(40, 2, 32, generator=g).bfloat16(), torch.randn(40, 2, 32, generator=g).bfloat16())
    dec, waited = cache.decoder, []

    def broken(*a):
        raise RuntimeError("device side failed")

    monkeypatch.setattr(dec, "_window_part", broken)
    fb = ForwardBatch.build([slot], [1], [cache.seq_len(slot)], "cpu")
    with pytest.raises(RuntimeError, match="device side failed"):
        real = NativeWorker.wait_host
        monkeypatch.setattr(NativeWorker, "wait_host", lambda self, seq: waited.append(seq) or real(self, seq))
        cache.attend(0, torch.randn(1, 4, 32).bfloat16(), torch.randn(1, 2, 32).bfloat16(), torch.randn(1, 2, 32).bfloat16(), fb, 0.1)
    assert waited == [dec.worker.seq] and dec.worker.done_value() == dec.worker.seq
    cache.close()


def test_the_thread_pool_stays_selectable(monkeypatch):
    from writescope.attention.split import _native_wanted

    monkeypatch.setenv("WRITESCOPE_CPU_WORKER", "python")
    assert not _native_wanted()
    monkeypatch.setenv("WRITESCOPE_CPU_WORKER", "rust")
    with pytest.raises(ValueError, match="WRITESCOPE_CPU_WORKER='rust'"):
        _native_wanted()


@pytest.mark.gpu
def test_on_cuda_the_stream_hands_q_over_and_waits_without_the_host():
    """q's copy and the ready flag are issued behind queued device work, the stream waits for the
    done flag, and the host returns from both at once: the job runs when the device gets there."""
    gen = torch.Generator().manual_seed(4)
    w = NativeWorker(4, torch.device("cuda"))
    try:
        q, kv = _batch([300, 0, 1000], gen)
        q_dev = q.cuda()
        out = (torch.empty(3, 1, 16, 48, pin_memory=True), torch.empty(3, 1, 16, pin_memory=True))
        w.consume(w.submit(q_dev.cpu().pin_memory(), kv, 0.3, out))  # a first job (the kernels were compiled when the worker started)
        q_host = torch.empty(q.shape, dtype=q.dtype, pin_memory=True)  # before the sleep: a fresh cudaHostAlloc waits for the device
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # about 0.1 s of device time ahead of the hand-off
        q_host.copy_(q_dev, non_blocking=True)
        seq = w.submit(q_host, kv, 0.3, out)
        w.consume(seq)
        o_dev = out[0].to("cuda", non_blocking=True)
        stream = torch.cuda.current_stream()
        assert not stream.query() and w.done_value() != seq  # returned while the device is busy; the job waits for q
        torch.cuda.synchronize()
        assert w.done_value() == seq
        ro, rl = cpu_kernel.attend(q, kv, 0.3, threads=4)
        assert torch.equal(o_dev.cpu(), ro) and torch.equal(out[1], rl)
        w.check()
    finally:
        w.close()


def test_attention_threads_from_the_environment(monkeypatch):
    """WRITESCOPE_CPU_THREADS sets the CPU attention's threads (1 to the CPUs the process may use);
    unset, the default stays torch's count (less one with CUDA)."""
    import os

    from writescope.engine.threads import default_attention_threads

    monkeypatch.delenv("WRITESCOPE_CPU_THREADS", raising=False)
    assert default_attention_threads(torch.device("cpu")) == torch.get_num_threads()
    monkeypatch.setenv("WRITESCOPE_CPU_THREADS", "1")
    assert default_attention_threads(torch.device("cpu")) == 1
    from writescope.engine.threads import check_cpu_threads

    check_cpu_threads(None) or check_cpu_threads(1)  # not given, and 1: fine
    with pytest.raises(ValueError, match=r"--cpu-threads must be 1 to \d+ \(the CPUs this process may use\), got 0"):
        check_cpu_threads(0, "--cpu-threads")
    too_many = str(len(os.sched_getaffinity(0)) + 1)
    monkeypatch.setenv("WRITESCOPE_CPU_THREADS", too_many)
    with pytest.raises(ValueError, match=f"WRITESCOPE_CPU_THREADS='{too_many}': use an integer from 1 to"):
        default_attention_threads(torch.device("cpu"))


@pytest.mark.parametrize("budget_mib, layout", [(1, "mla"), (64, "mla"), (1, "gqa"), (64, "gqa")])
def test_a_waiting_job_prereads_its_first_bytes_and_gives_the_same_results(monkeypatch, budget_mib, layout):
    """WRITESCOPE_CPU_PREREAD: a job whose q has not come reads the first bytes it will read, up to
    the budget (all of its KV when that is less: each K row once, MLA's values being its keys'
    first columns), then waits; once q comes its results equal the inline call's."""
    import time

    monkeypatch.setenv("WRITESCOPE_CPU_PREREAD", str(budget_mib))
    gen = torch.Generator().manual_seed(11)
    w = NativeWorker(2, torch.device("cpu"))
    try:
        assert w.preread_bytes == budget_mib << 20
        if layout == "mla":
            q, kv = _batch([9000, 0, 15, 16, 17], gen)  # [1, n + 3, 64] latents: 1.16 MB of rows, more than 1 MiB
            total = sum(((x[0].shape[1] - 1) * 64 + 64) * 2 for x in kv if x is not None)
        else:
            H, n = 2, 4097
            q = torch.randn(3, H, 4, 64, generator=gen).bfloat16()
            k = torch.randn(H, n, 64, generator=gen).bfloat16()
            v = torch.randn(H, n, 48, generator=gen).bfloat16()
            kv = [(k, v), None, (k[:, :1], v[:, :1])]
            total = H * (n * 64 + n * 48) * 2 + H * (64 + 48) * 2  # 1.84 MB: keys, then values, per head
        rows = [r for r, x in enumerate(kv) if x is not None]
        flags = torch.zeros(2, dtype=torch.int32)
        o = _out(q, kv[0][1].shape[2])
        w._w.submit(q, [kv[r][0] for r in rows], [kv[r][1] for r in rows], rows, cpu_kernel.CHUNK, 0.125, -1, o[0], o[1], flags, 0, 1, 1, 1)
        want = min(budget_mib << 20, total)
        deadline = time.monotonic() + 600  # a guard against a hang only: the pre-read always comes, nothing is timed
        while w.preread_total() < want and time.monotonic() < deadline:  # no q yet: the job reads ahead, then spins
            time.sleep(0.01)
        assert w.preread_total() == want and int(flags[1]) == 0  # read ahead exactly, nothing attended
        flags[0] = 1  # q is there
        assert cpu_kernel._extension().wait_flag(flags, 1, 1, 30.0)
        ro, rl = cpu_kernel.attend(q, kv, 0.125, threads=2)
        assert torch.equal(o[0], ro) and torch.equal(o[1], rl)
    finally:
        w.close()
