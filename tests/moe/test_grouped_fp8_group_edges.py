"""``kernels/fp8/grouped_gemm`` (grouped FP8 GEMMs, any E4M3/E5M2 pair) under the Triton
interpreter on CPU against a float64 reference, one 64×64×32 tile config (module doc of
the kernel file): uneven groups whose boundaries (multiples of 16) split tiles, an empty
group (first, middle or last), Kc and R not multiples of the tile, padding rows past
``offs[-1]``, every dtype pair, ``fast_accum`` on and off; the rows GEMM's token-order
output (padding rows skipped) equals the padded output's token rows.

Tolerance: the FP8 inputs are exact in every wider format, so the products are exact and
the kernel differs from the float64 reference only by its fp32 accumulation (at most
``Kc · 2^-24 · Σ|terms|``, ``Σ|terms|`` the same product of absolute values, scaled) and
one cast to bf16. The interpreter's fp32 → bf16 cast truncates (the GPU's rounds to
nearest even), an error below one bf16 ulp, ``2^-7 · |value|``. Bound:
``|out - ref| <= 2^-7 · |ref| + 2^-16 · Σ|terms|``. A wrong group, row, scale or mask is
off by O(|ref|).

``TRITON_INTERPRET=1`` must be set before the kernels are defined: a subprocess. The GPU
checks at realistic sizes are ``tests/moe/test_grouped_fp8_expert_shapes.py``.
"""

from __future__ import annotations

import torch

from tests._helpers import run_under_triton_interpreter
from tests._tiers import slow

pytestmark = slow  # minutes of interpreted kernels on two cores: the slow tier

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = [(E5M2, E4M3), (E4M3, E4M3), (E4M3, E5M2), (E5M2, E5M2)]
# per-group padded sizes (multiples of 16): empty groups first, middle, last; C > offs[-1]
# for the rows GEMM; the tokens GEMM's group 0 is empty (its scale is inf), its groups end
# inside a contraction box (the box's next columns are the next group's), one fills C with
# a last box past C
GROUPS = [[48, 0, 80, 16], [0, 16, 112, 0], [144]]
TOKEN_GROUPS = [[0, 48, 0, 80, 16], [0, 16, 112, 0], [0, 48, 112]]
C, KC, R = 160, 80, 80  # the interpreter tile is 64x64x32: none divides these
RBS = (72, 76)  # the wgrad's second output dim: stored by TMA (a multiple of 8), by pointers (not)


def _fp8(shape, dtype, gen):
    return (torch.randn(shape, generator=gen) * 4).to(dtype)


def _offs(sizes):
    return torch.tensor(sizes).cumsum(0).to(torch.int32)


def _bound_check(out, ref, abs_sum, what):
    if ref.numel() == 0:
        return
    err = (out.double() - ref).abs()
    bound = 2.0**-7 * ref.abs() + 2.0**-16 * abs_sum
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: error exceeds the bound by {worst:.3g} (max err {err.max().item():.3g})"


def _check_rows(gen, pair, sizes, fast):
    from hybrid_dist.kernels.fp8.grouped_gemm import grouped_rows_fp8

    e, offs = len(sizes), _offs(sizes)
    a, b = _fp8((C, KC), pair[0], gen), _fp8((e, R, KC), pair[1], gen)
    sa, sb = torch.rand(e, generator=gen) + 0.25, torch.rand(e, generator=gen) * 2**-6
    out = grouped_rows_fp8(a, b, sa, sb, offs, fast_accum=fast)
    assert out.shape == (C, R) and out.dtype == torch.bfloat16
    ends = offs.tolist()
    for g, (s, end) in enumerate(zip([0] + ends[:-1], ends)):
        ag, bg, sc = a[s:end].double(), b[g].double(), float(sa[g]) * float(sb[g])
        what = f"rows {pair} groups={sizes} fast={fast} group {g}"
        _bound_check(out[s:end], ag @ bg.T * sc, ag.abs() @ bg.abs().T * sc, what)
    # token order: group g's first counts[g] rows are tokens, the rest padding (not written)
    counts = [max(0, n - 5 - 3 * g) for g, n in enumerate(sizes)]
    tok = grouped_rows_fp8(a, b, sa, sb, offs, fast_accum=fast, tokens=(_offs(counts), sum(counts)))
    assert tok.shape == (sum(counts), R), f"rows {pair} groups={sizes}: token output {tuple(tok.shape)}"
    want = torch.cat([out[s:s + n] for s, n in zip([0] + ends[:-1], counts)])
    assert torch.equal(tok, want), f"rows {pair} groups={sizes} counts={counts} fast={fast}: token order differs"


