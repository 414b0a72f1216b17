"""End-to-end tests of ``python -m gpudeck.trainers.fsdp_lm`` on CPU: real torch, torchrun, gloo.

Processes are started and stopped through tests/trainer_harness.py (by pid, each
worker checked for this test's GPUDECK_RUN_ID before it is killed).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

from tests.trainer_harness import FSDP_SMALL, Runs, WritesMarker, read_telemetry
from tests.trainer_harness import alive as _alive

FSDP = "gpudeck.trainers.fsdp_lm"
COMMON = FSDP_SMALL


def step_losses(records: list[dict], rank: int = 0) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["type"] == "step" and r["rank"] == rank}


@pytest.fixture(scope="module")
def runs():
    r = Runs()
    yield r
    r.teardown()


@pytest.fixture(scope="module")
def straight(tmp_path_factory, runs):
    """Reference: 2 ranks trained straight to step 8, checkpoints at 4 and 8."""
    out = tmp_path_factory.mktemp("fsdp") / "straight"
    rc, output, tel, _ = runs.run(FSDP, [*COMMON, "--max-steps", "8", "--checkpoint-every", "4", "--fresh"], out, nproc=2)
    assert rc == 0, output[-4000:]
    return out, tel, output


def test_straight_run_writes_telemetry_checkpoints_and_result(straight) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from gpudeck.trainers.common.checkpoint import list_checkpoints
    from gpudeck.trainers.fsdp_lm.trainer import PRESETS

    out, tel, _ = straight
    assert list_checkpoints(out) == [4, 8]
    manifests = [r for r in tel if r["type"] == "manifest"]
    assert sorted(m["rank"] for m in manifests) == [0, 1]
    kw = dict(PRESETS["tiny"])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    for m in manifests:
        assert m["params_total"] == n == m["params_trainable"]
        assert m["world_size"] == 2 and m["device"] == "cpu" and m["start"] == "fresh"
        assert m["dataset_samples"] > 10_000 and m["dataset_tokens"] >= 1024 * 1024
        assert m["dataset_sample_tokens"] == m["dataset_samples"] * 64
        assert m["kind"] == "fsdp" and "--fresh" in m["argv"]
    losses0, losses1 = step_losses(tel, 0), step_losses(tel, 1)
    assert sorted(losses0) == list(range(1, 9)) and losses0 == losses1
    assert losses0[8] < losses0[1] - 0.5, losses0  # it learns
    steps = [r for r in tel if r["type"] == "step"]
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None and r["flops_per_token"] > 0 for r in steps)
    assert all(r["mfu_torchtitan"] is None for r in steps)
    m = manifests[0]
    assert m["mfu_convention"].startswith("causal") and m["flops_per_token_torchtitan"] > m["flops_per_token"]
    assert {r["step"] for r in tel if r["type"] == "checkpoint" and r["rank"] == 0} == {4, 8}
    assert any(r["type"] == "heartbeat" for r in tel)
    assert {r["rank"] for r in tel if r["type"] == "done"} == {0, 1}
    result = json.loads((out / "result.json").read_text())
    assert result["final_step"] == 8 and result["world_size"] == 2
    assert result["params_total"] == n
    assert {int(k): v for k, v in result["losses"].items()} == losses0


def test_export_loads_with_from_pretrained(straight) -> None:
    from transformers import AutoModelForCausalLM

    from gpudeck.trainers.common.tokenizer import ByteTokenizer, load_tokenizer

    out, tel, _ = straight
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    manifest = next(r for r in tel if r["type"] == "manifest")
    assert sum(p.numel() for p in model.parameters()) == manifest["params_total"]
    tok = load_tokenizer(out / "final")
    assert isinstance(tok, ByteTokenizer)
    ids = torch.tensor([tok.encode("def main():\n    return 0\n")])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    # trained for 8 steps on Python source: better than uniform over the vocab
    assert float(loss) < 5.5


def test_failing_rank_stops_all_ranks_then_resume_matches_straight(straight, runs, tmp_path) -> None:
    ref = step_losses(straight[1])
    out = tmp_path / "crash"
    args = [*COMMON, "--max-steps", "8", "--checkpoint-every", "4"]
    rc, output, tel, seconds = runs.run(FSDP, [*args, "--fresh"], out, nproc=2, env={"GPUDECK_TEST_FAIL_AT_STEP": "6:1"}, timeout=90)
    assert rc != 0
    assert "injected failure at step 6 on rank 1" in output
    assert seconds < 60
    errors = [r for r in tel if r["type"] == "error"]
    assert 1 in {r["rank"] for r in errors}
    pids = [r["pid"] for r in tel if r["type"] == "manifest"]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "a rank lingered after the failure"
    crashed = step_losses(tel)
    assert crashed == {k: ref[k] for k in range(1, 6)}

    rc, output, tel2, _ = runs.run(FSDP, [*args, "--resume", "latest"], out, nproc=2)
    assert rc == 0, output[-4000:]
    assert {r["start"] for r in tel2 if r["type"] == "manifest"} == {"resume 4"}
    # the digest the save recorded is the one the resume verified
    saved_digest = next(r["metadata_sha256"] for r in tel if r["type"] == "checkpoint" and r["step"] == 4 and r["rank"] == 0)
    assert {r["checkpoint_metadata_sha256"] for r in tel2 if r["type"] == "manifest"} == {saved_digest}
    assert {r["checkpoint_trusted_by_flag"] for r in tel2 if r["type"] == "manifest"} == {False}
    resumed = step_losses(tel2)
    assert sorted(resumed) == [5, 6, 7, 8]
    for k in resumed:
        assert resumed[k] == pytest.approx(ref[k], abs=1e-6), (k, resumed[k], ref[k])


def test_resume_refuses_a_tampered_metadata_and_never_unpickles_it(straight, runs, tmp_path) -> None:
    import pickle  # noqa: TID251 - the hostile pickle the trainer must never read

    out = tmp_path / "tampered"
    shutil.copytree(straight[0] / "checkpoints", out / "checkpoints")
    marker = tmp_path / "marker"
    meta = out / "checkpoints" / "step_8" / ".metadata"
    meta.write_bytes(pickle.dumps(WritesMarker(marker)))
    for extra in ([], ["--trust-checkpoint"]):
        rc, output, tel, _ = runs.run(FSDP, [*COMMON, "--max-steps", "12", "--resume", "latest", *extra], out, nproc=None)
        assert rc == 2, output[-3000:]
        assert f"{meta} is not the file this checkpoint saved" in output
        assert "Traceback" not in output and len(output.strip().splitlines()) == 1, output
        assert [r["type"] for r in tel] == ["error"] and tel[0]["exit_code"] == 2
        assert not marker.exists()


def test_resume_of_a_group_writable_checkpoint_needs_the_flag(straight, runs, tmp_path) -> None:
    out = tmp_path / "shared"
    shutil.copytree(straight[0] / "checkpoints", out / "checkpoints")
    step = out / "checkpoints" / "step_8"
    step.chmod(0o777)
    rc, output, _, _ = runs.run(FSDP, [*COMMON, "--max-steps", "9", "--resume", "latest", "--no-export"], out, nproc=None)
    assert rc == 2 and f"{step} is writable by group" in output and "--trust-checkpoint" in output, output[-3000:]
    args = [*COMMON, "--max-steps", "9", "--resume", "latest", "--trust-checkpoint", "--no-export", "--no-final-checkpoint"]
    rc, output, tel, _ = runs.run(FSDP, args, out, nproc=None)
    assert rc == 0, output[-3000:]
    manifest = next(r for r in tel if r["type"] == "manifest")
    assert manifest["checkpoint_trusted_by_flag"] is True and "writable by group" in manifest["checkpoint_foreign"][0]


def test_fresh_refuses_folder_with_checkpoints(straight, runs) -> None:
    out = straight[0]
    rc, output, tel, _ = runs.run(FSDP, [*COMMON, "--max-steps", "2", "--fresh"], out, nproc=None)
    assert rc == 2
    assert "--fresh refuses" in output and "step_4" in output and "step_8" in output
    assert [r["type"] for r in tel] == ["error"] and tel[0]["exit_code"] == 2
    rc, output, _, _ = runs.run(FSDP, [*COMMON, "--max-steps", "2", "--fresh"], out, nproc=2)
    assert rc != 0 and "--fresh refuses" in output


def test_resume_missing_step_lists_existing(straight, runs) -> None:
    rc, output, _, _ = runs.run(FSDP, [*COMMON, "--max-steps", "8", "--resume", "5"], straight[0], nproc=None)
    assert rc == 2
    assert "step_5" in output and "step_4, step_8" in output


def test_missing_start_is_an_error(runs, tmp_path) -> None:
    rc, output, _, _ = runs.run(FSDP, [*COMMON, "--max-steps", "2"], tmp_path / "x", nproc=None)
    assert rc == 2
    assert "pick how to start" in output and "--fresh" in output and "--resume" in output
    assert not (tmp_path / "x").exists()


def test_new_run_dir_archives_old_checkpoints(straight, runs, tmp_path) -> None:
    out = tmp_path / "again"
    shutil.copytree(straight[0] / "checkpoints", out / "checkpoints")
    rc, output, tel, _ = runs.run(FSDP, [*COMMON, "--max-steps", "2", "--fresh", "--new-run-dir", "--no-export"], out, nproc=None)
    assert rc == 0, output[-4000:]
    archived = [p for p in out.iterdir() if p.name.startswith("checkpoints.archived-")]
    assert len(archived) == 1 and (archived[0] / "step_8").is_dir()
    from gpudeck.trainers.common.checkpoint import list_checkpoints

    assert list_checkpoints(out) == [2]
    manifest = next(r for r in tel if r["type"] == "manifest")
    assert manifest["world_size"] == 1 and manifest["start"] == "fresh"


def test_init_from_exported_folder_continues_from_trained_weights(straight, runs, tmp_path) -> None:
    out, tel, _ = straight
    ref = step_losses(tel)
    rc, output, tel2, _ = runs.run(
        FSDP,
        [
            "--init-from",
            str(out / "final"),
            "--seq-len",
            "64",
            "--batch-size",
            "4",
            "--corpus-bytes",
            str(1024 * 1024),
            "--max-steps",
            "2",
            "--fresh",
            "--no-export",
        ],
        tmp_path / "from_final",
        nproc=2,
    )
    assert rc == 0, output[-4000:]
    manifest = next(r for r in tel2 if r["type"] == "manifest")
    assert manifest["tokenizer"]["kind"] == "byte"  # picked up from the exported folder
    assert manifest["params_total"] == next(r for r in tel if r["type"] == "manifest")["params_total"]
    # sharded over 2 ranks from the exported weights: starts near where training ended
    assert step_losses(tel2)[1] < ref[1] - 0.5


def test_sigterm_stops_all_ranks_after_a_checkpoint(runs, tmp_path) -> None:
    from gpudeck.trainers.common.checkpoint import list_checkpoints

    out = tmp_path / "term"
    p, tel = runs.start(FSDP, [*COMMON, "--max-steps", "100000", "--fresh"], out, nproc=2)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and max(step_losses(read_telemetry(tel)), default=0) < 3:
        assert p.poll() is None, p.communicate()[0][-3000:]
        time.sleep(0.1)
    os.kill(p.pid, signal.SIGTERM)  # what gpudeck's agent sends first; torchrun forwards it
    output, _ = p.communicate(timeout=60)
    recs = read_telemetry(tel)
    done = [r for r in recs if r["type"] == "done"]
    assert {r["rank"] for r in done} == {0, 1}, output[-3000:]
    assert {r["reason"] for r in done} == {"stopped"}
    final = done[0]["final_step"]
    assert list_checkpoints(out) == [final]
    pids = [r["pid"] for r in recs if r["type"] == "manifest"]
    deadline = time.monotonic() + 10
    while any(_alive(x) for x in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(x) for x in pids)


def test_prepare_then_train_with_validation_then_resume_is_exact(runs, tmp_path) -> None:
    """A saved dataset -> gpudeck.trainers.prepare (2 processes) -> 2 ranks train from the token file
    (the source deleted: nothing re-tokenises) with val_loss records -> resume is exact."""
    datasets = pytest.importorskip("datasets")
    from gpudeck.trainers.common.checkpoint import list_checkpoints
    from gpudeck.trainers.common.data import PREPARED_MANIFEST, load_documents

    docs = load_documents(None, max_bytes=600 * 1024)
    src = tmp_path / "corpus"
    datasets.Dataset.from_dict({"n": list(range(len(docs))), "text": docs}).save_to_disk(str(src))
    prep = tmp_path / "prep"
    rc, output, _, _ = runs.run(
        "gpudeck.trainers.prepare", ["--data", str(src), "--num-proc", "2", "--val-fraction", "0.1"], prep, nproc=None
    )
    assert rc == 0, output[-3000:]
    prepared = json.loads((prep / PREPARED_MANIFEST).read_text())
    shutil.rmtree(src)

    args = [
        *COMMON,
        "--data",
        str(prep),
        "--max-steps",
        "6",
        "--checkpoint-every",
        "3",
        "--val-every",
        "2",
        "--val-batches",
        "2",
        "--no-export",
        "--prefetch",
        "yes",
    ]  # a batch fetched ahead is not counted as consumed in a checkpoint
    out = tmp_path / "straight"
    rc, output, tel, _ = runs.run(FSDP, [*args, "--fresh"], out, nproc=2)
    assert rc == 0, output[-4000:]
    assert list_checkpoints(out) == [3, 6]
    train = prepared["splits"]["train"]
    for m in (r for r in tel if r["type"] == "manifest"):
        assert m["dataset_prepared"] and m["dataset_tokens"] == train["tokens"]
        assert m["dataset_documents"] == train["documents"]
        assert m["dataset_unique_documents"] == train["unique_documents"]
        assert m["dataset_sha256"] == train["sha256"]
        assert m["dataset_samples"] == (train["tokens"] - 1) // 64
        assert m["tokenizer"]["kind"] == "byte" and m["val_every"] == 2
        assert m["val_samples"] == (prepared["splits"]["val"]["tokens"] - 1) // 64
    vals = [r for r in tel if r["type"] == "val_loss"]
    assert sorted({r["step"] for r in vals}) == [2, 4, 6]
    assert {r["rank"] for r in vals} == {0, 1}
    by_step = {r["step"]: r["val_loss"] for r in vals if r["rank"] == 0}
    assert all(r["val_loss"] == by_step[r["step"]] for r in vals)  # one figure, all ranks
    assert all(r["val_tokens"] == 2 * 2 * 4 * 64 for r in vals)  # ranks x batches x batch x seq
    assert 0 < by_step[6] < by_step[2]  # it learns, also on held-out documents
    result = json.loads((out / "result.json").read_text())
    assert result["final_val_loss"] == by_step[6]

    again = tmp_path / "again"
    (again / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "checkpoints" / "step_3", again / "checkpoints" / "step_3")
    rc, output, tel2, _ = runs.run(FSDP, [*args, "--resume", "latest"], again, nproc=2)
    assert rc == 0, output[-4000:]
    ref, resumed = step_losses(tel), step_losses(tel2)
    assert sorted(resumed) == [4, 5, 6]
    for k in resumed:
        assert resumed[k] == pytest.approx(ref[k], abs=1e-6), (k, resumed[k], ref[k])
    vals2 = {r["step"]: r["val_loss"] for r in tel2 if r["type"] == "val_loss" and r["rank"] == 0}
    assert sorted(vals2) == [4, 6]
    assert vals2[6] == pytest.approx(by_step[6], abs=1e-6)


def test_bad_corpus_options_exit_2_with_the_fix(runs, tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    src = tmp_path / "two_columns"
    datasets.Dataset.from_dict({"a": ["x" * 500] * 4, "b": ["y"] * 4}).save_to_disk(str(src))
    rc, output, tel, _ = runs.run(FSDP, [*COMMON, "--data", str(src), "--max-steps", "1", "--fresh"], tmp_path / "o", nproc=None)
    assert rc == 2 and "--text-column" in output, output[-3000:]
    assert [r["type"] for r in tel if r["type"] == "error"] == ["error"]


def test_chunked_loss_matches_plain_and_profile_prints_top_kernels(runs, tmp_path) -> None:
    args = [*COMMON, "--max-steps", "3", "--no-export", "--no-final-checkpoint", "--fresh"]
    # 2 ranks: the head's gradients, made inside its forward, must still be reduce-scattered
    rc, output, tel, _ = runs.run(FSDP, [*args, "--profile-steps", "1", "--profile-start", "2"], tmp_path / "plain", nproc=2)
    assert rc == 0, output[-3000:]
    lines = [ln for ln in output.splitlines() if ln.startswith("profile")]
    assert lines[0].startswith("profile: steps 2..2, 1 steps")
    assert any(ln.startswith("profile class gemm") for ln in lines)
    # the top op by time may be a collective's wait on a loaded machine: an aten kernel is among the top ones
    assert any(ln.startswith("profile top") and "aten::" in ln for ln in lines), lines
    rc, output, tel2, _ = runs.run(FSDP, [*args, "--loss-impl", "chunked", "--loss-chunk-rows", "100"], tmp_path / "chunked", nproc=2)
    assert rc == 0, output[-3000:]
    assert next(r for r in tel2 if r["type"] == "manifest")["loss_impl"] == "chunked"
    plain, chunked = step_losses(tel), step_losses(tel2)
    assert sorted(chunked) == [1, 2, 3]
    # same maths in other summation orders: equal to float32 rounding; steps 2 and 3 follow
    # updates, equal only if the head's gradients were averaged over the ranks as plain's are
    for k in plain:
        assert chunked[k] == pytest.approx(plain[k], abs=2e-5), (k, plain[k], chunked[k])
