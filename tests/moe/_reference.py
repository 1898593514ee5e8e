"""Per-expert ``hd.Linear`` loop on zero-padded slices: the reference GroupedLinear must
equal bitwise (same GEMM shapes, same per-expert quantizer states)."""

from __future__ import annotations

import torch
from torch import nn

import hybrid_dist as hd
from hybrid_dist.moe import token_multiple
from hybrid_dist.quantized_tensor import QuantizedTensor


def pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def expert_weight(w, e: int) -> nn.Parameter:
    """Expert e's ``[N, K]`` weight; a QuantizedTensor slice of a quantized ``[E, N, K]``."""
    if not isinstance(w, QuantizedTensor):
        return nn.Parameter(w.detach()[e].clone())
    n, k = w.shape[1:]
    col = None if w.columnwise is None else w.columnwise.narrow_dim0(e * n, n)
    return nn.Parameter(QuantizedTensor((n, k), w.dtype, w.rowwise.narrow_dim0(e * n, n), col, w.quantizer))


class LinearLoop:
    """E ``hd.Linear`` modules run on each expert's padded token slice."""

    def __init__(self, weight, recipe):
        e, n, k = weight.shape
        self.linears = []
        for i in range(e):
            lin = hd.Linear(k, n, bias=False, recipe=recipe, dtype=weight.dtype, device=weight.device)
            lin.weight = expert_weight(weight, i)
            self.linears.append(lin)
        plan = self.linears[0].plan_for(recipe)
        self.multiple = token_multiple(plan.input, plan.grad_output)

    def run(self, x, splits, dy):
        """Returns ``(y, dx, dW [E, N, K])``."""
        ys, dxs, dws = [], [], []
        for lin, xe, dye in zip(self.linears, torch.split(x, splits), torch.split(dy, splits)):
            m = xe.shape[0]
            p = -(-m // self.multiple) * self.multiple
            xp = pad(xe.detach(), p).requires_grad_(True)
            yp = lin(xp)
            yp.backward(pad(dye, p))
            ys.append(yp[:m].detach())
            dxs.append(xp.grad[:m])
            dws.append(lin.weight.grad)
            lin.weight.grad = None
        return torch.cat(ys), torch.cat(dxs), torch.stack(dws)
