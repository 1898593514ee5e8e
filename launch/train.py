"""Entry point: ``torchrun --nproc-per-node N -m hybrid_dist.launch.train [options]``.

Trains a Llama-style model (``--preset tiny|125m|1b|8b``, ``--moe-experts`` for MoE)
under any recipe (``--recipe NAME``, ``package.module:attr`` or ``path/file.py:attr``) with FSDP2/HSDP
(``--fsdp``, ``--hsdp``), tensor and expert parallelism (``--tp``, ``--ep``), and prints a
progress line per step on rank 0. ``--dry-run --world-size N`` validates a configuration
for N ranks on one CPU without training (see ``launch/dry_run.py``).

Example (2 CPU ranks, < 2 min)::

    torchrun --nproc-per-node 2 -m hybrid_dist.launch.train --preset tiny \\
        --recipe mxfp8_fwd_nvfp4_bwd --fsdp 2 --steps 60 --metrics runs/tiny.jsonl
"""

from __future__ import annotations

import gc
import os
import sys
import traceback

import torch.distributed as dist

from hybrid_dist.launch.config import parse_args


def _error(e: Exception, *, every_rank: bool = False) -> int:
    """Bad input or a stopped run: one line on rank 0 (every rank raises the same), or on
    each rank that raised it (``every_rank``: a collective timeout), exit 2."""
    if every_rank or int(os.environ.get("RANK", "0")) == 0:
        print(f"hybrid_dist.launch.train: error: {e}", file=sys.stderr, flush=True)
    return 2


def _exit_on_unexpected_error() -> None:
    """An unexpected error on one rank of several: print its traceback and end the process
    at once. The orderly shutdown (``destroy_process_group``, or aborting the groups) waits
    for this rank's collectives in flight, which the other ranks, waiting for this rank in
    theirs, never complete (NCCL and gloo alike); once this rank exits, ``torchrun`` stops
    the others and the job fails with this traceback."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    print(f"hybrid_dist.launch.train: rank {dist.get_rank()} failed:", file=sys.stderr)
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, ns = parse_args(argv)
    except (ValueError, NotImplementedError) as e:
        return _error(e)
    if ns.dry_run:
        from hybrid_dist.launch.dry_run import dry_run, format_report

        if ns.world_size is None:
            raise ValueError("--dry-run needs --world-size N (the number of ranks to validate for)")
        print(format_report(dry_run(cfg, world_size=ns.world_size)))
        return 0
    from hybrid_dist.launch.guards import NonFiniteLoss
    from hybrid_dist.launch.heartbeat import CollectiveTimeout
    from hybrid_dist.launch.loop import train

    try:
        train(cfg)
    except (ValueError, NotImplementedError, ImportError, NonFiniteLoss) as e:
        return _error(e)
    except CollectiveTimeout as e:
        return _error(e, every_rank=True)
    except Exception:
        _exit_on_unexpected_error()
        raise
    finally:
        # the model and optimizer are in reference cycles (FSDP2's hooks): free them, and the
        # collectives' work objects they hold, while the interpreter is alive; left to its
        # shutdown, a gloo worker thread could still hold one and abort the process
        # ("terminate called without an active exception") after a finished run
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
