"""The placement policy's interface (:class:`PlacementPolicy`) and the region ids, in a module of
their own so that the policy modules form no import cycle: :mod:`writescope.scheduler.roofline`
(the adaptive policy) imports only this one, :mod:`writescope.scheduler.policies` (the static
policies and ``parse_policy``, which builds every policy) imports both and re-exports these
names."""

from __future__ import annotations

COMPUTE = 0  # region id: host, pageable, per-KV-head rows; attended on the CPU
LOAD = 1  # region id: host, pinned, one contiguous block per D tokens; streamed to the GPU

POLICY_NAMES = "resident, gpu, cpu, static:R with R in [0, 1], writescope, monolithic or monolithic:R"


class PlacementPolicy:
    """Chooses the CPU share of placed KV. Subclasses implement :meth:`cpu_share`."""

    name: str = "policy"

    @property
    def max_cpu_share(self) -> float:
        """Largest fraction of blocks this policy may put in the compute region (sizes host memory)."""
        return 1.0

    @property
    def max_load_share(self) -> float:
        """Largest fraction of blocks this policy may put in the load region (sizes pinned memory)."""
        return 1.0

    def cpu_share(self, placed_tokens: int) -> float:
        """Target fraction in [0, 1] of placed tokens in the compute region at L = placed_tokens."""
        raise NotImplementedError

    def observe(self, cpu_seconds: float, cpu_tokens: int, batch: int) -> None:
        """Feedback after one layer's decode attention: the CPU part took ``cpu_seconds`` for
        ``cpu_tokens`` compute-region tokens over ``batch`` sequences. Static policies ignore it."""

    def expect_batch(self, batch: int) -> None:
        """``batch`` sequences will decode together (told before their prompts are placed, so a
        policy whose share depends on the batch plans the prefill for it). Static policies ignore it."""

    def __repr__(self) -> str:
        return self.name


def micro_batched(micro_batches: int | str, batch: int, cpu_experts_from: int | None = None) -> bool:
    """Whether a decode step of ``batch`` sequences with a CPU part runs as two micro-batches under
    ``micro_batches`` (``WRITESCOPE_MICRO_BATCHES``: 1, 2 or ``"auto"``): the one rule that
    :meth:`~writescope.kvcache.inplace.InplaceKVCache.decode_groups` splits by and that the
    roofline's balance assumes (with micro-batches the layer's other work overlaps the CPU part).

    ``auto`` splits the steps whose CPU computes no host experts: those of fewer tokens than
    ``cpu_experts_from`` (the engine's threshold, engine/llm.py ``_cpu_experts_from``; None: no
    step computes host experts on the CPU, so every step of two or more sequences splits). Where
    the CPU computes experts, each half routes on its own and the expert worker reads the experts
    both halves hit twice (run 65, Qwen3 16 x 32K: 2,909 expert reads a step against 1,777, median
    642 against 577 ms); where it attends only, the halves hide the layer's other work behind
    the CPU's (DSV2 16 x 32K: 160.8 against 184.4-192.6 ms, benchmarks/results/gpu_decode_h200.md).

    The rule reads the whole step's tokens, while each half's expert path follows its own count: a
    step at or above the threshold stays whole even where its halves alone would read their host
    experts in place. And where host experts are streamed or read in place over the link (none on
    the CPU), ``auto`` splits, so the experts both halves hit cross the link twice; run 65's DSV2
    rows had few host experts (its budget kept most on the device), so that case is unmeasured.

    Under ``auto`` a ``writescope`` policy may still have a step run whole where its two-half split
    does not pay and the whole-step one does (roofline.py ``WriteScopePolicy.splits_micro``); the
    cache asks it after this rule."""
    if batch < 2:
        return False
    if micro_batches == "auto":
        return cpu_experts_from is None or batch < cpu_experts_from
    return micro_batches >= 2
