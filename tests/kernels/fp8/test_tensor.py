"""``kernels.fp8.tensor`` (per-tensor FP8: current, delayed, batched) against the reference:
on the GPU bitwise on random data; under the Triton interpreter (CPU, the slow tier) the
batched kernel against the 2D one and the compiled current-scaling path against eager.
"""

from __future__ import annotations

import pytest
import torch

from tests._helpers import run_check_under_triton_interpreter
from tests._tiers import slow

import hybrid_dist as hd
from tests._kernel_helpers import assert_storages_bitwise, kernel_quantize, reference_quantize
from tests.kernels._quantize_checks import DIRS, E4M3, E5M2, SHAPES, bits_equal, check_bitwise, make_x


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(100, 300)], ids=str)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_current_bitwise(shape, dtype, in_dtype):
    for pow2 in (False, True):
        q = hd.Float8Quantizer(dtype=dtype, power_of_2_scales=pow2)
        x = make_x(shape, dtype=in_dtype)
        for rw, cw in DIRS:
            check_bitwise(q, x, rw, cw, f"fp8 {dtype} pow2={pow2} {shape} dirs={rw, cw}")
        amax = torch.tensor(3.0, device="cuda")  # precomputed (e.g. all-reduced) amax
        check_bitwise(q, x, True, True, f"fp8 {dtype} amax= {shape}", amax=amax)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_fp8_batched_bitwise(dtype):
    """``quantize_fp8_batched`` (one amax and scale per matrix, two launches) equals the
    reference quantizer run on every matrix: data, transposed data and scale_inv."""
    from hybrid_dist.kernels.fp8.tensor import quantize_fp8_batched

    q = hd.Float8Quantizer(dtype=dtype)
    x = torch.stack([make_x((384, 640), seed=s) * f for s, f in ((0, 1.0), (1, 300.0), (2, 1e-4))])
    x[1] = 0.0  # an all-zero matrix
    row, col, scale_inv = quantize_fp8_batched(q, x)
    for b in range(x.shape[0]):
        r_row, r_col = reference_quantize(q, x[b], rowwise=True, columnwise=True)
        what = f"{dtype} matrix {b}"
        assert torch.equal(row[b].view(torch.uint8), r_row.data.view(torch.uint8)), f"{what}: rowwise bytes"
        assert torch.equal(col[b].view(torch.uint8), r_col.data.view(torch.uint8)), f"{what}: columnwise bytes"
        assert torch.equal(scale_inv[b], r_row.scale_inv.float().reshape(())), f"{what}: scale_inv"


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp8_delayed_bitwise_and_records_amax(shape):
    q = hd.Float8Quantizer(scaling="delayed")
    sk, sr = q.make_state(), q.make_state()
    sk.to("cuda"), sr.to("cuda")
    for step in range(3):
        x = make_x(shape, seed=step)
        k = kernel_quantize(q, x, rowwise=True, columnwise=True, state=sk)
        r = reference_quantize(q, x, rowwise=True, columnwise=True, state=sr)
        assert_storages_bitwise(k[0], r[0], f"delayed step {step} rowwise")
        assert_storages_bitwise(k[1], r[1], f"delayed step {step} columnwise")
        assert torch.equal(sk.amax_history, sr.amax_history), f"step {step}: amax history differs"
        q.advance_state(sk), q.advance_state(sr)
        assert torch.equal(sk.scale, sr.scale)


