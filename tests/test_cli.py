"""``writescope generate`` end to end on CPU."""

import json

import torch

from writescope.cli.main import main


def test_generate_prints_text_and_timings_and_writes_json(tmp_path, capsys):
    out = tmp_path / "o.json"
    rc = main(["generate", "--model", "tiny-qwen3-moe", "--prompt", "def main():\n    return", "--max-new-tokens", "5",
               "--batch", "2", "--device", "cpu", "--output-json", str(out), "--quiet", "--ignore-eos"])
    assert rc == 0
    printed = capsys.readouterr().out
    for word in ("TTFT", "TPOT", "prefill", "decode", "peak memory"):
        assert word in printed
    doc = json.loads(out.read_text())
    assert len(doc["requests"]) == 2
    r = doc["requests"][0]
    assert len(r["token_ids"]) == 5 and isinstance(r["text"], str)
    assert r["metrics"]["ttft_s"] > 0 and r["metrics"]["prompt_tokens"] == len(r["prompt_token_ids"])
    assert doc["requests"][1]["token_ids"] == r["token_ids"], "greedy decoding of equal prompts must agree"
    # the main thread per decode step (4: the first token comes from the prefill): issue, wait, and the time before it
    assert len(doc["decode_host_s"]) == len(doc["decode_between_s"]) == 4 and min(doc["decode_between_s"]) >= 0


def test_generate_with_prompt_ids_and_sampling_is_seeded(tmp_path, capsys):
    args = ["generate", "--model", "tiny-mixtral", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "6", "--temperature", "1.0",
            "--top-p", "0.9", "--seed", "3", "--quiet", "--ignore-eos", "--batch", "2"]
    outs = []
    for i in range(2):
        p = tmp_path / f"{i}.json"
        assert main(args + ["--output-json", str(p)]) == 0
        outs.append([r["token_ids"] for r in json.loads(p.read_text())["requests"]])
    assert outs[0] == outs[1], "same --seed, same samples"
    assert outs[0][0] != outs[0][1], "request i samples with seed + i, so copies of a prompt differ"


class _Stop(Exception):
    pass


