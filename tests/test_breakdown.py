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
    marked = {m for f in root.rglob("*.py") for m in re.findall(r'(?:record_function|named)\("([a-z_.]+)"\)', f.read_text())}
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


def test_a_range_with_device_work_keeps_its_cpu_time_span_and_busy_time():
    """With CUDA, key_averages() lists a range twice (a CPU entry and a GPU-side annotation,
    grouped apart by device_type); each time is read from its own entry, in ms per step."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    from writescope.bench.breakdown import Breakdown, RangeTime, range_times

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        E(key="attn.load_region", device_type=cpu, cpu_time_total=6000.0, device_time_total=30000.0),  # busy 30 ms
        E(key="aten::mm", device_type=cpu, cpu_time_total=9000.0, device_time_total=9000.0),  # not a named range
        E(key="moe.host_experts", device_type=cpu, cpu_time_total=12000.0, device_time_total=0.0),
        E(key="attn.load_region", device_type=cuda, cpu_time_total=0.0, device_time_total=45000.0),  # span 45 ms
    ]
    ranges = range_times(events, steps=3)
    assert ranges == {"attn.load_region": RangeTime(2.0, 15.0, 10.0), "moe.host_experts": RangeTime(4.0, 0.0, 0.0)}
    bd = Breakdown(step_ms=20.0, steps=3, ranges={"attn.cpu_part": RangeTime(7.0), **ranges})
    assert bd.other_ms == 14.0  # 20 - (2 + 4); the worker's 7 ms overlap the main thread
    rows = {line.split()[0]: line.split()[1:] for line in bd.table().splitlines()[2:]}
    assert rows["attn.load_region"] == ["main", "2.000", "10.0%", "15.000", "10.000"]
    assert rows["attn.cpu_part"] == ["worker", "7.000", "(35.0%)", "0.000", "0.000"]  # overlaps: in brackets
    assert rows["other"][1:4] == ["main", "14.000", "70.0%"] and rows["device"][0] == "span:"
    cpu_only = Breakdown(step_ms=20.0, steps=3, ranges=ranges, device_timed=False).table()
    assert "device" not in cpu_only and cpu_only.splitlines()[2].split() == ["moe.host_experts", "main", "4.000", "20.0%"]
