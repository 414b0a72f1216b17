"""Provides the trainers' data: tokenizers, token streams, packed samples, sharded batches.

Public API (kept stable; dflash imports it):

Tokenizers: :mod:`gpudeck.trainers.common.tokenizer`.

Corpus and token arrays
    ``builtin_corpus_files(max_bytes) -> list[Path]``  the offline corpus: the
        Python standard library's ``.py`` sources then installed packages'
        ``*.dist-info/METADATA`` documents, in sorted path order, until
        ``max_bytes`` of text are gathered (deterministic on one machine).
    ``load_documents(data=None, max_bytes=..., text_column=None) -> list[str]``
        documents of a text file (one document), a JSONL file (``text`` field,
        else the first string field, one document per line), a folder (every
        .txt/.md/.rst/.py/.jsonl file, sorted), a Hugging Face dataset saved
        with ``save_to_disk``, parquet / arrow files (or a folder of them), or
        the built-in corpus (data None). Datasets are read offline through
        ``datasets``; their text column is ``text_column``, else ``text``, else
        the only string column (``DataError`` naming the columns otherwise).
    ``open_documents(data=None, max_bytes=..., text_column=None, split=None)
        -> DocumentSource``  the same documents, read lazily by index range
        (``len(src)``, ``src.texts(start, end)``, ``src.description``) — what
        ``gpudeck.trainers.prepare`` hands to its worker processes.
    ``load_tokens(data=None, tokenizer=None, dtype="uint16", max_bytes=...,
        text_column=None) -> TokenSource``  a 1-D token array (``np.memmap``
        for ``.bin`` files and for a folder written by ``gpudeck.trainers.prepare``,
        otherwise the documents encoded and joined with EOS) plus a description.
    ``is_prepared(path)``, ``load_prepared(path, split="train") -> TokenSource``
        a prepared folder's split, memory-mapped (never re-tokenised), with the
        document index and the figures of its manifest (see gpudeck.trainers.prepare).

Samples and batches
    ``PackedDataset(tokens, seq_len)``  non-overlapping windows of ``seq_len+1``
        tokens (inputs + shifted labels); ``len(ds)`` samples, ``ds[i]`` ->
        np.int64 array, ``ds.num_tokens`` (tokens the samples cover, exact),
        ``ds.source_tokens`` (tokens of the whole stream).
    ``split_tokens(tokens, val_fraction) -> (train, val)``  holds out the tail
        of the token stream as validation (no overlap with train).
    ``ShardedBatches(dataset, batch_size, rank, world_size, seed=0, shuffle=True)``
        an endless, deterministic iterator of ``torch.LongTensor [B, seq_len+1]``.
        Each step consumes ``world_size * batch_size`` samples of one epoch-wide
        permutation (seed, epoch); rank r takes its own contiguous slice, so
        ranks are disjoint within an epoch. The position is global
        (epoch, cursor), so ``state_dict()`` is the same on every rank and
        ``load_state_dict()`` resumes exactly (also with another world size).
        ``next_batch()`` / ``__next__``; ``samples_per_epoch``.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpudeck.trainers.common.tokenizer import ByteTokenizer
from gpudeck.trainers.errors import DataPathError, InputError

PREPARED_MANIFEST = "gpudeck_prepared.json"
PREPARED_FORMAT = "gpudeck-prepared/1"
PREPARED_DTYPES = ("uint16", "uint32")
DEFAULT_CORPUS_BYTES = 16 * 1024 * 1024
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".jsonl", ".json")
DATASET_SUFFIXES = (".parquet", ".arrow")
HF_DATASET_MARKERS = ("dataset_dict.json", "state.json", "dataset_info.json")


class DataError(InputError, ValueError):
    """Bad ``--data`` (or ``--val-data``): the message names what is wrong and the fix (exit 2, one line)."""


# ------------------------------------------------------------------ corpus


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _site_dirs() -> list[Path]:
    dirs = []
    for key in ("purelib", "platlib"):
        p = Path(sysconfig.get_paths()[key])
        if p.is_dir() and p not in dirs:
            dirs.append(p)
    return dirs


def _sorted_py_files(folder: Path) -> Iterator[Path]:
    """``sorted(folder.rglob("*.py"))`` less site-packages and __pycache__, walked lazily in the same order.

    A path sorts by its parts, so visiting each folder's entries by name and going depth-first gives sorted
    order without listing the whole tree first; the corpus takes the first few files, and walking all of the
    standard library (13,000 entries) for them cost every trainer process 0.4 s at start-up. Like rglob: symlinked
    folders are not entered, a folder that cannot be read is passed over, any entry named ``*.py`` is yielded.
    """
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except PermissionError:
        return
    for entry in entries:
        if entry.name in ("site-packages", "__pycache__"):
            continue
        if entry.name.endswith(".py"):
            yield folder / entry.name
        try:
            walk = entry.is_dir() and not entry.is_symlink()
        except OSError:
            walk = False
        if walk:
            yield from _sorted_py_files(folder / entry.name)


def _corpus_candidates() -> Iterator[Path]:
    stdlib = _stdlib_dir()
    if "site-packages" not in stdlib.parts and "__pycache__" not in stdlib.parts:
        yield from _sorted_py_files(stdlib)
    for site in _site_dirs():
        yield from sorted(site.glob("*.dist-info/METADATA"))


def builtin_corpus_files(max_bytes: int = DEFAULT_CORPUS_BYTES) -> list[Path]:
    """Sorted stdlib ``.py`` files, then package METADATA docs, up to ``max_bytes``."""
    chosen: list[Path] = []
    total = 0
    for p in _corpus_candidates():
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if size == 0 or size > 4 * 1024 * 1024:
            continue
        chosen.append(p)
        total += size
        if total >= max_bytes:
            break
    return chosen


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of a JSONL file; a bad line raises DataError naming it."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield number, json.loads(line)
            except ValueError as exc:
                raise DataError(f"{path}:{number}: not valid JSON ({exc}); each line must be one JSON object") from None


def _jsonl_documents(path: Path, text_column: str | None = None) -> list[str]:
    docs = []
    for number, obj in iter_jsonl(path):
        if isinstance(obj, str) and text_column is None:
            docs.append(obj)
            continue
        if not isinstance(obj, dict):
            raise DataError(f'{path}:{number}: expected a string or an object with a "text" field, got {type(obj).__name__}')
        if text_column is not None:
            text = obj.get(text_column)
            if text is not None and not isinstance(text, str):
                raise DataError(f"--text-column {text_column!r}: {path}:{number} holds a {type(text).__name__} there, not text")
        else:
            text = obj.get("text")
            if not isinstance(text, str):
                text = next((v for v in obj.values() if isinstance(v, str)), None)
        if text:
            docs.append(text)
    return docs


class DocumentSource:
    """Documents readable by index range: ``len(src)``, ``src.texts(start, end)``, ``description``."""

    description: str = ""

    def __len__(self) -> int:
        raise NotImplementedError

    def texts(self, start: int, end: int) -> list[str]:
        raise NotImplementedError


class ListDocuments(DocumentSource):
    """Documents already in memory (text, JSONL, folders, the built-in corpus)."""

    def __init__(self, docs: list[str], description: str) -> None:
        self.docs = docs
        self.description = description

    def __len__(self) -> int:
        return len(self.docs)

    def texts(self, start: int, end: int) -> list[str]:
        return self.docs[start:end]


class DatasetDocuments(DocumentSource):
    """One text column of a ``datasets.Dataset`` (memory-mapped Arrow; read by range)."""

    def __init__(self, dataset: Any, column: str, description: str) -> None:
        self.dataset = dataset.select_columns([column])
        self.column = column
        self.description = description

    def __len__(self) -> int:
        return len(self.dataset)

    def texts(self, start: int, end: int) -> list[str]:
        # missing and empty texts are no documents (as blank JSONL texts are not)
        return [v for v in self.dataset[start:end][self.column] if v]


def is_hf_dataset_dir(path: str | os.PathLike) -> bool:
    """True for a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``."""
    p = Path(path)
    return p.is_dir() and any((p / m).is_file() for m in HF_DATASET_MARKERS)


def _dataset_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in DATASET_SUFFIXES)


def _is_dataset_source(path: Path) -> bool:
    if path.is_file():
        return path.suffix in DATASET_SUFFIXES
    return is_hf_dataset_dir(path) or (
        path.is_dir() and bool(_dataset_files(path)) and not any(f.suffix in TEXT_SUFFIXES for f in path.rglob("*"))
    )


def open_hf_dataset(data: str | os.PathLike, split: str | None = None, option: str = "--data"):
    """A ``datasets.Dataset`` from a saved dataset folder or parquet/arrow files, offline."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{option} {data}: reading saved datasets, parquet and arrow files needs the "
            "'datasets' package: pip install 'gpudeck[train]' (or pip install datasets)"
        ) from None
    datasets.disable_progress_bars()
    path = Path(data)
    if is_hf_dataset_dir(path):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            names = list(ds)
            pick = split
            if pick is None:
                pick = "train" if "train" in ds else (names[0] if len(names) == 1 else None)
            if pick is None or pick not in ds:
                raise DataError(
                    f"{option} {path}: a dataset with splits {', '.join(names)}; "
                    f"{'no split ' + repr(split) if split else 'none is called train'} — "
                    "pick one with --data-split NAME"
                )
            ds = ds[pick]
        elif split not in (None, "train"):
            raise DataError(f"{option} {path}: a dataset without splits; drop --data-split {split}")
        return ds
    files = _dataset_files(path)
    kinds = {f.suffix for f in files}
    if not files:
        raise DataError(f"{option} {path}: no {', '.join(DATASET_SUFFIXES)} files")
    if len(kinds) > 1:
        raise DataError(f"{option} {path}: mixes parquet and arrow files; point it at one kind")
    builder = "parquet" if kinds == {".parquet"} else "arrow"
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")


