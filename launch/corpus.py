"""A real text corpus every machine already has: the Python standard library's own sources and its English
documentation topics, tokenized with a byte-level BPE trained on them, cached.

- Documents: every `.py` file under `sysconfig.get_paths()["stdlib"]`, without test suites (`test`, `tests`,
  `idle_test` directories) and installed packages (`site-packages`), plus each topic of `pydoc_data.topics` (English
  prose about the language; the `pydoc_data` package itself is skipped, its code holds the same topics). About
  11 MB of code and 0.7 MB of prose for CPython 3.11.
- Split by document, deterministically: a document is in validation when the SHA-1 of its name (the path relative
  to the stdlib, or "pydoc:<topic>") falls in the first `val_percent` of the hash space. The same Python version
  gives the same split on every machine; another version has other files, so another corpus (and cache key).
- Tokenizer: Hugging Face `tokenizers` byte-level BPE (no unknown tokens), trained on the training split only, with
  `<|endoftext|>` between documents (and as the end-of-sequence token). Saved as a Hugging Face tokenizer directory
  (tokenizer.json + tokenizer_config.json), which `AutoTokenizer` and Megatron's `HuggingFaceTokenizer` load.
- Cache: `$XDG_CACHE_HOME/coat_fp8/corpus-<key>/` (default `~/.cache/...`) (tokenizer.json, train.bin / val.bin as
uint16 or uint32 token arrays,
  meta.json), keyed by the Python version, the documents' names and sizes, the vocabulary size and the split; a
  second run loads it at once. `CorpusError` when the corpus cannot be read.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

EOT = "<|endoftext|>"
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "pydoc_data"}


class CorpusError(RuntimeError):
    pass


def documents(stdlib: str | None = None, topics: bool = True) -> list[tuple[str, Path | str]]:
    """[(name, path or text)] in name order: the .py files under `stdlib` (default: this Python's standard
    library), then, with `topics`, the pydoc topics."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise CorpusError(f"the Python standard library is not a directory here: {root}")
    docs = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for f in sorted(filenames):
            if f.endswith(".py"):
                path = Path(dirpath, f)
                docs.append((str(path.relative_to(root)), path))
    if topics:
        try:
            from pydoc_data.topics import topics as texts
            docs += [(f"pydoc:{k}", texts[k]) for k in sorted(texts)]
        except ImportError:  # a stripped Python without the documentation topics: code only
            pass
    if len(docs) < 10:
        raise CorpusError(f"only {len(docs)} documents found under {root}: not a usable corpus")
    return docs


def in_validation(name: str, val_percent: float) -> bool:
    return int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) < val_percent / 100 * 2 ** 32


def _read(doc) -> str:
    name, source = doc
    if isinstance(source, str):
        return source
    try:
        return source.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise CorpusError(f"cannot read {source}: {exc}") from exc


def _cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coat_fp8"


@dataclass
class Corpus:
    train: np.ndarray  # token ids, documents joined by EOT
    val: np.ndarray
    vocab_size: int
    directory: Path  # holds tokenizer.json
    meta: dict

    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.directory / "tokenizer.json"))


def _size(source) -> int:
    if isinstance(source, str):
        return len(source)
    try:
        return os.path.getsize(source)
    except OSError as exc:
        raise CorpusError(f"cannot read {source}: {exc}") from exc


CACHE_FORMAT = 2  # bumped when the cache's files change


