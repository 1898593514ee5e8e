"""Direct Triton launches (``kernels._launch``) and zeroed amax slots (``kernels._zeros``).

A direct launch must run the kernel Triton would have chosen: calls that Triton specializes
differently (16-byte aligned or not, an int equal to 1, a multiple of 16 or not) must not
share a cached kernel, each cached kernel must be the very one ``kernel[grid]`` returns for
that call, and every output must be bitwise that of ``kernel[grid]``. A zeroed
slot must never be handed out twice, and a CUDA graph must not replay one.
"""

from __future__ import annotations

import pytest
import torch

knobs = pytest.importorskip("triton").knobs  # the kernel modules import Triton (absent on CPU-only installs)

from hybrid_dist.formats import Float8Quantizer  # noqa: E402
from hybrid_dist.kernels import _launch, _zeros  # noqa: E402
from hybrid_dist.kernels.fp8 import tensor as fp8_tensor  # noqa: E402
from hybrid_dist.kernels._jit_common import cdiv  # noqa: E402
from tests._kernel_helpers import kernel_quantize, n_bit_diffs  # noqa: E402

pytestmark = pytest.mark.gpu


def _cast_args(x, amax, rowwise=True, columnwise=True):
    m, k = x.shape
    e4m3 = torch.float8_e4m3fn
    row = torch.empty((m, k) if rowwise else (0, 0), dtype=e4m3, device=x.device)
    col = torch.empty((k, m) if columnwise else (0, 0), dtype=e4m3, device=x.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x.device)
    grid = (max(cdiv(m, 64), 1), max(cdiv(k, 128), 1))
    args = (x, amax, amax, scale_inv, row, col, amax, m, k, max(x.stride(0), 1), 0, 0)
    consts = dict(FMAX=448.0, EPS=0.0, POW2=False, SCALE_FROM_AMAX=True, ROW=rowwise, COL=columnwise,
                  AMAX_OUT=False, BM=64, BK=128, num_warps=8)
    return grid, args, consts, (row, col, scale_inv)


