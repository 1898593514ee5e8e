"""Quantization statistics of one GEMM operand direction, as one device vector.

``quant_stats(x2d, storage)`` compares a direction ``storage`` (what a GEMM multiplies)
with the high-precision tensor ``x2d [M, K]`` it was made from, in the quantizer's own
orientation and domain: the stored ``[R, C]`` (columnwise is ``x2d.T``), and for an NVFP4
direction with a random Hadamard transform, ``x · T`` (what the quantizer rounded). The
result is one float64 vector (``FIELDS``, then ``HIST_BINS`` histogram counts), computed
on the tensor's device without a host sync: on CUDA the first six fields by one kernel
(``kernels.stats``, one read of the operand, its codes and scales), elsewhere by torch ops
(the reference; ``fused=False`` picks them on CUDA too).

    amax          max |x|                                          (exact)
    signal_norm   ‖x‖₂             (fp32 reduction)
    noise_norm    ‖x − x̂‖₂         x̂ = codes · block scales · tensor scale
    nonzero       #{x ≠ 0}                                         (exact count)
    underflow     #{x ≠ 0 and x̂ = 0}   nonzero values flushed to zero
    saturated     #{|x| > elem_max · s_b}   beyond the largest magnitude of its block
    numel         elements
    sharded       1 if the tensor is this rank's shard of a larger GEMM operand, else 0
    hist[i]       #{blocks b : floor(log2 s_b) = HIST_LO + i}, ends clamped

``s_b`` is the block's dequantization multiplier (``BLOCK_SCALES`` per storage kind: the
per-tensor ``scale_inv`` of FP8, each 1×128 / 128×128 ``scale_inv``, MXFP8's E8M0 power of
two, NVFP4's E4M3 block scale × its fp32 global scale). A high-precision (identity)
direction has no blocks: ``saturated`` is 0 and the histogram empty. SQNR (dB) is
``20·log10(signal_norm / noise_norm)`` (``decode``). Without a high-precision tensor
(``x2d=None``: a quantized parameter) ``x`` is the dequantized tensor itself and every
field that needs the reference is NaN.
"""

from __future__ import annotations

import math

import torch

from hybrid_dist.formats.float8 import Float8Storage
from hybrid_dist.formats.float8_block import BLOCK as FP8_BLOCK, Float8BlockStorage
from hybrid_dist.formats.identity import IdentityStorage
from hybrid_dist.formats.mxfp8 import MX_BLOCK, MXFP8Storage
from hybrid_dist.formats.numerics import E2M1_MAX, FP8_MAX, apply_hadamard16, e8m0_to_scale, hadamard16
from hybrid_dist.formats.nvfp4 import NV_BLOCK, NVFP4Storage

FIELDS = ("amax", "signal_norm", "noise_norm", "nonzero", "underflow", "saturated", "numel", "sharded")
HIST_LO, HIST_BINS = -64, 128  # histogram of floor(log2 s_b) over [-64, 63]; outside -> end bins
WIDTH = len(FIELDS) + HIST_BINS


def _fp8(st: Float8Storage):
    r, c = st.shape2d
    return st.scale_inv.reshape(1, 1), r, c, FP8_MAX[st.data.dtype]


def _fp8_block(st: Float8BlockStorage):
    return st.scale_inv, st.block_rows, FP8_BLOCK, FP8_MAX[st.data.dtype]


def _mxfp8(st: MXFP8Storage):
    return e8m0_to_scale(st.scale), 1, MX_BLOCK, FP8_MAX[st.data.dtype]


def _nvfp4(st: NVFP4Storage):
    return st.block_scale.float() * st.global_scale, st.block_rows, NV_BLOCK, E2M1_MAX


# storage class -> fn(storage) -> (s_b [R/br, C/bc] fp32, br, bc, elem_max)
BLOCK_SCALES = {Float8Storage: _fp8, Float8BlockStorage: _fp8_block, MXFP8Storage: _mxfp8, NVFP4Storage: _nvfp4}


