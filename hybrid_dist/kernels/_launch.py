"""Eager Triton launches at the host cost of the compiled kernel's launcher.

[Note: direct launches]
``kernel[grid](*args, **consts)`` goes through Triton's ``JITFunction.run`` on every call
(argument binding and specialization, a string cache key, global-value checks, launch
metadata, device and stream lookups), several times the cost of the compiled launcher.
``launch(kernel, grid, *args, **consts)`` launches the same compiled kernel, keyed on what
Triton's specialization depends on, computed here from the values:

* a tensor: its dtype and whether its address is a multiple of 16;
* an int: whether it is 1, whether it is a multiple of 16, and whether it fits int32;
* a bool, float or None: its type;
* the constexpr and option keywords, by value; the current device.

Calls with the same key share Triton's compiled kernel. The first call of each key goes
through ``kernel[grid]`` (which compiles or finds it); later calls call its launcher with
every parameter in signature order (Triton 3.6; other versions always take ``kernel[grid]``),
for kernels without scratch memory (all of this package's) its C function (``_entry``).
Launch hooks (a profiler's), debug mode, pre-run hooks, an instrumentation mode and the
interpreter always take ``kernel[grid]``, so nothing they watch is skipped. Not cached:
Triton's check that the kernel's global values are unchanged (these kernels read module
constants only). Why: ``docs/design.md`` §8 ("Host cost").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
from triton import knobs

from hybrid_dist.kernels._jit_common import INTERPRET

_I32, _I64 = 2**31, 2**63
_Tensor = torch.Tensor
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_runtime = knobs.runtime
# the launcher signature is known (Triton 3.6), a compiled kernel exists (not the interpreter),
# and the specialization is NVIDIA's (AMD's also keys tensors on their storage size)
_DIRECT = (triton.__version__.startswith("3.6.") and not INTERPRET.value and _raw_stream is not None
           and _current_device is not None and torch.version.hip is None)

_compilation = knobs.compilation


class Cached(NamedTuple):
    """A cached launch (``_entry``): ``call(gx, gy, gz, stream, *head, *args, *tail)``."""

    compiled: Any  # the CompiledKernel that kernel[grid] returned
    call: Any  # its launcher's C launch function, or the launcher object (kernels with scratch)
    head: tuple  # the arguments before the kernel's own
    tail: tuple  # the constexpr values after the runtime arguments, in parameter order


_COMPILED: dict[tuple, Cached] = {}  # cache_key(...) -> Cached


def arg_keys(args: tuple) -> tuple:
    """What Triton's specialization of each runtime argument depends on (see the note):
    ``(dtype, aligned)`` per tensor, ``(== 1, % 16 == 0, fits int32, fits int64)`` per int,
    else the type. One expression, no call per argument: it runs on every launch."""
    return tuple([(a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, _Tensor)
                  else (a == 1, a & 15 == 0, -_I32 <= a < _I32, a < _I64) if type(a) is int
                  else type(a) for a in args])


def cache_key(kernel, device: int, args: tuple, consts: dict) -> tuple:
    """The ``_COMPILED`` key of a launch: the kernel, the current device, ``arg_keys`` and the
    constexpr keywords by value and type (Triton keys them by their text: True, 1 and 1.0 differ)."""
    return id(kernel), device, arg_keys(args), tuple(consts.items()), tuple(map(type, consts.values()))


def _constexpr_tail(kernel, n_args: int, consts: dict) -> tuple | None:
    """The values of the parameters after the ``n_args`` positional ones, in order (from
    ``consts`` or the defaults); None if one is missing (Triton then raises) or if a
    positional one is a constexpr (keyed like a runtime value, so never cached)."""
    if any(p.is_constexpr for p in kernel.params[:n_args]):
        return None
    tail = []
    for p in kernel.params[n_args:]:
        name = p.name
        if name in consts:
            tail.append(consts[name])
        elif p.has_default:
            tail.append(p.default)
        else:
            return None
    return tuple(tail)


def _entry(compiled, tail: tuple) -> Cached:
    """The ``_COMPILED`` value of a kernel Triton just compiled or found (and ran). Triton 3.6's
    launcher object (``compiled.run``) allocates the kernel's global and profile scratch, if it
    has any, then calls its C ``launch``; a kernel with neither is launched by that C function
    directly, with the launcher's cooperative-grid and PDL flags and no scratch (``None``), as
    the launcher itself would."""
    launcher, meta = compiled.run, compiled.packed_metadata  # handles loaded: the kernel has run
    if (getattr(launcher, "global_scratch_size", 1) == 0 and getattr(launcher, "profile_scratch_size", 1) == 0
            and hasattr(launcher, "launch")):
        head = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, meta, None,
                None, None)
        return Cached(compiled, launcher.launch, head, tail)
    return Cached(compiled, launcher, (compiled.function, meta, None, None, None), tail)


def launch(kernel, grid: tuple[int, ...], *args, **consts) -> None:
    """``kernel[grid](*args, **consts)`` without ``JITFunction.run`` once the kernel for this
    specialization is known (see the note). ``args``: the runtime parameters, positionally
    and first; ``consts``: constexprs and launch options (``num_warps``, ``maxnreg``)."""
    # Triton's own path where it does more than launch: launch hooks (a profiler; Triton 3.6
    # keeps them in HookChains, empty by default), debug mode, pre-run hooks, an instrumentation
    # mode (part of Triton's cache key, not of ours)
    enter, leave = _runtime.launch_enter_hook, _runtime.launch_exit_hook
    if (not _DIRECT or getattr(enter, "calls", enter) or getattr(leave, "calls", leave) or _runtime.debug
            or kernel.debug or kernel.pre_run_hooks or _compilation.instrumentation_mode):
        kernel[grid](*args, **consts)
        return
    device = _current_device()
    key = cache_key(kernel, device, args, consts)
    hit = _COMPILED.get(key)
    if hit is None:
        compiled = kernel[grid](*args, **consts)
        tail = _constexpr_tail(kernel, len(args), consts)
        if tail is not None and hasattr(compiled, "packed_metadata"):
            _COMPILED[key] = _entry(compiled, tail)
        return
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    hit.call(grid[0], g1, g2, _raw_stream(device), *hit.head, *args, *hit.tail)
