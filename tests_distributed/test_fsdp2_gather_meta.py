"""FSDP2 pre-all-gather builds a parameter's gather plan once, and never copies its scalars.

``_hooks.gather_inputs`` needs the metadata of every direction the shard has (to pick the
slots / packed mode) and the transport buffers of the directions the pass gathers. The
plan (metadata, mode) depends only on the shard's storage objects and the pass, so it is
built on the first gather of a pass and reused; its per-tensor scalars (FP8
``scale_inv``, NVFP4 ``global_scale``) are the shard's live fields — never cloned in
pre-all-gather — and the unsharded tensor shares them. Clones counted with a dispatch
mode on ``aten.clone`` (no process group needed).
"""

from __future__ import annotations

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hybrid_dist as hd
from hybrid_dist.fsdp2._buffers import fsdp_buffer_fields
from hybrid_dist.fsdp2._hooks import gather_inputs
from hybrid_dist.fsdp2._pass import BACKWARD, BOTH, FORWARD


class _CountClones(TorchDispatchMode):
    """Counts ``aten.clone`` of the tensors ``watched`` (by data pointer)."""

    def __init__(self, watched: list[torch.Tensor]):
        super().__init__()
        self.ptrs, self.clones = {t.data_ptr() for t in watched}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.clone.default and args[0].data_ptr() in self.ptrs:
            self.clones += 1
        return func(*args, **(kwargs or {}))


def _scalar_fields(t) -> list[torch.Tensor]:
    """Per-tensor (not gathered) fields of every direction present."""
    return [getattr(st, f) for st in (t.rowwise, t.columnwise) if st is not None
            for f in st.TENSOR_FIELDS if f not in fsdp_buffer_fields(st)]


def _weight_shard(name: str):
    """A 128 x 256 weight shard of recipe ``name`` with both directions (stateless)."""
    q = hd.recipe_from_name(name).quantizer(hd.Role(tensor_type="weight"))
    return hd.hybrid.stateless(q).quantize(torch.randn(128, 256), rowwise=True, columnwise=True)


_BOTH = types.SimpleNamespace(gathered=("rowwise", "columnwise"))  # a meta-like: compare both directions


def _assert_same_bytes(unsharded, fresh, meta, where: str) -> None:
    for d in meta.gathered:
        for f in fresh.storage_of(d).TENSOR_FIELDS:
            got, ref = getattr(unsharded.storage_of(d), f), getattr(fresh.storage_of(d), f)
            assert torch.equal(got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), (
                f"{where}: {d}.{f} differs")


@pytest.mark.parametrize("name", ["fp8_current", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "mxfp8"])
@pytest.mark.parametrize("pass_", [FORWARD, BACKWARD, BOTH])
def test_gather_plan_built_once_and_scalars_never_cloned(name, pass_):
    from hybrid_dist.fsdp2._hooks import post_all_gather

    torch.manual_seed(0)
    w = torch.randn(256, 128)
    q = hd.recipe_from_name(name).quantizer(hd.Role(tensor_type="weight"))
    shard = q.quantize(w[:128], rowwise=True, columnwise=True)
    scalars = _scalar_fields(shard)
    with _CountClones(scalars) as mode:
        inputs, meta = gather_inputs(shard, pass_, 2, torch.Size([256, 128]), None)
        _, meta_again = gather_inputs(shard, pass_, 2, torch.Size([256, 128]), None)
    assert mode.clones == 0, f"{name} {pass_}: {mode.clones} clones of per-tensor fields in pre-all-gather"
    assert meta_again is meta, f"{name} {pass_}: the gather plan was rebuilt for the same shard and pass"
    live = {id(s) for s in scalars}
    assert all(id(s) in live for dm in meta.dirs.values() for s in dm.scalars.values()), (
        f"{name} {pass_}: the plan's scalars are not the shard's live fields")
    # the unsharded tensor shares the scalars: an in-place update of the shard reaches it
    unsharded, _ = post_all_gather(shard, [torch.cat([b, b]) for b in inputs], meta, None)
    for st, full in ((shard.rowwise, unsharded.rowwise), (shard.columnwise, unsharded.columnwise)):
        for f in st.TENSOR_FIELDS:
            if f not in fsdp_buffer_fields(st):
                assert getattr(full, f) is getattr(st, f), f"{name} {pass_}: unsharded {f} is a copy"