def block_scales(storage):
    """``(s_b [R/br, C/bc], br, bc, elem_max)`` of a storage, or None for an identity one."""
    if isinstance(storage, IdentityStorage):
        return None
    fn = BLOCK_SCALES.get(type(storage))
    if fn is None:
        raise NotImplementedError(
            f"quant_stats: no block-scale rule for {type(storage).__name__}; add one to "
            "hybrid_dist.inspection.stats.BLOCK_SCALES")
    return fn(storage)


def quantizer_domain(x2d: torch.Tensor, storage) -> torch.Tensor:
    """fp32 ``x2d`` as the quantizer saw it for ``storage``: stored orientation, and
    Hadamard-transformed where the direction is."""
    x = (x2d.t() if storage.transposed else x2d).float()
    seed = getattr(storage, "rht_seed", None)
    if seed is not None:
        x = apply_hadamard16(x, hadamard16(seed, x.device))
    return x


def dequantized_domain(storage) -> torch.Tensor:
    """fp32 ``[R, C]`` values of ``storage`` in its quantizer's domain (scales applied)."""
    v = storage.values(undo_rht=False)
    s = storage.tensor_scale()
    return v if s is None else v * s


def _fused_head(x2d: torch.Tensor | None, storage) -> torch.Tensor | None:
    """The first six fields from one kernel (``kernels.stats``), or None for a storage kind
    it does not cover (every kind of ``BLOCK_SCALES`` and identity is covered)."""
    from hybrid_dist.kernels import stats as kernel  # imports Triton

    if not kernel.supported(storage) or (x2d is not None and x2d.dim() != 2):
        return None
    if x2d is None:
        x = None
    elif getattr(storage, "rht_seed", None) is not None:
        x = quantizer_domain(x2d, storage)  # fp32 x·T, as the quantizer rounded it
    else:
        x = x2d.t() if storage.transposed else x2d  # a view: the kernel reads through strides
    return kernel.stats_head(x, storage)


def quant_stats(x2d: torch.Tensor | None, storage, *, sharded: bool = False,
                fused: bool | None = None) -> torch.Tensor:
    """float64 ``[WIDTH]`` statistics of ``storage`` against ``x2d`` (see the module doc).
    ``fused``: whether the six head fields and the histogram come from the kernels
    (``kernels.stats``) rather than the torch ops; None: on CUDA tensors. The torch ops are the reference; True off
    CUDA needs the Triton interpreter (``TRITON_INTERPRET=1``)."""
    if fused is None:
        fused = storage.device.type == "cuda"
    head = _fused_head(x2d, storage) if fused else None
    dev = storage.device
    hist = _scale_histogram(storage, dev, fused)
    numel = torch.full((), float(x2d.numel() if x2d is not None else math.prod(storage.shape2d)),
                       dtype=torch.float64, device=dev)
    shard = torch.full((), float(sharded), dtype=torch.float64, device=dev)
    if head is None:
        head = _torch_head(x2d, storage)
    return torch.cat([head, numel.reshape(1), shard.reshape(1), hist.double()])


def _scale_histogram(storage, device, fused: bool = False) -> torch.Tensor:
    """int64 ``[HIST_BINS]``: blocks by ``floor(log2 s_b)`` (empty for an identity direction);
    ``fused``: one kernel (``kernels.stats.scale_histogram``) instead of the torch ops."""
    hist = torch.zeros(HIST_BINS, dtype=torch.int64, device=device)
    scales = block_scales(storage)
    if scales is not None and fused and HIST_LO > -126:
        from hybrid_dist.kernels.stats import scale_histogram  # Triton: CUDA installs only

        return scale_histogram(scales[0], HIST_LO, HIST_BINS)  # no atomics on one global bin per block
    if scales is not None:
        s_b = scales[0]
        _, exp = torch.frexp(s_b.float())  # s = m · 2**exp, m in [0.5, 1): floor(log2 s) = exp - 1
        idx = torch.where(s_b > 0, exp.long() - 1 - HIST_LO, 0).clamp(0, HIST_BINS - 1)
        hist.scatter_add_(0, idx.reshape(-1), torch.ones_like(idx.reshape(-1)))
    return hist


