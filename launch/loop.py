"""``train(cfg)``: build, parallelize and train the model; the body of ``launch.train``.

Callable in-process on an initialised process group (tests run it on gloo ranks); under
``torchrun`` it initialises the group itself (NCCL on GPU, gloo on CPU). Returns the
summary dict, with every step's data-parallel-mean loss under ``"losses"``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.profiler import record_function

import hybrid_dist as hd
from hybrid_dist.fsdp2 import track_all_gather
from hybrid_dist.launch import checkpoint, torchao_baseline
from hybrid_dist.launch.config import TrainConfig, load_recipe
from hybrid_dist.launch.data import make_data
from hybrid_dist.launch.dry_run import check_alignment, check_tp
from hybrid_dist.launch.gc_policy import StepGC
from hybrid_dist.launch.mesh import ParallelDims
from hybrid_dist.launch.metrics import Meter
from hybrid_dist.launch.model import Transformer, apply_recipe
from hybrid_dist.launch.grad_clip import clip_grad_norm_
from hybrid_dist.launch.guards import NonFiniteLoss, first_nonfinite, nonfinite_amaxes, nonfinite_anywhere
from hybrid_dist.launch.heartbeat import CollectiveTimeout, Heartbeat, is_timeout, shorten_timeouts, timeout_message
from hybrid_dist.launch.inspect_stats import StepInspector
from hybrid_dist.launch.parallelize import (EP_API, all_gather_bytes_per_step, blocks_per_unit, expert_modules,
                                            needs_fsdp, parallelize, require)
from hybrid_dist.launch.presets import preset
from hybrid_dist.launch.profile import StepProfiler
from hybrid_dist.launch.quantized_init import check_quantized_init
from hybrid_dist.launch.read_back import ReadBackWindow
from hybrid_dist.launch.sequence_parallel import replicated_block_params, sync_replicated_grads
from hybrid_dist.launch.torchao_baseline import TORCHAO_FLOAT8


def init_distributed(timeout_s: float = 600.0) -> torch.device:
    """The process group (joined if already up) and this rank's device; a collective that
    waits longer than ``timeout_s`` for the other ranks fails the job."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        torch.cuda.init()  # before any module: NVFP4 SR states make their live keys on this device then
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if "RANK" in os.environ and attempt:  # a torchrun restart
            # torchrun's default (static) rendezvous keeps one store across restarts: without a
            # prefix per attempt the ranks would read the earlier attempt's gloo/NCCL addresses
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timeout)
            dist.init_process_group(backend, store=dist.PrefixStore(f"hd_attempt_{attempt}", store),
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                                    timeout=timeout)
        elif "RANK" in os.environ:  # under torchrun
            dist.init_process_group(backend, timeout=timeout)
        else:  # run as one process: a one-rank group over an in-memory store
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup`` steps, then cosine to ``lr * min_lr_ratio``."""
    if step <= cfg.warmup:
        return cfg.lr * step / max(cfg.warmup, 1)
    frac = (step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def set_lr(optimizer, lr: float) -> float:
    """``lr`` on every parameter group of ``optimizer``; returns it."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def compute_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype:
    """``--dtype``; ``auto`` is bf16 on GPU and fp32 on CPU."""
    return {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        cfg.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)


