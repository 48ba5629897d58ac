"""The fused decode kernels' in-place read of host experts (the link's share of a decode step's host
experts, moe/async_experts.py), alone and beside what a decode step runs at the same time: the
CPU's expert kernel on other host experts, the copy stream carrying KV, and both (issue 16).

Why: on the H200 (run 58, benchmarks/results/gpu_decode_h200.md) Qwen3-30B-A3B 16 x 16K's streamed
host experts cost the step as if read at about 26 GB/s, where the read timed with the host idle
gave 43 GB/s. This measures each load's effect on the read, and the read's on the loads.

Per model (expert shape D x I from its preset): ``--experts`` random bf16 host experts (std 0.02,
never zeros) in page-locked memory, one token on each, read by ``fused_experts_into`` through a
CUDA view of the host pack (as the decode step reads them), each call timed by CUDA events;
``--repeats`` calls under each load, started 0.2 s before and stopped after:

- ``idle``: nothing else;
- ``cpu``: the C++ expert kernel (the path the runtime picks, ``--threads`` threads) in a loop on
  another set of host experts, one token each, as the expert worker computes the CPU's share;
- ``copy``: ``--copy-mib`` page-locked-to-device copies in a loop on another stream, as the ping-pong
  fills of the next layer's KV;
- ``cpu+copy``: both.

Reported per load: the in-place read's GB/s (median [min-max] over the calls), its ratio to the
same run's plain host-to-device copy rate alone (the link's bound), and the loads' own rates over
the window. Needs CUDA and Triton.

Run (repository root, on the GPU machine):
    PYTHONPATH=. python3 benchmarks/link_read.py --out benchmarks/results/link_read_h200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from interference import Loop  # benchmarks/ (the script's folder)

DTYPE = torch.bfloat16
LOADS = ("idle", "cpu", "copy", "cpu+copy")


def rate_line(nbytes: int, seconds: list[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` GB/s of ``nbytes`` read in each of ``seconds`` (all > 0)."""
    if not seconds or any(not s > 0 for s in seconds) or nbytes < 1:
        raise ValueError(f"need >= 1 positive time and >= 1 byte, got {seconds} for {nbytes} bytes")
    rates = [nbytes / s / 1e9 for s in seconds]
    return statistics.median(rates), min(rates), max(rates)


