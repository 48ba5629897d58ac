"""Write a Hugging Face checkpoint directory: config.json, safetensors (sharded with an index
when larger than one shard), tokenizer.json. Tensor names are the published checkpoints'
(one tensor per expert)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from writescope.checkpoint.loader import INDEX_NAME, SINGLE_NAME
from writescope.checkpoint.tokenizer import Tokenizer
from writescope.config import ModelConfig

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def write_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    total: int,
    dtype: torch.dtype,
    tokenizer: Tokenizer | None,
    max_shard_bytes: int = 4 << 30,
    progress: bool = True,
) -> Path:
    """Stream ``tensors`` into shards of at most ``max_shard_bytes`` (a single tensor larger
    than that gets its own shard) and write the index, config and tokenizer.

    Args:
        total: number of tensors (for the progress bar).

    Returns the directory. Raises ``FileExistsError`` if it already holds a checkpoint.
    """
    out = Path(out_dir)
    if (out / SINGLE_NAME).exists() or (out / INDEX_NAME).exists():
        raise FileExistsError(f"{out} already holds a checkpoint: choose a new --out directory or delete it")
    out.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}  # the shard being filled
    files: list[Path] = []
    weight_map: dict[str, int] = {}  # tensor name -> shard number
    total_bytes = shard_bytes = 0

    def flush() -> None:
        path = out / f"model-{len(files) + 1:05d}.safetensors.part"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(path), metadata={"format": "pt"})
        files.append(path)
        shard.clear()

    bar = tqdm(total=total, desc="writing tensors", unit="tensor", disable=not progress)
    for name, t in tensors:
        t = t.to(dtype).cpu()
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
            shard_bytes = 0
        shard[name] = t
        shard_bytes += nbytes
        total_bytes += nbytes
        weight_map[name] = len(files)
        bar.update(1)
    if shard:
        flush()
    bar.close()
    n = len(files)
    if n == 1:
        files[0].rename(out / SINGLE_NAME)
    else:
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for f, final in zip(files, names):
            f.rename(out / final)
        index = {"metadata": {"total_size": total_bytes}, "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
        (out / INDEX_NAME).write_text(json.dumps(index, indent=2))
    hf = cfg.hf_dict()
    hf["torch_dtype"] = DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    if tokenizer is not None:
        tokenizer.save(out / "tokenizer.json")
    for f in out.iterdir():
        f.chmod(0o644)
    return out


def checkpoint_bytes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> int:
    """Bytes the weights take on disk in ``dtype``."""
    return sum(math.prod(s) for s in shapes.values()) * dtype.itemsize