def _check_fp8_batched():
    """The batched per-tensor FP8 kernel (one amax and scale per matrix) against the 2D
    kernel run per matrix (same interpreter casts on both sides: bitwise) and the scales
    against the reference quantizer (fp32 arithmetic: exact here too)."""
    import hybrid_dist as hd
    from hybrid_dist.kernels.fp8 import tensor as fp8_tensor

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 72, 200, generator=gen) * torch.tensor([0.5, 4.0, 1e-3])[:, None, None]).bfloat16()
    x[1] = 0.0  # an all-zero matrix: scale 1
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = hd.Float8Quantizer(dtype=dtype)
        for columnwise in (True, False):
            row, col, scale_inv = fp8_tensor.quantize_fp8_batched(q, x, columnwise=columnwise)
            assert (col is None) != columnwise
            for b in range(x.shape[0]):
                k_row, k_col = fp8_tensor.quantize_fp8_tensor(q, x[b], rowwise=True, columnwise=True, state=None,
                                                              amax=None)
                what = f"fp8 batched {dtype} matrix {b} columnwise={columnwise}"
                bits_equal(row[b], k_row.data, f"{what} row")
                if columnwise:
                    bits_equal(col[b], k_col.data, f"{what} col")
                bits_equal(scale_inv[b], k_row.scale_inv, f"{what} scale_inv")
                r_row, _ = q._quantize_2d(x[b], rowwise=True, columnwise=False, state=None, amax=None)
                bits_equal(scale_inv[b], r_row.scale_inv.float(), f"{what} scale_inv vs reference")

def _check_fp8_batched_delayed():
    """Delayed scaling through the batched kernel: matrix b cast with state b's scale, its amax
    recorded into state b's history (running max over two calls), equal to the 2D kernel run
    per matrix on copies of the states; the stacked advance equals each state's torch advance."""
    import copy

    import hybrid_dist as hd
    from hybrid_dist.formats.float8 import advance_stacked
    from hybrid_dist.kernels.fp8 import tensor as fp8_tensor

    gen = torch.Generator().manual_seed(4)
    q = hd.Float8Quantizer(scaling="delayed", amax_history_len=4)
    states = [q.make_state() for _ in range(3)]
    for i, st in enumerate(states):
        st.scale.fill_(2.0 ** (i - 1))
        st.amax_history[1:] = torch.tensor([1.0, 5.0, 0.5]) * (i + 1)
    ref = copy.deepcopy(states)
    for step in range(2):
        x = (torch.randn(3, 72, 200, generator=gen) * torch.tensor([0.5, 4.0, 1e-3])[:, None, None]).bfloat16()
        row, col, scale_inv = fp8_tensor.quantize_fp8_batched(q, x, states=states)
        for b in range(3):
            k_row, k_col = fp8_tensor.quantize_fp8_tensor(q, x[b], rowwise=True, columnwise=True, state=ref[b],
                                                          amax=None)
            what = f"fp8 batched delayed step {step} matrix {b}"
            bits_equal(row[b], k_row.data, f"{what} row")
            bits_equal(col[b], k_col.data, f"{what} col")
            bits_equal(scale_inv[b], k_row.scale_inv, f"{what} scale_inv")
            bits_equal(states[b].amax_history, ref[b].amax_history, f"{what} history")
    advance_stacked(states, q)
    for b in range(3):
        ref[b].advance_reference(q)
        bits_equal(states[b].scale, ref[b].scale, f"stacked advance scale {b}")
        bits_equal(states[b].amax_history, ref[b].amax_history, f"stacked advance history {b}")

def _check_fp8_current_compiled():
    """The compiled current-scaling path (amax as traced torch ops, fused by inductor into the
    producer; the non-mutating cast op) is bitwise the eager kernels' (both directions and
    ``scale_inv``), with no graph break, under ``aot_eager`` and inductor."""
    from torch._dynamo.utils import counters

    from hybrid_dist.formats.float8 import Float8Quantizer
    from hybrid_dist.kernels.fp8 import tensor as fp8_tensor

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn((128, 256), generator=gen) * 3).bfloat16()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        q = Float8Quantizer(dtype=dtype)

        def quantize(x):
            y = -torch.nn.functional.silu(x.float()).bfloat16()  # a producer; its largest |y| is negative
            row, col = fp8_tensor.quantize_fp8_tensor(q, y, rowwise=True, columnwise=True, state=None, amax=None)
            return row.data, col.data, row.scale_inv

        eager = quantize(x)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            counters.clear()
            got = torch.compile(quantize, backend=backend, fullgraph=True)(x)
            assert not counters["graph_break"], dict(counters["graph_break"])
            for name, a, b in zip(("row", "col", "scale_inv"), got, eager):
                bits_equal(a, b, f"compiled ({backend}) fp8 current {dtype} {name}")


