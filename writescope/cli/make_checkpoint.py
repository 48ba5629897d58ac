"""``writescope make-checkpoint``: a synthetic Hugging Face checkpoint for a preset."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("make-checkpoint", help="write a synthetic HF checkpoint (real config, seeded weights, trained tokenizer)")
    p.add_argument("--preset", required=True, help="preset name, e.g. tiny-qwen3-moe or deepseek-v2-lite")
    p.add_argument("--out", required=True, type=Path, help="output directory (must not hold a checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights (default 0)")
    p.add_argument("--dtype", default="bf16", help="bf16 (default), fp16, fp32, or auto (fp32, as on the CPU)")
    p.add_argument("--max-shard-gib", type=float, default=4.0, help="largest safetensors shard (GiB)")
    p.add_argument("--device", default="cpu",
                   help="where the seeded values are generated: cpu (default) or cuda (the same values, far faster for full-size presets)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import math
    import shutil

    import torch

    from writescope.checkpoint.synthetic import synthetic_tensors
    from writescope.checkpoint.tokenizer import synthetic_tokenizer
    from writescope.checkpoint.writer import INDEX_NAME, SINGLE_NAME, checkpoint_bytes, write_checkpoint
    from writescope.cli.outputs import check_output_dir
    from writescope.engine.model_loader import DTYPES, parse_dtype, resolve_device
    from writescope.models import LAYER_BUILDERS
    from writescope.models.causal_lm import CausalLM
    from writescope.presets import preset_config

    cfg = preset_config(args.preset)
    if not (args.max_shard_gib > 0 and math.isfinite(args.max_shard_gib)):
        raise ValueError(f"--max-shard-gib must be a size in GiB above 0, got {args.max_shard_gib}: e.g. 4 (the default) "
                         "or 0.5 for smaller files")
    check_output_dir(args.out, "--out")  # before the weights are built, not after
    if (args.out / SINGLE_NAME).exists() or (args.out / INDEX_NAME).exists():
        raise FileExistsError(f"--out {args.out} already holds a checkpoint: choose a new --out directory or delete it")
    dtype = parse_dtype(args.dtype, torch.device("cpu"))
    device = resolve_device(args.device)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(cfg, LAYER_BUILDERS[cfg.model_type]).state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    need = checkpoint_bytes(shapes, dtype)
    args.out.mkdir(exist_ok=True)
    free = shutil.disk_usage(args.out).free
    if need > free:
        raise ValueError(f"{args.preset} in {dtype} needs {need / 1e9:.1f} GB but {args.out} has {free / 1e9:.1f} GB free")
    t0 = time.perf_counter()
    tok = synthetic_tokenizer(cfg.vocab_size)
    write_checkpoint(
        args.out, cfg, synthetic_tensors(shapes, args.seed, dtype, device), len(shapes), dtype, tok,
        max_shard_bytes=int(args.max_shard_gib * 2**30), progress=not args.quiet,
    )
    name = next(k for k, v in DTYPES.items() if v == dtype) + (f" (--dtype {args.dtype})" if args.dtype not in DTYPES else "")
    print(f"wrote {args.out}: {len(shapes)} tensors, {need / 1e6:,.1f} MB {name}, tokenizer of {tok.vocab_size} tokens, "
          f"{time.perf_counter() - t0:.1f} s")
    return 0
