"""The one-kernel delayed-scaling ``advance`` equals the torch reference bitwise, eagerly on
the GPU and as the operator compiled graphs call (CPU, Triton interpreter)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybrid_dist.formats.float8 import DelayedScalingState, Float8Quantizer
from tests._helpers import assert_bitwise_equal, run_check_under_triton_interpreter


def _histories(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    rand = torch.rand(n, generator=g) * 10.0 ** torch.randint(-30, 30, (n,), generator=g).float()
    out = {"random": rand, "zeros": torch.zeros(n), "tiny": torch.full((n,), 1e-40)}
    nan, inf = rand.clone(), rand.clone()
    nan[n // 2] = float("nan")
    inf[-1] = float("inf")
    out.update(nan=nan, inf=inf)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16, 1024])
def test_advance_kernel_bitwise_reference(n):
    quantizers = [Float8Quantizer(scaling="delayed", amax_history_len=n, dtype=dt, margin=m, amax_epsilon=eps,
                                  power_of_2_scales=p2, amax_compute=ac)
                  for dt, m, eps, p2, ac in itertools.product(
                      (torch.float8_e4m3fn, torch.float8_e5m2), (0, 2), (0.0, 1e-3), (False, True),
                      ("max", "most_recent"))]
    for q, (kind, hist) in itertools.product(quantizers, _histories(n).items()):
        kernel, ref = DelayedScalingState(n, "cuda"), DelayedScalingState(n, "cuda")
        for st in (kernel, ref):
            st.amax_history.copy_(hist)
            st.scale.fill_(0.75)
        for _ in range(3):  # several steps: the rolled history feeds the next scale
            kernel.advance(q)
            ref.advance_reference(q)
            what = f"{kind} history, n={n}, {q}"
            assert_bitwise_equal(kernel.scale, ref.scale, f"scale {what}")
            assert_bitwise_equal(kernel.amax_history, ref.amax_history, f"history {what}")


@pytest.mark.gpu
def test_stacked_advance_bitwise_each_state():
    """``advance_stacked``: one launch over E states stacked as [E, L] / [E] (the states'
    tensors become rows of the stack) equals each state's torch advance."""
    from hybrid_dist.formats.float8 import advance_stacked

    n = 16
    q = Float8Quantizer(scaling="delayed", amax_history_len=n, margin=1)
    hists = list(_histories(n).values())
    states, refs = [DelayedScalingState(n, "cuda") for _ in hists], [DelayedScalingState(n, "cuda") for _ in hists]
    for i, h in enumerate(hists):
        for st in (states[i], refs[i]):
            st.amax_history.copy_(h)
            st.scale.fill_(0.5 + i)
    for step in range(3):
        advance_stacked(states, q)
        for i, (st, ref) in enumerate(zip(states, refs)):
            ref.advance_reference(q)
            assert_bitwise_equal(st.scale, ref.scale, f"step {step} state {i} scale")
            assert_bitwise_equal(st.amax_history, ref.amax_history, f"step {step} state {i} history")
    assert states[1].amax_history._base is states[0].amax_history._base, "the states should share one stack"


def _check_compiled_advance():
    """(Under ``TRITON_INTERPRET=1``.) ``advance_`` compiled with ``aot_eager`` and inductor,
    for one state ``[L]``, a stack ``[E, L]`` and each row of a stack, three steps: the kernel
    runs once per call (the ``hybrid_dist::fp8_delayed_advance`` operator) and scale and
    history are bitwise the torch reference's (correctly rounded divisions, as the GPU
    kernel's ``div_rn``; inductor's own division is approximate)."""
    from hybrid_dist.kernels.fp8 import delayed

    calls = [0]
    real = delayed._advance

    def counted(*args):
        calls[0] += 1
        return real(*args)

    delayed._advance = counted
    n = 16
    q = Float8Quantizer(scaling="delayed", amax_history_len=n, margin=1, amax_epsilon=1e-3)
    hists = torch.stack(list(_histories(n).values()))
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        fn = torch.compile(lambda h, s: delayed.advance_(h, s, q), backend=backend, fullgraph=True)
        # one state [L]; a stack [E, L] in one call; each row of a stack, a view, in its own call
        # (``advance_stacked`` while compiling: the states' tensors are rows of a stack)
        rows_fn = torch.compile(lambda h, s: [delayed.advance_(h[i], s[i], q) for i in range(h.shape[0])],
                                backend=backend, fullgraph=True)
        for stacked, call, per_call in ((False, fn, 1), (True, fn, 1), (True, rows_fn, hists.shape[0])):
            rows = range(hists.shape[0]) if stacked else range(1)
            hist = hists.clone() if stacked else hists[0].clone()
            scale = torch.full((len(rows),) if stacked else (), 0.75)
            refs = [DelayedScalingState(n) for _ in rows]
            for i, ref in zip(rows, refs):
                ref.amax_history.copy_(hists[i])
                ref.scale.fill_(0.75)
            before = calls[0]
            for step in range(3):
                call(hist, scale)
                for i, ref in zip(rows, refs):
                    ref.advance_reference(q)
                    what = f"{backend} stacked={stacked} step {step} state {i}"
                    assert_bitwise_equal(scale[i] if stacked else scale, ref.scale, f"scale, {what}")
                    assert_bitwise_equal(hist[i] if stacked else hist, ref.amax_history, f"history, {what}")
            assert calls[0] - before == 3 * per_call, f"{backend}: the kernel ran {calls[0] - before} times"


def test_compiled_advance_is_the_kernel_and_bitwise():
    run_check_under_triton_interpreter("tests.kernels.fp8.test_delayed", "compiled_advance", timeout=600)
