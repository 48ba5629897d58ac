"""Prefill with write-time routing vs writing everything to one region (issue 3's target: within 1%).

One attention layer of Qwen3-30B-A3B shape (32 q heads, 4 KV heads, head_dim 128, bf16) by
default. Three caches are made side by side per context, one per CPU share: R = 0 (every prompt
block to the load region), R = 0.5 (routed: the share's blocks to the compute region, the rest to
the load region) and R = 1 (every block to the compute region). Each round prefills the whole batch
(one sequence per call, as the engine does) into each cache in turn, in a rotated order so that no
share always goes first; the time counts from the first call until every KV write has landed
(device synchronised, the compute region's background writes flushed). Slots are allocated before
and freed after the timed part. Reported: median and min over rounds of ms per sequence, and the
routed median against the faster of the two single-region medians.

    PYTHONPATH=. python3 benchmarks/prefill_routing.py --out benchmarks/results/prefill_routing_h200

The same random q, k, v (normal, seeded) are used for every sequence: the values do not change the
work, and generating them is kept out of the timed part.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from writescope.attention.metadata import ForwardBatch
from writescope.config import KVLayout
from writescope.engine.timing import synchronized_seconds
from writescope.kvcache.inplace import InplaceKVCache
from writescope.kvcache.spec import PartitionSpec
from writescope.scheduler.policies import StaticPolicy

from layer_args import layer_parser  # benchmarks/ (the script's folder)

SHARES = (0.0, 0.5, 1.0)


def parse_args():
    p = layer_parser(__doc__)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per (context, share); a first round is warm-up")
    p.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    return p.parse_args()


def batch_prefill_s(cache: InplaceKVCache, L: int, B: int, qkv, scale: float, dev) -> float:
    """Seconds to prefill B sequences of L tokens into ``cache`` until every write has landed."""
    slots = [cache.allocate(L + 1, prompt_len=L) for _ in range(B)]

    def run():
        for s in slots:
            cache.attend(0, *qkv, ForwardBatch.build([s], [L], [0], dev), scale)
        cache.flush_writes()

    _, dt = synchronized_seconds(run, dev)
    for s in slots:
        cache.free(s)
    return dt


def main():
    args = parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    torch.set_num_threads(args.cpu_threads)
    layout = KVLayout(args.kv_heads, args.head_dim, args.head_dim, False)
    spec = PartitionSpec(layout, 1, dtype, window=args.window)
    rows, t_start = [], time.perf_counter()
    for L in [int(c) for c in args.contexts.split(",")]:
        g = torch.Generator(device=dev).manual_seed(L)
        qkv = [torch.randn(L, h, args.head_dim, device=dev, dtype=dtype, generator=g) for h in (args.q_heads, args.kv_heads, args.kv_heads)]
        caches = {r: InplaceKVCache(spec, StaticPolicy(r), dev, cpu_threads=args.cpu_threads) for r in SHARES}
        times: dict[float, list[float]] = {r: [] for r in SHARES}
        for rnd in range(args.rounds + 1):
            order = SHARES[rnd % 3 :] + SHARES[: rnd % 3]
            for r in order:
                dt = batch_prefill_s(caches[r], L, args.batch, qkv, args.head_dim**-0.5, dev)
                if rnd > 0:
                    times[r].append(dt / args.batch)
        for c in caches.values():
            c.close()
        med = {r: statistics.median(times[r]) for r in SHARES}
        best_single = min(med[0.0], med[1.0])
        row = {"context": L, "ms_per_seq": {str(r): med[r] * 1e3 for r in SHARES},
               "min_ms_per_seq": {str(r): min(times[r]) * 1e3 for r in SHARES},
               "all_ms_per_seq": {str(r): [t * 1e3 for t in times[r]] for r in SHARES},
               "routed_vs_best_single": med[0.5] / best_single - 1}
        rows.append(row)
        print(f"L={L:>6}  " + "  ".join(f"R={r}: {med[r] * 1e3:6.2f} ms/seq" for r in SHARES)
              + f"  routed {100 * row['routed_vs_best_single']:+.1f}%", flush=True)
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "rows": rows, "wall_s": time.perf_counter() - t_start}
    md = render(doc)
    print("\n" + md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
        args.out.with_suffix(".md").write_text(md)


def render(doc) -> str:
    a = doc["args"]
    out = [f"Prefill of one layer, batch {a['batch']} (one sequence per call), until every KV write has landed: "
           f"ms per sequence, median of {a['rounds']} interleaved rounds (min in brackets)", "",
           "| L | R = 0 (all load region) | R = 0.5 (routed) | R = 1 (all compute region) | routed vs best single region |",
           "|---|---|---|---|---|"]
    for row in doc["rows"]:
        cells = [f"{row['ms_per_seq'][str(r)]:.2f} ({row['min_ms_per_seq'][str(r)]:.2f})" for r in SHARES]
        out.append(f"| {row['context'] // 1024}K | " + " | ".join(cells) + f" | {100 * row['routed_vs_best_single']:+.1f}% |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
