"""Time the synthetic weight build of a model shape on this machine: the build
``writescope profile --model M --num-layers N`` does before its first step.

    PYTHONPATH=. python benchmarks/synthetic_build.py --model qwen3-30b-a3b --num-layers 2 [--dtype fp32] [--device cpu]

Prints the time of ``load_model`` (model allocated on the device, every tensor filled, the
tokenizer read), of the fill alone on a second pass over the now touched memory, and the GB/s.
On the 2-core CPU machine (other jobs beside it; issue 19), Qwen3-30B-A3B's 2 layers in float32
(1.87 G parameters, 7.47 GB): before the pool build, the per-element hash took 192.6 s and 284.0 s
(0.039 and 0.026 GB/s, two runs of load_model); after, 14.0-19.5 s (four runs), of which the first
touch of the fresh pages is most (the second fill: 1.5-3.8 s).
"""

from __future__ import annotations

import argparse
import time

import torch

from writescope.checkpoint.synthetic import fill_synthetic
from writescope.engine.model_loader import load_model, parse_dtype, resolve_device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    t0 = time.perf_counter()
    _, net, _, _ = load_model(args.model, True, dtype, device, 0, False, args.num_layers)
    t_load = time.perf_counter() - t0
    n = sum(p.numel() for p in net.state_dict().values())
    t0 = time.perf_counter()
    fill_synthetic(net, 0, progress=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_fill = time.perf_counter() - t0
    gb = n * dtype.itemsize / 1e9
    print(f"{args.model} --num-layers {args.num_layers}, {dtype} on {device}, torch threads {torch.get_num_threads()}: "
          f"{n / 1e9:.2f} G parameters ({gb:.2f} GB); load_model {t_load:.1f} s ({gb / t_load:.3f} GB/s); "
          f"fill again (touched pages) {t_fill:.1f} s ({gb / t_fill:.2f} GB/s)")


if __name__ == "__main__":
    main()
