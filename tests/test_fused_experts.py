"""The fused decode experts (writescope/moe/fused_decode.py) against float64, and in the block.

The kernels' checks run in a subprocess under Triton's interpreter on the CPU (fp16: numpy has
no bf16) where Triton is installed, and on CUDA in bf16 (marked ``gpu``). Cases: widths that are
not multiples of the tiles (D 80, I 48), an expert with no rows, one with more rows than a tile
(20 > BLOCK_M 16), host experts (slot G) skipped, 1 to 17 tokens. Tolerance: relative norm error
<= 1e-2 for 16-bit inputs (the SiLU x up product is rounded once to the input dtype, as the
grouped path rounds its GEMM outputs).
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import interpreter_unusable, run_under_interpreter

TOL = 1e-2


def reference(x, weights, ids, slot_of, w13, w2, inter):
    """float64 sum over each token's device experts of weight x down(silu(gate x) * up x)."""
    G = w13.shape[0]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            g = int(slot_of[ids[t, k]])
            if g >= G:
                continue
            h = w13[g].double().cpu() @ x[t].double().cpu()
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, k]) * (w2[g].double().cpu() @ a)
    return out


def case(T, K, device, dtype, gen, D=80, inter=48, G=5):
    """Experts 0..6 in slots [0, 1, G, 2, 3, G, 4] (2 and 5 on the host); expert 4 (slot 3) is
    never routed (an empty group); with T >= 17 every token routes to expert 0 (20 rows > a tile)."""
    x = torch.randn(T, D, generator=gen).to(device, dtype)
    w13 = (torch.randn(G, 2 * inter, D, generator=gen) / D**0.5).to(device, dtype)
    w2 = (torch.randn(G, D, inter, generator=gen) / inter**0.5).to(device, dtype)
    slot_of = torch.tensor([0, 1, G, 2, 3, G, 4], dtype=torch.long).to(device)
    choices = torch.tensor([0, 1, 2, 3, 5, 6])
    rows = []
    for _ in range(T):
        perm = choices[torch.randperm(len(choices), generator=gen)].tolist()
        rows.append(([0] + [c for c in perm if c != 0])[:K] if T >= 17 else perm[:K])
    ids = torch.tensor(rows, dtype=torch.long)
    weights = torch.rand(T, K, generator=gen).softmax(-1)
    return x, weights.to(device), ids.to(device), slot_of, w13, w2, inter


def check_fused(device: str, dtype: torch.dtype) -> None:
    from writescope.moe.fused_decode import fused_experts_into

    gen = torch.Generator().manual_seed(3)
    for T, K in ((1, 2), (3, 3), (20, 2)):
        x, w, ids, slot_of, w13, w2, inter = case(T, K, device, dtype, gen)
        out = torch.zeros(x.shape, dtype=torch.float32, device=device)
        fused_experts_into(x, w, ids, slot_of, w13, w2, inter, out)
        ref = reference(x, w, ids, slot_of, w13, w2, inter)
        err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert err <= TOL, (T, K, err)
        before = out.clone()  # accumulates into what is there
        fused_experts_into(x, w, ids, slot_of, w13, w2, inter, out)
        torch.testing.assert_close(out, 2 * before, rtol=1e-5, atol=1e-6)


def check_block_in_place(device: str, dtype: torch.dtype) -> None:
    """A MoE block (tiny-qwen3-moe's and tiny-deepseek-v2's shapes) with some experts on the host
    and every hit one streamed (stream_share 1): with WRITESCOPE_MOE_KERNEL=fused its decode
    forward reads them in place in the fused kernels, gives the grouped path's output within
    TOL, and has a graph key (nothing read back to the host)."""
    from writescope.engine.model_loader import resolve_config
    from writescope.moe import fused_decode
    from writescope.moe.block import SparseMoeBlock

    for name in ("tiny-qwen3-moe", "tiny-deepseek-v2"):
        cfg, _ = resolve_config(name)
        torch.manual_seed(0)
        block = SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=cfg.model_type == "deepseek_v2").to(device, dtype)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.05)
        E = cfg.moe.num_experts
        for host in (range(1, E, 3), range(E)):  # some experts on the host; all of them
            block.offload_experts(host)
            block.pack()
            block.stream_share = 1.0
            x = torch.randn(5, cfg.hidden_size, device=device).to(dtype)
            os.environ["WRITESCOPE_MOE_KERNEL"] = "grouped"
            assert block.graph_key() is None  # the grouped path reads routing back for its host experts
            with torch.no_grad():
                ref = block(x).double()
            os.environ["WRITESCOPE_MOE_KERNEL"] = "fused"
            assert block.graph_key(x.shape[0]) is not None
            calls = {"fused": 0}
            real_fused, real_split = fused_decode.fused_experts_into, block._split_forward

            def count(*a, **k):
                calls["fused"] += 1
                return real_fused(*a, **k)

            def refuse(*a, **k):
                raise AssertionError("the in-place path read routing back to the host (_split_forward)")

            fused_decode.fused_experts_into, block._split_forward = count, refuse
            try:
                with torch.no_grad():
                    got = block(x).double()
            finally:
                fused_decode.fused_experts_into = real_fused
                del block._split_forward
            assert calls["fused"] == (1 if len(host) == E else 2), calls  # the host pack (and the device pack)
            err = ((got - ref).norm() / ref.norm()).item()
            assert err <= TOL, (name, len(host), err)
        os.environ.pop("WRITESCOPE_MOE_KERNEL")


