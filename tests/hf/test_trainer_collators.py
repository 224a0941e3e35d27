"""The transformers Trainer with the collators of variable-length training, on a converted model: samples of varying
length padded to the longest of each batch (DataCollatorForLanguageModeling, mlm=False: the causal-LM collator that
pads and masks the padding's labels) and packed into one row with position ids restarting per sample
(DataCollatorWithFlattening). Each trains like the unconverted model under the same Trainer (losses per step within
FP8 tolerance); a packed run that let samples attend to each other would not."""
import copy
import warnings

import pytest
import torch
from transformers import (DataCollatorForLanguageModeling, DataCollatorWithFlattening, PreTrainedTokenizerFast,
                          Trainer, TrainingArguments)

from coat_hf import ActivationConfig, convert_to_coat
from test_hf import VOCAB, tiny

warnings.filterwarnings("ignore")


class VaryingLengths(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(8, 33, (1,), generator=g))
        return {"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()}


def tokenizer():
    from tokenizers import Tokenizer, models

    vocab = {"[PAD]": 0, **{f"t{i}": i for i in range(1, VOCAB)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[PAD]")),
                                   pad_token="[PAD]")


def train(model, collator, out):
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=4, logging_steps=1,
                             learning_rate=1e-3, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
                             remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=VaryingLengths(), data_collator=collator)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("collator", ["padding", "flattening"])
def test_trainer_with_variable_length_collators(tmp_path, collator):
    make = {"padding": lambda: DataCollatorForLanguageModeling(tokenizer(), mlm=False),
            "flattening": lambda: DataCollatorWithFlattening()}[collator]
    ref = tiny("llama", max_position_embeddings=64)
    model = convert_to_coat(copy.deepcopy(ref), ActivationConfig(backend="torch"))
    expected, got = train(ref, make(), tmp_path / "ref"), train(model, make(), tmp_path / "coat")
    assert len(got) == 4 and type(model.model.layers[0]).__name__.startswith("Coat")
    # measured: within 1.5e-4 of the unconverted model's losses; packed samples attending to each other: 4.3e-3
    assert max(abs(a - b) / b for a, b in zip(got, expected)) < 1e-3, (got, expected)
