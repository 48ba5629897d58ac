"""Chunked prefill's compute-row reads started ahead on the prefill writer's reader thread
(kvcache/inplace.py ``_read_ahead``, kvcache/prefill_writer.py ``read_async``): the same
attention as reading each layer when it comes, the reads' device memory bounded, a failed write
still raised, nothing left reading a freed sequence. On the CPU (the regions are host tensors and
the copies plain there; the reader thread and the ordering are the same)."""

from __future__ import annotations

import threading

import pytest
import torch

import writescope.kvcache.inplace as inplace
import writescope.kvcache.prefill_writer as pw
from writescope.attention.metadata import ForwardBatch
from writescope.config import KVLayout
from writescope.kvcache.inplace import InplaceKVCache, read_ahead_from_env
from writescope.kvcache.spec import PartitionSpec
from writescope.scheduler.policies import parse_policy

W, LAYERS, HQ, DIM = 16, 5, 4, 8


def _cache(policy="static:0.5", layout=KVLayout(2, DIM, DIM, False), ahead=2):
    """A cache on the CPU reading ``ahead`` layers ahead (the engine reads ahead only with CUDA,
    where the rows cross through staging; here the same path runs with plain copies)."""
    spec = PartitionSpec(layout, LAYERS, torch.float32, window=W, pingpong_bytes=2 * W * 2 * 2 * DIM * 4)
    cache = InplaceKVCache(spec, parse_policy(policy), "cpu", cpu_threads=1)
    assert cache.read_ahead == 0  # without CUDA the rows are read in place: nothing read ahead by default
    cache.read_ahead = ahead
    return cache


def _inputs(cache, qlens, seed):
    g = torch.Generator().manual_seed(seed)
    lay = cache.layout
    T = sum(qlens)
    out = []
    for _ in range(LAYERS):
        q = torch.randn(T, HQ, lay.k_dim, generator=g)
        k = torch.randn(T, lay.kv_heads, lay.k_dim, generator=g)
        v = None if lay.shared_kv else torch.randn(T, lay.kv_heads, lay.v_dim, generator=g)
        out.append((q, k, v))
    return out


def _prefill(cache, prompts, chunk, seed=0, spy=None):
    """Every prompt in chunks of ``chunk`` tokens, all sequences in each pass (ragged: a finished
    prompt has no tokens in later passes); returns each pass's per-layer outputs."""
    slots = [cache.allocate(n + 4, prompt_len=n) for n in prompts]
    done, outs, p = [0] * len(prompts), [], 0
    while any(d < n for d, n in zip(done, prompts)):
        qlens = [min(chunk, n - d) for d, n in zip(done, prompts)]
        batch = ForwardBatch.build(slots, qlens, list(done), "cpu")
        layer_outs = []
        for layer, (q, k, v) in enumerate(_inputs(cache, qlens, seed + p)):
            layer_outs.append(cache.attend(layer, q, k, v, batch, DIM**-0.5).clone())
            if spy is not None:
                spy(layer)
        outs.append(layer_outs)
        done = [d + n for d, n in zip(done, qlens)]
        p += 1
    return slots, outs


