"""``hd.Linear`` fwd+bwd step time per recipe against bf16 ``nn.Linear`` (and torchao float8
tensorwise, compiled, when torchao is importable), with the roofline speedup next to the
achieved one. Prints one table. Run: ``python -m benchmarks.linear``
(``--shapes 3 --recipes fp8_current --compile`` for a subset and the compiled variants;
``--graphs`` adds each module under ``torch.cuda.make_graphed_callables``, bf16 included:
forward and backward replayed as one CUDA graph each, so no host time per kernel).
``host ms`` is the CPU time per step (enqueue only): a step is host-bound where it
approaches ``fwd+bwd ms``.

Timing: ``--rounds`` rounds (default 3) per shape, each timing every variant once in turn,
and each recipe's three GEMMs next to its steps; the table shows the median ms and, for the
ratios (``x bf16``, ``x torchao`` with its [min, max], the roofline columns), the median over
rounds of the ratio within a round. Repetitions of one large step varied by up to 20% within one H100
run (``fp8_current`` at 16384×4096×14336: 4.87 / 5.84 / 5.07 ms), more than the differences
compared here, so a variant is compared with its neighbours in time.

roofline = bf16 step time / (the recipe's three GEMMs timed alone on pre-quantized
operands + the fewest bytes its quantization must move / the copy bandwidth measured in
the same run). Fewest bytes per tensor (x, W, dy): the high-precision input read once
(twice when a direction needs a current per-tensor amax) plus every quantized byte
written; identity directions move nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable

import torch
from torch import nn

import hybrid_dist as hd
from benchmarks._bench import copy_gbps, host_ms, interleaved_ms, print_table
from hybrid_dist import gemm
from hybrid_dist.formats import Float8Quantizer, IdentityQuantizer, NVFP4Quantizer
from hybrid_dist.linear import LinearPlan

SHAPES = [(16384, 8192, 8192), (16384, 4096, 14336), (16384, 14336, 4096), (8192, 2048, 2048)]
TORCHAO = "torchao fp8 tensorwise (compiled)"
RECIPES = ["fp8_current", "fp8_delayed", "fp8_block", "mxfp8", "nvfp4", "mxfp8_fwd_nvfp4_bwd",
           "fp8_fwd_bf16_bwd", "bf16_fwd_mxfp8_bwd"]


def _step(module, x, dy):
    params = [p for p in module.parameters() if p.requires_grad]
    return lambda: torch.autograd.grad(module(x), [x, *params], dy)


def _graphed(module, x):
    """``module`` with forward and backward captured as CUDA graphs (static shapes)."""
    return torch.cuda.make_graphed_callables(module, (x,), num_warmup_iters=3)


def _reads(q) -> int:
    subs = [q.direction_quantizer(d) for d in ("rowwise", "columnwise")]
    if all(isinstance(s, IdentityQuantizer) for s in subs):
        return 0
    current = any((isinstance(s, Float8Quantizer) and s.scaling == "current") or isinstance(s, NVFP4Quantizer)
                  for s in subs)
    return 2 if current else 1


def _roofline_parts(recipe, x, w, dy, copy):
    """``(three, quantize ms)``: a callable running the recipe's three GEMMs on operands
    quantized once, and the fewest bytes its quantization moves at ``copy`` GB/s."""
    plan = LinearPlan.build(recipe, module_type="linear", name="")
    for st in plan.states.values():
        if hasattr(st, "to"):
            st.to("cuda")
    qs = {}
    nbytes = 0
    for name, t in (("input", x), ("weight", w), ("grad_output", dy)):
        q = getattr(plan, name)
        qt = q.quantize(t.detach(), rowwise=True, columnwise=True, state=plan.states[name])
        qs[name] = qt
        quantized = sum(n for d, n in qt.nbytes_by_direction().items()
                        if not isinstance(q.direction_quantizer(d), IdentityQuantizer))
        nbytes += _reads(q) * t.numel() * t.element_size() + quantized
    xq, wq, dyq = qs["input"], qs["weight"], qs["grad_output"]
    r = recipe

    def three():
        gemm.gemm_nt(xq.rowwise, wq.rowwise, out_dtype=torch.bfloat16, config=r.fprop)  # fprop
        gemm.gemm_nt(dyq.rowwise, wq.columnwise, out_dtype=torch.bfloat16, config=r.dgrad)  # dgrad
        gemm.gemm_nt(dyq.columnwise, xq.columnwise, out_dtype=torch.bfloat16, config=r.wgrad)  # wgrad

    return three, nbytes / copy / 1e6


def _torchao_step(k, n, x, dy):
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    m = nn.Sequential(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
    convert_to_float8_training(m)
    return _step(torch.compile(m), x, dy)


def _args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="all",
                   help="'all' or comma-separated indices into SHAPES (0-3; 3 is 8192,2048,2048)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile(fullgraph=True) of each hd.Linear (inductor)")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode for --compile, e.g. reduce-overhead (CUDA graphs)")
    p.add_argument("--graphs", action="store_true",
                   help="also time each module (bf16 included) under torch.cuda.make_graphed_callables")
    p.add_argument("--rounds", type=int, default=3,
                   help="timing rounds; each round times every variant of a shape once, in turn")
    return p.parse_args()


@dataclasses.dataclass
class Variant:
    """One timed step of a shape. ``fn`` is None once it failed (``error`` says how);
    ``floor``: the recipe's ``(three GEMMs callable, quantize ms)`` (``_roofline_parts``)."""

    label: str
    fn: Callable[[], object] | None
    floor: tuple[Callable[[], object], float] | None = None
    error: str = ""


