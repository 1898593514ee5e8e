"""Collectives per TP/SP step at TP=8 × DP=8 (64 ranks) on the fake process group.

One process plays rank 3 of 64 with ``FakeStore`` (collectives run no communication), so
values are meaningless and only the communication pattern is checked: ``CommDebugMode``
counts the c10d collectives of one training step (after a warm-up step) and
``record_wire_bytes`` their payloads. Expected per MLP step (fc1 colwise, fc2 rowwise):

* SP on:  all-gathers 3 (fc1 input rowwise; fc2 output-grad rowwise+columnwise in one;
  fc1 input columnwise for wgrad), reduce-scatters 2 (fc2 output, fc1 input grad),
  all-reduces 1 (fc2 bias grad) + the amax all-reduces of sharded tensors with a
  per-tensor scale: one per layer forward (input and weight together), one per output
  gradient;
* SP off: all-reduces 2 (fc1 input grad, fc2 output) + amax all-reduces: fc1 weight,
  fc2 input and weight together, fc1 output gradient (fc2's is replicated);
* FSDP2 on the dp axis adds 4 all-gathers (fc1, fc2 × forward, backward) and 2
  reduce-scatters.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import hybrid_dist as hd
from hybrid_dist.recipes import Role
from hybrid_dist.tensor_parallel import (
    HybridColwiseParallel,
    HybridRowwiseParallel,
    PrepareHybridModuleInput,
    record_wire_bytes,
)
from tests_distributed.test_tp_linear import MLP, GateUp

TP = DP = 8
S_LOCAL, B, H, F = 16, 2, 128, 1024
M = S_LOCAL * TP * B  # rows of the gathered [S, B, H] activation

AG, RS, AR = "c10d._allgather_base_", "c10d._reduce_scatter_base_", "c10d.allreduce_"


@pytest.fixture(scope="module")
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=TP * DP)
    try:
        yield init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def _per_tensor(recipe, tensor_type: str) -> int:
    return int(recipe.quantizer(Role(tensor_type=tensor_type)).is_per_tensor)


def expected_mlp_counts(recipe, sp: bool, fsdp: bool = False) -> dict[str, int]:
    pt = {t: _per_tensor(recipe, t) for t in ("input", "weight", "grad_output")}
    fwd = max(pt["input"], pt["weight"])  # a layer's input and weight amaxes share one all-reduce
    if sp:
        counts = {AG: 3, RS: 2, AR: 1 + 2 * fwd + 2 * pt["grad_output"]}
    else:
        counts = {AG: 0, RS: 0, AR: 2 + pt["weight"] + fwd + pt["grad_output"]}
    if fsdp:
        counts[AG] += 4
        counts[RS] += 2
    return {k: v for k, v in counts.items() if v}


def _step_counts(model, x, *, steps: int = 2):
    for _ in range(steps):
        with CommDebugMode() as cm, record_wire_bytes() as log:
            model(x).sum().backward()
    return {str(k): v for k, v in cm.get_comm_counts().items() if v}, log


def _mlp(recipe, mesh, *, sp: bool, quantized_gather: bool = True):
    m = MLP(H, F, recipe)
    parallelize_module(m, mesh["tp"], {
        "fc1": HybridColwiseParallel(sequence_parallel=sp, quantized_gather=quantized_gather),
        "fc2": HybridRowwiseParallel(sequence_parallel=sp, quantized_gather=quantized_gather)})
    return m


@pytest.mark.parametrize("sp", [False, True], ids=["sp_off", "sp_on"])
def test_collectives_per_step_every_recipe(mesh, sp):
    warnings.simplefilter("ignore")
    fails = []
    for name in hd.RECIPE_NAMES:
        recipe = hd.recipe_from_name(name)
        x = torch.randn(S_LOCAL if sp else S_LOCAL * TP, B, H, requires_grad=True)
        got, _ = _step_counts(_mlp(recipe, mesh, sp=sp), x, steps=1)
        want = expected_mlp_counts(recipe, sp)
        if got != want:
            fails.append(f"[{name} TP={TP} DP={DP} SP={sp}] collectives {got}, expected {want}")
    assert not fails, "\n".join(fails)


# bytes of all all-gathers of one SP MLP step, per element of the gathered [M, H]
# activation: fc1 input rowwise + fc1 input columnwise + fc2 output grad (both ways; per-tensor
# FP8 sends its rowwise bytes once and derives the columnwise, hybrid_dist.derived_columnwise)
GATHER_BYTES_PER_ELEM = {
    "fp8_current": 3 * 1,
    "mxfp8": 4 * (1 + 1 / 32),
    "nvfp4": 4 * (1 / 2 + 1 / 16),
    "bf16": 3 * 4,  # identity: fp32 gathered once per use (fc2 grad once for both ways)
}


@pytest.mark.parametrize("name", sorted(GATHER_BYTES_PER_ELEM))
def test_all_gather_bytes_per_step(mesh, name):
    warnings.simplefilter("ignore")
    recipe = hd.recipe_from_name(name)
    x = torch.randn(S_LOCAL, B, H, requires_grad=True)
    _, log = _step_counts(_mlp(recipe, mesh, sp=True), x)
    want = GATHER_BYTES_PER_ELEM[name] * M * H
    assert log.total("all_gather") == want, f"[{name} SP] all-gather bytes {log.total('all_gather')} != {want}"
    _, log_hp = _step_counts(_mlp(recipe, mesh, sp=True, quantized_gather=False), x)
    assert log_hp.total("all_gather") == 3 * 4 * M * H, f"[{name} SP high-precision gathers]"
    assert log.total("reduce_scatter") == log_hp.total("reduce_scatter") == 2 * 4 * M * H, \
        f"[{name} SP] reduce-scatters stay fp32"


def test_fsdp2_on_dp_axis_adds_its_collectives(mesh):
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")
    for name in ("bf16", "fp8_current", "nvfp4"):
        recipe = hd.recipe_from_name(name)
        m = _mlp(recipe, mesh, sp=True)
        for mod in (m.fc1, m.fc2, m):
            fully_shard(mod, mesh=mesh["dp"])
        got, _ = _step_counts(m, torch.randn(S_LOCAL, B, H, requires_grad=True))
        want = expected_mlp_counts(recipe, True, fsdp=True)
        assert got == want, f"[{name} TP={TP} x FSDP2 DP={DP} SP] collectives {got}, expected {want}"


def test_prepared_input_gathers_once_for_gate_and_up(mesh):
    warnings.simplefilter("ignore")
    for name in ("bf16", "mxfp8", "fp8_current"):
        recipe = hd.recipe_from_name(name)
        m = GateUp(H, F, recipe)
        parallelize_module(m, mesh["tp"], {
            "": PrepareHybridModuleInput(consumers=("gate", "up")),
            "gate": HybridColwiseParallel(sequence_parallel=True),
            "up": HybridColwiseParallel(sequence_parallel=True),
            "down": HybridRowwiseParallel(sequence_parallel=True)})
        got, log = _step_counts(m, torch.randn(S_LOCAL, B, H, requires_grad=True))
        pt = {t: _per_tensor(recipe, t) for t in ("input", "weight", "grad_output")}
        # amax: shared input; gate, up weights; down input+weight; down/gate/up grads
        n_ar = pt["input"] + 2 * pt["weight"] + max(pt["input"], pt["weight"]) + 3 * pt["grad_output"]
        want = {k: v for k, v in {AG: 3, RS: 2, AR: n_ar}.items() if v}
        assert got == want, f"[{name} prepared gate/up SP] collectives {got}, expected {want}"
        n_col = sum(1 for e in log.events if e.kind == "all_gather" and e.what == "columnwise")
        # columnwise bytes travel only where the columnwise is not the rowwise transposed
        # (mxfp8: the wgrad input and dy); bf16 and fp8_current gather rowwise bytes and
        # transpose them (bf16's dy goes high precision)
        want_col = 2 if name == "mxfp8" else 0
        assert n_col == want_col, f"[{name}] columnwise gathers {n_col}, expected {want_col}"


def test_bad_input_raises_clear_errors(mesh):
    from torch import nn

    from hybrid_dist.tensor_parallel import gather_along_first_dim

    group = mesh["tp"].get_group()
    x = torch.randn(4, 128)  # 4 rows per rank: MXFP8 columnwise blocks need 32
    with pytest.raises(ValueError, match="path must be one of"):
        gather_along_first_dim(x, group, quantizer=hd.MXFP8Quantizer(), path="fast")
    with pytest.raises(ValueError, match="straddle"):
        gather_along_first_dim(x, group, quantizer=hd.MXFP8Quantizer(), columnwise=True, path="quantized")
    with pytest.raises(ValueError, match="at least one"):
        gather_along_first_dim(x, group, quantizer=hd.MXFP8Quantizer(), rowwise=False)
    with pytest.raises(ValueError, match="applies to hd.Linear"):
        parallelize_module(nn.Linear(8, 8), mesh["tp"], HybridColwiseParallel())
    with pytest.raises(ValueError, match="1D TP mesh"):
        parallelize_module(hd.Linear(128, 128), mesh, HybridColwiseParallel())
    for bad in (lambda: HybridRowwiseParallel(reduce_input_grad=False),
                lambda: HybridColwiseParallel(sequence_parallel=True, reduce_input_grad=False)):
        with pytest.raises(ValueError, match="reduce_input_grad=False applies to HybridColwiseParallel"):
            bad()
    lin = parallelize_module(hd.Linear(128, 128), mesh["tp"], HybridRowwiseParallel())
    with pytest.raises(ValueError, match="already tensor parallel"):
        parallelize_module(lin, mesh["tp"], HybridColwiseParallel())
    with pytest.raises(ValueError, match=r"expects input \[..., 16\]"):
        lin(torch.randn(4, 128))
    with hd.quantized_model_init(hd.recipe_from_name("mxfp8")):
        qlin = hd.Linear(128, 128)
    with pytest.raises(NotImplementedError, match="high-precision weight"):
        parallelize_module(qlin, mesh["tp"], HybridColwiseParallel())
    m = GateUp(H, F, None)
    m.up.recipe = hd.recipe_from_name("mxfp8")
    parallelize_module(m, mesh["tp"], {"": PrepareHybridModuleInput(consumers=("gate", "up")),
                                       "gate": HybridColwiseParallel(sequence_parallel=True),
                                       "up": HybridColwiseParallel(sequence_parallel=True)})
    with pytest.raises(ValueError, match="one input quantizer"):
        m(torch.randn(S_LOCAL, B, H))


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8"])
def test_tp_masters_start_from_the_kept_init_slice(mesh, name):
    """Under ``quantized_model_init``'s default the TP styles slice the kept fp32 init with
    each quantized weight, so rank 3's masters are bitwise its slices of the init (column
    parallel: rows; row parallel: columns), as the unsharded masters are the whole init."""
    from hybrid_dist import hp_init

    recipe = hd.recipe_from_name(name)
    torch.manual_seed(0)
    with hd.quantized_model_init(recipe):
        m = torch.nn.Sequential(hd.Linear(H, F, bias=False), hd.Linear(F, H, bias=False))
    inits = [hp_init.kept(layer.weight).clone() for layer in m]
    parallelize_module(m, mesh["tp"], {"0": HybridColwiseParallel(), "1": HybridRowwiseParallel()})
    opt = hd.MasterWeightOptimizer(torch.optim.AdamW, m.parameters(), lr=1e-2)
    tp_rank = mesh["tp"].get_local_rank()
    for dim, layer, init in zip((0, 1), m, inits):
        n = init.shape[dim] // TP
        master = opt.master_of(layer.weight)._local_tensor
        assert torch.equal(master, init.narrow(dim, tp_rank * n, n)), f"{name}: master of a Shard({dim}) weight"
        assert hp_init.kept(layer.weight) is None, "the init was not freed once the master took it"
