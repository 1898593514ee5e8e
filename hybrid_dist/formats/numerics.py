"""Element and scale encodings shared by the formats, in pure torch.

Everything here is exact integer/bit arithmetic or a single IEEE rounding, so the
Triton kernels can reproduce it bitwise:

* ``cast_to_fp8``: saturating cast (PyTorch's own cast turns out-of-range E4M3 into NaN).
* ``e8m0_from_amax``: MXFP8 block exponent, rounded **up** (RCEIL, as cuBLAS and TE).
* ``exp2_int``: ``2**k`` built from bits, exact down to the fp32 subnormal range.
* ``e2m1_encode`` / ``e2m1_decode``: FP4 E2M1 codes (round-to-nearest-even or stochastic),
  ``pack_fp4`` / ``unpack_fp4``: two codes per byte, element ``2j`` in the low nibble.
* ``hadamard16``: the 16×16 random Hadamard transform ``T = H16 · diag(s) / 4`` (orthogonal).
"""

from __future__ import annotations

import functools

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# The eight non-negative E2M1 values, indexed by their 3-bit magnitude code.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbours. A tie rounds to the even code: ties at 0.25, 1.25, 2.5, 5
# go down (to codes 0, 2, 4, 6), ties at 0.75, 1.75, 3.5 go up (to codes 2, 4, 6).
_E2M1_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)


def check_fp8_dtype(dtype: torch.dtype) -> None:
    if dtype not in FP8_MAX:
        raise ValueError(
            f"fp8 dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}"
        )


