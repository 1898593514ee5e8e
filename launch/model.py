"""A Llama-style decoder: RMSNorm, RoPE, SwiGLU, grouped-query attention through
``F.scaled_dot_product_attention``, and a dense or MoE MLP.

Every projection inside the blocks is an ``hd.Linear`` (its recipe is set later with
``hd.convert_to_hybrid``); the token embedding and the output head stay high precision,
as TransformerEngine and torchao keep them. Created inside ``hd.quantized_model_init``,
the block weights are QuantizedTensors. With ``hd.Linear`` projections the block norms
are ``hd.RMSNorm`` and the MLP gate is ``hd.SwiGLU``, which ``apply_recipe`` links to the
layers reading them (attention_norm → wq, wk, wv; ffn_norm → w1, w3; SwiGLU → w2) so each
of those inputs is quantized once (``hybrid_dist.shared_input``). The ``nn.Linear``
baseline (torchao) keeps ``nn.RMSNorm`` and ``F.silu(a) * b``.

Shape legend: B batch, S sequence, D model dim, H query heads, G kv heads, Dh head dim,
V vocab, F ffn dim. Attention reshapes use ``-1`` for the head count so a tensor-parallel
shard (H/tp local heads) runs the same code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import hybrid_dist as hd
from hybrid_dist.launch.presets import ModelConfig
from hybrid_dist.launch.sequence_parallel import gather_sequence, scatter_sequence


def rope_tables(cfg: ModelConfig, *, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[max_seq_len, Dh/2]`` (fp32)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x_BSHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim by the position angle."""
    s = x_BSHD.shape[1]
    cos, sin = cos[:s, None, :], sin[:s, None, :]
    x1, x2 = x_BSHD.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x_BSHD.dtype)


class Attention(nn.Module):
    """Grouped-query attention on ``[B, S, D]``; with ``seq_first`` (sequence parallel) its
    projections see ``[S, B, D]`` (the gathered sequence) and ``wo`` returns that layout."""

    def __init__(self, cfg: ModelConfig, *, linear: type[nn.Linear] = hd.Linear):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.seq_first = False
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = linear(cfg.dim, cfg.dim, bias=False)
        self.wk = linear(cfg.dim, kv_dim, bias=False)
        self.wv = linear(cfg.dim, kv_dim, bias=False)
        self.wo = linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x_BSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.seq_first:
            return self._forward_seq_first(x_BSD, cos, sin)
        b, s, _ = x_BSD.shape
        q = apply_rope(self.wq(x_BSD).view(b, s, -1, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x_BSD).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x_BSD).view(b, s, -1, self.head_dim)
        o_BHSD = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return self.wo(o_BHSD.transpose(1, 2).reshape(b, s, -1))

    def _forward_seq_first(self, x, cos, sin) -> torch.Tensor:
        """``x``: this rank's ``[S/tp, B, D]``; the projections' input hook gathers it to
        ``[S, B, D]``, so the sequence length comes from their outputs."""
        q_SBX, k_SBX, v_SBX = self.wq(x), self.wk(x), self.wv(x)
        s, b = q_SBX.shape[:2]
        q = apply_rope(q_SBX.transpose(0, 1).unflatten(-1, (-1, self.head_dim)), cos, sin)
        k = apply_rope(k_SBX.transpose(0, 1).unflatten(-1, (-1, self.head_dim)), cos, sin)
        v = v_SBX.transpose(0, 1).unflatten(-1, (-1, self.head_dim))
        o_BHSD = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True)
        return self.wo(o_BHSD.permute(2, 0, 1, 3).reshape(s, b, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, ffn_dim: int, *, linear: type[nn.Linear] = hd.Linear):
        super().__init__()
        self.w1 = linear(dim, ffn_dim, bias=False)
        self.w3 = linear(dim, ffn_dim, bias=False)
        self.w2 = linear(ffn_dim, dim, bias=False)
        # hd.SwiGLU can quantize its output once for w2 (no parameters: state dict unchanged)
        self.act = hd.SwiGLU() if linear is hd.Linear else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(self.act(self.w1(x), self.w3(x)))


def build_mlp(cfg: ModelConfig, *, ep_group=None, linear: type[nn.Linear] = hd.Linear) -> nn.Module:
    """Dense SwiGLU, or the MoE MLP of ``hybrid_dist.moe`` when ``cfg.moe_experts > 0``."""
    if not cfg.moe_experts:
        return FeedForward(cfg.dim, cfg.ffn_dim, linear=linear)
    from hybrid_dist.launch.moe_mlp import MoEFeedForward

    return MoEFeedForward(cfg, ep_group=ep_group)


class Block(nn.Module):
    """``forward(x, cos, sin) -> (x, aux)``: ``aux`` is the MoE load-balancing loss
    added to the incoming ``aux`` (dense blocks pass it through)."""

    def __init__(self, cfg: ModelConfig, *, ep_group=None, linear: type[nn.Linear] = hd.Linear):
        super().__init__()
        norm = hd.RMSNorm if linear is hd.Linear else nn.RMSNorm
        self.attention_norm = norm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg, linear=linear)
        self.ffn_norm = norm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = build_mlp(cfg, ep_group=ep_group, linear=linear)
        self.is_moe = bool(cfg.moe_experts)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, aux: torch.Tensor):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        if self.is_moe:
            y, block_aux = self.feed_forward(self.ffn_norm(x))
            return x + y, aux + block_aux
        return x + self.feed_forward(self.ffn_norm(x)), aux