def build_model(cfg: TrainConfig, dims: ParallelDims, meshes, device: torch.device):
    """The parallelized model and the recipe. ``--init direct`` (CPU default) initialises
    weights before sharding (identical for every world size); ``--init meta`` (GPU default,
    for large presets) builds on the meta device and initialises the shards in place.
    ``--baseline torchao-float8`` builds ``nn.Linear`` projections and converts them with
    torchao instead of applying the (bf16) recipe."""
    mcfg = preset(cfg.preset, moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k, layers=cfg.layers)
    if cfg.seq_len > mcfg.max_seq_len:
        raise ValueError(f"--seq-len {cfg.seq_len} exceeds preset {cfg.preset!r}'s max_seq_len {mcfg.max_seq_len}")
    recipe = load_recipe(cfg.recipe)
    where = f"train (preset {cfg.preset}, recipe {recipe.name}, tp={dims.tp})"
    check_tp(mcfg, dims.tp, where)  # fail before building anything, with the config named
    check_alignment(mcfg, recipe, tp=dims.tp, tokens=cfg.batch_size * cfg.seq_len, where=where)
    compute = compute_dtype(cfg, device)
    torchao = cfg.baseline == TORCHAO_FLOAT8
    if torchao:
        torchao_baseline.check_available()  # before building anything
    linear = nn.Linear if torchao else hd.Linear
    torch.manual_seed(cfg.seed)
    on_meta = cfg.init == "meta" or (cfg.init == "auto" and device.type == "cuda" and not cfg.quantized_init)
    if mcfg.moe_experts:
        require("moe", EP_API, f"--moe-experts {mcfg.moe_experts}")
    ep_group = meshes.ep.get_group() if dims.ep > 1 else None
    if cfg.quantized_init:
        check_quantized_init(needs_fsdp=needs_fsdp(cfg, dims, compute), tp=dims.tp)
        with torch.device(device), hd.quantized_model_init(recipe, keep_high_precision_init=False):
            model = Transformer(mcfg, ep_group=ep_group)
    else:
        with torch.device("meta" if on_meta else device):
            model = Transformer(mcfg, ep_group=ep_group, linear=linear)
    if not on_meta:
        torch.manual_seed(cfg.seed)  # construction draws depend on the layout (e.g. experts per EP rank)
        model.init_weights()
    if torchao:
        torchao_baseline.convert(model)
    else:
        # one quantization per norm / SwiGLU output (opt-in), except where it cannot apply (compile, TP)
        apply_recipe(model, recipe, share_quantized_inputs=cfg.links_quantized_inputs)
    parallelize(model, cfg, dims, meshes, param_dtype=compute, device_type=device.type)
    if on_meta:  # with CPU offload the sharded parameters live on CPU, the buffers on the GPU
        model.to_empty(device="cpu" if cfg.cpu_offload else device)
        model.rope_cos, model.rope_sin = model.rope_cos.to(device), model.rope_sin.to(device)
        torch.manual_seed(cfg.seed)
        model.init_weights()
    return model, mcfg, recipe


def make_optimizer(model, cfg: TrainConfig):
    params = [p for p in model.parameters() if p.requires_grad]
    # fused AdamW on GPUs (torchtitan's default; one kernel per parameter group), foreach on CPU
    on_cuda = bool(params) and params[0].device.type == "cuda"
    kw = dict(lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=cfg.weight_decay, fused=on_cuda or None)
    if cfg.quantized_init:  # quantized parameters step through fp32 master copies
        return hd.MasterWeightOptimizer(torch.optim.AdamW, params, **kw)
    return torch.optim.AdamW(params, **kw)


def _mean_over(loss: torch.Tensor, group, size: int) -> torch.Tensor:
    """The data-parallel mean of ``loss``, on the device (no host sync)."""
    loss = loss.detach().float().clone()
    dist.all_reduce(loss, group=group)  # gloo has no AVG
    return loss / size


def _has_sharded_quantized_params(model) -> bool:
    return any(isinstance(getattr(p, "_local_tensor", None), hd.QuantizedTensor) for p in model.parameters())


