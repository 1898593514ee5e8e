"""``torch.compile(block, fullgraph=True)`` of the launcher's Llama blocks, every recipe.

Two blocks, each compiled on its own (as the launcher compiles them), run three steps
forward and backward next to the same blocks in eager. Asserted per recipe, with
high-precision weights and with ``hd.quantized_model_init`` weights:

* no graph break (``fullgraph=True`` raises on one, and Dynamo's counter stays 0);
* one graph for both blocks over all steps (no recompile per block or per step: the
  stochastic-rounding states and the quantized weights put no per-module constant in it);
* on the CPU backend (``aot_eager`` runs the traced aten graph) outputs, input gradients
  and every parameter gradient bitwise the eager steps.

GPU: inductor on the CUDA kernels, one graph and no break for every recipe, and compiled
as accurate as eager: against the same blocks run in high precision (no recipe), each
output and gradient of the compiled run has an SQNR at most 3 dB below the eager run's
(capped at 40 dB). Not bitwise at the block level for any recipe, bf16 included: inductor
fuses and re-generates the block's own torch arithmetic (the RMSNorm reduction, RoPE in
fp32, the SwiGLU product, the NVFP4 per-tensor scale's division), whose roundings differ
from eager's kernels by an ulp, and a quantizer downstream can then round a value or a
block scale the other way, which is noise of the format's own size. The hd layers
themselves are bitwise under inductor for per-tensor FP8 (``tests/test_compile.py``,
``fp8_current`` and ``fp8_delayed``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

import hybrid_dist as hd
from hybrid_dist.launch.model import Block, rope_tables
from hybrid_dist.launch.presets import preset
from tests._helpers import assert_bitwise_equal, sqnr_db
from tests._tiers import slow

FAST = {("fp8_current", True), ("fp8_delayed", True), ("mxfp8_fwd_nvfp4_bwd", False),
        ("mxfp8_fwd_nvfp4_bwd", True)}
CASES = [pytest.param(n, q, id=f"{n}-{'qinit' if q else 'hp'}", marks=() if (n, q) in FAST else slow)
         for n in hd.RECIPE_NAMES for q in (False, True)]


def _blocks(name: str, qinit: bool, device: str, n_blocks: int = 2):
    cfg = dataclasses.replace(preset("tiny"), n_layers=n_blocks)
    recipe = hd.recipe_from_name(name)
    torch.manual_seed(0)
    init = hd.quantized_model_init(recipe, keep_high_precision_init=False) if qinit else contextlib.nullcontext()
    with torch.device(device), init:
        blocks = torch.nn.ModuleList([Block(cfg) for _ in range(n_blocks)])
    blocks = blocks.to(torch.bfloat16)
    hd.convert_to_hybrid(blocks, recipe=recipe)
    for m in blocks.modules():
        if isinstance(m, hd.Linear):
            m.plan_for(recipe)  # as apply_recipe does: states exist before the first (compiled) forward
    return cfg, blocks


def _steps(cfg, blocks, fns, device: str, steps: int = 3):
    """Per step: the last block's output, the input gradient and every parameter gradient."""
    cos, sin = rope_tables(cfg, device=device)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2, 64, cfg.dim, generator=g).to(device, torch.bfloat16).requires_grad_(True)
        blocks.zero_grad(set_to_none=True)
        h, aux = x, torch.zeros((), device=device)
        for fn in fns:
            h, aux = fn(h, cos, sin, aux)
        h.float().square().mean().backward()
        out.append([h.detach(), x.grad] + [p.grad for p in blocks.parameters()])
    return out


def _high_precision(name: str, qinit: bool, device: str):
    """The same blocks and steps with every hd layer's recipe removed (dequantized weights)."""
    cfg, blocks = _blocks(name, qinit, device)
    for m in blocks.modules():
        if isinstance(m, hd.Linear):
            m.recipe = None
    return _steps(cfg, blocks, list(blocks), device)


def _compiled_vs_eager(name: str, qinit: bool, device: str, backend):
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    counters.clear()
    counter = CompileCounterWithBackend(backend)
    cfg, eager = _blocks(name, qinit, device)
    _, compiled = _blocks(name, qinit, device)
    fns = [torch.compile(b, backend=counter, fullgraph=True) for b in compiled]
    ref = _steps(cfg, eager, list(eager), device)
    got = _steps(cfg, compiled, fns, device)
    breaks = sum(counters["graph_break"].values())
    return ref, got, counter.frame_count, breaks


@pytest.mark.parametrize("name, qinit", CASES)
def test_compiled_blocks_one_graph_bitwise_eager_cpu(name, qinit):
    ref, got, frames, breaks = _compiled_vs_eager(name, qinit, "cpu", "aot_eager")
    where = f"{name} {'quantized-init' if qinit else 'high-precision'} weights"
    assert breaks == 0, f"{where}: {breaks} graph breaks"
    assert frames == 1, f"{where}: {frames} graphs for 2 identical blocks x 3 steps (expected 1)"
    for step, (r, c) in enumerate(zip(ref, got)):
        for i, (a, b) in enumerate(zip(r, c)):
            what = ("y", "dx")[i] if i < 2 else f"grad of parameter #{i - 2}"
            assert_bitwise_equal(b, a, f"{where}, step {step}, {what} (compiled vs eager)")


@pytest.mark.gpu
@pytest.mark.parametrize("name", hd.RECIPE_NAMES)
@pytest.mark.parametrize("qinit", [False, True], ids=["hp", "qinit"])
def test_compiled_blocks_inductor_gpu(name, qinit):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ref, got, frames, breaks = _compiled_vs_eager(name, qinit, "cuda", "inductor")
    exact = _high_precision(name, qinit, "cuda")
    where = f"{name} {'quantized-init' if qinit else 'high-precision'} weights (inductor)"
    assert breaks == 0 and frames == 1, f"{where}: {frames} graphs, {breaks} graph breaks"
    for step, (r, c, h) in enumerate(zip(ref, got, exact)):
        for i, (a, b, e) in enumerate(zip(r, c, h)):
            what = ("y", "dx")[i] if i < 2 else f"grad of parameter #{i - 2}"
            eager_db, compiled_db = sqnr_db(e.float(), a.float()), sqnr_db(e.float(), b.float())
            assert compiled_db >= min(eager_db, 40.0) - 3.0, (
                f"{where}, step {step}, {what}: SQNR vs high precision {compiled_db:.1f} dB compiled, "
                f"{eager_db:.1f} dB eager")