def _torch_head(x2d: torch.Tensor | None, storage) -> torch.Tensor:
    """float64 ``[6]``: amax, signal_norm, noise_norm, nonzero, underflow, saturated (torch ops)."""
    v = dequantized_domain(storage)
    have_ref = x2d is not None
    x = quantizer_domain(x2d, storage) if have_ref else v
    nan = torch.full((), math.nan, dtype=torch.float64, device=v.device)
    ax = x.abs()
    amax = ax.amax().double() if x.numel() else torch.zeros((), dtype=torch.float64, device=v.device)
    signal = torch.linalg.vector_norm(x).double()
    noise = torch.linalg.vector_norm(x - v).double() if have_ref else nan
    nz = x != 0
    nonzero = nz.sum().double()
    underflow = (nz & (v == 0)).sum().double() if have_ref else nan
    scales = block_scales(storage)
    if scales is None:
        saturated = torch.zeros((), dtype=torch.float64, device=v.device)
    else:
        s_b, br, bc, elem_max = scales
        r, c = x.shape
        limit = (s_b.float() * elem_max).reshape(r // br, 1, c // bc, 1)
        saturated = (ax.reshape(r // br, br, c // bc, bc) > limit).sum().double() if have_ref else nan
    return torch.stack([amax, signal, noise, nonzero, underflow, saturated])


def combine_stats(vectors: torch.Tensor) -> torch.Tensor:
    """float64 ``[WIDTH]``: the statistics of the union of the tensors whose ``quant_stats``
    are the rows of ``vectors [n, WIDTH]`` (each expert's storage of one grouped operand):
    ``amax`` and ``sharded`` the max, ``signal_norm`` and ``noise_norm`` the square root of
    the sum of squares, the counts and the histogram the sums. NaN (no reference) stays NaN."""
    if vectors.shape[0] == 0:
        return vectors.new_zeros(WIDTH)
    i = {f: n for n, f in enumerate(FIELDS)}
    head = vectors[:, :len(FIELDS)]
    norms = head[:, [i["signal_norm"], i["noise_norm"]]].square().sum(0).sqrt()
    maxes = head[:, [i["amax"], i["sharded"]]].amax(0)
    out = vectors.sum(0)  # counts and histogram
    out[i["amax"]], out[i["sharded"]] = maxes[0], maxes[1]
    out[i["signal_norm"]], out[i["noise_norm"]] = norms[0], norms[1]
    return out


def _num(v: float):
    return None if math.isnan(v) else v


def decode(vec: list[float]) -> dict:
    """A ``quant_stats`` vector (host floats) as a JSON-ready dict: ``amax``, ``sqnr_db``
    (None where the reference is missing or the quantization is exact), ``underflow`` and
    ``saturated`` as fractions (of the nonzero values, of all values), ``numel`` and
    ``scale_hist`` ``{"log2_lo": e, "counts": [...]}`` trimmed to its nonzero bins (``e`` is
    the exponent of the first bin; the first and last of the full range also count what lies
    beyond, the first also all-zero blocks), and ``scope``: ``"shard"`` or ``"full"``."""
    f = dict(zip(FIELDS, vec[:len(FIELDS)]))
    counts = [int(c) for c in vec[len(FIELDS):]]
    nz_bins = [i for i, c in enumerate(counts) if c]
    hist = ({"log2_lo": HIST_LO + nz_bins[0], "counts": counts[nz_bins[0]:nz_bins[-1] + 1]}
            if nz_bins else {"log2_lo": 0, "counts": []})
    sig, noise = f["signal_norm"], f["noise_norm"]
    sqnr = 20 * math.log10(sig / noise) if noise > 0 and sig > 0 and not math.isnan(noise) else None
    nonzero, numel = f["nonzero"], f["numel"]
    return {"amax": f["amax"], "sqnr_db": sqnr,
            "underflow": _num(f["underflow"] / nonzero) if nonzero else (None if math.isnan(f["underflow"]) else 0.0),
            "saturated": _num(f["saturated"] / numel) if numel else 0.0,
            "nonzero": int(nonzero), "numel": int(numel), "scale_hist": hist,
            "scope": "shard" if f["sharded"] else "full"}
