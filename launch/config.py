"""``TrainConfig`` (every option of the training job) and its command-line parser.

The parser maps ``--flag-name`` to the field ``flag_name``; ``parse_args(argv)`` returns a
validated config, so tests build the same object in-process with ``TrainConfig(...)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import os
from typing import Sequence

import hybrid_dist as hd
from hybrid_dist.launch.presets import PRESETS


BASELINES = ("none", "torchao-float8")
RESHARD_POLICIES = ("default", "always", "never")  # --reshard-after-forward


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    preset: str = "tiny"
    layers: int = 0                 # 0 = the preset's n_layers; N overrides it (e.g. a shorter 8b stack)
    recipe: str = "bf16"            # a name in hd.RECIPE_NAMES, "package.module:attr" or "file.py:attr"
    baseline: str = "none"          # none, or torchao-float8 (torchao's float8 tensorwise training)
    steps: int = 100
    batch_size: int = 4             # sequences per data-parallel rank
    seq_len: int = 64
    lr: float = 3e-3
    warmup: int = 10
    min_lr_ratio: float = 0.1       # cosine decay to lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    fsdp: int = -1                  # dp_shard degree; -1 = world / (hsdp * tp)
    hsdp: int = 1                   # dp_replicate degree (HSDP when > 1)
    tp: int = 1
    sequence_parallel: bool = False  # with --tp: the blocks' residual stream split along the sequence
    ep: int = 1                     # expert parallel, carved out of the fsdp axis
    moe_experts: int = 0            # 0 = dense MLP
    moe_top_k: int = 2
    moe_aux_loss_coef: float = 0.01  # weight of the MoE load-balancing loss
    dtype: str = "auto"             # compute dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp32
    init: str = "auto"              # meta (build on meta, init after sharding), direct, auto (meta on GPU)
    quantized_init: bool = False
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    fsdp_copy_in: str = "auto"      # FSDP2's gradient copy-in before reduce-scatter: auto, hd or torch (its own)
    reshard_after_forward: str = "default"  # default (every unit but the last), always or never
    fsdp_unit: int = 0              # consecutive blocks per fully_shard unit (0 = by block size)
    fsdp_prefetch: int = 0          # units whose forward all-gathers each unit issues early (0 = FSDP2's own)
    compile: bool = False
    share_quantized_inputs: bool = False  # norms / SwiGLU quantize once for their consumers (opt-in: see README)
    data: str | None = None         # .npy or raw token file; None = synthetic Markov stream
    data_dtype: str = "uint16"
    checkpoint_dir: str | None = None
    save_every: int = 0
    resume: str | None = None       # a checkpoint step dir, or a checkpoint_dir (latest step)
    metrics: str | None = None      # JSONL path (rank 0 writes)
    log_every: int = 10
    inspect_every: int = 0          # quantization statistics every N steps into --metrics (0 = off)
    timing_warmup: int = 2          # first steps left out of the summary's tokens/s (allocator, JIT, compile)
    gc_every: int = 50              # Python GC after warm-up: survivors frozen, collected every N steps (0 = auto)
    run_name: str | None = None
    quiet: bool = False
    profile_step: int = 0           # profile this step on rank 0 and print where its time went (0 = off)
    profile_steps: int = 1          # profile this many consecutive steps from --profile-step (one trace)
    profile_device_only: bool = False  # record device activity only, not host ops
    profile_trace: str | None = None  # also write the profiled steps' Chrome trace here (gzipped if it ends in .gz)
    collective_timeout: float = 300.0  # seconds a collective may wait for the other ranks, after the first step
    first_step_timeout: float = 600.0  # the same until the first step is done (setup, compilation, resume)
    on_nonfinite: str = "stop"      # a NaN/inf loss: stop the job, or skip that step on every rank

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"--preset {self.preset!r} is unknown; choose one of {', '.join(PRESETS)}")
        for name in ("steps", "batch_size", "seq_len", "hsdp", "tp", "ep", "log_every", "profile_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.fsdp_prefetch < 0:
            raise ValueError(f"--fsdp-prefetch must be >= 0 (0 = FSDP2's implicit prefetch), got {self.fsdp_prefetch}")
        if self.fsdp_unit < 0:
            raise ValueError(f"--fsdp-unit must be >= 0 (0 = by block size), got {self.fsdp_unit}")
        if self.layers < 0:
            raise ValueError(f"--layers must be >= 1 (or 0 for the preset's depth), got {self.layers}")
        if self.fsdp_copy_in not in ("auto", "hd", "torch"):
            raise ValueError(f"--fsdp-copy-in must be auto, hd or torch, got {self.fsdp_copy_in!r}")
        if self.reshard_after_forward not in RESHARD_POLICIES:
            raise ValueError(f"--reshard-after-forward must be one of {', '.join(RESHARD_POLICIES)}, "
                             f"got {self.reshard_after_forward!r}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"--on-nonfinite must be stop or skip, got {self.on_nonfinite!r}")
        for name in ("collective_timeout", "first_step_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.inspect_every < 0:
            raise ValueError(f"--inspect-every must be >= 0 (0 = off), got {self.inspect_every}")
        if self.inspect_every and not self.metrics:
            raise ValueError(f"--inspect-every {self.inspect_every} writes to the metrics file: pass --metrics PATH")
        if self.gc_every < 0:
            raise ValueError(f"--gc-every must be >= 0 (0 = Python's automatic collector), got {self.gc_every}")
        if self.timing_warmup < 0:
            raise ValueError(f"--timing-warmup must be >= 0, got {self.timing_warmup}")
        if self.baseline not in BASELINES:
            raise ValueError(f"--baseline {self.baseline!r} is unknown; choose one of {', '.join(BASELINES)}")
        if self.recipe not in hd.RECIPE_NAMES and ":" not in self.recipe:
            raise ValueError(f"--recipe {self.recipe!r} is unknown; choose one of {', '.join(hd.RECIPE_NAMES)} "
                             "or give package.module:attr or path/to/file.py:attr")
        if self.baseline != "none":
            self._check_baseline()
        if self.fsdp != -1 and self.fsdp < 1:
            raise ValueError(f"--fsdp must be >= 1 (or -1 for 'all remaining ranks'), got {self.fsdp}")
        if self.dtype not in ("auto", "bf16", "fp32"):
            raise ValueError(f"--dtype must be auto, bf16 or fp32, got {self.dtype!r}")
        if self.init not in ("auto", "meta", "direct"):
            raise ValueError(f"--init must be auto, meta or direct, got {self.init!r}")
        if self.init == "meta" and self.quantized_init:
            raise NotImplementedError("--init meta with --quantized-init is not supported: quantized weights are "
                                      "made at construction; use --init direct")
        if self.save_every and not self.checkpoint_dir:
            raise ValueError("--save-every needs --checkpoint-dir DIR")
        if self.ep > 1 and not self.moe_experts:
            raise ValueError(f"--ep {self.ep} needs an MoE model: pass --moe-experts N (a multiple of {self.ep})")
        if self.sequence_parallel:
            self._check_sequence_parallel()

    def check_device(self, device_type: str) -> None:
        """Refuses what is known to fail on ``device_type``: compiled MoE blocks with
        ``fp8_block`` on CPU (inductor's C++ code generation fails on the experts, torch 2.13)."""
        if not (self.compile and self.moe_experts):
            return
        if device_type == "cpu" and self.recipe == "fp8_block":
            raise NotImplementedError(
                "--compile with --moe-experts and --recipe fp8_block on CPU: inductor fails to compile the "
                "experts; train this model without --compile")

    def _check_sequence_parallel(self) -> None:
        if self.tp < 2:
            raise ValueError("--sequence-parallel splits the sequence over the TP ranks: it needs --tp 2 or more")
        if self.moe_experts:
            raise ValueError("--sequence-parallel with --moe-experts: the experts would each see a part of the "
                             "tokens; run MoE models without --sequence-parallel")
        if self.seq_len % self.tp:
            raise ValueError(f"--sequence-parallel: --seq-len {self.seq_len} must be a multiple of --tp {self.tp}")

    def _check_baseline(self) -> None:
        if self.recipe != "bf16":
            raise ValueError(f"--baseline {self.baseline} replaces the recipe; it needs --recipe bf16 (the default), "
                             f"got --recipe {self.recipe}")
        for flag, on in (("--quantized-init", self.quantized_init), ("--moe-experts", self.moe_experts),
                         ("--tp > 1", self.tp > 1)):
            if on:
                raise NotImplementedError(f"--baseline {self.baseline} with {flag} is not supported (torchao "
                                          "converts the dense nn.Linear layers only); drop one of the two")

    @property
    def links_quantized_inputs(self) -> bool:
        """``--share-quantized-inputs`` where it can apply: not with ``--compile`` (a
        ``QuantizedTensor`` crossing modules breaks the graph) nor ``--tp`` (TP input styles)."""
        return self.share_quantized_inputs and not self.compile and self.tp == 1

    @property
    def name(self) -> str:
        base = self.recipe if self.baseline == "none" else self.baseline
        return self.run_name or f"{self.preset}-{base}"


def load_recipe(spec: str) -> hd.Recipe:
    """A named recipe, or ``MODULE:ATTR`` where MODULE is a dotted module name
    (``package.module``) or a Python file path (``runs/advised.py``) and ATTR names an
    ``hd.Recipe`` or a function returning one."""
    if spec in hd.RECIPE_NAMES:
        return hd.recipe_from_name(spec)
    if ":" not in spec:
        raise ValueError(f"--recipe {spec!r}: use one of {', '.join(hd.RECIPE_NAMES)}, 'package.module:attr' "
                         "or 'path/to/file.py:attr'")
    where, attr = spec.rsplit(":", 1)
    module = _recipe_module(where, spec)
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ValueError(f"--recipe {spec!r}: {where} has no attribute {attr!r} (it has: {', '.join(public)})")
    obj = getattr(module, attr)
    recipe = obj if isinstance(obj, hd.Recipe) else obj() if callable(obj) else obj
    if not isinstance(recipe, hd.Recipe):
        raise ValueError(f"--recipe {spec!r} gave {type(recipe).__name__}; it must be (or return) an hd.Recipe")
    return recipe


def _recipe_module(where: str, spec: str):
    """The module of a ``--recipe MODULE:ATTR``: a file when ``where`` ends in ``.py`` or
    contains a path separator, else a dotted module name."""
    if where.endswith(".py") or os.sep in where:
        if not os.path.isfile(where):
            raise ValueError(f"--recipe {spec!r}: no such file {where!r}")
        name = "hd_recipe_" + os.path.splitext(os.path.basename(where))[0].replace("-", "_")
        file_spec = importlib.util.spec_from_file_location(name, os.path.abspath(where))
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise ValueError(f"--recipe {spec!r}: cannot import {where!r} ({e}); give a dotted module name on "
                         "the Python path or a path to a .py file") from None


_HELP = {
    "preset": "model shape: tiny (CPU), 125m, 1b, 8b (Llama-3-8B shaped)",
    "layers": "number of blocks (0 = the preset's), e.g. a shorter 8b stack that fits fewer GPUs",
    "recipe": "a named recipe (bf16, fp8_current, mxfp8_fwd_nvfp4_bwd, ...), package.module:attr or "
              "path/to/file.py:attr (e.g. a recipe written by hybrid_dist.launch.advise)",
    "baseline": "none, or torchao-float8: torchao float8 tensorwise training with float8 FSDP all-gather "
                "(needs torchao; with --recipe bf16)",
    "timing_warmup": "first steps left out of the summary's tokens/s and MFU",
    "gc_every": "Python's garbage collector after the warm-up steps: objects alive then frozen, automatic "
                "collection off, a full collection of the rest every N steps (0 = Python's automatic collector)",
    "batch_size": "sequences per data-parallel rank (batch*seq must fit the recipe's blocks: 128 for fp8_block)",
    "fsdp": "FSDP (dp_shard) degree; -1 = world / (hsdp*tp)",
    "hsdp": "HSDP replicas (dp_replicate degree)",
    "tp": "tensor-parallel degree (hybrid_dist.tensor_parallel styles)",
    "sequence_parallel": "with --tp: split the blocks' residual stream along the sequence; one gather of each "
                         "normed input (quantized where the recipe allows) and a reduce-scatter after wo / w2 "
                         "instead of an all-reduce (dense models)",
    "ep": "expert-parallel degree, carved out of --fsdp (needs --moe-experts)",
    "moe_experts": "number of routed experts (0 = dense MLP)",
    "dtype": "compute dtype: auto (bf16 on GPU, fp32 on CPU), bf16, fp32",
    "init": "auto, meta (build on meta, initialise the shards) or direct",
    "quantized_init": "create block weights as QuantizedTensors (hd.quantized_model_init)",
    "activation_checkpointing": "recompute each block in backward",
    "cpu_offload": "FSDP2 CPU offload of sharded parameters (GPU only)",
    "fsdp_copy_in": "FSDP2's packing of gradients before each reduce-scatter: hd (hybrid_dist.fsdp2."
                    "grad_copy_in: the same bytes, one copy per parameter), torch (torch._chunk_cat, host work "
                    "per 2 KiB of gradient) or auto (hd where this torch's FSDP2 allows it, else torch)",
    "reshard_after_forward": "FSDP2 blocks' weights after forward: default (resharded, then gathered again "
                             "in backward, except the last unit's), always, or never (kept unsharded until "
                             "backward: no backward all-gathers, the memory of every block's unsharded weights)",
    "fsdp_unit": "blocks per FSDP2 unit: fully_shard of N consecutive blocks, gathered and reduced together "
                 "(one all-gather, one reduce-scatter and FSDP2's per-unit host work for N blocks; N blocks' "
                 "unsharded weights in memory at once; with --ep, the unit's experts form one group too); 0 "
                 "(default): the fewest blocks holding 200M parameters, at most a quarter of them (the 8b: 1, "
                 "the 1b: 4, whose FP8 step is otherwise bound by the host)",
    "fsdp_prefetch": "N > 0: each FSDP2 unit issues the forward all-gathers of the next N units as soon as its "
                     "own are copied out (FSDP2's explicit prefetch; N more units' weights in memory at most), "
                     "so a host running behind the GPU still starts each gather a unit ahead; 0 (default): "
                     "FSDP2's implicit prefetch, each gather issued at its unit's own pre-forward",
    "compile": "torch.compile each block (with hd.compile_options(): layers reading one tensor share its "
               "FP8 cast)",
    "share_quantized_inputs": "quantize each norm / SwiGLU output once for the layers reading it "
                              "(hd.link_quantized_input, eager; --compile shares casts by itself; not with --tp)",
    "data": "tokens as .npy or raw binary (--data-dtype); default: synthetic Markov stream",
    "save_every": "save a DCP checkpoint to --checkpoint-dir every N steps",
    "resume": "a checkpoint step dir, or a --checkpoint-dir (latest step)",
    "metrics": "metrics JSONL path (rank 0 appends)",
    "log_every": "print progress and read losses back every N steps (the host queues the steps between "
                 "without waiting for the device; every step's loss is still checked and written)",
    "inspect_every": "every N steps (and the first), write per-layer quantization statistics (amax, SQNR, "
                     "underflow, saturation, block-scale histogram; used and candidate formats) to --metrics; "
                     "0 = off",
    "on_nonfinite": "a NaN/inf loss: stop (every rank, nothing saved from that state) or skip (that step's "
                    "update is dropped on every rank; costs one all-reduce and a sync per step)",
    "collective_timeout": "seconds a collective waits for the other ranks (a frozen or lost rank) before "
                          "the job fails, once the first step is done; the error names the ranks behind",
    "first_step_timeout": "the same until every rank finished its first step (setup, compilation, resume)",
    "profile_step": "profile this step (torch.profiler) and print its top kernels and host regions on rank 0",
    "profile_steps": "profile this many consecutive steps from --profile-step as one trace; the device is "
                     "waited for only after the last, so the later ones show the steady state",
    "profile_device_only": "profile device activity only, not host ops (no host regions in the summary; "
                           "the CUDA activity tracing still slows the host)",
    "profile_trace": "write the profiled steps' Chrome trace to this path (gzipped when it ends in .gz; "
                     "python -m benchmarks.trace_summary reads it)",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybrid_dist.launch.train",
                                description="Train a Llama-style model with a hybrid low-precision recipe.")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", default=f.default, help=_HELP.get(f.name))
            continue
        kind = {"int": int, "float": float}.get(str(f.type), str)
        help_ = _HELP.get(f.name, "") + (f" (default: {f.default})" if f.default is not None else "")
        p.add_argument(flag, type=kind, default=f.default, help=help_)
    p.add_argument("--dry-run", action="store_true", help="validate the configuration for --world-size ranks")
    p.add_argument("--world-size", type=int, default=None, help="ranks to validate with --dry-run")
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
    ns = build_parser().parse_args(argv)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    return TrainConfig(**{k: v for k, v in vars(ns).items() if k in fields}), ns
