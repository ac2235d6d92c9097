# SPDX-License-Identifier: Apache-2.0
"""SwiGLU feed-forward with the gate and up projections fused into one matmul."""
import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoints.model_shape import ModelShape


class MLP(nn.Module):
    def __init__(self, args: ModelShape, dtype: torch.dtype):
        super().__init__()
        self.hidden_dim = args.hidden_dim
        self.w_gate_up = nn.Linear(args.dim, 2 * args.hidden_dim, bias=False, dtype=dtype)
        self.w_down = nn.Linear(args.hidden_dim, args.dim, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).split(self.hidden_dim, dim=-1)
        return self.w_down(F.silu(gate) * up)
