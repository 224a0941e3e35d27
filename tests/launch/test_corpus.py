"""The real-text corpus (launch/corpus.py), its Megatron indexed datasets (launch/megatron_data.py) and the main job
(launch/main.py), on a small stand-in for the standard library so the tokenizer trains in seconds."""
import json
import os

import numpy as np
import pytest
import torch

from launch import corpus as C

CODE = '''def f{i}(x):
    """Return x plus {i}; documents {i} of the stand-in corpus."""
    total = 0
    for k in range({i}):
        total += k * x
    return total + {i}
'''


@pytest.fixture()
def fake_stdlib(tmp_path, monkeypatch):
    """A directory laid out like the stdlib (a package, a test suite, site-packages) and a private cache."""
    root = tmp_path / "lib"
    for i in range(60):
        sub = root / ("pkg" if i % 2 else "") / f"m{i}.py"
        sub.parent.mkdir(parents=True, exist_ok=True)
        sub.write_text(CODE.format(i=i) * 20)
    for skipped in ("test/test_x.py", "site-packages/dep/mod.py", "pkg/tests/t.py", "idlelib/idle_test/t.py"):
        (root / skipped).parent.mkdir(parents=True, exist_ok=True)
        (root / skipped).write_text("SKIPPED = 1\n")
    (root / "notes.txt").write_text("not python")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return root


def test_documents_are_python_files_without_test_suites_then_topics(fake_stdlib):
    docs = C.documents(str(fake_stdlib))
    names = [n for n, _ in docs]
    code = [n for n in names if not n.startswith("pydoc:")]
    assert len(code) == 60 and all(n.endswith(".py") for n in code)
    assert not any(part in n for n in names for part in ("test", "site-packages", "idle_test"))
    assert len(names) > 60 and names[60].startswith("pydoc:")  # the English topics follow the code
    assert [n for n, _ in C.documents(str(fake_stdlib), topics=False)] == code


def test_unreadable_corpus_is_a_clear_error(tmp_path):
    with pytest.raises(C.CorpusError, match="not a directory"):
        C.documents(str(tmp_path / "missing"))
    (tmp_path / "a.py").write_text("x = 1\n")
    with pytest.raises(C.CorpusError, match="only 1 documents"):
        C.documents(str(tmp_path), topics=False)
    for i in range(12):
        (tmp_path / f"b{i}.py").write_text("y = 2\n")
    os.symlink(tmp_path / "gone", tmp_path / "broken.py")
    with pytest.raises(C.CorpusError, match="cannot read"):
        C.load(vocab_size=300, stdlib=str(tmp_path), topics=False, cache_root=tmp_path / "cache")
    with pytest.raises(C.CorpusError, match="vocab_size"):
        C.load(vocab_size=100, stdlib=str(tmp_path))
    with pytest.raises(C.CorpusError, match="val_percent"):
        C.load(val_percent=0, stdlib=str(tmp_path))


def test_split_by_document_is_deterministic_and_disjoint(fake_stdlib):
    names = [n for n, _ in C.documents(str(fake_stdlib))]
    val = [n for n in names if C.in_validation(n, 5.0)]
    assert val == [n for n in names if C.in_validation(n, 5.0)]
    assert 0 < len(val) < len(names) / 5
    assert {n for n in names if C.in_validation(n, 1.0)} <= set(val)  # a smaller share is a subset


def test_load_builds_once_then_reads_the_cache(fake_stdlib, monkeypatch):
    logs = []
    first = C.load(vocab_size=400, stdlib=str(fake_stdlib), log=logs.append)
    assert len(logs) == 1 and "cached in" in logs[0]
    assert first.vocab_size == 400 and first.train.dtype == np.uint16
    eot = first.meta["eot"]
    assert first.train[-1] == eot and first.val[-1] == eot
    assert first.meta["documents"]["train"] + first.meta["documents"]["val"] == len(C.documents(str(fake_stdlib)))
    assert (first.train == eot).sum() == first.meta["documents"]["train"]

    def no_training(*a):
        raise AssertionError("the cached tokenizer was retrained")

    monkeypatch.setattr(C, "_train_tokenizer", no_training)
    again = C.load(vocab_size=400, stdlib=str(fake_stdlib), log=logs.append)
    assert len(logs) == 1 and again.directory == first.directory
    assert np.array_equal(again.train, first.train) and np.array_equal(again.val, first.val)
    text = 'def f(x):\n    return "é" + x  # bytes\n'
    tok = again.tokenizer()
    assert tok.decode(tok.encode(text).ids) == text  # byte level: every text round-trips
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(again.directory))  # what Megatron's HuggingFaceTokenizer loads
    assert hf.eos_token_id == eot and hf(text)["input_ids"] == tok.encode(text).ids
    (fake_stdlib / "new.py").write_text("z = 3\n")  # another corpus: another cache
    with pytest.raises(AssertionError, match="retrained"):
        C.load(vocab_size=400, stdlib=str(fake_stdlib))


def test_batches_are_seeded_windows_and_fixed_validation(fake_stdlib):
    data = C.load(vocab_size=300, stdlib=str(fake_stdlib))
    a, b = C.Batches(data, 32, 4, seed=1), C.Batches(data, 32, 4, seed=1)
    x, y = a.train_batch(), b.train_batch()
    assert x.shape == (4, 32) and x.dtype == torch.int64 and torch.equal(x, y)
    assert not torch.equal(a.train_batch(), C.Batches(data, 32, 4, seed=2).train_batch())
    val = a.val_batches(3)
    assert len(val) == 3 and all(v.shape == (4, 32) for v in val)
    assert all(torch.equal(u, v) for u, v in zip(val, b.val_batches(3)))
    assert torch.equal(val[0][0], torch.from_numpy(data.val[:32].astype(np.int64)))
    with pytest.raises(C.CorpusError, match="longer than the corpus"):
        C.Batches(data, len(data.val) + 1, 1)


