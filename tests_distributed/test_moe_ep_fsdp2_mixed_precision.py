"""Expert parallel with the MoE layer under FSDP2 mixed precision, as the launcher wraps it
(fp32 parameters; each rank's GroupedLinears ``fully_shard``-ed over the ranks holding the
same experts, then the layer over all ranks; ``MixedPrecisionPolicy(param_dtype=bf16)``):

* the quantized dispatch's operands (``ExchangeIO``) reach the experts untouched, though
  ``cast_forward_inputs`` rebuilds the forward's arguments and casts their floating tensors
  (a rebuilt copy would hand the experts FP8 codes cast to bf16, which ``torch._scaled_mm``
  refuses on CUDA, and hide the gradient the combine's backward fills for the last expert
  layer, whose backward would then quantize the zero stand-in);
* the exchange hands the rows packed where the experts take the packed grouped path,
  judged by the weight's dtype in the experts' forward (bf16), not the fp32 shard the
  layer holds before their pre-forward;

so y, dx and the experts' weight gradients are bitwise those of the same layer in bf16
without ``fully_shard``. EP = 2 on gloo (the per-expert loop, and the packed path forced on
CPU); over NCCL (``gpu``, 2 or 4 GPUs) the packed path.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hybrid_dist as hd
from hybrid_dist.moe import MoE
from tests_distributed._harness import nccl_world, run_nccl, run_ranks

H, FFN, E, TOP_K, T = 64, 64, 4, 2, 48  # T tokens per rank
PACKED = {"fp8_current": "packed_fp8_rows", "mxfp8": "place_rows"}  # recipe -> the receiver's packing function


def _bits(t):
    return t.contiguous().view(torch.int16) if t.element_size() == 2 else t.contiguous().view(torch.int32)


def _build(recipe_name, device):
    torch.manual_seed(0)  # the same fp32 weights each time (the layer holds a process group: no deepcopy)
    return MoE(H, FFN, E, TOP_K, recipe=hd.recipe_from_name(recipe_name), ep_group=dist.group.WORLD,
               quantized_dispatch=True, device=device, dtype=torch.float32)


def _step(moe, x, dy):
    x = x.clone().requires_grad_(True)
    y, _ = moe(x)
    y.backward(dy)
    grads = {}
    for name in ("fc1", "fc2"):
        g = getattr(moe, name).weight.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).to(torch.bfloat16)
    return {"y": y.detach(), "dx": x.grad, **grads}


def _worker(rank, world, recipes, device, force_packed):
    import hybrid_dist.moe.device_split as ds
    from hybrid_dist.moe import grouped_quantized as gq

    if force_packed:  # the packed path on CPU too (its emulated kernels)
        gq.fits = lambda plan, x, weight: gq.unsupported_reason(plan, x, weight) is None
    mesh = init_device_mesh(device, (world, 1), mesh_dim_names=("ep", "dp"))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    gen = torch.Generator(device=device).manual_seed(7 + rank)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(T, H, device=device, dtype=torch.bfloat16, generator=gen)
    bad = []
    for recipe_name in recipes:
        cfg = f"EP={world} rank={rank} {device} recipe={recipe_name} packed={'forced' if force_packed else 'auto'}"
        calls, fn = [], PACKED[recipe_name]
        place = getattr(ds, fn)
        setattr(ds, fn, lambda *a, **k: calls.append(1) or place(*a, **k))
        plain = _build(recipe_name, device).to(torch.bfloat16)
        want = _step(plain, x, dy)
        n_plain = len(calls)
        wrapped = _build(recipe_name, device)
        for mod in (wrapped.fc1, wrapped.fc2):  # the experts over the ranks holding them (each rank alone)
            fully_shard(mod, mesh=mesh["dp"], mp_policy=mp)
        fully_shard(wrapped, mesh=mesh._flatten("all") if hasattr(mesh, "_flatten") else mesh["ep"], mp_policy=mp)
        got = _step(wrapped, x, dy)
        n_wrapped = len(calls) - n_plain
        setattr(ds, fn, place)
        if force_packed or device == "cuda":
            if (n_plain, n_wrapped) != (2, 2):
                bad.append(f"{cfg}: {fn} ran {n_plain} times for the plain layer and {n_wrapped} under FSDP2 "
                           "(the packed dispatch fwd + combine bwd: 2 each)")
        for k, ref in want.items():
            n = int((_bits(got[k]) != _bits(ref)).sum())
            if n:
                bad.append(f"{cfg}: {k} of the FSDP2 mixed-precision layer differs from the plain bf16 layer "
                           f"in {n} of {ref.numel()} elements")
    return bad


@pytest.mark.parametrize("force_packed", [False, True], ids=["loop", "packed"])
@pytest.mark.parametrize("recipe_name", sorted(PACKED))
def test_fsdp2_mixed_precision_experts_get_the_exchanged_operands(recipe_name, force_packed):
    bad = [b for per_rank in run_ranks(_worker, 2, [recipe_name], "cpu", force_packed) for b in per_rank]
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
def test_fsdp2_mixed_precision_experts_nccl():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    bad = [b for per_rank in run_nccl(_worker, nccl_world(), sorted(PACKED), "cuda", False) for b in per_rank]
    assert not bad, "\n".join(bad)
