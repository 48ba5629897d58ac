"""InplaceKVCache on CUDA: pinning, streams, ping-pong overlap, exactness in bf16 and fp32.

Run on the GPU machine: ``python -m pytest -m gpu tests/test_gpu_inplace.py``.
"""

from __future__ import annotations

import pytest
import torch

from writescope.attention.metadata import ForwardBatch
from writescope.config import KVLayout
from writescope.kvcache.inplace import InplaceKVCache
from writescope.kvcache.pinned import host_empty, unpin
from writescope.kvcache.spec import PartitionSpec
from writescope.scheduler.policies import COMPUTE, LOAD, StaticPolicy, parse_policy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QWEN3 = (KVLayout(4, 128, 128, False), 32)  # (layout, q_heads)
MLA = (KVLayout(1, 576, 512, True), 16)


def _reference(q, keys, vals, scale):
    """float64 softmax(q k^T) v for one sequence: q [Hq, dk], keys [n, Hkv, dk], vals [n, Hkv, dv]."""
    G = q.shape[0] // keys.shape[1]
    k = keys.double().repeat_interleave(G, dim=1)  # [n, Hq, dk]
    v = vals.double().repeat_interleave(G, dim=1)
    s = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)


def _drive(layout, Hq, policy, lens, steps, dtype, window, seed=0):
    """Prefill ``lens`` then decode ``steps`` on CUDA; returns max abs error vs float64 per step
    and the cache (slots still allocated)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    spec = PartitionSpec(layout, 1, dtype, window=window, pingpong_bytes=4 * window * 2 * layout.kv_heads * layout.k_dim * 2)
    cache = InplaceKVCache(spec, policy, "cuda", cpu_threads=4)
    slots = [cache.allocate(n + steps, prompt_len=n) for n in lens]
    kv_all = [[] for _ in lens]
    scale = layout.k_dim**-0.5

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    errs = []
    ctx = [0] * len(lens)
    for step in range(steps + 1):
        qlens = lens if step == 0 else [1] * len(lens)
        T = sum(qlens)
        q, k = rnd(T, Hq, layout.k_dim), rnd(T, layout.kv_heads, layout.k_dim)
        v = None if layout.shared_kv else rnd(T, layout.kv_heads, layout.v_dim)
        out = cache.attend(0, q, k, v, ForwardBatch.build(slots, qlens, ctx, "cuda"), scale)
        start = 0
        err = 0.0
        for i, n in enumerate(qlens):
            kv_all[i].append((k[start : start + n], (k[start : start + n, :, : layout.v_dim] if v is None else v[start : start + n])))
            keys = torch.cat([a for a, _ in kv_all[i]])
            vals = torch.cat([b for _, b in kv_all[i]])
            ref = _reference(q[start + n - 1], keys, vals, scale)
            err = max(err, (out[start + n - 1].double() - ref).abs().max().item())
            start += n
            ctx[i] += n
        for s in slots:
            cache.sequence(s).check_invariants()
        errs.append(err)
    return errs, cache, slots


@pytest.mark.parametrize("layout", [QWEN3, MLA], ids=["gqa-32-4", "mla"])
@pytest.mark.parametrize("policy", ["gpu", "cpu", "static:0.5", "monolithic:0.5", "monolithic:0"])
def test_split_decode_on_cuda_matches_float64(layout, policy):
    lay, Hq = layout
    # fp32: exact up to summation order. window 16: several evictions through the side stream.
    errs, cache, _ = _drive(lay, Hq, parse_policy(policy), [1, 300, 4097], 40, torch.float32, 16)
    assert max(errs) < 2e-5, errs
    assert cache.evicted_blocks >= 3
    cache.close()


def test_bf16_split_error_within_bf16_rounding():
    lay, Hq = QWEN3
    errs, cache, _ = _drive(lay, Hq, StaticPolicy(0.5), [17, 2049], 20, torch.bfloat16, 256)
    # values ~N(0,1): bf16 storage of q, k, v and output rounding ~ 2^-8 relative
    assert max(errs) < 3e-2, errs
    cache.close()


def test_load_region_is_pinned_and_unregistered_on_free(monkeypatch):
    monkeypatch.setenv("WRITESCOPE_PINNED_POOL", "0")  # no pool: freeing unregisters at once
    lay, Hq = QWEN3
    _, cache, slots = _drive(lay, Hq, StaticPolicy(0.5), [64 * 10], 2, torch.bfloat16, 64)
    seq = cache.sequence(slots[0])
    assert seq.slabs and all(s.tensor.is_pinned() for s in seq.slabs)
    assert not seq.compute.is_pinned()  # the compute region stays pageable
    homes = {r for r, _ in seq.homes}
    assert homes == {COMPUTE, LOAD}
    slab = seq.slabs[0].tensor
    cache.free(slots[0])
    assert not slab.is_pinned()
    cache.close()


def test_freed_load_region_is_lent_again_registered(monkeypatch):
    """With the pool (the default), a freed request's slabs stay registered and the next request
    of the same shape gets the same pages without registering anything; its results stay exact."""
    from writescope.kvcache import pinned

    monkeypatch.setenv("WRITESCOPE_PINNED_POOL", "1GiB")
    pinned.POOL.release_idle()
    lay, Hq = QWEN3
    errs, cache, slots = _drive(lay, Hq, StaticPolicy(0.5), [64 * 10], 2, torch.bfloat16, 64)
    cache.free(slots[0])
    cache.close()
    idle = {b.ptr for b in pinned.POOL._idle}
    assert idle and pinned.POOL.idle_bytes > 0
    before = dict(pinned.STATS)
    errs2, cache2, slots2 = _drive(lay, Hq, StaticPolicy(0.5), [64 * 10], 2, torch.bfloat16, 64, seed=1)
    seq2 = cache2.sequence(slots2[0])
    assert {s.tensor.data_ptr() for s in seq2.slabs} <= idle  # the same pages, not registered again
    assert all(s.tensor.is_pinned() for s in seq2.slabs)
    assert pinned.STATS["reused"] > before["reused"]
    assert max(errs2) < 3e-2 and max(errs) < 3e-2  # stale KV of the first request is never read
    cache2.free(slots2[0])
    cache2.close()
    assert pinned.POOL.release_idle() > 0


def test_exact_sized_registration_round_trip(monkeypatch):
    from writescope.kvcache import pinned

    monkeypatch.setenv("WRITESCOPE_PINNED_POOL", "0")
    before = dict(pinned.STATS)
    t = host_empty((3, 1000, 7), torch.bfloat16, pin=True)
    assert t.is_pinned() and t.shape == (3, 1000, 7)
    span = -(-3 * 1000 * 7 * 2 // pinned.PAGE) * pinned.PAGE
    assert pinned.STATS["register_bytes"] - before["register_bytes"] == span
    src = torch.randn(3, 1000, 7, device="cuda").bfloat16()
    t.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t, src.cpu())
    unpin(t)
    assert not t.is_pinned()
    assert pinned.STATS["unregister_bytes"] - before["unregister_bytes"] == span  # counted once: unpin is idempotent
    unpin(t)
    assert pinned.STATS["unregister_bytes"] - before["unregister_bytes"] == span


def test_pingpong_copies_overlap_attention():
    """The copy stream's host-to-device copies run while the compute stream attends: with
    buffers large enough that a copy (~2.4 ms for 128 MiB) outlasts issuing the next fill (about
    0.8 ms of Python per fill on the H200 host; 32 MiB fills, 0.6 ms copies, were too short to
    show it), the kernels of fill i run during the copy of fill i+1 in the device timeline."""
    from torch.profiler import ProfilerActivity, profile

    lay, Hq = QWEN3
    n = 65536
    spec = PartitionSpec(lay, 1, torch.bfloat16, window=256, pingpong_bytes=128 * 2**20)
    cache = InplaceKVCache(spec, StaticPolicy(0.0), "cuda", cpu_threads=4)
    slots = [cache.allocate(n + 4, prompt_len=n) for _ in range(4)]
    for s in slots:
        q, k, v = (torch.randn(n, h, 128, device="cuda", dtype=torch.bfloat16) for h in (Hq, 4, 4))
        cache.attend(0, q, k, v, ForwardBatch.build([s], [n], [0], "cuda"), 0.088)
    q, k, v = (torch.randn(4, h, 128, device="cuda", dtype=torch.bfloat16) for h in (Hq, 4, 4))
    batch = ForwardBatch.build(slots, [1] * 4, [n] * 4, "cuda")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cache.attend(0, q, k, v, batch, 0.088)
        torch.cuda.synchronize()
    ev = [e for e in prof.events() if e.device_type.name == "CUDA"]
    copies = [(e.time_range.start, e.time_range.end) for e in ev if "Memcpy HtoD" in e.name]
    kernels = [(e.time_range.start, e.time_range.end) for e in ev if "Memcpy" not in e.name and "Memset" not in e.name]
    assert len(copies) >= 4, [e.name for e in ev][:20]  # 4 x 64K tokens x 2 KiB = 4 fills of 128 MiB
    overlaps = sum(any(ks < ce and cs < ke for ks, ke in kernels) for cs, ce in copies)
    assert overlaps >= 2, (overlaps, copies)
    cache.close()


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_policies_give_resident_tokens_on_cuda(name):
    from writescope import LLM, SamplingParams

    prompts = [list(range(5, 5 + n)) for n in (90, 33, 5)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    tokens = {}
    for policy in ["resident", "gpu", "cpu", "static:0.5", "monolithic:0.5"]:
        llm = LLM(name, device="cuda", dtype="fp32", progress=False, policy=policy, window=16, prefill_chunk_tokens=40)
        tokens[policy] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        assert llm.cache.active_slots == []
    assert all(t == tokens["resident"] for t in tokens.values()), tokens


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_load_region_read_in_place_on_cuda(name, monkeypatch):
    """WRITESCOPE_LOAD_READ=in-place: the Triton fills read CUDA views of the pinned slabs over
    PCIe; the same tokens as resident in fp32, no ping-pong buffers, and a view reads the
    host's bytes."""
    from writescope import LLM, SamplingParams
    from writescope.kvcache.pinned import device_view

    host = host_empty((3, 257), torch.bfloat16, pin=True)
    host.copy_(torch.randn(3, 257).bfloat16())
    view = device_view(host, torch.device("cuda"))
    assert view.is_cuda and torch.equal((view.float() * 2).cpu(), host.float() * 2)
    with pytest.raises(ValueError, match="page-locked"):
        device_view(torch.zeros(4), torch.device("cuda"))
    del view
    unpin(host)
    prompts = [list(range(5, 5 + n)) for n in (90, 33, 5)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in LLM(name, device="cuda", dtype="fp32", progress=False, policy="resident").generate(
        prompt_token_ids=prompts, sampling_params=params)]
    monkeypatch.setenv("WRITESCOPE_LOAD_READ", "in-place")
    for policy in ["gpu", "static:0.5", "monolithic:0.5"]:
        llm = LLM(name, device="cuda", dtype="fp32", progress=False, policy=policy, window=16, prefill_chunk_tokens=40)
        assert [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)] == ref, policy
        assert llm.cache.decoder.in_place and llm.cache.decoder._buffers == []
        assert llm.cache.active_slots == []


