"""GPU (``@pytest.mark.gpu``, skipped without CUDA): GroupedLinear on CUDA against the
hd.Linear loop, the ``torch._grouped_mm`` bf16 path, and no device-to-host sync in the
forward and backward of the bf16 grouped path and the dropless MoE layer.

Quantized recipes on CUDA run the reference grouped path, which reads the split sizes on
the host (``split_quantize`` note), so they are excluded from the no-sync check.
"""

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.moe import GroupedLinear, MoE
from tests._helpers import sqnr_db
from tests.moe.test_grouped_linear import SPLITS, run_both

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("recipe_name", [n for n in hd.RECIPE_NAMES if n != "bf16"])
def test_grouped_linear_matches_linear_loop_cuda(recipe_name):
    # both sides go through the same gemm_nt dispatch on CUDA with the same shapes
    run_both(recipe_name, quantized_init=False, steps=1, device="cuda")


def test_bf16_grouped_mm_close_to_linear_loop():
    def close(a, b, what):
        assert sqnr_db(b.float(), a.float()) > 40, f"{what}: SQNR {sqnr_db(b.float(), a.float()):.1f} dB"

    run_both("bf16", quantized_init=False, steps=1, device="cuda", check=close)


class _SyncError:
    """``torch.cuda.set_sync_debug_mode("error")`` inside the block, restored after."""

    def __enter__(self):
        torch.cuda.synchronize()
        self.prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.prev)


def test_grouped_linear_bf16_no_host_sync():
    g = GroupedLinear(4, 128, 256, recipe=hd.recipe_from_name("bf16"), device="cuda", dtype=torch.bfloat16)
    x = torch.randn(sum(SPLITS), 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tpe = torch.tensor(SPLITS, device="cuda")
    dy = torch.randn(sum(SPLITS), 256, device="cuda", dtype=torch.bfloat16)
    with _SyncError():
        y = g(x, tpe)
        y.backward(dy)
    assert x.grad is not None and g.weight.grad.shape == (4, 256, 128)
    assert torch.count_nonzero(g.weight.grad[1]) == 0  # the zero-token expert


@pytest.mark.parametrize("recipe_name", [None, "bf16"])
def test_moe_forward_backward_no_host_sync(recipe_name):
    recipe = hd.recipe_from_name(recipe_name) if recipe_name else None
    moe = MoE(128, 128, 8, 2, recipe=recipe, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    with _SyncError():
        y, aux = moe(x)
        torch.autograd.backward([y, aux], [dy, torch.ones((), device="cuda")])
    assert torch.isfinite(x.grad.float()).all() and moe.fc1.weight.grad is not None
