"""The published DFlash drafter shapes: per-layer sliding-window/full attention, as SpecForge defines them.

* ``--drafter-config`` reads SpecForge's ``configs/qwen3.6-27b-dflash.json`` (vendored next to
  ``tests/reference/specforge_dflash.py``, MIT, sgl-project/SpecForge a6b6b023): four sliding
  layers, window 2048, one full layer, its target layers and mask token;
* the dense masks equal SpecForge's ``create_dflash_sdpa_mask`` (full and sliding);
* a drafter of that shape (small widths), exported the way ``gpudeck.trainers.dflash`` exports it, loads in
  SpecForge's ``DFlashDraftModel`` from the same config and state dict, and both give the same
  outputs on CPU in float64 (and the window really bites: all-full masks give other outputs);
* the attention FLOPs count exactly the keys the masks let through.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gpudeck.trainers.dflash.config import drafter_config_from_file, read_drafter_config
from gpudeck.trainers.dflash.loss import block_inputs, build_attention_mask, visible_keys
from gpudeck.trainers.dflash.model import DFlashDraftModel, attention_layout, drafter_config_from_target
from gpudeck.trainers.dflash.trainer import make_masks
from tests.reference import specforge_dflash as ref

SEED_CONFIG = Path(__file__).resolve().parents[1] / "reference" / "qwen3.6-27b-dflash.json"
SEED_TYPES = ["sliding_attention"] * 4 + ["full_attention"]


def _target(hidden=32, layers=8, vocab=64):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )


def test_the_qwen36_27b_drafter_config_is_read_as_published():
    from transformers import Qwen3Config

    cfg = read_drafter_config(str(SEED_CONFIG))
    target = Qwen3Config(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
    )
    dcfg = drafter_config_from_file(cfg, target, block_size=32, mask_token_id=248070)
    assert attention_layout(dcfg) == (SEED_TYPES, 2048)
    assert dcfg.dflash_config == {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}
    assert (dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.head_dim) == (32, 8, 128)
    assert dcfg.intermediate_size == 17408 and dcfg.block_size == 32
    assert dcfg.rope_parameters["rope_theta"] == 1e7 and dcfg.max_position_embeddings == 262144
    with torch.device("meta"):
        d = DFlashDraftModel(dcfg)
    assert [layer.self_attn.sliding_window for layer in d.layers] == [2048] * 4 + [None]


def test_a_drafter_config_of_another_width_or_bad_layout_is_refused_naming_the_field(tmp_path):
    cfg = read_drafter_config(str(SEED_CONFIG))
    with pytest.raises(ValueError, match="hidden_size 5120 differs from the target's 32"):
        drafter_config_from_file(cfg, _target(), 16, 63)
    bad = dict(cfg, layer_types=["sliding_attention"] * 4)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="layer_types must list 5 entries"):
        read_drafter_config(str(p))
    p.write_text(json.dumps(dict(cfg, sliding_window=None)))
    with pytest.raises(ValueError, match="positive sliding_window"):
        read_drafter_config(str(p))


def test_the_config_checks_and_the_model_name_the_same_layer_kinds():
    """config.py spells the layer kinds itself (model.py, copied next to a saved drafter, imports nothing of gpudeck):
    the two must agree, or a file the check passes would name a kind the model does not build."""
    from gpudeck.trainers.dflash import config, model

    assert (config.FULL_ATTENTION, config.SLIDING_ATTENTION) == (model.FULL_ATTENTION, model.SLIDING_ATTENTION)
    assert config.LAYER_TYPES == model.LAYER_TYPES


def test_the_argument_checks_import_neither_torch_nor_transformers(tmp_path):
    """A run refused for its arguments (a drafter config, a block size without a gamma) answers without torch's import."""
    import subprocess
    import sys

    cfg = tmp_path / "drafter.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"]}))
    code = (
        "import sys\n"
        "from gpudeck.trainers.dflash.config import parse_args\n"
        "try:\n"
        f"    parse_args(['--target-config', 'tiny', '--drafter-config', {str(cfg)!r}, '--block-size', '12', '--fresh', '--out', 'o'])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    # refused for the sliding layer without a window: read_drafter_config ran, and nothing heavy was imported for it
    assert cp.stdout.split() == ["2", "False", "False"], (cp.stdout, cp.stderr[-2000:])
    assert "sliding_window" in cp.stderr, cp.stderr[-2000:]
    cfg.write_text(json.dumps({"num_hidden_layers": 2}))
    cp = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert cp.stdout.split() == ["2", "False", "False"], (cp.stdout, cp.stderr[-2000:])
    assert "no published loss-decay gamma" in cp.stderr, cp.stderr[-2000:]


@pytest.mark.parametrize("window", [None, 1, 3, 7, 40])
def test_dense_masks_equal_specforges(window):
    g = torch.Generator().manual_seed(window or 0)
    S, B, N = 37, 4, 6
    anchors = torch.sort(torch.randperm(S - 1, generator=g)[:N]).values.view(1, N).repeat(2, 1)
    anchors[1] = torch.sort(torch.randperm(S - 1, generator=g)[:N]).values
    keep = torch.ones_like(anchors, dtype=torch.bool)
    mine = build_attention_mask(anchors, S, B, window)
    theirs = ref.create_dflash_sdpa_mask(anchors, keep, S, B, "cpu", sliding_window=window)
    assert torch.equal(mine, theirs)
    assert visible_keys(anchors, B, window) == float(mine.sum())


def _export(d: DFlashDraftModel, folder: Path) -> Path:
    """What Trainer.export writes: save_pretrained plus dflash_model.py as dflash.py."""
    d.save_pretrained(str(folder))
    shutil.copy(Path(__file__).resolve().parents[2] / "trainers" / "dflash" / "model.py", folder / "dflash.py")
    return folder


def test_an_exported_sliding_window_drafter_matches_specforges_model_in_float64(tmp_path):
    W, B, S, N = 6, 4, 40, 5
    dcfg = drafter_config_from_target(_target(), 5, B, 63, layer_types=SEED_TYPES, sliding_window=W)
    torch.manual_seed(0)
    mine = DFlashDraftModel(dcfg).double().eval()
    with torch.no_grad():  # non-trivial norms, so that every weight matters
        for name, p in mine.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    folder = _export(mine, tmp_path / "drafter")
    saved = json.loads((folder / "config.json").read_text())
    assert saved["layer_types"] == SEED_TYPES and saved["sliding_window"] == W and saved["use_sliding_window"]

    theirs = ref.DFlashDraftModel.from_pretrained(str(folder), dtype=torch.float64).eval()
    theirs.config._attn_implementation = "sdpa"
    assert theirs.sliding_window == W and list(theirs.layer_types) == SEED_TYPES
    sd_mine, sd_theirs = mine.state_dict(), theirs.state_dict()
    assert sd_mine.keys() == sd_theirs.keys()
    assert all(torch.equal(sd_mine[k], sd_theirs[k]) for k in sd_mine)

    g = torch.Generator().manual_seed(1)
    n_ctx = len(dcfg.dflash_config["target_layer_ids"])
    feats = torch.randn(2, S, n_ctx * 32, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 60, (2, S), generator=g)
    anchors = torch.stack([torch.sort(torch.randperm(S - 1, generator=g)[:N]).values for _ in range(2)])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    _, bpos = block_inputs(ids, anchors, B, 63)
    noise = torch.randn(2, N * B, 32, generator=g, dtype=torch.float64)
    pos = torch.cat([torch.arange(S).unsqueeze(0).expand(2, -1), bpos], 1)
    masks = make_masks(anchors, S, B, "sdpa", "cpu", mine.layer_types, mine.sliding_window)
    their_masks = {
        t: ref.create_dflash_sdpa_mask(anchors, keep, S, B, "cpu", sliding_window=w)
        for t, w in (("full_attention", None), ("sliding_attention", W))
    }
    with torch.no_grad():
        out_mine = mine(noise, feats, pos, masks)
        out_theirs = theirs(position_ids=pos, attention_mask=their_masks, noise_embedding=noise, target_hidden=feats)
        all_full = mine(noise, feats, pos, masks["full_attention"])
    assert out_mine.shape == (2, N * B, 32)
    assert torch.allclose(out_mine, out_theirs, atol=1e-10, rtol=1e-10), (out_mine - out_theirs).abs().max()
    assert (all_full - out_mine).abs().max() > 1e-3  # the window changes what the sliding layers see

    # the exported folder also loads on its own (trust_remote_code, gpudeck's dflash.py) and agrees
    from transformers import AutoModel

    auto = AutoModel.from_pretrained(str(folder), trust_remote_code=True, dtype=torch.float64).eval()
    with torch.no_grad():
        assert torch.allclose(auto(noise, feats, pos, masks), out_mine, atol=1e-12)


def test_the_target_runs_and_counts_only_the_layers_the_features_need():
    from transformers import AutoModelForCausalLM

    from gpudeck.trainers.dflash.model import build_target_layer_ids
    from gpudeck.trainers.dflash.trainer import TargetFlops, target_features, truncate_target

    tc = _target(layers=10)
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tc).double().eval()
    ids = build_target_layer_ids(10, 3)
    assert ids == [1, 4, 7]
    x = torch.randint(0, 60, (2, 12))
    with torch.no_grad():
        want = target_features(target, x, ids)
    per_layer = sum(p.numel() for p in target.model.layers[0].parameters())
    fl = TargetFlops(target, ids)
    assert fl.layers_needed == 8 and fl.dense == 2.0 * 8 * per_layer
    assert truncate_target(target, ids, "cpu") == 8 and len(target.model.layers) == 8
    with torch.no_grad():
        assert torch.equal(target_features(target, x, ids), want)
    causal, tt = fl.batch(2, 12)
    attn_full = 2.0 * 8 * 4 * 2 * 8 * 12  # 2 * L_run * heads * 2 * head_dim * S, per token
    assert tt == 24 * (fl.dense + attn_full) and causal == 24 * (fl.dense + attn_full / 2)
