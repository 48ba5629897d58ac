"""Placement policies: the CPU share r of every sequence's spilled KV, and per-block routing.

A policy answers one question, ``cpu_share(L)``: which fraction of a sequence's placed tokens
should live in the compute region (attended by the CPU) when L tokens are placed. Routing a
block (D tokens) follows docs/DESIGN.md section 3:

- prefill: the last floor(r(P) * P / D + 1/2) whole blocks of a P-token prompt go to the
  compute region, the other whole blocks to the load region (``WRITESCOPE_PROMPT_PLAN=compute-first``:
  the first ones, the paper's order: decode reads every block wherever it sits, but each later
  chunk of a chunked prefill reads the earlier blocks again, and compute rows cross through
  pinned staging while load blocks are DMA'd where they lie, so the default keeps the compute
  blocks last: :func:`compute_last_from_env`);
- decode: each evicted window (one block) goes where it brings the placed CPU share closest to
  r(L): to the compute region while ``n_compute < floor(r(L) * (placed_blocks + 1) + 1/2)``.

Policies here: ``gpu`` (r = 0), ``cpu`` (r = 1), ``static:R``, the ``monolithic`` baseline;
the adaptive ``writescope``
(roofline r(L), paper section 5) is in :mod:`writescope.scheduler.roofline`. ``resident`` keeps
all KV on the GPU and uses no partitioned cache (see :func:`writescope.engine.llm.LLM`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from writescope.scheduler.placement import COMPUTE, LOAD, POLICY_NAMES, PlacementPolicy  # noqa: F401 - also imported from here
from writescope.scheduler.roofline import WriteScopePolicy


@dataclass(frozen=True, repr=False)
class StaticPolicy(PlacementPolicy):
    """A fixed CPU share ``share`` in [0, 1]: ``gpu`` is 0, ``cpu`` is 1."""

    share: float
    name: str = "static"

    def __post_init__(self) -> None:
        if not (0.0 <= self.share <= 1.0) or math.isnan(self.share):
            raise ValueError(f"CPU share R must be in [0, 1], got {self.share}")

    @property
    def max_cpu_share(self) -> float:
        return self.share

    @property
    def max_load_share(self) -> float:
        return 1.0 - self.share

    def cpu_share(self, placed_tokens: int) -> float:
        return self.share


class MonolithicPolicy(PlacementPolicy):
    """``monolithic`` baseline (docs/DESIGN.md section 7): every spilled block goes to one physical
    state, the compute region's per-head rows, and the split is made when reading: each step the
    CPU attends the first ``read_share(L)`` of the blocks in place, and the GPU's share is
    re-laid out into pinned staging and streamed, as a cache without the format must do. The
    share comes from ``inner`` (the roofline policy, or a static R), so the comparison with
    ``writescope`` isolates what the physical format saves.
    """

    monolithic = True

    def __init__(self, inner: PlacementPolicy):
        self.inner = inner
        self.name = "monolithic" if not isinstance(inner, StaticPolicy) else f"monolithic:{inner.share:g}"

    @property
    def max_load_share(self) -> float:
        return 0.0

    def cpu_share(self, placed_tokens: int) -> float:
        return 1.0  # placement: everything in the compute region

    def read_share(self, placed_tokens: int) -> float:
        """Fraction of the placed blocks the CPU attends this step."""
        return self.inner.cpu_share(placed_tokens)

    def observe(self, cpu_seconds: float, cpu_tokens: int, batch: int) -> None:
        """No feedback: the baseline reads with the calibrated share. Its CPU part runs while the
        main thread re-lays out the GPU's share, so fed back it would see a slower CPU, lower
        the share, re-lay out more, and run away to r = 0."""

    def expect_batch(self, batch: int) -> None:
        self.inner.expect_batch(batch)


def parse_policy(text: str, roofline=None) -> PlacementPolicy | None:
    """``"gpu"``, ``"cpu"``, ``"static:0.25"``, ``"writescope"`` -> a policy; ``"resident"`` ->
    None (no spilling). ``writescope`` needs ``roofline`` (a calibrated
    :class:`~writescope.kvcache.spec.Roofline`; :class:`~writescope.engine.llm.LLM` finds or
    measures it).

    Raises:
        ValueError: unknown name, an R outside [0, 1] (naming the accepted spellings), or
            ``writescope`` without roofline inputs.
    """
    t = text.strip().lower()
    if t == "resident":
        return None
    if "@" in t:
        alone, rest = (x.strip() for x in text.split("@", 1))
        sets = " ".join(p.strip() for p in rest.split("+") if p.strip())
        raise ValueError(f"policy {text!r}: @switches (POLICY@NAME=VALUE) are for bench and profile rows; here set "
                         + (f"{sets} in the environment before the command" if sets else "switches in the environment")
                         + (f" and give the policy alone ({alone!r})" if alone else " and give a policy"))
    if t.startswith("monolithic:"):
        try:
            inner = parse_policy("static:" + t.split(":", 1)[1])
        except ValueError:
            raise ValueError(f"policy {text!r}: R must be a number in [0, 1] (e.g. monolithic:0.5); policies: {POLICY_NAMES}") from None
        assert inner is not None
        return MonolithicPolicy(inner)
    if t in ("writescope", "monolithic"):
        if roofline is None:
            raise ValueError(f"policy {t!r} needs calibrated roofline inputs: run `writescope calibrate --model M`")
        return WriteScopePolicy(roofline) if t == "writescope" else MonolithicPolicy(WriteScopePolicy(roofline))
    if t == "gpu":
        return StaticPolicy(0.0, "gpu")
    if t == "cpu":
        return StaticPolicy(1.0, "cpu")
    if t.startswith("static:"):
        try:
            r = float(t.split(":", 1)[1])
        except ValueError:
            r = float("nan")
        if not 0.0 <= r <= 1.0:  # also NaN
            raise ValueError(f"policy {text!r}: R must be a number in [0, 1] (e.g. static:0.5); policies: {POLICY_NAMES}")
        return StaticPolicy(r + 0.0, f"static:{r + 0.0:g}")  # + 0.0: -0 reads as 0
    raise ValueError(f"unknown policy {text!r}: choose {POLICY_NAMES}")


PROMPT_PLAN_ENV = "WRITESCOPE_PROMPT_PLAN"


def compute_last_from_env() -> bool:
    """``WRITESCOPE_PROMPT_PLAN``: ``compute-last`` (the default, docs/DESIGN.md section 3: a
    prompt's compute-region blocks are its last whole blocks) or ``compute-first`` (its first
    ones, the paper's order). Decode reads every block wherever it sits; a chunked prefill reads
    the earlier blocks again for each later chunk, and with the compute blocks last most of that
    read is direct DMA from the pinned load region instead of compute rows through pinned
    staging: on an H100 host, 32 x 32K of text (2,048-token chunks) prefilled at 15,463 tok/s
    against 13,412 compute-first, with decode steps alike (348 against 343 ms, medians of steps
    2-8 on the main thread; run 67, benchmarks/results/gpu_decode_h200.md).

    Raises:
        ValueError: another value (names it and the choices).
    """
    from writescope.env import env_choice

    return env_choice(PROMPT_PLAN_ENV, ("compute-last", "compute-first")) == "compute-last"


def _prompt_compute_blocks(policy: PlacementPolicy, prompt_len: int, window: int) -> int:
    """floor(r(P) * P / D + 1/2) whole blocks of a P-token prompt for the compute region (halves
    up, as decode routing rounds)."""
    return min(prompt_len // window, math.floor(policy.cpu_share(prompt_len) * prompt_len / window + 0.5))


def prompt_plan(policy: PlacementPolicy, prompt_len: int, window: int, compute_last: bool | None = None) -> list[int]:
    """Region (COMPUTE or LOAD) of each whole block of a ``prompt_len``-token prompt:
    floor(r(P) * P / D + 1/2) compute blocks (r asked once), the last ones, or the first where
    ``compute_last`` is False (None: :func:`compute_last_from_env`)."""
    prompt_blocks = prompt_len // window
    if compute_last is None:
        compute_last = compute_last_from_env()
    n_cpu = _prompt_compute_blocks(policy, prompt_len, window)
    return [_prompt_region(j, prompt_blocks, n_cpu, compute_last) for j in range(prompt_blocks)]


def _prompt_region(block: int, prompt_blocks: int, n_cpu: int, compute_last: bool) -> int:
    """Region of prompt block ``block`` when ``n_cpu`` of the ``prompt_blocks`` go to the compute
    region: the last ones where ``compute_last``, else the first ones."""
    if compute_last:
        return COMPUTE if block >= prompt_blocks - n_cpu else LOAD
    return COMPUTE if block < n_cpu else LOAD


def route_block(policy: PlacementPolicy, block: int, prompt_len: int, window: int, n_compute: int, compute_last: bool | None = None) -> int:
    """Region (COMPUTE or LOAD) of block ``block`` (tokens ``block*D .. block*D + D - 1``).

    Args:
        policy: the placement policy.
        block: index of the block in the sequence (blocks are placed in order).
        prompt_len: tokens of the prompt P; blocks below ``P // D`` follow the prefill plan.
        window: D, tokens per block.
        n_compute: blocks of this sequence already in the compute region.
        compute_last: the prompt's compute-region blocks are its last whole blocks, not its first;
            None: as :func:`compute_last_from_env` says (the default: last). Decode's blocks are
            routed alike either way.
    """
    prompt_blocks = prompt_len // window
    if block < prompt_blocks:  # the block of prompt_plan's list, without making the list
        last = compute_last_from_env() if compute_last is None else compute_last
        return _prompt_region(block, prompt_blocks, _prompt_compute_blocks(policy, prompt_len, window), last)
    placed_after = (block + 1) * window
    target = math.floor(policy.cpu_share(placed_after) * (block + 1) + 0.5)
    return COMPUTE if n_compute < target else LOAD