def test_host_hand_offs_do_not_wait_for_the_device():
    """q to the host and the CPU partial back are issued behind queued device work without the
    calling thread waiting for it (a waiting copy would drain the queue every layer)."""
    from writescope.attention.split import SplitDecoder

    spec = PartitionSpec(KVLayout(4, 128, 128, False), 1, torch.bfloat16, window=16)
    dec = SplitDecoder(spec, torch.device("cuda"))
    try:
        q = torch.randn(4, 32, 128, device="cuda", dtype=torch.bfloat16)
        o = torch.randn(4, 4, 8, 144)[..., :128]  # strided, as MLA's partial cut from the latent
        dec._to_host(q)[1].synchronize()  # warm the pinned allocator: no cudaHostAlloc behind the sleeps
        dec._to_device(o)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # about 0.1 s of device time ahead of the copies
        q_host, ready = dec._to_host(q)
        stream = torch.cuda.current_stream()
        assert q_host.is_pinned() and not ready.query() and not stream.query()  # returned while the device is still busy
        ready.synchronize()
        assert torch.equal(q_host, q.cpu())
        torch.cuda._sleep(200_000_000)
        o_dev = dec._to_device(o)
        assert not stream.query()  # the copy is queued, not waited for
        torch.cuda.synchronize()
        assert torch.equal(o_dev.cpu(), o)
    finally:
        dec.close()


