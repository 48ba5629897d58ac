"""One decode-attention layer over InplaceKVCache: ms per layer vs CPU share, and prefill routing.

Qwen3-30B-A3B attention shape by default (32 q heads, 4 KV heads, head_dim 128, bf16), batch 16,
contexts 8K/16K/32K. For each context and each CPU share R in {0, 1/16, ..., 1} (R = 0 is the
``gpu`` policy, R = 1 the ``cpu`` policy): prefill random KV through the cache (write-time
routing places it), then time decode steps (one new token per sequence, appended to the
D-window; windows evicted as they fill). Prints medians, achieved GB/s and the fraction of the
bound; writes JSON, a markdown table and a plot.

    python benchmarks/split_attention.py --out benchmarks/results/split_attention_h200

Bound per layer step: placed KV bytes / (H2D GB/s + CPU read GB/s) when both paths read at
their raw rates at once (docs/HARDWARE.md: 55 + 86 GB/s on the H200 machine).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from writescope.attention.metadata import ForwardBatch
from writescope.config import KVLayout
from writescope.engine.timing import synchronize, synchronized_seconds
from writescope.kvcache.inplace import InplaceKVCache
from writescope.kvcache.spec import PartitionSpec
from writescope.scheduler.policies import StaticPolicy

from layer_args import layer_parser  # benchmarks/ (the script's folder)


def parse_args():
    p = layer_parser(__doc__)
    p.add_argument("--shares", type=int, default=16, help="R in {0, 1/N, ..., 1} (default N = 16)")
    p.add_argument("--steps", type=int, default=15, help="timed decode steps per configuration")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--shares-list", default=None, help="explicit comma-separated R values (overrides --shares)")
    p.add_argument("--cpu-inline", action="store_true", help="CPU attention on the calling thread instead of a worker")
    p.add_argument("--h2d-gbs", type=float, default=55.0, help="pinned host-to-device GB/s (HARDWARE.md)")
    p.add_argument("--cpu-gbs", type=float, default=86.0, help="CPU read GB/s, 16 threads (HARDWARE.md)")
    p.add_argument("--num-layers-model", type=int, default=48, help="layers of the model, for the GPU-resident fraction")
    p.add_argument("--out", type=Path, default=None, help="write OUT.json, OUT.md and OUT.png")
    return p.parse_args()


def run_config(args, L: int, share: float, dev: torch.device, dtype):
    layout = KVLayout(args.kv_heads, args.head_dim, args.head_dim, False)
    spec = PartitionSpec(layout, 1, dtype, window=args.window)
    cache = InplaceKVCache(spec, StaticPolicy(share), dev, cpu_threads=args.cpu_threads, cpu_inline=args.cpu_inline)
    B, Hq, d = args.batch, args.q_heads, args.head_dim
    n_steps = args.warmup + args.steps
    t0 = time.perf_counter()
    slots = [cache.allocate(L + n_steps, prompt_len=L) for _ in range(B)]
    alloc_s = time.perf_counter() - t0
    g = torch.Generator(device=dev).manual_seed(int(share * 1000) + L)
    scale = d**-0.5
    prefill_s = []
    t_all = time.perf_counter()
    for s in slots:  # one sequence per prefill call bounds the attention temporaries
        q = torch.randn(L, Hq, d, device=dev, dtype=dtype, generator=g)
        k = torch.randn(L, args.kv_heads, d, device=dev, dtype=dtype, generator=g)
        v = torch.randn(L, args.kv_heads, d, device=dev, dtype=dtype, generator=g)
        prefill_s.append(synchronized_seconds(lambda: cache.attend(0, q, k, v, ForwardBatch.build([s], [L], [0], dev), scale), dev)[1])
        del q, k, v
    cache.flush_writes()  # compute-region writes land in the background: the batch's prefill ends when they have
    synchronize(dev)
    prefill_all_s = time.perf_counter() - t_all
    times = []
    for step in range(n_steps):
        q = torch.randn(B, Hq, d, device=dev, dtype=dtype, generator=g)
        k = torch.randn(B, args.kv_heads, d, device=dev, dtype=dtype, generator=g)
        v = torch.randn(B, args.kv_heads, d, device=dev, dtype=dtype, generator=g)
        batch = ForwardBatch.build(slots, [1] * B, [L + step] * B, dev)
        _, dt = synchronized_seconds(lambda: cache.attend(0, q, k, v, batch, scale), dev)
        if step >= args.warmup:
            times.append(dt)
    seqs = [cache.sequence(s) for s in slots]
    comp = sum(sq.n_comp[0] for sq in seqs) * args.window
    load = sum(sq.n_load[0] for sq in seqs) * args.window
    win = sum(sq.win_len[0] for sq in seqs)
    cache.close()
    med = statistics.median(times)
    kv_bytes = (comp + load + win) * spec.token_bytes
    bound = kv_bytes / ((args.h2d_gbs + args.cpu_gbs) * 1e9)
    return {
        "context": L, "share": share, "ms": med * 1e3, "ms_min": min(times) * 1e3, "ms_max": max(times) * 1e3,
        "placed_cpu_share": comp / max(1, comp + load), "kv_bytes": kv_bytes, "gbs": kv_bytes / med / 1e9,
        "bound_ms": bound * 1e3, "frac_of_bound": bound / med, "prefill_ms_per_seq": statistics.median(prefill_s) * 1e3,
        "prefill_batch_ms_per_seq": prefill_all_s / B * 1e3,
        "allocate_ms_per_seq": alloc_s / B * 1e3,
        "tokens": {"compute": comp, "load": load, "window": win},
    }


def main():
    args = parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    torch.set_num_threads(args.cpu_threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    shares = [float(x) for x in args.shares_list.split(",")] if args.shares_list else [i / args.shares for i in range(args.shares + 1)]
    rows = []
    t_start = time.perf_counter()
    run_config(args, contexts[0], 0.5, dev, dtype)  # warm-up (kernel and allocator first-use costs), discarded
    for L in contexts:
        for r in shares:
            row = run_config(args, L, r, dev, dtype)
            rows.append(row)
            print(f"L={L:>6} R={r:.4f}  {row['ms']:7.2f} ms  {row['gbs']:6.1f} GB/s  {100 * row['frac_of_bound']:5.1f}% of bound  "
                  f"prefill {row['prefill_ms_per_seq']:.1f} ms/seq  placed r={row['placed_cpu_share']:.3f}", flush=True)
    spec = PartitionSpec(KVLayout(args.kv_heads, args.head_dim, args.head_dim, False), args.num_layers_model, dtype, window=args.window)
    resident = []
    for L in contexts:
        total = args.batch * L * args.num_layers_model * spec.token_bytes
        gpu = spec.window_bytes(args.batch) + spec.pingpong_total_bytes()
        resident.append({"context": L, "kv_gib": total / 2**30, "gpu_mib": gpu / 2**20, "fraction": gpu / total,
                         "window_only_fraction": args.window / L})
    doc = {"args": {k: str(v) for k, v in vars(args).items()}, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "rows": rows, "gpu_resident": resident, "wall_s": time.perf_counter() - t_start}
    md = render(doc, contexts, shares)
    print("\n" + md)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
        args.out.with_suffix(".md").write_text(md)
        plot(rows, contexts, args.out.with_suffix(".png"))


def render(doc, contexts, shares) -> str:
    rows = doc["rows"]
    by = {(r["context"], r["share"]): r for r in rows}
    mode = "calling thread (--cpu-inline)" if doc["args"]["cpu_inline"] == "True" else "worker thread"
    out = [f"ms per layer step (median of {doc['args']['steps']}), batch {doc['args']['batch']}, CPU attention on the {mode}; "
           "achieved GB/s and % of the bound in brackets", "",
           "| R | " + " | ".join(f"L = {L // 1024}K" for L in contexts) + " |", "|---|" + "---|" * len(contexts)]
    for r in shares:
        cells = [f"{by[(L, r)]['ms']:.2f} ({by[(L, r)]['gbs']:.0f} GB/s, {100 * by[(L, r)]['frac_of_bound']:.0f}%)" for L in contexts]
        name = {0.0: "0 (gpu)", 1.0: "1 (cpu)"}.get(r, f"{r:.4f}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    if not {0.0, 0.5, 1.0} <= set(shares):
        return "\n".join(out) + "\n"
    out += ["", "| L | best R | ms at best | gpu (R=0) ms | cpu (R=1) ms | speedup vs best of gpu/cpu |", "|---|---|---|---|---|---|"]
    for L in contexts:
        best = min((by[(L, r)] for r in shares), key=lambda x: x["ms"])
        g, c = by[(L, 0.0)]["ms"], by[(L, 1.0)]["ms"]
        out.append(f"| {L // 1024}K | {best['share']:.4f} | {best['ms']:.2f} | {g:.2f} | {c:.2f} | {min(g, c) / best['ms']:.2f}x |")
    out += ["", "Prefill, one layer, ms per sequence: the whole batch's prefill (one sequence per call, attention + KV",
            "writes, until the background compute-region writes have landed) / batch; in brackets the median of one",
            "call alone, then allocate (regions made, load region registered) per sequence:", "",
            "| L | R = 0 (all load region) | R = 0.5 (routed) | R = 1 (all compute region) | routed vs best single region |",
            "|---|---|---|---|---|"]
    for L in contexts:
        a, m, c = (by[(L, r)].get("prefill_batch_ms_per_seq", by[(L, r)]["prefill_ms_per_seq"]) for r in (0.0, 0.5, 1.0))
        one = [by[(L, r)]["prefill_ms_per_seq"] for r in (0.0, 0.5, 1.0)]
        al = [by[(L, r)]["allocate_ms_per_seq"] for r in (0.0, 0.5, 1.0)]
        out.append(f"| {L // 1024}K | {a:.1f} ({one[0]:.1f}; {al[0]:.1f}) | {m:.1f} ({one[1]:.1f}; {al[1]:.1f}) | "
                   f"{c:.1f} ({one[2]:.1f}; {al[2]:.1f}) | {100 * (m / min(a, c) - 1):+.1f}% |")
    out += ["", "GPU memory of the format as a fraction of all KV, whole model (D-windows hold the GPU-resident KV,",
            "D / L of it; ping-pong buffers are transient staging):", "",
            "| L | all KV (GiB) | D-windows + ping-pong (MiB) | fraction | D-windows alone (D / L) |", "|---|---|---|---|---|"]
    for g in doc["gpu_resident"]:
        out.append(f"| {g['context'] // 1024}K | {g['kv_gib']:.1f} | {g['gpu_mib']:.0f} | {100 * g['fraction']:.2f}% | "
                   f"{100 * g['window_only_fraction']:.2f}% |")
    return "\n".join(out) + "\n"


def plot(rows, contexts, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for L in contexts:
        pts = sorted((r["share"], r["ms"]) for r in rows if r["context"] == L)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"L = {L // 1024}K")
    ax.set_xlabel("CPU share R (0 = gpu policy, 1 = cpu policy)")
    ax.set_ylabel("ms per layer step (median)")
    ax.set_title("Split decode attention, one layer")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
