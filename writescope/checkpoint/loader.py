"""Load safetensors weights from a Hugging Face checkpoint directory into a model.

Layout accepted: ``model.safetensors`` (single file) or ``model.safetensors.index.json`` with
its shards; tensors in bf16, fp16 or fp32 are converted to the model's dtype on load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from writescope.models.causal_lm import CausalLM

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; recomputed here


class CheckpointError(ValueError):
    """The checkpoint directory does not match the model (message lists every problem)."""


def shard_map(ckpt_dir: Path) -> dict[str, Path]:
    """tensor name -> shard file.

    Raises:
        CheckpointError: no weights, an unreadable index, or a shard named by the index missing.
    """
    index = ckpt_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from e
        missing = sorted({f for f in weight_map.values() if not (ckpt_dir / f).is_file()})
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are not in {ckpt_dir}: {', '.join(missing)}")
        return {k: ckpt_dir / f for k, f in weight_map.items()}
    single = ckpt_dir / SINGLE_NAME
    if single.is_file():
        return {k: single for k in _shapes(single)}
    raise CheckpointError(f"no {SINGLE_NAME} or {INDEX_NAME} in {ckpt_dir}")


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """tensor name -> shape of one safetensors file (header only).

    Raises:
        CheckpointError: the file cannot be read (the message names it).
    """
    try:
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"cannot read safetensors file {path}: {e}. Re-download or re-create it.") from e


def validate(model: CausalLM, names: dict[str, Path]) -> None:
    """Compare checkpoint tensors with the model's parameters.

    Raises:
        CheckpointError: one message listing missing, unexpected, mis-shaped and wrongly indexed tensors.
    """
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    # count a tensor only where load_weights will read it: in the shard the index names for it
    held = {path: _shapes(path) for path in sorted(set(names.values()))}
    found = {k: held[p][k] for k, p in names.items() if k in held[p]}
    misindexed = sorted(f"{k} (not in {p.name})" for k, p in names.items() if k not in held[p])
    for k in list(found):
        if k.endswith(IGNORED_SUFFIXES):
            found.pop(k)
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = sorted(f"{k}: checkpoint {found[k]} vs model {expected[k]}" for k in set(found) & set(expected) if found[k] != expected[k])
    if missing or unexpected or misshaped or misindexed:
        parts = []
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped), ("wrongly indexed", misindexed)):
            if items:
                shown = items[:20] + ([f"... and {len(items) - 20} more"] if len(items) > 20 else [])
                parts.append(f"{len(items)} {title} tensor(s):\n  " + "\n  ".join(shown))
        raise CheckpointError(f"checkpoint does not match {model.config.architecture}:\n" + "\n".join(parts))


def load_weights(model: CausalLM, ckpt_dir: str | Path, progress: bool = True) -> None:
    """Validate, then copy every tensor into the model (converted to its dtype and device).

    Raises:
        CheckpointError: see :func:`shard_map` and :func:`validate`.
    """
    ckpt_dir = Path(ckpt_dir)
    names = shard_map(ckpt_dir)
    validate(model, names)
    params = model.state_dict()
    by_file: dict[Path, list[str]] = {}
    for k, f in names.items():
        if k in params:
            by_file.setdefault(f, []).append(k)
    bar = tqdm(total=len(params), desc="loading weights", unit="tensor", disable=not progress)
    with torch.no_grad():
        for path, keys in sorted(by_file.items()):
            with safe_open(str(path), "pt", device="cpu") as f:
                for k in keys:
                    params[k].copy_(f.get_tensor(k))
                    bar.update(1)
    bar.close()