def text_column_of(dataset: Any, requested: str | None = None, where: str = "--data") -> str:
    """The column holding the documents: ``requested``, else ``text``, else the only string column."""
    features = dataset.features
    strings = [name for name, f in features.items() if getattr(f, "dtype", None) in ("string", "large_string")]
    listing = ", ".join(f"{n} ({getattr(f, 'dtype', type(f).__name__)})" for n, f in features.items())
    if requested is not None:
        if requested not in features:
            raise DataError(f"--text-column {requested!r}: {where} has no such column (columns: {listing})")
        if requested not in strings:
            raise DataError(f"--text-column {requested!r}: not a string column in {where} (columns: {listing}); name a text column")
        return requested
    if "text" in strings:
        return "text"
    if len(strings) == 1:
        return strings[0]
    if not strings:
        raise DataError(f"{where}: no string column to train on (columns: {listing})")
    raise DataError(f"{where}: several string columns ({', '.join(strings)}) and none is called 'text'; name one with --text-column NAME")


def open_documents(
    data: str | os.PathLike | None = None,
    max_bytes: int = DEFAULT_CORPUS_BYTES,
    text_column: str | None = None,
    split: str | None = None,
    option: str = "--data",
) -> DocumentSource:
    """Documents of any supported source, read lazily by range (see module docstring)."""
    if data is None:
        files = builtin_corpus_files(max_bytes)
        return ListDocuments([_read_text(p) for p in files], "built-in corpus (Python stdlib sources + package docs)")
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"{option} {path} does not exist")
    if _is_dataset_source(path):
        ds = open_hf_dataset(path, split, option)
        column = text_column_of(ds, text_column, f"{option} {path}")
        return DatasetDocuments(ds, column, f"{path} [{column}]")
    if text_column is not None and path.suffix != ".jsonl" and not path.is_dir():
        raise DataError(f"--text-column {text_column!r}: {option} {path} is a plain text file, which has no columns; drop --text-column")
    if path.is_dir():
        docs: list[str] = []
        for p in sorted(path.rglob("*")):
            if p.is_file() and p.suffix in TEXT_SUFFIXES:
                docs.extend(_jsonl_documents(p, text_column) if p.suffix == ".jsonl" else [_read_text(p)])
        if not docs:
            raise DataError(
                f"{option} {path}: no text files ({', '.join(TEXT_SUFFIXES)}), no saved dataset and no {', '.join(DATASET_SUFFIXES)} files"
            )
        return ListDocuments(docs, str(path))
    if path.suffix == ".jsonl":
        return ListDocuments(_jsonl_documents(path, text_column), str(path))
    return ListDocuments([_read_text(path)], str(path))


