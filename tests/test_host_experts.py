"""Host experts as single-threaded tasks on a pool (writescope.moe.host) against the plain
GatedMLP, in fp32 and bf16, with odd token counts and widths that do not divide into chunks."""

from __future__ import annotations

import pytest
import torch

from writescope.layers.mlp import GatedMLP
from writescope.moe.block import SparseMoeBlock
from writescope.moe.host import MIN_ROWS, _chunks, run_host_experts
from writescope.presets import preset_config


def _experts(n, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mlps = [GatedMLP(hidden, inter) for _ in range(n)]
    with torch.no_grad():
        for m in mlps:
            for p in m.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    mlps = [m.to(dtype) for m in mlps]
    w13 = [torch.cat((m.gate_proj.weight, m.up_proj.weight)) for m in mlps]
    w2 = [m.down_proj.weight for m in mlps]
    return mlps, w13, w2


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tasks_match_the_plain_mlp(threads, dtype):
    hidden, inter = 2 * MIN_ROWS + 65, 2 * MIN_ROWS + 17  # chunks with a remainder in both phases
    mlps, w13, w2 = _experts(4, hidden, inter, dtype)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, hidden, generator=g).to(dtype) for n in (1, 15, 16, 17)]
    got = run_host_experts(w13, w2, xs, threads)
    with torch.no_grad():
        want = [m(x) for m, x in zip(mlps, xs)]
    for y, w in zip(got, want):
        assert y.shape == w.shape and y.dtype == dtype
        assert w.float().std() > 0.05
        if dtype == torch.float32:
            torch.testing.assert_close(y, w, atol=1e-5, rtol=1e-5)
        else:  # one bf16 rounding step at the output's magnitude (2^-8 relative)
            torch.testing.assert_close(y.float(), w.float(), atol=2**-8 * w.float().abs().max().item(), rtol=0)
    assert run_host_experts(w13, w2, [], threads) == []


def test_chunks_cover_each_width_once():
    for n in (1, 15, MIN_ROWS, MIN_ROWS + 1, 4097):
        for parts in (1, 2, 3, 16):
            c = _chunks(n, parts)
            assert c[0][0] == 0 and c[-1][1] == n and all(a < b for a, b in c)
            assert all(c[i][1] == c[i + 1][0] for i in range(len(c) - 1))
            assert len(c) <= max(1, min(parts, n // MIN_ROWS))  # no chunk below MIN_ROWS unless the width is


def test_the_calling_thread_keeps_its_thread_count():
    before = torch.get_num_threads()
    _, w13, w2 = _experts(3, 64, 48, torch.float32)
    run_host_experts(w13, w2, [torch.randn(2, 64) for _ in range(3)], threads=2)
    assert torch.get_num_threads() == before


def test_a_failing_task_raises():
    _, w13, w2 = _experts(2, 64, 48, torch.float32)
    with pytest.raises(RuntimeError):
        run_host_experts(w13, w2, [torch.randn(2, 64), torch.randn(2, 63)], threads=2)  # wrong width


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_block_gives_the_same_output_either_way(preset):
    cfg = preset_config(preset)
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=False)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.05)
    block.offload_experts(range(cfg.moe.num_experts // 2, cfg.moe.num_experts))  # half on the host
    x = torch.randn(17, cfg.hidden_size)
    with torch.no_grad():
        block.host_parallel = True
        a = block(x)
        block.host_parallel = False
        b = block(x)
    assert a.std() > 0
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_threads_started_later_keep_the_default_count():
    import threading

    outer = torch.get_num_threads()
    torch.set_num_threads(2)  # not the pool's 1 (the test session runs on one thread)
    try:
        _, w13, w2 = _experts(2, 64, 48, torch.float32)
        run_host_experts(w13, w2, [torch.randn(1, 64), torch.randn(3, 64)], threads=3)  # a new pool of one-thread workers
        seen = []
        # an op first: torch sets a new thread's count when it first runs one
        t = threading.Thread(target=lambda: seen.append((torch.randn(64, 64) @ torch.randn(64, 64), torch.get_num_threads())[1]))
        t.start()
        t.join()
        assert seen == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(outer)
