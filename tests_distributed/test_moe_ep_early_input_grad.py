"""The dispatch's backward exchange starts inside the first expert layer's backward
(``expert_parallel.InputGradSender``): on 2 gloo ranks, the ``dispatch_grad`` all-to-all is
issued before the layer's weight gradient exists (its wgrad GEMM runs during the exchange)
with ``early_input_grad``, after it without; the input and weight gradients are bitwise
the same either way, for the high-precision dispatch (``bf16``) and the quantized one
(``fp8_current``). The ``MoE`` layer uses it. Over NCCL (``gpu``) the CUDA paths: bf16
``torch._grouped_mm`` (also with no recipe) and the packed FP8 path. (Without a recipe a
CPU GroupedLinear is a loop of ``F.linear``, no autograd Function of ours: its dx goes back
after its wgrad.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybrid_dist as hd
from hybrid_dist.moe import MoE, GroupedLinear
from hybrid_dist.moe import expert_parallel as ep
from tests_distributed._harness import nccl_world, run_nccl, run_ranks

H, N, E, SLOTS = 64, 96, 4, 80


class _LoggedWire(ep.WireStats):
    """WireStats that logs each exchange as it is issued."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def add(self, key: str, n: int) -> None:
        self.events.append(key)
        super().add(key, n)


def _dispatch_then_experts(rank, world, recipe_name, early, device):
    """(event order, dx, dW) of dispatch → GroupedLinear → backward on this rank."""
    torch.manual_seed(0)
    recipe = hd.recipe_from_name(recipe_name) if recipe_name else None
    fc = GroupedLinear(E // world, H, N, recipe=recipe, dtype=torch.bfloat16, device=device)
    torch.manual_seed(1 + rank)
    counts = torch.randint(5, 30, (E,)).to(device)
    x = torch.randn(int(counts.sum()), H, dtype=torch.bfloat16, device=device, requires_grad=True)
    events = []
    fc.weight.register_hook(lambda g: events.append("fc1_weight_grad"))
    wire = _LoggedWire(events)
    route = ep.make_route(counts, dist.group.WORLD, wire)
    plan = fc.plan(recipe) if recipe is not None else None
    packed = fc.packed_exchange(x, "input") if plan is not None else None
    x_local, io = ep.dispatch(x, route, plan=plan, stats=wire, packed=packed, early_input_grad=early)
    y = fc(x_local, route.tokens_per_local_expert, io=io)
    dy = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(7 + rank)).to(device)
    y.backward(dy)
    return [e for e in events if e in ("dispatch_grad", "fc1_weight_grad")], x.grad, fc.weight.grad


def _worker(rank, world, recipe_names, device="cpu"):
    for name in recipe_names:
        order, dx, dw = _dispatch_then_experts(rank, world, name, True, device)
        late_order, late_dx, late_dw = _dispatch_then_experts(rank, world, name, False, device)
        cfg = f"EP={world} rank={rank} recipe={name}"
        assert order == ["dispatch_grad", "fc1_weight_grad"], f"{cfg}: early input grad, order {order}"
        assert late_order == ["fc1_weight_grad", "dispatch_grad"], f"{cfg}: without it, order {late_order}"
        for what, a, b in (("dx", dx, late_dx), ("dW", dw, late_dw)):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{cfg}: {what} differs with early input grad"
    # the layer issues dx's exchange inside fc1's backward
    torch.manual_seed(0)
    events = []
    moe = MoE(H, N, E, 2, recipe=hd.recipe_from_name("fp8_current"), ep_group=dist.group.WORLD, dtype=torch.bfloat16,
              device=device)
    moe.wire = _LoggedWire(events)
    moe.fc1.weight.register_hook(lambda g: events.append("fc1_weight_grad"))
    y, aux = moe(torch.randn(1, 48, H, dtype=torch.bfloat16, device=device, requires_grad=True))
    (y.float().square().mean() + aux).backward()
    order = [e for e in events if e in ("dispatch_grad", "fc1_weight_grad")]
    assert order == ["dispatch_grad", "fc1_weight_grad"], f"EP={world} rank={rank} MoE layer: order {order}"
    return True


@pytest.mark.parametrize("world", [2], ids=lambda w: f"EP={w}")
def test_dispatch_grad_exchange_starts_before_the_first_layers_wgrad(world):
    run_ranks(_worker, world, ["bf16", "fp8_current"])


@pytest.mark.gpu
def test_dispatch_grad_exchange_starts_before_the_first_layers_wgrad_nccl():
    run_nccl(_worker, nccl_world(), ["bf16", "fp8_current", None], "cuda")
