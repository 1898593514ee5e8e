"""``MasterWeightOptimizer``: an optimizer over fp32 master copies of the parameters.

Quantized (and bf16) parameters keep their storage; the wrapped optimizer steps fp32
masters, and each step writes the masters back **in place** (quantized parameters are
re-quantized into their existing buffers, so views held by FSDP2 or saved tensors stay
valid). fp32 parameters are stepped directly.

A quantized parameter's master starts from the high-precision init it keeps
(``hp_init``: ``quantized_model_init``'s default, ``convert_to_hybrid(...,
quantized_weights=True)``), which ``fully_shard`` shards with it row for row, else from its
dequantization. Either way an FSDP2-sharded master is bitwise the matching rows of the
unsharded master, so sharded training is the unsharded training.

[Note: a torch optimizer to torch.distributed.checkpoint]
It is a ``torch.optim.Optimizer`` whose ``param_groups`` hold the model's parameters (what
``torch.distributed.checkpoint.state_dict`` maps to FQNs through ``named_parameters``) and
the hyperparameters; ``step`` copies those into the wrapped optimizer's groups, which hold
the masters. ``state[p]`` is the wrapped optimizer's state of ``p``'s master. The state dict
has torch's form, ``{"state": {i: {...}}, "param_groups": [{..., "params": [i, ...]}]}``
with ``i`` the position in ``param_groups``, and each master under ``"master"`` in its
parameter's state (a DTensor like its parameter when sharded): so
``get_optimizer_state_dict(model, opt)`` keys masters by FQN and DCP reshards them as it
reshards ``exp_avg``. ``load_state_dict`` matches saved parameters by position, as torch
does, copies each master and re-quantizes its parameter from it.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Iterable

import torch

from hybrid_dist import hp_init
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.requantize_many import requantize_many_
from hybrid_dist.sharded_params import (
    is_sharded_quantized,
    like_dtensor,
    master_shard,
    sync_amax_and_requantize,
)

MASTER_KEY = "master"  # a parameter's fp32 master in its optimizer state


def _master_of(p: torch.Tensor) -> torch.Tensor:
    if is_sharded_quantized(p):
        return master_shard(p)  # fp32 master shard (a DTensor like p)
    hp = hp_init.take(p)  # the master takes over the kept init; don't keep two copies
    if hp is not None:
        return hp
    if isinstance(p, QuantizedTensor):
        return p.dequantize(dtype=torch.float32).detach().clone()
    return p.detach().to(torch.float32).clone()


def _fp32_grad(g: torch.Tensor) -> torch.Tensor:
    """A gradient in fp32 for a master; a quantized one (``torch.zeros_like`` of a quantized
    parameter, as ``torch.distributed.checkpoint`` sets to initialise state) dequantized."""
    if g.dtype == torch.float32 and type(getattr(g, "_local_tensor", g)) is torch.Tensor:
        return g  # plain fp32, or a DTensor of it: what ``g.to(torch.float32)`` returns
    if isinstance(g, QuantizedTensor):
        return g.dequantize(dtype=torch.float32)
    if is_sharded_quantized(g):
        return like_dtensor(g._local_tensor.dequantize(dtype=torch.float32), g)
    return g.to(torch.float32)


class MasterWeightOptimizer(torch.optim.Optimizer):
    """``MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=...)``.

    Accepts parameters or param-group dicts like any optimizer; hyperparameters are read
    and set in ``param_groups`` (LR schedulers work on it). ``state_dict`` holds the wrapped
    optimizer's state and the fp32 masters (module note), so a resumed run continues
    bitwise, also through ``torch.distributed.checkpoint.state_dict``'s helpers.
    """

    def __init__(self, optimizer_cls: type, params: Iterable, **kwargs: Any):
        self._optimizer_cls, self._kwargs = optimizer_cls, kwargs
        self.optimizer: torch.optim.Optimizer | None = None  # steps the masters; made with the first group
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model param, fp32 master), groups' order
        self._masters: dict[torch.Tensor, torch.Tensor] = {}  # model param -> its master
        super().__init__(params, defaults={})  # calls add_param_group per group
        self.defaults = self.optimizer.defaults
        self.state = _MasterState(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group: its masters go to the wrapped optimizer, its parameters here."""
        group = dict(param_group)
        params = group.pop("params")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        masters = []
        for p in params:
            plain_fp32 = p.dtype == torch.float32 and not isinstance(p, QuantizedTensor)
            m = p if (plain_fp32 and not is_sharded_quantized(p)) else _master_of(p)
            m.requires_grad_(p.requires_grad)
            self._pairs.append((p, m))
            self._masters[p] = m
            masters.append(m)
        if self.optimizer is None:
            self.optimizer = self._optimizer_cls([{**group, "params": masters}], **self._kwargs)
        else:
            self.optimizer.add_param_group({**group, "params": masters})
        inner = self.optimizer.param_groups[-1]
        super().add_param_group({**{k: v for k, v in inner.items() if k != "params"}, "params": params})

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        m = self._masters.get(param)
        if m is None:
            raise ValueError("master_of: this parameter is not managed by the optimizer")
        return m

    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in outer.items() if k != "params"})

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError(
                "MasterWeightOptimizer.step(closure) is not supported: the closure's gradients "
                "land on the model parameters after the masters were filled. Call backward(), "
                "then step() without a closure.")
        self._sync_hyperparameters()
        for p, m in self._pairs:
            if m is not p:
                m.grad = None if p.grad is None else _fp32_grad(p.grad)
        loss = self.optimizer.step()
        self._write_back(self._pairs)
        return loss

    @staticmethod
    def _write_back(pairs) -> None:
        sharded, quantized = [], []
        for p, m in pairs:
            if m is p:
                continue
            if is_sharded_quantized(p):
                sharded.append((p, m))
            elif isinstance(p, QuantizedTensor):
                quantized.append((p, m))
            else:
                p.copy_(m)
        if sharded:  # one amax all-reduce for all per-tensor shards, then in-place requantize
            sync_amax_and_requantize(sharded)
        if quantized:  # a constant number of launches for per-tensor FP8 on CUDA
            requantize_many_([p for p, _ in quantized], [m for _, m in quantized])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, m in self._pairs:
            for t in (p, m):
                if t.grad is not None:
                    if set_to_none:
                        t.grad = None
                    else:
                        t.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """torch's form (module note): the wrapped optimizer's state per parameter position,
        each master under ``"master"`` (live tensors, as torch's optimizers return them)."""
        self._sync_hyperparameters()
        inner = self.optimizer.state_dict()  # positions in the wrapped groups = positions here
        state = {}
        for i, (p, m) in enumerate(self._pairs):
            st = dict(inner["state"].get(i, {}))
            if m is not p:
                st[MASTER_KEY] = m.detach()
            if st:
                state[i] = st
        return {"state": state, "param_groups": inner["param_groups"]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` output (its keys may be any ids, e.g. FQNs: parameters are
        matched by position in ``param_groups``), then re-quantize from the masters."""
        groups = state_dict["param_groups"]
        sizes, want = [len(g["params"]) for g in groups], [len(g["params"]) for g in self.param_groups]
        if sizes != want:
            raise ValueError(f"load_state_dict: the saved param groups have {sizes} parameters, this "
                             f"optimizer's {want}; build it over the parameters the state was saved from")
        saved_ids = [i for g in groups for i in g["params"]]
        inner_state, masters = {}, {}
        for j, ((p, m), i) in enumerate(zip(self._pairs, saved_ids)):
            st = dict(state_dict["state"].get(i, {}))
            saved = st.pop(MASTER_KEY, None)
            if m is not p:
                if saved is None:
                    raise ValueError(
                        f"load_state_dict: no master weight ({MASTER_KEY!r}) for parameter #{j} ({i!r}, "
                        f"shape {tuple(p.shape)}); a MasterWeightOptimizer's state dict has one for each "
                        "parameter that is not plain fp32")
                masters[j] = saved
            if st:
                inner_state[j] = st
        positions = iter(range(len(self._pairs)))
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [next(positions) for _ in g["params"]]}
                        for g in groups]
        self.optimizer.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups):
            outer.update({k: v for k, v in inner.items() if k != "params"})
        owned = [(p, m) for j, (p, m) in enumerate(self._pairs) if j in masters]
        with torch.no_grad():
            for j, (p, m) in enumerate(self._pairs):
                if j in masters and masters[j] is not m:
                    m.copy_(masters[j])
            self._write_back(owned)


class _MasterState(MutableMapping):
    """``state[p]`` for a model parameter ``p``: the wrapped optimizer's state of its master
    (torch's convention: optimizer state keyed by the tensors in ``param_groups``)."""

    def __init__(self, opt: MasterWeightOptimizer):
        self._opt = opt

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        m = self._opt._masters.get(p)
        if m is None:
            raise KeyError("this tensor is not a parameter of the MasterWeightOptimizer")
        return m

    def __getitem__(self, p: torch.Tensor) -> dict:
        return self._opt.optimizer.state[self._master(p)]  # a defaultdict: empty state if none yet

    def __setitem__(self, p: torch.Tensor, value: dict) -> None:
        self._opt.optimizer.state[self._master(p)] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        del self._opt.optimizer.state[self._master(p)]

    def __contains__(self, p) -> bool:
        m = self._opt._masters.get(p)
        return m is not None and m in self._opt.optimizer.state

    def get(self, p, default=None):
        return self[p] if p in self else default

    def __iter__(self):
        inner = self._opt.optimizer.state
        return iter([p for p, m in self._opt._pairs if m in inner])

    def __len__(self) -> int:
        return sum(1 for _ in self)
