"""Expert parallel: all-to-all dispatch and combine of token slots over an EP group.

``make_route`` (``route``) plans a layer's exchange for the step; ``dispatch`` sends the
slots to their experts' ranks and ``combine`` brings the experts' outputs back. With a
recipe whose formats allow it (``_wire.unsupported_reason``), the dispatch payload and the
combine's backward payload (dy) travel in the expert layers' formats
(``quantized_exchange``); the combine forward and the dispatch backward exchange high
precision (they are summed, not multiplied). The rest exchange high precision and quantize
after (warned once): an NVFP4 rowwise under a columnwise made at the receiver (``nvfp4``'s
x), an identity columnwise under a quantized rowwise (``fp8_fwd_bf16_bwd``'s x: its bf16
rows are the wgrad operand, cheapest sent alone), and NVFP4 stochastic rounding in the
sent direction (both NVFP4 recipes' dy: the expert's generator draws).

A quantized payload reaches the expert layer through ``io`` (``ExchangeIO``), not through
autograd: no dequantized copy is made for autograd, and the tensor the graph carries
between the exchange and the experts (forward rows, backward dy) is a broadcast stand-in.

With ``early_input_grad`` (the ``MoE`` layer's setting) the dispatch's backward exchange
starts inside the first expert layer's backward, as soon as its dgrad is computed
(``InputGradSender``): the all-to-all then runs during that layer's wgrad GEMM instead of
after it, and the dispatch's backward only waits for it. The rows are the same.
"""

from __future__ import annotations

import torch

from hybrid_dist.moe.exchange_io import ExchangeIO
from hybrid_dist.recipe_module import in_backward
from hybrid_dist.warn import warn_once
from hybrid_dist.moe import _wire, device_split
from hybrid_dist.moe.packed_index import IndexCache
from hybrid_dist.moe.quantized_exchange import quantize_payload, quantized_exchange
from hybrid_dist.moe.route import (PendingRows, Route, RouteStart, WireStats, exchange, exchange_to_slots_async,
                                   finish_route, make_route, start_route)

__all__ = ["WireStats", "Route", "RouteStart", "InputGradSender", "make_route", "start_route", "finish_route",
           "dispatch_payload", "dispatch", "combine", "combine_io"]


class InputGradSender:
    """The dispatch's backward exchange, started early (module note): the first expert
    layer's backward calls ``send(dx)`` once its dgrad is computed; the dispatch's backward
    then ``take()``s the exchanged rows (None: nothing was sent, it exchanges itself)."""

    def __init__(self, route: Route, stats):
        self._route, self._stats, self._pending = route, stats, None

    def send(self, dx: torch.Tensor) -> None:
        self._pending = exchange_to_slots_async(dx, self._route, self._stats, "dispatch_grad")

    def take(self) -> torch.Tensor | None:
        pending, self._pending = self._pending, None
        return pending.wait() if isinstance(pending, PendingRows) else None


def _dispatch_grad(dx, route, stats, sender: InputGradSender | None) -> torch.Tensor:
    """The dispatch's backward: the early sender's rows, else ``dx`` exchanged now."""
    early = sender.take() if sender is not None else None
    return early if early is not None else exchange(dx.contiguous(), route, False, stats, "dispatch_grad")


class _Exchange(torch.autograd.Function):
    """High-precision exchange: dispatch (``to_experts=True``: slots → experts) or combine."""

    @staticmethod
    def forward(ctx, x, route: Route, to_experts: bool, stats, key: str, sender: InputGradSender | None):
        ctx.route, ctx.to_experts, ctx.stats, ctx.key, ctx.sender = route, to_experts, stats, key, sender
        return exchange(x, route, to_experts, stats, key)

    @staticmethod
    def backward(ctx, g):
        if ctx.to_experts:
            dx = _dispatch_grad(g, ctx.route, ctx.stats, ctx.sender)
        else:
            dx = exchange(g.contiguous(), ctx.route, True, ctx.stats, ctx.key + "_grad")
        return dx, None, None, None, None, None


def _rows_stand_in(g, like: torch.Tensor) -> torch.Tensor:
    """``[R, K]`` zeros standing for the received rows in the autograd graph: the experts read
    the rows from ``io`` (note in ``dispatch``). A broadcast view: no memory, no kernel."""
    rows = g.dest.numel() if isinstance(g, device_split.PackedSplit) else sum(g.splits)
    return like.new_zeros(()).expand(rows, like.shape[1])


class _QuantizedDispatch(torch.autograd.Function):
    """Forward: quantized slots → experts (fills ``io["x_quantized"]`` / ``"x_packed"``);
    returns the rows' stand-in (``_rows_stand_in``). Backward: high-precision dx back to the
    slots."""

    @staticmethod
    def forward(ctx, x_perm, route, quantizer, multiple, need_columnwise, io, stats, packed, states, payload):
        g, _ = quantized_exchange(x_perm, route, quantizer, multiple=multiple, need_columnwise=need_columnwise,
                                  stats=stats, key="dispatch", packed_multiple=packed, values=False,
                                  states=states, advance=not in_backward(), payload=payload)
        io["x_packed" if packed is not None else "x_quantized"] = g
        ctx.route, ctx.stats, ctx.sender = route, stats, io.get("dx_sender")
        return _rows_stand_in(g, x_perm)

    @staticmethod
    def backward(ctx, dx):
        return _dispatch_grad(dx, ctx.route, ctx.stats, ctx.sender), *([None] * 9)


