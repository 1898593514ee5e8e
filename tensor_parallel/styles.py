"""``ParallelStyle``s for ``hd.Linear`` (use with ``parallelize_module``).

* ``HybridColwiseParallel(sequence_parallel=False)``: ``W [N, K]`` → ``Shard(0)`` (bias
  ``Shard(0)``). Input: replicated ``[*, K]``, or with SP the dim-0 shard ``[S/tp, *, K]``
  (all-gathered in the input quantizer's rowwise format). Output: ``[S, *, N/tp]`` local.
  A replicated input's gradient is all-reduced, or with ``reduce_input_grad=False`` left
  partial for a parent that reduces the sum of several consumers' gradients once.
* ``HybridRowwiseParallel(sequence_parallel=False)``: ``W`` → ``Shard(1)`` (bias
  replicated, added after the reduction). Input ``[S, *, K/tp]``; output all-reduced
  ``[S, *, N]``, or with SP reduce-scattered to ``[S/tp, *, N]``.
* ``PrepareHybridModuleInput(consumers=("wq", "wk", "wv"))``: on the parent module,
  all-gathers the SP input once, quantized with the consumers' (equal) input quantizer,
  and hands the gathered tensor to every consumer (each a colwise-parallel layer); the
  backward reduce-scatters the summed input gradient once.

Activations are plain local tensors (Megatron style); parameters become ``DTensor``s on
the TP mesh, so optimizers, ``state_dict`` and FSDP2 on a 2D mesh see their placements.
``parallelize_module`` mutates modules in place: the styles switch the module's class to
a TP subclass of its class (as ``fully_shard`` does), leaving ``hd.Linear`` itself as it
was. ``quantized_gather=False`` gathers in high precision (then quantizes) for
comparisons. High-precision weights are quantized per step from the local shard with the
group amax; ``QuantizedTensor`` weights (``hd.quantized_model_init``) are sliced in the
quantized domain (``_quantized_param``) and used as stored, and compose with FSDP2 over a
data-parallel mesh dim (``fully_shard(..., mesh=mesh["dp"])`` after ``parallelize_module``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hybrid_dist.linear import Linear, in_backward
from hybrid_dist.quantized_tensor import QuantizedTensor
from hybrid_dist.recipes import bf16 as _bf16_recipe
from hybrid_dist.tensor_parallel._quantized_param import shard_quantized
from hybrid_dist.tensor_parallel._linear_fn import (
    ColumnParallelFn,
    PreparedGatherFn,
    RowParallelFn,
    TPConfig,
    prepared_holder,
)

_HP_RECIPE = _bf16_recipe()  # modules without a recipe run high precision through the same path
_TP_CLASSES: dict[type, type] = {}  # hd.Linear subclass -> its TP subclass


class _TensorParallelLinear:
    """Mixin placed before the module's class: forward runs the TP autograd function."""

    _hd_tp: TPConfig

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = self.active_recipe() or _HP_RECIPE
        plan = self.plan_for(recipe)
        if not in_backward():
            if prepared_holder(x) is not None:  # its input state was advanced by the preparing hook
                plan.weight.advance_state(plan.states["weight"])
            else:
                plan.start_forward_pass()
        w, b = _to_local(self.weight), _to_local(self.bias)
        fn = ColumnParallelFn if self._hd_tp.kind == "colwise" else RowParallelFn
        if x.shape[-1] != w.shape[-1]:
            raise ValueError(
                f"{self._hd_tp.kind}-parallel hd.Linear expects input [..., {w.shape[-1]}] (the local "
                f"in_features), got {tuple(x.shape)}")
        return fn.apply(x, w, b, plan, self._hd_tp)

    def extra_repr(self) -> str:
        cfg = self._hd_tp
        return super().extra_repr() + f", tp={cfg.kind}, sequence_parallel={cfg.sequence_parallel}"


def _to_local(p):
    return p.to_local() if isinstance(p, DTensor) else p


def _tp_class(cls: type) -> type:
    if cls not in _TP_CLASSES:
        _TP_CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (_TensorParallelLinear, cls), {})
    return _TP_CLASSES[cls]


def _shard_param(module: nn.Module, name: str, mesh: DeviceMesh, placement, src_data_rank) -> None:
    p = getattr(module, name)
    if p is None:
        return
    if isinstance(p, DTensor):
        raise ValueError(f"{name} is already a DTensor ({p.placements}); apply one TP style per module")
    if isinstance(p, QuantizedTensor):  # sliced in the quantized domain (no re-quantization)
        local = p.detach()
        if isinstance(placement, Shard):
            local = shard_quantized(local, placement.dim, mesh.size(), mesh.get_local_rank())
        dt = DTensor.from_local(local, mesh, [placement], run_check=False, shape=p.shape, stride=p.stride())
        module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))
        return
    if src_data_rank is None:  # every rank holds the full tensor: slice locally, no communication
        local = p.detach()
        if isinstance(placement, Shard):
            local = local.chunk(mesh.size(), dim=placement.dim)[mesh.get_local_rank()]
        dt = DTensor.from_local(local.contiguous(), mesh, [placement], run_check=False)
    else:
        dt = distribute_tensor(p.detach(), mesh, [placement], src_data_rank=src_data_rank)
    module.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def _check_mesh(mesh: DeviceMesh, style: str):
    if mesh.ndim != 1:
        raise ValueError(f"{style} needs a 1D TP mesh (e.g. mesh['tp']); got a {mesh.ndim}D mesh {mesh}")