def train_step(model, optimizer, tokens: torch.Tensor, cfg: TrainConfig, ep_group=None,
               after_step=None, host: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step on ``tokens [B, S+1]``; returns the (local) cross-entropy loss and
    the gradient norm before clipping (None without ``--grad-clip``), both on the device.
    ``after_step()`` runs after ``optimizer.step()`` (torchao's scale precompute). ``host``:
    filled with the seconds the host spent issuing the forward, backward and optimizer."""
    t0 = time.perf_counter()
    # a skipped step leaves the quantizer states (amax histories, SR keys) as they were too
    before = checkpoint.copy_quantizer_states(model, tokens.device) if cfg.on_nonfinite == "skip" else None
    with record_function("hd::forward"):
        logits, aux = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    t1 = time.perf_counter()
    with record_function("hd::backward"):
        (loss + cfg.moe_aux_loss_coef * aux if cfg.moe_experts else loss).backward()
        if getattr(model, "sp_group", None) is not None:  # norms computed on a part of the tokens each
            sync_replicated_grads(replicated_block_params(model), model.sp_group)
    t2 = time.perf_counter()
    if host is not None:
        host.update(forward=t1 - t0, backward=t2 - t1)
    with record_function("hd::optimizer"):
        norm = None
        if cfg.grad_clip > 0:
            experts = [p for m in expert_modules(model) for p in m.parameters()]
            norm = clip_grad_norm_(model.parameters(), cfg.grad_clip, expert_params=experts, ep_group=ep_group)
        if before is not None and nonfinite_anywhere(loss, norm):
            optimizer.zero_grad(set_to_none=True)  # no update from this batch on any rank
            checkpoint.load_quantizer_states(model, before, tokens.device)
            if host is not None:
                host["optimizer"] = time.perf_counter() - t2
            return loss, norm
        optimizer.step()
        if after_step is not None:
            after_step()
        optimizer.zero_grad(set_to_none=True)
    if host is not None:
        host["optimizer"] = time.perf_counter() - t2
    return loss, norm


def compile_stats(since: dict | None = None) -> dict:
    """What Dynamo did in this process (after ``since``, an earlier ``compile_stats()``):
    graphs compiled (one per distinct block structure when nothing recompiles) and graph
    breaks."""
    from torch._dynamo.utils import counters

    now = {"graphs": int(counters["stats"]["unique_graphs"]),
           "graph_breaks": int(sum(counters["graph_break"].values()))}
    return {k: v - (since or {}).get(k, 0) for k, v in now.items()}


def _run_info(cfg: TrainConfig, dims: ParallelDims, mcfg, recipe: hd.Recipe, start: int, data, unit: int) -> dict:
    """The metrics JSONL's ``start`` record: what was run (the throughput table reads it);
    ``unit``: the blocks per FSDP unit that ``--fsdp-unit`` resolved to."""
    return {"name": cfg.name, "recipe": recipe.name, "baseline": cfg.baseline, "preset": cfg.preset,
            "n_layers": mcfg.n_layers, "world_size": dims.world_size, "fsdp": dims.fsdp, "hsdp": dims.hsdp,
            "tp": dims.tp, "ep": dims.ep, "start_step": start, "moe_experts": mcfg.moe_experts,
            "moe_top_k": mcfg.moe_top_k, "params": mcfg.num_params(), "batch_size": cfg.batch_size,
            "seq_len": cfg.seq_len, "quantized_init": cfg.quantized_init, "compile": cfg.compile,
            "inspect_every": cfg.inspect_every,
            "activation_checkpointing": cfg.activation_checkpointing, "timing_warmup": cfg.timing_warmup,
            "reshard_after_forward": cfg.reshard_after_forward, "fsdp_unit": unit,
            "fsdp_prefetch": cfg.fsdp_prefetch, "entropy_floor": data.entropy_floor, "log_vocab": math.log(mcfg.vocab_size)}


def report_nonfinite_amaxes(model, step: int, reported: set) -> None:
    """Warn on rank 0, once per slot, of delayed-scaling amaxes that were NaN or inf."""
    bad = [b for b in nonfinite_amaxes(model) if b not in reported]
    if bad and dist.get_rank() == 0:
        print(f"warning: step {step}: non-finite amax recorded by {', '.join(bad)} (their inputs or gradients held "
              "NaN or inf; delayed scaling keeps the last finite scale)", flush=True)
    reported.update(bad)


def run_identity(cfg: TrainConfig) -> dict:
    """What must match for a checkpoint to continue this run (kept in its COMPLETE record)."""
    return {"preset": cfg.preset, "layers": cfg.layers, "recipe": cfg.recipe, "baseline": cfg.baseline,
            "moe_experts": cfg.moe_experts, "moe_top_k": cfg.moe_top_k, "quantized_init": cfg.quantized_init,
            "seed": cfg.seed, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len}


def resume_source(cfg: TrainConfig) -> str | None:
    """Where this run resumes from: ``--resume``; or, when ``torchrun`` restarted the job
    (``TORCHELASTIC_RESTART_COUNT`` > 0), the newest finished step in ``--checkpoint-dir``.
    A checkpoint directory that already holds steps of another run, or of this run without
    ``--resume`` on a first start, is refused (its steps would be overwritten or mixed)."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    resume = cfg.resume
    done = checkpoint.complete_steps(cfg.checkpoint_dir) if cfg.checkpoint_dir else []
    if done:
        record = checkpoint.complete_record(done[-1])
        if record.get("run") != run_identity(cfg):
            raise ValueError(
                f"--checkpoint-dir {cfg.checkpoint_dir!r} holds checkpoints of another run ({record.get('run')}); "
                "use a new directory for this configuration")
        if resume is None and restarted:
            resume = cfg.checkpoint_dir
        elif resume is None:
            raise ValueError(
                f"--checkpoint-dir {cfg.checkpoint_dir!r} already holds this run's checkpoints (newest "
                f"{os.path.basename(done[-1])}); pass --resume {cfg.checkpoint_dir} to continue it, or use an "
                "empty directory")
    return resume


def check_loss(loss: float, step: int, cfg: TrainConfig, *, grad_norm: float | None = None,
               locate=None) -> None:
    """A non-finite (data-parallel mean) loss or (global) gradient norm: a warning with
    ``--on-nonfinite skip``, else ``NonFiniteLoss`` on every rank. ``locate()``: where the
    state is non-finite now (called only then; a collective: every rank sees the same
    values, so all call it)."""
    if math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm)):
        return
    what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {grad_norm} (loss {loss:.4f})"
    if cfg.on_nonfinite == "skip":
        if dist.get_rank() == 0:
            print(f"warning: step {step}: {what} on some rank; the step was skipped (--on-nonfinite skip)",
                  flush=True)
        return
    where = f"; {locate()}" if locate is not None else ""
    raise NonFiniteLoss(
        f"step {step}: {what}{where} (every rank stops; no checkpoint is written from this state). Resume "
        f"from the last checkpoint with a lower --lr or --grad-clip, or check the data.")