def load_documents(
    data: str | os.PathLike | None = None, max_bytes: int = DEFAULT_CORPUS_BYTES, text_column: str | None = None, split: str | None = None
) -> list[str]:
    """Documents from a text/JSONL file, a folder, a saved dataset, parquet/arrow, or the built-in corpus."""
    src = open_documents(data, max_bytes=max_bytes, text_column=text_column, split=split)
    return src.texts(0, len(src))


@dataclass
class TokenSource:
    """A 1-D token stream and what it came from."""

    tokens: np.ndarray
    description: str
    documents: int | None  # None for pre-tokenized .bin files
    unique_documents: int | None = None  # prepared folders: distinct documents (by token content)
    sha256: str | None = None  # prepared folders: hash of the token file
    offsets: np.ndarray | None = None  # prepared folders: document start offsets (+ end)
    manifest: dict[str, Any] | None = None  # prepared folders: the whole manifest


def _out_dtype(vocab_size: int) -> Any:
    return np.uint16 if vocab_size <= 65535 else np.uint32


def load_tokens(
    data: str | os.PathLike | None = None,
    tokenizer: Any = None,
    dtype: str = "uint16",
    max_bytes: int = DEFAULT_CORPUS_BYTES,
    text_column: str | None = None,
    split: str | None = None,
) -> TokenSource:
    """Token stream of a ``.bin`` memmap or a prepared folder, or documents encoded and joined by EOS."""
    if data is not None and str(data).endswith(".bin"):
        arr = np.memmap(str(data), dtype=np.dtype(dtype), mode="r")
        return TokenSource(arr, f"token file {data} ({dtype}, {arr.shape[0]} tokens)", None)
    if data is not None and is_prepared(data):
        return load_prepared(data, "train")
    tok = tokenizer if tokenizer is not None else ByteTokenizer()
    src = open_documents(data, max_bytes=max_bytes, text_column=text_column, split=split)
    tokens, lengths = encode_documents(tok, src.texts(0, len(src)))
    return TokenSource(tokens, f"{src.description}: {lengths.shape[0]} documents, {tokens.shape[0]} tokens", int(lengths.shape[0]))


