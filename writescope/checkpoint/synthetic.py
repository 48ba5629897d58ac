"""Seeded synthetic weights, identical on every device, with scales that keep activations sane.

Values are rows cut from a pool of ``POOL`` = 2^24 seeded values (one pool per seed and device,
made once): row ``r`` of a tensor whose rows (last dimension) have ``L`` elements is
``pool[o_r : o_r + L]`` with ``o_r = (a r + b) mod POOL``, ``a`` odd in [L, 2L] and ``b``
hashed from (tensor name, seed). The map is one-to-one for ``r < POOL``, so no two rows of a
tensor are the same; consecutive rows are disjoint stretches of the pool, so a tensor is a few
strided copies with the scale applied (memory bound: one pass per tensor, no per-element
hashing). Rows of two tensors coincide only where their maps meet (about rows_1 x rows_2 /
2^24 rows per pair of tensors of one row length; about 0.04 between two experts of Qwen3-30B-A3B).
On the 2-core CPU machine the build of ``profile --model qwen3-30b-a3b --num-layers 2`` (1.87 G
float32 values) took 14-20 s, most of it the first touch of fresh memory, against 193-284 s for
the per-element hash this replaced (``benchmarks/synthetic_build.py``; other jobs ran beside both).

The pool comes from a counter-based integer hash (element index, seed), computed in chunks that
stay in cache; rows longer than ``MAX_ROW`` are hashed per element the same way, keyed by the
tensor's name. Integer hashing, copies, the float32 scale and the cast round the same way on CPU
and CUDA, so the same seed gives bit-identical weights on both, generated directly on the target
device without a host copy: full-size models (31-93 GB) are built in GPU memory this way.

Scales (uniform distributions with these standard deviations):
- linear weights ``[out, in]``: 1/sqrt(in), so a unit-variance input gives unit-variance output;
- embeddings: 1; RMSNorm weights: 1 ± 0.1 (uniform), so loading them is exercised.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Iterator

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B1
_MIX = 0x045D9F3B  # < 2^27: products with 32-bit values stay below 2^63 in int64
CHUNK = 1 << 24  # elements hashed per step on CUDA
SCRATCH = 1 << 20  # float32 elements scaled per step before the cast of a non-float32 build (4 MiB: stays in cache)
HASH_CHUNK = 1 << 15  # elements hashed per step: int64 scratch that stays in cache (one thread: no fork-join per op)
POOL_BITS = 24
POOL = 1 << POOL_BITS  # distinct values per seed and device (64 MiB of float32)
MAX_ROW = 1 << 16  # longest row cut from the pool; longer rows are hashed per element


def _hash32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """An avalanche hash of int64 values in [0, 2^32), in place (two multiply-xorshift rounds);
    ``tmp`` is scratch of ``x``'s shape."""
    for _ in range(2):
        torch.bitwise_right_shift(x, 16, out=tmp)
        x.bitwise_xor_(tmp).mul_(_MIX).bitwise_and_(_MASK32)
    torch.bitwise_right_shift(x, 16, out=tmp)
    return x.bitwise_xor_(tmp)


def _keys(name: str, seed: int) -> tuple[int, int]:
    return (zlib.crc32(name.encode()) ^ (seed * _GOLDEN)) & _MASK32, zlib.crc32(f"{seed}:{name}".encode()) & _MASK32


def _hashed_unit(n: int, key: int, key2: int, device, begin: int = 0, end: int | None = None) -> torch.Tensor:
    """Elements ``begin:end`` (default: all ``n``) of ``n`` float32 values uniform on [-1, 1) in
    steps of 2^-23 (exact), element i from the hash of (i, key, key2): a float32 tensor
    ``[end - begin]`` on ``device``, the same bits on every device."""
    end = n if end is None else end
    out = torch.empty(end - begin, dtype=torch.float32, device=device)
    step = HASH_CHUNK if torch.device(device).type == "cpu" else CHUNK
    x = torch.empty(max(0, min(end - begin, step)), dtype=torch.int64, device=device)
    hi, tmp = torch.empty_like(x), torch.empty_like(x)
    for start in range(begin, end, step):
        m = min(end, start + step) - start
        xs, hs, ts = x[:m], hi[:m], tmp[:m]
        torch.arange(start, start + m, out=xs)
        torch.bitwise_right_shift(xs, 32, out=hs)
        hs.add_(key2).bitwise_and_(_MASK32)
        xs.bitwise_and_(_MASK32).bitwise_xor_(key)
        _hash32_(_hash32_(xs, ts).bitwise_xor_(hs), ts)
        xs.bitwise_right_shift_(8).sub_(1 << 23)  # 24 random bits, centred: k in [-2^23, 2^23)
        torch.mul(xs.to(torch.float32), 2.0**-23, out=out[start - begin:start - begin + m])  # k 2^-23, exact
    return out