def nonfinite_place(model, optimizer, device: torch.device, read_at: int) -> str:
    """The first non-finite parameter (``guards.first_nonfinite``) after step ``read_at``,
    the read-back step at which a non-finite step was found."""
    place = first_nonfinite(model, optimizer, device=device)
    if place is None:
        return f"every parameter and gradient is finite after step {read_at}"
    return f"first non-finite after step {read_at}: {place}"


@contextlib.contextmanager
def named_laggards(heartbeat: Heartbeat, current_step, cfg: TrainConfig, start: int):
    """A collective timeout inside the block becomes ``CollectiveTimeout`` naming the ranks
    behind this one (``launch.heartbeat``)."""
    try:
        yield
    except RuntimeError as e:
        if not is_timeout(e):
            raise
        step = current_step()
        first = step == start + 1
        seconds = max(cfg.first_step_timeout, cfg.collective_timeout) if first else cfg.collective_timeout
        raise CollectiveTimeout(timeout_message(heartbeat, step, seconds)) from e


def _make_meter(cfg: TrainConfig, dims: ParallelDims, model, mcfg, recipe, start: int, data, device):
    """``(meter, measured, hp_ag_bytes)``: whether hybrid_dist.fsdp2 counts the quantized
    all-gathers (sharded quantized parameters), and the estimated high-precision bytes."""
    measured = _has_sharded_quantized_params(model)
    hp_ag_bytes = all_gather_bytes_per_step(model, dims, 2 if compute_dtype(cfg, device) == torch.bfloat16 else 4,
                                            skip_quantized=measured, reshard=cfg.reshard_after_forward,
                                            blocks_per_unit=cfg.fsdp_unit)
    meter = Meter(total_steps=cfg.steps, flops_per_token=mcfg.flops_per_token(cfg.seq_len),
                  world_size=dims.world_size, device=device, rank=dist.get_rank(), jsonl_path=cfg.metrics,
                  log_every=cfg.log_every, quiet=cfg.quiet, ag_measured=measured,
                  ag_bytes_per_step=hp_ag_bytes, timing_warmup=cfg.timing_warmup,
                  run=_run_info(cfg, dims, mcfg, recipe, start, data, blocks_per_unit(model, cfg.fsdp_unit)))
    return meter, measured, hp_ag_bytes