def test_plans_of_both_passes_are_kept():
    """Forward and backward gathers alternate: each pass's plan is built once, not once per gather."""
    q = hd.recipe_from_name("fp8_current").quantizer(hd.Role(tensor_type="weight"))
    shard = q.quantize(torch.randn(128, 128), rowwise=True, columnwise=True)
    metas = [gather_inputs(shard, p, 2, torch.Size([256, 128]), None)[1] for p in (FORWARD, BACKWARD) * 2]
    assert metas[0] is metas[2] and metas[1] is metas[3] and metas[0] is not metas[1]


@pytest.mark.parametrize("name, expected", [("fp8_current", True), ("fp8_delayed", True), ("mxfp8", False),
                                            ("nvfp4", False), ("fp8_block", False)])
def test_backward_transport_reads_the_rowwise_data(name, expected):
    """Per-tensor FP8: the columnwise shard is the rowwise one transposed byte for byte, so the
    backward gather sends the rowwise data as it is (no transpose on the shard) and the
    unsharded columnwise data it rebuilds is bitwise the transpose-based result."""
    from hybrid_dist.fsdp2._buffers import fsdp_transport_buffers

    torch.manual_seed(0)
    shard = _weight_shard(name)
    inputs, meta = gather_inputs(shard, BACKWARD, 2, torch.Size([256, 256]), None)
    assert meta.col_from_row is expected, f"{name}: col_from_row {meta.col_from_row}"
    by_transpose = fsdp_transport_buffers(shard.columnwise, meta.dirs["columnwise"])
    assert [b.shape for b in inputs] == [b.shape for b in by_transpose], name
    for got, ref in zip(inputs, by_transpose):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8)), f"{name}: transport bytes differ"
    if expected:
        assert inputs[0].data_ptr() == shard.rowwise.data.data_ptr(), f"{name}: the rowwise data was copied"


@pytest.mark.parametrize("name, one_rank_mode", [("fp8_current", "slots"), ("fp8_delayed", "slots"),
                                                  ("mxfp8", "packed"), ("nvfp4", "packed"),
                                                  ("mxfp8_fwd_nvfp4_bwd", "packed")])
