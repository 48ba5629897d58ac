"""The link's rate inside decode steps (writescope/bench/runner.py ``link_copies``, report.py
``format_link_copies``): the ping-pong fills' copies timed on the copy stream, each after its wait."""

from __future__ import annotations

import math

import pytest
import torch

from writescope.bench.report import format_link_copies
from writescope.bench.runner import BenchRow, link_copies


def test_the_rate_is_the_bytes_over_the_fills_own_seconds():
    # three fills of 64 MiB at 1.25 ms each (wall-clock stamps, as without CUDA): 53.7 GB/s; the gaps between them
    # (a fill waiting for its buffer) are not the link's
    mib64 = 64 * 2**20
    timers = [(0.0, 1.25e-3, mib64), (5.0e-3, 6.25e-3, mib64), (9.0e-3, 10.25e-3, mib64)]
    got = link_copies(timers)
    assert got["fills"] == 3 and got["link_copy_ms"] == pytest.approx(1.25)
    assert got["link_copy_gbs"] == pytest.approx(mib64 / 1.25e-3 / 1e9)


@pytest.mark.parametrize("timers", [None, [], [(1.0, 1.0, 100)]])
def test_no_timed_fill_gives_none(timers):
    assert link_copies(timers) is None


def test_the_report_prints_each_run_beside_the_stand_alone_rate():
    def row(policy, gbs, repeat):
        extra = {"repeat": repeat, "bound_rates_gbs": {"split": 150.0, "stream": 55.0, "source": "test"}}
        if gbs is not None:
            extra["link_copies"] = {"link_copy_gbs": gbs, "link_copy_ms": 1.0, "fills": 2}
        return BenchRow(4, 16384, policy, decode_tok_s=1.0, tpot_ms=100.0, attn_ms_per_layer=1.0, r_deployed=0.0, extra=extra)

    text = format_link_copies([row("writescope", 46.1, 0), row("cpu", None, 0), row("writescope", 47.9, 1)])
    assert "batch 4 context 16384 writescope: 46.1, 47.9 GB/s (stand-alone copies 55.0 GB/s in this run)" in text
    assert "cpu" not in text.split("\n", 1)[1]  # a row that streamed nothing is not listed
    assert format_link_copies([row("cpu", None, 0)]) == ""


def test_a_cpu_decode_times_no_fill():
    """Without CUDA the fills are plain copies (no copy stream): a bench row has no link figures."""
    from writescope import LLM, SamplingParams

    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, cpu_threads=1)
    llm.cache.decoder.copy_timers = []
    llm.generate(prompt_token_ids=[[1 + i for i in range(60)]], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert llm.cache.decoder.copy_timers == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the copy stream's fills")
def test_a_cuda_decode_times_its_fills():
    from writescope import LLM, SamplingParams

    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16, cpu_threads=1, device="cuda")
    llm.cache.decoder.copy_timers = []
    llm.generate(prompt_token_ids=[[1 + i for i in range(200)]], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    torch.cuda.synchronize()
    got = link_copies(llm.cache.decoder.copy_timers)
    assert got is not None and got["fills"] > 0 and math.isfinite(got["link_copy_gbs"]) and got["link_copy_gbs"] > 0
