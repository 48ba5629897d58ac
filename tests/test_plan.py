"""Memory plans under a GPU budget: weight sizes, the paper's configurations by hand, refusals."""

from __future__ import annotations

import re

import pytest
import torch

from writescope.budget.plan import GiB, RESERVE, make_plan, parse_size
from writescope.budget.weights import weight_sizes
from writescope.cli.main import main
from writescope.models import build_model
from writescope.presets import PRESETS, preset_config
from writescope.scheduler.policies import StaticPolicy


@pytest.mark.parametrize("name", PRESETS)
def test_weight_sizes_match_the_built_model(name):
    cfg = preset_config(name)
    model = build_model(cfg, torch.bfloat16, "meta")
    w = weight_sizes(cfg)
    assert w.total == sum(p.numel() for p in model.parameters())
    assert w.routed == sum(p.numel() for n, p in model.named_parameters() if re.search(r"\.experts\.\d+\.", n))


# The paper's setting: 32 GiB, batch 32, 32K context (+256 new tokens), bf16, D = 256.
# Hand arithmetic per model: (expert bytes, experts, KV bytes per token and layer, layers)
HAND = {
    "deepseek-v2-lite": (3 * 2048 * 1408 * 2, 64 * 26, 576 * 2, 27),
    "qwen3-30b-a3b": (3 * 2048 * 768 * 2, 128 * 48, 4 * 128 * 2 * 2, 48),
    "mixtral-8x7b": (3 * 4096 * 14336 * 2, 8 * 32, 8 * 128 * 2 * 2, 32),
}