def test_one_rank_packs_only_passes_of_several_buffers(name, one_rank_mode):
    """On a one-rank mesh FSDP2 copies only the first all-gather input: a temporary shard's
    (``quantize_on_all_gather``) pass whose transport is one buffer (per-tensor FP8's codes;
    its scale travels in the metadata) goes in slots, sending views of the shard's own
    bytes, built once; the others pack (a persistent shard is shared: the next test)."""
    shard = _weight_shard(name)
    for pass_ in (FORWARD, BACKWARD):
        inputs, meta = gather_inputs(shard, pass_, 1, torch.Size([128, 256]), None, temporary=True)
        again, _ = gather_inputs(shard, pass_, 1, torch.Size([128, 256]), None, temporary=True)
        assert meta.mode == one_rank_mode, f"{name} {pass_}: one-rank mode {meta.mode}, expected {one_rank_mode}"
        assert len(inputs) == 1, f"{name} {pass_}: {len(inputs)} all-gather inputs on one rank"
        if one_rank_mode == "slots":
            assert again is inputs and inputs[0].data_ptr() == shard.rowwise.data.data_ptr(), (
                f"{name} {pass_}: the one-rank input is not the shard's rowwise codes")
    fresh = _weight_shard(name)
    both, meta = gather_inputs(fresh, BOTH, 1, torch.Size([128, 256]), None, temporary=True)  # no reshard after forward
    # per-tensor FP8 sends its codes once for both directions (the columnwise is derived after)
    expected = "both" if one_rank_mode == "slots" else "packed"
    assert meta.mode == expected and len(both) == 1, f"{name}: both directions on one rank: {meta.mode}"


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd", "fp8_block"])
def test_one_rank_persistent_shard_is_shared_not_copied(name):
    """One rank, a persistent shard ("local"): every pass sends one placeholder byte, the
    unsharded tensor's fields are the shard's own memory (FSDP owns none of it: nothing to
    free or refill), so the optimizer's in-place write-back reaches it with no copy; a shard
    rebuilt since (new storages) is copied in, bitwise."""
    from hybrid_dist._tensor_ops import requantize_
    from hybrid_dist.fsdp2._hooks import post_all_gather

    torch.manual_seed(0)
    shard, full = _weight_shard(name), torch.Size([128, 256])
    unsharded = None
    for pass_ in (FORWARD, BACKWARD, BOTH):
        inputs, meta = gather_inputs(shard, pass_, 1, full, None)
        assert meta.mode == "local" and [b.numel() for b in inputs] == [1], f"{name} {pass_}: {meta.mode}"
        assert gather_inputs(shard, pass_, 1, full, None)[0] is inputs, f"{name} {pass_}: inputs rebuilt"
        if unsharded is None:
            unsharded, owned = post_all_gather(shard, inputs, meta, torch.bfloat16)
            assert owned == () and unsharded.dtype == torch.bfloat16, f"{name}: owned {len(owned)}"
        else:
            assert post_all_gather(shard, inputs, meta, torch.bfloat16, out=unsharded) is None
    for d in ("rowwise", "columnwise"):
        for f in shard.storage_of(d).TENSOR_FIELDS:
            a, b = getattr(unsharded.storage_of(d), f), getattr(shard.storage_of(d), f)
            assert a.data_ptr() == b.data_ptr(), f"{name}: {d}.{f} is a copy"
    requantize_(shard, torch.randn(128, 256))  # in place: seen with no refresh
    _assert_same_bytes(unsharded, shard, _BOTH, f"{name} after the write-back")
    rebuilt = _weight_shard(name)  # new storage objects: a new plan, whose refresh copies
    inputs, meta = gather_inputs(rebuilt, BACKWARD, 1, full, None)
    post_all_gather(rebuilt, inputs, meta, torch.bfloat16, out=unsharded)
    _assert_same_bytes(unsharded, rebuilt, _BOTH, f"{name} rebuilt")


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8", "nvfp4"])
def test_refresh_reuses_inputs_and_copies_only_unaliased_fields(name):
    """Steady-state gathers do no repeated work: the transport inputs that are views of the
    shard's fields are built once, and refreshing the unsharded tensor from FSDP's reused
    all-gather outputs (handed over as fresh views of the same base tensors) runs a cached
    program that copies only what does not alias them (a slots-mode forward: nothing; a
    backward: each columnwise field), and its result is bitwise a fresh rebuild from the
    same bytes."""
    from hybrid_dist._tensor_ops import requantize_
    from hybrid_dist.fsdp2._hooks import post_all_gather

    torch.manual_seed(0)
    shard = _weight_shard(name)
    full = torch.Size([256, 256])
    bases, programs, unsharded = {}, {}, None
    for step in range(3):
        requantize_(shard, torch.randn(128, 256))  # the optimizer's in-place write-back: new bytes and scales
        for pass_ in (FORWARD, BACKWARD):
            inputs, meta = gather_inputs(shard, pass_, 2, full, None)
            again, _ = gather_inputs(shard, pass_, 2, full, None)
            if meta.mode != "slots":
                pytest.skip(f"{name}: {meta.mode} mode")
            zero_copy = all(b.untyped_storage().data_ptr() in {getattr(st, f).untyped_storage().data_ptr()
                                                              for st in (shard.rowwise, shard.columnwise)
                                                              for f in st.TENSOR_FIELDS} for b in inputs)
            assert (again is inputs) == zero_copy, f"{name} {pass_}: inputs cached={again is inputs}, views={zero_copy}"
            # FSDP's persistent outputs, refilled by each gather; a new view of them per call
            base = bases.setdefault(pass_, [torch.empty(2 * b.numel(), dtype=b.dtype) for b in inputs])
            for o, b in zip(base, inputs):
                o.copy_(torch.cat([b.reshape(-1), b.reshape(-1)]))
            outputs = tuple(o.view(-1, *b.shape[1:]) for o, b in zip(base, inputs))
            if unsharded is None:
                unsharded, _ = post_all_gather(shard, outputs, meta, None)
                continue
            assert post_all_gather(shard, outputs, meta, None, out=unsharded) is None
            program = unsharded._hd_refresh[meta.pass_]
            expected = 0 if pass_ == FORWARD else len(meta.dirs["columnwise"].fields)
            assert len(program.fields) == expected, f"{name} {pass_}: {len(program.fields)} copies, expected {expected}"
            assert programs.setdefault(pass_, program) is program, f"{name} {pass_}: the refresh program was rebuilt"
            fresh, _ = post_all_gather(shard, tuple(o.view(-1, *b.shape[1:]) for o, b in zip(base, inputs)), meta, None)
            _assert_same_bytes(unsharded, fresh, meta, f"{name} {pass_}")


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd"])
def test_one_rank_packed_refresh_reads_fsdp_output_in_place(name):
    """One rank, several buffers per pass ("packed"): FSDP2 copies the packed input into its
    one reused output; refreshing the unsharded tensor copies each field straight out of it
    (a cached program, no unpacking clone) and is bitwise a fresh rebuild from the same bytes."""
    from hybrid_dist._tensor_ops import requantize_
    from hybrid_dist.fsdp2._hooks import post_all_gather

    torch.manual_seed(0)
    shard = _weight_shard(name)
    full = torch.Size([128, 256])
    bases, programs, unsharded = {}, {}, None
    for step in range(3):
        requantize_(shard, torch.randn(128, 256))
        for pass_ in (FORWARD, BACKWARD):
            (packed,), meta = gather_inputs(shard, pass_, 1, full, None, temporary=True)
            assert meta.mode == "packed", f"{name} {pass_}: {meta.mode}"
            base = bases.setdefault(pass_, torch.empty_like(packed))  # FSDP's output, reused
            base.copy_(packed)
            if unsharded is None:
                unsharded, _ = post_all_gather(shard, (base.view(-1),), meta, None)
                continue
            with _CountClones([base]) as mode:
                assert post_all_gather(shard, (base.view(-1),), meta, None, out=unsharded) is None
            assert mode.clones == 0, f"{name} {pass_}: the one-rank refresh unpacked {mode.clones} clones"
            program = unsharded._hd_refresh[meta.pass_]
            assert programs.setdefault(pass_, program) is program, f"{name} {pass_}: the refresh program was rebuilt"
            fresh, _ = post_all_gather(shard, (base.clone().view(-1),), meta, None)
            _assert_same_bytes(unsharded, fresh, meta, f"{name} step {step} {pass_}")


