"""The Triton decode-attention kernels (attention/gpu_kernel.py) and the fused GPU side of the
split decode (attention/gpu_decode.py) against float64 references.

On CUDA (gpu marker, the H200): bf16, the real path. Elsewhere, where Triton is installed, the
same checks run once in a subprocess under Triton's interpreter (``TRITON_INTERPRET=1``, CPU
tensors, fp16: the interpreter computes bf16 dot products on the raw bits). CI's CPU torch has no
Triton: there the torch path stands in (tests/test_split_attention.py) and these are skipped.

Tolerances (values ~N(0, 1), scores scaled by dk^-0.5): the kernels round the probabilities to
the value dtype for P.V, as FlashAttention-2 does; the bound is 4 units of the storage dtype's
rounding at 1 (bf16 2^-8 * 4 = 1.6e-2, fp16 2^-11 * 4 = 2e-3) on the output, lse to 1e-4 relative.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import interpreter_unusable, run_under_interpreter

from writescope.attention.metadata import ForwardBatch
from writescope.config import KVLayout
from writescope.kvcache.inplace import InplaceKVCache
from writescope.kvcache.spec import PartitionSpec
from writescope.scheduler.policies import parse_policy

TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}

# (kv_heads, G, dk, dv, parts): MLA's latent, Qwen3's GQA, G = 1, odd widths
SHAPES = [(1, 16, 576, 512, 1), (4, 8, 128, 128, 2), (2, 4, 64, 64, 2), (3, 1, 24, 24, 2), (1, 3, 48, 32, 1), (2, 17, 40, 40, 2)]


def _ref_partial(q, k, v, scale):
    """float64 (o, lse) of q [G, dk] over k [n, dk], v [n, dv]; (0, -inf) for n = 0."""
    if k.shape[0] == 0:
        return torch.zeros(q.shape[0], v.shape[1], dtype=torch.float64), torch.full((q.shape[0],), float("-inf"), dtype=torch.float64)
    s = q.double() @ k.double().T * scale
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v.double(), lse


def _kv(blk, h, parts, dv, n):
    k = blk[0, h, :n]
    return k, (blk[1, h, :n] if parts == 2 else k[:, :dv])


def check_kernels(device: str, dtype: torch.dtype) -> None:
    """Window mode (offsets, lengths 0..D), fill mode (sequence ids), merge with load and CPU
    partials, empty sequences and NaN propagation, for every shape in SHAPES."""
    from writescope.attention import gpu_kernel as gk

    g = torch.Generator().manual_seed(0)
    for Hkv, G, dk, dv, parts in SHAPES:
        D = 64
        dim = dk
        lens = [0, 1, 15, 16, 17, D - 1, D]
        B = len(lens)
        scale = dk**-0.5
        q = torch.randn(B, Hkv, G, dk, generator=g).to(dtype)
        dev = lambda t: t.to(device)  # noqa: E731
        # gaps between the windows: offsets, not a stride (made on the device: .to() would make a
        # strided tensor contiguous, and offsets taken before the move would point elsewhere)
        win_dev = dev(torch.randn(B, 2, parts, Hkv, D, dim, generator=g).to(dtype))[:, 0]
        win = win_dev.cpu()
        offs = torch.tensor([(w.data_ptr() - win_dev.data_ptr()) // win_dev.element_size() for w in win_dev], dtype=torch.int64)
        o_w, l_w = dev(torch.empty(B, Hkv, G, dv)), dev(torch.empty(B, Hkv, G))
        gk.block_partials_into(dev(q), win_dev, parts, dv, scale, o_w, l_w, offsets=dev(offs), lengths=dev(torch.tensor(lens, dtype=torch.int32)),
                               window=D)
        tol = TOL[dtype]
        ref_w = [[_ref_partial(q[b, h], *_kv(win[b], h, parts, dv, lens[b]), scale) for h in range(Hkv)] for b in range(B)]
        for b in range(B):
            for h in range(Hkv):
                ro, rl = ref_w[b][h]
                assert (o_w[b, h].cpu().double() - ro).abs().max() <= tol, (Hkv, G, dk, lens[b])
                if lens[b] == 0:
                    assert torch.isneginf(l_w[b, h].cpu()).all()
                else:
                    assert torch.allclose(l_w[b, h].cpu().double(), rl, rtol=1e-4, atol=1e-4)
        # fill mode: blocks of sequences 1, 1, 3, 5, 5, 5 (sequence 0, 2, 4, 6 have none)
        seq_of = [1, 1, 3, 5, 5, 5]
        P = len(seq_of)
        fill = torch.randn(P, parts, Hkv, D, dim, generator=g).to(dtype)
        o_l, l_l = dev(torch.empty(P + 2, Hkv, G, dv)), dev(torch.empty(P + 2, Hkv, G))
        seq_t = dev(torch.tensor([0, 0] + seq_of, dtype=torch.int32))
        gk.block_partials_into(dev(q), dev(fill[:4]), parts, dv, scale, o_l, l_l, out_base=2, seq=seq_t)  # two fills
        gk.block_partials_into(dev(q), dev(fill[4:]), parts, dv, scale, o_l, l_l, out_base=6, seq=seq_t)
        for j, b in enumerate(seq_of):
            for h in range(Hkv):
                ro, rl = _ref_partial(q[b, h], *_kv(fill[j], h, parts, dv, D), scale)
                assert (o_l[2 + j, h].cpu().double() - ro).abs().max() <= tol
                assert torch.allclose(l_l[2 + j, h].cpu().double(), rl, rtol=1e-4, atol=1e-4)
        # merge: window + load rows 2.. (CSR) + a CPU partial (row 4's empty)
        starts = torch.tensor([2, 2, 4, 4, 5, 5, 8, 8], dtype=torch.int64)
        o_c = torch.randn(B, Hkv, G, dv + 3, generator=g)[..., :dv]  # strided, as a view of a wider buffer
        l_c = torch.randn(B, Hkv, G, generator=g)
        l_c[4] = float("-inf")
        o_c[4] = 0
        for cpu in (None, (o_c, l_c)):
            out = dev(torch.empty(B, Hkv * G, dv, dtype=dtype))
            gk.merge_into(out, (o_w, l_w), (o_l, l_l), dev(starts), None if cpu is None else (dev(cpu[0]), dev(cpu[1])))
            for b in range(B):
                os_, ls = [o_w[b].cpu().double()], [l_w[b].cpu().double()]
                for j in range(int(starts[b]), int(starts[b + 1])):
                    os_.append(o_l[j].cpu().double())
                    ls.append(l_l[j].cpu().double())
                if cpu is not None:
                    os_.append(cpu[0][b].double())
                    ls.append(cpu[1][b].double())
                L = torch.stack(ls)  # [p, Hkv, G]
                m = L.amax(0)
                m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
                w = torch.exp(L - m)
                tot = w.sum(0)
                ref = (w.unsqueeze(-1) * torch.stack(os_)).sum(0) / torch.where(tot > 0, tot, 1).unsqueeze(-1)
                got = out[b].cpu().double().view(Hkv, G, dv)
                assert (got - ref).abs().max() <= 2 ** -7 * max(1.0, ref.abs().max().item()), (b, cpu is None)
            if cpu is None:
                assert (out[0].cpu() == 0).all()  # sequence 0: empty window, no load blocks
        # a NaN CPU partial (a failed job) shows in its row only
        bad = l_c.clone()
        bad[2] = float("nan")
        out = dev(torch.empty(B, Hkv * G, dv, dtype=dtype))
        gk.merge_into(out, (o_w, l_w), (o_l, l_l), dev(starts), (dev(o_c), dev(bad)))
        assert torch.isnan(out[2].cpu()).all() and not torch.isnan(out[3].cpu()).any()


def _drive(device, dtype, layout, Hq, policy, lens, steps, window, layers=2):
    """Prefill then decode over ``layers`` layers; per decode step the max abs error vs float64
    of the last layer's output, and the cache."""
    g = torch.Generator().manual_seed(1)
    spec = PartitionSpec(layout, layers, dtype, window=window, pingpong_bytes=3 * window * 2 * layout.kv_heads * layout.k_dim * 2)
    cache = InplaceKVCache(spec, parse_policy(policy), device, cpu_threads=2)
    slots = [cache.allocate(n + steps, prompt_len=n) for n in lens]
    keys = [[] for _ in lens]
    vals = [[] for _ in lens]
    scale = layout.k_dim**-0.5
    errs, ctx = [], [0] * len(lens)
    for step in range(steps + 1):
        qlens = lens if step == 0 else [1] * len(lens)
        T = sum(qlens)
        batch = ForwardBatch.build(slots, qlens, ctx, device)
        err = 0.0
        for layer in range(layers):
            q = torch.randn(T, Hq, layout.k_dim, generator=g).to(dtype)
            k = torch.randn(T, layout.kv_heads, layout.k_dim, generator=g).to(dtype)
            v = None if layout.shared_kv else torch.randn(T, layout.kv_heads, layout.v_dim, generator=g).to(dtype)
            out = cache.attend(layer, q.to(device), k.to(device), None if v is None else v.to(device), batch, scale).cpu()
            if layer == layers - 1:
                start = 0
                for i, n in enumerate(qlens):
                    keys[i].append(k[start : start + n])
                    vals[i].append(k[start : start + n, :, : layout.v_dim] if v is None else v[start : start + n])
                    if step > 0:
                        kk, vv = torch.cat(keys[i]), torch.cat(vals[i])
                        Hkv, G = layout.kv_heads, Hq // layout.kv_heads
                        for h in range(Hkv):
                            ro, _ = _ref_partial(q[start, h * G : (h + 1) * G], kk[:, h], vv[:, h], scale)
                            err = max(err, (out[start, h * G : (h + 1) * G].double() - ro).abs().max().item())
                    start += n
        ctx = [c + n for c, n in zip(ctx, qlens)]
        if step > 0:
            errs.append(err)
    return errs, cache