@pytest.mark.parametrize("name", list(HAND))
def test_paper_configurations_by_hand(name):
    expert, n_exp, tok, layers = HAND[name]
    cfg = preset_config(name)
    plan = make_plan(cfg, torch.bfloat16, 32 * GiB, 32, 32768, 256, StaticPolicy(0.5), host_free=None)
    assert plan.expert_bytes == expert and plan.experts_total == n_exp
    assert plan.kv_gpu == 32 * layers * 256 * tok  # one D-window per sequence and layer
    assert plan.kv_host == 32 * 33024 * layers * tok  # 33,024 = 129 whole blocks of 256
    assert plan.kv_pinned_max == plan.kv_host // 2  # static:0.5
    assert plan.pingpong == 2 * (64 * 2**20 // (256 * tok)) * (256 * tok)  # two buffers of whole blocks
    assert plan.reserve == RESERVE
    room = 32 * GiB - plan.gpu_min
    # experts left on the host: two groups of 4 streaming slots (one expert each) are kept for prefill
    stream = 8 * expert if room // expert < n_exp else 0
    assert plan.stream_slots == stream
    assert plan.experts_gpu == min(n_exp, (room - stream) // expert)
    assert plan.gpu_total <= 32 * GiB
    assert max(plan.experts_gpu_per_layer) - min(plan.experts_gpu_per_layer) <= 1  # spread evenly
    assert plan.expert_weights_host == (n_exp - plan.experts_gpu) * expert
    plan.check()  # no host figure given: only the GPU side is checked


def test_paper_configurations_on_a_125_gib_host():
    """With the GPU machine's memory, DeepSeek-V2-Lite fits; Qwen3-30B-A3B's 97 GiB of KV plus
    27 GiB of host experts do not, and the refusal says by how much. A larger budget is advised only
    where the host experts it would take back cover the shortfall: Qwen3's 27 GiB cover its 12,
    Mixtral's 62 GiB not its 80."""
    host = 125 * GiB
    for name, fits, raise_budget in (("deepseek-v2-lite", True, None), ("qwen3-30b-a3b", False, True), ("mixtral-8x7b", False, False)):
        plan = make_plan(preset_config(name), torch.bfloat16, 32 * GiB, 32, 32768, 256, StaticPolicy(0.5), host_free=host)
        if fits:
            plan.check()
        else:
            with pytest.raises(ValueError, match=r"host memory .* 125.00 GiB is free, of which at most 90% .*: (raise vram_budget|lower)") as e:
                plan.check()
            assert ("raise vram_budget" in str(e.value)) == raise_budget, name


def test_budget_below_the_minimum_is_refused_with_the_minimum():
    cfg = preset_config("qwen3-30b-a3b")
    plan = make_plan(cfg, torch.bfloat16, 3 * GiB, 4, 8192, 256, StaticPolicy(0.5))
    assert plan.experts_gpu == 0
    with pytest.raises(ValueError, match=rf"below the minimum of {plan.gpu_min / GiB:.3f} GiB") as e:
        plan.check()
    assert "partitioned policy" not in str(e.value)  # it already is one
    resident = make_plan(cfg, torch.bfloat16, 3 * GiB, 4, 8192, 256, None)
    with pytest.raises(ValueError, match=r"or use a partitioned policy \(KV in host memory\)"):  # the API's names
        resident.check()


def test_a_budget_too_small_for_the_prefill_pass_advises_a_smaller_chunk(capsys):
    """Qwen3-30B-A3B at 4.25 GiB: the minimum at 8,192-token prefill passes is above the budget, but at
    1,024 it fits, so the refusal names the prefill chunk (a new user's trial found no working advice:
    smaller batches and contexts leave the activations' 8,192 tokens). Where host memory is short
    too, both are said."""
    cfg = preset_config("qwen3-30b-a3b")
    big = make_plan(cfg, torch.bfloat16, 4.25 * GiB, 1, 32768, 256, StaticPolicy(0.5))
    assert big.prefill_tokens == 8192 and big.budget < big.gpu_min
    with pytest.raises(ValueError, match=r"or prefill_chunk_tokens=1024 \(the activations are sized for prefill passes of 8,192 "
                                         r"tokens; at 1,024 they take 0\.\d\d GiB and the minimum is 4\.\d{3} GiB\)") as e:
        big.check()
    small = make_plan(cfg, torch.bfloat16, 4.25 * GiB, 1, 32768, 256, StaticPolicy(0.5), prefill_chunk_tokens=1024)
    small.check()  # the advice works
    assert f"the minimum is {small.gpu_min / GiB:.3f} GiB" in str(e.value)  # the minimum said is the smaller chunk's
    with pytest.raises(ValueError) as e:  # where even 1,024-token passes would not fit, no such advice
        make_plan(cfg, torch.bfloat16, 3 * GiB, 1, 32768, 256, StaticPolicy(0.5)).check()
    assert "below the minimum" in str(e.value) and "prefill" not in str(e.value)
    short = make_plan(cfg, torch.bfloat16, 1024, 1, 1024, 0, StaticPolicy(0.5), prefill_chunk_tokens=1024)
    assert short.prefill_tokens == 1024
    with pytest.raises(ValueError) as e:
        short.check()
    assert "below the minimum" in str(e.value) and "prefill" not in str(e.value)  # 1,024 is not advised smaller
    both = make_plan(cfg, torch.bfloat16, 4 * GiB, 4, 32768, 256, StaticPolicy(0.5), host_free=20 * GiB)
    with pytest.raises(ValueError, match=r"below the minimum .*; and the plan needs .* GiB of host memory"):
        both.check()
    args = ["plan", "--model", "qwen3-30b-a3b", "--vram-budget", "4.25GiB", "--batch", "1", "--context", "32k", "--host-memory", "200GiB"]
    assert main(args) == 2
    assert "or --prefill-chunk-tokens 1024 (the activations" in capsys.readouterr().err  # the command's flag
    assert main(args + ["--prefill-chunk-tokens", "1024"]) == 0
    assert "the plan fits" in capsys.readouterr().out
    assert main(args + ["--prefill-chunk-tokens", "0"]) == 2
    assert "--prefill-chunk-tokens must be >= 1, got 0" in capsys.readouterr().err


def test_the_plan_counts_the_gemm_workspaces():
    """Four cuBLAS workspaces (the loading and issuing threads' streams, the graphs' warm-up and capture streams) are in
    the minimum and the working set, in the refusal's sum and in the table (run 35's out-of-memory
    decode step under a server was likely a workspace per warm-up stream: models/graphs.py)."""
    from writescope.budget.plan import CUBLAS_WORKSPACE, GEMM_WORKSPACES, format_plan

    cfg = preset_config("qwen3-30b-a3b")
    plan = make_plan(cfg, torch.bfloat16, 32 * GiB, 12, 8209, 0, StaticPolicy(0.5), 256, 4096)
    assert plan.workspaces == GEMM_WORKSPACES == 4 * CUBLAS_WORKSPACE == 128 * 2**20
    assert plan.gpu_min == plan.non_expert_weights + plan.kv_gpu + plan.pingpong + plan.activations + plan.workspaces + RESERVE
    assert plan.working_gpu == plan.kv_gpu + plan.pingpong + plan.activations + plan.workspaces + plan.stream_slots
    assert plan.gpu_total <= 32 * GiB
    assert re.search(r"GEMM workspaces \(cuBLAS: 4 streams x 32 MiB\)\s+0\.12 GiB", format_plan(plan, cfg))
    none = make_plan(cfg, torch.bfloat16, 32 * GiB, 12, 8209, 0, StaticPolicy(0.5), 256, 4096, gemm_workspaces=0)
    assert none.gpu_min == plan.gpu_min - GEMM_WORKSPACES and "GEMM workspaces (cuBLAS: 0 streams x 32 MiB)" in format_plan(none, cfg)
    small = make_plan(cfg, torch.bfloat16, 3 * GiB, 4, 8192, 256, StaticPolicy(0.5))
    with pytest.raises(ValueError, match=r"GEMM workspaces 0\.12 \+ reserve 0\.50"):
        small.check()


def test_resident_puts_all_kv_on_the_gpu():
    cfg = preset_config("deepseek-v2-lite")
    plan = make_plan(cfg, torch.bfloat16, 80 * GiB, 4, 8192, 256, None)
    assert plan.kv_gpu == 4 * (8192 + 256) * 27 * 1152 and plan.kv_host == 0 and plan.pingpong == 0


def test_parse_size():
    assert parse_size("32GiB") == 32 * GiB == parse_size("32g") == parse_size(" 32 G ")
    assert parse_size("30GB") == 30 * 10**9 and parse_size("512MiB") == 512 * 2**20 and parse_size("1024") == 1024
    for bad in ("32 parsecs", "-1G", "G", "0"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_a_budget_without_a_unit_is_refused_under_a_mebibyte(capsys):
    from writescope import LLM
    from writescope.units import parse_budget

    assert parse_budget("1048576") == 2**20 and parse_budget("1e9") == 10**9 and parse_budget("32GiB") == 32 * GiB
    for bare, shown in (("32", "32 bytes"), ("1.5", "1 byte:"), (" 1048575 ", "1,048,575 bytes")):
        with pytest.raises(ValueError, match=f"'{bare.strip()}' has no unit, so it would be {shown}.*{bare.strip()}GiB"):
            parse_budget(bare)
    assert parse_budget("512KiB") == 512 * 2**10  # a unit given: taken as meant (the plan then says it is too small)
    assert main(["plan", "--model", "tiny-qwen3-moe", "--vram-budget", "32", "--batch", "2", "--context", "1k"]) == 2
    assert "'32' has no unit" in capsys.readouterr().err
    with pytest.raises(ValueError, match="vram_budget: '24' has no unit"):
        LLM("tiny-qwen3-moe", progress=False, vram_budget="24")


def test_plan_cli(capsys):
    assert main(["plan", "--model", "tiny-qwen3-moe", "--vram-budget", "2GiB", "--batch", "2", "--context", "1k"]) == 0
    out = capsys.readouterr().out
    assert "routed experts on GPU" in out and "the plan fits" in out
    assert main(["plan", "--model", "tiny-qwen3-moe", "--vram-budget", "1MiB", "--batch", "2", "--context", "1k"]) == 2
    assert "below the minimum" in capsys.readouterr().err


def test_plan_refuses_a_context_past_the_model_limit(capsys):
    from writescope.cli.main import main

    assert main(["plan", "--model", "deepseek-v2-lite", "--vram-budget", "1000GiB", "--batch", "1", "--context", "1000k",
                 "--host-memory", "2000GiB"]) == 2
    assert "passes deepseek-v2-lite's limit of 163,840 tokens" in capsys.readouterr().err
    assert main(["plan", "--model", "deepseek-v2-lite", "--vram-budget", "0", "--batch", "1", "--context", "1k"]) == 2
    assert "--vram-budget: a size must be positive" in capsys.readouterr().err


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
def test_the_plan_counts_the_prefill_reads_started_ahead(share, monkeypatch):
    """Chunked prefill's compute-row reads started ahead (kvcache/inplace.py READ_AHEAD_BYTES) are
    in the activations: read_ahead layers of the policy's largest share of one layer's rows, at
    most the cap; none for a policy without a compute region or with the read-ahead off."""
    from writescope.kvcache.inplace import READ_AHEAD_BYTES
    from writescope.kvcache.spec import PartitionSpec

    cfg = preset_config("deepseek-v2-lite")
    plans = {}
    for ahead in ("0", "1", "2", "64"):
        monkeypatch.setenv("WRITESCOPE_PREFILL_READ_AHEAD", ahead)
        plans[ahead] = make_plan(cfg, torch.bfloat16, 32 * GiB, 4, 32768, 256, StaticPolicy(share)).activations
    layer = PartitionSpec(cfg.kv_layout, cfg.num_layers, torch.bfloat16).token_bytes * (32768 + 256)
    for ahead in ("1", "2", "64"):
        want = min(READ_AHEAD_BYTES, int(int(ahead) * share * layer))
        assert plans[ahead] - plans["0"] == want
    assert plans["64"] - plans["0"] == (READ_AHEAD_BYTES if share else 0)
