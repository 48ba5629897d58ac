"""The chunked prefill's read of a sequence's cached KV (kvcache/inplace.py ``_gather``): each
region crosses in one piece and the blocks are put in position order on the device. Checked
against a per-block reference (the old form: one copy per block) for every placement and odd
lengths, on the CPU (the regions are host tensors there too)."""

from __future__ import annotations

import contextlib
import re
from concurrent.futures import wait

import pytest
import torch

import writescope.kvcache.prefill_writer as pw

from writescope import LLM
from writescope.scheduler.policies import COMPUTE

D = 16


def _reference(cache, sq, layer: int) -> torch.Tensor:
    """One block at a time, in position order, as the first form read them."""
    D = cache.spec.window
    pieces = []
    for j in range(sq.placed[layer] // D):
        region, idx = sq.homes[j]
        blk = sq.compute[layer, :, :, idx * D : (idx + 1) * D] if region == COMPUTE else sq.load_block(layer, idx)
        pieces.append(blk.to(cache.device))
    pieces.append(sq.window[layer, :, :, : sq.win_len[layer]])
    return torch.cat(pieces, dim=2)


@pytest.mark.parametrize("policy", ["static:0.5", "static:0.3", "cpu", "gpu"])
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_gather_equals_the_block_by_block_read(policy, preset, monkeypatch):
    import writescope.kvcache.inplace as inplace

    llm = LLM(preset, progress=False, policy=policy, window=D)
    ticks = iter(range(10**9))
    monkeypatch.setattr(inplace.time, "perf_counter", lambda: float(next(ticks)))  # a clock that moves a second a call
    _check_gather(llm, policy, fake_clock=True)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["static:0.5", "cpu"])
def test_gather_on_cuda_reads_the_compute_rows_through_pinned_staging(policy):
    """On CUDA the compute rows cross through the prefill writer's pinned buffers (kvcache/
    inplace.py ``_read_compute``): the same tensor as the block-by-block read."""
    llm = LLM("tiny-deepseek-v2", device="cuda", dtype="bfloat16", progress=False, policy=policy, window=D)
    _check_gather(llm, policy)
    assert llm.cache._writer is not None and all(b.is_pinned() for b in llm.cache._writer._bufs + llm.cache._writer._read_bufs)


@pytest.mark.parametrize("plan", ["compute-last", "compute-first"])
def test_gather_past_the_prompt_plan(plan, monkeypatch):
    """Blocks past the prompt are routed as decode routes them, so the regions alternate: each
    run of blocks still lands in its positions (one copy per run, kvcache/sequence.py
    ``block_runs``)."""
    monkeypatch.setenv("WRITESCOPE_PROMPT_PLAN", plan)
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.3", window=D)
    runs = _check_gather(llm, "static:0.3", prompt_len=lambda n: min(n, 3 * D + 5))
    assert max(runs) > 2  # the routing past the prompt alternated regions at least once


def test_block_runs_cover_every_block_once():
    from writescope.kvcache.sequence import block_runs

    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        regions = torch.randint(0, 2, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
        count, homes = [0, 0], []
        for r in regions:
            homes.append((r, count[r]))
            count[r] += 1
        runs = block_runs(homes)
        back = [(region, first + i) for region, first, _, n in runs for i in range(n)]
        assert back == homes
        assert [start for _, _, start, _ in runs] == [sum(n for *_, n in runs[:i]) for i in range(len(runs))]
        assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))  # dense indices: a run ends only where the region changes