class _HybridLinearStyle(ParallelStyle):
    KIND = ""
    WEIGHT, BIAS = Shard(0), Shard(0)

    def __init__(self, *, sequence_parallel: bool = False, quantized_gather: bool = True,
                 reduce_input_grad: bool = True):
        super().__init__()
        if not reduce_input_grad and (self.KIND != "colwise" or sequence_parallel):
            raise ValueError("reduce_input_grad=False applies to HybridColwiseParallel with a replicated input "
                             "(sequence_parallel=False)")
        self.sequence_parallel = sequence_parallel
        self.quantized_gather = quantized_gather
        self.reduce_input_grad = reduce_input_grad

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        name = type(self).__name__
        if not isinstance(module, Linear):
            raise ValueError(f"{name} applies to hd.Linear; got {type(module).__name__}. Convert with "
                             "hd.convert_to_hybrid first.")
        if isinstance(module, _TensorParallelLinear):
            raise ValueError(f"{name}: this hd.Linear is already tensor parallel ({module._hd_tp.kind})")
        _check_mesh(device_mesh, name)
        _shard_param(module, "weight", device_mesh, self.WEIGHT, self.src_data_rank)
        _shard_param(module, "bias", device_mesh, self.BIAS, self.src_data_rank)
        module._hd_tp = TPConfig(kind=self.KIND, group=device_mesh.get_group(),
                                 sequence_parallel=self.sequence_parallel,
                                 gather_path="auto" if self.quantized_gather else "high_precision",
                                 reduce_input_grad=self.reduce_input_grad)
        module.__class__ = _tp_class(type(module))
        return module


class HybridColwiseParallel(_HybridLinearStyle):
    """Column-parallel ``hd.Linear`` (see the module doc)."""

    KIND = "colwise"
    WEIGHT, BIAS = Shard(0), Shard(0)


class HybridRowwiseParallel(_HybridLinearStyle):
    """Row-parallel ``hd.Linear`` (see the module doc)."""

    KIND = "rowwise"
    WEIGHT, BIAS = Shard(1), Replicate()


class PrepareHybridModuleInput(ParallelStyle):
    """All-gather the parent's sequence-parallel input ``args[input_index]`` once for the
    colwise-parallel children ``consumers`` (their input quantizers must be equal; the
    first consumer's quantizer state is used). Apply it to the parent, and
    ``HybridColwiseParallel(sequence_parallel=True)`` to each consumer."""

    def __init__(self, *, consumers: tuple[str, ...], input_index: int = 0, quantized_gather: bool = True):
        super().__init__()
        if not consumers:
            raise ValueError("PrepareHybridModuleInput needs the names of its consumer hd.Linear children")
        self.consumers, self.input_index = tuple(consumers), input_index
        self.path = "auto" if quantized_gather else "high_precision"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        _check_mesh(device_mesh, type(self).__name__)
        group = device_mesh.get_group()
        for c in self.consumers:
            if not isinstance(module.get_submodule(c), Linear):
                raise ValueError(f"PrepareHybridModuleInput: consumer {c!r} is a "
                                 f"{type(module.get_submodule(c)).__name__}, not an hd.Linear")
        module.register_forward_pre_hook(lambda mod, args: self._prepare(mod, args, group))
        return module

    def _prepare(self, module: nn.Module, args: tuple, group) -> tuple:
        layers = [module.get_submodule(c) for c in self.consumers]
        plans = []
        for layer in layers:
            plan = layer.plan_for(layer.active_recipe() or _HP_RECIPE)
            plans.append(plan)
        first = plans[0]
        for c, plan in zip(self.consumers, plans):
            if plan.input != first.input:
                raise ValueError(
                    f"PrepareHybridModuleInput: consumers need one input quantizer to share a gather; "
                    f"{self.consumers[0]!r} has {first.input}, {c!r} has {plan.input}")
        if not in_backward():
            first.input.advance_state(first.states["input"])  # consumers then advance only their weights
        need_wgrad = torch.is_grad_enabled() and any(
            _to_local(layer.weight).requires_grad for layer in layers)
        x = args[self.input_index]
        gathered = PreparedGatherFn.apply(x, first.input, first.states["input"], group, len(layers),
                                          self.path, need_wgrad)
        return (*args[:self.input_index], gathered, *args[self.input_index + 1:])
