"""Unit tests for fsdp_lm's performance options: the chunked loss head, the repeated-KV attention, the batch feeder, the profiler's kernel classes."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gpudeck.trainers.common import data as D
from gpudeck.trainers.common.profiling import StepProfiler, classify
from gpudeck.trainers.fsdp_lm import trainer as F


def _tiny(attn: str = "sdpa", seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpudeck.trainers.presets import PRESETS

    kw = dict(PRESETS["tiny"], hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    F._register_attention(attn)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).double()


def test_chunked_loss_head_gives_the_plain_loss_and_gradients() -> None:
    plain, chunked = _tiny(), _tiny()
    chunked.load_state_dict(plain.state_dict())
    F.install_chunked_loss(chunked, chunk_rows=7)  # chunks that do not divide the rows
    batch = torch.randint(0, 260, (3, 17))
    inputs, labels = batch[:, :-1], batch[:, 1:]
    logits = plain(input_ids=inputs, use_cache=False).logits  # float64 throughout
    want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    want.backward()
    got = chunked(input_ids=inputs, labels=labels)
    got.backward()
    assert got.dtype == torch.float64
    assert float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-12)
    for (name, a), (_, b) in zip(plain.named_parameters(), chunked.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-10), name
    # without labels it is the plain model (what validation and export call)
    with torch.no_grad():
        assert torch.allclose(chunked(input_ids=inputs, use_cache=False).logits, plain(input_ids=inputs, use_cache=False).logits)


def test_repeat_kv_attention_matches_sdpa() -> None:
    a, b = _tiny("sdpa"), _tiny(F.REPEAT_KV_ATTENTION)
    b.load_state_dict(a.state_dict())
    assert a.config.num_key_value_heads < a.config.num_attention_heads  # grouped-query
    ids = torch.randint(0, 260, (2, 33))
    with torch.no_grad():
        la = a(input_ids=ids, use_cache=False).logits
        lb = b(input_ids=ids, use_cache=False).logits
    assert torch.allclose(la, lb, atol=1e-10)


def test_batch_feeder_position_excludes_the_batch_fetched_ahead() -> None:
    ds = D.PackedDataset(np.arange(40 * 4 + 1), 4)
    ahead = F.BatchFeeder(D.ShardedBatches(ds, 2, seed=1), "cpu", pin=False, ahead=True)
    plain = D.ShardedBatches(ds, 2, seed=1)
    for _ in range(3):
        assert torch.equal(ahead.next(), plain.next_batch())
        ahead.prefetch()
        assert ahead.state_dict() == plain.state_dict()  # what a checkpoint now saves
    resumed = D.ShardedBatches(ds, 2, seed=1)
    resumed.load_state_dict(ahead.state_dict())
    assert torch.equal(ahead.next(), resumed.next_batch())


def test_kernel_classes_and_report_lines() -> None:
    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "gemm"
    assert classify("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "gemm"
    assert classify("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>") == "attention"
    assert classify("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert classify("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "triton"
    assert classify("ncclDevKernel_ReduceScatter_Sum_f32") == "nccl"
    assert classify("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert classify("Memcpy HtoD (Pinned -> Device)") == "memory"
    lines = StepProfiler(5, 2, on_gpu=True).report(
        [("sm90_xmma_gemm_x", 60.0, 10), ("flash_bwd", 20.0, 4), ("triton_poi_fused_1", 10.0, 8)], 100.0, 6
    )
    assert lines[0] == "profile: steps 5..6, 2 steps, 100.0 ms wall, 90.0 ms in GPU kernels (90.0%)"
    assert lines[1].startswith("profile class gemm") and "60.0%" in lines[1]
    assert any(ln.startswith("profile class (idle)") and "10.0%" in ln for ln in lines)
    assert lines[-3].startswith("profile top  1") and lines[-3].endswith("[gemm] sm90_xmma_gemm_x")