def encode_documents(tok: Any, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, per-document lengths): each document's ids followed by EOS, joined."""
    out_dtype = _out_dtype(tok.vocab_size)
    eos = np.array([tok.eos_id], dtype=np.int64)
    parts: list[np.ndarray] = []
    lengths = np.zeros(len(texts), dtype=np.int64)
    for i, ids in enumerate(tok.encode_batch(texts)):
        parts.append(ids.astype(np.int64, copy=False))
        parts.append(eos)
        lengths[i] = ids.shape[0] + 1
    tokens = np.concatenate(parts).astype(out_dtype) if parts else np.zeros(0, dtype=out_dtype)
    return tokens, lengths


# ------------------------------------------------------------------ prepared folders


def is_prepared(path: str | os.PathLike) -> bool:
    """True for a folder written by ``python -m gpudeck.trainers.prepare``."""
    return (Path(path) / PREPARED_MANIFEST).is_file()


def read_prepared_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a prepared folder (format checked)."""
    folder = Path(path)
    try:
        manifest = json.loads((folder / PREPARED_MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise DataError(
            f"--data {folder}: unreadable {PREPARED_MANIFEST} ({exc}); prepare it again with python -m gpudeck.trainers.prepare"
        ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != PREPARED_FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(
            f"--data {folder}: format {got!r}, this trainer reads {PREPARED_FORMAT!r}; prepare it again with python -m gpudeck.trainers.prepare"
        )
    if not isinstance(manifest.get("splits"), dict) or manifest.get("dtype") not in PREPARED_DTYPES:
        raise DataError(
            f"--data {folder}: {PREPARED_MANIFEST} needs a 'splits' object and a 'dtype' of {', '.join(PREPARED_DTYPES)}; prepare it again"
        )
    return manifest


def prepared_file(folder: Path, name: object, field: str) -> Path:
    """``folder / name`` for a file a prepared manifest names: a plain relative name that stays inside ``folder``, else DataPathError."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise DataPathError(
            f"--data {folder}: {PREPARED_MANIFEST}'s {field} {name!r} is not a file name inside the folder "
            "(absolute paths and '..' are refused); prepare the corpus again"
        )
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise DataPathError(f"--data {folder}: {field} {name!r} leads outside the folder (a symlink to {path.resolve()}); prepare it again")
    return path


