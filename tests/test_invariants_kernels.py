"""docs/design.md §4 invariants 1–3 with the CUDA kernels (Linear fwd+bwd on the GPU)."""

from __future__ import annotations

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.gemm import GemmConfig, gemm_nt, reference_gemm_nt
from tests._kernel_helpers import n_bit_diffs

pytestmark = pytest.mark.gpu
M, K, N = 256, 512, 384
FORMATS = {
    "fp8": hd.Float8Quantizer(),
    "fp8_delayed": hd.Float8Quantizer(scaling="delayed"),
    "fp8_block": hd.Float8BlockQuantizer(block="1x128"),
    "mxfp8": hd.MXFP8Quantizer(),
    "nvfp4_rht": hd.NVFP4Quantizer(rht=True),
    "nvfp4_2d_sr": hd.NVFP4Quantizer(block_2d=True, stochastic_rounding=True),
    "bf16": hd.IdentityQuantizer(),
}
CROSS = [("mxfp8", "nvfp4_rht"), ("fp8", "bf16"), ("bf16", "mxfp8"), ("fp8", "mxfp8"), ("fp8_block", "nvfp4_rht")]


def _run(factory):
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    lin = hd.Linear(K, N, bias=False, recipe=hd.CustomRecipe(factory), device="cuda", dtype=torch.bfloat16)
    torch.manual_seed(1234)
    y = lin(x)
    y.backward(g)
    return y.detach(), x.grad, lin.weight.grad


def _same(a, b, what):
    n = n_bit_diffs(a, b, what)
    assert n == 0, f"{what}: {n} of {a.numel()} elements differ bitwise"


@pytest.mark.parametrize("name", list(FORMATS))
def test_invariant1_same_format_hybrid_is_plain(name):
    f = FORMATS[name]
    plain = _run(lambda role: f)
    hybrid = _run(lambda role: hd.HybridQuantizer(rowwise=f, columnwise=f))
    for what, a, b in zip(("y", "dx", "dW"), plain, hybrid):
        _same(a, b, f"{name}: {what}")


@pytest.mark.parametrize("pair", CROSS, ids=lambda p: f"{p[0]}->{p[1]}")
def test_invariant2_cross_format_exact_per_direction(pair):
    a, b = FORMATS[pair[0]], FORMATS[pair[1]]

    def hybrid(role):
        return b if role.tensor_type == "grad_output" else hd.HybridQuantizer(rowwise=a, columnwise=b)

    y_h, dx_h, dw_h = _run(hybrid)
    y_a = _run(lambda role: a)[0]
    _, dx_b, dw_b = _run(lambda role: b)
    _same(y_h, y_a, f"{pair}: y vs plain {pair[0]}")
    _same(dx_h, dx_b, f"{pair}: dx vs plain {pair[1]}")
    _same(dw_h, dw_b, f"{pair}: dW vs plain {pair[1]}")


@pytest.mark.parametrize("pair", CROSS, ids=lambda p: f"{p[0]}x{p[1]}")
def test_invariant3_any_pair_meets_in_one_gemm(pair):
    g = torch.Generator(device="cuda").manual_seed(5)
    dy = torch.randn(M, N, device="cuda", generator=g).bfloat16()
    w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
    qa, qb = FORMATS[pair[0]], FORMATS[pair[1]]
    sa = qa.quantize_storages(dy, rowwise=True, columnwise=False, state=qa.make_state())[0]
    sb = qb.quantize_storages(w, rowwise=False, columnwise=True, state=qb.make_state())[1]
    out = gemm_nt(sa, sb, out_dtype=torch.float32, config=GemmConfig())
    ref = reference_gemm_nt(sa, sb, out_dtype=torch.float32)
    err = float((out - ref).norm() / ref.norm())
    assert err < 1e-5, f"{pair}: CUDA GEMM vs reference rel err {err:.2e}"
