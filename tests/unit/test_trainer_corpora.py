"""Unit tests for real corpora in gpudeck.trainers.common.data (saved datasets, parquet, arrow) and gpudeck.trainers.prepare.

The datasets are made here (``datasets`` offline; no hub access).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
datasets = pytest.importorskip("datasets")

from gpudeck.trainers.common import data as D
from gpudeck.trainers.common import prepare as P
from gpudeck.trainers.common import tokenizer as T

DOCS = [f"document {i}: " + "word " * (i % 7) + "end" for i in range(40)] + ["document 3: end"] * 3


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same documents as a saved dataset, a DatasetDict, parquet, arrow and JSONL."""
    root = tmp_path_factory.mktemp("corpora")
    ds = datasets.Dataset.from_dict({"id": list(range(len(DOCS))), "body": DOCS, "lang": ["en"] * len(DOCS)})
    ds.save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(5))}).save_to_disk(str(root / "dict"))
    (root / "pq").mkdir()
    ds.select(range(20)).to_parquet(str(root / "pq" / "a.parquet"))
    ds.select(range(20, len(DOCS))).to_parquet(str(root / "pq" / "b.parquet"))
    only_text = datasets.Dataset.from_dict({"content": DOCS, "n": list(range(len(DOCS)))})
    only_text.to_parquet(str(root / "content.parquet"))
    (root / "arrow").mkdir()
    import pyarrow as pa

    with pa.OSFile(str(root / "arrow" / "d.arrow"), "wb") as sink:  # the IPC file format
        table = pa.table({"text": DOCS})
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    with open(root / "docs.jsonl", "w") as fh:
        fh.writelines(json.dumps({"body": d, "other": "x"}) + "\n" for d in DOCS)
    return root


def test_every_dataset_kind_gives_the_same_documents(sources) -> None:
    assert D.load_documents(sources / "saved", text_column="body") == DOCS
    assert D.load_documents(sources / "dict", text_column="body") == DOCS  # the train split
    assert D.load_documents(sources / "dict", text_column="body", split="test") == DOCS[:5]
    assert D.load_documents(sources / "pq", text_column="body") == DOCS  # sorted files
    assert D.load_documents(sources / "pq" / "a.parquet", text_column="body") == DOCS[:20]
    assert D.load_documents(sources / "arrow") == DOCS  # "text" found without --text-column
    assert D.load_documents(sources / "content.parquet") == DOCS  # the only string column
    assert D.load_documents(sources / "docs.jsonl", text_column="body") == DOCS
    tok = T.ByteTokenizer()
    direct = D.load_tokens(sources / "saved", tok, text_column="body")
    assert direct.documents == len(DOCS)
    assert np.array_equal(direct.tokens, D.load_tokens(sources / "docs.jsonl", tok, text_column="body").tokens)


def test_text_column_errors_name_the_columns_and_the_fix(sources) -> None:
    with pytest.raises(D.DataError, match=r"several string columns \(body, lang\).*--text-column"):
        D.load_documents(sources / "saved")
    with pytest.raises(D.DataError, match=r"no such column \(columns: id \(int64\), body \(string\)"):
        D.load_documents(sources / "saved", text_column="missing")
    with pytest.raises(D.DataError, match=r"'id': not a string column"):
        D.load_documents(sources / "saved", text_column="id")
    with pytest.raises(D.DataError, match=r"no split 'valid'.*--data-split"):
        D.load_documents(sources / "dict", text_column="body", split="valid")
    with pytest.raises(D.DataError, match=r"plain text file.*drop --text-column"):
        (sources / "plain.txt").write_text("hello")
        D.load_documents(sources / "plain.txt", text_column="body")
    ints = datasets.Dataset.from_dict({"a": [1, 2]})
    ints.to_parquet(str(sources / "ints.parquet"))
    with pytest.raises(D.DataError, match=r"no string column to train on \(columns: a \(int64\)\)"):
        D.load_documents(sources / "ints.parquet")


def test_missing_and_empty_texts_are_no_documents(tmp_path) -> None:
    ds = datasets.Dataset.from_dict({"text": ["a", None, "", "b"]})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert D.load_documents(tmp_path / "ds") == ["a", "b"]


# ------------------------------------------------------------------ prepare


def _prepare(src, out, *extra: str) -> dict:
    argv = ["--data", str(src), "--out", str(out), *extra]
    assert P.main(argv) == 0
    return json.loads((out / D.PREPARED_MANIFEST).read_text())


def test_prepare_writes_the_tokens_training_would_make(sources, tmp_path) -> None:
    manifest = _prepare(sources / "saved", tmp_path / "p", "--text-column", "body", "--num-proc", "1")
    direct = D.load_tokens(sources / "saved", T.ByteTokenizer(), text_column="body")
    prepared = D.load_tokens(tmp_path / "p")  # a prepared folder is a --data like any other
    assert isinstance(prepared.tokens, np.memmap)
    assert np.array_equal(np.asarray(prepared.tokens), direct.tokens)
    train = manifest["splits"]["train"]
    assert train["documents"] == prepared.documents == len(DOCS)
    assert train["unique_documents"] == prepared.unique_documents == len(set(DOCS))
    assert train["tokens"] == prepared.tokens.shape[0]
    assert manifest["text_column"] == "body" and manifest["tokenizer"]["kind"] == "byte"
    assert manifest["max_token_id"] == int(direct.tokens.max())
    import hashlib

    assert train["sha256"] == hashlib.sha256((tmp_path / "p" / "train.bin").read_bytes()).hexdigest()
    # the index: document d is tokens[offsets[d]:offsets[d+1]], ending in EOS
    offs = prepared.offsets
    tok = T.ByteTokenizer()
    for d in (0, 7, len(DOCS) - 1):
        ids = prepared.tokens[offs[d] : offs[d + 1]]
        assert ids[-1] == tok.eos_id and tok.decode(ids[:-1].tolist()) == DOCS[d]
    assert isinstance(T.load_tokenizer(tmp_path / "p" / "tokenizer"), T.ByteTokenizer)


