"""Expert phase of one MoE block: grouped GEMMs vs the fused decode kernels (CUDA, decode sizes;
writescope/moe/fused_decode.py) vs the per-expert loop, and the fraction of routed experts on the
GPU (the rest computed on the CPU, or streamed to the GPU when an expert has at least
writescope.moe.streaming.MIN_TOKENS tokens), for a decode batch and a long prefill chunk.
Host experts are also run streamed whatever their tokens ("stream all", the decode default on
CUDA) and split between streaming and the CPU ("stream share": ``SparseMoeBlock.stream_share``).
(Until 0d63fa9 an opt-in pool of single-threaded CPU tasks was compared too, column "host
experts" = "parallel" in results/experts_h200_0d63fa9.md; it lost and was removed.)

Per configuration: median ms of the block's forward over --repeats runs (synchronised), the
bytes of the activated experts' weights, and against them
- on the device: GB/s and the fraction of the HBM bound (bytes / device copy GB/s, measured
  first in the same run);
- with every expert on the host: the CPU expert path's weight GB/s.
Weights are random (std 0.02), inputs random; routing is the block's own top-k.

Run (repository root):
    PYTHONPATH=. python3 benchmarks/experts.py --models qwen3-30b-a3b,deepseek-v2-lite --out benchmarks/results/experts_h200
    PYTHONPATH=. python3 benchmarks/experts.py --models tiny-qwen3-moe --device cpu --tokens 4,64 --repeats 3 --out /tmp/experts
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from writescope.engine.model_loader import parse_dtype, resolve_config, resolve_device
from writescope.engine.timing import synchronized_seconds
from writescope.moe import fused_decode
from writescope.moe.block import SparseMoeBlock
from writescope.moe.router import route
from writescope.moe.streaming import MIN_TOKENS

from layer_args import token_counts  # benchmarks/ (the script's folder)


def copy_gbs(device, nbytes=2**30, repeats=5) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    ts = [synchronized_seconds(lambda: b.copy_(a), device)[1] for _ in range(repeats)]
    return 2 * nbytes / statistics.median(ts) / 1e9


def timed(fn, device, repeats) -> float:
    fn()  # warm-up (packing, kernels)
    return statistics.median(synchronized_seconds(fn, device)[1] for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--tokens", default="16,16384", help="token counts: a decode batch, a prefill chunk")
    ap.add_argument("--fractions", default="1,0.75,0.5,0.25,0", help="fractions of routed experts on the device")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--stream-share", type=float, default=0.67,
                    help="for the 'stream share' path: fraction of the few-token host experts streamed while the CPU computes the rest")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    if not 0 < args.stream_share <= 1:
        ap.error(f"--stream-share must be in (0, 1], got {args.stream_share}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    tokens = token_counts(ap, args.tokens)
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    hbm = copy_gbs(device) if device.type == "cuda" else None
    rows = []
    for name in args.models.split(","):
        cfg, _ = resolve_config(name)
        block = SparseMoeBlock(cfg.moe, cfg.hidden_size, deepseek=cfg.model_type == "deepseek_v2").to(device, dtype)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0.0, 0.02)
        E, D, I = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
        expert_bytes = 3 * D * I * dtype.itemsize
        for T in tokens:
            x = torch.randn(T, D, device=device, dtype=dtype)
            _, ids = route(x, block.gate.weight, cfg.moe, block.deepseek)
            active = torch.unique(ids).tolist()
            for frac in (float(f) for f in args.fractions.split(",")):
                on_device = int(round(frac * E))
                block.offload_experts(range(on_device, E))
                share_path = f"grouped, stream share {args.stream_share:g}"
                for path in ("grouped", "fused", "grouped, no streaming", "grouped, stream all", share_path, "loop"):
                    if path not in ("grouped", "fused", "loop") and on_device == E:
                        continue  # nothing on the host to stream
                    if path == "fused" and (on_device < E or T * cfg.moe.top_k > fused_decode.MAX_ROWS or device.type != "cuda"):
                        continue  # the fused kernels: decode-sized, every expert on the GPU
                    os.environ["WRITESCOPE_MOE_KERNEL"] = "fused" if path == "fused" else "grouped"
                    block.grouped, block.packed = path != "loop", None
                    block.stream_min_tokens = {"grouped": MIN_TOKENS, share_path: MIN_TOKENS, "grouped, stream all": 1}.get(path)
                    block.stream_share = args.stream_share if path == share_path else 0.0
                    if path != "loop" and not block.pack() and (on_device > 0 or path == "grouped, no streaming" or device.type != "cuda"):
                        continue  # no grouped GEMM here; with every expert on the host, streaming still runs (CUDA)
                    host_mode = "cpu" if on_device < E and path != "grouped, stream all" else "-"  # some computed on the CPU
                    with torch.no_grad():
                        sec = timed(lambda: block(x), device, args.repeats)
                    dev_active = sum(1 for e in active if e < on_device)
                    host_active = len(active) - dev_active
                    row = {"model": name, "tokens": T, "fraction_on_device": frac, "path": path, "host_experts": host_mode,
                           "ms": sec * 1e3, "active_experts": len(active), "active_on_device": dev_active,
                           "active_on_host": host_active, "active_weight_bytes": len(active) * expert_bytes}
                    if hbm and host_active == 0:
                        bound = dev_active * expert_bytes / (hbm * 1e9)
                        row.update(hbm_gbs=hbm, gbs=dev_active * expert_bytes / sec / 1e9, frac_of_bound=bound / sec)
                    if dev_active == 0:
                        row["cpu_weight_gbs"] = host_active * expert_bytes / sec / 1e9
                    rows.append(row)
                    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"device": str(device), "dtype": str(dtype), "hbm_copy_gbs": hbm, "rows": rows}, indent=1))
    lines = ["| model | tokens | on device | path | host experts | ms | active experts (device/host) | GB/s | % of HBM bound | CPU weight GB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    def f(r, key, scale=1.0, fmt=".0f"):
        return "-" if key not in r else format(scale * r[key], fmt)

    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens']} | {r['fraction_on_device']:g} | {r['path']} | {r['host_experts']} | {r['ms']:.2f} | "
                     f"{r['active_on_device']}/{r['active_on_host']} | {f(r, 'gbs')} | {f(r, 'frac_of_bound', 100)} | "
                     f"{f(r, 'cpu_weight_gbs', fmt='.1f')} |")
    table = "\n".join(lines)
    args.out.with_suffix(".md").write_text(f"device {device}, {dtype}, device copy {hbm} GB/s\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a bad model name, device or dtype
        raise SystemExit(f"experts.py: error: {e}") from None
