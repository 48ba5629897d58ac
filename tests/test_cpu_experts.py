"""The host-expert kernel (writescope.moe.cpu_experts) against float64 SwiGLU experts.

Tolerance, bf16: the relative Frobenius-norm error of the kernel's y against the float64
reference is at most twice what torch's own bf16 ``GatedMLP`` (the old path, times the routing
weight in bf16) errs against the same reference on the same inputs, plus a floor of 1e-4.
fp32 (portable path): relative-norm error at most 1e-5. Paths: ``portable``, ``avx512bf16`` and
``amx-emulated`` (the AMX code with tiles emulated in C++) here; the real ``amx`` path by the tests
marked ``amx`` (run with ``-m amx`` on a CPU with AMX-BF16: they skip without the flag in
/proc/cpuinfo and fail when the flag is there but the path is not offered).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from writescope.layers.mlp import GatedMLP
from writescope.moe import cpu_experts
from writescope.moe.block import SparseMoeBlock
from writescope.moe.router import route

COUNTS = [1, 15, 0, 16, 17, 33, 0, 2]  # tokens per expert: ones and tails of 16-token blocks, empty experts
FLOOR = 1e-4


@pytest.fixture(scope="module")
def kernel():
    if not cpu_experts.kernel_available():
        pytest.skip("no C++ compiler for the host-expert kernel")
    return cpu_experts


def cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def needs(path: str, kernel) -> None:
    if path == "portable":
        return
    if path in ("avx512bf16", "amx-emulated") and kernel.best_path() == "portable":
        pytest.skip(f"this CPU lacks AVX512-BF16 (needed by {path})")


def experts(E, D, I, dtype, seed=0):
    """Random packed weights ``w13 [E, 2I, D]``, ``w2 [E, D, I]`` (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, D, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, I, generator=g) / I**0.5).to(dtype)
    return w13, w2


def tokens(counts, D, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    return torch.randn(n, D, generator=g).to(dtype), torch.rand(n, generator=g) + 0.1


def reference(x, counts, w13, w2, slots, rw) -> torch.Tensor:
    """The SwiGLU experts in float64: rw * down(silu(gate(x)) * up(x)) per group."""
    I, out, s = w2.shape[2], [], 0
    for c, sl in zip(counts, slots):
        xe = x[s : s + c].double()
        s += c
        h = xe @ w13[sl].double().t()
        out.append((F.silu(h[:, :I]) * h[:, I:]) @ w2[sl].double().t())
    return torch.cat(out) * rw.double()[:, None]


def torch_bf16(x, counts, w13, w2, slots, rw) -> torch.Tensor:
    """The old path: a bf16 GatedMLP per expert (views of the packed weights), times the weight."""
    I, out, s = w2.shape[2], [], 0
    for c, sl in zip(counts, slots):
        mlp = GatedMLP(x.shape[1], I).to(x.dtype)
        mlp.gate_proj.weight.data, mlp.up_proj.weight.data, mlp.down_proj.weight.data = w13[sl, :I], w13[sl, I:], w2[sl]
        with torch.no_grad():
            out.append(mlp(x[s : s + c]))
        s += c
    return torch.cat(out) * rw[:, None].to(x.dtype)


def rel(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def check(kernel, path, D, I, dtype=torch.bfloat16, counts=COUNTS, threads=2):
    """Runs the kernel with ``path`` forced; asserts the tolerance; returns (y, path that ran)."""
    E = len(counts) - 1
    w13, w2 = experts(E, D, I, dtype)
    slots = [i % E for i in range(len(counts))]  # the last group reuses slot 0
    x, rw = tokens(counts, D, dtype)
    y, ran = kernel.host_experts_forward(x, counts, w13, w2, slots, rw, threads=threads, return_path=True)
    assert y.shape == x.shape and y.dtype == dtype
    ref = reference(x, counts, w13, w2, slots, rw)
    err = rel(y, ref)
    if dtype == torch.bfloat16:
        bound = 2 * rel(torch_bf16(x, counts, w13, w2, slots, rw), ref) + FLOOR
    else:
        bound = 1e-5
    assert err <= bound, f"{ran}: relative error {err:.2e} > {bound:.2e}"
    return y, ran


@pytest.mark.parametrize("path", ["portable", "avx512bf16", "amx-emulated"])
@pytest.mark.parametrize("D, I", [(96, 160), (160, 96)])
def test_paths_match_float64(kernel, monkeypatch, path, D, I):
    """Odd multiples of 32 (the AMX path takes them: 3 and 5 steps of 32 inputs), tokens per
    expert 1, 15, 16, 17, 33 and 2, experts with no tokens, one expert twice."""
    needs(path, kernel)
    monkeypatch.setenv(cpu_experts.ENV, path)
    _, ran = check(kernel, path, D, I)
    assert ran == path


@pytest.mark.parametrize("D, I", [(96, 80), (80, 96), (72, 40)])
def test_shapes_amx_cannot_take_fall_back(kernel, monkeypatch, D, I):
    """D or I not a multiple of 32: the AMX path (emulated here) gives way to avx512bf16, which
    takes any width (masked tails), and says so."""
    needs("amx-emulated", kernel)
    monkeypatch.setenv(cpu_experts.ENV, "amx-emulated")
    assert kernel.path_for(torch.bfloat16, D, I) == "avx512bf16"
    _, ran = check(kernel, "amx-emulated", D, I)
    assert ran == "avx512bf16"


@pytest.mark.parametrize("D, I", [(96, 80), (64, 32)])
def test_fp32_runs_the_portable_path(kernel, monkeypatch, D, I):
    monkeypatch.setenv(cpu_experts.ENV, "auto")
    assert kernel.path_for(torch.float32, D, I) == "portable"
    _, ran = check(kernel, "auto", D, I, dtype=torch.float32)
    assert ran == "portable"


@pytest.mark.parametrize("path", ["portable", "avx512bf16", "amx-emulated"])
def test_thread_count_does_not_change_the_result(kernel, monkeypatch, path):
    """Every unit is computed whole by one thread, so the split over threads changes nothing."""
    needs(path, kernel)
    monkeypatch.setenv(cpu_experts.ENV, path)
    w13, w2 = experts(7, 64, 96, torch.bfloat16)
    x, rw = tokens(COUNTS, 64, torch.bfloat16)
    slots = list(range(len(COUNTS)))[:7] + [0]
    ys = [kernel.host_experts_forward(x, COUNTS, w13, w2, slots, rw, threads=t) for t in (1, 3, 5)]
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])


