"""launch/batches.py: the fixed, padded and packed micro-batches of launch/train_ds.py, built from a data source whose
sample i is the tokens i, i+1, ... (so every token says which sample and position it came from)."""
import pytest
import torch

from launch.batches import micro_batch, window_length


class Counting:
    def sequences(self, first_index, count):
        return torch.stack([torch.arange(i * 1000, i * 1000 + 65) for i in range(first_index, first_index + count)])


def test_fixed_batches_shift_labels_by_one():
    b = micro_batch(Counting(), "fixed", 3, 2, 64, 32, seed=1)
    assert b["input_ids"].shape == (2, 64) and torch.equal(b["labels"], b["input_ids"] + 1)
    assert b["real_tokens"] == 128 and b["input_ids"][1, 0] == 4000


def test_padded_batches_pad_to_the_longest_and_mask_the_padding():
    b = micro_batch(Counting(), "padded", 10, 4, 64, 32, seed=1)
    lengths = [window_length(1, 10 + i, 32, 64) for i in range(4)]
    assert all(32 <= n <= 64 for n in lengths) and len(set(lengths)) > 1
    assert b["input_ids"].shape == (4, max(lengths)) and b["real_tokens"] == sum(lengths)
    for i, n in enumerate(lengths):
        assert b["attention_mask"][i].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert torch.equal(b["input_ids"][i, :n], torch.arange((10 + i) * 1000, (10 + i) * 1000 + n))
        assert (b["labels"][i, n:] == -100).all() and torch.equal(b["labels"][i, :n], b["input_ids"][i, :n])
    again = micro_batch(Counting(), "padded", 10, 4, 64, 32, seed=1)
    assert all(torch.equal(again[k], b[k]) for k in ("input_ids", "attention_mask"))  # a function of the indices


def test_packed_rows_are_full_and_restart_positions_at_each_window():
    b = micro_batch(Counting(), "packed", 5, 3, 64, 16, seed=2)
    ids, pos, labels = b["input_ids"], b["position_ids"], b["labels"]
    assert ids.shape == pos.shape == (3, 64) and b["real_tokens"] == 192 and "attention_mask" not in b
    for row in range(3):
        starts = (pos[row] == 0).nonzero().flatten().tolist()
        assert starts[0] == 0 and len(starts) >= 2  # several windows per row
        bounds = starts + [64]
        for a, z in zip(bounds, bounds[1:]):
            assert torch.equal(pos[row, a:z], torch.arange(z - a))
            assert torch.equal(ids[row, a:z], ids[row, a] + torch.arange(z - a))  # one window each
        assert (labels[row, starts] == -100).all() and (labels[row][pos[row] > 0] >= 0).all()


def test_unknown_batching_is_an_error():
    with pytest.raises(ValueError, match="batching must be one of"):
        micro_batch(Counting(), "bucketed", 0, 1, 64, 32, seed=1)
