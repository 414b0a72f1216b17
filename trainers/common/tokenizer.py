"""Provides the trainers' tokenizers: a byte-level one that needs no files and a local transformers one, behind one interface.

Both have ``vocab_size``, ``eos_id``, ``bos_id``, ``pad_id``, ``encode(text) -> list[int]``,
``encode_np``, ``encode_batch``, ``decode(ids) -> str``, ``save(folder)``, ``describe() -> dict``:

- ``ByteTokenizer``: ids 0..255 are bytes, 256 BOS, 257 EOS, 258 PAD, 259 MASK (vocab 260);
  ``save`` writes ``gpudeck_byte_tokenizer.json``.
- ``HFTokenizer(path)``: ``AutoTokenizer.from_pretrained(path)`` (a local folder only);
  ``save`` calls ``save_pretrained``.
- ``load_tokenizer(spec=None)``: None / "byte" -> ByteTokenizer; a folder holding
  ``gpudeck_byte_tokenizer.json`` -> ByteTokenizer; any other folder -> HFTokenizer.
- ``has_tokenizer(folder)``: whether a folder (a model, a prepared corpus) holds a tokenizer
  ``load_tokenizer`` reads: the one rule both trainers use to pick up a model's own tokenizer.
- ``same_tokenizer(a, b)``: whether two ``describe()`` dicts give the same ids for the same text.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gpudeck.trainers.errors import InputError

BYTE_TOKENIZER_FILE = "gpudeck_byte_tokenizer.json"
# the files a saved tokenizer leaves in its folder (ours, transformers' fast and slow ones, sentencepiece)
TOKENIZER_FILES = (BYTE_TOKENIZER_FILE, "tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class TokenizerError(InputError, FileNotFoundError):
    """A tokenizer that cannot be loaded (no such folder); exit 2 with the fix."""


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a saved tokenizer (any of :data:`TOKENIZER_FILES`)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same ids for the same text: kind, vocabulary and specials agree (paths may differ)."""
    keys = ("kind", "vocab_size", "eos_id", "bos_id", "pad_id")
    return all(a.get(k) == b.get(k) for k in keys)


def _with_specials(ids: list[int], bos: int | None, eos: int | None) -> list[int]:
    """``ids`` with a BOS in front and/or an EOS at the end (None: not added)."""
    if bos is not None:
        ids.insert(0, bos)
    if eos is not None:
        ids.append(eos)
    return ids


class ByteTokenizer:
    """Byte-level tokenizer: 256 byte ids plus BOS/EOS/PAD/MASK; needs no files."""

    kind = "byte"
    bos_id = 256
    eos_id = 257
    pad_id = 258
    mask_id = 259
    vocab_size = 260

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        return _with_specials(list(text.encode("utf-8")), self.bos_id if add_bos else None, self.eos_id if add_eos else None)

    def encode_np(self, text: str) -> np.ndarray:
        """Fast path: the UTF-8 bytes as a uint16 array (no specials)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's ids (no specials), as arrays."""
        return [self.encode_np(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "byte",
            "vocab_size": self.vocab_size,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "pad_id": self.pad_id,
            "mask_id": self.mask_id,
            "note": "ids 0-255 are UTF-8 bytes; load with gpudeck.trainers.common.tokenizer.load_tokenizer(folder)",
        }

    def save(self, folder: str | os.PathLike) -> Path:
        path = Path(folder) / BYTE_TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.describe(), indent=2) + "\n")
        return path


class HFTokenizer:
    """A local transformers tokenizer folder behind the same small interface."""

    kind = "hf"

    def __init__(self, path: str | os.PathLike) -> None:
        from transformers import AutoTokenizer

        self.path = str(path)
        self.tok = AutoTokenizer.from_pretrained(self.path)
        self.vocab_size = len(self.tok)
        eos = self.tok.eos_token_id
        self.eos_id = int(eos) if eos is not None else int(self.tok.sep_token_id or 0)
        bos = self.tok.bos_token_id
        self.bos_id = int(bos) if bos is not None else self.eos_id
        pad = self.tok.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_id
        mask = getattr(self.tok, "mask_token_id", None)
        self.mask_id = int(mask) if mask is not None else None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(self.tok.encode(text, add_special_tokens=False))
        return _with_specials(ids, self.bos_id if add_bos else None, self.eos_id if add_eos else None)

    def encode_np(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Each text's ids (no specials), as arrays; one batched call to the fast tokenizer."""
        if not texts:
            return []
        ids = self.tok(list(texts), add_special_tokens=False)["input_ids"]
        return [np.asarray(x, dtype=np.int64) for x in ids]

    def decode(self, ids: Iterable[int]) -> str:
        text = self.tok.decode([int(i) for i in ids])
        if not isinstance(text, str):  # one sequence of ids decodes to one string
            raise TypeError(f"{self.path}: the tokenizer's decode returned {type(text).__name__}, expected str")
        return text

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "hf",
            "path": self.path,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "bos_id": self.bos_id,
            "pad_id": self.pad_id,
        }

    def save(self, folder: str | os.PathLike) -> Path:
        self.tok.save_pretrained(str(folder))
        return Path(folder)


def load_tokenizer(spec: str | os.PathLike | None = None) -> ByteTokenizer | HFTokenizer:
    """None or "byte" -> ByteTokenizer; a folder -> its saved tokenizer."""
    if spec is None or str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if (path / BYTE_TOKENIZER_FILE).is_file():
        return ByteTokenizer()
    if not path.exists():
        raise TokenizerError(f"tokenizer folder {path} does not exist; give a local tokenizer folder or 'byte'")
    return HFTokenizer(path)
