"""``kernels.stats`` against the torch statistics (``inspection.stats``). ``stats_head``: amax
and the three counts bitwise, norms within 1e-5 relative, for every storage kind and both
directions, on tensors with zeros, values that flush to zero and values that saturate
(delayed scaling's stale scale). ``scale_histogram``: bitwise the torch histogram, with
zero, NaN, negative, subnormal and clamped scales. On CPU under the Triton interpreter; on
CUDA at a larger shape (the storages from the CUDA quantize kernels)."""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_dist.formats import (
    Float8BlockQuantizer, Float8Quantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer,
)
from hybrid_dist.inspection.stats import FIELDS, _torch_head, quantizer_domain
from tests._helpers import run_check_under_triton_interpreter

QUANTIZERS = {
    "identity": IdentityQuantizer(),
    "fp8_e4m3": Float8Quantizer(),
    "fp8_e5m2": Float8Quantizer(dtype=torch.float8_e5m2),
    "fp8_block_1x128": Float8BlockQuantizer(block="1x128"),
    "fp8_block_128x128": Float8BlockQuantizer(block="128x128"),
    "mxfp8": MXFP8Quantizer(),
    "nvfp4": NVFP4Quantizer(),
    "nvfp4_2d": NVFP4Quantizer(block_2d=True),
    "nvfp4_rht": NVFP4Quantizer(rht=True),
}
EXACT = [FIELDS.index(f) for f in ("amax", "nonzero", "underflow", "saturated")]
NORMS = [FIELDS.index(f) for f in ("signal_norm", "noise_norm")]


def _input(m: int, k: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g) * torch.logspace(-30, 1, m)[:, None]  # rows that flush to zero
    x[:, ::7] = 0  # exact zeros
    x[1, 3] = 1e4  # one outlier: every other value of its blocks is small
    return x.bfloat16().to(device)


def _storages(name: str, x: torch.Tensor):
    q = QUANTIZERS[name]
    out = list(zip(("rowwise", "columnwise"), q.quantize_storages(x, rowwise=True, columnwise=True)))
    if name.startswith("fp8_e"):  # a stale delayed scale: 4x too large, so values saturate
        row = out[0][1]
        out.append(("rowwise saturating", type(row)(data=row.data, scale_inv=row.scale_inv / 4, transposed=False)))
    return out


def _compare(x: torch.Tensor, name: str) -> None:
    from hybrid_dist.kernels.stats import stats_head

    for direction, st in _storages(name, x):
        dom = quantizer_domain(x, st) if getattr(st, "rht_seed", None) is not None else (x.t() if st.transposed else x)
        got, ref = stats_head(dom, st).cpu(), _torch_head(x, st).cpu()
        what = f"{name} {direction}"
        assert torch.equal(got[EXACT], ref[EXACT]), f"{what}: {got[EXACT].tolist()} != {ref[EXACT].tolist()}"
        for i in NORMS:
            assert math.isclose(got[i], ref[i], rel_tol=1e-5), f"{what} {FIELDS[i]}: {got[i]} vs {ref[i]}"
        assert ref[FIELDS.index("nonzero")] > 0 and ref[FIELDS.index("underflow")] >= (name != "identity")
        if direction.endswith("saturating"):
            assert ref[FIELDS.index("saturated")] > 0, what


def _check_stats_kernel():
    x = _input(128, 256, "cpu")
    for name in QUANTIZERS:
        _compare(x, name)


def test_stats_kernel_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.test_stats", "stats_kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 4096), (384, 2048)], ids=str)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_stats_kernel_cuda(name, shape):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _compare(_input(*shape, "cuda"), name)


def _check_histogram(device: str = "cpu"):
    from hybrid_dist.inspection.stats import HIST_BINS, HIST_LO, _scale_histogram
    from hybrid_dist.kernels.stats import scale_histogram

    g = torch.Generator().manual_seed(5)
    s = torch.exp2(torch.randint(-90, 90, (5000,), generator=g).float()) * (1 + torch.rand(5000, generator=g))
    s[:7] = 0.0
    s[7:9] = torch.tensor([1e-40, float("nan")])  # subnormal (lowest bin), NaN (bin 0)
    s[9] = -3.0
    st = Float8BlockQuantizer(block="1x128").quantize_storages(torch.ones(5000, 128), rowwise=True,
                                                                columnwise=False)[0]
    st = type(st)(data=st.data, scale_inv=s.reshape(5000, 1), block_rows=1, transposed=False)
    ref = _scale_histogram(st, "cpu")  # the torch path (frexp, scatter_add)
    got = scale_histogram(s.to(device), HIST_LO, HIST_BINS).cpu()
    assert torch.equal(got, ref), (got - ref).nonzero().tolist()
    assert int(ref.sum()) == 5000 and ref[0] > 10 and ref[-1] > 10


def test_scale_histogram_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.test_stats", "histogram")


@pytest.mark.gpu
def test_scale_histogram_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_histogram("cuda")
