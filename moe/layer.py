"""``MoE``: a dropless top-k mixture of SwiGLU experts, optionally expert-parallel.

Legend: T tokens, H hidden, F expert ffn size, E experts, k = top_k, S = T·k slots.

    weights, experts [T, k] = router(x [T, H])                  (fp32 softmax top-k)
    x_perm [S, H], tokens_per_expert [E] = permute(x, experts)  (slots sorted by expert)
    ── expert parallel only: dispatch x_perm to the experts' ranks (``expert_parallel``)
    h [*, 2F] = fc1(x_perm)  → silu(h_gate) · h_up [*, F] → y_perm [*, H] = fc2(·)
    ── expert parallel only: combine y_perm back
    y [T, H] = Σ_j weights[:, j] · y_perm[slot j]  (+ shared_expert(x))
    aux = load_balancing_loss(probs, experts)

``forward(x [..., H]) -> (y [..., H], aux_loss fp32 scalar)``. Dropless: every slot is
computed (no capacity factor), with fixed-shape device routing. Recipes: ``recipe`` (or the
enclosing ``hd.autocast``) quantizes fc1/fc2 (GroupedLinear) and the shared expert
(``hd.Linear``); the router stays high precision. With ``ep_group`` (W ranks), this rank
holds experts ``[rank·E/W, (rank+1)·E/W)`` and the load-balancing loss uses this rank's
tokens.

Without ``ep_group`` the layer makes no device-to-host sync on the CUDA paths (eager NVFP4
splits read their offsets once, ``device_split``) and, on CPU,
``torch.compile(fullgraph=True)`` traces it whole with one graph for every routing
(``grouped_linear``). Expert parallelism keeps a host sync: the all-to-all split sizes
are read on the host (``route.finish_route``), and the received operands reach the
expert layers through an opaque ``ExchangeIO``; so under ``torch.compile`` the exchange
and the experts between it run eagerly (one graph break per forward), with the router,
the permutation and the combine's weighting compiled around them, and a new routing
recompiles nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_dist.autocast import current_recipe
from hybrid_dist.linear import Linear
from hybrid_dist.moe import expert_parallel as ep
from hybrid_dist.moe.grouped_linear import GroupedLinear
from hybrid_dist.moe.permute import permute, unpermute
from hybrid_dist.moe.router import TopKRouter, load_balancing_loss
from hybrid_dist.recipes import Recipe

__all__ = ["MoE", "SwiGLU"]


class SwiGLU(nn.Module):
    """Dense SwiGLU MLP of ``hd.Linear``s (the shared expert)."""

    def __init__(self, hidden: int, ffn: int, *, recipe: Recipe | None, name: str, device=None, dtype=None):
        super().__init__()
        self.fc1 = Linear(hidden, 2 * ffn, bias=False, recipe=recipe, name=f"{name}.fc1", device=device, dtype=dtype)
        self.fc2 = Linear(ffn, hidden, bias=False, recipe=recipe, name=f"{name}.fc2", device=device, dtype=dtype)

    def forward(self, x):
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


class MoE(nn.Module):
    """Dropless top-k MoE (see module doc).

    ``shared_ffn``: size of an always-on shared SwiGLU expert (0: none).
    ``ep_group``: process group for expert parallelism (None: all experts local).
    ``quantized_dispatch``: send token payloads in the experts' formats where they allow
    it (``expert_parallel``); False exchanges high precision and quantizes after.
    ``early_input_grad``: start the dispatch's backward all-to-all inside fc1's backward,
    once its dgrad is computed, so that it runs during fc1's wgrad GEMM (same gradients);
    False exchanges after fc1's backward.
    ``wire``: bytes this rank sent to other ranks, by exchange (accumulates).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *, shared_ffn: int = 0,
                 norm_topk_prob: bool = True, recipe: Recipe | None = None, ep_group=None,
                 quantized_dispatch: bool = True, early_input_grad: bool = True, name: str = "", device=None,
                 dtype=None):
        super().__init__()
        world = 1 if ep_group is None else torch.distributed.get_world_size(ep_group)
        if num_experts % world:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the EP group size {world}")
        self.hidden, self.num_experts, self.top_k = hidden, num_experts, top_k
        self.recipe, self.ep_group, self.quantized_dispatch = recipe, ep_group, quantized_dispatch
        self.early_input_grad = early_input_grad
        self.num_local_experts = num_experts // world
        self.router = TopKRouter(hidden, num_experts, top_k, norm_topk_prob=norm_topk_prob, device=device, dtype=dtype)
        kw = dict(recipe=recipe, device=device, dtype=dtype)
        self.fc1 = GroupedLinear(self.num_local_experts, hidden, 2 * ffn, name=f"{name}.experts.fc1", **kw)
        self.fc2 = GroupedLinear(self.num_local_experts, ffn, hidden, name=f"{name}.experts.fc2", **kw)
        self.shared_expert = SwiGLU(hidden, shared_ffn, name=f"{name}.shared_expert", **kw) if shared_ffn else None
        self.wire = ep.WireStats()  # bytes sent to other EP ranks, by exchange

    def use_recipe(self, recipe: Recipe | None, *, name: str | None = None) -> None:
        """The recipe of the token exchange (the expert layers get theirs from ``hd.set_recipe``
        as modules of their own)."""
        self.recipe = recipe

    def forward(self, x: torch.Tensor):
        if x.shape[-1] != self.hidden:
            raise ValueError(f"MoE expects x [..., {self.hidden}], got {tuple(x.shape)}")
        x2d = x.reshape(-1, self.hidden)
        weights, experts, probs = self.router(x2d)
        y = self.routed(x2d, weights, experts)
        if self.shared_expert is not None:
            y = y + self.shared_expert(x2d)
        return y.reshape(x.shape), load_balancing_loss(probs, experts)

    def routed(self, x_TH, weights_TK, experts_TK) -> torch.Tensor:
        """The routed experts' weighted output ``[T, H]`` for given routing decisions."""
        x_perm, tokens_per_expert, order = permute(x_TH, experts_TK, self.num_experts)
        if self.ep_group is None:
            y_perm = self._experts(x_perm, tokens_per_expert, None, None)
        else:
            y_perm = self._experts_parallel(x_perm, tokens_per_expert)
        return unpermute(y_perm, order, weights_TK)

    def _experts(self, x, tokens_per_expert, io1, io2):
        gate, up = self.fc1(x, tokens_per_expert, io=io1).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up, tokens_per_expert, io=io2)

    @torch.compiler.disable  # host split sizes and ExchangeIO: eager (module note)
    def _experts_parallel(self, x_perm, tokens_per_expert):
        start = ep.start_route(tokens_per_expert, self.ep_group, self.wire, num_slots=x_perm.shape[0])
        training = torch.is_grad_enabled()
        # the payload formats are those the expert layers will use (their recipe resolution)
        r1, r2 = (fc.recipe or self.recipe or current_recipe() for fc in (self.fc1, self.fc2))
        plan1 = self.fc1.plan(r1) if (r1 is not None and self.quantized_dispatch) else None
        plan2 = self.fc2.plan(r2) if (r2 is not None and self.quantized_dispatch and training) else None
        need_col = training and self.fc1.weight.requires_grad
        # the sender's quantization is queued before the host waits for the counts
        payload = ep.dispatch_payload(x_perm, start, plan=plan1, need_columnwise=need_col, stats=self.wire)
        route = ep.finish_route(start)
        # received rows go straight into the packed grouped GEMMs where the layer takes that path
        pk1 = self.fc1.packed_exchange(x_perm, "input") if plan1 is not None else None
        pk2 = self.fc2.packed_exchange(x_perm.new_empty(0, self.fc2.in_features), "grad_output") \
            if plan2 is not None else None
        # x_local's one consumer is fc1: its dx can go back while fc1 computes its wgrad
        x_local, io1 = ep.dispatch(x_perm, route, plan=plan1, need_columnwise=need_col, stats=self.wire, packed=pk1,
                                   early_input_grad=self.early_input_grad, payload=payload)
        io2 = ep.combine_io(plan2, packed=pk2, index=route.index)
        y_local = self._experts(x_local, route.tokens_per_local_expert, io1, io2)
        return ep.combine(y_local, route, plan=plan2, io=io2, stats=self.wire)
