"""``all_reduce_``: an in-place all-reduce that ``torch.compile`` can trace.

Eagerly it is c10d's ``all_reduce`` (its work handle when ``async_op``). While compiling,
Dynamo cannot trace c10d's asynchronous call, so it is a functional all-reduce
(``torch.distributed._functional_collectives``) copied back into the tensor, and no work.
The amax MAX all-reduce (``amax_sync``) and the tensor-parallel SUMs (``tensor_parallel``)
both go through it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def all_reduce_(x: torch.Tensor, group, *, op: str = "sum", async_op: bool = False):
    """``x`` reduced over ``group`` in place (``op``: ``"sum"`` or ``"max"``); the work
    (None while compiling or when not ``async_op``). ``op`` is a string because Dynamo
    (torch 2.11) cannot hash a ``dist.ReduceOp`` while tracing."""
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce_: op must be 'sum' or 'max', got {op!r}")
    if torch.compiler.is_compiling():
        x.copy_(funcol.all_reduce(x, op, group))
        return None
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    return dist.all_reduce(x, op=reduce_op, group=group, async_op=async_op)
