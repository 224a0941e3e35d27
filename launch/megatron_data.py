"""The corpus of launch/corpus.py as Megatron indexed datasets, for `coat_megatron.pretrain_gpt --data-path`-style
training on real text.

Two datasets (prefix.bin / prefix.idx, written with megatron.core's IndexedDatasetBuilder), one per split of the
corpus, so Megatron trains and validates on the same documents as the Hugging Face jobs: `<out>/stdlib_train` and
`<out>/stdlib_val`; one document per source file or pydoc topic, each ending with <|endoftext|> (what Megatron's
preprocess_data.py writes with --append-eod). The tokenizer is the corpus's Hugging Face tokenizer directory.

    python -m launch.megatron_data --out DIR [--vocab 8192]

prints (on stdout; progress goes to stderr) the Megatron arguments that train on it:
    --train-data-path DIR/stdlib_train --valid-data-path DIR/stdlib_val --test-data-path DIR/stdlib_val
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model <corpus cache dir>
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from launch import corpus as corpus_lib


def split_documents(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    """The documents of a joined split, each with its trailing <|endoftext|>."""
    ends = np.flatnonzero(tokens == eot) + 1
    if len(ends) == 0 or ends[-1] != len(tokens):
        raise corpus_lib.CorpusError("a corpus split must end with <|endoftext|>")
    return np.split(tokens, ends[:-1])


def write_indexed(corpus: corpus_lib.Corpus, out: Path) -> dict[str, str]:
    """Write both splits; returns {"train": prefix, "val": prefix}. Rewrites only what is missing or stale."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    out.mkdir(parents=True, exist_ok=True)
    stamp = json.dumps({"corpus": corpus.directory.name, "tokens": corpus.meta["tokens"]})
    prefixes = {}
    for split, tokens in (("train", corpus.train), ("val", corpus.val)):
        prefix = out / f"stdlib_{split}"
        stamp_path = prefix.with_suffix(".source.json")
        if not (stamp_path.exists() and stamp_path.read_text() == stamp and prefix.with_suffix(".idx").exists()):
            builder = IndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=tokens.dtype.type)
            for doc in split_documents(tokens, corpus.meta["eot"]):
                builder.add_document(doc, [len(doc)])
            builder.finalize(str(prefix.with_suffix(".idx")))
            stamp_path.write_text(stamp)
        written = IndexedDataset(str(prefix))
        if int(written.sequence_lengths.sum()) != len(tokens):
            raise corpus_lib.CorpusError(f"{prefix}: {written.sequence_lengths.sum()} tokens written, {len(tokens)} "
                                         "in the corpus")
        prefixes[split] = str(prefix)
    return prefixes


def megatron_args(corpus: corpus_lib.Corpus, prefixes: dict[str, str]) -> list[str]:
    return ["--train-data-path", prefixes["train"], "--valid-data-path", prefixes["val"],
            "--test-data-path", prefixes["val"], "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", str(corpus.directory)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for the .bin/.idx files")
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args(argv)
    data = corpus_lib.load(vocab_size=args.vocab, log=lambda *a: print(*a, file=sys.stderr, flush=True))
    prefixes = write_indexed(data, Path(args.out))
    print(" ".join(megatron_args(data, prefixes)))


if __name__ == "__main__":
    main()