def _check_tokens(gen, pair, sizes, fast, rb):
    from hybrid_dist.kernels.fp8.grouped_gemm import grouped_tokens_fp8

    e, offs = len(sizes), _offs(sizes)
    a, b = _fp8((R, C), pair[0], gen), _fp8((rb, C), pair[1], gen)
    sa, sb = torch.rand(e, generator=gen) + 0.25, torch.rand(e, generator=gen) * 2**-6
    sa[0] = float("inf")  # an empty group stays zero whatever its scale
    out = grouped_tokens_fp8(a, b, sa, sb, offs, fast_accum=fast)
    assert out.shape == (e, R, rb) and out.dtype == torch.bfloat16
    ends = offs.tolist()
    for g, (s, end) in enumerate(zip([0] + ends[:-1], ends)):
        what = f"tokens {pair} groups={sizes} fast={fast} Rb={rb} group {g}"
        if s == end:
            assert torch.count_nonzero(out[g]) == 0, f"{what}: empty group not zero"
            continue
        ag, bg, sc = a[:, s:end].double(), b[:, s:end].double(), float(sa[g]) * float(sb[g])
        _bound_check(out[g], ag @ bg.T * sc, ag.abs() @ bg.abs().T * sc, what)


def _check():
    gen = torch.Generator().manual_seed(0)
    for i, pair in enumerate(PAIRS):
        for sizes, token_sizes in zip(GROUPS, TOKEN_GROUPS):
            _check_rows(gen, pair, sizes, fast=i % 2 == 0)
            _check_tokens(gen, pair, token_sizes, fast=i % 2 == 1, rb=RBS[i % 2])
    print("grouped fp8 interpreter checks passed")



def _calls(fns):
    """Context manager counting Python calls of ``fns`` (a profile hook; nothing replaced)."""
    import contextlib
    import sys

    codes = {f.__code__: f.__name__ for f in fns}
    counts = dict.fromkeys(codes.values(), 0)

    def hook(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    @contextlib.contextmanager
    def ctx():
        prev = sys.getprofile()
        sys.setprofile(hook)
        try:
            yield counts
        finally:
            sys.setprofile(prev)

    return ctx()


def _check_grouped_linear():
    """``GroupedLinear``'s sync-free path on CPU under the interpreter, where its dgrad and
    wgrad (E5M2 gradients) take the kernels, against the reference GroupedLinear with the
    bar of ``test_grouped_quantized`` (the kernels skip the bf16 rounding of the scaled
    operand of that path's bf16 fold, so they meet its floor or better)."""
    import hybrid_dist as hd
    from hybrid_dist.kernels.fp8.grouped_gemm import grouped_rows_fp8, grouped_tokens_fp8
    from tests._helpers import sqnr_db
    from tests.moe.test_grouped_quantized import FLOOR_DB, run_paths

    for name in ("fp8_current", "fp8_delayed"):
        for quantized_init in (False, True):
            with _calls([grouped_rows_fp8, grouped_tokens_fp8]) as counts:
                for what, got, ref, _ in run_paths(hd.recipe_from_name(name), quantized_init=quantized_init):
                    assert got.dtype == ref.dtype and got.shape == ref.shape, what
                    db = sqnr_db(ref.float(), got.float())
                    assert db > FLOOR_DB, f"{what}: kernels vs reference {db:.1f} dB <= {FLOOR_DB}"
            # per step: dgrad on grouped_rows_fp8, wgrad on grouped_tokens_fp8 (fprop is E4M3 x E4M3)
            assert counts == {"grouped_rows_fp8": 2, "grouped_tokens_fp8": 2}, f"{name}: kernel calls {counts}"
    print("grouped linear interpreter checks passed")


def test_grouped_fp8_under_triton_interpreter():
    run_under_triton_interpreter("from tests.moe.test_grouped_fp8_group_edges import _check; _check()",
                                 done="grouped fp8 interpreter checks passed")


def test_grouped_linear_on_grouped_fp8_under_triton_interpreter():
    run_under_triton_interpreter(
        "from tests.moe.test_grouped_fp8_group_edges import _check_grouped_linear; _check_grouped_linear()",
        done="grouped linear interpreter checks passed")
