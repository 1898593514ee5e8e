"""Zero-filled fp32 targets for the amax passes' atomic max, without a fill per call.

[Note: zeroed slots]
An amax pass max-reduces into a buffer that must start at zero; ``torch.zeros`` costs an
allocation and a fill launch per call. ``zeroed_f32(device)`` hands out a fresh 16-byte slot
of a buffer zeroed once per ``_SLOTS`` slots instead. A slot is never handed out twice (each
comes from an iterator over the buffer's slot views, whose ``next`` is one C call, so this
holds across threads too): nothing is reset and no kernel sees another's maximum.

One buffer per (device, current stream, slot shape), allocated on the stream whose kernels
use it, so the caching allocator reuses its memory only after those kernels. Its slot views
are made once, by one ``unbind`` (views made per call cost two ``aten::select`` each);
``unbind``'s views refuse in-place ops that autograd would record. Slots are 16 bytes so each
starts 16-byte aligned, as a fresh tensor does (Triton specializes aligned pointers; inductor
asserts that a custom op's outputs are aligned).

Under CUDA-graph capture every replay would reuse the captured slot, so there (and while
tracing, and for more than four values) the targets are plain ``torch.zeros``
(``fresh_f32``), whose fill a graph records. The ``torch.library`` ops always take
``fresh_f32``: CUDA-graph trees (``mode="reduce-overhead"``) track every allocation made while
a graph runs, and a slot buffer allocated there would belong to the graph's pool without any
graph output tracking it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

_SLOT = 4  # fp32 values per slot (16 bytes); NVFP4's amax pass uses two
_SLOTS = 1024  # slots per buffer (16 KiB)

_capturing = torch._C._cuda_isCurrentStreamCapturing  # CPU builds: a stub that raises (never called)
# (device index, raw stream, n) -> the views of the newest buffer's slots not yet handed out
_FREE: dict[tuple[int, int, int | None], Iterator[torch.Tensor]] = {}


def fresh_f32(device: torch.device, n: int | None = None) -> torch.Tensor:
    """A new ``torch.zeros`` fp32 target: a scalar ``[]`` if ``n`` is None, else ``[n]``
    (the ops' implementations, capture and tracing; see the note)."""
    return torch.zeros(() if n is None else n, dtype=torch.float32, device=device)


def zeroed_f32(device: torch.device, n: int | None = None) -> torch.Tensor:
    """fp32 zeros on ``device``, never handed out before (see the note): a scalar ``[]`` if
    ``n`` is None, else ``[n]``. Off CUDA (the Triton interpreter's CPU tensors): ``torch.zeros``."""
    if device.type != "cuda" or (n or 1) > _SLOT or torch.compiler.is_compiling() or _capturing():
        return fresh_f32(device, n)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index), n)
    free = _FREE.get(key)
    slot = None if free is None else next(free, None)  # one C call: atomic under the GIL
    if slot is None:  # a new buffer; one in use stays alive through its slots' views
        buf = torch.zeros(_SLOTS, _SLOT, dtype=torch.float32, device=device)
        free = _FREE[key] = iter((buf[:, 0] if n is None else buf[:, :n]).unbind(0))
        slot = next(free)
    return slot