def _layers_outputs(layout, Hq, policy, buffers: int, copies: str, monkeypatch, delay_early: bool = False):
    """Three layers, ragged prompts, 20 decode steps (windows evicted into the load region), ping-pong
    buffers of 3 blocks; every layer's outputs of every step, in order."""
    from writescope.attention.split import SplitDecoder

    monkeypatch.setenv("WRITESCOPE_LOAD_COPIES", copies)
    if delay_early:  # the early copies land late: a missing wait for them shows as other outputs
        real = SplitDecoder._copy_early

        def late(self, *a, **k):
            with torch.cuda.stream(self.copy_stream):
                torch.cuda._sleep(5_000_000)
            return real(self, *a, **k)

        monkeypatch.setattr(SplitDecoder, "_copy_early", late)
    D, dtype = 16, torch.bfloat16
    block = PartitionSpec(layout, 3, dtype, window=D).block_bytes
    spec = PartitionSpec(layout, 3, dtype, window=D, pingpong_buffers=buffers, pingpong_bytes=3 * block)
    cache = InplaceKVCache(spec, policy, "cuda", cpu_threads=2)
    g = torch.Generator(device="cuda").manual_seed(1)
    lens = [21 * D + 3, 17, 9 * D]
    slots = [cache.allocate(n + 20, prompt_len=n) for n in lens]
    outs, ctx = [], [0] * len(lens)
    try:
        for step in range(21):
            qlens = lens if step == 0 else [1] * len(lens)
            T = sum(qlens)
            batch = ForwardBatch.build(slots, qlens, ctx, "cuda")
            for layer in range(3):
                q = torch.randn(T, Hq, layout.k_dim, device="cuda", dtype=dtype, generator=g)
                k = torch.randn(T, layout.kv_heads, layout.k_dim, device="cuda", dtype=dtype, generator=g)
                v = None if layout.shared_kv else torch.randn(T, layout.kv_heads, layout.v_dim, device="cuda", dtype=dtype, generator=g)
                outs.append(cache.attend(layer, q, k, v, batch, layout.k_dim**-0.5).float())
            ctx = [c + n for c, n in zip(ctx, qlens)]
        torch.cuda.synchronize()
        return outs, cache.decoder.stats
    finally:
        for s in slots:
            cache.free(s)
        cache.close()


@pytest.mark.parametrize("layout", [QWEN3, MLA], ids=["gqa-32-4", "mla"])
@pytest.mark.parametrize("buffers", [1, 2, 3])
@pytest.mark.parametrize("policy", ["gpu", "static:0.5"])
def test_early_copies_give_the_same_outputs_on_cuda(layout, buffers, policy, monkeypatch):
    """WRITESCOPE_LOAD_COPIES=early on CUDA with several fills a layer (buffers of 3 blocks, 1-3 of
    them), the early copies held back on the copy stream: the same outputs bit for bit as copying
    in each layer. A missing wait for an early copy (its ready event) would read the buffer's old
    fill; a copy not waiting for the buffer's last reader would overwrite a fill still being read."""
    lay, Hq = layout
    pol = parse_policy(policy)
    want, st0 = _layers_outputs(lay, Hq, pol, buffers, "own-layer", monkeypatch)
    got, st = _layers_outputs(lay, Hq, pol, buffers, "early", monkeypatch, delay_early=True)
    assert st0.early_fills == 0 and st.early_fills >= 20 * 2  # every decode step's layers 1 and 2
    assert st.early_fills_wasted == 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} (step {i // 3}, layer {i % 3}) differs"
