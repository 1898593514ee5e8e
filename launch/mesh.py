"""Parallel degrees → a named ``DeviceMesh``.

Axes (outer to inner): ``dp_replicate`` (HSDP replicas) × ``dp_shard`` (FSDP) × ``tp``.
Expert parallelism is carved out of the FSDP axis, as torchtitan does: with ``ep > 1``
``dp_shard`` is split into ``dp_shard_mod_ep × ep`` and re-flattened, so experts shard
over ``ep`` ranks while dense weights still shard over all ``dp_shard`` ranks.
Flattened axes: ``dp`` = dp_replicate × dp_shard (data-parallel rank: which batch).
"""

from __future__ import annotations

import dataclasses
import warnings

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    world_size: int
    hsdp: int = 1
    fsdp: int = -1
    tp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.fsdp == -1:
            rest = self.hsdp * self.tp
            if self.world_size % rest:
                raise ValueError(
                    f"world size {self.world_size} is not divisible by hsdp*tp = {self.hsdp}*{self.tp}; "
                    "choose degrees whose product divides the number of ranks")
            object.__setattr__(self, "fsdp", self.world_size // rest)
        product = self.hsdp * self.fsdp * self.tp
        if product != self.world_size:
            raise ValueError(
                f"hsdp*fsdp*tp = {self.hsdp}*{self.fsdp}*{self.tp} = {product}, but the world size is "
                f"{self.world_size}; the degrees must multiply to the number of ranks (use --fsdp -1 to fill)")
        if self.fsdp % self.ep:
            raise ValueError(
                f"--ep {self.ep} must divide --fsdp {self.fsdp}: expert parallelism is carved out of the "
                "FSDP axis (experts shard over ep ranks of each FSDP group)")

    @property
    def dp(self) -> int:
        return self.hsdp * self.fsdp

    def build_meshes(self, device_type: str) -> "Meshes":
        """The world mesh with axes as in the module doc (size-1 axes included) and its
        sub-meshes, kept here because slicing a flattened axis from the root is deprecated."""
        if self.ep > 1:
            shape = (self.hsdp, self.fsdp // self.ep, self.ep, self.tp)
            names = ("dp_replicate", "dp_shard_mod_ep", "ep", "tp")
            shard_axes = ("dp_shard_mod_ep", "ep")
        else:
            shape, names = (self.hsdp, self.fsdp, self.tp), ("dp_replicate", "dp_shard", "tp")
            shard_axes = ("dp_shard",)
        world = init_device_mesh(device_type, shape, mesh_dim_names=names)
        dp_shard = world[shard_axes]._flatten("dp_shard") if self.ep > 1 else world["dp_shard"]
        dp = world[("dp_replicate", *shard_axes)]._flatten("dp")
        fsdp = dp_shard
        if self.hsdp > 1:
            with warnings.catch_warnings():  # HSDP needs the 2D (replicate, shard) view
                warnings.simplefilter("ignore", UserWarning)
                fsdp = world["dp_replicate", "dp_shard"]
        ep_fsdp = None
        if self.ep > 1:
            ep_fsdp = world["dp_replicate", "dp_shard_mod_ep"] if self.hsdp > 1 else world["dp_shard_mod_ep"]
        return Meshes(world=world, dp=dp, fsdp=fsdp, tp=world["tp"],
                      ep=world["ep"] if self.ep > 1 else None, ep_fsdp=ep_fsdp)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Meshes:
    """``fsdp`` is 1D ``dp_shard`` (FSDP) or 2D ``(dp_replicate, dp_shard)`` (HSDP);
    ``ep_fsdp`` (EP only) is the FSDP mesh of the experts: the ranks holding the same ones."""

    world: DeviceMesh
    dp: DeviceMesh
    fsdp: DeviceMesh
    tp: DeviceMesh
    ep: DeviceMesh | None
    ep_fsdp: DeviceMesh | None
