"""``torchrun`` script: the launcher's ``main`` with a ``train`` that fails on rank 1 while
it has a collective in flight that rank 0 never matches, and rank 0 waits in another.
Used by ``test_launch_crash.py``; argv: the backend (``gloo`` or ``nccl``)."""

import os
import sys

import torch
import torch.distributed as dist

from hybrid_dist.launch import loop
from hybrid_dist.launch.train import main


def _train(cfg):
    backend = sys.argv[1]
    dist.init_process_group(backend)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    t = torch.ones(4, device=device)
    if dist.get_rank() == 1:
        dist.all_gather_into_tensor(torch.empty(8, device=device), t, async_op=True)  # left pending
        raise RuntimeError("injected fault on rank 1")
    dist.all_reduce(t)
    print(t.sum().item(), flush=True)  # waits for a collective rank 1 never joins


loop.train = _train
sys.exit(main(["--preset", "tiny", "--steps", "1"]))
