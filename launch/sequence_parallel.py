"""Sequence parallelism for the launcher's dense blocks (``--sequence-parallel`` with ``--tp N``).

Between the blocks' tensor-parallel regions the residual stream is split along the
sequence over the TP ranks: each holds ``[S/tp, B, D]`` (sequence first, so a shard is a
contiguous dim-0 slice). Norms and residual adds run on the local tokens; each block's
attention and MLP all-gather their normed input once for their column-parallel
projections, and their row-parallel output projection reduce-scatters back to the local
tokens. In eager blocks the gather is quantized in the projections' input format where
the recipe allows (``PrepareHybridModuleInput``; bitwise the gather-then-quantize path);
compiled blocks gather in high precision (``ConsumersInput``) and each projection
quantizes the gathered input, as in the Megatron layout. Against that layout (replicated
activations, one all-reduce per row-parallel projection) the bytes on the wire are the
same in high precision and a quarter fewer with FP8 gathers, and the norms, residual adds
and their activations are split ``tp`` ways.

The embedding output enters the split through ``scatter_sequence`` (backward: all-gather
of the gradient, so the embedding's gradient is whole on every TP rank), and the last
block's output leaves it through ``gather_sequence`` (backward: this rank's slice), so
the head and the loss run on the full sequence as without SP. The block norms' weights
are the only replicated parameters that see a part of the tokens: their gradients are
summed over the TP ranks after the backward (``sync_replicated_grads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hybrid_dist.tensor_parallel.gather import all_reduce_sum, gather_along_first_dim, reduce_scatter_along_first_dim


def _local_dim0(x: torch.Tensor, group) -> torch.Tensor:
    return x.chunk(dist.get_world_size(group), dim=0)[dist.get_rank(group)].contiguous()


class _Scatter(torch.autograd.Function):
    """Forward: this rank's dim-0 slice. Backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _local_dim0(x, group)

    @staticmethod
    def backward(ctx, dy):
        return gather_along_first_dim(dy, ctx.group), None


class _Gather(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: ``reduce`` the gradients' sum over the
    ranks and keep this rank's slice (consumers whose gradients are partial), else keep the
    slice of the replicated gradient."""

    @staticmethod
    def forward(ctx, x, group, reduce: bool):
        ctx.group, ctx.reduce = group, reduce
        return gather_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, dy):
        if ctx.reduce:
            return reduce_scatter_along_first_dim(dy, ctx.group), None, None
        return _local_dim0(dy, ctx.group), None, None


def scatter_sequence(x_SBD: torch.Tensor, group) -> torch.Tensor:
    """This rank's ``[S/tp, B, D]`` slice of a replicated ``[S, B, D]``; the backward
    all-gathers the gradient (whole on every rank)."""
    return _Scatter.apply(x_SBD, group)


def gather_sequence(x_SBD: torch.Tensor, group) -> torch.Tensor:
    """``[S, B, D]`` from every rank's ``[S/tp, B, D]`` slice, for a replicated consumer
    (the head); the backward keeps this rank's slice of the (replicated) gradient."""
    return _Gather.apply(x_SBD, group, False)


class _ReduceGrad(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) the gradient over the TP ranks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, dx):
        return all_reduce_sum(dx, ctx.group), None


class ConsumersInput:
    """Forward pre-hook on a module whose column-parallel projections read its first
    argument (attention: wq/wk/wv; dense MLP: w1/w3), built with
    ``HybridColwiseParallel(reduce_input_grad=False)``: their input gradients are summed
    by autograd and reduced here once, instead of once per projection.

    * ``sequence_parallel=False`` (Megatron layout): the input is replicated; the backward
      all-reduces the summed gradient.
    * ``sequence_parallel=True`` (the compiled blocks' path): the input is this rank's
      ``[S/tp, B, D]``, all-gathered in high precision (each projection quantizes the
      gathered input, as in the Megatron layout; the shared quantized gather of eager blocks
      hands a ``QuantizedTensor`` between modules, which Dynamo does not trace); the
      backward reduce-scatters the summed gradient."""

    def __init__(self, group, *, sequence_parallel: bool):
        self.group, self.sequence_parallel = group, sequence_parallel

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        x = _Gather.apply(x, self.group, True) if self.sequence_parallel else _ReduceGrad.apply(x, self.group)
        return (x, *args[1:])


def replicated_block_params(model: nn.Module) -> list[nn.Parameter]:
    """The block parameters that every TP rank holds whole but computes on its own tokens
    under SP: the attention and MLP norms' weights."""
    return [p for block in model.layers.values() for norm in (block.attention_norm, block.ffn_norm)
            for p in norm.parameters()]


def sync_replicated_grads(params: list[nn.Parameter], group) -> None:
    """Sum the gradients of ``params`` over ``group`` (one all-reduce of their local shards
    side by side; FSDP2's data-parallel reduction has already run)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))