def _llm_kwargs(monkeypatch, module, argv: list[str]) -> dict:
    """The keyword arguments ``writescope <argv>`` passes to ``module.LLM`` (stopped there)."""
    seen: dict = {}

    def fake_llm(*a, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(module, "LLM", fake_llm)
    try:
        main(argv)
    except _Stop:
        pass
    return seen


def test_budgeted_generate_plans_for_the_known_prompt_not_the_model_limit(monkeypatch):
    """With --vram-budget and a prompt whose length is known before the model loads, the plan
    covers prompt + new tokens: planning for the model's limit (DeepSeek-V2-Lite: 163,840 tokens)
    refused a 32 x 32K batch on the H200 machine for 152 GiB of KV it would never hold."""
    import writescope

    base = ["generate", "--model", "tiny-qwen3-moe", "--max-new-tokens", "7", "--quiet", "--vram-budget", "2GiB"]
    for extra, want in ((["--prompt-ids", "5,6,7"], 10), (["--machine-text", "1k"], 1024 + 7), (["--prompt", "hi"], None)):
        assert _llm_kwargs(monkeypatch, writescope, base + extra)["max_model_len"] == want, extra


def test_profile_and_bench_plan_for_their_contexts(monkeypatch):
    """profile and bench size the budget plan for the requests they make (the H200 profile of
    DeepSeek-V2-Lite planned for 163,840 tokens and moved experts to the host that fit the GPU)."""
    import writescope.engine.llm as engine

    for argv, want in ((["profile", "--context", "1k", "--steps", "3", "--skip", "2"], 1024 + 2 + 2 + 3),
                       (["bench", "--context", "1k,2k", "--steps", "4", "--policies", "gpu"], 2048 + 4 + 1),
                       (["bench", "--context", "1k,64k", "--steps", "4", "--policies", "gpu"], 8192)):  # past tiny's limit: capped
        got = _llm_kwargs(monkeypatch, engine, argv + ["--model", "tiny-qwen3-moe", "--quiet", "--vram-budget", "2GiB"])
        assert got["max_model_len"] == want, argv


def test_expert_stream_share_flag_reaches_the_engine_and_defaults_to_the_device_rule(monkeypatch, capsys):
    """None (the engine's default: 1 on CUDA, 0 without) unless given; out of [0, 1] is refused first."""
    import writescope
    import writescope.engine.llm as engine

    runs = ((writescope, ["generate", "--prompt", "hi", "--max-new-tokens", "2"]), (engine, ["bench", "--context", "1k", "--policies", "gpu"]),
            (engine, ["profile", "--context", "1k"]))
    for module, argv in runs:
        argv = argv + ["--model", "tiny-qwen3-moe", "--quiet"]
        assert _llm_kwargs(monkeypatch, module, argv)["expert_stream_share"] is None, argv
        assert _llm_kwargs(monkeypatch, module, argv + ["--expert-stream-share", "0"])["expert_stream_share"] == 0.0, argv
        assert _llm_kwargs(monkeypatch, module, argv + ["--expert-stream-share", "auto"])["expert_stream_share"] is None, argv
        for bad in ("1.5", "nan", "half"):
            assert _llm_kwargs(monkeypatch, module, argv + ["--expert-stream-share", bad]) == {}, argv  # refused before loading
            assert f"--expert-stream-share {bad!r}: give the share of decode's host experts streamed to the GPU, in [0, 1]" \
                in capsys.readouterr().err


def test_core_plan_names_the_worker_the_kernel_path_and_the_experts(monkeypatch):
    """generate's CPU line: who attends (native worker or thread pool, and the kernel's path),
    what computes the host experts, and who issues the GPU work."""
    from types import SimpleNamespace

    from writescope.cli.generate import core_plan

    block = SimpleNamespace(host_experts=frozenset({3}), uses_host_kernel=lambda dtype: dtype is torch.bfloat16)
    llm = SimpleNamespace(attention_threads=15, expert_threads=16, cpu_attention="C++ kernel (amx)", device=torch.device("cuda"),
                          dtype=torch.bfloat16, _moe_blocks=[block, SimpleNamespace(host_experts=frozenset())], max_batch=4,
                          expert_worker=SimpleNamespace(threads=15))
    monkeypatch.delenv("WRITESCOPE_CPU_WORKER", raising=False)
    line = core_plan(llm)
    assert "attention 15 (the native C++ worker, C++ kernel (amx))" in line
    assert "16 threads for the host experts the CPU computes (on the issuing thread, C++ kernel" in line
    assert "main thread issues the GPU work" in line
    block.takes_async = lambda dtype, device, tokens: tokens == 4
    monkeypatch.delenv("WRITESCOPE_CPU_TEAM", raising=False)
    assert ("15 threads for the host experts the CPU computes (on the native expert worker (one thread and OpenMP team with the "
            "attention worker), C++ kernel") in core_plan(llm)
    monkeypatch.setenv("WRITESCOPE_CPU_TEAM", "own")
    assert "(on the native expert worker (a thread of its own), C++ kernel" in core_plan(llm)
    del block.takes_async
    monkeypatch.setenv("WRITESCOPE_CPU_WORKER", "python")
    llm.dtype, llm._moe_blocks = torch.float32, [block]
    line = core_plan(llm)
    assert "a Python thread pool" in line and "torch's GEMMs" in line
    llm._moe_blocks = []
    assert "experts: none in host memory" in core_plan(llm)


def test_profile_prints_no_profiler_info_lines():
    """kineto's "USDT: ... profiler_start" lines on stderr stay out of profile's output (its log
    level is read when the profiler first starts in a process: hence a fresh process)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-m", "writescope.cli.main", "profile", "--model", "tiny-qwen3-moe", "--batch", "2",
                          "--context", "64", "--steps", "1", "--policy", "static:0.5"], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "decode step" in out.stdout and "USDT" not in out.stderr + out.stdout
