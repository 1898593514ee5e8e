"""``all_reduce``: an all-reduce that ``torch.compile`` can trace.

Eagerly it is c10d's in-place ``all_reduce`` (its work handle when ``async_op``). While
compiling, Dynamo cannot trace c10d's asynchronous call, so it is a functional all-reduce
(``torch.distributed._functional_collectives``): a new tensor and no work. Callers use the
returned tensor, never the argument: writing the functional result back into the argument
with ``copy_`` lost the mutation inside ``autograd.Function`` bodies on torch 2.11 (the
compiled TP backward summed nothing). The amax MAX all-reduce (``amax_sync``) and the
tensor-parallel SUMs (``tensor_parallel``) both go through it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol


def all_reduce(x: torch.Tensor, group, *, op: str = "sum", async_op: bool = False):
    """``(work, reduced)``: ``x`` reduced over ``group`` (``op``: ``"sum"`` or ``"max"``).
    Eagerly ``reduced`` is ``x``, reduced in place, valid after ``work.wait()`` when
    ``async_op`` (work is None otherwise); while compiling it is a new tensor and work is
    None. ``op`` is a string because Dynamo (torch 2.11) cannot hash a ``dist.ReduceOp``."""
    if op not in ("sum", "max"):
        raise ValueError(f"all_reduce: op must be 'sum' or 'max', got {op!r}")
    if torch.compiler.is_compiling():
        return None, funcol.all_reduce(x, op, group)
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    return dist.all_reduce(x, op=reduce_op, group=group, async_op=async_op), x
