"""``kernels.dedupe_launches``: identical traced FP8 casts of one tensor (wq, wk, wv reading
one norm output) are launched once, in the forward graph inductor compiles; casts that
differ in input or flags, and casts that write an existing tensor, are left alone.
Traced without a GPU (``_traced_graphs``); the compiled step's numbers: tests/test_compile.py."""

from __future__ import annotations

import operator

import pytest
import torch

from hybrid_dist.kernels._jit_common import INTERPRET
from hybrid_dist.kernels.dedupe_launches import compile_options, dedupe_kernel_launches
from tests.kernels._traced_graphs import cuda_kernels_on_cpu, forward_graph, triton_target  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(INTERPRET.value, reason="under the interpreter the ops are library_ops")
E4M3 = torch.float8_e4m3fn


def _cast_fn(columnwise: bool = True):
    """An autograd function that casts its input as ``hd.Linear`` does (amax, then one
    launch) and saves the columnwise copy for its backward."""
    from hybrid_dist.kernels.fp8.tensor import cast_current_op, traced_amax

    class Cast(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x2d = x.reshape(-1, x.shape[-1])
            row, col, scale_inv = cast_current_op(x2d, traced_amax(x2d), E4M3, 0.0, False, True, columnwise)
            ctx.save_for_backward(col, scale_inv)
            return row.float() * scale_inv

        @staticmethod
        def backward(ctx, g):  # a stand-in that reads the saved columnwise copy
            col, scale_inv = ctx.saved_tensors
            if not columnwise:
                return g.to(torch.bfloat16)
            return (col.float().t() * scale_inv * g).to(torch.bfloat16)

    return Cast


def _launches(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target)]


def _inputs(device):
    return (torch.randn(96, 320, device=device).bfloat16().requires_grad_(True),)