_SPLIT_COUNTS = ("documents", "tokens", "unique_documents")


def _split_info(folder: Path, manifest: dict[str, Any], split: str) -> dict[str, Any]:
    info = manifest["splits"].get(split)
    if info is None:
        raise DataError(f"--data {folder}: no {split!r} split (has {', '.join(manifest['splits'])})")
    if not isinstance(info, dict):
        info = {}
    bad = [k for k in _SPLIT_COUNTS if isinstance(info.get(k), bool) or not isinstance(info.get(k), int) or info[k] < 0]
    if bad or not isinstance(info.get("sha256"), str):
        raise DataError(
            f"--data {folder}: split {split!r} of {PREPARED_MANIFEST} lacks sane {', '.join(bad) or 'sha256'}; prepare it again"
        )
    return info


def load_prepared(path: str | os.PathLike, split: str = "train") -> TokenSource:
    """A prepared split, memory-mapped; the figures come from its files and manifest (files confined to the folder)."""
    folder = Path(path)
    manifest = read_prepared_manifest(folder)
    info = _split_info(folder, manifest, split)
    dtype = np.dtype(manifest["dtype"])
    tok_file = prepared_file(folder, info.get("tokens_file"), "tokens_file")
    index_file = prepared_file(folder, info.get("index_file"), "index_file")
    size = tok_file.stat().st_size if tok_file.is_file() else -1
    if size != info["tokens"] * dtype.itemsize:
        raise DataError(
            f"--data {folder}: {info['tokens_file']} holds {max(size, 0)} bytes, the manifest "
            f"says {info['tokens']} tokens of {dtype.name}; the folder is incomplete — "
            "prepare it again"
        )
    tokens = np.memmap(str(tok_file), dtype=dtype, mode="r") if size > 0 else np.zeros(0, dtype)
    try:
        offsets = np.load(str(index_file), mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"--data {folder}: {info['index_file']} is not an index prepare wrote ({exc}); prepare it again") from None
    if offsets.ndim != 1 or offsets.shape[0] != info["documents"] + 1 or int(offsets[-1]) != info["tokens"]:
        raise DataError(f"--data {folder}: {info['index_file']} does not match {info['tokens_file']}; prepare it again")
    desc = (
        f"prepared {folder} [{split}] ({manifest.get('source')}): {info['documents']} documents, "
        f"{info['tokens']} tokens, sha256 {info['sha256'][:12]}"
    )
    return TokenSource(tokens, desc, int(offsets.shape[0] - 1), int(info["unique_documents"]), info["sha256"], offsets, manifest)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Hold out the last ``val_fraction`` of the stream (train, val); no overlap."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError("val_fraction must be in [0, 1)")
    cut = int(round(tokens.shape[0] * (1.0 - val_fraction)))
    return tokens[:cut], tokens[cut:]


# ------------------------------------------------------------------ samples


class PackedDataset:
    """Non-overlapping ``seq_len + 1`` windows over a token stream."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if seq_len <= 0:
            raise ValueError("seq_len must be positive")
        self.tokens = tokens
        self.seq_len = seq_len
        self._n = max(0, (int(tokens.shape[0]) - 1) // seq_len)

    def __len__(self) -> int:
        return self._n

    @property
    def source_tokens(self) -> int:
        """Tokens in the whole stream."""
        return int(self.tokens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens the samples train on (inputs), exact: len(self) * seq_len."""
        return self._n * self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self._n:
            raise IndexError(i)
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def gather(self, indices: Sequence[int]) -> np.ndarray:
        return np.stack([self[int(i)] for i in indices]) if len(indices) else np.zeros((0, self.seq_len + 1), dtype=np.int64)