@functools.lru_cache(maxsize=2)
def _pool(seed: int, device: str) -> torch.Tensor:
    """The seed's ``POOL`` unit values on ``device`` and, after them, the first ``MAX_ROW``
    again (so every window of up to ``MAX_ROW`` starting in the pool is contiguous):
    float32 ``[POOL + MAX_ROW]``."""
    key, key2 = _keys("<pool>", seed)
    unit = _hashed_unit(POOL, key, key2, device)
    return torch.cat([unit, unit[:MAX_ROW]])


def seeded_uniform(name: str, shape: tuple[int, ...], seed: int, std: float, dtype: torch.dtype, device, mean: float = 0.0) -> torch.Tensor:
    """A tensor of ``shape`` with values uniform on mean ± std·sqrt(3), determined by
    (name, shape, seed) alone (see the module docstring): 24 random bits per value, scaled in
    float32 then cast to ``dtype``; the result is exact across devices."""
    out = torch.empty(shape, dtype=dtype, device=device)
    _fill(out, name, seed, std, mean)
    return out


def _fill(out: torch.Tensor, name: str, seed: int, std: float, mean: float) -> None:
    """Write :func:`seeded_uniform`'s values for ``name`` into ``out`` (contiguous), in place."""
    half_width = std * math.sqrt(3.0)
    device, n = out.device, out.numel()
    L = out.shape[-1] if out.dim() else 1
    if n == 0 or L > MAX_ROW:  # rows too long to cut from the pool: one hashed value per element
        flat = out.view(-1)
        for start in range(0, n, CHUNK):
            u = _hashed_unit(n, *_keys(name, seed), device, start, min(n, start + CHUNK))
            flat[start:start + u.numel()] = u.mul_(half_width).add_(mean)
        return
    key, key2 = _keys(name, seed)
    a = L + (_hash_int(key) % L) | 1  # row stride in the pool, odd and in [L, 2L]: r -> a r + b is one-to-one mod POOL
    b = _hash_int(key2) & (POOL - 1)
    pool = _pool(seed, str(device))
    rows, out2 = n // L, out.view(n // L, L)
    step = rows if out.dtype == torch.float32 else max(1, SCRATCH // L)  # rows per float32 scratch
    r = 0
    while r < rows:  # one run of rows per pass through the pool: start + a k stays below POOL
        start = (b + a * r) & (POOL - 1)
        m = min(rows - r, (POOL - 1 - start) // a + 1, step)
        src = pool.as_strided((m, L), (a, 1), start)  # rows r .. r + m - 1, a view
        if out.dtype == torch.float32:
            part = torch.mul(src, half_width, out=out2[r:r + m])
        else:
            part = torch.mul(src, half_width)
        if mean:
            part.add_(mean)
        if out.dtype != torch.float32:
            out2[r:r + m] = part
        r += m


def _hash_int(x: int) -> int:
    """The 32-bit avalanche hash of one Python int (the same rounds as :func:`_hash32_`)."""
    x &= _MASK32
    for _ in range(2):
        x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


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
    """Overwrite every parameter of ``model`` with its seeded synthetic value, in place, on the
    device it lives on (routed experts a budget put in host memory are built there: the values
    are the same on every device, and a CPU build is a memory-bound gather, see the module
    docstring)."""
    from tqdm import tqdm

    params = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in params.items()}
    if getattr(model.config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    bar = tqdm(total=len(shapes), desc="synthetic weights", unit="tensor", disable=not progress)
    for name, shape in shapes.items():
        p = params[name]
        mean, std = param_std(name, shape)
        if p.is_contiguous():
            _fill(p, name, seed, std, mean)
        else:
            p.copy_(seeded_uniform(name, shape, seed, std, p.dtype, p.device, mean))
        bar.update(1)
    bar.close()
    if any(v.device.type == "cuda" for v in params.values()):
        _pool.cache_clear()  # the pool's 64 MiB of device memory are not the run's to keep (a --vram-budget counts them)