def test_identical_casts_launch_once(triton_target):
    cast = _cast_fn()

    def block(x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        return cast.apply(h) + cast.apply(h) + cast.apply(h) + cast.apply(h * 2)

    gm = forward_graph(block, *_inputs(triton_target), min_cut=True)
    assert len(_launches(gm)) == 4, "AOTAutograd merged the casts itself: this pass has nothing to do"
    assert dedupe_kernel_launches(gm.graph) == 2
    gm.graph.lint()
    kept = _launches(gm)
    assert len(kept) == 2 and kept[0].kwargs["kwargs"]["x_ptr"] is not kept[1].kwargs["kwargs"]["x_ptr"]
    reads = [n for n in gm.graph.nodes if n.target is operator.getitem and n.args[0] in kept]
    assert {n.args[0] for n in reads} == set(kept)
    saved = [a for a in gm.graph.output_node().args[0] if isinstance(a, torch.fx.Node)]
    cols = [a for a in saved if a.target is operator.getitem and a.args[1] == "col_ptr"]
    assert len(cols) == 4 and len({c.args[0] for c in cols}) == 2, f"saved columnwise copies not shared: {saved}"
    assert not any("empty" in str(n.target) and not n.users for n in gm.graph.nodes), "an allocation is left"


@pytest.mark.parametrize("options", [False, True], ids=["plain", "compile_options"])
def test_in_inductors_post_grad_passes(triton_target, options):
    """Where ``compile_options`` runs it: inductor's post-grad passes over the forward graph
    (they re-inplace the launches after it): 4 launches, 2 with the pass."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.fx_passes.post_grad import post_grad_passes
    from torch._inductor.virtualized import V

    cast = _cast_fn()

    def block(x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        return cast.apply(h) + cast.apply(h) + cast.apply(h) + cast.apply(h * 2)

    gm = forward_graph(block, *_inputs(triton_target), min_cut=True)
    fake_mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])
    with config.patch(compile_options() if options else {}), V.set_fake_mode(fake_mode):
        post_grad_passes(gm, is_inference=False)
    gm.graph.lint()
    assert len(_launches(gm)) == (2 if options else 4)


def test_rowwise_only_casts_launch_once(triton_target):
    """A rowwise-only cast passes its row buffer as the unused columnwise pointer too."""
    row_only = _cast_fn(columnwise=False)

    def block(x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        return row_only.apply(h) + row_only.apply(h)

    gm = forward_graph(block, *_inputs(triton_target), min_cut=True)
    assert len(_launches(gm)) == 2
    assert dedupe_kernel_launches(gm.graph) == 1
    gm.graph.lint()


def test_a_launcher_block_casts_each_shared_input_once(triton_target, monkeypatch):
    """The launcher's Llama block under ``fp8_current`` (its CUDA kernels traced on CPU
    tensors): the compiled forward casts the 7 weights and the 7 layer inputs, 14 launches;
    with the pass 11: q, k, v share the attention norm's cast, w1 and w3 the FFN norm's."""
    import dataclasses

    import hybrid_dist as hd
    from hybrid_dist.launch.model import Block, rope_tables
    from hybrid_dist.launch.presets import preset
    from torch._guards import detect_fake_mode
    from torch._inductor import config
    from torch._inductor.fx_passes.post_grad import post_grad_passes
    from torch._inductor.virtualized import V

    cuda_kernels_on_cpu(monkeypatch)
    cfg = dataclasses.replace(preset("tiny"), n_layers=1)
    torch.manual_seed(0)
    block = Block(cfg).bfloat16()
    hd.set_recipe(block, hd.recipe_from_name("fp8_current"))
    cos, sin = rope_tables(cfg, device="cpu")
    x = torch.randn(1, 64, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
    aux = torch.zeros((), requires_grad=True)
    counts = []
    for options in ({}, compile_options()):
        gm = forward_graph(lambda x: block(x, cos, sin, aux)[0], x, min_cut=True)
        fake_mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])
        with config.patch(options), V.set_fake_mode(fake_mode):
            post_grad_passes(gm, is_inference=False)
        counts.append(len(_launches(gm)))
    assert counts == [14, 11]


def test_casts_that_differ_are_kept(triton_target):
    with_col, row_only = _cast_fn(columnwise=True), _cast_fn(columnwise=False)

    def block(x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        return with_col.apply(h) + row_only.apply(h)

    gm = forward_graph(block, *_inputs(triton_target), min_cut=True)
    assert dedupe_kernel_launches(gm.graph) == 0
    assert len(_launches(gm)) == 2


def test_a_cast_that_writes_a_history_is_kept(triton_target):
    from hybrid_dist.kernels.fp8.tensor import cast_op

    def f(x, scale, history):
        a = cast_op(x, scale, scale, history, E4M3, False, 0.0, False, True, False, True)
        b = cast_op(x, scale, scale, history, E4M3, False, 0.0, False, True, False, True)
        return a[0].float() + b[0].float()

    x = torch.randn(64, 128, device=triton_target).bfloat16()
    scale, history = torch.ones((), device=triton_target), torch.zeros(4, device=triton_target)
    gm = forward_graph(f, x, scale, history)
    assert len(_launches(gm)) == 2
    assert dedupe_kernel_launches(gm.graph) == 0


def test_compile_options_install_one_pass():
    """Equal options for every block compiled with them (else Dynamo compiles each block
    with its own backend: one graph per block instead of one per block structure)."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    p = compile_options()["post_grad_custom_pre_pass"]
    assert isinstance(p, CustomGraphPass) and p.uuid() == "hybrid_dist.dedupe_kernel_launches.1"
    assert compile_options() == compile_options()


def test_the_pass_never_fails_a_compile(monkeypatch):
    """A graph the pass does not understand compiles as it is (warned once)."""
    from hybrid_dist.kernels import dedupe_launches

    def broken(graph):
        raise KeyError("kernel_idx")

    monkeypatch.setattr(dedupe_launches, "dedupe_kernel_launches", broken)
    graph = torch.fx.Graph()
    with pytest.warns(UserWarning, match="merging identical kernel launches failed"):
        compile_options()["post_grad_custom_pre_pass"](graph)
