"""SwiGLU MLP with checkpoint-specific parameter names."""

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """down(silu(gate(x)) · up(x)).

    ``names`` are the checkpoint's parameter names for (gate, up, down): ``("gate_proj",
    "up_proj", "down_proj")`` for Qwen3/DeepSeek, ``("w1", "w3", "w2")`` for Mixtral experts.
    Input ``[T, hidden]``, output ``[T, hidden]``, same dtype.
    """

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, intermediate, bias=False))
        self.add_module(up, nn.Linear(hidden, intermediate, bias=False))
        self.add_module(down, nn.Linear(intermediate, hidden, bias=False))

    def dtype_of(self) -> torch.dtype:
        return getattr(self, self.names[0]).weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(F.silu(gate(x)) * up(x))
