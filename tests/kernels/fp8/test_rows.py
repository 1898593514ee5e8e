"""``kernels/fp8/rows`` (per-expert FP8 cast into the packed layout) under the Triton
interpreter on CPU: bitwise the torch form of ``split_quantize_packed`` (and, unpadded, of
the expert-parallel sender's row cast), and the per-expert
amax (``expert_amax``: tiles spanning several experts, an empty expert) equal to a loop of
``max |x|`` per expert.

``TRITON_INTERPRET=1`` must be set before the kernel is defined, so the check runs in a
subprocess. The interpreter's fp32 → fp8 cast does not round like the GPU's (ties), so
the inputs make every cast exact: values ``±1.mm · 2^e`` times power-of-two per-expert
scales, plus saturating values (clamped to the fp8 max, exact). The GPU comparison on
random data is ``test_device_split``'s CUDA case (bitwise the reference).
"""

from __future__ import annotations

import torch

from tests._helpers import run_check_under_triton_interpreter, run_under_triton_interpreter
from tests._tiers import slow

SPLITS = [37, 0, 90, 22, 1]


def _inputs(gen):
    t, k = sum(SPLITS), 96  # K not a multiple of the 128-column tile, T (and C) not of the 64-row tile
    mant = 1.0 + torch.randint(0, 4, (t, k), generator=gen).float() / 4
    sign = torch.randint(0, 2, (t, k), generator=gen).float() * 2 - 1
    e = torch.randint(-4, 4, (t, k), generator=gen).float()
    x = sign * mant * torch.exp2(e)
    x[5, :7] = 1e4  # saturates for every scale below
    x[100] = 0.0
    scale_e = torch.exp2(torch.tensor([2.0, 0.0, -1.0, 3.0, 1.0]))  # per expert, powers of two
    return x.bfloat16(), scale_e


def _check():
    from hybrid_dist.formats.numerics import cast_to_fp8
    from hybrid_dist.kernels.fp8.rows import expert_amax, fp8_rows
    from hybrid_dist.moe.device_split import _Layout
    from tests._helpers import assert_bitwise_equal

    gen = torch.Generator().manual_seed(0)
    x, scale_e = _inputs(gen)
    lay = _Layout(x, torch.tensor(SPLITS), 16)
    ends = torch.tensor(SPLITS).cumsum(0).tolist()
    want_amax = torch.stack([x[s:e].float().abs().amax() if e > s else torch.tensor(0.0)
                             for s, e in zip([0] + ends[:-1], ends)])
    assert_bitwise_equal(expert_amax(x, lay.eid, len(SPLITS)), want_amax, "expert_amax")
    scale_rows = torch.cat([scale_e, torch.ones(1)])[lay.row_expert]
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        want = cast_to_fp8(lay.x_pad * scale_rows[:, None], dtype)
        for rowwise, columnwise in ((True, True), (True, False), (False, True)):
            row, col = fp8_rows(x, scale_e, lay.row_expert, lay.off, lay.poff, dtype, rowwise=rowwise,
                                columnwise=columnwise)
            what = f"{dtype} rowwise={rowwise} columnwise={columnwise}"
            assert (row is None) != rowwise and (col is None) != columnwise, what
            if rowwise:
                assert_bitwise_equal(row, want, f"{what} row")
            if columnwise:
                assert_bitwise_equal(col, want.t().contiguous(), f"{what} col")
        # unpadded (padded offsets = offsets, row_expert = each row's expert): the expert-
        # parallel sender's call (device_split.fp8_rows_by_expert)
        row, _ = fp8_rows(x, scale_e, lay.eid, lay.off, lay.off, dtype, rowwise=True, columnwise=False)
        assert_bitwise_equal(row, cast_to_fp8(x * scale_e[lay.eid][:, None], dtype), f"{dtype} unpadded row")
    # codes already quantized (the expert-parallel receiver): placed, zero padding, transposed
    from hybrid_dist.kernels.fp8.rows import place_codes

    codes = cast_to_fp8(x * scale_e[lay.eid][:, None], torch.float8_e4m3fn)
    code_bytes = codes.view(torch.uint8)
    want_row = code_bytes.new_zeros(lay.cap, codes.shape[1]).index_copy_(0, lay.dest, code_bytes)
    for columnwise in (True, False):
        row, col = place_codes(codes, lay.row_expert, lay.off, lay.poff, columnwise=columnwise)
        assert_bitwise_equal(row, want_row, f"place_codes row (columnwise={columnwise})")
        assert (col is None) != columnwise
        if columnwise:
            assert_bitwise_equal(col, want_row.t().contiguous(), "place_codes col")
    src = torch.randperm(codes.shape[0], generator=gen)  # token t read from row src[t] (the receiver's regroup)
    want_src = code_bytes.new_zeros(lay.cap, codes.shape[1]).index_copy_(0, lay.dest, code_bytes[src])
    row, col = place_codes(codes, lay.row_expert, lay.off, lay.poff, columnwise=True, src=src)
    assert_bitwise_equal(row, want_src, "place_codes row through src")
    assert_bitwise_equal(col, want_src.t().contiguous(), "place_codes col through src")
    print("fp8_rows interpreter checks passed")


def _check_compiled():
    """(Under ``TRITON_INTERPRET=1``.) ``expert_amax`` and ``fp8_rows`` compiled with
    ``aot_eager`` and inductor run their kernels once per call (the operators
    ``hybrid_dist::fp8_expert_amax`` / ``fp8_packed_rows``) and give eager's bytes, for each
    direction set."""
    from hybrid_dist.kernels.fp8 import rows
    from hybrid_dist.moe.device_split import _Layout
    from tests._helpers import assert_bitwise_equal

    calls = {"amax": 0, "rows": 0}
    real_amax, real_rows = rows._expert_amax, rows._fp8_rows

    def amax(*args, **kwargs):
        calls["amax"] += 1
        return real_amax(*args, **kwargs)

    def fp8(*args):
        calls["rows"] += 1
        return real_rows(*args)

    rows._expert_amax, rows._fp8_rows = amax, fp8
    x, scale_e = _inputs(torch.Generator().manual_seed(1))
    lay = _Layout(x, torch.tensor(SPLITS), 16)
    args = (lay.row_expert, lay.off, lay.poff, torch.float8_e4m3fn)
    for rowwise, columnwise in ((True, True), (False, True), (True, False)):
        def split(x, scale):
            a = rows.expert_amax(x, lay.eid, len(SPLITS))
            return (a, *rows.fp8_rows(x, scale, *args, rowwise=rowwise, columnwise=columnwise))

        eager = split(x, scale_e)
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            before = dict(calls)
            got = torch.compile(split, backend=backend, fullgraph=True)(x, scale_e)
            assert calls == {k: v + 1 for k, v in before.items()}, (backend, before, calls)
            for name, a, b in zip(("amax", "row", "col"), got, eager):
                assert (a is None) == (b is None), name
                if a is not None:
                    assert_bitwise_equal(a, b, f"compiled ({backend}) {name}, rowwise={rowwise} "
                                               f"columnwise={columnwise}")


def test_compiled_rows_under_triton_interpreter():
    run_check_under_triton_interpreter("tests.kernels.fp8.test_rows", "compiled", timeout=600)


@slow  # minutes of interpreted kernels on two cores: the slow tier
def test_fp8_rows_under_triton_interpreter():
    run_under_triton_interpreter("from tests.kernels.fp8.test_rows import _check; _check()",
                                 done="fp8_rows interpreter checks passed")
