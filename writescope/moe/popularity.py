"""Expert popularity: which routed experts a model's router picks, per MoE layer, and the
placement it implies under a VRAM budget (issue 16, item 3).

A profile holds, per MoE layer, how many times each routed expert was chosen (top-k assignments)
over some text. Under a budget that keeps ``keep`` experts of a layer on the GPU, the ``keep``
most chosen ones stay there (ties by lower id), instead of the lowest ids; the others live in
host memory. With skewed routing (real checkpoints on real text) the device then serves most
assignments; seeded synthetic weights route nearly uniformly, so there the gain is small.

Profiles come from a short pass over text (``writescope expert-profile``, which counts routing
in the model's own forward, on the device, without a host wait) or from a file the user passes
(``--expert-profile PATH``). The file is JSON::

    {"model": "<name>", "tokens": 8192, "layers": {"1": [c_0, ..., c_{E-1}], ...}}

keys are the model's layer ids of its MoE layers, values one non-negative count per routed expert.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch


def _spans(ids: list[int], most: int = 6) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0..2, 5, 7..8"`` (sorted runs; past ``most`` runs, ``", ..."``)."""
    runs: list[list[int]] = []
    for i in sorted(set(ids)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = [f"{a}..{b}" if b > a else f"{a}" for a, b in runs[:most]]
    return ", ".join(text + (["..."] if len(runs) > most else []))


@dataclass
class ExpertProfile:
    """Routing counts per MoE layer: ``layers[layer_id][e]`` assignments to expert e."""

    layers: dict[int, list[float]]
    tokens: int = 0
    model: str = ""
    source: str = field(default="", compare=False)

    def check(self, moe_layers: list[int], num_experts: int) -> None:
        """Raise ValueError unless the profile has one row of ``num_experts`` finite, non-negative
        counts for each of ``moe_layers`` (naming what differs and what to do)."""
        where = f"expert profile {self.source or '(given)'}"
        if not moe_layers:
            raise ValueError(f"{where}: the model has no MoE layers: an expert profile does not apply")
        missing = [i for i in moe_layers if i not in self.layers]
        extra = sorted(set(self.layers) - set(moe_layers))
        if missing or extra:
            made = f" (it was made with {self.model})" if self.model else ""
            raise ValueError(f"{where}{made}: {len(missing)} of this model's MoE layers missing ({_spans(missing) or 'none'}), "
                             f"{len(extra)} not MoE layers of this model ({_spans(extra) or 'none'}; its MoE layers: "
                             f"{_spans(moe_layers)}): make the profile with this model (writescope expert-profile)")
        for i in moe_layers:
            row = self.layers[i]
            if len(row) != num_experts:
                raise ValueError(f"{where}: layer {i} has {len(row)} counts, the model {num_experts} routed experts")
            bad = [c for c in row if not (c >= 0 and c != float("inf"))]
            if bad:
                raise ValueError(f"{where}: layer {i} has a count {bad[0]!r}: counts must be finite and >= 0")

    def warn_if_unused(self, model: str, budgeted: bool) -> None:
        """Warn (``UserWarning``) when the profile cannot do what it is given for: no VRAM budget
        (every expert stays on the device), or a profile made with another model name (same
        shape, perhaps another checkpoint: the routing may differ)."""
        import warnings

        if not budgeted:
            warnings.warn(f"expert profile {self.source or '(given)'} is unused without a VRAM budget: every routed expert stays on the device",
                          stacklevel=3)
        elif self.model and Path(self.model).name != Path(model).name:
            warnings.warn(f"expert profile {self.source or '(given)'} was made with {self.model!r}, not {model!r}: "
                          "its routing counts may not fit this model", stacklevel=3)

    def hot(self, layer: int, keep: int) -> list[int]:
        """The ``keep`` most chosen experts of ``layer``, most chosen first (ties: lower id)."""
        row = self.layers[layer]
        return sorted(range(len(row)), key=lambda e: (-row[e], e))[:keep]

    def coverage(self, layer: int, on_gpu) -> float:
        """Fraction of ``layer``'s assignments that go to the experts ``on_gpu`` (1.0 for no counts)."""
        row = self.layers[layer]
        total = sum(row)
        return 1.0 if total <= 0 else sum(row[e] for e in on_gpu) / total

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"model": self.model, "tokens": self.tokens, "layers": {str(k): v for k, v in sorted(self.layers.items())}}))
        return path

    @staticmethod
    def load(path: str | Path) -> "ExpertProfile":
        """Read a profile file (see the module docstring).

        Raises:
            ValueError: unreadable, not JSON, or not of that form (naming the file).
        """
        try:
            doc = json.loads(Path(path).read_text())
            layers = {int(k): [float(c) for c in v] for k, v in doc["layers"].items()}
        except OSError as e:
            raise ValueError(f"--expert-profile {path}: {e.strerror or e}") from None
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"--expert-profile {path}: not an expert profile (JSON with \"layers\": "
                             "{layer id: [count per routed expert]}; `writescope expert-profile` writes one)") from None
        return ExpertProfile(layers, int(doc.get("tokens", 0)), str(doc.get("model", "")), str(path))


@contextmanager
def recording(model: torch.nn.Module):
    """Count the routing of every SparseMoeBlock of ``model`` while the block runs: yields a dict
    filled on exit with ``{layer id: [count per expert]}`` (the counts accumulate on the device,
    one bincount per forward, read once at the end)."""
    from writescope.moe.block import SparseMoeBlock

    blocks = {i: layer.mlp_module for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp_module, SparseMoeBlock)}
    for b in blocks.values():
        b.routing_counts = torch.zeros(b.cfg.num_experts, dtype=torch.int64, device=b.gate.weight.device)
    out: dict[int, list[float]] = {}
    try:
        yield out
    finally:
        for i, b in blocks.items():
            out[i] = [float(c) for c in b.routing_counts.tolist()]
            b.routing_counts = None
