"""Zero-filled fp32 targets for the amax passes' atomic max, without a fill per call.

[Note: zeroed slots]
An amax pass max-reduces into a buffer that must start at zero. ``torch.zeros`` costs an
allocation and a fill launch: ~13 µs of host time alone and ~35 µs of profiled time
inside an ``hd.Linear`` step, three times per step. ``zeroed_f32(device)`` hands out a
fresh 16-byte slot of a buffer zeroed once per ``_SLOTS`` slots instead. A slot is
never handed out twice (``itertools.count`` takes each index once, also across threads),
so nothing is reset and no kernel can see another's maximum.

One buffer per (device, current stream): the buffer is allocated on the stream whose
kernels use it, so the caching allocator reuses its memory only after those kernels (the
usual stream semantics). Slots are 16 bytes so each starts 16-byte aligned, as a fresh
tensor does: Triton specializes aligned pointers, and inductor asserts that a custom op's
outputs are aligned (the amax ops return slots). Under CUDA-graph capture every replay
would reuse the captured slot, so there (and while tracing, and for more than four values)
the targets are plain ``torch.zeros``, whose fill a graph records.
"""

from __future__ import annotations

import itertools

import torch

_SLOT = 4  # fp32 values per slot (16 bytes); NVFP4's amax pass uses two
_SLOTS = 1024  # slots per buffer (16 KiB)

# (device index, raw stream) -> (buffer [_SLOTS, _SLOT], slot index counter)
_BUFFERS: dict[tuple[int, int], tuple[torch.Tensor, itertools.count]] = {}


def zeroed_f32(device: torch.device, n: int | None = None) -> torch.Tensor:
    """fp32 zeros on ``device``, never handed out before (see the note): a scalar ``[]`` if
    ``n`` is None, else ``[n]``. Off CUDA (the Triton interpreter's CPU tensors): ``torch.zeros``."""
    if (device.type != "cuda" or (n or 1) > _SLOT or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()):
        return torch.zeros(() if n is None else n, dtype=torch.float32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    entry = _BUFFERS.get(key)
    slot = next(entry[1]) if entry is not None else _SLOTS
    if slot >= _SLOTS:  # a new buffer; one in use stays alive through its slots' views
        entry = _BUFFERS[key] = (torch.zeros(_SLOTS, _SLOT, dtype=torch.float32, device=device), itertools.count(1))
        slot = 0
    row = entry[0][slot]
    return row[0] if n is None else row[:n]
