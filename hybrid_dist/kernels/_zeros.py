"""Zero-filled fp32 targets for the amax passes' atomic max, without a fill per call.

[Note: zeroed slots]
An amax pass max-reduces into a buffer that must start at zero. ``torch.zeros`` costs an
allocation and a fill launch: ~10 µs of host time alone and ~35 µs of profiled time
inside an ``hd.Linear`` step, three times per step. ``zeroed_f32(device, n)`` hands out
fresh slots of a buffer zeroed once per ``_SLOTS`` slots instead. A slot is never
handed out twice, so nothing is reset and no kernel can see another's maximum.

One buffer per (device, current stream): the buffer is allocated on the stream whose
kernels use it, so the caching allocator reuses its memory only after those kernels (the
usual stream semantics), and slots are taken in the order that stream runs them. Under
CUDA-graph capture every replay would reuse the captured slot, so there (and while
tracing) the slots are plain ``torch.zeros``, whose fill the graph records.
"""

from __future__ import annotations

import torch

_SLOTS = 4096  # fp32 slots per buffer (16 KiB)

# (device index, raw stream) -> [buffer, index of the next free slot]
_BUFFERS: dict[tuple[int, int], list] = {}


def zeroed_f32(device: torch.device, n: int | None = None) -> torch.Tensor:
    """fp32 zeros on ``device``, never handed out before (see the note): a scalar ``[]`` if
    ``n`` is None, else ``[n]``. Off CUDA (the Triton interpreter's CPU tensors): ``torch.zeros``."""
    size = 1 if n is None else n
    if (device.type != "cuda" or size > _SLOTS or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()):
        return torch.zeros(() if n is None else n, dtype=torch.float32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    entry = _BUFFERS.get(key)
    if entry is None or entry[1] + size > _SLOTS:
        entry = _BUFFERS[key] = [torch.zeros(_SLOTS, dtype=torch.float32, device=device), 0]
    buf, start = entry
    entry[1] = start + size
    return buf[start] if n is None else buf[start:start + size]
