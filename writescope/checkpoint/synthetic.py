"""Seeded synthetic weights, identical on every device, with scales that keep activations sane.

Values come from a counter-based integer hash (element index, tensor name, seed), so the same
seed gives bit-identical weights on CPU and CUDA, generated directly on the target device in
chunks, without a host copy: full-size models (31-93 GB) are built in GPU memory this way.

Scales (uniform distributions with these standard deviations):
- linear weights ``[out, in]``: 1/sqrt(in), so a unit-variance input gives unit-variance output;
- embeddings: 1; RMSNorm weights: 1 ± 0.1 (uniform), so loading them is exercised.
"""

from __future__ import annotations

import math
import zlib
from typing import Iterator

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_MIX = 0x045D9F3B  # < 2^27: products with 32-bit values stay below 2^63 in int64
CHUNK = 1 << 24  # elements generated per step (bounds int64 scratch at 128 MiB)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """An avalanche hash of int64 values in [0, 2^32) (two multiply-xorshift rounds)."""
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def seeded_uniform(name: str, shape: tuple[int, ...], seed: int, std: float, dtype: torch.dtype, device, mean: float = 0.0) -> torch.Tensor:
    """A tensor of ``shape`` with values uniform on mean ± std·sqrt(3), determined by
    (name, seed) alone. 24 random bits per value; the result is exact across devices."""
    key = (zlib.crc32(name.encode()) ^ (seed * _GOLDEN)) & _MASK32
    key2 = zlib.crc32(f"{seed}:{name}".encode()) & _MASK32
    n = math.prod(shape)
    out = torch.empty(n, dtype=dtype, device=device)
    half_width = std * math.sqrt(3.0)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        idx = torch.arange(start, stop, dtype=torch.int64, device=device)
        x = _hash32((idx & _MASK32) ^ key)
        x = _hash32(x ^ (((idx >> 32) + key2) & _MASK32))
        u = (x >> 8).to(torch.float32) * (1.0 / (1 << 24))  # [0, 1), exact
        out[start:stop] = ((u * 2.0 - 1.0) * half_width + mean).to(dtype)
    return out.view(shape)


def param_std(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
    """(mean, std) of the synthetic value for a checkpoint tensor name."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1 / math.sqrt(3.0)
    if "embed_tokens" in name:
        return 0.0, 1.0
    if len(shape) == 2:
        return 0.0, 1.0 / math.sqrt(shape[1])
    return 0.0, 0.02  # biases


def synthetic_tensors(shapes: dict[str, tuple[int, ...]], seed: int, dtype: torch.dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every checkpoint tensor name, in the order given."""
    for name, shape in shapes.items():
        mean, std = param_std(name, shape)
        yield name, seeded_uniform(name, shape, seed, std, dtype, device, mean)


@torch.no_grad()
def fill_synthetic(model: torch.nn.Module, seed: int, progress: bool = True) -> None:
    """Overwrite every parameter of ``model`` with its seeded synthetic value, in place.

    Parameters in host memory of a model that also has CUDA parameters (routed experts placed on
    the host by a budget) are generated on that GPU and copied down: the values are identical on
    every device, and the hash generator is slow on a CPU (0.025 GB/s on the 2-core CI machine, command in benchmarks/results/e2e.md:
    Qwen3-30B-A3B's 27 GB of host experts under a 32 GiB budget would take minutes; a profile of
    that configuration on the H200 did not finish in 150 s, likely for this).
    """
    from tqdm import tqdm

    params = model.state_dict()
    gpu = next((v.device for v in params.values() if v.device.type == "cuda"), None)
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    if getattr(model.config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    bar = tqdm(total=len(shapes), desc="synthetic weights", unit="tensor", disable=not progress)
    for name, shape in shapes.items():
        p = params[name]
        mean, std = param_std(name, shape)
        where = gpu if gpu is not None and p.device.type == "cpu" else p.device
        p.copy_(seeded_uniform(name, shape, seed, std, p.dtype, where, mean))
        bar.update(1)
    bar.close()