class ShardedBatches:
    """Deterministic, resumable, rank-disjoint batches of packed samples."""

    def __init__(
        self, dataset: PackedDataset, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        per_step = batch_size * world_size
        if len(dataset) < per_step:
            raise ValueError(
                f"dataset has {len(dataset)} samples of {dataset.seq_len + 1} tokens, "
                f"fewer than one step needs ({world_size} ranks x batch {batch_size}); "
                "use more data or a shorter --seq-len"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0  # samples of this epoch consumed by all ranks together
        self._perm_epoch: int | None = None
        self._perm: np.ndarray | None = None

    @property
    def samples_per_epoch(self) -> int:
        per_step = self.batch_size * self.world_size
        return (len(self.dataset) // per_step) * per_step

    def _order(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            n = len(self.dataset)
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self.epoch])
                self._perm = rng.permutation(n)
            else:
                self._perm = np.arange(n)
            self._perm_epoch = self.epoch
        assert self._perm is not None
        return self._perm

    def next_indices(self) -> np.ndarray:
        """Sample indices of this rank's next batch (advances the position)."""
        per_step = self.batch_size * self.world_size
        if self.cursor + per_step > len(self.dataset):
            self.epoch += 1
            self.cursor = 0
        order = self._order()
        start = self.cursor + self.rank * self.batch_size
        idx = order[start : start + self.batch_size]
        self.cursor += per_step
        return idx

    def next_batch(self):
        """This rank's next batch as a LongTensor [batch, seq_len + 1]."""
        import torch

        return torch.from_numpy(self.dataset.gather(self.next_indices()))

    def __iter__(self) -> ShardedBatches:
        return self

    def __next__(self):
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Global position (same on every rank), JSON-able."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": len(self.dataset),
            "seq_len": self.dataset.seq_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_samples") not in (None, len(self.dataset)):
            print(
                f"warning: data changed since the checkpoint ({state.get('num_samples')} "
                f"samples then, {len(self.dataset)} now); resuming by position",
                file=sys.stderr,
            )
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        self.seed = int(state.get("seed", self.seed))
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self._perm_epoch = None


class ValidationBatches:
    """The same rank-disjoint validation batches at every evaluation (no shuffle, no state).

    Each rank reads ``per_rank`` samples: ``min(len(dataset) // world_size,
    max_batches * batch_size)``, rounded down to whole batches when at least one
    fits; rank r takes samples r, r + world_size, ... Every rank gets the same
    number of batches of the same shape (FSDP's collectives need that).
    """

    def __init__(
        self, dataset: PackedDataset, batch_size: int, max_batches: int, rank: int = 0, world_size: int = 1, where: str = "validation data"
    ) -> None:
        per_rank = min(len(dataset) // world_size, max_batches * batch_size)
        if per_rank == 0:
            raise DataError(
                f"{where}: {len(dataset)} samples of {dataset.seq_len + 1} tokens, fewer than the "
                f"{world_size} ranks need (one each); give more validation data (a larger "
                "--val-fraction or --val-data) or a shorter --seq-len"
            )
        if per_rank >= batch_size:
            per_rank -= per_rank % batch_size
        self.dataset = dataset
        self.batch_size = min(batch_size, per_rank)
        self.per_rank = per_rank
        self.indices = np.arange(rank, per_rank * world_size, world_size)

    @property
    def tokens_per_rank(self) -> int:
        """Predicted tokens (labels) one evaluation scores on each rank."""
        return self.per_rank * self.dataset.seq_len

    def __iter__(self):
        import torch

        for s in range(0, self.per_rank, self.batch_size):
            yield torch.from_numpy(self.dataset.gather(self.indices[s : s + self.batch_size]))