def train(cfg: TrainConfig) -> dict:
    compiled_before = compile_stats()  # the summary counts this run's compilation only
    device = init_distributed(max(cfg.first_step_timeout, cfg.collective_timeout))
    cfg.check_device(device.type)
    dims = ParallelDims(world_size=dist.get_world_size(), hsdp=cfg.hsdp, fsdp=cfg.fsdp, tp=cfg.tp, ep=cfg.ep)
    meshes = dims.build_meshes(device.type)
    model, mcfg, recipe = build_model(cfg, dims, meshes, device)
    optimizer = make_optimizer(model, cfg)
    data = make_data(cfg.data, vocab_size=mcfg.vocab_size, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                     seed=cfg.seed, dp_rank=meshes.dp.get_local_rank(), dtype=cfg.data_dtype)
    resume = resume_source(cfg)
    start = checkpoint.load(resume, model, optimizer, device) if resume else 0
    meter, measured, hp_ag_bytes = _make_meter(cfg, dims, model, mcfg, recipe, start, data, device)
    after_step = torchao_baseline.after_step(model) if cfg.baseline == TORCHAO_FLOAT8 else None
    inspector = StepInspector(model, every=cfg.inspect_every, start=start, rank=dist.get_rank(), device=device)
    losses, reported = [], set()
    window = ReadBackWindow(cfg, start, meter, data, device)
    profiler = StepProfiler(cfg.profile_step, cfg.profile_steps, rank=dist.get_rank(), trace=cfg.profile_trace,
                            host=not cfg.profile_device_only)
    heartbeat, step = Heartbeat(dist.get_rank(), dist.get_world_size()), start + 1
    collector = StepGC(cfg.gc_every, start, cfg.timing_warmup)
    with track_all_gather() as acct, named_laggards(heartbeat, lambda: step, cfg, start), \
            contextlib.closing(collector):
        for step in range(start + 1, cfg.steps + 1):
            lr = set_lr(optimizer, lr_at(cfg, step))
            tokens = window.batch(step)
            with profiler.around(step), inspector.capture(step):
                host = {}
                loss, norm = train_step(model, optimizer, tokens, cfg, meshes.ep.get_group() if meshes.ep else None,
                                        after_step=after_step, host=host)
            records = inspector.records(step)
            if records is not None:
                meter.inspect(step, records)
            if measured:
                meter.ag_bytes = hp_ag_bytes + acct.total_output_bytes()
                acct.reset()
            window.add(step, _mean_over(loss, meshes.dp.get_group(), dims.dp), norm,
                       tokens=tokens[:, 1:].numel() * dims.dp, lr=lr, ag_bytes=meter.ag_bytes, host_s=host)
            collector.after_step(step)
            if not window.due(step, records is not None):
                heartbeat.beat(step)
                continue
            locate = functools.partial(nonfinite_place, model, optimizer, device, step)  # called only on failure
            for s, loss_v, norm_v in window.read_back():  # the first non-finite step of the window stops the run
                losses.append(loss_v)
                check_loss(loss_v, s, cfg, grad_norm=norm_v, locate=locate)  # same values on every rank: all stop
            if step % cfg.log_every == 0 or step == cfg.steps:
                report_nonfinite_amaxes(model, step, reported)
            if cfg.save_every and step % cfg.save_every == 0:
                checkpoint.save(cfg.checkpoint_dir, step, model, optimizer, device, run=run_identity(cfg))
            heartbeat.beat(step)
            if step == start + 1:  # setup, compilation and the first step are done on this rank
                shorten_timeouts(cfg.collective_timeout)
    extra = {"entropy_floor": data.entropy_floor, "log_vocab": math.log(mcfg.vocab_size)}
    if cfg.compile:
        extra["compile_stats"] = compile_stats(since=compiled_before)
    summary = meter.finish(extra)
    return {**summary, "losses": losses}
