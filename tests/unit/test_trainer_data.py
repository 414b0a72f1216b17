"""Unit tests for gpudeck.trainers.common.data (and the pure parts of gpudeck.trainers.common.checkpoint / flops / runtime)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings
from hypothesis import strategies as st

from gpudeck.trainers.checkpoint_trust import CheckpointTrustError, write_manifest
from gpudeck.trainers.common import data as D
from gpudeck.trainers.common import tokenizer as T
from gpudeck.trainers.common.checkpoint import StartError, resolve_start
from gpudeck.trainers.common.flops import flops_per_token, mfu, peak_flops
from gpudeck.trainers.common.runtime import add_common_args, check_common_args


@pytest.fixture(scope="module")
def corpus_tokens() -> np.ndarray:
    return D.load_tokens(None, T.ByteTokenizer(), max_bytes=2 * 1024 * 1024).tokens


# ------------------------------------------------------------------ tokenizer


@given(st.text(max_size=200))
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = T.ByteTokenizer()
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert np.array_equal(tok.encode_np(text), np.asarray(tok.encode(text), dtype=np.uint16))


def test_byte_tokenizer_save_and_reload(tmp_path) -> None:
    tok = T.ByteTokenizer()
    tok.save(tmp_path)
    again = T.load_tokenizer(tmp_path)
    assert isinstance(again, T.ByteTokenizer)
    assert json.loads((tmp_path / T.BYTE_TOKENIZER_FILE).read_text())["vocab_size"] == 260
    assert isinstance(T.load_tokenizer(None), T.ByteTokenizer)
    assert isinstance(T.load_tokenizer("byte"), T.ByteTokenizer)


# ------------------------------------------------------------------ corpus


def test_builtin_corpus_is_large_varied_and_deterministic(corpus_tokens) -> None:
    files = D.builtin_corpus_files(2 * 1024 * 1024)
    assert files == D.builtin_corpus_files(2 * 1024 * 1024)  # deterministic
    assert files == sorted(files[: len(files)]) or len(files) > 50
    assert len(files) > 50, "many distinct source files"
    assert len({f.name for f in files}) > 50
    assert corpus_tokens.shape[0] >= 2 * 1024 * 1024
    # varied: many distinct byte values and many distinct 64-byte lines
    assert len(np.unique(corpus_tokens)) > 90
    text = T.ByteTokenizer().decode(corpus_tokens[:1_000_000].tolist())
    lines = [ln for ln in text.splitlines() if len(ln.strip()) > 20]
    assert len(set(lines)) > 0.5 * len(lines) > 5000
    again = D.load_tokens(None, T.ByteTokenizer(), max_bytes=2 * 1024 * 1024).tokens
    assert np.array_equal(corpus_tokens, again)


def test_builtin_corpus_walk_is_sorted_rglob_in_the_same_order(tmp_path, monkeypatch) -> None:
    """The lazy walk picks exactly what ``sorted(rglob("*.py"))`` less site-packages and __pycache__ picked, in that
    order: a folder and a file of the same stem, a symlinked folder (not entered), an unreadable folder, a ``*.py``
    folder, the excluded folders; then the real standard library."""
    import os

    root = tmp_path / "lib"
    for rel in ("a/x.py", "a.py", "a-b.py", "ab/y.py", "B.py", "pkg.py/z.py", "site-packages/s.py", "__pycache__/c.py", "d/e/f.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (root / "d" / "note.txt").write_text("not python\n")
    (root / "linked").symlink_to(root / "d", target_is_directory=True)
    (root / "locked").mkdir()
    (root / "locked" / "hidden.py").write_text("y = 2\n")
    (root / "locked").chmod(0)

    def reference(folder):  # what builtin_corpus_files walked before: every path listed, then sorted
        return sorted(p for p in folder.rglob("*.py") if "site-packages" not in p.parts and "__pycache__" not in p.parts)

    try:
        assert list(D._sorted_py_files(root)) == reference(root)
        if os.geteuid() != 0:  # root reads the locked folder anyway: both then list it
            assert root / "locked" / "hidden.py" not in reference(root)
    finally:
        (root / "locked").chmod(0o700)
    assert list(D._sorted_py_files(D._stdlib_dir())) == reference(D._stdlib_dir())
    monkeypatch.setattr(D, "_stdlib_dir", lambda: root)
    monkeypatch.setattr(D, "_site_dirs", lambda: [])
    assert D.builtin_corpus_files(10**9) == reference(root)


def test_text_jsonl_folder_and_bin_sources(tmp_path) -> None:
    tok = T.ByteTokenizer()
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    src = D.load_tokens(tmp_path / "a.txt", tok)
    assert tok.decode(src.tokens.tolist()) == "hello world" and src.tokens[-1] == tok.eos_id
    src = D.load_tokens(tmp_path / "b.jsonl", tok)
    assert src.documents == 2 and src.tokens.shape[0] == len("one") + len("two") + 2
    src = D.load_tokens(tmp_path, tok)
    assert src.documents == 3
    arr = np.arange(1000, dtype=np.uint32) * 70
    arr.tofile(tmp_path / "t.bin")
    src = D.load_tokens(tmp_path / "t.bin", dtype="uint32")
    assert np.array_equal(np.asarray(src.tokens), arr)
    with pytest.raises(FileNotFoundError):
        D.load_tokens(tmp_path / "missing.txt", tok)


def test_split_tokens_holds_out_tail() -> None:
    toks = np.arange(1000)
    train, val = D.split_tokens(toks, 0.1)
    assert train.shape[0] == 900 and val.shape[0] == 100
    assert np.intersect1d(train, val).size == 0


# ------------------------------------------------------------------ samples / sharding


def test_packed_dataset_sizes_exact() -> None:
    ds = D.PackedDataset(np.arange(1001), 10)
    assert len(ds) == 100 and ds.num_tokens == 1000 and ds.source_tokens == 1001
    assert ds[0].tolist() == list(range(11)) and ds[99][-1] == 1000
    assert len(D.PackedDataset(np.arange(1000), 10)) == 99


@settings(max_examples=30, deadline=None)
@given(world=st.integers(1, 4), batch=st.integers(1, 5), seed=st.integers(0, 2**31), n=st.integers(40, 300))
def test_sharding_is_disjoint_and_covers_epoch(world: int, batch: int, seed: int, n: int) -> None:
    ds = D.PackedDataset(np.arange(n * 4 + 1), 4)
    if len(ds) < world * batch:
        return
    loaders = [D.ShardedBatches(ds, batch, r, world, seed=seed) for r in range(world)]
    steps = loaders[0].samples_per_epoch // (world * batch)
    seen: list[int] = []
    for _ in range(steps):
        per_rank = [set(ld.next_indices().tolist()) for ld in loaders]
        for i in range(world):
            for j in range(i + 1, world):
                assert not per_rank[i] & per_rank[j]
        for s in per_rank:
            seen.extend(s)
    assert len(seen) == len(set(seen)) == loaders[0].samples_per_epoch
    # next step starts a new epoch with another order
    assert loaders[0].next_indices() is not None and loaders[0].epoch == 1


def test_batches_are_deterministic_and_state_round_trips(corpus_tokens) -> None:
    ds = D.PackedDataset(corpus_tokens, 64)
    a = D.ShardedBatches(ds, 4, 1, 2, seed=7)
    b = D.ShardedBatches(ds, 4, 1, 2, seed=7)
    for _ in range(3):
        assert torch.equal(a.next_batch(), b.next_batch())
    state = json.loads(json.dumps(a.state_dict()))  # JSON-able
    expected = [a.next_batch() for _ in range(5)]
    c = D.ShardedBatches(ds, 4, 1, 2, seed=0)
    c.load_state_dict(state)
    for want in expected:
        got = c.next_batch()
        assert got.shape == (4, 65) and got.dtype == torch.int64
        assert torch.equal(got, want)
    other = D.ShardedBatches(ds, 4, 0, 2, seed=7)
    assert not torch.equal(other.next_batch(), D.ShardedBatches(ds, 4, 1, 2, seed=7).next_batch())


def test_state_round_trips_across_epoch_boundary() -> None:
    ds = D.PackedDataset(np.arange(10 * 8 + 1), 8)  # 10 samples
    a = D.ShardedBatches(ds, 3, 0, 1, seed=1)
    for _ in range(3):
        a.next_batch()
    st_ = a.state_dict()
    want = [a.next_batch() for _ in range(4)]
    assert a.epoch >= 1
    b = D.ShardedBatches(ds, 3, 0, 1, seed=1)
    b.load_state_dict(st_)
    assert all(torch.equal(b.next_batch(), w) for w in want)


def test_too_small_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match="fewer than one step"):
        D.ShardedBatches(D.PackedDataset(np.arange(20), 8), 4, 0, 2)


# ------------------------------------------------------------------ start, flops, CLI


def test_resolve_start_rules(tmp_path) -> None:
    assert resolve_start(tmp_path, True, None).describe() == "fresh"
    with pytest.raises(StartError, match="no complete checkpoint"):
        resolve_start(tmp_path, False, "latest")
    step = tmp_path / "checkpoints" / "step_5"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"x")
    (step / "gpudeck_checkpoint.json").write_text("{}")
    with pytest.raises(StartError, match="refuses"):
        resolve_start(tmp_path, True, None)
    assert resolve_start(tmp_path, True, None, new_run_dir=True).archive_existing
    with pytest.raises(CheckpointTrustError, match="records no digests"):  # a manifest from before checkpoint trust
        resolve_start(tmp_path, False, "latest")
    assert resolve_start(tmp_path, False, "latest", trust=True).trust.trusted_by_flag
    write_manifest(step, {"step": 5})
    assert resolve_start(tmp_path, False, "latest").describe() == "resume 5"
    with pytest.raises(StartError, match="step_5"):
        resolve_start(tmp_path, False, "3")


def test_cli_requires_exactly_one_start(capsys) -> None:
    p = argparse.ArgumentParser()
    add_common_args(p)
    with pytest.raises(SystemExit) as exc:
        check_common_args(p, p.parse_args(["--out", "x"]))
    assert exc.value.code == 2
    assert "--fresh" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--out", "x", "--fresh", "--resume", "latest"])
    with pytest.raises(SystemExit):
        p.parse_args(["--out", "x", "--resume", "soon"])
    args = p.parse_args(["--out", "x", "--resume", "12"])
    check_common_args(p, args)
    assert args.resume == "12"


def test_flops_formula_and_peaks() -> None:
    # llama-1b shape at seq 2048: torchtitan's count by hand
    n, emb = 1_100_048_384, 32000 * 2048
    f = flops_per_token(n, emb, 22, 32, 64, 2048)
    assert f == 6 * (n - emb) + 12 * 22 * 32 * 64 * 2048
    assert mfu(50_000, f, 989e12) == pytest.approx(50_000 * f / 989e12)
    assert mfu(50_000, f, None) is None
    peak, reason = peak_flops("cpu")
    assert peak is None and "cpu" in reason


def test_causal_convention_halves_attention_only() -> None:
    from gpudeck.trainers.common.flops import attention_flops, causal_pairs, dense_flops, full_pairs, window_pairs

    n, emb, L, H, d, S = 1_100_048_384, 32000 * 2048, 22, 32, 64, 2048
    titan = flops_per_token(n, emb, L, H, d, S)
    causal = flops_per_token(n, emb, L, H, d, S, causal=True)
    assert causal == 6 * (n - emb) + 6 * L * H * d * S
    assert titan - causal == 6 * L * H * d * S  # exactly the halved attention term
    # the published llama-1b figures, converted: 52.9% / 56.3% torchtitan -> 48.9% / 52.1% causal
    assert round(52.9 * causal / titan, 1) == 48.9 and abs(56.3 * causal / titan - 52.1) < 0.1
    # the building blocks add up, and forward-only is a third of training
    assert dense_flops(n - emb) + attention_flops(L, H, d, causal_pairs(S)) / S == causal
    assert flops_per_token(n, emb, L, H, d, S, training=False, causal=True) == pytest.approx(causal / 3)
    assert full_pairs(S) == 2 * causal_pairs(S)
    # a sliding window: query i sees min(i + 1, W) keys; a window as long as S is causal (+S/2)
    brute = sum(min(i + 1, 5) for i in range(12))
    assert window_pairs(12, 5) == brute and window_pairs(12, 12) == causal_pairs(12) + 6


def test_model_flops_gives_both_conventions() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpudeck.trainers.common.flops import model_flops
    from gpudeck.trainers.presets import PRESETS

    kw = dict(PRESETS["tiny"])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    c = model_flops(model, cfg, 64)
    L, H, d = 4, 4, 64
    assert c.flops_per_token_torchtitan - c.flops_per_token == 6 * L * H * d * 64
    assert c.flops_per_token == flops_per_token(c.params_total, c.params_embedding, L, H, d, 64, causal=True)


def test_bad_jsonl_lines_are_named(tmp_path) -> None:
    import pytest

    from gpudeck.trainers.common.data import load_documents

    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "fine"}\n\n{"text": broken}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: not valid JSON"):
        load_documents(f)
    f.write_text('{"text": "fine"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: expected a string or an object"):
        load_documents(f)
    f.write_text('"plain"\n{"text": "doc"}\n')
    assert load_documents(f) == ["plain", "doc"]


def test_has_tokenizer_is_one_rule_for_both_trainers(tmp_path) -> None:
    """A model or corpus folder holds a tokenizer when it has any file a saved tokenizer leaves (sentencepiece's too)."""
    assert not T.has_tokenizer(tmp_path)
    for name in T.TOKENIZER_FILES:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_text("{}")
        assert T.has_tokenizer(folder), name
    T.ByteTokenizer().save(tmp_path / "byte")
    assert T.has_tokenizer(tmp_path / "byte")
    with pytest.raises(T.TokenizerError, match="does not exist"):
        T.load_tokenizer(tmp_path / "missing")
