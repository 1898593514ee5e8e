"""Expert-parallel steps whose received row counts change compile no Triton kernel after
the first steps (2 NCCL ranks).

A rank's received row count R changes every step with the routing. Triton specializes a
kernel on its integer arguments' classes (equal to 1, a multiple of 16) and its pointers'
16-byte alignment, and a kernel may pick a form by a count (a constexpr), so a count of a new
class would compile a new variant in the middle of a run, a step of a second or more. So the
kernels that see R take it unspecialized (``do_not_specialize``) or see the packed capacity,
a multiple of 128 rows (``moe.packed_index``); the packed index's views stay aligned for any
R, and a transpose of one row is a copy. Here the router is steered so that rank 0 receives,
step by step, R = 1024, 1024 (warm-up), 1025, 424 (one local expert empty), 1 and 1024 rows,
and Triton's compile hook must not fire after the warm-up."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybrid_dist as hd
from hybrid_dist.moe import MoE
from tests_distributed._harness import run_nccl

H, FFN, E, TOP_K, T = 256, 256, 4, 2, 512
WARMUP = 2
# per step and rank: tokens routed to experts (0, 1), (2, 3) and (0, 2); rank 0 owns
# experts 0 and 1, so it receives 2·Σa + Σc rows and rank 1 2·Σb + Σc
PLAN = [
    ((200, 200, 112), (200, 200, 112)),
    ((200, 200, 112), (200, 200, 112)),
    ((200, 199, 113), (200, 200, 112)),
    ((0, 300, 212), (0, 300, 212)),
    ((0, 511, 1), (0, 512, 0)),
    ((256, 256, 0), (256, 256, 0)),
]


def planned_rows(step: int, rank: int) -> int:
    (a0, b0, c0), (a1, b1, c1) = PLAN[step]
    return 2 * (a0 + a1 if rank == 0 else b0 + b1) + c0 + c1


def steered_input(a: int, b: int, c: int, gen: torch.Generator, device) -> torch.Tensor:
    """``[T, H]`` whose first four features make the steered router pick experts (0, 1) for
    the first ``a`` tokens, (2, 3) for the next ``b`` and (0, 2) for the last ``c``."""
    x = torch.randn(T, H, generator=gen, device=device) * 0.1
    first = torch.tensor([0] * a + [2] * b + [0] * c, device=device)
    second = torch.tensor([1] * a + [3] * b + [2] * c, device=device)
    x[:, :E] = 0
    x[torch.arange(T, device=device), first] = 4.0
    x[torch.arange(T, device=device), second] = 3.0
    return x


def steer(moe: MoE) -> None:
    """The router's logits become the input's first ``E`` features."""
    with torch.no_grad():
        moe.router.gate.weight.zero_()
        moe.router.gate.weight[:, :E].copy_(torch.eye(E))


def _worker(rank, world, recipe_name):
    import triton
    from hybrid_dist.moe import expert_parallel as ep

    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    moe = MoE(H, FFN, E, TOP_K, recipe=hd.recipe_from_name(recipe_name), ep_group=dist.group.WORLD,
              device=device, dtype=torch.bfloat16)
    steer(moe)
    received, compiled = [], []
    finish_route = ep.finish_route

    def recording_route(*args, **kwargs):
        route = finish_route(*args, **kwargs)
        received.append(sum(route.recv_splits))
        return route

    ep.finish_route = recording_route
    triton.knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append((len(received), kw["repr"][:160]))
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    for plan in PLAN:
        x = steered_input(*plan[rank], gen, device).to(torch.bfloat16).requires_grad_(True)
        y, aux = moe(x)
        (y.float().square().mean() + aux).backward()
    torch.cuda.synchronize()
    triton.knobs.runtime.jit_post_compile_hook = None
    late = [c for c in compiled if c[0] > WARMUP]
    return received, len(compiled), late


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["fp8_current", "mxfp8"])
def test_changing_received_rows_compile_nothing_after_warmup(recipe_name):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    for rank, (received, n_compiled, late) in enumerate(run_nccl(_worker, 2, recipe_name)):
        where = f"EP=2 {recipe_name} rank {rank}"
        assert received == [planned_rows(s, rank) for s in range(len(PLAN))], f"{where}: received rows {received}"
        assert n_compiled > 0, f"{where}: the compile hook never fired (no Triton kernel ran?)"
        assert not late, f"{where}: Triton compiled after the warm-up steps (step, kernel): {late}"