class _QuantizedCombine(torch.autograd.Function):
    """Forward: high-precision expert outputs back to the slots. Backward: dy slots sent
    in the experts' gradient format (fills ``io["dy_quantized"]`` / ``"dy_packed"`` before
    the experts' backward runs, which reads dy from there); returns the rows' stand-in."""

    @staticmethod
    def forward(ctx, y_local, route, quantizer, multiple, io, stats, states):
        ctx.route, ctx.q, ctx.multiple, ctx.io, ctx.stats, ctx.states = route, quantizer, multiple, io, stats, states
        return exchange(y_local, route, False, stats, "combine")

    @staticmethod
    def backward(ctx, dy):
        packed = ctx.io.get("packed")  # the last GroupedLinear took the packed path (combine_io)
        g, _ = quantized_exchange(dy.contiguous(), ctx.route, ctx.q, multiple=ctx.multiple, need_columnwise=True,
                                  stats=ctx.stats, key="combine_grad", packed_multiple=packed, values=False,
                                  states=ctx.states)
        ctx.io["dy_packed" if packed is not None else "dy_quantized"] = g
        return _rows_stand_in(g, dy), *([None] * 6)


def _warn_once(reason: str) -> None:
    warn_once(f"expert parallel: exchanging high precision and quantizing after, because {reason}", stacklevel=4)


def dispatch_payload(x_perm, start: RouteStart, *, plan=None, need_columnwise: bool = True, stats=None):
    """The quantized dispatch's payload (``quantize_payload``) made from ``start_route``'s
    device layout, before ``finish_route`` reads the counts: the sender's quantization is
    then queued on the device while the host waits for that read, not issued after it.
    None where ``dispatch`` will exchange high precision. Give it to ``dispatch(payload=)``
    with the same ``plan`` and ``need_columnwise``."""
    if _quantized_reason(plan, "input", need_columnwise) is not None:
        return None
    return quantize_payload(x_perm, start, plan.input, stats=stats, key="dispatch", states=plan.states["input"],
                            advance=not in_backward())


def dispatch(x_perm, route: Route, *, plan=None, need_columnwise: bool = True, stats=None,
             packed: int | None = None, early_input_grad: bool = False, payload=None):
    """Slots → local experts (expert-major rows). With a quantized ``plan`` (the first
    GroupedLinear's) whose input format allows it, the payload travels quantized; returns
    ``(x_local, io)`` where ``io`` feeds ``GroupedLinear.forward(io=...)`` (None: HP without
    ``early_input_grad``). With exchanged rows in ``io``, ``x_local`` is their stand-in
    (broadcast zeros of the rows' shape): it carries the gradient path, and only that
    GroupedLinear may consume it. ``packed``: the GroupedLinear's packed padding multiple
    when it takes the packed path (``GroupedLinear.packed_exchange``): the received rows
    arrive as ``io["x_packed"]``. ``early_input_grad``: ``io`` also holds an
    ``InputGradSender`` (module note); then ``x_local``'s only consumer must be that
    GroupedLinear, whose dx is the whole gradient of ``x_local``. ``payload``:
    ``dispatch_payload``'s, made before the route was finished (else made here)."""
    sender = InputGradSender(route, stats) if early_input_grad else None
    reason = _quantized_reason(plan, "input", need_columnwise)
    if reason is None:
        io = ExchangeIO(index=route.index) if sender is None else ExchangeIO(index=route.index, dx_sender=sender)
        x = _QuantizedDispatch.apply(x_perm, route, plan.input, plan.multiple, need_columnwise, io, stats, packed,
                                     plan.states["input"], payload)
        return x, io
    if plan is not None and reason != "identity":
        _warn_once(reason)
    io = None if sender is None else ExchangeIO(dx_sender=sender)
    return _Exchange.apply(x_perm, route, True, stats, "dispatch", sender), io


def combine_io(plan, packed: int | None = None, index: IndexCache | None = None) -> ExchangeIO | None:
    """The ``io`` to give the last GroupedLinear when its dy will arrive quantized
    (None: high precision; also for ``plan=None``); ``packed`` as for ``dispatch`` (dy then
    arrives as ``io["dy_packed"]``); ``index`` the route's (``Route.index``)."""
    if plan is None or _quantized_reason(plan, "grad_output", True) is not None:
        return None
    return ExchangeIO(index=index) if packed is None else ExchangeIO(packed=packed, index=index)


def combine(y_local, route: Route, *, plan=None, io: ExchangeIO | None = None, stats=None):
    """Local expert outputs → slots (high precision). With ``io = combine_io(plan)`` (also
    given to the last GroupedLinear's forward), the backward payload dy travels in that
    GroupedLinear's gradient format and fills ``io["dy_quantized"]`` for its backward."""
    if io is not None:
        return _QuantizedCombine.apply(y_local, route, plan.grad_output, plan.multiple, io, stats,
                                       plan.states["grad_output"])
    reason = _quantized_reason(plan, "grad_output", True)
    if plan is not None and reason not in (None, "identity"):
        _warn_once(reason)
    return _Exchange.apply(y_local, route, False, stats, "combine", None)


def _quantized_reason(plan, tensor_type: str, need_columnwise: bool) -> str | None:
    if plan is None:
        return "no recipe"
    q = getattr(plan, tensor_type)
    if all(isinstance(q.direction_quantizer(d), _wire.IdentityQuantizer) for d in ("rowwise", "columnwise")):
        return "identity"
    reason = _wire.unsupported_reason(q, need_columnwise=need_columnwise)
    return None if reason is None else f"the {tensor_type} format: {reason}"
