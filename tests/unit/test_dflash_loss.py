"""Unit tests for the DFlash objective and drafter: anchors, mask, labels, decay, chunked lm_head + CE."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hypothesis import given, settings
from hypothesis import strategies as st

from gpudeck.trainers.dflash.gamma import decay_gamma
from gpudeck.trainers.dflash.loss import (
    block_inputs,
    build_attention_mask,
    chunked_linear_cross_entropy,
    dflash_loss,
    labels_and_weights,
    plain_linear_cross_entropy,
    sample_anchors,
    valid_anchor_mask,
)
from gpudeck.trainers.dflash.model import (
    DFlashDraftModel,
    build_target_layer_ids,
    drafter_config_from_target,
)

# ------------------------------------------------------------------ anchors


@settings(max_examples=60, deadline=None)
@given(
    seq_len=st.integers(3, 60),
    num_anchors=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    density=st.floats(0.0, 1.0),
)
def test_anchors_are_valid_sorted_unique(seq_len, num_anchors, seed, density):
    g = torch.Generator().manual_seed(seed)
    loss_mask = (torch.rand((3, seq_len), generator=g) < density).long()
    anchors, keep = sample_anchors(loss_mask, num_anchors, generator=g)
    valid = valid_anchor_mask(loss_mask)
    counts = valid.sum(1)
    assert anchors.shape == keep.shape
    assert anchors.shape[1] == max(1, min(num_anchors, int(counts.max())))
    for b in range(3):
        kept = anchors[b][keep[b]].tolist()
        assert len(kept) == min(int(counts[b]), anchors.shape[1])
        assert kept == sorted(set(kept)), "sorted and without repeats"
        for t in kept:
            assert 0 <= t < seq_len - 1
            assert loss_mask[b, t] and loss_mask[b, t + 1]


def test_anchors_uniform_and_redrawn():
    loss_mask = torch.ones((1, 21), dtype=torch.long)
    loss_mask[0, 10] = 0  # positions 9 and 10 are invalid (and 20, the last)
    g = torch.Generator().manual_seed(0)
    hits = torch.zeros(21)
    draws = set()
    for _ in range(3000):
        a, k = sample_anchors(loss_mask, 3, generator=g)
        hits[a[0]] += 1
        draws.add(tuple(a[0].tolist()))
    assert hits[9] == hits[10] == hits[20] == 0
    valid_hits = hits[valid_anchor_mask(loss_mask)[0]]
    assert valid_hits.numel() == 18
    expected = 3000 * 3 / 18
    assert (valid_hits - expected).abs().max() < 0.25 * expected  # uniform within noise
    assert len(draws) > 100  # redrawn every call


def test_anchor_rng_is_reproducible():
    lm = torch.ones((2, 50), dtype=torch.long)
    a1, _ = sample_anchors(lm, 8, torch.Generator().manual_seed(7))
    a2, _ = sample_anchors(lm, 8, torch.Generator().manual_seed(7))
    assert torch.equal(a1, a2)


# ------------------------------------------------------------------ mask, inputs, labels, weights


@settings(max_examples=40, deadline=None)
@given(seq_len=st.integers(4, 40), block=st.integers(2, 9), n=st.integers(1, 6), seed=st.integers(0, 999))
def test_mask_sees_strict_prefix_and_own_block_only(seq_len, block, n, seed):
    g = torch.Generator().manual_seed(seed)
    anchors, keep = sample_anchors(torch.ones((2, seq_len), dtype=torch.long), n, g)
    m = build_attention_mask(anchors, seq_len, block)
    nn_ = anchors.shape[1]
    assert m.shape == (2, 1, nn_ * block, seq_len + nn_ * block)
    assert m.dtype == torch.bool
    for b in range(2):
        for q in range(nn_ * block):
            i = q // block
            a = int(anchors[b, i])
            row = m[b, 0, q]
            # context: exactly positions < anchor; never the anchor or later
            assert row[:a].all() and not row[a:seq_len].any()
            blocks = row[seq_len:].view(nn_, block)
            assert blocks[i].all()
            others = torch.cat([blocks[:i], blocks[i + 1 :]])
            assert not others.any()


def test_block_inputs_and_labels():
    ids = torch.arange(100, 130).view(1, 30)
    lm = torch.ones_like(ids)
    lm[0, 25] = 0
    anchors = torch.tensor([[2, 20, 27]])
    keep = torch.tensor([[True, True, False]])
    bids, bpos = block_inputs(ids, anchors, 4, mask_token_id=7)
    assert bids.tolist() == [[102, 7, 7, 7, 120, 7, 7, 7, 127, 7, 7, 7]]
    assert bpos.tolist() == [[2, 3, 4, 5, 20, 21, 22, 23, 27, 28, 29, 30]]
    y, w = labels_and_weights(ids, lm, anchors, keep, 4, gamma=2.0)
    assert y[0, 0].tolist() == [102, 103, 104, 105]  # slot k -> input_ids[a + k], no shift
    assert y[0, 1].tolist() == [120, 121, 122, 123]
    d = [0.0, 1.0, math.exp(-0.5), math.exp(-1.0)]
    assert torch.allclose(w[0, 0], torch.tensor(d))
    assert torch.allclose(w[0, 1], torch.tensor(d))
    assert w[0, 2].abs().sum() == 0  # padded anchor slot carries nothing
    # a masked label position and positions past the end carry no weight
    y2, w2 = labels_and_weights(ids, lm, torch.tensor([[23, 27]]), torch.tensor([[True, True]]), 4, gamma=2.0)
    assert w2[0, 0].tolist()[2] == 0.0  # 23 + 2 = 25 is masked
    assert w2[0, 1, 3] == 0.0  # 27 + 3 = 30 is past the end
    assert w2[0, 1, 2] > 0


def test_decay_gamma_is_the_published_table_or_given():
    from gpudeck.trainers.dflash.gamma import GammaError

    assert decay_gamma(16) == 7 and decay_gamma(10) == 5 and decay_gamma(8) == 4
    assert decay_gamma(32, 7.0) == 7.0
    for b in (4, 12, 32):
        with pytest.raises(GammaError, match="give --gamma"):
            decay_gamma(b)
    with pytest.raises(GammaError, match="positive"):
        decay_gamma(16, 0.0)


# ------------------------------------------------------------------ chunked lm_head + CE


@pytest.mark.parametrize("mode", ["fused", "recompute"])
@pytest.mark.parametrize("weight_grad", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_ce_matches_plain_value_and_gradient(mode, weight_grad, chunk):
    g = torch.Generator().manual_seed(chunk)
    m, h, v = 53, 12, 97
    hid = torch.randn(m, h, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=weight_grad)
    y = torch.randint(0, v, (m,), generator=g)
    wt = torch.rand(m, generator=g, dtype=torch.float64)
    wt[::5] = 0.0
    a = chunked_linear_cross_entropy(hid, w, y, wt, chunk_rows=chunk, mode=mode)
    (2.5 * a).backward()
    gh, gw = hid.grad.clone(), (w.grad.clone() if weight_grad else None)
    hid.grad = None
    w.grad = None
    b = plain_linear_cross_entropy(hid, w, y, wt)
    (2.5 * b).backward()
    assert a.dtype == torch.float64
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert torch.allclose(gh, hid.grad, rtol=1e-10, atol=1e-12)
    if weight_grad:
        assert torch.allclose(gw, w.grad, rtol=1e-10, atol=1e-12)


def test_chunked_ce_gradcheck():
    g = torch.Generator().manual_seed(3)
    hid = torch.randn(9, 4, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 11, (9,), generator=g)
    wt = torch.rand(9, generator=g, dtype=torch.float64)
    for mode in ("fused", "recompute"):
        assert torch.autograd.gradcheck(lambda a, b: chunked_linear_cross_entropy(a, b, y, wt, chunk_rows=4, mode=mode), (hid, w))


def test_chunked_ce_no_grad_and_float32():
    g = torch.Generator().manual_seed(1)
    hid = torch.randn(40, 16, generator=g, requires_grad=True)
    w = torch.randn(300, 16, generator=g)
    y = torch.randint(0, 300, (40,), generator=g)
    wt = torch.ones(40)
    with torch.no_grad():
        a = chunked_linear_cross_entropy(hid, w, y, wt, chunk_rows=16)
    assert not a.requires_grad
    b = plain_linear_cross_entropy(hid, w, y, wt)
    assert torch.allclose(a, b, rtol=1e-5)


def test_dflash_loss_compact_equals_full():
    g = torch.Generator().manual_seed(2)
    hid = torch.randn(2, 6 * 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64)
    y = torch.randint(0, 50, (2, 6, 4), generator=g)
    wt = torch.rand(2, 6, 4, generator=g, dtype=torch.float64)
    wt[..., 0] = 0
    wt[1, 3:] = 0
    l1, s1 = dflash_loss(hid, w, y, wt, chunk_rows=5, compact=True)
    (g1,) = torch.autograd.grad(l1, hid)
    l2, s2 = dflash_loss(hid, w, y, wt, mode="plain", compact=False)
    (g2,) = torch.autograd.grad(l2, hid)
    assert torch.allclose(l1, l2) and torch.allclose(s1, s2) and torch.allclose(g1, g2)
    ce = torch.nn.functional.cross_entropy((hid.reshape(-1, 8) @ w.t()), y.reshape(-1), reduction="none")
    ref = (ce * wt.reshape(-1)).sum() / wt.sum()
    assert torch.allclose(l1, ref)


# ------------------------------------------------------------------ drafter


def test_target_layer_ids_match_released_configs():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert build_target_layer_ids(28, 1) == [14]
    ids = build_target_layer_ids(4, 3)
    assert all(0 <= i < 4 for i in ids)


def _tiny_drafter(layers=2, block=4):
    from transformers import Qwen3Config

    tc = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    cfg = drafter_config_from_target(tc, layers, block, mask_token_id=63)
    torch.manual_seed(0)
    return DFlashDraftModel(cfg).double().eval(), cfg


def test_drafter_block_never_sees_context_at_or_after_anchor_nor_other_blocks():
    d, cfg = _tiny_drafter()
    B, S, H = 4, 24, 32
    n_ctx = len(cfg.dflash_config["target_layer_ids"])
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, S, n_ctx * H, generator=g, dtype=torch.float64)
    anchors = torch.tensor([[3, 10, 17]])
    noise = torch.randn(1, 3 * B, H, generator=g, dtype=torch.float64)
    _, bpos = block_inputs(torch.zeros(1, S, dtype=torch.long), anchors, B, 63)
    pos = torch.cat([torch.arange(S).view(1, -1), bpos], 1)
    mask = build_attention_mask(anchors, S, B)
    base = d(noise, ctx, pos, mask)
    # perturb context at positions >= 10: block 0 (anchor 3) and block 1 (anchor 10) must not move
    ctx2 = ctx.clone()
    ctx2[:, 10:] += 5.0
    out2 = d(noise, ctx2, pos, mask)
    assert torch.allclose(out2[:, : 2 * B], base[:, : 2 * B], atol=1e-12)
    assert not torch.allclose(out2[:, 2 * B :], base[:, 2 * B :])  # block 2 (anchor 17) sees it
    # perturb block 1's inputs: blocks 0 and 2 must not move (no cross-block leakage)
    noise2 = noise.clone()
    noise2[:, B : 2 * B] += 3.0
    out3 = d(noise2, ctx, pos, mask)
    assert torch.allclose(out3[:, :B], base[:, :B], atol=1e-12)
    assert torch.allclose(out3[:, 2 * B :], base[:, 2 * B :], atol=1e-12)
    # non-causal inside a block: the first slot sees the last slot of its own block
    noise3 = noise.clone()
    noise3[:, B - 1] += 3.0
    assert not torch.allclose(d(noise3, ctx, pos, mask)[:, 0], base[:, 0])


def test_drafter_save_and_reload(tmp_path):
    d, cfg = _tiny_drafter(layers=1, block=8)
    d.save_pretrained(tmp_path)
    d2 = DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float64)
    assert d2.config.block_size == 8
    assert d2.config.dflash_config == cfg.dflash_config
    for (n1, p1), (n2, p2) in zip(d.state_dict().items(), d2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_compilable_chunk_kernel_matches_inplace_kernel():
    from gpudeck.trainers.dflash.loss import _softmax_ce_grad, _softmax_ce_grad_inplace

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(17, 41, generator=g, dtype=torch.float64)
    y = torch.randint(0, 41, (17,), generator=g)
    w = torch.rand(17, generator=g, dtype=torch.float64)
    l1, g1 = _softmax_ce_grad(logits, y, w)
    l2, g2 = _softmax_ce_grad_inplace(logits.clone(), y, w)
    assert torch.allclose(l1, l2, rtol=1e-12) and torch.allclose(g1, g2, atol=1e-14)
    ref = logits.clone().requires_grad_(True)
    (torch.nn.functional.cross_entropy(ref, y, reduction="none") * w).sum().backward()
    assert torch.allclose(g1, ref.grad, atol=1e-14)