def _check_fp8_batched_compiled():
    """Current scaling through the batched kernel compiled with ``aot_eager`` and inductor:
    the operator ``hybrid_dist::fp8_batched_current`` runs the eager kernels once per call
    (rows, columns, ``scale_inv``, an all-zero matrix's scale 1 included) and gives eager's
    bytes; an empty batch's ``scale_inv`` is 1. Delayed scaling refuses to trace."""
    from hybrid_dist.formats.float8 import Float8Quantizer
    from hybrid_dist.kernels.fp8 import tensor as fp8_tensor

    calls = [0]
    real = fp8_tensor._batched_current

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    fp8_tensor._batched_current = counted
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 40, 72, generator=gen) * torch.tensor([0.5, 4.0, 1e-3])[:, None, None]).bfloat16()
    x[1] = 0.0
    for dtype, columnwise in ((torch.float8_e4m3fn, True), (torch.float8_e5m2, False)):
        q = Float8Quantizer(dtype=dtype)
        eager = fp8_tensor.quantize_fp8_batched(q, x, columnwise=columnwise)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            before = calls[0]
            got = torch.compile(lambda x: fp8_tensor.quantize_fp8_batched(q, x, columnwise=columnwise),
                                backend=backend, fullgraph=True)(x)
            assert calls[0] - before == 1, f"{backend}: the batched kernels ran {calls[0] - before} times"
            for name, a, b in zip(("row", "col", "scale_inv"), got, eager):
                assert (a is None) == (b is None), name
                if a is not None:
                    bits_equal(a, b, f"compiled ({backend}) batched {dtype} {name}")
    q = Float8Quantizer()
    empty = torch.zeros(2, 0, 72, dtype=torch.bfloat16)
    _, _, scale_inv = torch.compile(lambda x: fp8_tensor.quantize_fp8_batched(q, x), backend="aot_eager",
                                    fullgraph=True)(empty)
    assert scale_inv.tolist() == [1.0, 1.0], scale_inv
    qd = Float8Quantizer(scaling="delayed")
    try:
        torch.compile(lambda x: fp8_tensor.quantize_fp8_batched(qd, x, states=[qd.make_state() for _ in range(3)]),
                      backend="aot_eager", fullgraph=True)(x)
    except Exception as e:  # Dynamo wraps the ValueError
        assert "not traceable" in str(e), e
    else:
        raise AssertionError("delayed scaling traced through the batched kernel")


CHECKS = ('fp8_current_compiled', 'fp8_batched', 'fp8_batched_delayed')


def test_fp8_batched_compiled_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.fp8.test_tensor", "fp8_batched_compiled", timeout=600)


@slow  # minutes of interpreted kernels on two cores: the slow tier
@pytest.mark.parametrize("check", CHECKS)
def test_fp8_tensor_under_triton_interpreter(check):
    run_check_under_triton_interpreter("tests.kernels.fp8.test_tensor", check)


def test_eager_quantize_launches_through_the_module_launch(monkeypatch):
    """The eager current-scaling path launches both of its kernels (amax, then cast-transpose)
    through ``kernels.fp8.tensor.launch`` as looked up at the call, so replacing it (what
    ``benchmarks.host_costs`` does to time a step without launches) reaches every launch.
    CPU: the recorder launches nothing, so the outputs are never read."""
    from hybrid_dist.kernels.fp8 import tensor as fp8_tensor

    seen = []
    monkeypatch.setattr(fp8_tensor, "launch", lambda kernel, grid, *args, **consts: seen.append(kernel))
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    row, col = fp8_tensor.quantize_fp8_tensor(hd.Float8Quantizer(), x, rowwise=True, columnwise=True, state=None,
                                              amax=None)
    assert seen == [fp8_tensor._amax_kernel, fp8_tensor._cast_transpose_kernel], seen
    assert (tuple(row.data.shape), tuple(col.data.shape)) == ((64, 128), (128, 64))
