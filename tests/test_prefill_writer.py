"""Background prefill writes to the compute region: ordering, back-pressure, errors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import writescope.kvcache.prefill_writer as pw
from writescope import LLM, SamplingParams
from writescope.kvcache.prefill_writer import PrefillWriter


@pytest.fixture
def slow_writes(monkeypatch):
    """Every background copy lands 5 ms late: a reader that does not flush sees stale rows."""
    real = pw._finish

    def slow(event, stage, dst):
        time.sleep(0.005)
        real(event, stage, dst)

    monkeypatch.setattr(pw, "_finish", slow)


def test_chunks_land_in_strided_rows_after_flush(slow_writes, monkeypatch):
    slow, gate = pw._finish, threading.Event()

    def held(event, stage, dst):  # the last chunk (3 of 101 tokens) lands only once the test has looked
        if dst.shape[2] == 3:
            assert gate.wait(600)
        slow(event, stage, dst)

    monkeypatch.setattr(pw, "_finish", held)
    src = torch.randn(2, 3, 101, 8)
    region = torch.zeros(2, 3, 200, 8)  # per-head rows with a larger capacity: dst is strided
    dst = region[:, :, 50:151]
    w = PrefillWriter(buffer_bytes=2 * 3 * 8 * 4 * 7, dtype=torch.float32, device=torch.device("cpu"), buffers=2)  # 7 tokens a chunk
    w.write(dst, src)  # 15 chunks through 2 buffers: the issuing thread waits for free buffers, never for its last copy
    assert w.in_flight > 0 and not torch.equal(dst, src)  # still landing
    gate.set()
    w.flush()
    assert torch.equal(dst, src) and w.in_flight == 0
    assert torch.all(region[:, :, :50] == 0) and torch.all(region[:, :, 151:] == 0)
    w.close()


def test_a_failed_write_is_raised_at_flush_and_the_writer_goes_on(slow_writes):
    w = PrefillWriter(1024, torch.float32, torch.device("cpu"), buffers=1)  # every write reuses the failed one's buffer
    later = torch.zeros(1, 1, 4, 2)
    w.write(torch.zeros(1, 1, 3, 2), torch.ones(1, 1, 4, 2))  # shapes differ: the copy fails in the thread
    with pytest.raises(RuntimeError):
        w.write(later, torch.ones(1, 1, 4, 2))  # the buffer is needed again: its failure surfaces here, once
    w.write(later, torch.ones(1, 1, 4, 2))
    w.flush()  # the failure was reported once, above
    assert torch.equal(later, torch.ones(1, 1, 4, 2))
    bad = torch.zeros(1, 1, 3, 2)
    w.write(bad, torch.ones(1, 1, 4, 2))
    with pytest.raises(RuntimeError):
        w.flush()  # a failure still pending is raised by flush, after every write has finished
    for _ in range(3):
        dst = torch.zeros(1, 1, 4, 2)
        w.write(dst, torch.ones(1, 1, 4, 2))
        w.flush()
        assert torch.equal(dst, torch.ones(1, 1, 4, 2))
    w.close()


def test_cache_allocated_under_inference_mode():
    """A user calling generate inside torch.inference_mode(): the compute rows are inference
    tensors, written by the writer thread (outside inference mode) all the same."""
    llm = LLM("tiny-qwen3-moe", progress=False)
    prompts = [list(range(3, 300))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm.set_policy("static:0.5", window=16)
    with torch.inference_mode():
        got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == ref


def test_staging_is_made_at_allocate_only_when_the_prompt_uses_the_compute_region():
    """Setting up the staging (pinning, on CUDA) is allocate's cost, not the first prefill's;
    a cache whose prompts all go to the load region never makes it."""
    from writescope.kvcache.inplace import InplaceKVCache
    from writescope.kvcache.spec import KVLayout, PartitionSpec
    from writescope.scheduler.policies import StaticPolicy

    spec = PartitionSpec(KVLayout(2, 8, 8, False), 1, torch.float32, window=16)
    load_only = InplaceKVCache(spec, StaticPolicy(0.0), "cpu")
    load_only.allocate(100, prompt_len=64)
    assert load_only._writer is None
    load_only.close()
    routed = InplaceKVCache(spec, StaticPolicy(0.5), "cpu")
    routed.allocate(100, prompt_len=8)  # no whole block in the prompt: nothing to stage yet
    assert routed._writer is None
    routed.allocate(100, prompt_len=64)
    assert routed._writer is not None and len(routed._writer._bufs) == pw.STAGING_BUFFERS and len(routed._writer._read_bufs) == pw.READ_BUFFERS
    routed.close()


@pytest.mark.parametrize("policy", ["cpu", "static:0.5", "monolithic:0.5"])
def test_late_writes_do_not_change_tokens(slow_writes, policy):
    """Prompts routed partly to the compute region, written late: the CPU attention and chunked
    prefill's read-back wait for them, so tokens equal the all-device cache's."""
    llm = LLM("tiny-qwen3-moe", progress=False, prefill_chunk_tokens=96)  # chunked: later chunks read earlier KV back
    prompts = [list(range(3, 3 + n)) for n in (300, 17, 129)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm.set_policy(policy, window=16)
    got = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    assert got == ref


@pytest.mark.gpu
def test_cuda_writes_go_through_pinned_staging():
    src = torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty(2, 4, 2000, 128, dtype=torch.bfloat16)[:, :, 500:1500]
    w = PrefillWriter(4 << 20, torch.bfloat16, torch.device("cuda"))  # 4 MiB: 4 chunks
    w.write(dst, src)
    assert all(b.is_pinned() for b in w._bufs)
    w.flush()
    assert torch.equal(dst, src.cpu())
    w.close()


@pytest.mark.parametrize("n", [0, 1, 6, 7, 8, 15, 101])
def test_read_equals_the_strided_rows_in_pieces_through_the_buffers(n):
    """Host rows (strided) read to a new tensor in 7-token pieces through the read buffers, between
    writes: every size from none to many pieces, twice (the buffers come round)."""
    g = torch.Generator().manual_seed(n)
    region = torch.randn(2, 3, 200, 8, generator=g)
    rows = region[:, :, 40 : 40 + n]
    w = PrefillWriter(buffer_bytes=2 * 3 * 8 * 4 * 7, dtype=torch.float32, device=torch.device("cpu"), buffers=2)
    other = torch.zeros(2, 3, 30, 8)
    w.write(other, torch.ones(2, 3, 30, 8))  # the buffers were last used by writes
    w.flush()
    got = w.read(rows)
    assert got.shape == rows.shape and got.is_contiguous() and torch.equal(got, rows)
    assert n == 0 or got.data_ptr() != rows.data_ptr()  # a copy, not the rows
    got2 = w.read(rows)  # again: the buffers come round
    assert torch.equal(got2, rows) and torch.equal(got, rows)
    w.close()


def test_read_keeps_nan_and_inf():
    rows = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.5]).view(1, 1, 6, 1).repeat(1, 2, 1, 3)
    w = PrefillWriter(buffer_bytes=2 * 3 * 4 * 4, dtype=torch.float32, device=torch.device("cpu"), buffers=2)  # 4 tokens a piece
    got = w.read(rows)
    assert torch.equal(torch.isnan(got), torch.isnan(rows)) and torch.equal(torch.nan_to_num(got), torch.nan_to_num(rows))
    assert torch.equal(torch.signbit(got), torch.signbit(rows))
    w.close()


def test_a_read_does_not_wait_for_writes_in_flight(monkeypatch):
    """Reads have their own buffers: with every write buffer held by a write that has not landed,
    a read of other rows still completes (chunked prefill reads one layer while the layers after
    it are being written)."""
    gate = threading.Event()
    real = pw._finish

    def held(event, stage, dst):
        assert gate.wait(600)
        real(event, stage, dst)

    monkeypatch.setattr(pw, "_finish", held)
    w = PrefillWriter(buffer_bytes=1 * 1 * 2 * 4 * 3, dtype=torch.float32, device=torch.device("cpu"), buffers=2)  # 3 tokens a piece
    dst = torch.zeros(1, 1, 6, 2)
    futures = w.write(dst, torch.ones(1, 1, 6, 2))  # two pieces: both write buffers in flight
    assert len(futures) == 2 and not any(f.done() for f in futures)
    rows = torch.randn(1, 1, 20, 2)
    assert torch.equal(w.read(rows), rows)
    assert not any(f.done() for f in futures)
    gate.set()
    w.flush()
    assert all(f.done() for f in futures) and torch.equal(dst, torch.ones(1, 1, 6, 2))
    w.close()


@pytest.mark.gpu
def test_cuda_read_through_pinned_staging_between_writes():
    """Reads through their own pinned buffers between writes, with the current stream busy: a
    read's DMA from a buffer has finished before a later piece refills it; the rows equal a
    plain copy's."""
    region = torch.randn(2, 4, 3000, 128).to(torch.bfloat16)
    w = PrefillWriter(4 << 20, torch.bfloat16, torch.device("cuda"))  # 2 KiB a token: 2,048 tokens a piece
    for n in (1, 17, 2048, 2049, 2999):
        rows = region[:, :, 1 : 1 + n]
        torch.cuda._sleep(20_000_000)  # the current stream busy: the read is ordered after it
        got = w.read(rows)
        assert got.is_cuda and torch.equal(got.cpu(), rows)
        src = torch.randn(2, 4, 700, 128, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty(2, 4, 700, 128, dtype=torch.bfloat16)
        w.write(dst, src)
        w.flush()
        assert torch.equal(dst, src.cpu())
    w.close()
