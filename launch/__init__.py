"""hybrid_dist.launch: the end-to-end training job (docs/design.md §3).

``torchrun --nproc-per-node N -m hybrid_dist.launch.train [options]`` trains a Llama-style
dense or MoE model under any recipe with FSDP2/HSDP/TP/EP; ``python -m
hybrid_dist.launch.plot RUN.jsonl ... --out X.png`` plots runs (with a heatmap of the
quantization statistics of ``--inspect-every`` runs); ``python -m hybrid_dist.launch.advise
RUN.jsonl`` proposes a per-layer recipe from them. In-process:
``launch.loop.train(TrainConfig(...))`` (joins an initialised process group, else runs as
one process) and
``launch.dry_run.dry_run(TrainConfig(...), world_size=N)`` (module names, so not re-exported).

Files: ``config`` (options), ``presets`` (model shapes), ``model`` (the decoder),
``moe_mlp``, ``data``, ``mesh`` (device mesh), ``parallelize`` (TP/AC/compile/FSDP2),
``grad_clip``, ``checkpoint`` (DCP: atomic, verified steps), ``guards`` (non-finite loss
and amax checks), ``metrics`` (progress, JSONL), ``loop`` (the training loop), ``dry_run``,
``plot``, ``quantized_init``, ``torchao_baseline`` (``--baseline torchao-float8``),
``inspect_stats`` (``--inspect-every``), ``inspect_records`` (reading them), ``plot_inspect``
(the heatmap), ``advice`` (the advisor's rule), ``advise_report`` (its outputs), ``advise``.
"""

from hybrid_dist.launch.config import TrainConfig
from hybrid_dist.launch.model import Transformer
from hybrid_dist.launch.presets import PRESETS, ModelConfig

__all__ = ["PRESETS", "ModelConfig", "TrainConfig", "Transformer"]
