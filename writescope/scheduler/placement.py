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


def micro_batched(micro_batches: int, batch: int) -> bool:
    """Whether a decode step of ``batch`` sequences with a CPU part runs as two micro-batches when
    ``micro_batches`` (``WRITESCOPE_MICRO_BATCHES``) are asked for: the one rule that
    :meth:`~writescope.kvcache.inplace.InplaceKVCache.decode_groups` splits by and that the
    roofline's balance assumes (with micro-batches the layer's other work overlaps the CPU part)."""
    return micro_batches >= 2 and batch >= 2