@pytest.mark.parametrize("path", ["portable", "avx512bf16", "amx-emulated"])
def test_the_units_split_from_a_counter_or_equally_give_the_same_bits(kernel, monkeypatch, path):
    """The default split hands out runs of units from a counter; set_split(False) cuts one equal
    range per thread. Each unit is still computed whole by one thread: the same bits, over odd
    widths and token counts, and thread counts above the units' runs."""
    needs(path, kernel)
    monkeypatch.setenv(cpu_experts.ENV, path)
    ext = kernel._ext()
    w13, w2 = experts(7, 96, 160, torch.bfloat16)
    x, rw = tokens(COUNTS, 96, torch.bfloat16)
    slots = list(range(len(COUNTS)))[:7] + [0]
    assert ext.set_split(True) is True  # the default
    try:
        for t in (1, 3, 5, 64):
            dynamic = kernel.host_experts_forward(x, COUNTS, w13, w2, slots, rw, threads=t)
            ext.set_split(False)
            equal = kernel.host_experts_forward(x, COUNTS, w13, w2, slots, rw, threads=t)
            ext.set_split(True)
            assert torch.equal(dynamic, equal), t
    finally:
        ext.set_split(True)
    check(kernel, path, 96, 160, threads=5)


@pytest.mark.parametrize("path", ["portable", "avx512bf16", "amx-emulated"])
def test_nan_stays_in_its_token(kernel, monkeypatch, path):
    """A NaN in one input token makes that token's output NaN and no other (token blocks are
    shared in the AMX tiles and the AVX accumulators: columns must not mix)."""
    needs(path, kernel)
    monkeypatch.setenv(cpu_experts.ENV, path)
    counts = [3, 17]
    w13, w2 = experts(2, 64, 64, torch.bfloat16)
    x, rw = tokens(counts, 64, torch.bfloat16)
    bad = [1, 3 + 16]  # a row inside a block of 3, the 17th token (a block of its own)
    x[bad[0], 5] = float("nan")
    x[bad[1], 63] = float("nan")
    y = kernel.host_experts_forward(x, counts, w13, w2, [0, 1], rw, threads=2)
    nan_rows = torch.isnan(y).any(dim=1)
    assert nan_rows.tolist() == [i in bad for i in range(sum(counts))]
    assert torch.isnan(y[bad]).all()
    good = [i for i in range(sum(counts)) if i not in bad]
    ref = reference(x, counts, w13, w2, [0, 1], rw)[good]
    assert rel(y[good], ref) < 1e-2