def _failed(label: str, e: Exception) -> Variant:
    return Variant(label, None, error=f"failed: {type(e).__name__}: {e}"[:160])


def _checked(label: str, fn, floor=None) -> Variant:
    """``fn`` run once (compiling, capturing, allocating) so that a failure is its row's."""
    try:
        fn()
        torch.cuda.synchronize()
        return Variant(label, fn, floor)
    except Exception as e:  # keep the table: report the failure in its row
        return _failed(label, e)


def _variants(args, recipes, *, k, n, x, dy, copy) -> list[Variant]:
    """The variants of one shape: bf16 first, then torchao (if importable), then each recipe
    (eager, and compiled / graphed when asked). All stay alive while the shape is timed:
    graphed and reduce-overhead variants each hold a private memory pool."""
    ref = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    out = [_checked("bf16 nn.Linear", _step(ref, x, dy))]
    if args.graphs:
        out.append(_checked("bf16 nn.Linear (CUDA graph)", _step(_graphed(ref, x), x, dy)))
    ao = _torchao_step(k, n, x, dy)
    if ao is not None:
        out.append(_checked(TORCHAO, ao))
    for name in recipes:
        try:
            recipe = hd.recipe_from_name(name)
            lin = hd.Linear(k, n, bias=False, recipe=recipe, device="cuda", dtype=torch.bfloat16)
            floor = _roofline_parts(recipe, x, lin.weight, dy, copy)
        except Exception as e:  # keep the table: report the failure in its row
            out.append(_failed(name, e))
            continue
        out.append(_checked(name, _step(lin, x, dy), floor))
        if args.compile:
            label = f"{name} (compiled{', ' + args.compile_mode if args.compile_mode else ''})"
            out.append(_checked(label, _step(torch.compile(lin, fullgraph=True, mode=args.compile_mode), x, dy),
                                floor))
        if args.graphs:
            try:
                lin_g = hd.Linear(k, n, bias=False, recipe=recipe, device="cuda", dtype=torch.bfloat16)
                out.append(_checked(f"{name} (CUDA graph)", _step(_graphed(lin_g, x), x, dy), floor))
            except Exception as e:
                out.append(_failed(f"{name} (CUDA graph)", e))
    return out


def _rounds(variants: list[Variant], rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``(ms, floor ms)`` per round per variant (``_bench.interleaved_ms``): each round times
    every variant once, in turn, and each recipe's GEMMs once, next to its first variant. A
    variant that fails while timed keeps its error and leaves the rounds."""
    fns, gemms_of = {}, {}
    for v in variants:
        if v.fn is not None:
            fns[v.label] = v.fn
        if v.fn is not None and v.floor is not None:
            gemms_of[v.label] = ("GEMMs", id(v.floor[0]))  # a recipe's variants share its GEMMs
            fns.setdefault(gemms_of[v.label], v.floor[0])
    ms, errors = interleaved_ms(fns, rounds)
    floors = {v.label: [] for v in variants}
    for v in variants:
        if v.label in errors:
            v.fn, v.error = None, errors[v.label]
        elif v.label in gemms_of and gemms_of[v.label] not in errors:
            floors[v.label] = [g + v.floor[1] for g in ms[gemms_of[v.label]]]
    return {v.label: ms.get(v.label, []) for v in variants}, floors


def _spread(values: list[float]) -> str:
    """``median [min, max]``, 3 decimals."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def _shape_rows(shape, variants: list[Variant], ms, floors) -> list[list]:
    """Table rows: median ms, host ms, and over the rounds the per-round ratios to bf16 and
    (median [min, max]) to torchao; roofline x = bf16 / floor and of roofline = floor / ms,
    per round, medians."""
    bf16, ao = ms["bf16 nn.Linear"], ms.get(TORCHAO) or None
    rows = []
    for v in variants:
        t = ms[v.label]
        if v.fn is None:
            rows.append([shape, v.label, v.error, "", "", "", "", ""])
            continue
        x_bf16 = statistics.median(b / u for b, u in zip(bf16, t))
        x_ao = "" if ao is None else _spread([a / u for a, u in zip(ao, t)])
        f = floors[v.label]
        roof = ["", ""] if not f else [statistics.median(b / c for b, c in zip(bf16, f)),
                                       statistics.median(c / u for c, u in zip(f, t))]
        host = host_ms(v.fn) if v.label != TORCHAO else ""
        rows.append([shape, v.label, statistics.median(t), host, x_bf16, x_ao, *roof])
    return rows


def main() -> None:
    args = _args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    recipes = list(dict.fromkeys(r for r in args.recipes.split(",") if r))  # each once, in order
    # every compiled variant of a shape stays alive, each with its own guards
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(recipes) + 8)
    copy = copy_gbps()
    rows = []
    for m, k, n in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16().requires_grad_(True)
        dy = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        variants = _variants(args, recipes, k=k, n=n, x=x, dy=dy, copy=copy)
        rows += _shape_rows(f"{m},{k},{n}", variants, *_rounds(variants, args.rounds))
        del x, dy, variants
        torch.cuda.empty_cache()
    print_table(["M,K,N", "variant", "fwd+bwd ms", "host ms", "x bf16", "x torchao [min, max]", "roofline x",
                 "of roofline"], rows, f"Linear fwd+bwd on {torch.cuda.get_device_name()} (copy {copy:.0f} GB/s; "
                f"medians of {args.rounds} interleaved rounds, ratios per round)")


if __name__ == "__main__":
    main()
