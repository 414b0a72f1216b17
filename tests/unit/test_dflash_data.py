"""Prompt/response data as the DFlash references treat it, the mask-token rule and the global loss normalisation.

* one sample per record: truncated to seq_len, padded with mask 0, mask 0 on the prompt (or 1 with
  loss_on_prompt), no record split or packed with another; records without two consecutive
  supervised tokens dropped and counted;
* token-budget batches: whole records, count x padded length <= budget, deterministic per
  (seed, epoch), disjoint across consumers, resumed exactly from state_dict;
* the mask token: SpecForge's order (explicit, drafter config, tokenizer MASK, len(tokenizer), pad, eos);
* the loss: gradients of sum(w*CE)/sum(w) over every rank and micro-batch, against a direct
  computation (one process, two micro-batches; and two gloo ranks with FSDP2).
"""

from __future__ import annotations

import json
import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gpudeck.trainers.common.tokenizer import ByteTokenizer
from gpudeck.trainers.dflash.data import RecordBatches, load_records
from gpudeck.trainers.dflash.loss import dflash_loss, finish_global_mean
from gpudeck.trainers.dflash.trainer import resolve_mask_token

EOS = ByteTokenizer.eos_id


def _write(path, pairs):
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in pairs))
    return path


def test_one_sample_per_record_with_prompt_and_padding_masked(tmp_path):
    data = _write(tmp_path / "d.jsonl", [("ab", "XYZ"), ("q" * 4, "r" * 30), ("p" * 20, "s"), ("hi", "ok")])
    rec = load_records(data, ByteTokenizer(), seq_len=16)
    # record 3 ("p"*20 + "s" + EOS) truncated to 16 tokens is all prompt: no anchor possible, dropped
    assert len(rec) == 3 and rec.dropped == 1 and rec.truncated == 2
    assert rec.ids[0].tolist() == list(b"abXYZ") + [EOS]
    assert rec.masks[0].tolist() == [0, 0, 1, 1, 1, 1]
    assert rec.ids[1].tolist() == list(b"qqqq" + b"r" * 12)  # truncated: the EOS is cut too
    assert rec.masks[1].tolist() == [0] * 4 + [1] * 12
    ids, mask = rec.collate([0, 2], 8)
    assert ids.shape == (2, 8)
    assert ids[0].tolist() == list(b"abXYZ") + [EOS, ByteTokenizer.pad_id, ByteTokenizer.pad_id]
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 1, 0, 0]  # padding carries mask 0
    assert ids[1, :5].tolist() == list(b"hiok") + [EOS] and mask[1, :5].tolist() == [0, 0, 1, 1, 1]
    on_prompt = load_records(data, ByteTokenizer(), seq_len=16, loss_on_prompt=True)
    assert on_prompt.masks[0].tolist() == [1] * 6 and on_prompt.dropped == 0
    # not prompt/response JSONL: the packed-text path applies
    plain = tmp_path / "p.jsonl"
    plain.write_text(json.dumps({"text": "x"}) + "\n")
    assert load_records(plain, ByteTokenizer(), 16) is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + json.dumps({"prompt": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: record 2 lacks a prompt/response pair"):
        load_records(bad, ByteTokenizer(), 16)


def _records(tmp_path, n=60, seed=0):
    rng = np.random.default_rng(seed)
    pairs = [("P" * int(rng.integers(1, 20)), "R" * int(rng.integers(2, 60))) for _ in range(n)]
    return load_records(_write(tmp_path / "r.jsonl", pairs), ByteTokenizer(), seq_len=64)


def test_token_budget_batches_are_whole_records_within_budget_deterministic_and_disjoint(tmp_path):
    rec = _records(tmp_path)
    budget = 160
    ranks = [RecordBatches(rec, 2, r, 2, seed=3, token_budget=budget) for r in range(2)]
    seen: list[int] = []
    for _ in range(ranks[0].rounds_per_epoch):
        for loader in ranks:
            idx, length = loader.next_batch_plan()
            assert length % 64 == 0 or length == 64
            assert len(idx) * length <= budget or len(idx) == 1
            assert length >= max(int(rec.lengths[i]) for i in idx)
            seen += idx.tolist()
    assert len(seen) == len(set(seen))  # every record at most once an epoch, across both ranks
    assert len(seen) >= len(rec) - 2 * 3  # only an incomplete last round is left out
    again = RecordBatches(rec, 2, 0, 2, seed=3, token_budget=budget)
    assert [again.next_batch_plan()[0].tolist() for _ in range(3)] == [
        RecordBatches(rec, 2, 0, 2, seed=3, token_budget=budget)._batches(0)[2 * k][0].tolist() for k in range(3)
    ]


def test_record_batches_resume_exactly(tmp_path):
    rec = _records(tmp_path, n=40)
    a = RecordBatches(rec, 3, 0, 1, seed=1, token_budget=128)
    straight = [a.next_batch() for _ in range(30)]  # crosses epochs
    b = RecordBatches(rec, 3, 0, 1, seed=1, token_budget=128)
    for _ in range(11):
        b.next_batch()
    state = json.loads(json.dumps(b.state_dict()))
    c = RecordBatches(rec, 3, 0, 1, seed=1, token_budget=128)
    c.load_state_dict(state)
    for k in range(11, 30):
        ids, mask = c.next_batch()
        assert np.array_equal(ids, straight[k][0]) and np.array_equal(mask, straight[k][1])
    fixed = RecordBatches(rec, 4, 0, 1, seed=1)  # no budget: --batch-size records padded to seq_len
    ids, mask = fixed.next_batch()
    assert ids.shape == (4, 64)


class _Tok:
    def __init__(self, mask=None, size=100, pad=None, eos=None):
        self.mask_id, self.vocab_size, self.pad_id, self.eos_id = mask, size, pad, eos


def test_mask_token_follows_specforges_order():
    cfg = {"dflash_config": {"mask_token_id": 7}}
    assert resolve_mask_token(5, cfg, _Tok(mask=9), 128) == (5, "--mask-token-id")
    assert resolve_mask_token(None, cfg, _Tok(mask=9), 128) == (7, "drafter config dflash_config.mask_token_id")
    assert resolve_mask_token(None, None, _Tok(mask=9), 128) == (9, "tokenizer mask token")
    assert resolve_mask_token(None, None, _Tok(size=100, pad=3), 128) == (100, "first unused embedding slot len(tokenizer)")
    assert resolve_mask_token(None, None, _Tok(size=128, pad=3, eos=4), 128) == (3, "tokenizer pad token")
    assert resolve_mask_token(None, None, _Tok(size=128, eos=4), 128) == (4, "tokenizer eos token")
    assert resolve_mask_token(None, None, _Tok(mask=200, size=128, eos=4), 128)[0] == 4  # out of range: skipped
    assert resolve_mask_token(None, None, ByteTokenizer(), 320) == (259, "tokenizer mask token")
    with pytest.raises(ValueError, match="--mask-token-id 500 is outside"):
        resolve_mask_token(500, None, ByteTokenizer(), 320)


def _micro(gen, rows):
    h = torch.randn(rows, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 11, (rows,), generator=gen)
    w = torch.rand(rows, generator=gen, dtype=torch.float64) * (torch.rand(rows, generator=gen) > 0.3)
    return h, y, w


def test_loss_is_normalised_by_the_step_weight_over_micro_batches():
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(8, 8, bias=False).double()
    head = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    micros = [_micro(gen, 5), _micro(gen, 13)]  # unequal supervised counts: mean of means would differ
    total = wsum = 0.0
    for h, y, w in micros:
        s, ws = dflash_loss(lin(h).unsqueeze(0), head, y.view(1, 1, -1), w.view(1, 1, -1), normalize=False, chunk_rows=4)
        s.backward()
        total, wsum = total + float(s.detach()), wsum + float(ws)
    loss, wtot, _ = finish_global_mean(lin.parameters(), total, wsum)
    got = lin.weight.grad.clone()
    lin.weight.grad = None
    h = torch.cat([m[0] for m in micros])
    y = torch.cat([m[1] for m in micros])
    w = torch.cat([m[2] for m in micros])
    direct = (torch.nn.functional.cross_entropy(lin(h) @ head.t(), y, reduction="none") * w).sum() / w.sum()
    direct.backward()
    assert abs(loss - float(direct)) < 1e-12 and abs(wtot - float(w.sum())) < 1e-12
    assert torch.allclose(got, lin.weight.grad, atol=1e-12)
    means = [dflash_loss(lin(hh).unsqueeze(0), head, yy.view(1, 1, -1), ww.view(1, 1, -1))[0] for hh, yy, ww in micros]
    assert abs(float(sum(means)) / 2 - float(direct)) > 1e-3  # the per-micro-batch mean is another number


def _rank_main(rank, world, port, out):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 8, bias=False).double()
    head = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    data = [[_micro(gen, 4 + 3 * r + 5 * m) for m in range(2)] for r in range(world)]  # same on every rank
    fully_shard(lin, mesh=init_device_mesh("cpu", (world,)))
    total = wsum = 0.0
    for h, y, w in data[rank]:
        s, ws = dflash_loss(lin(h).unsqueeze(0), head, y.view(1, 1, -1), w.view(1, 1, -1), normalize=False)
        s.backward()
        total, wsum = total + float(s.detach()), wsum + float(ws)
    loss, _, _ = finish_global_mean(lin.parameters(), total, wsum, group=None, world=world)
    grad = lin.weight.grad.full_tensor()
    if rank == 0:
        torch.save({"loss": loss, "grad": grad, "data": data, "head": head}, out)
    dist.destroy_process_group()


def test_loss_is_normalised_by_the_global_weight_across_ranks_fsdp2(tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "r0.pt"
    mp.spawn(_rank_main, args=(2, port, str(out)), nprocs=2, join=True)
    got = torch.load(out)
    torch.manual_seed(1)
    lin = torch.nn.Linear(8, 8, bias=False).double()
    flat = [m for r in got["data"] for m in r]
    h, y, w = (torch.cat([m[i] for m in flat]) for i in range(3))
    direct = (torch.nn.functional.cross_entropy(lin(h) @ got["head"].t(), y, reduction="none") * w).sum() / w.sum()
    direct.backward()
    assert abs(got["loss"] - float(direct)) < 1e-12
    assert torch.allclose(got["grad"], lin.weight.grad, atol=1e-12)