def test_megatron_indexed_datasets_hold_the_corpus_documents(fake_stdlib, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from launch import megatron_data as M

    data = C.load(vocab_size=300, stdlib=str(fake_stdlib))
    prefixes = M.write_indexed(data, tmp_path / "mg")
    for split, tokens in (("train", data.train), ("val", data.val)):
        ds = IndexedDataset(prefixes[split])
        assert len(ds) == data.meta["documents"][split]
        assert np.array_equal(np.concatenate([ds[i] for i in range(len(ds))]), tokens)
        assert all(ds[i][-1] == data.meta["eot"] for i in range(len(ds)))
    mtime = os.path.getmtime(prefixes["train"] + ".bin")
    assert M.write_indexed(data, tmp_path / "mg") == prefixes  # up to date: not rewritten
    assert os.path.getmtime(prefixes["train"] + ".bin") == mtime
    args = M.megatron_args(data, prefixes)
    assert args[args.index("--tokenizer-model") + 1] == str(data.directory)
    with pytest.raises(C.CorpusError, match="must end with"):
        M.split_documents(np.array([5, 0, 7], dtype=np.uint16), 0)


def test_megatron_gpt_dataset_trains_on_the_corpus(fake_stdlib, tmp_path):
    """megatron.core's own GPTDataset reads the written datasets with the corpus tokenizer through Megatron's
    HuggingFaceTokenizer, as coat_megatron.pretrain_gpt does with --train-data-path / --valid-data-path."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.tokenizers import MegatronTokenizer

    from launch import megatron_data as M

    data = C.load(vocab_size=300, stdlib=str(fake_stdlib))
    prefixes = M.write_indexed(data, tmp_path / "mg")
    tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=str(data.directory),
                                                  metadata_path={"library": "huggingface"})
    assert tokenizer.vocab_size == 300
    config = GPTDatasetConfig(random_seed=1, sequence_length=64, tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False,
                              blend_per_split=[([prefixes["train"]], None), ([prefixes["val"]], None), None],
                              path_to_cache=str(tmp_path / "mg_cache"))
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [20, 4, None], lambda: True, config).build()
    sample = train[0]
    assert sample["tokens"].shape == (64,) and torch.equal(sample["tokens"][1:], sample["labels"][:-1])

    def within(tokens, split):  # the first 8 tokens of a sample are a window of that split
        joined = torch.from_numpy(split.astype(np.int64))
        return bool((joined.unfold(0, 8, 1) == tokens[:8]).all(1).any())

    assert within(sample["tokens"], data.train) and len(valid) >= 4 and within(valid[0]["tokens"], data.val)


def test_main_job_trains_both_arms_and_writes_table_json_and_png(fake_stdlib, tmp_path, capsys):
    from launch import main as M

    out = tmp_path / "run"
    M.main(["--device", "cpu", "--stdlib", str(fake_stdlib), "--hidden", "32", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--ffn", "64", "--vocab", "300", "--seq", "32", "--batch", "2", "--steps", "3",
            "--eval-every", "2", "--eval-batches", "1", "--out", str(out), "--no-progress"])
    printed = capsys.readouterr().out
    assert "| validation loss |" in printed and "gap (COAT vs BF16)" in printed
    result = json.loads((out / "results.json").read_text())
    bf16, coat = result["results"]
    assert [s for s, _ in bf16["val"]] == [2, 3] and len(coat["train"]) == 3
    assert bf16["train"][0][1] == pytest.approx(coat["train"][0][1], rel=0.02)  # one initialisation
    assert "float8_e4m3fn" in coat["saved_bytes"] and "float8_e4m3fn" not in bf16["saved_bytes"]
    assert sum(coat["saved_bytes"].values()) < sum(bf16["saved_bytes"].values())
    assert coat["optimizer_state_bytes"] < bf16["optimizer_state_bytes"] / 3
    table = (out / "results.md").read_text()
    assert table.startswith("| | BF16") and f"CPU, {result['args']['threads']} thread(s): COAT runs" in table
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loss_parity_runs_and_report(fake_stdlib, tmp_path, capsys):
    from launch import loss_parity as L

    out = tmp_path / "parity"
    tiny = ["--device", "cpu", "--stdlib", str(fake_stdlib), "--hidden", "32", "--layers", "1", "--heads", "2",
            "--kv-heads", "1", "--ffn", "64", "--vocab", "300", "--seq", "32", "--batch", "2", "--steps", "4",
            "--eval-every", "2", "--eval-batches", "1", "--out", str(out), "--no-progress"]
    for arm, seed in (("bf16", 0), ("bf16", 1), ("coat", 0)):
        L.main(["--arm", arm, "--seed", str(seed)] + tiny)
    record = json.loads((out / "coat-seed0.json").read_text())
    assert [s for s, _ in record["val"]] == [2, 4] and record["result"]["optimizer_state_bytes"] > 0
    L.main(["--report", str(out)])
    table = (out / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| BF16") or line.startswith("| COAT")]
    assert len(rows) == 3 and "+0.000%" in rows[0] and "BF16 seed-to-seed at step 4: 2 seeds" in table
    assert (out / "curves.png").exists()
    with pytest.raises(SystemExit, match="no results"):
        L.main(["--report", str(tmp_path)])
