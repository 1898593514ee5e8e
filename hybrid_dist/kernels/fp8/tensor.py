"""Per-tensor FP8 (current / delayed scaling): amax pass + one fused cast-transpose pass.

Kernels (``torch.library`` ops in the ``hybrid_dist`` namespace):

* ``hybrid_dist::amax``: fp32 ``max|x|`` of a 2D tensor (tiles + relaxed atomic max).
* ``quantize_fp8_batched`` (eager only): the same kernels over a batch ``[B, M, K]`` (a
  third grid axis: one amax, scale and ``scale_inv`` per matrix; delayed scaling reads
  scale ``b`` of a stacked state and records into history row ``b``).
* ``hybrid_dist::fp8_cast_transpose``: reads ``x [M, K]`` once and writes the rowwise
  ``[M, K]`` and/or columnwise ``[K, M]`` (its transpose) fp8 data, bitwise
  ``Float8Quantizer._quantize_2d``. The scale is computed in the kernel from an amax
  (current: ``fp8_max / max(amax, eps)``, 1 if 0, clamped, optional power-of-two floor)
  or read as given (delayed); program (0, 0) writes ``scale_inv = 1 / scale`` (IEEE).
  With an ``amax_out`` buffer it also max-reduces ``max|x|`` into it in the same pass
  (delayed scaling records straight into ``amax_history[0]``, a running max).
* ``hybrid_dist::fp8_cast_transpose_current``: the same cast with the scale from an amax
  and no ``amax_out`` (mutates nothing). Compiled graphs use it for current scaling, with
  the amax as torch ops (``traced_amax``) that inductor fuses into the producer.

The two cast ops are ``torch.library.triton_op``s: inductor traces into them and launches
the kernel from its generated code (no dispatcher call or Python wrapper per call), with
the kernel and arguments of the eager path, so compiled and eager bytes are the same.
Eager code calls the host wrappers, which launch through ``kernels._launch``.

[Note: fp32 inputs] The columnwise tile is the rowwise fp8 tile transposed in registers
(``tl.trans``): bitwise the reference from bf16 and fp16 inputs. From fp32 inputs a launch
that writes both directions gives wrong columnwise bytes with Triton 3.6 on sm_90
(``docs/design.md`` §8), so fp32 inputs with a columnwise direction are cast rowwise and
``kernels.transpose`` transposes the rowwise data (bitwise the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_dist.formats.float8 import DelayedScalingState, Float8Quantizer, Float8Storage, stacked_delayed_states
from hybrid_dist.formats.numerics import FP8_MAX
from hybrid_dist.kernels._jit_common import cast_fp8, div_rn, eager_or_op, per_block_scale
from hybrid_dist.kernels._launch import launch
from hybrid_dist.kernels._traced import kernel_op, traced_empty_f32, traced_launch
from hybrid_dist.kernels._zeros import fresh_f32, zeroed_f32
from hybrid_dist.kernels.transpose import transpose_into, transposed
from hybrid_dist.library_op import library_op

_BM, _BK = 64, 128


@triton.jit
def _amax_kernel(x_ptr, amax_ptr, M, K, stride_m, stride_b, BM: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_k, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # pid_b: matrix of a batch
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    x = tl.load(x_ptr + pid_b.to(tl.int64) * stride_b + rm * stride_m + rk, mask=(rm < M) & (rk < K), other=0.0)
    tl.atomic_max(amax_ptr + pid_b, sem="relaxed", val=tl.max(tl.abs(x.to(tl.float32))))


@triton.jit
def _cast_transpose_kernel(
    x_ptr, amax_in_ptr, scale_ptr, scale_inv_ptr, row_ptr, col_ptr, amax_out_ptr, M, K, stride_m, stride_b,
    stride_amax_out, FMAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr, SCALE_FROM_AMAX: tl.constexpr,
    ROW: tl.constexpr, COL: tl.constexpr, AMAX_OUT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    pid_b = tl.program_id(2)  # matrix of a batch (its own amax, scale and scale_inv; 0 for one matrix)
    x_ptr += pid_b.to(tl.int64) * stride_b
    row_ptr += pid_b.to(tl.int64) * M * K
    col_ptr += pid_b.to(tl.int64) * M * K
    amax_in_ptr += pid_b
    scale_ptr += pid_b
    scale_inv_ptr += pid_b
    amax_out_ptr += pid_b * stride_amax_out  # a stacked delayed state: matrix b's history row
    rm = pid_m * BM + tl.arange(0, BM)[:, None]
    rk = pid_k * BK + tl.arange(0, BK)[None, :]
    mask = (rm < M) & (rk < K)
    x_in = tl.load(x_ptr + rm * stride_m + rk, mask=mask, other=0.0)
    x = x_in.to(tl.float32)
    if AMAX_OUT:
        tl.atomic_max(amax_out_ptr, sem="relaxed", val=tl.max(tl.abs(x)))
    if SCALE_FROM_AMAX:
        scale = per_block_scale(tl.load(amax_in_ptr), FMAX, EPS, POW2)
    else:
        scale = tl.load(scale_ptr)
    if (pid_m == 0) & (pid_k == 0):
        tl.store(scale_inv_ptr, div_rn(tl.zeros_like(scale) + 1.0, scale))
    out_ty = row_ptr.dtype.element_ty if ROW else col_ptr.dtype.element_ty
    q = cast_fp8(x * scale, FMAX, out_ty)
    if ROW:
        tl.store(row_ptr + rm * K + rk, q, mask=mask)
    if COL:  # columnwise stored [K, M]: element (m, k) goes to col[k, m]
        rm_t = pid_m * BM + tl.arange(0, BM)[None, :]
        rk_t = pid_k * BK + tl.arange(0, BK)[:, None]
        tl.store(col_ptr + rk_t * M + rm_t, tl.trans(q), mask=(rk_t < K) & (rm_t < M))


def _amax_2d(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scalar ``max|x|`` of a 2D tensor with unit stride along dim 1, reduced into
    ``out`` (zeros; default a zeroed slot, ``kernels._zeros``)."""
    m, k = x.shape
    out = zeroed_f32(x.device) if out is None else out
    if m and k:
        grid = ((m + _BM - 1) // _BM, (k + _BK - 1) // _BK)
        launch(_amax_kernel, grid, x, out, m, k, x.stride(0), 0, BM=_BM, BK=_BK, num_warps=4)
    return out


def _amax_2d_fresh(x: torch.Tensor) -> torch.Tensor:
    """``_amax_2d`` into ``fresh_f32``: the op's implementation (``kernels._zeros``' note)."""
    return _amax_2d(x, fresh_f32(x.device))


amax_op = library_op("hybrid_dist::amax")(_amax_2d_fresh)
amax_op.register_fake(lambda x: x.new_empty((), dtype=torch.float32))
amax_2d = eager_or_op(amax_op, _amax_2d)


def _fp8_cast_transpose(
    x: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, amax_out: torch.Tensor, dtype: torch.dtype,
    scale_from_amax: bool, eps: float, pow2: bool, rowwise: bool, columnwise: bool, record_amax: bool,
    run=None, scale_inv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(row [M, K] or empty, col [K, M] or empty, scale_inv [])``. Scale from ``amax``
    (``scale_from_amax``) or ``scale``; ``record_amax`` max-reduces ``max|x|`` into
    ``amax_out`` (mutated). ``run(kernel, grid, *args, **consts)`` launches the kernel
    (default ``launch``, looked up at the call); ``scale_inv`` is the fp32 ``[]`` it writes
    (default a new one)."""
    m, k = x.shape
    row = torch.empty((m, k) if rowwise else (0, 0), dtype=dtype, device=x.device)
    col = torch.empty((k, m) if columnwise else (0, 0), dtype=dtype, device=x.device)
    if scale_inv is None:
        scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    _cast_transpose_into(x, amax, scale, amax_out, scale_from_amax, eps, pow2, record_amax,
                         row=row if rowwise else None, col=col if columnwise else None, scale_inv=scale_inv, run=run)
    return row, col, scale_inv


def _cast_transpose_into(x, amax, scale, amax_out, scale_from_amax: bool, eps: float, pow2: bool,
                         record_amax: bool, *, row, col, scale_inv, run=None) -> None:
    """The cast-transpose launch into given buffers: ``row [M, K]`` and/or ``col [K, M]``
    (contiguous, the fp8 dtype; ``None`` skips that direction) and ``scale_inv []``."""
    m, k = x.shape
    rowwise, columnwise = row is not None, col is not None
    dtype = (row if rowwise else col).dtype
    grid = (max((m + _BM - 1) // _BM, 1), max((k + _BK - 1) // _BK, 1), 1)
    (run or launch)(
        _cast_transpose_kernel, grid,
        x, amax, scale, scale_inv, row if rowwise else col, col if columnwise else row, amax_out, m, k,
        max(x.stride(0), 1), 0, 0, FMAX=FP8_MAX[dtype],
        EPS=eps, POW2=pow2, SCALE_FROM_AMAX=scale_from_amax, ROW=rowwise, COL=columnwise,
        AMAX_OUT=record_amax, BM=_BM, BK=_BK, num_warps=8,
    )


def quantize_fp8_tensor_into(q: Float8Quantizer, x2d: torch.Tensor, row_st, col_st, amax) -> object:
    """Current-scaling FP8 of ``x2d`` written straight into existing storages (``row_st``
    ``[M, K]`` and/or ``col_st`` ``[K, M]``, contiguous, ``q.dtype``; the optimizer's
    write-back of a quantized weight), bitwise ``quantize_fp8_tensor`` then ``copy_from``.
    ``NotImplemented`` for any other case (the caller quantizes and copies)."""
    st = row_st if row_st is not None else col_st
    m, k = x2d.shape
    if (q.scaling != "current" or st is None or x2d.dtype not in (torch.float32, torch.bfloat16, torch.float16)
            or any(s is not None and (s.data.dtype != q.dtype or not s.data.is_contiguous()
                                      or tuple(s.data.shape) != ((k, m) if s.transposed else (m, k)))
                   for s in (row_st, col_st))):
        return NotImplemented
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    dev = x2d.device
    amax = _amax_2d(x2d) if amax is None else amax.float().to(dev).reshape(())
    fp32_col = col_st is not None and x2d.dtype == torch.float32  # the module note on fp32 inputs
    row = row_st.data if row_st is not None else (torch.empty((m, k), dtype=q.dtype, device=dev) if fp32_col else None)
    col = None if fp32_col or col_st is None else col_st.data
    _cast_transpose_into(x2d, amax, amax, _unused(dev, False), True, float(q.amax_epsilon), q.power_of_2_scales,
                         False, row=row, col=col, scale_inv=st.scale_inv)
    if fp32_col:
        transpose_into(col_st.data, row)
    if row_st is not None and col_st is not None and col_st.scale_inv is not row_st.scale_inv:
        col_st.scale_inv.copy_(row_st.scale_inv)
    return None


def _cast_fake(x, amax, scale, amax_out, dtype, scale_from_amax, eps, pow2, rowwise, columnwise, record_amax):
    m, k = x.shape
    return (x.new_empty((m, k) if rowwise else (0, 0), dtype=dtype),
            x.new_empty((k, m) if columnwise else (0, 0), dtype=dtype),
            x.new_empty((), dtype=torch.float32))


@kernel_op("hybrid_dist::fp8_cast_transpose", mutates_args=("amax_out",), fake=_cast_fake)
def cast_op(x: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, amax_out: torch.Tensor, dtype: torch.dtype,
            scale_from_amax: bool, eps: float, pow2: bool, rowwise: bool, columnwise: bool,
            record_amax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_fp8_cast_transpose`` for compiled graphs (delayed scaling: the amax recorded into
    ``amax_out``): the same kernel and arguments as eager, so the same bytes."""
    return _fp8_cast_transpose(x, amax, scale, amax_out, dtype, scale_from_amax, eps, pow2, rowwise, columnwise,
                               record_amax, run=traced_launch, scale_inv=traced_empty_f32(x.device))


fp8_cast_transpose = eager_or_op(cast_op, _fp8_cast_transpose)


def _cast_current_fake(x, amax, dtype, eps, pow2, rowwise, columnwise):
    return _cast_fake(x, amax, amax, amax, dtype, True, eps, pow2, rowwise, columnwise, False)


@kernel_op("hybrid_dist::fp8_cast_transpose_current", fake=_cast_current_fake)
def cast_current_op(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, eps: float, pow2: bool,
                    rowwise: bool, columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_fp8_cast_transpose`` with the scale from ``amax`` and nothing recorded, for compiled
    graphs (current scaling; mutates nothing, so no buffer is cloned): the same kernel and
    arguments as eager, so the same bytes. ``amax`` stands in for the unread scale and the
    never-written ``amax_out`` (the constexprs prune both)."""
    return _fp8_cast_transpose(x, amax, amax, amax, dtype, True, eps, pow2, rowwise, columnwise, False,
                               run=traced_launch, scale_inv=traced_empty_f32(x.device))


def traced_amax(x2d: torch.Tensor) -> torch.Tensor:
    """fp32 ``max|x|`` as torch ops, for compiled graphs: a max is exact in any order, so this
    equals ``_amax_2d`` bitwise (finite inputs), and inductor fuses it into the producer of
    ``x2d`` instead of launching an op that reads ``x2d`` again."""
    if x2d.numel() == 0:
        return x2d.new_zeros((), dtype=torch.float32)
    return x2d.abs().amax().to(torch.float32)


def quantize_fp8_batched(q: Float8Quantizer, x: torch.Tensor, *, columnwise: bool = True,
                         states: list[DelayedScalingState] | None = None):
    """Per-tensor FP8 of each matrix of ``x [B, M, K]`` (bf16, CUDA, unit stride along K), each
    with its own scale: ``(row [B, M, K], col [B, K, M] or None, scale_inv [B])``, bitwise
    ``quantize_fp8_tensor`` of every ``x[b]`` (the per-expert weights of ``moe.GroupedLinear``),
    in place of ``2·B`` launches and the stacking of ``B`` results.

    Current scaling: two launches (amax, then cast-transpose); while ``torch.compile`` traces,
    the same launches as the operator ``hybrid_dist::fp8_batched_current``. Delayed scaling
    (``states``: one ``DelayedScalingState`` per matrix; eager only): one launch, scale ``b``
    read from and the amax recorded (running max) into the states' stacked buffers
    (``formats.float8.stacked_delayed_states``)."""
    delayed = q.scaling == "delayed"
    if (x.dim() != 3 or x.dtype != torch.bfloat16 or x.stride(-1) != 1
            or (delayed and (states is None or len(states) != x.shape[0]))):
        raise ValueError(f"quantize_fp8_batched: bf16 [B, M, K] with unit stride along K (and one delayed-scaling "
                         f"state per matrix); got scaling={q.scaling!r}, {x.dtype} {tuple(x.shape)} strides "
                         f"{x.stride()}, {0 if states is None else len(states)} states")
    if not delayed:
        fn = batched_current_op if torch.compiler.is_compiling() else _batched_current
        row, col, scale_inv = fn(x, q.dtype, float(q.amax_epsilon), q.power_of_2_scales, columnwise)
        return row, (col if columnwise else None), scale_inv
    if torch.compiler.is_compiling():
        raise ValueError("quantize_fp8_batched: delayed scaling records into stacked states; not traceable")
    row, col, scale_inv = _batched_buffers(x, q.dtype, columnwise)
    hist, scale = stacked_delayed_states(states, x.device)
    if x.numel():
        _batched_cast(x, scale, scale, scale_inv, row, col, hist, hist.stride(0), q.dtype, float(q.amax_epsilon),
                      q.power_of_2_scales, False, columnwise, True, launch)
    else:
        torch.reciprocal(scale, out=scale_inv)
    return row, (col if columnwise else None), scale_inv


def _batched_buffers(x, dtype, columnwise):
    b, m, k = x.shape
    return (torch.empty((b, m, k), dtype=dtype, device=x.device),
            torch.empty((b, k, m) if columnwise else (0, 0, 0), dtype=dtype, device=x.device),
            torch.empty(b, dtype=torch.float32, device=x.device))


def _batched_grid(x):
    b, m, k = x.shape
    return ((m + _BM - 1) // _BM, (k + _BK - 1) // _BK, b)


def _batched_cast(x, amax_in, scale, scale_inv, row, col, amax_out, stride_out, dtype, eps, pow2, from_amax,
                  columnwise, record, run):
    b, m, k = x.shape
    run(_cast_transpose_kernel, _batched_grid(x), x, amax_in, scale, scale_inv, row, col, amax_out, m, k,
        x.stride(1), x.stride(0), stride_out, FMAX=FP8_MAX[dtype], EPS=eps, POW2=pow2, SCALE_FROM_AMAX=from_amax,
        ROW=True, COL=columnwise, AMAX_OUT=record, BM=_BM, BK=_BK, num_warps=8)


def _batched_current(x, dtype, eps, pow2, columnwise, amax=None, run=None):
    """Current scaling of ``quantize_fp8_batched``: ``(row, col or empty, scale_inv)``; the
    amax max-reduced into ``amax`` (zeros ``[B]``; default a zeroed slot) by the first launch."""
    run = run or launch
    b, m, k = x.shape
    row, col, scale_inv = _batched_buffers(x, dtype, columnwise)
    if not x.numel():
        return row, col, scale_inv.fill_(1.0)
    amax = zeroed_f32(x.device, b) if amax is None else amax
    run(_amax_kernel, _batched_grid(x), x, amax, m, k, x.stride(1), x.stride(0), BM=_BM, BK=_BK, num_warps=4)
    _batched_cast(x, amax, amax, scale_inv, row, col, amax, 0, dtype, eps, pow2, True, columnwise, False, run)
    return row, col, scale_inv


def _batched_current_fake(x, dtype, eps, pow2, columnwise):
    return _batched_buffers(x, dtype, columnwise)


@kernel_op("hybrid_dist::fp8_batched_current", fake=_batched_current_fake)
def batched_current_op(x: torch.Tensor, dtype: torch.dtype, eps: float, pow2: bool,
                       columnwise: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_batched_current`` for compiled graphs: the same kernels and arguments as eager (the
    amax reduced into a traced zeroed buffer), so the same bytes."""
    amax = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    return _batched_current(x, dtype, eps, pow2, columnwise, amax, traced_launch)


_UNUSED: dict[torch.device, torch.Tensor] = {}


def _unused(device, compiling: bool) -> torch.Tensor:
    """A never-written placeholder for the ``amax_out`` argument."""
    if compiling:  # a traced buffer; never stored in the eager cache
        return torch.zeros(1, dtype=torch.float32, device=device)
    buf = _UNUSED.get(device)
    if buf is None:
        buf = _UNUSED[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return buf


def quantize_fp8_tensor(q: Float8Quantizer, x2d, *, rowwise, columnwise, state, amax):
    """Registry impl for :class:`Float8Quantizer` (bitwise the reference; fp32 inputs with a
    columnwise direction: rowwise, then a torch transpose, the module's note on fp32 inputs)."""
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    if columnwise and x2d.dtype == torch.float32:
        row_st, _ = quantize_fp8_tensor(q, x2d, rowwise=True, columnwise=False, state=state, amax=amax)
        col_st = Float8Storage(data=transposed(row_st.data), scale_inv=row_st.scale_inv, transposed=True)
        return (row_st if rowwise else None), col_st
    dev = x2d.device
    # eager: the raw host wrappers (no dispatcher); while compiling: the torch.library ops
    compiling = torch.compiler.is_compiling()
    cast = cast_op if compiling else _fp8_cast_transpose
    if q.scaling == "delayed":
        if not isinstance(state, DelayedScalingState):
            return NotImplemented  # the reference raises the explanatory ValueError
        state.to(dev)
        record = amax is None
        if not record:
            state.record(amax.float().to(dev))
        row, col, scale_inv = cast(
            x2d, state.scale, state.scale, state.amax_history, q.dtype, False, 0.0, False,
            rowwise, columnwise, record)
    else:
        if amax is None:
            amax = traced_amax(x2d) if compiling else _amax_2d(x2d)
        else:
            amax = amax.float().to(dev).reshape(())
        if compiling:
            row, col, scale_inv = cast_current_op(x2d, amax, q.dtype, float(q.amax_epsilon), q.power_of_2_scales,
                                                  rowwise, columnwise)
        else:
            row, col, scale_inv = _fp8_cast_transpose(
                x2d, amax, amax, _unused(dev, False), q.dtype, True, float(q.amax_epsilon),
                q.power_of_2_scales, rowwise, columnwise, False)
    row_st = Float8Storage(data=row, scale_inv=scale_inv, transposed=False) if rowwise else None
    col_st = Float8Storage(data=col, scale_inv=scale_inv, transposed=True) if columnwise else None
    return row_st, col_st
