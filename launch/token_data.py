"""The token sources of launch/train_ds.py (`--data`): each maps a global sample index to seq_len + 1 tokens, so a
run's data depend only on (seed, sample index) and runs on 1 and on N ranks see the same global batches.

- `BigramData` (`bigram`): sequences of a fixed random bigram language, each token followed by one of 8 successors
  with Zipf weights (about 1.7 nats of entropy).
- `CorpusData` (`corpus`): windows of the standard library corpus's training split (launch.corpus).
"""
from __future__ import annotations

import numpy as np
import torch


class BigramData:
    """Synthetic token sequences: token t is followed by one of SUCCESSORS fixed random tokens, Zipf-weighted."""
    SUCCESSORS = 8

    def __init__(self, vocab: int, seq_len: int, seed: int):
        rng = np.random.default_rng(seed)
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.successors = rng.integers(0, vocab, size=(vocab, self.SUCCESSORS))
        weights = 1.0 / np.arange(1, self.SUCCESSORS + 1)
        self.cdf = np.cumsum(weights / weights.sum())

    def sequences(self, first_index: int, count: int) -> torch.Tensor:
        """int64 [count, seq_len + 1] for global sample indices first_index .. first_index + count - 1."""
        rngs = [np.random.default_rng((self.seed, first_index + i)) for i in range(count)]
        choices = np.stack([np.searchsorted(self.cdf, r.random(self.seq_len)) for r in rngs])
        out = np.empty((count, self.seq_len + 1), dtype=np.int64)
        out[:, 0] = [r.integers(0, self.vocab) for r in rngs]
        for t in range(self.seq_len):
            out[:, t + 1] = self.successors[out[:, t], choices[:, t]]
        return torch.from_numpy(out)


class CorpusData:
    """Windows of seq_len + 1 tokens of the standard library corpus's training split, each at an offset drawn from
    (seed, global sample index)."""

    def __init__(self, model_vocab: int, seq_len: int, seed: int):
        from launch import corpus

        loaded = corpus.load(log=lambda *a: None)
        if loaded.vocab_size > model_vocab:
            raise SystemExit(f"--data corpus has a vocabulary of {loaded.vocab_size} tokens, more than the model's "
                             f"{model_vocab}: pick a --model with a vocabulary of at least {loaded.vocab_size}")
        self.tokens = loaded.train
        if len(self.tokens) <= seq_len + 1:
            raise SystemExit(f"--seq-len {seq_len} is longer than the corpus ({len(self.tokens)} tokens)")
        self.seq_len, self.seed = seq_len, seed

    def sequences(self, first_index: int, count: int) -> torch.Tensor:
        """int64 [count, seq_len + 1] for global sample indices first_index .. first_index + count - 1."""
        high = len(self.tokens) - self.seq_len - 1
        starts = [int(np.random.default_rng((self.seed, first_index + i)).integers(0, high)) for i in range(count)]
        return torch.from_numpy(np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int64))
