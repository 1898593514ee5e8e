"""The NVFP4 kernels' stochastic-rounding stream in plain torch (no Triton): the ground truth
the kernels are compared with bitwise.

* ``philox4x32_10``: Philox4x32-10 (Salmon et al., SC'11) on uint32 held in int64 tensors;
  Triton's ``tl.randint4x(seed, c)`` is counter ``(c, 0, 0, 0)`` and key ``(seed & M32,
  seed >> 32)``.
* ``kernel_sr_rand``: per element of one direction, the uniform ``rand`` for which
  ``numerics.e2m1_encode(v, rand)`` rounds up exactly when the kernel does: the kernel
  rounds up when ``(u - lo) / gap >= 1 - n`` with ``n = (r8 + 1/2) / 256`` (``kernels.nvfp4._e2m1.
  e2m1_sr_mad``), the reference when ``rand < (u - lo) / gap``, so ``rand`` is the fp32 just
  below ``1 - n``. Element ``(m, k)`` of ``x [M, K]`` takes byte ``m % 4`` of word
  ``(m % 16) / 4`` of counter ``(m / 16)·K + k`` (rowwise), ``⌈M/16⌉·K`` more (columnwise).
* ``KernelStreamNVFP4``: the reference quantizer drawing those ``rand``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from hybrid_dist.formats.nvfp4 import NVFP4Quantizer

M32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(a·b) >> 32`` and ``(a·b) & M32`` for uint32 ``a``, ``b`` (int64 without overflow)."""
    lo_part = a * (b & 0xFFFF)  # < 2**48
    hi_part = a * (b >> 16)
    hi = (hi_part + (lo_part >> 16)) >> 16
    lo = (((hi_part & 0xFFFF) << 16) + lo_part) & M32
    return hi, lo


def philox4x32_10(c0, c1, c2, c3, k0: int, k1: int) -> tuple[torch.Tensor, ...]:
    """Ten Philox rounds on counters ``c0..c3`` (int64 tensors of uint32 values), key ``(k0, k1)``."""
    for _ in range(10):
        hi_b, lo_b = _mulhilo(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & M32, (k1 + _KEY_B) & M32
    return c0, c1, c2, c3


def randint4x(seed: int, ctr: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Triton's ``tl.randint4x(seed, ctr)`` for uint32 counters ``ctr`` (int64 tensor)."""
    z = torch.zeros_like(ctr)
    return philox4x32_10(ctr & M32, z, z, z, seed & M32, (seed >> 32) & M32)


def kernel_sr_rand(seed: int, m: int, k: int, columnwise: bool, device=None) -> torch.Tensor:
    """fp32 ``rand`` of one direction: ``[M, K]`` rowwise, ``[K, M]`` (the transposed
    direction's element order) columnwise (module doc)."""
    mi = torch.arange(m, dtype=torch.int64, device=device)[:, None]
    ctr = (mi // 16) * k + torch.arange(k, dtype=torch.int64, device=device)[None, :]
    if columnwise:
        ctr = ctr + -(-m // 16) * k
    words = torch.stack(randint4x(seed, ctr))  # [4, M, K]
    word = torch.gather(words, 0, ((mi % 16) // 4).expand(m, k)[None])[0]
    rand = noise_rand((word >> (8 * (mi % 4))) & 0xFF)
    return rand.t().contiguous() if columnwise else rand


def noise_rand(r8: torch.Tensor) -> torch.Tensor:
    """fp32 just below ``1 - (r8 + 1/2) / 256`` (exact: 9 bits) for random bytes ``r8``."""
    return torch.nextafter((1.0 - (r8.double() + 0.5) / 256).float(), torch.zeros((), device=r8.device))


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelStreamNVFP4(NVFP4Quantizer):
    """The reference NVFP4 quantizer with stochastic rounding from the kernels' stream for the
    int64 seed ``kernel_seed`` (the kernels take it as a tensor: the state's kernel key, one
    per call, ``NVFP4State.kernel_key``)."""

    kernel_seed: int = 0

    def _rand(self, shape, device, state, *, like=None, draw: int = 0) -> torch.Tensor:
        assert self.stochastic_rounding
        m, k = shape if draw == 0 else shape[::-1]
        return kernel_sr_rand(self.kernel_seed, m, k, columnwise=bool(draw), device=device)


@contextlib.contextmanager
def fixed_kernel_seed(seed: int):
    """Within the block, the NVFP4 kernels' per-call seed is ``seed`` (not the state's kernel
    key): their output is then comparable with ``KernelStreamNVFP4``'s."""
    from hybrid_dist.kernels.nvfp4 import quantize as nvfp4

    draw = nvfp4._seed_tensor
    nvfp4._seed_tensor = lambda q, state, device, like: torch.tensor([seed], dtype=torch.int64, device=device)
    try:
        yield
    finally:
        nvfp4._seed_tensor = draw