def _one_rank_copy_worker(rank, world):
    """A quantized-init ``hd.Linear`` under FSDP2 on one gloo rank: its own shard gathers in
    "local" mode; a copy of the shard (what CPU offload hands the hook: the shard moved to
    the device for this gather) is not shared, it packs or goes in slots."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hybrid_dist.fsdp2._hooks import pre_all_gather

    mesh = init_device_mesh("cpu", (1,))
    out = {}
    for name in ("fp8_current", "mxfp8"):
        with hd.quantized_model_init(hd.recipe_from_name(name)):
            layer = hd.Linear(256, 128, bias=False, dtype=torch.bfloat16)
        fully_shard(layer, mesh=mesh)
        shard = layer.weight._local_tensor
        copy = hd.QuantizedTensor(shard.shape, shard.dtype, shard.rowwise.map_tensors(torch.clone),
                                  shard.columnwise.map_tensors(torch.clone), shard.quantizer)
        modes = [pre_all_gather(t, mesh, None, None, layer, None)[1].mode for t in (shard, copy)]
        out[name] = modes
    return out


def test_one_rank_shares_only_fsdps_own_shard():
    from tests_distributed._harness import run_ranks

    (modes,) = run_ranks(_one_rank_copy_worker, 1)
    assert modes == {"fp8_current": ["local", "slots"], "mxfp8": ["local", "packed"]}, modes


@pytest.mark.parametrize("name, derived", [("fp8_current", True), ("fp8_delayed", True), ("mxfp8", False)])
def test_both_directions_pass_sends_a_derivable_columnwise_once(name, derived):
    """``reshard_after_forward=False`` ("forward_both"): per-tensor FP8 sends its rowwise codes
    once (a view of the shard) and the unsharded columnwise is transposed from them after the
    gather; other formats send both directions. Either way the unsharded tensor is bitwise
    the quantization of the full weight."""
    from hybrid_dist.fsdp2._hooks import post_all_gather

    torch.manual_seed(0)
    w = torch.randn(128, 256)
    q = hd.hybrid.stateless(hd.recipe_from_name(name).quantizer(hd.Role(tensor_type="weight")))
    shard = q.quantize(w, rowwise=True, columnwise=True)
    inputs, meta = gather_inputs(shard, BOTH, 2, torch.Size([256, 256]), None)
    n_row, n_col = (len(fsdp_buffer_fields(st)) for st in (shard.rowwise, shard.columnwise))
    assert meta.mode == "both" and meta.col_from_row is derived, f"{name}: {meta.mode}, {meta.col_from_row}"
    assert len(inputs) == (n_row if derived else n_row + n_col), f"{name}: {len(inputs)} all-gather inputs"
    if derived:
        assert inputs[0].data_ptr() == shard.rowwise.data.data_ptr(), f"{name}: the rowwise codes were copied"
    unsharded, _ = post_all_gather(shard, [torch.cat([b, b]) for b in inputs], meta, None)  # two equal shards
    full = q.quantize(torch.cat([w, w]), rowwise=True, columnwise=True)
    _assert_same_bytes(unsharded, full, _BOTH, f"{name} both directions")
