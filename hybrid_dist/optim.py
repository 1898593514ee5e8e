"""``MasterWeightOptimizer``: an optimizer over fp32 master copies of the parameters.

Quantized (and bf16) parameters keep their storage; the wrapped optimizer steps fp32
masters, and each step writes the masters back **in place** (quantized parameters are
re-quantized into their existing buffers, so views held by FSDP2 or saved tensors stay
valid). fp32 parameters are stepped directly.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from hybrid_dist._tensor_ops import requantize_
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.sharded_params import is_sharded_quantized, master_shard, sync_amax_and_requantize


def _master_of(p: torch.Tensor) -> torch.Tensor:
    if is_sharded_quantized(p):
        return master_shard(p)  # fp32 master shard (a DTensor like p)
    hp = getattr(p, "_hd_hp_init", None)
    if hp is not None:
        del p._hd_hp_init  # the master takes over; don't keep two copies
        return hp.detach().to(device=p.device, dtype=torch.float32).clone()
    if isinstance(p, QuantizedTensor):
        return p.dequantize(dtype=torch.float32).detach().clone()
    return p.detach().to(torch.float32).clone()


class MasterWeightOptimizer:
    """``MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=...)``.

    Accepts parameters or param-group dicts like any optimizer. ``state_dict`` holds the
    wrapped optimizer's state and the fp32 masters, so a resumed run continues bitwise.
    """

    def __init__(self, optimizer_cls: type, params: Iterable, **kwargs: Any):
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model param, fp32 master)
        master_groups = []
        for g in groups:
            masters = []
            for p in g["params"]:
                plain_fp32 = p.dtype == torch.float32 and not isinstance(p, QuantizedTensor)
                m = p if (plain_fp32 and not is_sharded_quantized(p)) else _master_of(p)
                m.requires_grad_(p.requires_grad)
                self._pairs.append((p, m))
                masters.append(m)
            master_groups.append({**g, "params": masters})
        self.optimizer = optimizer_cls(master_groups, **kwargs)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        for p, m in self._pairs:
            if p is param:
                return m
        raise ValueError("master_of: this parameter is not managed by the optimizer")

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError(
                "MasterWeightOptimizer.step(closure) is not supported: the closure's gradients "
                "land on the model parameters after the masters were filled. Call backward(), "
                "then step() without a closure.")
        for p, m in self._pairs:
            if m is not p:
                m.grad = None if p.grad is None else p.grad.to(torch.float32)
        loss = self.optimizer.step(closure)
        self._write_back(self._pairs)
        return loss

    @staticmethod
    def _write_back(pairs) -> None:
        sharded = [(p, m) for p, m in pairs if m is not p and is_sharded_quantized(p)]
        if sharded:  # one amax all-reduce for all per-tensor shards, then in-place requantize
            sync_amax_and_requantize(sharded)
        for p, m in pairs:
            if m is p or is_sharded_quantized(p):
                continue
            if isinstance(p, QuantizedTensor):
                requantize_(p, m)
            else:
                p.copy_(m)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in self._pairs:
            for t in (p, m):
                if t.grad is not None:
                    if set_to_none:
                        t.grad = None
                    else:
                        t.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(),
                "masters": [m.detach() for p, m in self._pairs if m is not p]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sd["optimizer"])
        owned = [(p, m) for p, m in self._pairs if m is not p]
        if len(owned) != len(sd["masters"]):
            raise ValueError(f"load_state_dict: expected {len(owned)} master weights, got {len(sd['masters'])}")
        with torch.no_grad():
            for (p, m), saved in zip(owned, sd["masters"]):
                m.copy_(saved)
            self._write_back(owned)
