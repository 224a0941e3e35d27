"""The micro-batches launch/train_ds.py feeds the model, in the three shapes training pipelines give:

- `fixed`: every sample `seq_len` tokens (input_ids = tokens 0..L-1, labels = tokens 1..L, as this script always fed).
- `padded`: each sample a window of a length drawn uniformly in [min_len, seq_len], the micro-batch right-padded to
  its longest sample, as `DataCollatorWithPadding` gives: `attention_mask` 0 on padding, labels -100 there (the model
  shifts labels itself: labels = input_ids).
- `packed`: each row `seq_len` tokens of whole windows (lengths drawn as for `padded`, the last one cut to fit) with
  `position_ids` restarting at each and the first label of each window -100, as `DataCollatorWithFlattening` gives
  per row (Hugging Face then keeps the windows apart: a block-diagonal causal mask for sdpa and eager, sequence
  boundaries for the flash kernels). One fixed token count per micro-batch.
Each sample or window is the data's sample of its own global index, so a run's batches depend only on (seed, step).
`real_tokens` counts the tokens that are not padding (what tokens/s counts).
"""
from __future__ import annotations

import numpy as np
import torch

BATCHING = ("fixed", "padded", "packed")
WINDOWS_PER_ROW = 64  # index space of a packed row's windows


def window_length(seed: int, index: int, min_len: int, seq_len: int) -> int:
    return int(np.random.default_rng((seed, 7, index)).integers(min_len, seq_len + 1))


def micro_batch(data, batching: str, first_index: int, count: int, seq_len: int, min_len: int, seed: int,
                pad_to_multiple_of: int = 1) -> dict:
    """Model inputs for samples first_index .. first_index + count - 1, plus `real_tokens` (int). padded: the
    longest sample's length rounded up to `pad_to_multiple_of` (DataCollatorWithPadding's option of that name)."""
    if batching == "fixed":
        tokens = data.sequences(first_index, count)
        return dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:].contiguous(), real_tokens=count * seq_len)
    if batching == "padded":
        windows = [data.sequences(first_index + i, 1)[0, :window_length(seed, first_index + i, min_len, seq_len)]
                   for i in range(count)]
        longest = -(-max(len(w) for w in windows) // pad_to_multiple_of) * pad_to_multiple_of
        ids = torch.zeros(count, longest, dtype=torch.long)
        mask = torch.zeros(count, longest, dtype=torch.long)
        for i, w in enumerate(windows):
            ids[i, :len(w)], mask[i, :len(w)] = w, 1
        return dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                    real_tokens=int(mask.sum()))
    if batching == "packed":
        rows, positions = [], []
        for i in range(count):
            row, pos, filled, j = [], [], 0, 0
            while filled < seq_len:
                index = (first_index + i) * WINDOWS_PER_ROW + j
                take = min(window_length(seed, index, min_len, seq_len), seq_len - filled)
                row.append(data.sequences(index, 1)[0, :take])
                pos.append(torch.arange(take))
                filled, j = filled + take, j + 1
            rows.append(torch.cat(row))
            positions.append(torch.cat(pos))
        ids, position_ids = torch.stack(rows), torch.stack(positions)
        return dict(input_ids=ids, position_ids=position_ids, labels=ids.masked_fill(position_ids == 0, -100),
                    real_tokens=count * seq_len)
    raise ValueError(f"batching must be one of {BATCHING}, got {batching!r}")
