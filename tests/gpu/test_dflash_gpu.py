"""DFlash on a real GPU (skipped without CUDA): chunked CE vs plain in bf16, flex vs SDPA mask, a short run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]


def test_chunked_ce_matches_plain_and_saves_memory_on_gpu():
    from trainers.dflash_loss import chunked_linear_cross_entropy, plain_linear_cross_entropy

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    m, h, v = 4096, 256, 32000
    w = (torch.randn(v, h, device=dev, generator=g) * 0.05).bfloat16()
    x = torch.randn(m, h, device=dev, generator=g).bfloat16()
    y = torch.randint(0, v, (m,), device=dev, generator=g)
    wt = torch.rand(m, device=dev, generator=g)

    def run(fn):
        hid = x.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        loss = fn(hid)
        loss.backward()
        torch.cuda.synchronize()
        return loss.detach().float(), hid.grad.float(), torch.cuda.max_memory_allocated() - before

    lp, gp, mp = run(lambda hid: plain_linear_cross_entropy(hid, w, y, wt))
    for mode in ("fused", "recompute"):
        lc, gc, mc = run(lambda hid: chunked_linear_cross_entropy(hid, w, y, wt, chunk_rows=512, mode=mode))
        assert torch.allclose(lc, lp, rtol=2e-3), (mode, lc, lp)
        assert (gc - gp).abs().max() <= 2e-2 * gp.abs().max(), mode
        assert mc < 0.4 * mp, (mode, mc, mp)


def test_flex_mask_matches_dense_sdpa_mask():
    from transformers import Qwen3Config

    from trainers.dflash import _make_mask
    from trainers.dflash_loss import block_inputs, sample_anchors
    from trainers.dflash_model import DFlashDraftModel, drafter_config_from_target

    dev = torch.device("cuda")
    tc = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    cfg = drafter_config_from_target(tc, 2, 16, mask_token_id=511)
    torch.manual_seed(0)
    d = DFlashDraftModel(cfg).to(dev).bfloat16().eval()
    b, s = 2, 256
    anchors, _ = sample_anchors(torch.ones(b, s, dtype=torch.long), 8)
    anchors = anchors.to(dev)
    _, bpos = block_inputs(torch.zeros(b, s, dtype=torch.long, device=dev), anchors, 16, 511)
    pos = torch.cat([torch.arange(s, device=dev).expand(b, -1), bpos], 1)
    ctx = torch.randn(b, s, 2 * 256, device=dev, dtype=torch.bfloat16)
    noise = torch.randn(b, 8 * 16, 256, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        dense = d(noise, ctx, pos, _make_mask(anchors, s, 16, "sdpa", dev)).float()
        flex = d(noise, ctx, pos, _make_mask(anchors, s, 16, "flex", dev)).float()
    assert (dense - flex).abs().max() < 5e-2 * dense.abs().max()


def test_trainer_runs_on_gpu_and_reports_mfu(tmp_path):
    tel = tmp_path / "tel.jsonl"
    env = dict(os.environ, GPUDECK_TELEMETRY=str(tel))
    cmd = [sys.executable, "-m", "trainers.dflash", "--target-config", "tiny", "--fresh",
           "--out", str(tmp_path / "out"), "--max-steps", "4", "--seq-len", "256", "--batch-size", "2",
           "--num-anchors", "32", "--block-size", "8", "--drafter-layers", "2", "--corpus-bytes", "600000",
           "--eval-prompt-len", "32", "--eval-gen-len", "32"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    recs = [json.loads(x) for x in tel.read_text().splitlines()]
    man = next(r for r in recs if r["type"] == "manifest")
    assert man["device"].startswith("cuda:") and man["gpu_uuid"]
    steps = [r for r in recs if r["type"] == "step"]
    assert len(steps) == 4 and all(r["mfu"] is not None and r["mfu"] > 0 for r in steps)
    assert all(r["mem_peak_gib"] > 0 for r in steps)
    assert any(r["type"] == "eval" for r in recs)