def host_pack(experts: int, D: int, I: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, D], w2 [E, D, I]) random bf16 (std 0.02) in page-locked host memory."""
    w13 = torch.empty(experts, 2 * I, D, dtype=DTYPE).normal_(0.0, 0.02).pin_memory()
    w2 = torch.empty(experts, D, I, dtype=DTYPE).normal_(0.0, 0.02).pin_memory()
    return w13, w2


def bench_model(name: str, args) -> list[dict]:
    from writescope.kvcache.pinned import device_view
    from writescope.moe import cpu_experts, fused_decode
    from writescope.presets import preset_config

    cfg = preset_config(name)
    D, I, E = cfg.hidden_size, cfg.moe.intermediate_size, args.experts
    dev = torch.device("cuda")
    expert_bytes = 3 * D * I * DTYPE.itemsize
    nbytes = E * expert_bytes
    w13, w2 = host_pack(E, D, I)
    v13, v2 = device_view(w13, dev), device_view(w2, dev)
    slot_of = torch.arange(E, dtype=torch.long, device=dev)
    x = (0.02 * torch.randn(E, D, device=dev)).to(DTYPE)
    ids = torch.arange(E, dtype=torch.long, device=dev).view(-1, 1)  # one token on each expert, top-1
    weights = torch.ones(E, 1, dtype=torch.float32, device=dev)
    out = torch.zeros(E, D, dtype=torch.float32, device=dev)

    def read_once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fused_decode.fused_experts_into(x, weights, ids, slot_of, v13, v2, I, out)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e-3

    # the CPU's load: the expert kernel on its own set of host experts (the CPU's share is other experts)
    c13, c2 = host_pack(E, D, I)
    cx = torch.randn(E, D).to(DTYPE)
    crw = torch.rand(E) + 0.1

    def cpu_call():
        cpu_experts.host_experts_forward(cx, [1] * E, c13, c2, list(range(E)), crw, threads=args.threads)

    # the link's load: page-locked KV-sized blocks copied to the device on their own stream
    copy_bytes = args.copy_mib * 2**20
    src = torch.empty(copy_bytes, dtype=torch.uint8).random_(0, 256).pin_memory()
    dst = torch.empty(copy_bytes, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()

    def copy_call():
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        side.synchronize()

    for _ in range(2):  # warm-up: Triton's compile, the kernel's build, the first touches
        read_once()
        cpu_call()
        copy_call()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        copy_call()
    link_alone = copy_bytes * args.repeats / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        cpu_call()
    cpu_alone = nbytes * args.repeats / (time.perf_counter() - t0) / 1e9
    rows = []
    for load in args.loads:
        loops = ([Loop(cpu_call, nbytes)] if "cpu" in load else []) + ([Loop(copy_call, copy_bytes)] if "copy" in load else [])
        for lp in loops:
            lp.__enter__()
        try:
            times = [read_once() for _ in range(args.repeats)]
        finally:
            for lp in loops:
                lp.__exit__(None, None, None)
        med, lo, hi = rate_line(nbytes, times)
        row = {"model": name, "D": D, "I": I, "experts": E, "weight_bytes": nbytes, "load": load,
               "read_gbs": med, "read_min_gbs": lo, "read_max_gbs": hi, "link_alone_gbs": link_alone, "ratio": med / link_alone,
               "cpu_kernel_gbs": next((lp.gbs for lp in loops if lp.fn is cpu_call), None), "cpu_kernel_alone_gbs": cpu_alone,
               "copy_gbs": next((lp.gbs for lp in loops if lp.fn is copy_call), None)}
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The markdown table of :func:`bench_model`'s rows."""
    lines = ["| model | experts x MB | load | in-place read GB/s [min-max] | link alone GB/s | ratio | CPU kernel GB/s (alone) | copies GB/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cpu = f"{r['cpu_kernel_gbs']:.1f}" if r["cpu_kernel_gbs"] is not None else "-"
        copies = f"{r['copy_gbs']:.1f}" if r["copy_gbs"] is not None else "-"
        lines.append(f"| {r['model']} | {r['experts']} x {r['weight_bytes'] / r['experts'] / 1e6:.1f} | {r['load']} | "
                     f"{r['read_gbs']:.1f} [{r['read_min_gbs']:.1f}-{r['read_max_gbs']:.1f}] | {r['link_alone_gbs']:.1f} | "
                     f"{r['ratio']:.2f} | {cpu} ({r['cpu_kernel_alone_gbs']:.1f}) | {copies} |")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--experts", type=int, default=8, help="host experts read a call, one token each (default 8)")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated, of {', '.join(LOADS)}")
    ap.add_argument("--threads", type=int, default=max(1, torch.get_num_threads() - 1), help="the CPU expert kernel's threads")
    ap.add_argument("--copy-mib", type=int, default=64, help="MiB a copy of the copy load (default 64, a ping-pong buffer)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args(argv)
    args.loads = [s.strip() for s in args.loads.split(",") if s.strip()]
    bad = [s for s in args.loads if s not in LOADS]
    if bad or not args.loads:
        ap.error(f"--loads {','.join(bad) or '(none)'}: use some of {','.join(LOADS)}")
    for key in ("experts", "threads", "copy_mib", "repeats"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("link_read.py: error: needs a CUDA device (the fused kernels read host memory over PCIe)")
    from writescope.moe import fused_decode

    if fused_decode.triton is None:
        raise SystemExit("link_read.py: error: needs Triton (the fused decode kernels)")
    t0 = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name.strip(), args)
    wall = time.perf_counter() - t0
    text = table(rows)
    head = (f"{torch.cuda.get_device_name()}, CPU kernel {args.threads} threads, {args.repeats} calls a load, "
            f"copies of {args.copy_mib} MiB, {wall:.0f} s in all")
    command = "PYTHONPATH=. python3 benchmarks/link_read.py " + " ".join(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "wall_s": wall, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(f"{head}\n\n`{command}`\n\n{text}\n")
    print(f"\n{head}\n{text}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a bad model name
        raise SystemExit(f"link_read.py: error: {e}") from None
