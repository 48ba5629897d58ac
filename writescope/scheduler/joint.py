"""One roofline for the host-resident work of a decode step: KV and routed experts (issue 16).

Beyond the paper, which leaves joint scheduling as future work. A layer step has two kinds of
host-resident bytes, each of which can go two ways:

```
                      the CPU, in place                 the link (host-to-GPU), streamed
KV (L tokens)         u tokens x A  (s per token)        (L - u) tokens x B
experts (X bytes)     v bytes  x E  (s per byte)         (X - v) bytes  x G
T_cpu = u A + v E + C_cpu            T_link = (L - u) B + (X - v) G + C_gpu
```

and the step takes max(T_cpu, T_link). Both are linear, so the best split moves work from the
link to the CPU until the two are equal, taking first the kind whose move costs the CPU least per
second it saves the link: a KV token saves B and costs A, an expert byte saves G and costs E, so
KV goes first when A / (A + B) < E / (E + G) (a fractional knapsack: linear costs make the greedy
order exact). With no host experts (X = 0) this is the paper's eq. 2 with its clamp; with no
host KV (L = 0) only the expert split remains.

Two decisions use it, at different times (the write-time principle: placed KV never moves):
- r(L), the CPU share of KV as it is placed (prefill plans, evictions), from the expected expert
  bytes per layer step (tracked from routing) and E (tracked from the host experts' timings);
- each layer step, once routing is known and this step's KV split is fixed: how many of the hit
  host experts the link streams (whole experts; the ones with most tokens go first, as the block
  orders them) and how many the CPU computes, so the two sides finish closest together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class JointCosts:
    """Per-unit costs of one layer step (seconds).

    Attributes:
        a: CPU seconds per KV token attended in place.
        b: link seconds per KV token streamed (and attended on the GPU).
        e: CPU seconds per byte of expert weights computed in place.
        g: link seconds per byte of expert weights streamed.
        c_cpu, c_gpu: fixed seconds per step of each side.
    """

    a: float
    b: float
    e: float
    g: float
    c_cpu: float = 0.0
    c_gpu: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "b", "e", "g", "c_cpu", "c_gpu"):
            x = getattr(self, name)
            if not x >= 0 or math.isinf(x):  # also NaN
                raise ValueError(f"joint roofline cost {name} must be finite and >= 0, got {x}")


def step_times(L: float, X: float, u: float, v: float, c: JointCosts) -> tuple[float, float]:
    """``(T_cpu, T_link)`` of a layer step with ``u`` of ``L`` KV tokens and ``v`` of ``X`` expert
    bytes on the CPU (module docstring)."""
    return u * c.a + v * c.e + c.c_cpu, (L - u) * c.b + (X - v) * c.g + c.c_gpu


def joint_split(L: float, X: float, c: JointCosts) -> tuple[float, float]:
    """The split of a layer step that minimises max(T_cpu, T_link).

    Args:
        L: host KV tokens of the step (the batch's), >= 0.
        X: bytes of the hit host experts' weights, >= 0.
        c: the costs.

    Returns:
        ``(r, s)``: r the CPU share of the KV tokens, s the streamed share of the expert bytes,
        both in [0, 1] (r = 0 when L = 0, s = 1 when X = 0: nothing to split).

    Raises:
        ValueError: a negative or NaN L or X.
    """
    for name, x in (("L", L), ("X", X)):
        if not x >= 0:
            raise ValueError(f"joint roofline input {name} must be >= 0, got {x}")
    cpu, link = step_times(L, X, 0.0, 0.0, c)
    gap = link - cpu  # what moving work to the CPU must close
    u = v = 0.0
    kinds = [("kv", L, c.a + c.b, c.a / (c.a + c.b) if c.a + c.b > 0 else 1.0),
             ("experts", X, c.e + c.g, c.e / (c.e + c.g) if c.e + c.g > 0 else 1.0)]
    for name, total, closes, _ in sorted(kinds, key=lambda k: (k[3], k[0] != "kv")):  # cheapest for the CPU first
        if gap <= 0 or total <= 0 or closes <= 0:
            continue
        move = min(total, gap / closes)
        gap -= move * closes
        if name == "kv":
            u = move
        else:
            v = move
    r = u / L if L > 0 else 0.0
    s = 1.0 - v / X if X > 0 else 1.0
    return min(1.0, max(0.0, r)), min(1.0, max(0.0, s))


def streamed_count(sizes: list[float], cpu_seconds: float, link_seconds: float, c: JointCosts, cpu_call: float = 0.0) -> int:
    """How many of a layer step's hit host experts to stream, the rest computed on the CPU.

    Args:
        sizes: weight bytes of each hit host expert, in streaming priority order (the block
            streams the first k).
        cpu_seconds, link_seconds: what the step's KV already costs each side (its split is fixed
            by placement), fixed costs included.
        c: the costs (``e`` and ``g`` are used).
        cpu_call: the CPU's fixed seconds of a call with any experts (the kernel's start and
            hand-back), paid when it computes at least one.

    Returns:
        k in [0, len(sizes)]: the whole-expert split whose slower side finishes first (ties: the
        fewer streamed, which keeps the link free for the next layer's KV).
    """
    n = len(sizes)
    total = sum(sizes)
    best_k, best_t = 0, math.inf
    streamed = 0.0
    for k in range(n + 1):
        if k > 0:
            streamed += sizes[k - 1]
        t = max(cpu_seconds + (total - streamed) * c.e + (cpu_call if k < n else 0.0), link_seconds + streamed * c.g)
        if t < best_t - 1e-15:
            best_k, best_t = k, t
    return best_k
