"""``hd.Linear`` under ``torch.cuda.make_graphed_callables``: the forward and backward are
each captured once and replayed, with no host work per kernel (how small, host-bound
layers reach their GPU time; ``benchmarks.linear --graphs``).

Each replayed step must equal the eager step bitwise (same kernels, same order), over
several steps with changing inputs, so state carried between steps (delayed-scaling amax
histories and scales, stochastic-rounding Philox keys, all advanced on the device) is
replayed correctly too.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.formats import NVFP4State
from tests._kernel_helpers import n_bit_diffs

pytestmark = pytest.mark.gpu
M, K, N, STEPS = 512, 1024, 768, 4


def _sr_keys(module) -> list[torch.Tensor]:
    """The live CUDA Philox keys of the module's stochastic-rounding states."""
    plan = next(iter(module._plans.values()))
    states = [s for s in plan.states.values() if isinstance(s, NVFP4State)]
    for s in states:  # the kernels ask with the tensor's device, "cuda:0": one key either way
        assert s.kernel_key(torch.device("cuda")) is s.kernel_key(torch.device("cuda", torch.cuda.current_device()))
    return [s.kernel_key(torch.device("cuda")) for s in states]


@pytest.mark.parametrize("name,dtype", [(n, torch.bfloat16) for n in ("fp8_current", "fp8_delayed", "mxfp8",
                                                                     "fp8_block", "nvfp4", "mxfp8_fwd_nvfp4_bwd")]
                         + [("nvfp4", torch.float32)], ids=str)
def test_graphed_linear_equals_eager_bitwise(name, dtype):
    """Also an fp32 module with stochastic rounding: its columnwise NVFP4 runs on the tile
    kernel (device key), so it is captured like bf16's."""
    recipe = hd.recipe_from_name(name)
    torch.manual_seed(0)
    eager = hd.Linear(K, N, bias=True, recipe=recipe, device="cuda", dtype=dtype)
    graphed = hd.Linear(K, N, bias=True, recipe=recipe, device="cuda", dtype=dtype)
    graphed.load_state_dict(eager.state_dict())
    sample = torch.randn(M, K, device="cuda", dtype=dtype, requires_grad=True)
    for mod in (eager, graphed):  # both past their first step (any host-side first-step logic)
        mod(sample).backward(torch.ones(M, N, device="cuda", dtype=dtype))
    # the capture's warm-up backward uses uninitialised gradients and advances the delayed
    # states: reset every device state (in place: the graphs hold these buffers) from eager
    graphed = torch.cuda.make_graphed_callables(graphed, (sample,), num_warmup_iters=3)
    graphed.load_state_dict(eager.state_dict())  # the SR keys too, in place (warm-up advanced them)
    keys = list(zip(_sr_keys(eager), _sr_keys(graphed)))
    assert bool(keys) == ("nvfp4" in name), f"{name}: stochastic-rounding states {len(keys)}"
    for ke, kg in keys:
        assert torch.equal(kg, ke), f"{name}: the SR key was not loaded from the state dict"
    start = [ke.item() for ke, _ in keys]
    g = torch.Generator(device="cuda").manual_seed(1)
    for step in range(STEPS):
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype) * (step + 1)
        dy = torch.randn(M, N, device="cuda", generator=g).to(dtype)
        out = []
        for mod in (eager, graphed):
            xi = x.clone().requires_grad_(True)
            y = mod(xi)
            dx, dw, db = torch.autograd.grad(y, [xi, mod.weight, mod.bias], dy)
            out.append((y.detach(), dx, dw, db))
        for what, a, b in zip(("y", "dx", "dW", "db"), *out):
            n = n_bit_diffs(b, a, f"{name} step {step} {what}")
            assert n == 0, (f"{name} step {step}: {what} differs bitwise in {n} of {a.numel()} elements "
                            "(graphed vs eager)")
    for (ke, kg), k0 in zip(keys, start):  # one SR kernel call per step: fresh noise per replay
        assert ke.item() == kg.item() == k0 + STEPS, f"{name}: SR keys {ke.item()}, {kg.item()}, expected {k0 + STEPS}"
