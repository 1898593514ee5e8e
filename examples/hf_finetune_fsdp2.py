"""Fine-tune a Hugging Face causal LM with a hybrid recipe under FSDP2, checkpointed by DCP.

    python examples/hf_finetune_fsdp2.py                          # tiny LlamaForCausalLM, CPU, ~15 s
    torchrun --nproc-per-node 2 examples/hf_finetune_fsdp2.py     # the same on 2 gloo ranks
    torchrun --nproc-per-node 8 examples/hf_finetune_fsdp2.py --model PATH_OR_HUB_NAME \\
        --device cuda --recipe fp8_current --steps 200 --seq 2048 --lr 1e-5

``hd.convert_to_hybrid(..., quantized_weights=True)`` swaps every Linear of the blocks for an
``hd.Linear`` with a quantized weight (``lm_head`` stays high precision); ``fully_shard``
shards each decoder layer and the root; ``hd.MasterWeightOptimizer`` keeps fp32 masters.
Halfway, the model and optimizer are saved with DCP's state-dict helpers
(``get_state_dict``); a fresh model then loads them (``set_state_dict``) and runs the second
half again: its losses equal the first run's bitwise. Without ``--model`` the model is a
tiny ``LlamaConfig`` (no download) trained on a few fixed random batches.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hybrid_dist as hd


def build(args) -> torch.nn.Module:
    import transformers

    torch.manual_seed(args.seed)
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    else:
        cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=4,
                                       max_position_embeddings=args.seq, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    model = hd.convert_to_hybrid(model.to(args.device), recipe=hd.recipe_from_name(args.recipe),
                                 quantized_weights=True, module_filter_fn=lambda _, fqn: fqn != "lm_head")
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def batches(args, vocab: int) -> list[torch.Tensor]:
    """``args.batches`` fixed random batches of this rank (a stand-in for a data loader)."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    return [torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(args.device) for _ in range(args.batches)]


def run(model, opt, data, steps: range) -> list[float]:
    losses = []
    for step in steps:
        tokens = data[step % len(data)]
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="a Hugging Face model name or path (default: a tiny Llama)")
    p.add_argument("--recipe", default="mxfp8_fwd_nvfp4_bwd", choices=hd.RECIPE_NAMES)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--checkpoint-dir", default="", help="default: a temporary folder")
    args = p.parse_args(argv)
    own_group = not dist.is_initialized()
    if own_group and "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    elif own_group:  # one process
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            where = [args.checkpoint_dir or tmp]
            dist.broadcast_object_list(where, src=0)  # every rank writes into rank 0's folder
            return _fine_tune(args, where[0])
    finally:
        if own_group:
            dist.destroy_process_group()


def _fine_tune(args, checkpoint: str) -> dict:
    half = args.steps // 2

    def fresh():
        model = build(args)
        return model, hd.MasterWeightOptimizer(torch.optim.AdamW, model.parameters(), lr=args.lr)

    model, opt = fresh()
    data = batches(args, model.config.vocab_size)
    first = run(model, opt, data, range(half))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=checkpoint)
    second = run(model, opt, data, range(half, args.steps))

    model2, opt2 = fresh()
    msd, osd = get_state_dict(model2, opt2)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    resumed = run(model2, opt2, data, range(half, args.steps))
    if dist.get_rank() == 0:
        print(f"{args.recipe} on {dist.get_world_size()} rank(s): loss {first[0]:.4f} -> {second[-1]:.4f}; "
              f"resumed from step {half}: {'bitwise the same' if resumed == second else 'DIFFERENT'} losses")
    return {"losses": first + second, "resumed": resumed}


if __name__ == "__main__":
    main()
