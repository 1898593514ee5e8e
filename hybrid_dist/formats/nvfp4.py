"""NVFP4: E2M1 elements packed two per byte, an E4M3 scale per 16 elements, and an fp32
per-tensor scale.

Layout for a logical ``[M, K]`` tensor (stored forms, see ``_storage``):

* rowwise    ``data`` uint8 ``[M, K/2]``, ``block_scale`` fp8 E4M3 ``[M, K/16]``;
* columnwise ``data`` uint8 ``[K, M/2]``, ``block_scale`` ``[K, M/16]``;
* ``block_2d=True`` (weights): 16×16 blocks, ``block_scale`` ``[R/16, C/16]``; columnwise
  is then the exact transpose of rowwise (codes and scales);
* ``global_scale`` fp32 ``[]`` per direction (the RHT direction has its own amax).

Byte ``j`` of a row packs elements ``2j`` (low nibble) and ``2j+1`` (high nibble); a code
is sign(bit 3) + E2M1 magnitude (see ``_numerics``). Scale rules (as TE):

    global_scale = amax / (448 · 6)                      (amax 0 → 1)
    block_scale  = e4m3( min(amax_block / 6 / global_scale, 448) )
    encode       = min(1 / (block_scale · global_scale), fp32 max)    (0 where block_scale is 0)
    q            = e2m1( x · encode )                  (RNE, or stochastic)
    x            ≈ q · block_scale · global_scale

Options: ``rht`` applies the 16×16 random Hadamard transform ``T`` (``numerics.hadamard16``,
sign vector from ``rht_seed``) along the contraction dim of the **columnwise** direction
only (the wgrad operand of inputs and gradients); ``stochastic_rounding`` rounds elements
stochastically with the randomness of ``make_state()`` (seeded with ``seed``: a generator
here, a Philox key advanced on the device by the CUDA kernels; the global generator if no
state is passed). Shape rules: rowwise ``K % 16``, columnwise ``M % 16``
(both for 2D blocks).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch

from hybrid_dist.formats.numerics import (
    E2M1_MAX,
    E4M3_MAX,
    apply_hadamard16,
    cast_to_fp8,
    e2m1_decode,
    e2m1_encode,
    hadamard16,
    scale_from_amax,
    pack_fp4,
    unpack_fp4,
)
from hybrid_dist import _kernel_registry
from hybrid_dist.formats import traced_rng
from hybrid_dist.formats._quantizer import Quantizer, tensor_amax
from hybrid_dist.formats._storage import DirectionStorage, FieldAxes

NV_BLOCK = 16
FP32_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4Storage(DirectionStorage):
    """``data`` uint8 ``[R, C/2]``; ``block_scale`` E4M3 ``[R/br, C/16]``; ``global_scale`` fp32 []."""

    TENSOR_FIELDS = ("data", "block_scale", "global_scale")
    FORMAT = "nvfp4"
    data: torch.Tensor
    block_scale: torch.Tensor
    global_scale: torch.Tensor
    block_rows: int  # 1, or 16 for 2D blocks
    rht_seed: int | None  # None: no Hadamard transform applied to this direction

    @property
    def shape2d(self):
        r, half = self.data.shape
        return (r, 2 * half)

    def field_axes(self) -> FieldAxes:
        return {
            "data": {"R": (0, 1), "C": (1, 2)},
            "block_scale": {"R": (0, self.block_rows), "C": (1, NV_BLOCK)},
            "global_scale": {},
        }

    def values(self, *, undo_rht: bool = True) -> torch.Tensor:
        """fp32 ``[R, C]`` = codes · block scales; in the original (not Hadamard) domain
        unless ``undo_rht=False``."""
        r, c = self.shape2d
        br = self.block_rows
        q = e2m1_decode(unpack_fp4(self.data)).reshape(r // br, br, c // NV_BLOCK, NV_BLOCK)
        v = (q * self.block_scale.float()[:, None, :, None]).reshape(r, c)
        if undo_rht and self.rht_seed is not None:
            v = apply_hadamard16(v, hadamard16(self.rht_seed, v.device), inverse=True)
        return v

    def tensor_scale(self):
        return self.global_scale


class NVFP4State:
    """Stochastic-rounding randomness of one NVFP4 tensor slot, per device:

    * a ``torch.Generator`` (seeded with ``seed``) for the reference backend's draws;
    * the CUDA kernels' **Philox key**, an int64 ``[1]`` device tensor: each kernel call reads
      it as its seed and then advances it by one in place (``kernel_key``,
      ``advance_kernel_key``). A key in device memory, not a generator draw, is what lets a
      CUDA-graph replay draw fresh noise: the replay re-runs the in-place increment, while a
      ``torch.Generator`` other than the default one cannot be used under capture at all.
      The first key is ``splitmix64(seed)`` (63 bits), so states with the same seed walk the
      same keys, as their generators draw the same numbers.

    ``state_dict(device)`` / ``load_state_dict`` save and resume both streams (a module's
    state dict holds them: ``recipe_module``'s note on quantizer states).
    """

    def __init__(self, seed: int):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self._keys: dict[torch.device, torch.Tensor] = {}
        # loaded by load_state_dict, for the keys and generators made after it
        self._loaded_key: torch.Tensor | None = None
        self._loaded_generators: dict[str, torch.Tensor] = {}  # device type -> generator state
        # how a compiled graph finds this state: its id as a CPU tensor (none while tracing)
        self.uid = None if torch.compiler.is_compiling() else traced_rng.register(self)
        if not torch.compiler.is_compiling() and torch.cuda.is_available() and torch.cuda.is_initialized():
            # the live key of the current device made now, eagerly: a compiled graph reads it
            # and advances it in place, but cannot create it (a new tensor stored on this
            # object from inside a trace breaks the graph)
            self.kernel_key(torch.device("cuda", torch.cuda.current_device()))

    def generator(self, device: torch.device) -> torch.Generator:
        device = _indexed(device)
        if device not in self._generators:
            gen = self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
            if device.type in self._loaded_generators:
                gen.set_state(self._loaded_generators[device.type])
        return self._generators[device]

    def kernel_key(self, device: torch.device) -> torch.Tensor:
        """The int64 ``[1]`` tensor on ``device`` holding the kernels' next Philox key (live)."""
        device = _indexed(device)
        key = self._keys.get(device)
        if key is None:
            if self._loaded_key is not None:
                key = self._keys[device] = self._loaded_key.to(device, copy=True)
            else:
                key = self._keys[device] = torch.full((1,), first_kernel_key(self.seed), dtype=torch.int64,
                                                      device=device)
        return key

    def advance_kernel_key(self, device: torch.device) -> None:
        """After a kernel call read the key: the next call's key (one launch, no sync)."""
        self.kernel_key(device).add_(1)

    def take_kernel_key(self, device: torch.device) -> torch.Tensor:
        """A copy of the current key, the live one advanced (for a traced call site)."""
        taken = self.kernel_key(device).clone()
        self.advance_kernel_key(device)
        return taken

    def state_dict(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Where both streams stand on ``device``, to resume them bitwise: ``"kernel_key"``
        int64 ``[1]``, the kernels' next Philox key (the live tensor, so that a load copies
        into it in place: CUDA graphs and compiled steps read that tensor), and
        ``"generator_<device type>"`` uint8, the state of ``device``'s generator (a copy).
        A ``meta`` device (a module not materialized yet) reports the CPU's."""
        device = _indexed(device if torch.device(device).type != "meta" else "cpu")
        return {"kernel_key": self.kernel_key(device),
                f"generator_{device.type}": self.generator(device).get_state()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Resume at ``sd`` (``state_dict`` of any device): the key is copied in place into
        this state's key on every device, a generator state into its generators of that
        device type; both also seed the keys and generators made later (a module loaded on
        the CPU, then moved to a GPU)."""
        gens = {k[len("generator_"):]: v for k, v in sd.items() if k.startswith("generator_")}
        unknown = sorted(set(sd) - {"kernel_key"} - {f"generator_{t}" for t in gens})
        if unknown:
            raise ValueError(f"NVFP4State.load_state_dict: unknown entries {unknown} (expected 'kernel_key' "
                             "and 'generator_<device type>')")
        if "kernel_key" in sd:
            key = sd["kernel_key"].detach().to("cpu", torch.int64, copy=True).reshape(1)
            self._loaded_key = key
            for live in self._keys.values():
                live.copy_(key)
        for device_type, gen_state in gens.items():
            self._loaded_generators[device_type] = gen_state.detach().to("cpu", copy=True)
            for device, gen in self._generators.items():
                if device.type == device_type:
                    gen.set_state(self._loaded_generators[device_type])


def _indexed(device) -> torch.device:
    """``device`` with its index (``"cuda"`` and ``"cuda:0"`` are one device, one state)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def first_kernel_key(seed: int) -> int:
    """``splitmix64(seed)`` masked to 63 bits (non-negative int64, never wraps in use)."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 decode scale ``1 / min(448·6/amax, fp32_max)`` (1 when amax is 0)."""
    return torch.reciprocal(scale_from_amax(amax, E4M3_MAX * E2M1_MAX))


def nvfp4_quantize_rows(
    x: torch.Tensor, global_scale: torch.Tensor, *, block_rows: int, rand: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: quantize fp32 ``x [R, C]`` along C → ``(packed data, block_scale)``."""
    r, c = x.shape
    br = block_rows
    blocks = x.float().reshape(r // br, br, c // NV_BLOCK, NV_BLOCK)
    block_amax = blocks.abs().amax(dim=(1, 3))
    # a tensor divisor: CUDA computes ``tensor / python_scalar`` as a * (1/b) (2 roundings)
    per_element = block_amax / torch.full_like(block_amax, E2M1_MAX)
    block_scale = cast_to_fp8(per_element / global_scale, torch.float8_e4m3fn)
    denom = block_scale.float() * global_scale
    # a tiny tensor (gs down at 2**-128) gives a subnormal denom whose reciprocal overflows:
    # clamped at the fp32 max, as TE (an inf would turn every element into ±6)
    encode = torch.where(denom > 0, torch.reciprocal(denom).clamp(max=FP32_MAX), torch.zeros_like(denom))
    scaled = (blocks * encode[:, None, :, None]).clamp(-E2M1_MAX, E2M1_MAX).reshape(r, c)
    codes = e2m1_encode(scaled, rand)
    return pack_fp4(codes), block_scale


def transpose_packed_fp4(data: torch.Tensor) -> torch.Tensor:
    """Packed ``[R, C/2]`` → packed ``[C, R/2]`` of the transposed codes."""
    return pack_fp4(unpack_fp4(data).t().contiguous())


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4Quantizer(Quantizer):
    """NVFP4 (16-element E4M3 scales + fp32 tensor scale); options as in the module doc."""

    FORMAT: ClassVar[str] = "nvfp4"
    PRECISION_RANK: ClassVar[int] = 1
    rht: bool = False
    rht_seed: int = 0
    stochastic_rounding: bool = False
    seed: int = 0
    block_2d: bool = False

    @property
    def is_per_tensor(self) -> bool:
        return True

    @property
    def block_rows(self) -> int:
        return NV_BLOCK if self.block_2d else 1

    def block_shape(self, direction):
        if self.block_2d:
            return (NV_BLOCK, NV_BLOCK)
        return (1, NV_BLOCK) if direction == "rowwise" else (NV_BLOCK, 1)

    def make_state(self):
        return NVFP4State(self.seed) if self.stochastic_rounding else None

    def _rand(self, shape, device, state, *, like=None, draw: int = 0) -> torch.Tensor | None:
        if not self.stochastic_rounding:
            return None
        if isinstance(state, NVFP4State) and like is not None:
            return traced_rng.state_rand(state, like, shape, draw=draw)
        gen = state.generator(device) if isinstance(state, NVFP4State) else None
        return torch.rand(shape, device=device, generator=gen)

    def _storage(self, x, amax, state, *, transposed: bool, rht: bool, rht_amax=None) -> NVFP4Storage:
        seed = self.rht_seed if rht else None
        if rht:
            x = apply_hadamard16(x.float(), hadamard16(self.rht_seed, x.device))
            # the transformed direction uses its own amax (precomputed, e.g. group-reduced, or local)
            amax = tensor_amax(x) if rht_amax is None else rht_amax
        elif amax is None:
            amax = tensor_amax(x)
        gs = nvfp4_global_scale(amax.to(x.device))
        rand = self._rand(x.shape, x.device, state, like=x, draw=int(transposed))
        data, bs = nvfp4_quantize_rows(x, gs, block_rows=self.block_rows, rand=rand)
        return NVFP4Storage(
            data=data, block_scale=bs, global_scale=gs, block_rows=self.block_rows,
            rht_seed=seed, transposed=transposed,
        )

    def _quantize_2d(self, x, *, rowwise, columnwise, state, amax):
        row = col = None
        derive_col = self.block_2d and not self.rht
        if rowwise or (columnwise and derive_col):
            row = self._storage(x, amax, state, transposed=False, rht=False)
        if columnwise and derive_col:
            col = NVFP4Storage(
                data=transpose_packed_fp4(row.data), block_scale=row.block_scale.t().contiguous(),
                global_scale=row.global_scale, block_rows=self.block_rows, rht_seed=None,
                transposed=True,
            )
        elif columnwise:
            col = self._storage(x.t(), amax, state, transposed=True, rht=self.rht)
        return (row if rowwise else None), col

    # --- precomputed amax of the Hadamard (columnwise) direction (additive; used by TP) ---
    def columnwise_rht_amax(self, x2d: torch.Tensor) -> torch.Tensor:
        """fp32 amax of the columnwise direction of ``x2d [M, K]`` in its Hadamard domain
        (``M % 16 == 0``). The max over row shards equals the full tensor's value, so it
        can be all-reduced (MAX) over a process group."""
        if not self.rht:
            raise ValueError("columnwise_rht_amax needs NVFP4Quantizer(rht=True); got rht=False")
        impl = _kernel_registry.rht_amax_impl_for(x2d)
        if impl is not None:  # the kernel's own value: bitwise what its quantize would derive
            return impl(self, x2d.detach())
        return tensor_amax(apply_hadamard16(x2d.t().float(), hadamard16(self.rht_seed, x2d.device)))

    def quantize_columnwise_rht(self, x2d: torch.Tensor, *, amax: torch.Tensor, rht_amax: torch.Tensor,
                                state=None) -> NVFP4Storage:
        """Columnwise (Hadamard) storage of ``x2d [M, K]`` (stored ``[K, M]``) with a
        precomputed ``rht_amax`` (see ``columnwise_rht_amax``), through the registered kernel
        where one serves ``x2d``. Bitwise equal to ``quantize_storages(x2d, rowwise=False,
        columnwise=True)`` when ``rht_amax`` is that tensor's own value."""
        if not self.rht:
            raise ValueError("quantize_columnwise_rht needs NVFP4Quantizer(rht=True); got rht=False")
        self.check_input(x2d, rowwise=False, columnwise=True)
        x2d = x2d.detach()
        impl = _kernel_registry.quantize_impl_for(self, x2d)
        if impl is not None:
            out = impl(self, x2d, rowwise=False, columnwise=True, state=state, amax=amax, rht_amax=rht_amax)
            if out is not NotImplemented:
                return out[1]
        return self._storage(x2d.t(), amax, state, transposed=True, rht=True, rht_amax=rht_amax.float().to(x2d.device))