def _check_gather(llm, policy: str, fake_clock: bool = False, prompt_len=lambda n: n) -> list[int]:
    """Write KV of odd lengths, then read each sequence back and compare with the block-by-block
    read; returns each read sequence's count of block runs."""
    from writescope.kvcache.sequence import block_runs

    cache, lay = llm.cache, llm.config.kv_layout
    g = torch.Generator().manual_seed(7)
    lens = [1, 15, 16, 17, 4097]
    slots = [cache.allocate(n + 4, prompt_len=prompt_len(n)) for n in lens]
    for slot, n in zip(slots, lens):
        for layer in range(llm.config.num_layers):
            for a in range(0, n, 1000):  # in chunks, as a chunked prefill writes
                e = min(n, a + 1000)
                k = torch.randn(e - a, lay.kv_heads, lay.k_dim, generator=g).to(cache.device, cache.spec.dtype)
                v = None if lay.shared_kv else torch.randn(e - a, lay.kv_heads, lay.v_dim, generator=g).to(cache.device, cache.spec.dtype)
                cache.write(slot, layer, k, v)
    regions, runs = set(), []
    before, before_c = cache.prefill_readback_bytes, cache.prefill_readback_compute_bytes
    for slot, n in zip(slots, lens):
        sq = cache.sequence(slot)
        regions |= {r for r, _ in sq.homes}
        runs.append(len(block_runs(sq.homes[: sq.placed[0] // D])))
        for layer in (0, llm.config.num_layers - 1):
            got = cache._gather(sq, layer)
            assert got.shape[2] == n
            assert torch.equal(got, _reference(cache, sq, layer))
    # every placed block read counts once per read (two layers read per sequence, all placed alike)
    assert cache.prefill_readback_bytes - before == sum(
        2 * (cache.sequence(s).placed[0] // D) * cache.spec.block_bytes for s in slots)
    assert cache.prefill_readback_compute_bytes - before_c == sum(
        2 * cache.sequence(s).n_comp[0] * cache.spec.block_bytes for s in slots)
    stats = cache.prefill_readback()
    assert stats["bytes"] == cache.prefill_readback_bytes and stats["compute_bytes"] == cache.prefill_readback_compute_bytes
    if fake_clock:  # ten reads above, each timed: on a clock that moves a second a call, at least a second each
        assert stats["host_s"] >= 10
    if policy.startswith("static"):
        assert len(regions) == 2  # both regions, interleaved
    for s in slots:
        cache.free(s)
    return runs


def test_gather_waits_only_for_its_own_layers_writes(monkeypatch):
    """Layer 1's compute-row writes held in the writer: layer 0's read-back completes without them
    and is exact; layer 1's, once they land, is exact too (it waited for them)."""
    import threading

    llm = LLM("tiny-deepseek-v2", progress=False, policy="static:0.5", window=D)
    cache, lay = llm.cache, llm.config.kv_layout
    slot = cache.allocate(200, prompt_len=150)
    sq = cache.sequence(slot)
    gate, real = threading.Event(), pw._finish
    layer1 = sq.compute[1]
    lo, hi = layer1.data_ptr(), layer1.data_ptr() + layer1.numel() * layer1.element_size()

    def held(event, stage, dst):
        if lo <= dst.data_ptr() < hi:
            assert gate.wait(600)
        real(event, stage, dst)

    monkeypatch.setattr(pw, "_finish", held)
    g = torch.Generator().manual_seed(3)
    try:
        for layer in (0, 1):
            for a in range(0, 150, 50):
                cache.write(slot, layer, torch.randn(50, lay.kv_heads, lay.k_dim, generator=g), None)
        assert any(not f.done() for f in sq.compute_writes[1])
        assert torch.equal(cache._gather(sq, 0), _reference(cache, sq, 0))
        assert any(not f.done() for f in sq.compute_writes[1])  # still held: layer 0 did not wait for them
    finally:
        gate.set()  # the writer thread is not left waiting when an assertion fails
    got = cache._gather(sq, 1)
    assert torch.equal(got, _reference(cache, sq, 1)) and not sq.compute_writes[1]
    cache.free(slot)


class _FakeStream:
    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self):
        return object()


def test_prefill_load_writes_on_the_evict_stream_still_tell_the_decoder(monkeypatch):
    """_write_load's evict-stream branch calls decoder.note_evict(): the decode copy stream and the
    in-place read wait for the evict stream only then (a request prefilled while others decode
    would otherwise have its load blocks read before they land). CUDA is faked on the CPU."""
    llm = LLM("tiny-deepseek-v2", progress=False, policy="gpu", window=D)
    cache = llm.cache
    slot = cache.allocate(200, prompt_len=64)  # on the CPU: unpinned
    sq = cache.sequence(slot)
    # pretend CUDA for _write_load's evict-stream branch only
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    cache.cuda, cache._load_on_evict, cache.evict_stream = True, True, _FakeStream()
    cache.decoder._evicted = False  # as after an earlier decode step consumed it
    blocks = torch.randn(1, *cache.spec.block_shape())
    cache._write_load(sq.load_runs(0, 0, 1, 1), blocks)
    cache.cuda = False
    assert cache.decoder._evicted, "a prefill write into the load region on the evict stream must tell the decoder (note_evict)"


def test_a_failed_compute_write_is_not_read_back_as_stale_rows(monkeypatch):
    """A compute-row write of layer 0 fails before a later compute run of the same layer in the
    same _place_blocks call: its failed future is kept, so the next chunk's read-back raises the
    failure instead of returning the stale (zero) rows."""
    llm = LLM("tiny-deepseek-v2", progress=False, policy="static:0.5", window=D)
    cache, lay = llm.cache, llm.config.kv_layout
    slot = cache.allocate(400)  # no prompt hint: the first write is the prompt, later blocks routed one by one
    sq = cache.sequence(slot)
    g = torch.Generator().manual_seed(1)
    cache.write(slot, 0, torch.randn(D, lay.kv_heads, lay.k_dim, generator=g), None)  # the "prompt": one block
    cache.flush_writes()
    real, calls = pw._finish, []

    def failing(event, stage, dst):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("copy failed")
        real(event, stage, dst)

    monkeypatch.setattr(pw, "_finish", failing)
    real_load = cache._write_load

    def load_after_writes_settle(runs, blocks):  # the writer thread got to the first write meanwhile
        wait(list(cache._writer._pending))
        return real_load(runs, blocks)

    monkeypatch.setattr(cache, "_write_load", load_after_writes_settle)
    cache.write(slot, 0, torch.randn(8 * D, lay.kv_heads, lay.k_dim, generator=g), None)
    runs = []
    for region, _ in sq.homes[1:9]:
        if not runs or runs[-1] != region:
            runs.append(region)
    assert runs.count(COMPUTE) >= 2, sq.homes[1:9]  # at least two compute runs in one call
    failed = False
    try:
        cache._gather(sq, 0)
    except RuntimeError as e:
        failed = "copy failed" in str(e)
    cache._writer._pending.clear()  # the failure is reported by this test, not at free
    cache.free(slot)
    assert failed, "the read-back returned rows whose write failed (its future was pruned from compute_writes)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["gpu", "static:0.5"])
def test_a_later_prefill_chunk_never_waits_for_the_device(policy):
    """A chunk after the first reads the earlier KV back without a host synchronisation (torch's
    sync debug mode raises on one): it waits only for its layer's earlier writes, done by then, and
    its copies run on their own streams. Its attention equals the reference's over the
    block-by-block read of the earlier KV."""
    from writescope.attention.metadata import ForwardBatch
    from writescope.attention.reference import attend_sequence
    from writescope.config import KVLayout
    from writescope.kvcache.inplace import InplaceKVCache
    from writescope.kvcache.spec import PartitionSpec
    from writescope.scheduler.policies import parse_policy

    layout, Hq, W, layers = KVLayout(2, 64, 64, False), 8, 64, 3
    spec = PartitionSpec(layout, layers, torch.bfloat16, window=W, pingpong_bytes=2 * W * 2 * 2 * 64 * 2)
    cache = InplaceKVCache(spec, parse_policy(policy), "cuda", cpu_threads=2)
    first, second = [W * 5 + 7, W * 3], [W * 2 + 3, 17]
    slots = [cache.allocate(a + b + 8, prompt_len=a + b) for a, b in zip(first, second)]
    try:
        def chunk(qlens, ctx):
            batch = ForwardBatch.build(slots, qlens, ctx, "cuda")
            T = sum(qlens)
            return batch, [tuple(torch.randn(T, h, 64, device="cuda", dtype=torch.bfloat16) for h in (Hq, 2, 2)) for _ in range(layers)]

        batch, inputs = chunk(first, [0, 0])
        for layer, (q, k, v) in enumerate(inputs):
            cache.attend(layer, q, k, v, batch, 64**-0.5)
        torch.cuda.synchronize()
        cache.flush_writes()
        refs = [[_reference(cache, cache.sequence(s), layer) for s in slots] for layer in range(layers)]
        batch, inputs = chunk(second, first)
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs = [cache.attend(layer, q, k, v, batch, 64**-0.5) for layer, (q, k, v) in enumerate(inputs)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        starts = [0, second[0], sum(second)]
        for layer, (q, k, v) in enumerate(inputs):
            out = getattr(outs[layer], "out", outs[layer])
            for i, ref in enumerate(refs[layer]):
                a, b = starts[i], starts[i + 1]
                kv = torch.cat((ref, torch.stack((k[a:b], v[a:b])).transpose(1, 2)), dim=2)  # [2, Hkv, ctx + n, 64]
                want = attend_sequence(q[a:b], kv[0].transpose(0, 1), kv[1].transpose(0, 1), first[i], 64**-0.5)
                torch.testing.assert_close(out[a:b], want)
        assert cache.prefill_readback_bytes > 0
    finally:
        cache.close()


def test_the_timings_show_the_read_back():
    """generate's timings table: the read-back's bytes and the issuing thread's time, only where
    a chunk read anything back."""
    from types import SimpleNamespace

    from writescope.cli.generate import format_timings

    m = SimpleNamespace(prefill_tok_s=1.0, ttft_s=1.0, tpot_s=0.01, decode_tok_s=100.0, peak_memory_bytes=0)
    outs = [SimpleNamespace(metrics=SimpleNamespace(**vars(m), prompt_tokens=10), kv_placement=None)]
    text = format_timings(outs, "static:0.5", None, None,
                          {"bytes": 2.5e9, "compute_bytes": 1.5e9, "host_s": 3.25, "take_wait_s": 0.25, "staging_copy_s": 0.5, "wait_s": 1.5})
    assert "prefill read-back (chunks re-reading earlier KV)" in text
    assert ("2.5 GB (1.5 GB compute rows); issuing thread 3.2 s in it (250.0 ms waiting for reads started ahead); "
            "compute-row reads (reader and issuing threads): 500.0 ms copying compute rows to pinned staging, "
            "1.5 s waiting for earlier writes and staging buffers") in text
    cpu = format_timings(outs, "static:0.5", None, None, {"bytes": 5e6, "compute_bytes": 0, "host_s": 0.002, "staging_copy_s": 0.0, "wait_s": 0.0})
    assert "5.0 MB (0.0 MB compute rows); issuing thread 2.0 ms in it\n" in cpu + "\n"
    assert "read-back" not in format_timings(outs, "gpu", None, None, {"bytes": 0, "compute_bytes": 0, "host_s": 0.0, "staging_copy_s": 0.0, "wait_s": 0.0})


@pytest.mark.parametrize("policy", ["static:0.5", "gpu", "cpu"])
def test_allocation_counts_the_load_blocks_reserved_and_the_compute_rows_committed(policy):
    """``InplaceKVCache.kv_allocation``: each allocated prompt's plan, its load blocks reserved and
    its compute rows faulted in at allocate, in bytes (and seconds); generate's timings show it."""
    from types import SimpleNamespace

    from writescope.cli.generate import format_timings
    from writescope.scheduler.policies import LOAD

    llm = LLM("tiny-deepseek-v2", progress=False, policy=policy, window=D)
    cache = llm.cache
    assert cache.kv_allocation() == {"sequences": 0, "host_s": 0.0, "reserve_s": 0.0, "reserve_bytes": 0, "commit_s": 0.0, "commit_bytes": 0}
    lens = [5 * D + 3, 17, 1]
    slots = [cache.allocate(n + 4, prompt_len=n) for n in lens]
    a = cache.kv_allocation()
    assert a["sequences"] == 3 and min(a["host_s"], a["reserve_s"], a["commit_s"]) >= 0  # host times: no bound on how long
    plans = [cache.sequence(s).prompt_plan() for s in slots]
    n_c = sum(p.count(COMPUTE) for p in plans)
    assert a["commit_bytes"] == n_c * cache.spec.block_bytes * llm.config.num_layers  # exactly the plans' compute rows, all layers
    reserved = sum(s.tensor.numel() * s.tensor.element_size() for q in slots for s in cache.sequence(q).slabs)
    assert a["reserve_bytes"] == reserved >= sum(p.count(LOAD) for p in plans) * cache.spec.block_bytes * llm.config.num_layers
    assert (a["commit_bytes"] > 0) == (policy != "gpu") and (a["reserve_bytes"] > 0) == (policy != "cpu")
    m = SimpleNamespace(prefill_tok_s=1.0, ttft_s=1.0, tpot_s=0.01, decode_tok_s=100.0, peak_memory_bytes=0)
    outs = [SimpleNamespace(metrics=SimpleNamespace(**vars(m), prompt_tokens=10), kv_placement=None)]
    text = format_timings(outs, policy, None, None, None, {**a, "host_s": 2.5, "commit_s": 2.0, "reserve_s": 0.25,
                                                           "commit_bytes": 8e9, "reserve_bytes": 2e6})
    assert ("KV allocation (before the timed prefill)  3 sequences in 2.5 s: 2.0 MB of load blocks reserved in "
            "250.0 ms, 8.0 GB of compute rows committed in 2.0 s") in text
    assert "KV allocation" not in format_timings(outs, policy, None, None, None, {**a, "sequences": 0})
    for s in slots:
        cache.free(s)


def test_the_prefill_passes_are_kept_and_shown(monkeypatch):
    """``LLM.prefill_chunks``: one entry per forward pass of the offline prefill run pass after
    pass (its requests, tokens, and host seconds from the start, increasing), or per group of
    passes run layer by layer; generate's timings show the first against the others."""
    from types import SimpleNamespace

    from writescope import SamplingParams
    from writescope.cli.generate import format_timings

    prompts = [list(range(3, 3 + n)) for n in (70, 5, 33)]
    monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", "layer")
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D, prefill_chunk_tokens=32)
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
    assert [(c["requests"], c["tokens"], c["passes"]) for c in llm.prefill_chunks] == [([0, 1, 2], 108, 4)]  # one group
    monkeypatch.setenv("WRITESCOPE_PREFILL_ORDER", "chunk")
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=D, prefill_chunk_tokens=32)
    llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=2, ignore_eos=True))
    chunks = llm.prefill_chunks
    assert sum(c["tokens"] for c in chunks) == 108 and all(c["tokens"] <= 32 and c["passes"] == 1 for c in chunks)
    assert len(chunks) == 4 and chunks[0]["requests"] == [0] and chunks[2]["requests"] == [0, 1, 2]  # 32 | 32 | 6+5+21 | 12
    assert all(a["end_s"] <= b["end_s"] for a, b in zip(chunks, chunks[1:])) and chunks[0]["end_s"] >= 0  # a monotonic clock
    m = SimpleNamespace(prefill_tok_s=1.0, ttft_s=1.0, tpot_s=0.01, decode_tok_s=100.0, peak_memory_bytes=0)
    outs = [SimpleNamespace(metrics=SimpleNamespace(**vars(m), prompt_tokens=10), kv_placement=None)]
    fake = [{"requests": [0], "tokens": 2048, "end_s": t} for t in (2.0, 2.1, 2.3, 2.4)]
    text = format_timings(outs, "static:0.5", chunks=fake)
    assert re.search(r"prefill passes \(issuing thread, each\) +4 of up to 2,048 tokens: the first 2\.0 s, "
                     r"the others median 100\.0 ms, slowest 200\.0 ms \(pass 3\)", text), text
    groups = format_timings(outs, "static:0.5", chunks=[{**c, "tokens": 32768, "passes": 16} for c in fake])
    assert re.search(r"prefill groups of passes, layer by layer \(issuing thread, each\) +4 of up to 32,768 tokens", groups), groups
    assert "prefill passes" not in format_timings(outs, "static:0.5", chunks=fake[:1])