def test_no_tokens_gives_an_empty_result(kernel):
    w13, w2 = experts(2, 64, 32, torch.bfloat16)
    y = kernel.host_experts_forward(torch.empty(0, 64, dtype=torch.bfloat16), [0, 0], w13, w2, [0, 1], torch.empty(0))
    assert y.shape == (0, 64)


def test_bad_inputs_raise_clear_errors(kernel, monkeypatch):
    w13, w2 = experts(3, 64, 48, torch.bfloat16)  # [3, 96, 64], [3, 64, 48]
    x, rw = tokens([2, 1], 64, torch.bfloat16)
    f = kernel.host_experts_forward
    with pytest.raises(ValueError, match="bf16 or fp32.*float16"):
        f(x.half(), [2, 1], w13.half(), w2.half(), [0, 1], rw)
    with pytest.raises(ValueError, match="one dtype.*float32"):
        f(x, [2, 1], w13.float(), w2, [0, 1], rw)
    with pytest.raises(ValueError, match=r"shapes do not match: x \[3, 64\], w13 \[3, 64, 96\] \(want \[E, 2I, 64\]\)"):
        f(x, [2, 1], w13.transpose(1, 2), w2, [0, 1], rw)
    with pytest.raises(ValueError, match=r"w2 \[3, 48, 64\] \(want \[3, 64, 48\]\)"):
        f(x, [2, 1], w13, w2.transpose(1, 2).contiguous(), [0, 1], rw)
    with pytest.raises(ValueError, match=r"sum to x's 3 rows"):
        f(x, [2, 2], w13, w2, [0, 1], rw)
    with pytest.raises(ValueError, match=r"slots \[3\] outside \[0, 3\)"):
        f(x, [2, 1], w13, w2, [0, 3], rw)
    with pytest.raises(ValueError, match="2 counts for 3 slots"):
        f(x, [2, 1], w13, w2, [0, 1, 2], rw)
    with pytest.raises(ValueError, match=r"weights must be a float \[3\] tensor.*\[2\]"):
        f(x, [2, 1], w13, w2, [0, 1], rw[:2])
    with pytest.raises(ValueError, match="unit stride"):
        f(x, [2, 1], w13.transpose(1, 2).contiguous().transpose(1, 2), w2, [0, 1], rw)
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        f(x, [2, 1], w13, w2, [0, 1], rw, threads=0)
    monkeypatch.setenv(cpu_experts.ENV, "avx1024")
    with pytest.raises(ValueError, match="WRITESCOPE_EXPERT_ISA='avx1024'"):
        f(x, [2, 1], w13, w2, [0, 1], rw)
    if kernel.best_path() != "amx":
        monkeypatch.setenv(cpu_experts.ENV, "amx")
        with pytest.raises(RuntimeError, match="'amx' was asked for"):
            f(x, [2, 1], w13, w2, [0, 1], rw)
        with pytest.raises(ValueError, match=f"offers at most {kernel.best_path()}"):
            kernel.prepare(progress=False)


# ------------------------------------------------------------------ the block
def block_reference(block, x) -> torch.Tensor:
    """The block in float64 with the block's own routing (computed from the same bf16 inputs)."""
    weights, ids = route(x, block.gate.weight, block.cfg, block.deepseek)
    names = block.cfg.expert_names
    out = torch.zeros(x.shape, dtype=torch.float64)
    for e in ids.unique().tolist():
        t, k = (ids == e).nonzero(as_tuple=True)
        gate, up, down = (getattr(block.experts[e], n).weight.double() for n in names)
        xe = x[t].double()
        out.index_add_(0, t, ((F.silu(xe @ gate.t()) * (xe @ up.t())) @ down.t()) * weights[t, k].double()[:, None])
    if block.cfg.n_shared_experts:
        s = block.shared_experts
        xd = x.double()
        out += (F.silu(xd @ s.gate_proj.weight.double().t()) * (xd @ s.up_proj.weight.double().t())) @ s.down_proj.weight.double().t()
    return out