@pytest.mark.parametrize("policy", ["static:0.5", "static:0.3", "cpu", "gpu"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("ahead", ["1", "2", "7"])
def test_reads_started_ahead_give_the_same_attention(policy, shared, ahead, monkeypatch):
    """Prompts of odd lengths (1, 15, 16, 17, 97) in chunks of 20 tokens: every pass's every
    layer equals the run that reads each layer's rows on the issuing thread (read-ahead 0)."""
    layout = KVLayout(1, 12, 12, True) if shared else KVLayout(2, DIM, DIM, False)
    prompts = [1, 15, 16, 17, 97]
    ref_cache = _cache(policy, layout, ahead=0)
    _, ref = _prefill(ref_cache, prompts, 20)
    ref_cache.close()
    cache = _cache(policy, layout, ahead=int(ahead))
    started = []
    real = pw.PrefillWriter.read_async
    monkeypatch.setattr(pw.PrefillWriter, "read_async", lambda self, src, after=(): started.append(1) or real(self, src, after))
    _, got = _prefill(cache, prompts, 20)
    for a, b in zip(ref, got):
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=0, atol=0)  # the same rows read: exactly the same attention
    if policy in ("gpu",):
        assert not started  # no compute rows: nothing to read ahead
    else:
        assert started  # the later chunks' compute rows were read ahead
        assert cache._ahead_bytes == 0  # every read started was taken within its pass
    cache.close()


@pytest.mark.parametrize("ahead", [2, 7])
def test_no_read_is_left_after_a_pass_even_before_a_one_token_pass(ahead):
    """Reads ahead stop at the pass's last layer: each pass takes all it started, also where the
    next pass is decode-shaped (a prompt of 4 blocks + 1 token in passes of 2 blocks: its last
    pass has one token and gathers nothing, so a read started for it would be left behind)."""
    cache = _cache("cpu", ahead=ahead)
    left = []

    def spy(layer):
        if layer == LAYERS - 1:
            left.append((cache._ahead_bytes, sum(len(s.read_ahead) for s in cache._seqs.values())))

    _prefill(cache, [4 * W + 1], 2 * W, spy=spy)
    assert len(left) == 3 and all(x == (0, 0) for x in left)
    cache.close()


def test_reads_in_flight_stay_within_the_byte_cap(monkeypatch):
    """With a cap of two layers' rows of one sequence, no more than that is ever read ahead,
    however many layers ahead are asked for and however many sequences the pass has."""
    cache = _cache(ahead=4)
    seen = []
    prompts = [6 * W, 6 * W, 6 * W]

    def spy(layer):
        seen.append(cache._ahead_bytes)
        got = sum(e[1] for s in cache._seqs.values() for e in s.read_ahead.values())
        assert got == cache._ahead_bytes

    # the rows a layer of one sequence has compute-placed before its last chunk: half of 5 blocks at most
    monkeypatch.setattr(inplace, "READ_AHEAD_BYTES", 2 * 3 * cache.spec.block_bytes)
    _prefill(cache, prompts, 2 * W, spy=spy)
    assert max(seen) > 0
    assert max(seen) <= 2 * 3 * cache.spec.block_bytes
    cache.close()


def test_a_failed_write_is_raised_by_the_gather_that_takes_its_read(monkeypatch):
    """A compute-row write of layer 3 fails: its read, started ahead from layer 1, waits for it
    and fails; layer 3's gather raises that failure (never the stale rows), and layer 2's, read
    ahead beside it, is exact."""
    cache = _cache("cpu")
    slot = cache.allocate(8 * W, prompt_len=8 * W)
    sq = cache.sequence(slot)
    layer3 = sq.compute[3]
    lo, hi = layer3.data_ptr(), layer3.data_ptr() + layer3.numel() * layer3.element_size()
    real = pw._finish

    def failing(event, stage, dst):
        if lo <= dst.data_ptr() < hi:
            raise RuntimeError("copy failed")
        real(event, stage, dst)

    monkeypatch.setattr(pw, "_finish", failing)
    g = torch.Generator().manual_seed(4)
    for layer in (2, 3):  # two writes: fewer than the writer's staging buffers, so no later write finds the failure first
        cache.write(slot, layer, torch.randn(4 * W, 2, DIM, generator=g), torch.randn(4 * W, 2, DIM, generator=g))
    cache._read_ahead([sq], 1)
    assert set(sq.read_ahead) == {2, 3} and not sq.compute_writes[3]  # the read took the write over
    assert torch.equal(cache._gather(sq, 2)[:, :, : 4 * W], sq.compute[2, :, :, : 4 * W])
    with pytest.raises(RuntimeError, match="copy failed"):
        cache._gather(sq, 3)
    cache._writer._pending.clear()  # the failure is this test's, not free's
    cache.free(slot)
    assert cache._ahead_bytes == 0
    cache.close()


def test_a_read_started_ahead_that_no_longer_covers_the_layer_is_dropped(monkeypatch):
    """Layer 2's rows read ahead, then more blocks placed in layer 2 before its gather (as a pass
    that failed and was retried could leave): the gather reads again and is exact."""
    cache = _cache("cpu")
    slot = cache.allocate(12 * W, prompt_len=12 * W)
    sq = cache.sequence(slot)
    g = torch.Generator().manual_seed(5)
    lay = cache.layout
    for layer in range(LAYERS):
        cache.write(slot, layer, torch.randn(4 * W, 2, DIM, generator=g), torch.randn(4 * W, 2, DIM, generator=g))
    cache._read_ahead([sq], 1)  # starts layers 2 and 3
    assert set(sq.read_ahead) == {2, 3}
    cache.write(slot, 2, torch.randn(W, 2, DIM, generator=g), torch.randn(W, 2, DIM, generator=g))
    got = cache._gather(sq, 2)
    want = torch.cat([sq.compute[2, :, :, : sq.n_comp[2] * W], sq.window[2, :, :, : sq.win_len[2]]], dim=2)
    assert got.shape[2] == 5 * W and torch.equal(got, want)
    assert torch.equal(cache._gather(sq, 3)[:, :, : 4 * W], sq.compute[3, :, :, : 4 * W])  # layer 3's still covers it
    assert cache._ahead_bytes == 0
    cache.free(slot)
    cache.close()


def test_free_waits_for_reads_still_running(monkeypatch):
    """A sequence freed while its reads started ahead wait for a held write: free waits for them
    (nothing reads rows being freed) and the cache counts no read in flight after."""
    cache = _cache("cpu", ahead=3)
    slot = cache.allocate(8 * W, prompt_len=8 * W)
    sq = cache.sequence(slot)
    gate, real = threading.Event(), pw._finish

    def held(event, stage, dst):
        assert gate.wait(600)
        real(event, stage, dst)

    g = torch.Generator().manual_seed(2)
    for layer in range(LAYERS):
        cache.write(slot, layer, torch.randn(4 * W, 2, DIM, generator=g), torch.randn(4 * W, 2, DIM, generator=g))
    cache.flush_writes()
    monkeypatch.setattr(pw, "_finish", held)
    try:
        for layer in (1, 2, 3):  # three held writes: fewer than the writer's staging buffers, so none blocks here
            cache.write(slot, layer, torch.randn(W, 2, DIM, generator=g), torch.randn(W, 2, DIM, generator=g))
        cache._read_ahead([sq], 0)
        reads = [e[2] for e in sq.read_ahead.values()]
        assert len(reads) == 3 and not any(r.done() for r in reads)  # waiting for the held writes
    finally:
        threading.Timer(0.2, gate.set).start()  # the writer is let go even when an assertion fails
    cache.free(slot)
    assert all(r.done() for r in reads) and cache._ahead_bytes == 0
    cache.close()


@pytest.mark.parametrize("value", ["-1", "65", "two"])
def test_a_bad_read_ahead_names_the_value(value, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_PREFILL_READ_AHEAD", value)
    with pytest.raises(ValueError, match=f"WRITESCOPE_PREFILL_READ_AHEAD.*{value}"):
        read_ahead_from_env()


def test_read_ahead_default_and_off(monkeypatch):
    monkeypatch.delenv("WRITESCOPE_PREFILL_READ_AHEAD", raising=False)
    assert read_ahead_from_env() == 2
    monkeypatch.setenv("WRITESCOPE_PREFILL_READ_AHEAD", "0")
    assert read_ahead_from_env() == 0
