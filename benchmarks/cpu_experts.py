"""Host experts on the CPU: the C++ kernel (writescope.moe.cpu_experts, each path this CPU offers)
against the old path, torch's bf16 GEMMs one ``GatedMLP`` after another, and against a plain read
of the same bytes.

Per model (expert shape D x I from its preset) and tokens per expert: one call computes
``--gb``'s worth of experts (at least one; every expert gets the same tokens, so all are read);
calls rotate over ``--sets`` weight sets (random bf16, std 0.02: never zeros; each set holds
>= 1 GB by default, more than any last-level cache). Reported: the median ms over ``--repeats``
calls after one warm-up call per set, the weight read rate (weight bytes / ms), the same run's
plain read rate of the same bytes with the same threads (a multi-threaded read in the extension),
and their ratio. Threads: ``--threads`` (default torch's count less one) for every path. With
``--busy N,...``: the best path again while N other processes spin on the cores, its units split
from a counter (the default) against one equal range per thread, calls taking turns.

Run (repository root):
    PYTHONPATH=. python3 benchmarks/cpu_experts.py --out benchmarks/results/cpu_experts_h200
    PYTHONPATH=. python3 benchmarks/cpu_experts.py --gb 0.25 --repeats 3 --out /tmp/cpu_experts   # a small machine
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from writescope.engine.threads import intra_op_threads
from writescope.layers.mlp import GatedMLP
from writescope.moe import cpu_experts
from writescope.presets import preset_config

from interference import Busy, timed_in_turns  # benchmarks/ (the script's folder)
from layer_args import token_counts

DTYPE = torch.bfloat16


def median_ms(fn, calls: int, repeats: int) -> float:
    """Median ms of ``fn(i)`` for i = calls, ..., calls + repeats - 1 (after the warm-up calls
    0 .. calls - 1 done by the caller)."""
    ts = []
    for i in range(calls, calls + repeats):
        t0 = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def weight_sets(n_sets: int, experts: int, D: int, I: int):
    """``n_sets`` of (w13 [E, 2I, D], w2 [E, D, I], the torch loop's GatedMLPs as views of them)."""
    sets = []
    for _ in range(n_sets):
        w13 = torch.empty(experts, 2 * I, D, dtype=DTYPE).normal_(0.0, 0.02)
        w2 = torch.empty(experts, D, I, dtype=DTYPE).normal_(0.0, 0.02)
        mlps = []
        for e in range(experts):
            with torch.device("meta"):  # no weights of its own: views of the set below
                m = GatedMLP(D, I)
            m.gate_proj.weight = torch.nn.Parameter(w13[e, :I], requires_grad=False)
            m.up_proj.weight = torch.nn.Parameter(w13[e, I:], requires_grad=False)
            m.down_proj.weight = torch.nn.Parameter(w2[e], requires_grad=False)
            mlps.append(m)
        sets.append((w13, w2, mlps))
    return sets


def bench_model(name: str, tokens: list[int], paths: list[str], args) -> list[dict]:
    cfg = preset_config(name)
    D, I = cfg.hidden_size, cfg.moe.intermediate_size
    expert_bytes = 3 * D * I * DTYPE.itemsize
    E = max(1, math.ceil(args.gb * 1e9 / expert_bytes))
    nbytes = E * expert_bytes
    sets = weight_sets(args.sets, E, D, I)
    rows = []
    for m in tokens:
        counts, slots = [m] * E, list(range(E))
        x = torch.randn(E * m, D).to(DTYPE)
        rw = torch.rand(E * m) + 0.1
        base = {"model": name, "D": D, "I": I, "experts": E, "weight_bytes": nbytes, "tokens_per_expert": m, "threads": args.threads}

        def read(i):
            w13, w2, _ = sets[i % len(sets)]
            cpu_experts.read_bytes(w13, args.threads)
            cpu_experts.read_bytes(w2, args.threads)

        for i in range(len(sets)):
            read(i)
        read_ms = median_ms(read, len(sets), args.repeats)
        read_gbs = nbytes / read_ms / 1e6
        for path in paths + ["torch loop"]:
            if path == "torch loop":
                def call(i):
                    _, _, mlps = sets[i % len(sets)]
                    with torch.inference_mode(), intra_op_threads(args.threads):
                        ys = [mlps[e](xe) for e, xe in zip(slots, x.split(counts))]
                        return torch.cat(ys) * rw[:, None].to(DTYPE)
                ran = "torch loop"
            else:
                os.environ[cpu_experts.ENV] = path

                def call(i):
                    w13, w2, _ = sets[i % len(sets)]
                    return cpu_experts.host_experts_forward(x, counts, w13, w2, slots, rw, threads=args.threads)
                ran = cpu_experts.path_for(DTYPE, D, I)
            for i in range(len(sets)):
                call(i)
            ms = median_ms(call, len(sets), args.repeats)
            gbs = nbytes / ms / 1e6
            row = dict(base, path=ran, ms=ms, gbs=gbs, read_ms=read_ms, read_gbs=read_gbs, ratio=gbs / read_gbs)
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        for n_busy in args.busy:
            os.environ[cpu_experts.ENV] = paths[0]
            ext, calls = cpu_experts._ext(), []
            for dynamic in (False, True):
                def call(dynamic=dynamic, turn=[0]):
                    ext.set_split(dynamic)
                    turn[0] += 1
                    w13, w2, _ = sets[turn[0] % len(sets)]
                    return cpu_experts.host_experts_forward(x, counts, w13, w2, slots, rw, threads=args.threads)
                calls.append(call)
            with Busy(n_busy):
                got = timed_in_turns(calls, args.repeats)
            ext.set_split(True)
            for dynamic, (med, lo, hi) in zip((False, True), got):
                label = f"{cpu_experts.path_for(DTYPE, D, I)}, {'dynamic' if dynamic else 'equal'} split, {n_busy} busy"
                row = dict(base, path=label, ms=med * 1e3, min_ms=lo * 1e3, max_ms=hi * 1e3, gbs=nbytes / med / 1e9,
                           read_ms=read_ms, read_gbs=read_gbs, ratio=nbytes / med / 1e9 / read_gbs, busy=n_busy)
                rows.append(row)
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    os.environ.pop(cpu_experts.ENV, None)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite,mixtral-8x7b")
    ap.add_argument("--tokens", default="1,4,16", help="tokens per expert")
    ap.add_argument("--threads", type=int, default=max(1, torch.get_num_threads() - 1))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gb", type=float, default=1.0, help="weight GB per call (rounded up to whole experts)")
    ap.add_argument("--sets", type=int, default=2, help="weight sets the calls rotate over")
    ap.add_argument("--paths", default="offered", help="kernel paths, comma-separated, or 'offered' (every path this CPU offers)")
    ap.add_argument("--busy", default="", help="comma-separated counts of spinning processes (e.g. 0,1): the best path's "
                    "units split from a counter and equally, calls taking turns, under each")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    try:
        args.busy = [int(b) for b in args.busy.split(",") if b.strip()]
    except ValueError:
        ap.error(f"--busy {args.busy!r}: use counts of processes, e.g. 0,1")
    if any(b < 0 for b in args.busy):
        ap.error(f"--busy must be >= 0, got {args.busy}")
    for key in ("threads", "repeats", "sets"):
        if getattr(args, key) < 1:
            ap.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.gb <= 0:
        ap.error(f"--gb must be > 0, got {args.gb}")
    tokens = token_counts(ap, args.tokens)
    os.environ.pop(cpu_experts.ENV, None)
    if not cpu_experts.kernel_available():
        raise SystemExit("cpu_experts.py: error: the host-expert kernel could not be built")
    best = cpu_experts.best_path()
    offered = list(cpu_experts.PATHS[: cpu_experts.PATHS.index(best) + 1])[::-1]  # e.g. amx, avx512bf16, portable
    paths = offered if args.paths == "offered" else args.paths.split(",")
    bad = [p for p in paths if p not in offered]
    if bad:
        ap.error(f"--paths {','.join(bad)}: this CPU offers {','.join(offered)}")
    t0 = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        rows += bench_model(name, tokens, paths, args)
    wall = time.perf_counter() - t0
    meta = {"threads": args.threads, "repeats": args.repeats, "sets": args.sets, "gb": args.gb, "best_path": best,
            "cpu": next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")), "?"),
            "wall_s": wall}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = ["| model | D x I | experts x GB | tokens/expert | path | ms | weight GB/s | plain read GB/s | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['D']} x {r['I']} | {r['experts']} x {r['weight_bytes'] / r['experts'] / 1e9:.3f} | "
                     f"{r['tokens_per_expert']} | {r['path']} | {r['ms']:.2f} | {r['gbs']:.1f} | {r['read_gbs']:.1f} | {r['ratio']:.2f} |")
    table = "\n".join(lines)
    head = f"{meta['cpu']}, {args.threads} threads, median of {args.repeats} calls over {args.sets} weight sets, {wall:.0f} s in all"
    command = "PYTHONPATH=. python3 benchmarks/cpu_experts.py " + " ".join(sys.argv[1:])
    args.out.with_suffix(".md").write_text(f"{head}\n\n`{command}`\n\n{table}\n")
    print(f"\n{head}\n{table}")


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a bad model name
        raise SystemExit(f"cpu_experts.py: error: {e}") from None
