"""The packed layout's index tensors from the per-expert token counts, in one launch (Triton).

Legend: E experts, ``m [E]`` tokens per expert, b the padding multiple, T = Σ m rows sorted
by expert, C the packed capacity (``moe.packed_index``), ``p_e = ⌈m_e / b⌉ · b``.

    off  [E+1]  0, cumsum(m)                 first row of each expert
    poff [E+1]  0, cumsum(p)                 first padded row of each expert
    eid  [T]    e with off[e] ≤ t < off[e+1]  = #{e : off[e+1] ≤ t}
    dest [T]    t − off[eid] + poff[eid]      = t + Σ_{e : off[e+1] ≤ t} (p_e − m_e)
    row_expert [C]  #{e : poff[e+1] ≤ q}       (E past the last expert's padded rows)

Each program recomputes both cumulative sums over all E counts in registers (E is small)
and writes a block of rows: each row's expert and padded row are counts and sums over the
experts that end at or before it, so no search and no gather. Integer arithmetic: bitwise
the torch form (``cumsum``, ``repeat_interleave`` with ``output_size``, two gathers), which
takes about twenty launches. Program 0 also writes ``off`` and ``poff``. int64 outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.kernels._launch import launch

_BLOCK = 128


@triton.jit(do_not_specialize=["t", "c"])  # row counts change every step: no recompiles
def _packed_index_kernel(m_ptr, off_ptr, poff_ptr, eid_ptr, dest_ptr, row_expert_ptr, t, c, e,
                         MULT: tl.constexpr, EB: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    ex = tl.arange(0, EB)
    in_e = ex < e
    m = tl.load(m_ptr + ex, mask=in_e, other=0).to(tl.int64)
    p = (m + (MULT - 1)) // MULT * MULT
    end = tl.cumsum(m, 0)  # off[e + 1]
    pend = tl.cumsum(p, 0)  # poff[e + 1]
    if pid == 0:
        tl.store(off_ptr + 1 + ex, end, mask=in_e)
        tl.store(poff_ptr + 1 + ex, pend, mask=in_e)
        zero = tl.zeros([EB], dtype=tl.int64)
        tl.store(off_ptr + ex, zero, mask=ex == 0)
        tl.store(poff_ptr + ex, zero, mask=ex == 0)
    r = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    done = (end[None, :] <= r[:, None]) & in_e[None, :]  # [BLOCK, EB]: experts ending at or before row r
    eid = tl.sum(done.to(tl.int64), 1)
    dest = r + tl.sum(tl.where(done, (p - m)[None, :], 0), 1)
    tl.store(eid_ptr + r, eid, mask=r < t)
    tl.store(dest_ptr + r, dest, mask=r < t)
    pdone = (pend[None, :] <= r[:, None]) & in_e[None, :]
    tl.store(row_expert_ptr + r, tl.sum(pdone.to(tl.int64), 1), mask=r < c)


def packed_index(tokens_per_expert: torch.Tensor, rows: int, capacity: int, multiple: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(off [E+1], poff [E+1], eid [rows], dest [rows], row_expert [capacity])`` int64
    (module doc) of ``tokens_per_expert [E]`` (any integer dtype, on CUDA) whose sum is
    ``rows``; ``capacity`` ≥ the padded total."""
    e = tokens_per_expert.numel()
    new = dict(dtype=torch.int64, device=tokens_per_expert.device)
    # one allocation, five views, each starting 16-byte aligned whatever ``rows`` is: Triton
    # specializes pointers on that alignment, and an odd row count would compile a new variant
    sizes = (e + 1, e + 1, rows, rows, capacity)
    flat = torch.empty(sum(n + n % 2 for n in sizes), **new)
    off, poff, eid, dest, row_expert = [v[:n] for v, n in zip(flat.split([n + n % 2 for n in sizes]), sizes)]
    if e:
        grid = (triton.cdiv(max(capacity, 1), _BLOCK),)
        launch(_packed_index_kernel, grid, tokens_per_expert.contiguous(), off, poff, eid, dest, row_expert,
               rows, capacity, e, MULT=multiple, EB=max(triton.next_power_of_2(e), 16), BLOCK=_BLOCK, num_warps=4)
    else:
        flat.zero_()
    return off, poff, eid, dest, row_expert
