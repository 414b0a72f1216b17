"""Provides prompt/response samples as the DFlash references treat them: one record per sample, truncated or padded, with token-budget batches.

SpecForge's DFlash data (and z-lab's) is one conversation per sample: its tokens
truncated to ``max_length``, a loss mask that is 0 on the prompt and 1 on the
response, padding that carries mask 0, and no packing (no record split across
windows, no context from one record reaching another). Here:

* ``load_records(path, tokenizer, seq_len, loss_on_prompt)``: a JSONL file of
  ``{"prompt": str, "response": str}`` lines -> ``Records``: each record is
  ``prompt + response + EOS`` truncated to ``seq_len``, mask 0 on the prompt (1
  with ``loss_on_prompt``) and 1 on the response and its EOS. A record left with
  no two consecutive supervised tokens (no anchor possible, e.g. a prompt that
  fills the window) is dropped and counted. Returns None for a file that is not
  prompt/response JSONL (the packed-text path applies).
* ``Records.collate(indices, length)``: ``(ids [b, length], mask [b, length])``,
  padded with the pad id and mask 0.
* ``RecordBatches``: the batch plan. Each epoch the records are shuffled
  (``numpy.random.default_rng([seed, epoch])``) and cut in order into batches:
  ``batch_size`` records each, or with ``token_budget`` as many consecutive
  records as fit ``count * padded_length <= token_budget`` (padded length: the
  batch's longest record rounded up to ``pad_multiple``, at most ``seq_len``; a
  record longer than the budget gets a batch of its own). Batches are padded to
  that length (``pad_to_seq_len`` pads every batch to ``seq_len``). Global
  batch ``k`` of an epoch goes to consumer ``k % world`` (rank order), whole
  rounds only, so every rank runs the same number of batches. The plan is a
  function of ``(seed, epoch)``; the position ``(epoch, round)`` is the same on
  every rank (``state_dict``), so a resume continues exactly.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Records:
    """Per-record token ids and loss masks (already truncated to ``seq_len``)."""

    ids: list[np.ndarray]
    masks: list[np.ndarray]
    seq_len: int
    pad_id: int
    dropped: int = 0
    truncated: int = 0
    source: str = ""
    lengths: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = np.asarray([len(x) for x in self.ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def supervised_tokens(self) -> int:
        return int(sum(int(m.sum()) for m in self.masks))

    def split(self, val_fraction: float) -> tuple[Records, Records]:
        """(train, held-out): the last ``val_fraction`` of the records are held out (whole records)."""
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError("val_fraction must be in [0, 1)")
        cut = int(round(len(self) * (1.0 - val_fraction)))

        def part(a: int, b: int) -> Records:
            return Records(self.ids[a:b], self.masks[a:b], self.seq_len, self.pad_id, source=self.source)

        train, held = part(0, cut), part(cut, len(self))
        train.dropped, train.truncated = self.dropped, self.truncated
        return train, held

    def concatenated(self) -> np.ndarray:
        """All records' tokens end to end (the evaluation's prompts come from the held-out ones)."""
        return np.concatenate(self.ids) if self.ids else np.zeros(0, dtype=np.int64)

    def collate(self, indices: Sequence[int] | np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of shape ``[len(indices), length]``: each record, then padding (pad id, mask 0)."""
        ids = np.full((len(indices), length), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(indices), length), dtype=np.int64)
        for row, i in enumerate(indices):
            n = min(length, int(self.lengths[int(i)]))
            ids[row, :n] = self.ids[int(i)][:n]
            mask[row, :n] = self.masks[int(i)][:n]
        return ids, mask


def has_two_supervised(mask: np.ndarray) -> bool:
    """Whether some t has mask[t] and mask[t+1] set (an anchor is possible; SpecForge's rule)."""
    m = np.asarray(mask).astype(bool)
    return bool((m[:-1] & m[1:]).any()) if m.shape[0] > 1 else False