@pytest.mark.parametrize("path", ["portable", "avx512bf16", "amx-emulated"])
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v2"])
def test_block_with_the_kernel_matches_the_torch_loop(kernel, monkeypatch, preset, path):
    """Half the routed experts offloaded (DeepSeek-V2: with its shared experts): the kernel's
    block output errs against float64 at most twice what the torch loop's does (plus the floor),
    and the kernel was called once per forward."""
    from writescope.presets import preset_config

    needs(path, kernel)
    monkeypatch.setenv(cpu_experts.ENV, path)
    cfg = preset_config(preset)
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=cfg.model_type == "deepseek_v2").to(torch.bfloat16)
    E = cfg.moe.num_experts
    block.offload_experts(range(E // 2, E))
    block.stream_min_tokens = None  # every host expert on the CPU (none streamed to the "device")
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    calls = []
    real = cpu_experts.host_experts_forward
    monkeypatch.setattr(cpu_experts, "host_experts_forward", lambda *a, **k: (calls.append(a[1]), real(*a, **k))[1])
    with torch.no_grad():
        assert block.uses_host_kernel(torch.bfloat16)
        got = block(x)
        assert len(calls) == 1 and sum(calls[0]) > 0
        block.host_kernel = False
        old = block(x)
    assert len(calls) == 1  # the loop did not call it
    ref = block_reference(block, x)
    assert rel(got, ref) <= 2 * rel(old, ref) + FLOOR


def test_block_keeps_the_loop_for_fp32_and_stale_packs(kernel, monkeypatch):
    from writescope.presets import preset_config

    cfg = preset_config("tiny-qwen3-moe")
    block = SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=False)
    block.offload_experts([1, 2])
    assert not block.uses_host_kernel(torch.float32)  # fp32: torch's GEMMs
    block.to(torch.bfloat16)  # the experts' parameters are new tensors; the pack is still fp32
    assert not block.uses_host_kernel(torch.bfloat16)
    block.offload_experts([1, 2])
    assert block.uses_host_kernel(torch.bfloat16)


# ------------------------------------------------------------------ the real AMX path (-m amx)
@pytest.mark.amx
@pytest.mark.parametrize("D, I, counts", [(96, 160, COUNTS), (2048, 768, [1, 4, 16, 17, 33, 0]), (96, 80, [1, 17])])
def test_amx_matches_float64(kernel, monkeypatch, D, I, counts):
    """On a CPU with AMX-BF16 the path must be offered (a kernel that refuses it fails here)."""
    if "amx_bf16" not in cpu_flags():
        pytest.skip("no amx_bf16 in /proc/cpuinfo")
    assert kernel.best_path() == "amx", f"the CPU has AMX-BF16 but the kernel offers {kernel.best_path()}"
    monkeypatch.setenv(cpu_experts.ENV, "amx")
    _, ran = check(kernel, "amx", D, I, counts=counts, threads=4)
    assert ran == ("amx" if D % 32 == 0 and I % 32 == 0 else "avx512bf16")


@pytest.mark.amx
def test_amx_nan_and_thread_split(kernel, monkeypatch):
    if "amx_bf16" not in cpu_flags():
        pytest.skip("no amx_bf16 in /proc/cpuinfo")
    assert kernel.best_path() == "amx", f"the CPU has AMX-BF16 but the kernel offers {kernel.best_path()}"
    monkeypatch.setenv(cpu_experts.ENV, "amx")
    w13, w2 = experts(7, 64, 96, torch.bfloat16)
    x, rw = tokens(COUNTS, 64, torch.bfloat16)
    slots = list(range(7)) + [0]
    ys = [kernel.host_experts_forward(x, COUNTS, w13, w2, slots, rw, threads=t) for t in (1, 3, 8)]
    assert torch.equal(ys[0], ys[1]) and torch.equal(ys[0], ys[2])
    x[20, 7] = float("nan")
    y = kernel.host_experts_forward(x, COUNTS, w13, w2, slots, rw, threads=4)
    assert torch.isnan(y).any(dim=1).nonzero().flatten().tolist() == [20]