class Transformer(nn.Module):
    """``forward(tokens [B, S] int64) -> (logits [B, S, V] fp32, aux)`` with ``aux`` the
    summed MoE load-balancing loss (0 for dense models). ``ep_group``: the expert-parallel
    process group (each rank then builds only its experts). ``linear``: the class of the
    block projections (``nn.Linear`` for a baseline that converts them itself, e.g. torchao)."""

    def __init__(self, cfg: ModelConfig, *, ep_group=None, linear: type[nn.Linear] = hd.Linear):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, ep_group=ep_group, linear=linear)
                                     for i in range(cfg.n_layers)})
        # (EP rank, EP size): this rank holds experts [rank·E/size, (rank+1)·E/size)
        self.ep_slot = (0, 1) if ep_group is None else (dist.get_rank(ep_group), dist.get_world_size(ep_group))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.sp_group = None  # the TP group when the blocks run sequence parallel (launch.sequence_parallel)
        cos, sin = rope_tables(cfg, device=self.tok_embeddings.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic init (given the global seed): N(0, 0.02) weights, output
        projections scaled by 1/sqrt(2·n_layers), unit norms, RoPE tables. Works on
        materialised ``to_empty`` models and on sharded (DTensor) parameters; unsharded
        quantized weights (``--quantized-init``) are re-quantized from the same draws, and
        (before sharding) an EP rank's experts are its slice of the single-process draw."""
        out_std = 0.02 / (2 * self.cfg.n_layers) ** 0.5
        ep_rank, ep_size = self.ep_slot
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = out_std if name.endswith(("wo.weight", "w2.weight", "fc2.weight")) else 0.02
            if isinstance(p, DTensor) and isinstance(p.to_local(), hd.QuantizedTensor):
                raise NotImplementedError("init_weights: initialise quantized weights before sharding them")
            if not isinstance(p, DTensor) and (isinstance(p, hd.QuantizedTensor) or ep_size > 1):
                # draw the full tensor (all experts under EP) so every layout gets the same values
                is_expert = name.endswith(("moe.fc1.weight", "moe.fc2.weight"))
                n = p.shape[0] * (ep_size if is_expert else 1)
                w = torch.empty((n, *p.shape[1:]), dtype=torch.float32, device=p.device).normal_(std=std)
                w = w[ep_rank * p.shape[0]:(ep_rank + 1) * p.shape[0]] if is_expert else w
                p.copy_(w)  # a QuantizedTensor re-quantizes (fp32 masters start from its dequantized values)
            else:
                nn.init.normal_(p, std=std)
        cos, sin = rope_tables(self.cfg, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tok_embeddings(tokens_BS)
        # MoE blocks add to aux: it requires grad from the first block on, so every block
        # sees one input signature (one compiled graph, not one for the first block)
        aux = torch.zeros((), dtype=torch.float32, device=h.device, requires_grad=self.cfg.moe_experts > 0)
        if self.sp_group is not None:  # blocks on [S/tp, B, D] (launch.sequence_parallel)
            h = scatter_sequence(h.transpose(0, 1), self.sp_group)
        # side inputs in the blocks' compute dtype, as FSDP2's MixedPrecisionPolicy casts them: it
        # does so at every block in torch 2.13, but before only at a multi-block unit's first
        # block (--fsdp-unit), which left the others fp32 rope tables and a second graph
        cos, sin = self.rope_cos.to(h.dtype), self.rope_sin.to(h.dtype)
        for layer in self.layers.values():
            h, aux = layer(h, cos, sin, aux.to(h.dtype))
        if self.sp_group is not None:
            h = gather_sequence(h, self.sp_group).transpose(0, 1)
        return self.output(self.norm(h)).float(), aux


def hybrid_filter(module: nn.Module, fqn: str) -> bool:
    """``module_filter_fn`` for ``hd.convert_to_hybrid``: every block projection, not the
    output head nor an MoE router."""
    return fqn != "output" and ".router" not in fqn


def link_shared_inputs(model: nn.Module) -> None:
    """Link each block's producers to the ``hd.Linear`` layers reading them, so their
    output is quantized once (where the recipe allows; see ``hybrid_dist.shared_input``):
    attention_norm → wq, wk, wv; for dense MLPs ffn_norm → w1, w3 and SwiGLU → w2."""
    for block in model.layers.values():
        attn = block.attention
        hd.link_quantized_input(block.attention_norm, consumers=[attn.wq, attn.wk, attn.wv])
        if not block.is_moe:
            ffn = block.feed_forward
            hd.link_quantized_input(block.ffn_norm, consumers=[ffn.w1, ffn.w3])
            hd.link_quantized_input(ffn.act, consumers=[ffn.w2])


def apply_recipe(model: nn.Module, recipe: hd.Recipe, *, share_quantized_inputs: bool = True) -> nn.Module:
    """Set ``recipe`` on every block projection (``hd.Linear`` and MoE ``GroupedLinear``)
    and on each ``MoE`` (which quantizes its expert-parallel token exchange with it).

    ``share_quantized_inputs``: link the norms and the SwiGLU to their consumers
    (:func:`link_shared_inputs`). Pass False for ``torch.compile``d blocks (a
    ``QuantizedTensor`` passed between modules breaks the graph) and for tensor-parallel
    layouts (the TP styles' input hooks expect high-precision inputs)."""
    hd.convert_to_hybrid(model, recipe=recipe, module_filter_fn=hybrid_filter)  # plans built now
    if share_quantized_inputs:
        link_shared_inputs(model)
    if model.cfg.moe_experts:  # the experts' GroupedLinear layers and each MoE's token exchange
        hd.set_recipe(model, recipe, module_filter_fn=lambda mod, fqn: not isinstance(mod, hd.Linear))
    return model
