"""``quant_stats`` with its head fields from the fused kernel (``kernels.stats``) against the
torch ops (``fused=False``, the reference), whole vectors: amax, the three counts, numel,
sharded and the block-scale histogram bitwise, the norms within 1e-5 relative (fp32 tree
sums per tile against torch's reduction order). Every storage kind and both directions, on
tensors with zeros, values that flush to zero and values that saturate (delayed scaling's
stale scale); without a reference (``x2d=None``: NaN fields in the same places); a NaN in
the reference (amax NaN); and a shape whose tiles are ragged in both dims. On CPU under the
Triton interpreter; on CUDA at larger shapes (the storages from the CUDA quantize kernels).
``scale_histogram``: bitwise the torch histogram, with zero, NaN, negative, subnormal and
clamped scales.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybrid_dist.formats import (
    Float8BlockQuantizer, Float8Quantizer, IdentityQuantizer, MXFP8Quantizer, NVFP4Quantizer,
)
from hybrid_dist.inspection.candidates import fits
from hybrid_dist.inspection.stats import FIELDS, quant_stats
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
NORMS = [FIELDS.index(f) for f in ("signal_norm", "noise_norm")]
EXACT = [i for i in range(len(FIELDS)) if i not in NORMS]  # and the histogram after FIELDS
NO_REF = [FIELDS.index(f) for f in ("noise_norm", "underflow", "saturated")]


def _input(m: int, k: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g) * torch.logspace(-30, 1, m)[:, None]  # rows that flush to zero
    x[:, ::7] = 0  # exact zeros
    x[1, 3] = 1e4  # one outlier: every other value of its blocks is small
    return x.bfloat16().to(device)


def _storages(name: str, x: torch.Tensor):
    """``(direction, storage)`` of every direction of ``x`` that fits the format's blocks."""
    q = QUANTIZERS[name]
    out = []
    for direction in ("rowwise", "columnwise"):
        if fits(q, *x.shape, direction):
            row, col = q.quantize_storages(x, rowwise=direction == "rowwise", columnwise=direction == "columnwise")
            out.append((direction, row if row is not None else col))
    if name.startswith("fp8_e") and out:  # a stale delayed scale: 4x too large, so values saturate
        row = out[0][1]
        out.append(("rowwise saturating", type(row)(data=row.data, scale_inv=row.scale_inv / 4, transposed=False)))
    return out


def _assert_same(got: torch.Tensor, ref: torch.Tensor, what: str, norm_tol: float = 1e-5) -> None:
    """``got`` equals ``ref`` bitwise but for the norms (``norm_tol`` relative); NaN where
    ``ref`` is."""
    got, ref = got.cpu(), ref.cpu()
    assert torch.equal(got.isnan(), ref.isnan()), f"{what}: NaN at {got.isnan().tolist()} vs {ref.isnan().tolist()}"
    exact = EXACT + list(range(len(FIELDS), got.numel()))
    g, r = got[exact].nan_to_num(), ref[exact].nan_to_num()
    bad = [FIELDS[i] if i < len(FIELDS) else f"hist[{i - len(FIELDS)}]" for i, a, b in zip(exact, g, r) if a != b]
    assert not bad, f"{what}: {bad} differ: {got[exact].tolist()} != {ref[exact].tolist()}"
    for i in NORMS:
        if not math.isnan(ref[i]):
            assert math.isclose(got[i], ref[i], rel_tol=norm_tol), f"{what} {FIELDS[i]}: {got[i]} vs {ref[i]}"


def _compare(x: torch.Tensor, name: str, *, no_ref: bool = True) -> None:
    for direction, st in _storages(name, x):
        what = f"{name} {direction} {tuple(x.shape)}"
        ref = quant_stats(x, st, sharded=True, fused=False)
        _assert_same(quant_stats(x, st, sharded=True, fused=True), ref, what)
        f = dict(zip(FIELDS, ref.tolist()))
        assert f["nonzero"] > 0 and f["underflow"] >= (name != "identity") and f["sharded"] == 1, what
        if direction.endswith("saturating"):
            assert f["saturated"] > 0, what
        if no_ref:
            ref = quant_stats(None, st, fused=False)
            assert ref[NO_REF].isnan().sum() == (2 if name == "identity" else 3), what
            _assert_same(quant_stats(None, st, fused=True), ref, f"{what} without a reference")


def _compare_nan_amax(x: torch.Tensor) -> None:
    """A NaN in the reference: amax is NaN (``tl.max`` alone would drop it), the counts stay."""
    for name in ("identity", "mxfp8"):
        for direction, st in _storages(name, x):
            bad = x.clone()
            bad[5, 9] = math.nan
            ref = quant_stats(bad, st, fused=False)
            assert math.isnan(ref[FIELDS.index("amax")]), name
            _assert_same(quant_stats(bad, st, fused=True), ref, f"{name} {direction} with a NaN")


def _check_stats_kernel():
    x = _input(128, 256, "cpu")
    for name in QUANTIZERS:
        _compare(x, name)
    _compare_nan_amax(x)


def _check_stats_kernel_ragged():
    x = _input(208, 384, "cpu")  # 208 = 6.5 row tiles; columnwise, 1.6 column tiles
    for name in QUANTIZERS:
        _compare(x, name, no_ref=False)


def test_stats_kernel_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.test_stats", "stats_kernel")


def test_stats_kernel_ragged_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.test_stats", "stats_kernel_ragged")


def test_quant_stats_refuses_a_wrong_orientation():
    """``stats_head`` takes ``x`` in the stored orientation (host check, no launch)."""
    pytest.importorskip("triton")
    from hybrid_dist.kernels.stats import stats_head

    x = _input(128, 256, "cpu")
    _, col = QUANTIZERS["mxfp8"].quantize_storages(x, rowwise=False, columnwise=True)
    with pytest.raises(ValueError, match=r"stored \[256, 128\]"):
        stats_head(x, col)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 4096), (384, 2048), (208, 384)], ids=str)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_stats_kernel_cuda(name, shape):
    x = _input(*shape, "cuda")
    _compare(x, name)
    # the default on CUDA is the kernel; the CPU torch code gives the same vector (not for
    # RHT: x·T is a matmul, whose rounding differs between the devices)
    for direction, st in _storages(name, x) if name != "nvfp4_rht" else ():
        cpu = st.map_tensors(lambda t: t.cpu())
        # the CPU's fp32 norm of 4M elements is off by up to ~4e-5 (the kernel sums tiles in fp64)
        _assert_same(quant_stats(x, st), quant_stats(x.cpu(), cpu), f"{name} {direction} cuda vs cpu", norm_tol=2e-4)


@pytest.mark.gpu
def test_stats_kernel_cuda_nan_amax():
    _compare_nan_amax(_input(1024, 4096, "cuda"))


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
