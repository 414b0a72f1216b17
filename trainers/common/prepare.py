"""Provides ``python -m gpudeck.trainers.prepare``: tokenise a corpus once, in parallel, into memory-mapped token files.

Usage::

    python -m gpudeck.trainers.prepare --data CORPUS --tokenizer TOK_FOLDER --out PREP \\
        [--text-column text] [--data-split train] [--val-fraction 0.01 | --val-data OTHER] \\
        [--num-proc N] [--seed 0] [--overwrite]

    python -m gpudeck.trainers.fsdp_lm --data PREP ... --fresh --out RUN

``--data`` is anything ``gpudeck.trainers.fsdp_lm --data`` reads (text / JSONL files and
folders, a dataset saved with ``save_to_disk``, parquet / arrow files, the
built-in corpus when omitted). Documents are tokenised by ``--num-proc``
worker processes (default: the CPUs this process may use), each reading its own
range of documents (a memory-mapped Arrow dataset is not copied to them), with a
progress bar on a terminal (tqdm; silent otherwise). Each document's ids are
followed by EOS, exactly as training on the source directly would join them.

The folder it writes (files appear under their names only once complete; the
manifest last)::

    PREP/gpudeck_prepared.json   the manifest (below)
    PREP/train.bin               tokens of the train split (uint16, or uint32 for vocabularies > 65535)
    PREP/train.idx.npy           int64 document offsets into train.bin (documents + 1 entries)
    PREP/val.bin, val.idx.npy    the validation split, when --val-fraction or --val-data
    PREP/tokenizer/              the tokenizer (gpudeck.trainers.common.tokenizer.load_tokenizer reads it)

Manifest: ``format`` (``gpudeck-prepared/1``), ``source``, ``text_column``,
``tokenizer`` (``describe()``), ``dtype``, ``max_token_id``, ``splits``:
{name: {``tokens_file``, ``index_file``, ``documents``, ``tokens``,
``unique_documents`` (distinct token sequences, by 64-bit hash), ``sha256``
(of the token file)}}, ``val_fraction``, ``val_source``, ``seed``,
``num_proc``, ``seconds``, ``created``.

Training ranks memory-map ``train.bin`` (``gpudeck.trainers.common.data.load_prepared``) and
never tokenise; the trainer's manifest takes its dataset figures (samples,
tokens, documents, unique documents, hash) from these files.

With ``--val-fraction F`` a seeded random ``F`` of the documents (at least one)
goes to ``val`` instead of ``train`` — whole documents, so the splits share no
text; ``--val-data`` tokenises a second source as ``val`` instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gpudeck.trainers.common.data import (
    DEFAULT_CORPUS_BYTES,
    PREPARED_FORMAT,
    PREPARED_MANIFEST,
    DocumentSource,
    encode_documents,
    open_documents,
)
from gpudeck.trainers.common.runtime import TrainerArgumentParser
from gpudeck.trainers.common.tokenizer import BYTE_TOKENIZER_FILE, load_tokenizer
from gpudeck.trainers.errors import InputError

CHUNK_DOCS = 256  # documents per task handed to a worker

# what each worker process holds (set by _init_worker: inherited over fork, never pickled)
_WORKER: dict[str, Any] = {}


class PrepareError(InputError):
    """The command line or the output folder is not usable; the message says the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = TrainerArgumentParser(
        prog="python -m gpudeck.trainers.prepare", description="Tokenise a corpus once into memory-mapped token files (gpudeck)."
    )
    p.add_argument(
        "--data", default=None, help="text/JSONL file or folder, saved dataset, parquet/arrow files (default: the built-in offline corpus)"
    )
    p.add_argument(
        "--text-column", default=None, help="column (or JSONL field) holding the text (default: 'text', else the only string column)"
    )
    p.add_argument("--data-split", default=None, help="split of a saved DatasetDict (default: train)")
    p.add_argument("--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES, help="bytes of text the built-in corpus gathers (no --data)")
    p.add_argument("--tokenizer", default=None, help="local tokenizer folder (AutoTokenizer) or 'byte' (default: byte-level)")
    p.add_argument("--out", required=True, help="folder to write (see the module docstring)")
    p.add_argument(
        "--val-fraction", type=float, default=0.0, help="fraction of the documents held out as the val split (seeded, whole documents)"
    )
    p.add_argument("--val-data", default=None, help="a second source tokenised as the val split")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out choice")
    p.add_argument("--num-proc", type=int, default=None, help="worker processes (default: the CPUs this process may use)")
    p.add_argument("--overwrite", action="store_true", help="replace a prepared folder already at --out")
    return p


# ------------------------------------------------------------------ workers


def _init_worker(source: DocumentSource, val_source: DocumentSource | None, tok_spec: str | None) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one process, one core
    _WORKER["sources"] = {"main": source, "val": val_source}
    _WORKER["tok"] = load_tokenizer(tok_spec)


def _encode_range(task: tuple[str, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, per-document lengths, per-document 64-bit hashes) of documents [start, end)."""
    which, start, end = task
    texts = _WORKER["sources"][which].texts(start, end)
    tokens, lengths = encode_documents(_WORKER["tok"], texts)
    hashes = np.zeros(lengths.shape[0], dtype=np.uint64)
    pos = 0
    for i, n in enumerate(lengths.tolist()):
        digest = hashlib.blake2b(tokens[pos : pos + n].tobytes(), digest_size=8).digest()
        hashes[i] = int.from_bytes(digest, "little")
        pos += n
    return tokens, lengths, hashes


# ------------------------------------------------------------------ writing


@dataclass
class SplitWriter:
    """Appends documents to one split's token file; keeps offsets, hashes and the sha256."""

    name: str
    folder: Path
    dtype: Any
    fh: BinaryIO | None = None
    sha: Any = field(default_factory=hashlib.sha256)
    lengths: list[np.ndarray] = field(default_factory=list)
    hashes: list[np.ndarray] = field(default_factory=list)
    max_token: int = 0

    def open(self) -> SplitWriter:
        self.fh = open(self.folder / f".{self.name}.bin.part", "wb")
        return self

    def write(self, tokens: np.ndarray, lengths: np.ndarray, hashes: np.ndarray) -> None:
        if lengths.shape[0] == 0:
            return
        data = tokens.astype(self.dtype, copy=False).tobytes()
        assert self.fh is not None
        self.fh.write(data)
        self.sha.update(data)
        self.lengths.append(lengths)
        self.hashes.append(hashes)
        self.max_token = max(self.max_token, int(tokens.max(initial=0)))

    def finish(self) -> dict[str, Any]:
        """Close, write the index, move both files to their names; the split's manifest entry."""
        assert self.fh is not None
        self.fh.close()
        lengths = np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)
        hashes = np.concatenate(self.hashes) if self.hashes else np.zeros(0, np.uint64)
        offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens_file, index_file = f"{self.name}.bin", f"{self.name}.idx.npy"
        with open(self.folder / f".{index_file}.part", "wb") as fh:
            np.save(fh, offsets)
        os.replace(self.folder / f".{self.name}.bin.part", self.folder / tokens_file)
        os.replace(self.folder / f".{index_file}.part", self.folder / index_file)
        return {
            "tokens_file": tokens_file,
            "index_file": index_file,
            "documents": int(lengths.shape[0]),
            "tokens": int(offsets[-1]),
            "unique_documents": int(np.unique(hashes).shape[0]),
            "sha256": self.sha.hexdigest(),
        }


def _held_out(n_docs: int, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of the documents that go to val: a seeded random ``fraction`` (>= 1 document)."""
    mask = np.zeros(n_docs, dtype=bool)
    if fraction <= 0:
        return mask
    if n_docs < 2:
        raise PrepareError(
            f"--val-fraction {fraction}: the source has {n_docs} document(s), a split by "
            "documents needs at least 2; pass --val-data OTHER instead"
        )
    k = min(n_docs - 1, max(1, int(round(n_docs * fraction))))
    mask[np.random.default_rng([seed, n_docs]).permutation(n_docs)[:k]] = True
    return mask


def _tasks(which: str, n: int) -> list[tuple[str, int, int]]:
    return [(which, s, min(s + CHUNK_DOCS, n)) for s in range(0, n, CHUNK_DOCS)]


def _progress(total: int, desc: str):
    from tqdm import tqdm

    # disable=None: silent when stderr is not a terminal (logs, the agent)
    return tqdm(total=total, desc=desc, unit="doc", disable=None, dynamic_ncols=True)


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenise ``args.data`` into ``args.out``; returns the manifest."""
    t0 = time.time()
    out = Path(args.out)
    if not 0.0 <= args.val_fraction < 1.0:
        raise PrepareError(f"--val-fraction {args.val_fraction}: must be in [0, 1)")
    if args.val_fraction > 0 and args.val_data is not None:
        raise PrepareError("give --val-fraction or --val-data, not both")
    if (out / PREPARED_MANIFEST).exists() and not args.overwrite:
        raise PrepareError(f"--out {out} already holds a prepared corpus; pass --overwrite to replace it")
    if out.exists() and not (out / PREPARED_MANIFEST).exists() and any(out.iterdir()) and not args.overwrite:
        raise PrepareError(f"--out {out} is a folder with other files; name an empty or new folder")
    num_proc = args.num_proc or len(os.sched_getaffinity(0))
    if num_proc < 1:
        raise PrepareError(f"--num-proc {args.num_proc}: must be at least 1")

    tok = load_tokenizer(args.tokenizer)
    source = open_documents(args.data, max_bytes=args.corpus_bytes, text_column=args.text_column, split=args.data_split)
    val_source = None
    if args.val_data is not None:
        val_source = open_documents(args.val_data, text_column=args.text_column, option="--val-data")
    dtype = np.uint16 if tok.vocab_size <= 65535 else np.uint32

    out.mkdir(parents=True, exist_ok=True)
    (out / PREPARED_MANIFEST).unlink(missing_ok=True)
    tok_dir = out / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    tok.save(tok_dir)
    # the workers load what was saved: the same tokenizer, whatever --tokenizer was
    tok_spec = None if (tok_dir / BYTE_TOKENIZER_FILE).is_file() else str(tok_dir)

    train = SplitWriter("train", out, dtype).open()
    val = SplitWriter("val", out, dtype).open() if (args.val_fraction > 0 or val_source) else None
    held = _held_out(len(source), args.val_fraction, args.seed)
    jobs: list[tuple[str, int, int]] = _tasks("main", len(source))
    if val_source is not None:
        jobs += _tasks("val", len(val_source))
    total_docs = len(source) + (len(val_source) if val_source else 0)

    def consume(results) -> None:
        with _progress(total_docs, f"prepare {out.name}") as bar:
            for (which, start, end), (tokens, lengths, hashes) in zip(jobs, results):
                if which == "val":
                    assert val is not None
                    val.write(tokens, lengths, hashes)
                else:
                    _write_split(train, val, held[start:end], tokens, lengths, hashes)
                bar.update(end - start)

    if num_proc == 1 or len(jobs) <= 1:
        _init_worker(source, val_source, tok_spec)
        consume(_encode_range(j) for j in jobs)
    else:
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(num_proc, initializer=_init_worker, initargs=(source, val_source, tok_spec)) as pool:
            consume(pool.imap(_encode_range, jobs, chunksize=1))

    splits = {"train": train.finish()}
    if val is not None:
        splits["val"] = val.finish()
    if splits["train"]["documents"] == 0:
        raise PrepareError(f"--data {args.data}: no documents to train on (all were empty)")
    manifest = {
        "format": PREPARED_FORMAT,
        "source": source.description,
        "text_column": getattr(source, "column", args.text_column),
        "tokenizer": tok.describe(),
        "dtype": np.dtype(dtype).name,
        "max_token_id": max(w.max_token for w in (train, val) if w is not None),
        "splits": splits,
        "val_fraction": args.val_fraction,
        "val_source": val_source.description if val_source else None,
        "seed": args.seed,
        "num_proc": num_proc,
        "seconds": round(time.time() - t0, 3),
        "created": time.time(),
    }
    tmp = out / f".{PREPARED_MANIFEST}.part"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / PREPARED_MANIFEST)
    return manifest


def _write_split(
    train: SplitWriter, val: SplitWriter | None, held: np.ndarray, tokens: np.ndarray, lengths: np.ndarray, hashes: np.ndarray
) -> None:
    """Route a chunk's documents to train and val by the held-out mask (order kept)."""
    if val is None or not held.any():
        train.write(tokens, lengths, hashes)
        return
    per_token = np.repeat(held, lengths)
    train.write(tokens[~per_token], lengths[~held], hashes[~held])
    val.write(tokens[per_token], lengths[held], hashes[held])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifest = prepare(args)
    except (InputError, FileNotFoundError) as exc:
        print(f"prepare: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    for name, info in manifest["splits"].items():
        print(
            f"prepare: {name}: {info['documents']:,} documents ({info['unique_documents']:,} unique), "
            f"{info['tokens']:,} tokens -> {Path(args.out) / info['tokens_file']} "
            f"(sha256 {info['sha256'][:12]})",
            flush=True,
        )
    print(f"prepare: {manifest['num_proc']} processes, {manifest['seconds']:.1f} s", flush=True)
    return 0