def check_decoder(device: str, dtype: torch.dtype) -> None:
    """The split decode through the Triton launches: every policy within the tolerance of
    float64 over ragged lengths (empty load regions, exact multiples of D), with evictions;
    the step's metadata built once per step, not per layer."""
    import os

    for load_read in ("copy", "in-place"):  # WRITESCOPE_LOAD_READ: in place, one launch per layer for all load blocks
        os.environ["WRITESCOPE_LOAD_READ"] = load_read
        try:
            for layout, Hq in ((KVLayout(2, 64, 64, False), 8), (KVLayout(1, 48, 32, True), 4)):
                for policy in ("gpu", "cpu", "static:0.5", "monolithic:0.5"):
                    errs, cache = _drive(device, dtype, layout, Hq, policy, [1, 15, 16, 17, 70], 20, 16, layers=3)
                    gpu = cache.decoder.gpu
                    assert gpu is not None, "the Triton path was not taken"
                    assert cache.decoder.in_place == (load_read == "in-place")
                    assert max(errs) <= TOL[dtype], (load_read, policy, errs)
                    assert gpu.plans_built <= 21, f"{policy}: {gpu.plans_built} plans for 21 steps of 3 layers"
                    assert cache.evicted_blocks >= 3
                    if load_read == "in-place" and policy in ("gpu", "static:0.5"):
                        assert any(p.load_offs is not None for p in gpu.plans.values()), "no one-launch load plan"
                    cache.close()
        finally:
            os.environ.pop("WRITESCOPE_LOAD_READ", None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_on_cuda_match_float64():
    check_kernels("cuda", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_split_decode_on_cuda_matches_float64():
    check_decoder("cuda", torch.bfloat16)


@pytest.mark.skipif(interpreter_unusable() is not None, reason=str(interpreter_unusable()))
def test_triton_kernels_under_the_interpreter():
    code = (
        "import torch, tests.test_gpu_kernel as t\n"
        "t.check_kernels('cpu', torch.float16)\n"
        "t.check_decoder('cpu', torch.float16)\n"
    )
    run_under_interpreter(code, timeout=1500)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["gpu", "static:0.5"])
def test_decode_layers_never_wait_for_the_device(policy):
    """Decode steps between evictions issue every layer without a host synchronisation (torch's
    sync debug mode raises on one): the window, load-region and merge launches, the streaming
    copies, q to the native worker and its partial back. (An eviction into the compute region is
    drained at the layer's next step through an event wait, already complete in steady state;
    the engine's sampling waits once per step, outside the layers.)"""
    layout, Hq, D, layers = KVLayout(2, 64, 64, False), 8, 64, 3
    spec = PartitionSpec(layout, layers, torch.bfloat16, window=D, pingpong_bytes=2 * D * 2 * 2 * 64 * 2)
    cache = InplaceKVCache(spec, parse_policy(policy), "cuda", cpu_threads=2)
    cache.warm_up(Hq)
    lens = [D * 5 + 1, D * 3 + 1, 1]  # windows far from full: no eviction in the measured steps
    slots = [cache.allocate(n + 40, prompt_len=n) for n in lens]
    try:
        dev = "cuda"
        ctx = [0] * len(lens)

        def step(qlens):
            T = sum(qlens)
            batch = ForwardBatch.build(slots, qlens, ctx, dev)
            inputs = [(torch.randn(T, Hq, 64, device=dev, dtype=torch.bfloat16), torch.randn(T, 2, 64, device=dev, dtype=torch.bfloat16),
                       torch.randn(T, 2, 64, device=dev, dtype=torch.bfloat16)) for _ in range(layers)]
            torch.cuda.synchronize()
            return batch, inputs

        def run(batch, inputs):
            return [cache.attend(layer, q, k, v, batch, 64**-0.5) for layer, (q, k, v) in enumerate(inputs)]

        run(*step(lens))  # prefill
        ctx = list(lens)
        for _ in range(3):  # warm: pinned blocks cached, worker started, plan buffers made
            run(*step([1] * len(lens)))
            ctx = [c + 1 for c in ctx]
        torch.cuda.synchronize()
        for _ in range(5):
            batch, inputs = step([1] * len(lens))
            torch.cuda.set_sync_debug_mode("error")
            try:
                outs = run(batch, inputs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            ctx = [c + 1 for c in ctx]
            assert all(torch.isfinite(o).all() for o in outs)
        assert cache.decoder.gpu is not None and cache.decoder.stats.streamed_copies > 0
    finally:
        cache.close()
