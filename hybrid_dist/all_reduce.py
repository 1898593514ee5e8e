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

_OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max"}


def all_reduce_(x: torch.Tensor, group, *, op=dist.ReduceOp.SUM, async_op: bool = False):
    """``x`` reduced over ``group`` in place; the work (None while compiling or when not
    ``async_op``)."""
    if torch.compiler.is_compiling():
        x.copy_(funcol.all_reduce(x, _OP_NAMES[op], group))
        return None
    return dist.all_reduce(x, op=op, group=group, async_op=async_op)
