"""TP/SP hd.Linear and a two-layer MLP equal the single-process module (gloo, TP = 2, 4).

One 4-rank job per named recipe (a test each) runs it × TP ∈ {2 (two 2-rank groups of a 2x2 mesh), 4}
× SP ∈ {off, on}, for two steps (delayed scaling uses step 0's history in step 1):
``fc1 = HybridColwiseParallel``, GELU, ``fc2 = HybridRowwiseParallel``; a gate/up
block whose input is gathered once by ``PrepareHybridModuleInput`` (also under
activation recompute); and the MLP under FSDP2 on the ``dp`` axis of a 2×2 ``(dp, tp)``
mesh.

[Note: what is bitwise and what is within tolerance]
* Bitwise: the column-parallel output (each output column contracts the full K on one
  rank, and the quantized gather equals gather-then-quantize), the row-parallel dgrad
  (contracts the unsharded N) and every wgrad (contracts M, never sharded) — when no
  stochastic rounding touches the gradient.
* Within ``REL_TOL`` (1e-5 of max |ref|): results summed over TP ranks — the row-parallel
  output, the column-parallel dgrad, the SP bias gradient of the row-parallel layer — whose
  fp32 additions run in another order than in one GEMM (a few ulps).
* Stochastic rounding (the NVFP4 gradient quantizers of ``nvfp4`` and
  ``mxfp8_fwd_nvfp4_bwd``) draws different random numbers per shard than on the full
  tensor, so gradients it touches differ like two independent SR draws: asserted by SQNR
  against the single-process gradient ≥ ``SR_SQNR_DB``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import hybrid_dist as hd
from hybrid_dist.tensor_parallel import HybridColwiseParallel, HybridRowwiseParallel, PrepareHybridModuleInput
from tests._helpers import as_bits, sqnr_db
from tests._tiers import by_recipe
from tests_distributed._harness import nccl_world, run_nccl, run_ranks

REL_TOL = 1e-5
SR_SQNR_DB = 8.0
GPU_SQNR_DB = 25.0  # GPU, quantized recipes: an ulp-level GEMM difference may flip a later rounding
SR_RECIPES = ("nvfp4", "mxfp8_fwd_nvfp4_bwd")
FSDP_RECIPES = ("bf16", "fp8_current", "mxfp8", "fp8_fwd_bf16_bwd")  # stateless, no SR
RECOMPUTE_RECIPES = ("fp8_delayed", "nvfp4")  # stateful: delayed history, SR generator


class MLP(nn.Module):
    def __init__(self, h, f, recipe):
        super().__init__()
        self.fc1 = hd.Linear(h, f, recipe=recipe, name="fc1")
        self.fc2 = hd.Linear(f, h, recipe=recipe, name="fc2")

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class GateUp(nn.Module):
    """``down(silu(gate(x)) * up(x))``: gate and up share one input gather."""

    def __init__(self, h, f, recipe):
        super().__init__()
        self.gate = hd.Linear(h, f, bias=False, recipe=recipe, name="gate")
        self.up = hd.Linear(h, f, bias=False, recipe=recipe, name="up")
        self.down = hd.Linear(f, h, bias=False, recipe=recipe, name="down")

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def shape_for(recipe: str):
    """(S, B, H, F): 128-blocks of fp8_block must fit TP=4 shards of H, F and SP rows."""
    return (256, 2, 512, 512) if recipe == "fp8_block" else (64, 2, 256, 256)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


class _Checker:
    """Compares TP tensors with single-process ones; collects failure messages.
    ``gemm_bitwise=False`` (GPU): cuBLAS may pick another split-K for a sharded shape,
    so GEMM results are held to ``REL_TOL`` instead of bitwise."""

    def __init__(self, recipe, gemm_bitwise: bool = True):
        self.recipe, self.fails, self.worst = recipe, [], {}
        self.gemm_bitwise = gemm_bitwise

    def __call__(self, cfg, what, got, ref, kind):
        got, ref = _local(got).detach(), ref.detach()
        name = f"{cfg} {what}"
        if got.shape != ref.shape:
            self.fails.append(f"{name}: shape {tuple(got.shape)} vs {tuple(ref.shape)}")
            return
        if kind == "recompute":  # the same computation twice: bitwise on every backend
            kind, self_bitwise = "bitwise", True
        else:
            self_bitwise = self.gemm_bitwise
        if kind == "bitwise" and self.recipe in SR_RECIPES and what.startswith("grad"):
            kind = "sr"
        if kind == "bitwise" and not self_bitwise:
            kind = "close"
        if kind == "close" and not self.gemm_bitwise and self.recipe != "bf16" and self.recipe not in SR_RECIPES:
            db = sqnr_db(ref, got)
            self.worst[name] = db
            if db < GPU_SQNR_DB:
                self.fails.append(f"{name}: SQNR {db:.1f} dB < {GPU_SQNR_DB} dB (GPU)")
            return
        if kind == "bitwise":
            n = int((as_bits(got) != as_bits(ref)).sum())
            if n:
                self.fails.append(f"{name}: {n}/{got.numel()} elements differ bitwise (max |d| "
                                  f"{(got - ref).abs().max():.3g})")
        elif kind == "close" and self.recipe not in SR_RECIPES or kind == "close" and not what.startswith("grad"):
            err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
            self.worst[name] = err
            if err > REL_TOL:
                self.fails.append(f"{name}: max rel error {err:.3g} > {REL_TOL}")
        else:
            db = sqnr_db(ref, got)
            self.worst[name] = db
            if db < SR_SQNR_DB:
                self.fails.append(f"{name}: SQNR {db:.1f} dB < {SR_SQNR_DB} dB (stochastic rounding)")


_DEVICE = torch.device("cpu")  # set per worker by _rank_fn


def _data(s, b, h, step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(s, b, h, generator=g).to(_DEVICE), torch.randn(s, b, h, generator=g).to(_DEVICE)


def _run_mlp(recipe_name, tp_mesh, sp, check, steps=2):
    s, b, h, f = shape_for(recipe_name)
    tp, r = tp_mesh.size(), tp_mesh.get_local_rank()
    recipe = hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    ref = MLP(h, f, recipe).to(_DEVICE)
    model = copy.deepcopy(ref)
    parallelize_module(model, tp_mesh, {"fc1": HybridColwiseParallel(sequence_parallel=sp),
                                        "fc2": HybridRowwiseParallel(sequence_parallel=sp)})
    cfg = f"[{recipe_name} TP={tp} SP={sp}]"
    for step in range(steps):
        x, dy = _data(s, b, h, step)
        xr = x.clone().requires_grad_()
        h_ref = ref.fc1(xr)
        y_ref = ref.fc2(F.gelu(h_ref))
        y_ref.backward(dy)
        xl = (x.chunk(tp)[r] if sp else x).clone().requires_grad_()
        h_tp = model.fc1(xl)
        y_tp = model.fc2(F.gelu(h_tp))
        y_tp.backward(dy.chunk(tp)[r] if sp else dy)
        c = f"{cfg} step={step}"
        check(c, "colwise fc1 output", h_tp, h_ref.chunk(tp, -1)[r], "bitwise")
        check(c, "rowwise fc2 output", y_tp, y_ref.chunk(tp)[r] if sp else y_ref, "close")
        check(c, "grad x (colwise dgrad, summed over TP)", xl.grad, xr.grad.chunk(tp)[r] if sp else xr.grad, "close")
        check(c, "grad fc1.weight (colwise wgrad)", model.fc1.weight.grad, ref.fc1.weight.grad.chunk(tp, 0)[r],
              "bitwise")
        check(c, "grad fc1.bias", model.fc1.bias.grad, ref.fc1.bias.grad.chunk(tp, 0)[r], "bitwise")
        check(c, "grad fc2.weight (rowwise wgrad)", model.fc2.weight.grad, ref.fc2.weight.grad.chunk(tp, 1)[r],
              "bitwise")
        check(c, "grad fc2.bias", model.fc2.bias.grad, ref.fc2.bias.grad, "close" if sp else "bitwise")
        for m in (ref, model):
            m.zero_grad(set_to_none=True)


def _run_gate_up(recipe_name, tp_mesh, check):
    s, b, h, f = shape_for(recipe_name)
    tp, r = tp_mesh.size(), tp_mesh.get_local_rank()
    recipe = hd.recipe_from_name(recipe_name)
    torch.manual_seed(1)
    ref = GateUp(h, f, recipe).to(_DEVICE)
    model = copy.deepcopy(ref)
    parallelize_module(model, tp_mesh, {
        "": PrepareHybridModuleInput(consumers=("gate", "up")),
        "gate": HybridColwiseParallel(sequence_parallel=True),
        "up": HybridColwiseParallel(sequence_parallel=True),
        "down": HybridRowwiseParallel(sequence_parallel=True)})
    cfg = f"[{recipe_name} TP={tp} SP=True prepared gate/up]"
    for step in range(2):
        x, dy = _data(s, b, h, step)
        xr = x.clone().requires_grad_()
        y_ref = ref(xr)
        y_ref.backward(dy)
        xl = x.chunk(tp)[r].clone().requires_grad_()
        y_tp = model(xl)
        y_tp.backward(dy.chunk(tp)[r])
        c = f"{cfg} step={step}"
        check(c, "output", y_tp, y_ref.chunk(tp)[r], "close")
        check(c, "grad x (one reduce-scatter)", xl.grad, xr.grad.chunk(tp)[r], "close")
        for n in ("gate", "up"):
            check(c, f"grad {n}.weight", getattr(model, n).weight.grad,
                  getattr(ref, n).weight.grad.chunk(tp, 0)[r], "bitwise")
        check(c, "grad down.weight", model.down.weight.grad, ref.down.weight.grad.chunk(tp, 1)[r], "bitwise")
        for m in (ref, model):
            m.zero_grad(set_to_none=True)


def _run_fsdp_tp(recipe_name, mesh2d, check):
    """FSDP2 on ``dp`` × TP/SP on ``tp``: the averaged weight gradients equal the average of
    single-process gradients of each dp rank's batch (each dp rank quantizes its own
    batch, as in any data parallelism), within ``REL_TOL`` (dp sums in another order)."""
    import logging

    from torch.distributed.fsdp import fully_shard

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # full_tensor() below
    s, b, h, f = shape_for(recipe_name)
    dp, tp = mesh2d["dp"].size(), mesh2d["tp"].size()
    d, r = mesh2d["dp"].get_local_rank(), mesh2d["tp"].get_local_rank()
    recipe = hd.recipe_from_name(recipe_name)
    torch.manual_seed(0)
    ref = MLP(h, f, recipe).to(_DEVICE)
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh2d["tp"], {"fc1": HybridColwiseParallel(sequence_parallel=True),
                                             "fc2": HybridRowwiseParallel(sequence_parallel=True)})
    for mod in (model.fc1, model.fc2, model):
        fully_shard(mod, mesh=mesh2d["dp"])
    x, dy = _data(s, b, h, 0)  # dp rank d takes batch column d of [S, B=dp, H]
    for i in range(dp):
        ref(x[:, i:i + 1]).backward(dy[:, i:i + 1] / dp)
    xl = x[:, d:d + 1].chunk(tp)[r].clone().requires_grad_()
    model(xl).backward(dy[:, d:d + 1].chunk(tp)[r])
    cfg = f"[{recipe_name} FSDP2 dp={dp} x TP={tp} SP]"
    for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        got = model.get_parameter(n).grad.full_tensor()
        check(cfg, f"grad {n} (avg over dp)", got, ref.get_parameter(n).grad, "close")


def _run_recompute(recipe_name, tp_mesh, check):
    """Activation recompute (``torch.utils.checkpoint``) of a TP/SP gate/up block gives
    bitwise the gradients of the plain run: the recompute re-gathers the input and leaves
    the quantizer states (delayed scaling history) unchanged."""
    from torch.utils.checkpoint import checkpoint

    s, b, h, f = shape_for(recipe_name)
    tp, r = tp_mesh.size(), tp_mesh.get_local_rank()
    torch.manual_seed(2)
    plain = GateUp(h, f, hd.recipe_from_name(recipe_name)).to(_DEVICE)
    ckpt = copy.deepcopy(plain)
    for m in (plain, ckpt):
        parallelize_module(m, tp_mesh, {
            "": PrepareHybridModuleInput(consumers=("gate", "up")),
            "gate": HybridColwiseParallel(sequence_parallel=True),
            "up": HybridColwiseParallel(sequence_parallel=True),
            "down": HybridRowwiseParallel(sequence_parallel=True)})
    for step in range(2):
        x, dy = _data(s, b, h, step)
        xa = x.chunk(tp)[r].clone().requires_grad_()
        xb = xa.detach().clone().requires_grad_()
        plain(xa).backward(dy.chunk(tp)[r])
        checkpoint(ckpt, xb, use_reentrant=False).backward(dy.chunk(tp)[r])
        c = f"[{recipe_name} TP={tp} SP recompute] step={step}"
        check(c, "recomputed grad x", xb.grad, xa.grad, "recompute")
        for (n, p), q in zip(ckpt.named_parameters(), plain.parameters()):
            check(c, f"recomputed grad {n}", p.grad, _local(q.grad), "recompute")


def _rank_fn(rank, world, recipes, prepared_recipes, device: str = "cpu"):
    import warnings

    global _DEVICE
    _DEVICE = torch.device(device, rank) if device == "cuda" else torch.device(device)
    warnings.simplefilter("ignore")  # fallback warnings are tested in test_tp_gather
    meshes = [init_device_mesh(device, (world,), mesh_dim_names=("tp",))["tp"]]
    if world == 4:  # TP=2 on the two rows of a 2x2 (dp, tp) mesh
        meshes.append(init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp"))["tp"])
    fails, worst = [], {}
    for name in recipes:
        check = _Checker(name, gemm_bitwise=device == "cpu")
        for mesh in meshes:
            for sp in (False, True):
                _run_mlp(name, mesh, sp, check)
            if name in prepared_recipes:
                _run_gate_up(name, mesh, check)
        if name in RECOMPUTE_RECIPES:
            _run_recompute(name, meshes[0], check)
        if world == 4 and name in FSDP_RECIPES:
            _run_fsdp_tp(name, init_device_mesh(device, (2, 2), mesh_dim_names=("dp", "tp")), check)
        fails += check.fails
        worst.update(check.worst)
    return fails, worst


@pytest.mark.parametrize("recipe", by_recipe())
def test_tp_mlp_equals_single_process(recipe):
    # one test per recipe (4 ranks each): pytest-xdist spreads them, each has its own timeout
    prepared = ("bf16", "fp8_current", "fp8_delayed", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "fp8_block")
    results = run_ranks(_rank_fn, 4, (recipe,), prepared, timeout=900.0)
    fails = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:30])


@pytest.mark.gpu
def test_tp_mlp_equals_single_process_nccl():
    """The TP/SP MLP and gate/up blocks over NCCL on 2 or 4 GPUs, every named recipe (GEMMs
    within tolerance: cuBLAS may split K differently for a sharded shape)."""
    names = tuple(hd.RECIPE_NAMES)
    results = run_nccl(_rank_fn, nccl_world(), names, names, "cuda")
    fails = [f"rank {r}: {m}" for r, (fs, _) in enumerate(results) for m in fs]
    assert not fails, f"{len(fails)} failures:\n" + "\n".join(fails[:30])
