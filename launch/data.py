"""Training data: a learnable synthetic Markov stream (default) or a tokenized file.

Both sources are stateless: ``batch(step)`` is a pure function of ``(seed, step,
dp_rank)``, so a resumed run reads exactly the batches the uninterrupted run would have.
A batch is ``tokens [B, S+1]`` int64; inputs are ``tokens[:, :-1]``, targets ``tokens[:, 1:]``.

Synthetic: a fixed random first-order Markov chain over the vocabulary in which each token
has ``branching`` successors with random (Dirichlet) probabilities. A model can learn it
down to the chain's conditional entropy (``entropy_floor``, ≈ log(branching) nats), far
below the ``log(vocab)`` of an untrained model.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _batch_seed(seed: int, step: int, dp_rank: int) -> int:
    return ((seed * 1_000_003 + step) * 65_537 + dp_rank) % (2**63)


def _distinct_rows(vocab_size: int, branching: int, g: torch.Generator) -> torch.Tensor:
    """``[V, branching]`` token ids, distinct within each row: uniform draws, rows with a
    repeat drawn again (O(V·branching); a randperm per row was O(V²), minutes at V=128k)."""
    rows = torch.randint(vocab_size, (vocab_size, branching), generator=g)
    while True:
        s = rows.sort(-1).values
        dup = (s[:, 1:] == s[:, :-1]).any(-1)
        if not bool(dup.any()):
            return rows
        rows[dup] = torch.randint(vocab_size, (int(dup.sum()), branching), generator=g)


class SyntheticMarkov:
    def __init__(self, *, vocab_size: int, batch_size: int, seq_len: int, seed: int = 0,
                 dp_rank: int = 0, branching: int = 4):
        if branching > vocab_size:
            raise ValueError(f"SyntheticMarkov: branching={branching} exceeds vocab_size={vocab_size}")
        self.batch_size, self.seq_len, self.seed, self.dp_rank = batch_size, seq_len, seed, dp_rank
        g = torch.Generator().manual_seed(10_000 + seed)  # the chain is the same on every rank
        self.successors = _distinct_rows(vocab_size, branching, g)           # [V, branching]
        probs = -torch.log(torch.rand(vocab_size, branching, generator=g))  # Exp(1) draws
        self.probs = probs / probs.sum(-1, keepdim=True)                     # Dirichlet(1) rows
        self.vocab_size = vocab_size

    @property
    def entropy_floor(self) -> float:
        """Expected conditional entropy (nats/token) under a uniform token marginal."""
        p = self.probs.double()
        return float(-(p * p.log()).sum(-1).mean())

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_batch_seed(self.seed, step, self.dp_rank))
        b, s = self.batch_size, self.seq_len + 1
        u = torch.rand(s, b, generator=g)  # [S+1, B]: each step reads a contiguous row
        first = torch.randint(self.vocab_size, (b,), generator=g)
        # the walk in numpy (a few µs per position; torch ops cost ~10x more per call):
        # successor index = number of cdf entries below u (= searchsorted left), clamped
        cdf, succ, u_np = self.probs.cumsum(-1).numpy(), self.successors.numpy(), u.numpy()
        last = cdf.shape[1] - 1
        out = np.empty((s, b), dtype=np.int64)
        out[0] = first.numpy()
        for t in range(1, s):
            prev = out[t - 1]
            idx = np.minimum((cdf[prev] < u_np[t, :, None]).sum(-1), last)
            out[t] = succ[prev, idx]
        return torch.from_numpy(np.ascontiguousarray(out.T))


class TokenFile:
    """Random windows of a flat token file: ``.npy`` (memory-mapped) or raw ``dtype`` binary."""

    def __init__(self, path: str, *, batch_size: int, seq_len: int, vocab_size: int, seed: int = 0,
                 dp_rank: int = 0, dtype: str = "uint16"):
        if path.endswith(".npy"):
            self.tokens = np.load(path, mmap_mode="r")
        else:
            self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        if self.tokens.ndim != 1 or len(self.tokens) < seq_len + 2:
            raise ValueError(f"TokenFile: {path} must hold a flat token array longer than seq_len+1="
                             f"{seq_len + 1}; got shape {self.tokens.shape}")
        self.batch_size, self.seq_len, self.seed, self.dp_rank = batch_size, seq_len, seed, dp_rank
        self.vocab_size = vocab_size
        self.entropy_floor = math.nan

    def batch(self, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_batch_seed(self.seed, step, self.dp_rank))
        starts = torch.randint(len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=g)
        rows = [np.asarray(self.tokens[i:i + self.seq_len + 1], dtype=np.int64) for i in starts.tolist()]
        out = torch.from_numpy(np.stack(rows))
        if int(out.max()) >= self.vocab_size:
            raise ValueError(f"TokenFile: token id {int(out.max())} >= vocab_size {self.vocab_size}; "
                             "pick a preset with a larger vocabulary")
        return out


def make_data(path: str | None, **kwargs):
    """``TokenFile(path)`` when a path is given, else ``SyntheticMarkov``."""
    if path:
        return TokenFile(path, **kwargs)
    kwargs.pop("dtype", None)
    return SyntheticMarkov(**kwargs)