def load(vocab_size: int = 8192, val_percent: float = 5.0, cache_root: Path | None = None,
         stdlib: str | None = None, topics: bool = True, log=print) -> Corpus:
    """The corpus, from the cache or built (tokenizer training and tokenization, logged with their times)."""
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise CorpusError(f"vocab_size must be an int of at least 257 (256 bytes + <|endoftext|>), got {vocab_size!r}")
    if not 0 < val_percent < 100:
        raise CorpusError(f"val_percent must be in (0, 100), got {val_percent!r}")
    docs = documents(stdlib, topics)
    sizes = [(name, _size(src)) for name, src in docs]
    key_src = json.dumps([CACHE_FORMAT, sys.version_info[:2], vocab_size, val_percent, sizes])
    key = hashlib.sha1(key_src.encode()).hexdigest()[:12]
    directory = (cache_root or _cache_root()) / f"corpus-{key}"
    meta_path = directory / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
        return Corpus(np.fromfile(directory / "train.bin", dtype=dtype),
                      np.fromfile(directory / "val.bin", dtype=dtype),
                      meta["vocab_size"], directory, meta)
    texts = [(doc[0], _read(doc)) for doc in docs]
    train = [t for name, t in texts if not in_validation(name, val_percent)]
    val = [t for name, t in texts if in_validation(name, val_percent)]
    if not train or not val:
        raise CorpusError(f"the split left {len(train)} training and {len(val)} validation documents")
    t0 = time.time()
    tokenizer = _train_tokenizer(train, vocab_size)
    t1 = time.time()
    eot = tokenizer.token_to_id(EOT)
    arrays = {}
    for split, split_texts in (("train", train), ("val", val)):
        ids = []
        for enc in tokenizer.encode_batch(split_texts):
            ids.extend(enc.ids)
            ids.append(eot)
        dtype = np.uint16 if tokenizer.get_vocab_size() <= 65535 else np.uint32
        arrays[split] = np.asarray(ids, dtype=dtype)
    t2 = time.time()
    # written to a private directory, then renamed: processes starting together never read a half-written cache
    building = directory.with_name(f"{directory.name}.{os.getpid()}.tmp")
    building.mkdir(parents=True, exist_ok=True)
    _save_hf_tokenizer(tokenizer, building)
    for split, arr in arrays.items():
        arr.tofile(building / f"{split}.bin")
    meta = dict(vocab_size=tokenizer.get_vocab_size(), dtype=str(arrays["train"].dtype), eot=eot,
                documents=dict(train=len(train), val=len(val)),
                bytes=dict(train=sum(map(len, train)), val=sum(map(len, val))),
                tokens=dict(train=len(arrays["train"]), val=len(arrays["val"])), python=sys.version.split()[0],
                tokenizer_seconds=round(t1 - t0, 1), tokenize_seconds=round(t2 - t1, 1))
    (building / "meta.json").write_text(json.dumps(meta, indent=1))
    try:
        building.rename(directory)
    except OSError:
        if (directory / "meta.json").exists():  # another process finished first: its cache is the same corpus
            shutil.rmtree(building, ignore_errors=True)
        else:  # an incomplete cache left by an interrupted older writer
            shutil.rmtree(directory, ignore_errors=True)
            building.rename(directory)
    log(f"corpus: {meta['documents']} documents, {meta['tokens']} tokens (BPE {meta['vocab_size']} trained in "
        f"{meta['tokenizer_seconds']} s, tokenized in {meta['tokenize_seconds']} s), cached in {directory}")
    return Corpus(arrays["train"], arrays["val"], meta["vocab_size"], directory, meta)


def _save_hf_tokenizer(tokenizer, directory: Path):
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOT, bos_token=EOT,
                            unk_token=None).save_pretrained(str(directory))


def _train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


class Batches:
    """Training windows of seq_len tokens at random offsets (seeded), and a fixed set of validation windows spread
    evenly over the validation split. A Hugging Face causal LM takes a window as both input_ids and labels (it
    shifts the labels itself)."""

    def __init__(self, corpus: Corpus, seq_len: int, batch_size: int, seed: int = 0):
        if len(corpus.train) <= seq_len or len(corpus.val) <= seq_len:
            raise CorpusError(f"sequence length {seq_len} is longer than the corpus")
        self.corpus, self.seq_len, self.batch_size = corpus, seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def _windows(self, data: np.ndarray, starts) -> torch.Tensor:
        return torch.from_numpy(np.stack([data[s:s + self.seq_len] for s in starts]).astype(np.int64))

    def train_batch(self) -> torch.Tensor:
        high = len(self.corpus.train) - self.seq_len
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator).tolist()
        return self._windows(self.corpus.train, starts)

    def val_batches(self, count: int) -> list[torch.Tensor]:
        high = len(self.corpus.val) - self.seq_len
        starts = np.linspace(0, high, count * self.batch_size).astype(np.int64)
        return [self._windows(self.corpus.val, starts[i * self.batch_size:(i + 1) * self.batch_size])
                for i in range(count)]
