"""Identical traced kernel launches of a compiled graph run once.

In a Llama block the attention norm's output feeds wq, wk and wv, and the FFN norm's feeds
w1 and w3. Compiled, each ``hd.Linear`` quantizes its own input: AOTAutograd's CSE merges
the three identical amax reductions, but not the three FP8 casts that follow, because a
``kernel_op``'s traced launch (``triton_kernel_wrapper_functional``) takes its outputs as
fresh ``empty`` buffers, which CSE never merges, and a launch with launch options is a new
kernel object per call. So a block casts the same tensor with the same scale five times
where two casts would do, and saves three columnwise copies of it for the weight gradients.

``dedupe_kernel_launches(graph)`` merges launches that must produce the same bytes: the
same Triton function with the same launch configurations, grid, constants and input nodes,
within one mutation region of the graph, whose written tensors are all fresh uninitialized
buffers of equal shape, stride and dtype that nothing else reads. Every use of a later
launch's outputs then reads the first launch's. A launch that writes an existing tensor
(the delayed-scaling cast's amax history) is never merged. The kernels it merges are
deterministic functions of their inputs, so the compiled step computes what it computed
before, bitwise, with fewer launches and fewer saved tensors.

It runs as an inductor post-grad pass, after the forward / backward partition and before
inductor re-inplaces the launches: ``compile_options()`` is the ``options`` argument of
``torch.compile`` that installs it.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch import fx

from hybrid_dist.warn import warn_once

aten = torch.ops.aten
_FRESH = (aten.empty.memory_format, aten.empty_strided.default)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _wrapper_op():
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional

    return triton_kernel_wrapper_functional


def _hashable(v):
    """``v`` as a hashable value (containers as tuples), or raise TypeError."""
    if isinstance(v, dict):
        return tuple(sorted((k, _hashable(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_hashable(x) for x in v)
    hash(v)
    return v


def _kernel_key(kernel):
    """The Triton function and launch configurations of a side-table kernel: Dynamo wraps a
    function launched with launch options into a new one-config ``Autotuner`` per call."""
    configs = getattr(kernel, "configs", None)
    if configs is None:
        return kernel
    return getattr(kernel, "fn", kernel), tuple(str(c) for c in configs)


def _fresh(node: fx.Node, user: fx.Node) -> bool:
    """True when ``node`` is a fresh ``empty`` (or a chain of views of one) read by ``user`` only."""
    while True:
        if list(node.users) != [user]:
            return False
        if node.op != "call_function":
            return False
        if node.target in _FRESH:
            return True
        if node.target not in _VIEWS:
            return False
        node, user = node.args[0], node


def _launch_key(node: fx.Node):
    """What determines the bytes a traced launch writes, or None if it may not be merged."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    kw = node.kwargs
    written = {kw["kwargs"][name]: name for name in kw["tensors_to_clone"]}
    args = []
    for name, v in sorted(kw["kwargs"].items()):
        if name in kw["tensors_to_clone"]:
            val = v.meta.get("val") if isinstance(v, fx.Node) else None
            if val is None or not _fresh(v, node):
                return None  # writes a tensor that exists (or cannot be checked)
            args.append((name, "out", tuple(val.shape), tuple(val.stride()), val.dtype, val.device))
        elif isinstance(v, fx.Node) and v in written:  # an unused pointer given a written buffer
            args.append((name, "same as", written[v]))
        elif isinstance(v, fx.Node):
            args.append((name, "in", v))
        else:
            args.append((name, "const", v))
    try:
        return _hashable((
            _kernel_key(kernel_side_table.get_kernel(kw["kernel_idx"])),
            kernel_side_table.get_constant_args(kw["constant_args_idx"]),
            kw["grid"], kw.get("tma_descriptor_metadata"), args, node.meta["mutation_region_id"]))
    except TypeError:  # e.g. a symbolic grid
        return None


def _erase_unused(node: fx.Node, graph: fx.Graph) -> None:
    """Erase ``node`` and the allocations / views feeding only it."""
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for n in inputs:
        if not n.users and n.op == "call_function" and (n.target in _FRESH or n.target in _VIEWS):
            _erase_unused(n, graph)


def dedupe_kernel_launches(graph: fx.Graph) -> int:
    """Merge identical traced Triton launches of ``graph`` (see the module note); returns
    how many it removed."""
    from torch._inductor.pattern_matcher import compute_mutation_region_ids

    wrapper = _wrapper_op()
    launches = [n for n in graph.nodes if n.op == "call_function" and n.target is wrapper]
    if len(launches) < 2:
        return 0
    compute_mutation_region_ids(graph)
    first: dict = {}
    removed = 0
    for node in launches:
        key = _launch_key(node)
        if key is None:
            continue
        kept = first.setdefault(key, node)
        if kept is node:
            continue
        for use in list(node.users):  # getitem(launch, name): read the kept launch's output
            if use.target is operator.getitem:
                use.replace_input_with(node, kept)
        if node.users:
            continue  # a use that is not a plain field read: leave this launch
        _erase_unused(node, graph)
        removed += 1
    return removed


@functools.cache
def _dedupe_pass():
    """The one ``dedupe_kernel_launches`` inductor post-grad pass (cacheable by ``uuid``),
    made on first use: importing ``torch._inductor`` takes about a second. One instance, so
    blocks compiled with ``compile_options()`` share a backend and Dynamo's cache entries."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class DedupeKernelLaunches(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            try:
                dedupe_kernel_launches(graph)
            except Exception as e:  # an optimization: a graph it does not understand compiles as it is
                warn_once(f"hd.compile_options: merging identical kernel launches failed ({type(e).__name__}: "
                          f"{e}); the graph compiles without it", key="dedupe_kernel_launches")

        def uuid(self) -> str:
            return "hybrid_dist.dedupe_kernel_launches.1"

    return DedupeKernelLaunches()


def compile_options() -> dict:
    """``torch.compile(..., options=hd.compile_options())``: inductor options that merge
    identical traced kernel launches (see the module note). Every call gives equal options,
    so the blocks of a model compiled one by one still share their compiled graphs."""
    return {"post_grad_custom_pre_pass": _dedupe_pass()}


__all__ = ["compile_options", "dedupe_kernel_launches"]
