"""Expert placement by popularity (moe/popularity.py, budget/apply.py; issue 16 item 3): the profile
file, the routing counter, the placement it gives under a budget, the same tokens, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from writescope.budget.apply import coverage_line, host_experts
from writescope.cli.main import main
from writescope.moe.popularity import ExpertProfile, recording
from writescope.presets import preset_config

from helpers import budget_plan, half_experts_budget

PRESET = "tiny-qwen3-moe"


def _half_plan(cfg):
    assert cfg == preset_config(PRESET)
    budget = half_experts_budget(PRESET)
    return budget_plan(PRESET, budget=budget), budget


def _skewed(cfg) -> ExpertProfile:
    """The highest ids are the popular ones: the opposite of lowest-id placement."""
    E = cfg.moe.num_experts
    return ExpertProfile({i: [float(e * e + (i % 3)) for e in range(E)] for i in cfg.moe.moe_layers}, tokens=1000, model=PRESET)


def test_a_skewed_profile_keeps_the_popular_experts_on_the_device():
    cfg = preset_config(PRESET)
    plan, _ = _half_plan(cfg)
    prof = _skewed(cfg)
    by_id, by_pop = host_experts(cfg, plan), host_experts(cfg, plan, prof)
    E = cfg.moe.num_experts
    for i, keep in zip(cfg.moe.moe_layers, plan.experts_gpu_per_layer):
        assert 0 < keep < E
        assert by_id[i] == list(range(keep, E))
        assert set(range(E)) - set(by_pop[i]) == set(range(E - keep, E))  # the keep most chosen stay
        assert len(by_pop[i]) == E - keep
    line = coverage_line(cfg, plan, prof)
    hot, low = (float(x.split("%")[0]) for x in line.split("serve ")[1].split(" of the profiled")[0:1] + [line.split("(")[1]])
    assert hot > low, line


def test_profile_file_round_trip_and_errors(tmp_path):
    cfg = preset_config(PRESET)
    prof = _skewed(cfg)
    path = prof.save(tmp_path / "p.json")
    back = ExpertProfile.load(path)
    assert back == prof and back.source == str(path)
    back.check(list(cfg.moe.moe_layers), cfg.moe.num_experts)
    with pytest.raises(ValueError, match="layer .* has 3 counts, the model 16 routed experts"):
        ExpertProfile({i: [1.0, 2.0, 3.0] for i in cfg.moe.moe_layers}).check(list(cfg.moe.moe_layers), cfg.moe.num_experts)
    with pytest.raises(ValueError, match="missing"):
        ExpertProfile({0: [1.0] * 16}).check(list(cfg.moe.moe_layers), cfg.moe.num_experts)
    # another model's profile: what is missing and what is extra, as spans, and which model made it
    with pytest.raises(ValueError, match=r"\(it was made with tiny-x\): 45 of this model's MoE layers missing \(3\.\.47\), "
                                         r"1 not MoE layers of this model \(60; its MoE layers: 0\.\.47\)"):
        ExpertProfile({0: [1.0], 1: [1.0], 2: [1.0], 60: [1.0]}, model="tiny-x").check(list(range(48)), 1)
    with pytest.raises(ValueError, match="finite and >= 0"):
        ExpertProfile({i: [-1.0] * 16 for i in cfg.moe.moe_layers}).check(list(cfg.moe.moe_layers), cfg.moe.num_experts)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="--expert-profile .*bad.json: not an expert profile"):
        ExpertProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="--expert-profile .*none.json"):
        ExpertProfile.load(tmp_path / "none.json")


def test_recording_counts_every_top_k_assignment():
    from writescope import LLM
    from writescope.moe.router import route

    llm = LLM(PRESET, progress=False)
    ids = list(range(5, 45))
    with recording(llm.model) as counts:
        llm.generate(prompt_token_ids=[ids], sampling_params=None)
    cfg = llm.config
    assert sorted(counts) == list(cfg.moe.moe_layers)
    steps = 16  # SamplingParams' default max_tokens: the prefill and every decode step are counted
    for i in cfg.moe.moe_layers:
        assert sum(counts[i]) == cfg.moe.top_k * (len(ids) + steps - 1)
    block = llm.model.model.layers[cfg.moe.moe_layers[0]].mlp_module
    assert block.routing_counts is None  # off again
    x = torch.randn(7, cfg.hidden_size)
    with recording(llm.model) as one:
        with torch.no_grad():
            block(x)
    want = torch.bincount(route(x, block.gate.weight, block.cfg, block.deepseek)[1].flatten(), minlength=cfg.moe.num_experts)
    assert one[cfg.moe.moe_layers[0]] == [float(c) for c in want]


def test_placement_by_profile_gives_the_same_tokens(tmp_path):
    from writescope import LLM

    cfg = preset_config(PRESET)
    _, budget = _half_plan(cfg)
    path = _skewed(cfg).save(tmp_path / "p.json")
    kw = dict(progress=False, policy="static:0.5", window=16, vram_budget=budget, max_batch=2)
    prompts = [[5, 6, 7] * 9, [8, 9] * 11]
    by_id = LLM(PRESET, **kw)
    by_pop = LLM(PRESET, expert_profile=str(path), **kw)
    E = cfg.moe.num_experts
    for i in cfg.moe.moe_layers:
        a, b = by_id.model.model.layers[i].mlp_module, by_pop.model.model.layers[i].mlp_module
        keep = E - len(a.host_experts)
        assert 0 < keep < E and a.host_experts == frozenset(range(keep, E))
        assert b.host_experts == frozenset(range(E - keep))  # the popular high ids on the device
    assert [o.token_ids for o in by_id.generate(prompt_token_ids=prompts)] == [o.token_ids for o in by_pop.generate(prompt_token_ids=prompts)]


def test_expert_profile_command_and_plan(tmp_path, capsys):
    out = tmp_path / "prof.json"
    assert main(["expert-profile", "--model", PRESET, "--synthetic", "--machine-text", "300", "--out", str(out), "--quiet"]) == 0
    doc = json.loads(out.read_text())
    cfg = preset_config(PRESET)
    assert doc["tokens"] == 300 and sorted(int(k) for k in doc["layers"]) == list(cfg.moe.moe_layers)
    assert all(sum(v) == 300 * cfg.moe.top_k for v in doc["layers"].values())
    assert "wrote" in capsys.readouterr().out
    assert main(["expert-profile", "--model", PRESET, "--synthetic", "--out", str(tmp_path / "no" / "p.json")]) == 2
    assert "directory" in capsys.readouterr().err
    _, budget = _half_plan(cfg)
    assert main(["plan", "--model", PRESET, "--vram-budget", str(budget), "--batch", "2", "--context", "100", "--max-new-tokens", "10",
                 "--policy", "static:0.5", "--window", "16", "--dtype", "fp32", "--expert-profile", str(out)]) == 0
    assert "of the profiled assignments placed by popularity" in capsys.readouterr().out


def test_profile_warnings_and_a_model_without_moe_layers():
    cfg = preset_config(PRESET)
    prof = _skewed(cfg)
    with pytest.warns(UserWarning, match="unused without a VRAM budget"):
        prof.warn_if_unused(PRESET, budgeted=False)
    with pytest.warns(UserWarning, match="was made with 'tiny-qwen3-moe', not 'other'"):
        prof.warn_if_unused("other", budgeted=True)
    with pytest.raises(ValueError, match="no MoE layers"):
        prof.check([], 16)
