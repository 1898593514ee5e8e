"""The launcher's model with shared input quantization (norms and SwiGLU linked to their
projections by ``apply_recipe``) trains bitwise like the unlinked model, with and without
activation checkpointing; linking leaves the state dict unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hybrid_dist as hd
from hybrid_dist.launch.model import Transformer, apply_recipe
from hybrid_dist.launch.parallelize import apply_ac
from hybrid_dist.launch.presets import preset
from tests._helpers import assert_bitwise_equal
from tests._tiers import by_recipe


def _train(recipe_name: str, *, share: bool, checkpoint: bool = False, steps: int = 2, moe_experts: int = 0):
    """Losses of ``steps`` AdamW steps, the last gradients, and how many forward outputs of
    the linked producers were QuantizedTensors."""
    torch.manual_seed(0)
    model = Transformer(preset("tiny", moe_experts=moe_experts))
    model.init_weights()
    apply_recipe(model, hd.recipe_from_name(recipe_name), share_quantized_inputs=share)
    shared = []
    for block in model.layers.values():
        producers = [block.attention_norm] + ([] if block.is_moe else [block.ffn_norm, block.feed_forward.act])
        for mod in producers:
            mod.register_forward_hook(lambda m, i, out: shared.append(isinstance(out, hd.QuantizedTensor)))
    if checkpoint:
        apply_ac(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(512, (2, 128), generator=gen)
        logits, aux = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()) + aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    grads = [p.grad for p in model.parameters()]
    return losses, grads, shared


@pytest.mark.parametrize("name", by_recipe(["fp8_current", "mxfp8", "nvfp4", "fp8_fwd_bf16_bwd", "fp8_delayed"]))
def test_linked_model_trains_bitwise_like_unlinked(name):
    ref_losses, ref_grads, ref_shared = _train(name, share=False)
    assert not any(ref_shared)
    for checkpoint in (False, True):
        losses, grads, shared = _train(name, share=True, checkpoint=checkpoint)
        # 2 layers x 3 producers x 2 steps (+ the recompute's forwards under checkpointing)
        assert len(shared) == 12 * (2 if checkpoint else 1)
        assert all(shared) == (name != "fp8_delayed") and (any(shared) or name == "fp8_delayed")
        for i, (a, b) in enumerate(zip(losses, ref_losses)):
            assert_bitwise_equal(a, b, f"{name} checkpoint={checkpoint}: loss of step {i}")
        for i, (a, b) in enumerate(zip(grads, ref_grads)):
            assert_bitwise_equal(a, b, f"{name} checkpoint={checkpoint}: gradient {i}")


def test_moe_model_links_attention_norm_only():
    _, _, shared = _train("mxfp8", share=True, steps=1, moe_experts=4)
    assert shared == [True, True]


def test_state_dict_keys_unchanged_by_linking():
    torch.manual_seed(0)
    a, b = Transformer(preset("tiny")), Transformer(preset("tiny"))
    apply_recipe(b, hd.recipe_from_name("fp8_current"))
    assert list(a.state_dict()) == list(b.state_dict())
    assert isinstance(a.layers["0"].attention_norm, torch.nn.RMSNorm)
    b.load_state_dict(a.state_dict())
    assert isinstance(b.layers["0"].attention_norm(torch.randn(2, 128, 256)), hd.QuantizedTensor)


def test_launcher_shares_only_when_asked():
    """Opt-in: on an H200 the shared path was no faster for an 8b block and slower for a
    host-bound 1b block (README, shared input quantization)."""
    from hybrid_dist.launch.config import parse_args

    assert parse_args([])[0].share_quantized_inputs is False
    assert parse_args(["--share-quantized-inputs"])[0].share_quantized_inputs is True
    assert [parse_args(argv)[0].links_quantized_inputs for argv in (
        [], ["--share-quantized-inputs"], ["--share-quantized-inputs", "--compile"],
        ["--share-quantized-inputs", "--tp", "2"])] == [False, True, False, False]
