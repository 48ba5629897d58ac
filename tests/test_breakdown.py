"""writescope.bench.breakdown: every range the engine marks is reported, and a run names them."""

from __future__ import annotations

import re
from pathlib import Path

from writescope import LLM
from writescope.bench.breakdown import MAIN_RANGES, WORKER_RANGES, decode_breakdown
from writescope.moe.block import SparseMoeBlock

# marked inside the CPU worker's own thread, before attn.cpu_part (the profiler sees the main thread only)
NOT_REPORTED = {"attn.wait_q"}


def test_every_marked_range_is_reported():
    root = Path(__file__).parents[1] / "writescope"
    marked = {m for f in root.rglob("*.py") for m in re.findall(r'record_function\("([a-z_.]+)"\)', f.read_text())}
    assert "moe.streamed_experts" in marked and "attn.load_region" in marked  # the pattern finds them
    assert marked - NOT_REPORTED == set(MAIN_RANGES) | set(WORKER_RANGES)


def test_breakdown_of_a_step_with_streamed_host_experts():
    llm = LLM("tiny-qwen3-moe", progress=False, policy="static:0.5", window=16)
    for b in (m for m in llm.model.modules() if isinstance(m, SparseMoeBlock)):
        b.offload_experts(range(2, b.cfg.num_experts))
        b.stream_share = 1.0  # every few-token host expert streamed ("the device" is the CPU here)
    bd = decode_breakdown(llm, [list(range(3, 60)), list(range(3, 40))], steps=3, skip=1)
    assert bd.steps == 3 and bd.step_ms > 0
    assert {"moe.streamed_experts", "moe.device_experts", "attn.window", "attn.cpu_part"} <= set(bd.ranges)
    assert "moe.host_experts" not in bd.ranges  # nothing left to the CPU's expert loop
    assert "moe.streamed_experts" in bd.table()