def cast_to_fp8(x_scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of an fp32 tensor to ``dtype``."""
    fmax = FP8_MAX[dtype]
    return x_scaled.clamp(-fmax, fmax).to(dtype)


def exp2_int(k: torch.Tensor) -> torch.Tensor:
    """Exact ``2.0**k`` in fp32 for integer tensors ``k`` in [-149, 127], built from bits."""
    k = k.to(torch.int32)
    normal = (k + 127).clamp(min=1) << 23
    subnormal = torch.ones_like(k) << (k + 149).clamp(min=0, max=22)
    bits = torch.where(k >= -126, normal, subnormal)
    return bits.view(torch.float32)


def pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= ``x`` for positive normal fp32 ``x`` (clears the mantissa)."""
    return (x.float().view(torch.int32) & 0x7F800000).view(torch.float32)


def scale_from_amax(amax: torch.Tensor, fmax: float, *, margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """fp32 encode scale ``fmax / amax`` (1 where amax is 0; clamped to the fp32 max),
    divided by ``2**margin``, optionally rounded down to a power of two.

    One IEEE division with a tensor numerator: torch computes ``scalar / tensor`` as a
    reciprocal then a multiply (two roundings), which the kernels would not reproduce.
    """
    amax = amax.float()
    scale = torch.where(amax > 0, torch.full_like(amax, fmax) / amax, torch.ones_like(amax))
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    if margin:
        scale = scale / (2.0**margin)
    return pow2_floor(scale) if pow2 else scale


def e8m0_from_amax(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """Biased E8M0 exponent ``e`` (uint8) such that ``2**(e-127) >= amax / elem_max``.

    ``amax / elem_max`` is rounded up to a power of two (RCEIL). NaN/Inf amax gives 255
    (the E8M0 NaN); zero amax gives 0 (scale 2**-127, every element quantizes to 0).
    """
    amax = amax.float()
    # a tensor divisor: CUDA computes ``tensor / python_scalar`` as a * (1/b) (2 roundings)
    ratio = amax / torch.full_like(amax, elem_max)
    bits = ratio.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + round_up.to(torch.int32)
    e = torch.where(exponent == 0xFF, torch.full_like(e, 0xFF), e)
    return e.to(torch.uint8)


def e8m0_to_scale(e: torch.Tensor) -> torch.Tensor:
    """Decode scale ``2**(e-127)`` (fp32) of a biased E8M0 exponent tensor (uint8)."""
    return exp2_int(e.to(torch.int32) - 127)


def e8m0_to_inv_scale(e: torch.Tensor) -> torch.Tensor:
    """Encode multiplier ``2**(127-e)`` (fp32); exact, never a division."""
    return exp2_int(127 - e.to(torch.int32))


def e2m1_encode(v: torch.Tensor, rand: torch.Tensor | None = None) -> torch.Tensor:
    """E2M1 4-bit codes (uint8, sign in bit 3) of fp32 ``v`` already scaled into [-6, 6].

    ``rand=None`` rounds to nearest even. Otherwise ``rand`` (uniform [0, 1), v's shape)
    rounds stochastically: up with probability ``(|v| - lo) / (hi - lo)``, which makes
    the rounding unbiased. The sign bit is ``v``'s: ``-0.0`` and negatives that round to
    zero encode as ``0x8`` (negative zero), as an IEEE conversion does (Blackwell's
    ``cvt.*.e2m1x2.f32`` too); the kernels take it from the input's bits.
    """
    mag = v.abs().clamp(max=E2M1_MAX)
    if rand is None:
        code = torch.zeros_like(mag, dtype=torch.uint8)
        for t in _E2M1_TIES_DOWN:
            code += (mag > t).to(torch.uint8)
        for t in _E2M1_TIES_UP:
            code += (mag >= t).to(torch.uint8)
    else:  # lo = the grid point at or below |v| (counted from scalar thresholds)
        lo = torch.zeros_like(mag, dtype=torch.uint8)
        for t in E2M1_GRID[1:]:
            lo += (mag >= t).to(torch.uint8)
        lo = lo.clamp(max=6)
        lo_val, hi_val = _e2m1_values(lo), _e2m1_values(lo + 1)
        p_up = (mag - lo_val) / (hi_val - lo_val)
        code = lo + (rand < p_up).to(torch.uint8)
    sign = torch.signbit(v).to(torch.uint8) << 3  # -0.0 too, as an IEEE conversion
    return code | sign


def _e2m1_values(i: torch.Tensor) -> torch.Tensor:
    """fp32 ``E2M1_GRID[i]`` for integer ``i`` in [0, 7], built from the bits: code
    ``i = 2e + m`` with ``e >= 1`` is ``2**(e-1) * (1 + m/2)``, whose fp32 pattern is
    ``(i << 22) + (126 << 23)``; the subnormals 0 and 1 are ``i/2``. No grid tensor is
    built on the host, so on CUDA there is no blocking copy (the sync-free MoE path runs
    this under ``torch.cuda.set_sync_debug_mode("error")``), and no per-value select."""
    ii = i.to(torch.int32)
    normal = ((ii << 22) + (126 << 23)).view(torch.float32)
    return torch.where(ii < 2, ii.to(torch.float32) * 0.5, normal)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8, low 4 bits used)."""
    mag = _e2m1_values(code & 0x7)
    return torch.where((code & 0x8) != 0, -mag, mag)


def pack_fp4(code: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[..., 2n]`` into bytes ``[..., n]``: element 2j low nibble, 2j+1 high."""
    return code[..., 0::2] | (code[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: bytes ``[..., n]`` to codes ``[..., 2n]``."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


@functools.lru_cache(maxsize=16)
def _hadamard16_cpu(seed: int) -> torch.Tensor:
    cpu = torch.device("cpu")  # explicit: also inside a `with torch.device("cuda")` block
    h = torch.ones(1, 1, device=cpu)
    for _ in range(4):  # Sylvester construction, 16 = 2**4
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator(device=cpu).manual_seed(seed)
    signs = torch.randint(0, 2, (16,), generator=gen, device=cpu).float() * 2 - 1
    return h * signs / 4.0  # T = H16 · diag(s) / 4 ; T @ T.T == I


def hadamard16(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16×16 orthogonal random Hadamard matrix ``T`` for ``seed`` (fp32).

    A row-chunked matrix ``X [R, C]`` (chunks of 16 along C) is transformed as
    ``Y = X_chunks @ T.T`` and restored as ``X = Y_chunks @ T``; dot products along C
    are preserved, so two operands transformed with the same ``T`` multiply exactly.
    """
    if torch.compiler.is_compiling():  # a torch.Generator cannot be traced: a constant instead
        return torch.tensor(_hadamard16_values(seed), dtype=torch.float32, device=device).reshape(16, 16)
    device = torch.device(device)
    key = (seed, device)
    if key not in _HADAMARD_ON_DEVICE:  # once per device, and without a host sync
        t = _hadamard16_cpu(seed)
        if device.type == "cuda":
            t = t.pin_memory().to(device, non_blocking=True)
        _HADAMARD_ON_DEVICE[key] = t.to(device)
    return _HADAMARD_ON_DEVICE[key]


_HADAMARD_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}  # never mutated by callers


def _assume_constant_result(fn):
    """What ``torch.compiler.assume_constant_result`` does (it sets this one attribute, read
    when dynamo traces a call), without importing ``torch._dynamo`` when hybrid_dist is
    imported: that import costs seconds in every process (e.g. each torchrun rank);
    ``tests/formats/test_numerics.py`` checks the attribute against torch's decorator."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _hadamard16_values(seed: int) -> tuple[float, ...]:
    """The entries of ``T`` (all ±1/4, exact) as Python floats, for tracing."""
    return tuple(_hadamard16_cpu(seed).flatten().tolist())


def apply_hadamard16(x: torch.Tensor, t: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Apply ``T`` (or its inverse) to each 16-chunk of the last dim of fp32 ``x``."""
    r, c = x.shape
    m = t if inverse else t.t()
    return (x.reshape(r, c // 16, 16) @ m).reshape(r, c)