def load_records(path: str | Path, tokenizer: Any, seq_len: int, loss_on_prompt: bool = False) -> Records | None:
    """One sample per ``{"prompt", "response"}`` JSONL record (see module docstring); None for other files."""
    from gpudeck.trainers.common.data import DataError, iter_jsonl

    p = Path(path)
    if p.suffix != ".jsonl" or not p.is_file():
        return None
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    n = dropped = truncated = 0
    for number, obj in iter_jsonl(p):
        if not (isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str)):
            if n == 0:
                return None
            raise DataError(
                f"{p}:{number}: record {n + 1} lacks a prompt/response pair (every line needs string fields 'prompt' and 'response')"
            )
        n += 1
        a = np.asarray(tokenizer.encode(obj["prompt"]), dtype=np.int64)
        b = np.asarray(tokenizer.encode(obj["response"]) + [tokenizer.eos_id], dtype=np.int64)
        tok = np.concatenate([a, b])
        mask = np.concatenate([np.full(len(a), 1 if loss_on_prompt else 0, dtype=np.uint8), np.ones(len(b), dtype=np.uint8)])
        if tok.shape[0] > seq_len:
            truncated += 1
            tok, mask = tok[:seq_len], mask[:seq_len]
        if not has_two_supervised(mask):
            dropped += 1
            continue
        ids.append(tok)
        masks.append(mask)
    if n == 0:
        return None
    pad = getattr(tokenizer, "pad_id", None)
    pad = int(pad) if pad is not None else int(tokenizer.eos_id)
    return Records(ids, masks, seq_len, pad, dropped=dropped, truncated=truncated, source=str(p))


class RecordBatches:
    """Deterministic, resumable batches of whole records for consumer ``rank`` of ``world`` (module docstring)."""

    def __init__(
        self,
        records: Records,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        token_budget: int | None = None,
        pad_multiple: int = 64,
        pad_to_seq_len: bool = False,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.records = records
        self.batch_size = int(batch_size)
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.token_budget = int(token_budget) if token_budget else None
        self.pad_multiple = max(1, int(pad_multiple))
        self.pad_to_seq_len = pad_to_seq_len or self.token_budget is None
        self.epoch = 0
        self.round = 0  # rounds of this epoch consumed (one batch per consumer each)
        self._plan_epoch: int | None = None
        self._plan: list[tuple[np.ndarray, int]] = []
        if len(self._batches(0)) < world_size:
            raise ValueError(
                f"{len(records)} records make {len(self._batches(0))} batches an epoch, fewer than "
                f"one round of {world_size} consumers needs; use more data, a smaller "
                "--batch-size or --token-budget"
            )

    def padded_length(self, longest: int) -> int:
        s = self.records.seq_len
        if self.pad_to_seq_len:
            return s
        m = self.pad_multiple
        return min(s, -(-int(longest) // m) * m)

    def _batches(self, epoch: int) -> list[tuple[np.ndarray, int]]:
        """The epoch's plan: (record indices, padded length) per global batch."""
        if self._plan_epoch == epoch:
            return self._plan
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.records))
        lengths = self.records.lengths
        plan: list[tuple[np.ndarray, int]] = []
        cur: list[int] = []
        longest = 0
        for i in order.tolist():
            if self.token_budget is None:
                cur.append(i)
                if len(cur) == self.batch_size:
                    plan.append((np.asarray(cur), self.padded_length(self.records.seq_len)))
                    cur = []
                continue
            grown = max(longest, int(lengths[i]))
            if cur and (len(cur) + 1) * self.padded_length(grown) > self.token_budget:
                plan.append((np.asarray(cur), self.padded_length(longest)))
                cur, longest = [], 0
                grown = int(lengths[i])
            cur.append(i)
            longest = grown
        if cur and self.token_budget is not None:
            plan.append((np.asarray(cur), self.padded_length(longest)))
        self._plan_epoch, self._plan = epoch, plan
        return plan

    @property
    def rounds_per_epoch(self) -> int:
        return len(self._batches(self.epoch)) // self.world_size

    def next_batch_plan(self) -> tuple[np.ndarray, int]:
        """(record indices, padded length) of this consumer's next batch; advances the position."""
        if self.round >= self.rounds_per_epoch:
            self.epoch += 1
            self.round = 0
        plan = self._batches(self.epoch)
        item = plan[self.round * self.world_size + self.rank]
        self.round += 1
        return item

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [b, L], loss mask [b, L])`` of this consumer's next batch."""
        idx, length = self.next_batch_plan()
        return self.records.collate(idx, length)

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "round": self.round,
            "seed": self.seed,
            "num_records": len(self.records),
            "token_budget": self.token_budget,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_records") not in (None, len(self.records)):
            print(
                f"warning: data changed since the checkpoint ({state.get('num_records')} records then, "
                f"{len(self.records)} now); resuming by position",
                file=sys.stderr,
            )
        self.epoch, self.round = int(state["epoch"]), int(state["round"])
        self.seed = int(state.get("seed", self.seed))


def max_batch_tokens(batch_size: int, seq_len: int, token_budget: int | None) -> int:
    """Capacity of one batch in tokens: what a split target rank's fixed-size message must hold."""
    if token_budget:
        return max(int(token_budget), int(seq_len))
    return int(batch_size) * int(seq_len)


__all__ = ["Records", "RecordBatches", "load_records", "has_two_supervised", "max_batch_tokens"]