def _inputs():
    """Inputs whose specializations all differ, pairs of them in one part only: the two views
    (same sizes, row stride 392) in the address's alignment, 192 and 17 rows in M % 16, 17
    rows and one row in M == 1; and odd sizes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    big = torch.randn(200, 392, device="cuda", generator=g).bfloat16()
    return {
        "aligned 192x384": big[:192, :384].contiguous(),
        "view 200x384 at column 0": big[:, :384],
        "view 200x384 at column 1 (misaligned)": big[:, 1:385],
        "17 rows 17x384": big[:17, :384].contiguous(),
        "one row 1x384": big[:1, :384].contiguous(),
        "odd 37x129": big[:37, :129].contiguous(),
    }


@pytest.mark.skipif(not _launch._DIRECT, reason="direct launches need Triton 3.6 (compiled kernels)")
def test_direct_launch_bitwise_triton_launch_per_specialization():
    kernel, keys, inputs = fp8_tensor._cast_transpose_kernel, set(), _inputs()
    for name, x in inputs.items():
        amax = x.float().abs().amax().reshape(())
        grid, args, consts, ref_out = _cast_args(x, amax)
        chosen = kernel[grid](*args, **consts)  # Triton's own launch, and the kernel its cache chose
        for call in ("first (through kernel[grid])", "second (direct)"):
            grid, args, consts, out = _cast_args(x, amax)
            _launch.launch(kernel, grid, *args, **consts)
            key = _launch.cache_key(kernel, torch.cuda.current_device(), args, consts)
            assert key in _launch._COMPILED, f"{name}: no cache entry after the {call} call"
            cached = _launch._COMPILED[key]
            assert cached.compiled is chosen, f"{name}: the cached kernel is not the one Triton chose"
            assert cached.call is chosen.run.launch, f"{name}: not launched by the C function (scratch?)"
            for what, a, b in zip(("row", "col", "scale_inv"), out, ref_out):
                n = n_bit_diffs(a, b, f"{name} {what}")
                assert n == 0, f"{name}, {call} call: {what} differs from kernel[grid] in {n} of {a.numel()} elements"
        keys.add(key)
    assert len(keys) == len(inputs), f"the inputs should specialize differently: {[k[2] for k in keys]}"


def test_arg_keys_separate_what_triton_specializes():
    x = torch.zeros(64, 64, device="cuda", dtype=torch.bfloat16)
    keys = _launch.arg_keys((x, x.view(-1)[1:], x.float(), x.view(-1)[8:], 1, 16, 17, 2**31, -16, True, 0.5, None,
                             2**63))
    assert keys[0] != keys[1] and keys[0] != keys[2] and keys[0] == keys[3]  # address % 16 (bytes), dtype
    assert len(set(keys[4:8])) == 4 and keys[8] == keys[5]  # == 1, % 16, int32 range; negative multiples
    assert len({keys[9], keys[10], keys[11], keys[4]}) == 4  # bool, float, None, int
    assert keys[12] != keys[7]  # beyond int64: Triton passes it as uint64
    consts = _launch.cache_key(fp8_tensor._amax_kernel, 0, (), {"BM": 1}), _launch.cache_key(
        fp8_tensor._amax_kernel, 0, (), {"BM": True})
    assert consts[0] != consts[1], "constexprs 1 and True must not share a compiled kernel"


def test_launch_hooks_see_every_launch():
    """With a launch hook set (a profiler), launches go through ``kernel[grid]``, which calls it."""
    x = _inputs()["aligned 192x384"]
    seen = []
    fp8_tensor.amax_2d(x)  # compiled and cached before the hook is set
    hook = seen.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        fp8_tensor.amax_2d(x)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 1, f"the launch hook saw {len(seen)} launches, expected 1"


def test_zeroed_slots_are_fresh_zeros():
    dev = torch.device("cuda")
    a, b = _zeros.zeroed_f32(dev), _zeros.zeroed_f32(dev, 2)
    assert a.shape == () and b.shape == (2,) and _zeros.zeroed_f32(dev, 5).shape == (5,)
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0, "slots must start 16-byte aligned"
    a.fill_(5.0)
    ptrs = {a.data_ptr(), b.data_ptr(), b[1].data_ptr()}
    for _ in range(_zeros._SLOTS + 1):  # past the end of a buffer: a new buffer
        s = _zeros.zeroed_f32(dev, 2)
        assert s.data_ptr() not in ptrs and s[1].data_ptr() not in ptrs, "a slot was handed out twice"
        ptrs |= {s.data_ptr(), s[1].data_ptr()}
    assert float(s.abs().sum()) == 0.0 and float(b.abs().sum()) == 0.0


def test_current_scaling_in_a_cuda_graph_takes_a_fresh_amax_per_replay():
    """A replayed quantize must not max-reduce into the amax of an earlier replay: the inputs
    shrink, so a reused slot would keep the first replay's (larger) amax."""
    q = Float8Quantizer()
    static = torch.randn(256, 512, device="cuda").bfloat16() * 8
    kernel_quantize(q, static, rowwise=True, columnwise=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        row, col = kernel_quantize(q, static, rowwise=True, columnwise=True)
    for step, scale in enumerate((8.0, 1.0, 0.25)):
        static.copy_(torch.randn(256, 512, device="cuda").bfloat16() * scale)
        graph.replay()
        ref_row, ref_col = kernel_quantize(q, static, rowwise=True, columnwise=True)
        for what, a, b in (("scale_inv", row.scale_inv, ref_row.scale_inv), ("row", row.data, ref_row.data),
                           ("col", col.data, ref_col.data)):
            n = n_bit_diffs(a, b, what)
            assert n == 0, f"replay {step} (x · {scale}): {what} differs from eager in {n} of {a.numel()} elements"