def test_prepare_in_parallel_equals_serial_and_holds_out_whole_documents(sources, tmp_path) -> None:
    serial = _prepare(sources / "pq", tmp_path / "s", "--text-column", "body", "--num-proc", "1", "--val-fraction", "0.2", "--seed", "3")
    P.CHUNK_DOCS, old = 4, P.CHUNK_DOCS  # many tasks over 2 processes
    try:
        par = _prepare(sources / "pq", tmp_path / "m", "--text-column", "body", "--num-proc", "2", "--val-fraction", "0.2", "--seed", "3")
    finally:
        P.CHUNK_DOCS = old
    assert par["num_proc"] == 2
    for split in ("train", "val"):
        assert par["splits"][split]["sha256"] == serial["splits"][split]["sha256"]
        assert np.array_equal(np.load(tmp_path / "s" / f"{split}.idx.npy"), np.load(tmp_path / "m" / f"{split}.idx.npy"))
    train, val = D.load_prepared(tmp_path / "m"), D.load_prepared(tmp_path / "m", "val")
    assert val.documents == round(0.2 * len(DOCS)) and train.documents + val.documents == len(DOCS)

    def docs(src):
        tok = T.ByteTokenizer()
        return [tok.decode(src.tokens[a : b - 1].tolist()) for a, b in zip(src.offsets[:-1], src.offsets[1:])]

    assert sorted(docs(train) + docs(val)) == sorted(DOCS)  # every document once, none split
    other = _prepare(sources / "pq", tmp_path / "o", "--text-column", "body", "--val-fraction", "0.2", "--seed", "4")
    assert other["splits"]["val"]["sha256"] != par["splits"]["val"]["sha256"]  # the seed picks


def test_prepare_val_data_and_refusals(sources, tmp_path, capsys) -> None:
    m = _prepare(sources / "docs.jsonl", tmp_path / "v", "--text-column", "body", "--val-data", str(sources / "saved"))
    assert m["splits"]["val"]["documents"] == len(DOCS) and m["val_source"].endswith("[body]")
    assert P.main(["--data", str(sources / "docs.jsonl"), "--out", str(tmp_path / "v")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert P.main(["--data", str(sources / "saved"), "--out", str(tmp_path / "x")]) == 2
    assert "--text-column" in capsys.readouterr().err
    (tmp_path / "one.txt").write_text("just one")
    assert P.main(["--data", str(tmp_path / "one.txt"), "--out", str(tmp_path / "y"), "--val-fraction", "0.1"]) == 2
    assert "--val-data" in capsys.readouterr().err


def test_a_damaged_prepared_folder_is_refused(sources, tmp_path) -> None:
    _prepare(sources / "docs.jsonl", tmp_path / "p", "--text-column", "body")
    with open(tmp_path / "p" / "train.bin", "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(D.DataError, match="incomplete — prepare it again"):
        D.load_prepared(tmp_path / "p")
    with pytest.raises(D.DataError, match="no 'val' split"):
        D.load_prepared(tmp_path / "p", "val")


def test_validation_batches_are_fixed_disjoint_and_even() -> None:
    ds = D.PackedDataset(np.arange(23 * 4 + 1), 4)  # 23 samples
    per = [list(D.ValidationBatches(ds, 3, 2, r, 3)) for r in range(3)]
    assert [len(b) for b in per] == [2, 2, 2] and all(x.shape == (3, 5) for b in per for x in b)
    firsts = [{int(row[0]) for x in b for row in x} for b in per]
    assert not (firsts[0] & firsts[1]) and not (firsts[1] & firsts[2])
    again = list(D.ValidationBatches(ds, 3, 2, 1, 3))
    assert all((a == b).all() for a, b in zip(again, per[1]))
    small = list(D.ValidationBatches(D.PackedDataset(np.arange(9), 4), 8, 4, 0, 2))
    assert len(small) == 1 and small[0].shape == (1, 5)
    with pytest.raises(D.DataError, match="--val-fraction"):
        D.ValidationBatches(D.PackedDataset(np.arange(9), 4), 8, 4, 0, 3)


def test_prepare_with_a_transformers_tokenizer_in_parallel(sources, tmp_path) -> None:
    """A local fast tokenizer (trained here): the workers load the saved copy and give the same ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok_dir = tmp_path / "tok"
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="[UNK]").save_pretrained(tok_dir)
    P.CHUNK_DOCS, old = 5, P.CHUNK_DOCS
    try:
        m = _prepare(sources / "docs.jsonl", tmp_path / "p", "--text-column", "body", "--tokenizer", str(tok_dir), "--num-proc", "2")
    finally:
        P.CHUNK_DOCS = old
    tok = T.load_tokenizer(tok_dir)
    direct = D.load_tokens(sources / "docs.jsonl", tok, text_column="body")
    assert np.array_equal(np.asarray(D.load_prepared(tmp_path / "p").tokens), direct.tokens)
    assert m["tokenizer"]["kind"] == "hf" and m["tokenizer"]["vocab_size"] == tok.vocab_size
    assert direct.tokens.max() < tok.vocab_size and tok.eos_id in direct.tokens
    assert T.load_tokenizer(tmp_path / "p" / "tokenizer").encode("document 3: end") == tok.encode("document 3: end")