@pytest.mark.skipif(interpreter_unusable() is not None, reason=str(interpreter_unusable()))
def test_fused_experts_under_the_interpreter():
    code = "import torch, tests.test_fused_experts as t\nt.check_fused('cpu', torch.float16)\nt.check_block_in_place('cpu', torch.float16)\n"
    run_under_interpreter(code, timeout=900)


def test_the_switch_is_checked_and_on_by_default(monkeypatch):
    from writescope.moe import fused_decode

    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    monkeypatch.delenv("WRITESCOPE_MOE_KERNEL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert fused_decode.env_fused()  # default: fused
    assert not fused_decode.wanted(x, 4)  # but never for CPU tensors outside the interpreter
    monkeypatch.setenv("WRITESCOPE_MOE_KERNEL", "grouped")
    assert not fused_decode.env_fused()
    assert not fused_decode.wanted_for(torch.bfloat16, torch.device("cuda"), 4)
    monkeypatch.setenv("WRITESCOPE_MOE_KERNEL", "fast")
    with pytest.raises(ValueError, match="WRITESCOPE_MOE_KERNEL='fast': use 'fused' \\(the default\\) or 'grouped'"):
        fused_decode.wanted(x, 4)
    monkeypatch.setenv("WRITESCOPE_MOE_KERNEL", "fused")
    assert not fused_decode.wanted(x.float(), 4)  # fp32: grouped
    assert not fused_decode.wanted(x, fused_decode.MAX_ROWS + 1)  # prefill-sized: grouped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_experts_on_cuda(monkeypatch):
    """bf16 on CUDA: the kernels against float64; then a whole model's teacher-forced decode logits
    with WRITESCOPE_MOE_KERNEL=fused against the grouped path (CUDA graphs on): finite, and the
    median (step, sequence) row within 3% of the logits' scale (a router near-tie may move a
    row further: the two paths round differently)."""
    check_fused("cuda", torch.bfloat16)
    check_block_in_place("cuda", torch.bfloat16)  # the host experts' pack read over PCIe
    from writescope import LLM
    from writescope.attention.metadata import ForwardBatch

    prompts, steps = [[5 + i % 50 for i in range(n)] for n in (40, 17, 3)], 6
    logits = {}
    for mode in ("grouped", "fused"):
        monkeypatch.setenv("WRITESCOPE_MOE_KERNEL", mode)
        llm = LLM("tiny-qwen3-moe", device="cuda", dtype="bf16", progress=False, policy="resident")
        cache, model = llm.cache, llm.model
        slots = [cache.allocate(len(p) + steps + 1, prompt_len=len(p)) for p in prompts]
        rows = []
        with torch.inference_mode():
            batch = ForwardBatch.build(slots, [len(p) for p in prompts], [0] * len(prompts), "cuda")
            model(torch.tensor([t for p in prompts for t in p], device="cuda"), batch, cache)
            for s in range(steps):
                batch = ForwardBatch.build(slots, [1] * len(prompts), [len(p) + s for p in prompts], "cuda")
                ids = torch.tensor([3 + (7 * s + 11 * i) % 1000 for i in range(len(prompts))], device="cuda")
                rows.append(model(ids, batch, cache).float().clone())
        for slot in slots:
            cache.free(slot)
        logits[mode] = torch.stack(rows)
    scale = logits["grouped"].abs().max().item()
    per_row = (logits["fused"] - logits["grouped"]).abs().amax(-1).flatten()
    assert torch.isfinite(logits["fused"]).all()
    assert per_row.median().item() <= 0.03 * scale, (per_row.tolist(), scale)
