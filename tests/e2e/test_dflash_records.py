"""``gpudeck.trainers.dflash`` on prompt/response records with a token budget and a sliding-window drafter, on CPU.

* colocated, 2 ranks, ``--token-budget``: one sample per record (the manifest says so, with the
  mask token's source), losses finite; a resume from step 2 reproduces steps 3-4 exactly (the
  batch plan is a function of the seed and the epoch; the position is in the checkpoint);
* split, 1 target + 1 drafter rank, the same data: batches of varying shape travel in the
  fixed-size messages, the drafter trains;
* ``--drafter-config`` with sliding layers is what the exported drafter says.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

from tests.trainer_harness import Runs, dflash_records_args


@pytest.fixture(scope="module")
def runs():
    r = Runs()
    yield r
    r.teardown()


def _steps(tel, rank):
    return {r["step"]: r for r in tel if r["type"] == "step" and r["rank"] == rank}


@pytest.fixture()
def setup(tmp_path):
    return [*dflash_records_args(tmp_path), "--eval-prompt-len", "16", "--eval-gen-len", "16", "--eval-samples", "2"]


def test_records_with_a_token_budget_train_and_resume_exactly(tmp_path, runs, setup):
    out = tmp_path / "colo"
    rc, output, tel, _ = runs.run(
        "gpudeck.trainers.dflash", [*setup, "--max-steps", "4", "--checkpoint-every", "2", "--fresh"], out, nproc=2
    )
    assert rc == 0, output[-4000:]
    man = next(r for r in tel if r["type"] == "manifest")
    assert man["batching"].startswith("token budget 192") and man["token_budget"] == 192
    assert man["loss_mask"].startswith("per record: 0 on prompt tokens")
    assert man["mask_token_id"] == 259 and man["mask_token_source"] == "tokenizer mask token"
    assert man["drafter_layer_types"] == ["sliding_attention", "full_attention"]
    assert man["drafter_sliding_window"] == 8 and man["gamma"] == 2.0
    assert 300 < man["dataset_samples"] < 400  # whole records, not packed windows
    straight = {s: r["loss"] for s, r in _steps(tel, 0).items()}
    assert sorted(straight) == [1, 2, 3, 4] and all(v > 0 for v in straight.values())
    assert all(r["loss"] == straight[s] for s, r in _steps(tel, 1).items())  # one global figure
    # gpudeck's triage: stacks on SIGUSR2, the Flight Recorder on request, compute vs collective wait (CPU: wall time)
    assert man["stack_signal"] == "SIGUSR2" and man["flight_recorder"] == "request_file" and man["compute_timing"].startswith("wall time")
    for rank in (0, 1):
        assert all(r["compute_s"] > 0 and r["wait_s"] >= 0 and r["waits"] > 0 for r in _steps(tel, rank).values())
    saved = json.loads((out / "drafter" / "config.json").read_text())
    assert saved["layer_types"] == ["sliding_attention", "full_attention"] and saved["sliding_window"] == 8

    rc, output, tel2, _ = runs.run(
        "gpudeck.trainers.dflash", [*setup, "--max-steps", "4", "--checkpoint-every", "2", "--resume", "2"], out, nproc=2
    )
    assert rc == 0, output[-4000:]
    resumed = {s: r["loss"] for s, r in _steps(tel2, 0).items()}
    assert resumed == {3: straight[3], 4: straight[4]}, (resumed, straight)


def test_records_with_a_token_budget_in_the_split_topology(tmp_path, runs, setup):
    out = tmp_path / "split"
    rc, output, tel, _ = runs.run(
        "gpudeck.trainers.dflash",
        [*setup, "--topology", "split", "--target-ranks", "0", "--drafter-ranks", "1", "--max-steps", "3", "--fresh"],
        out,
        nproc=2,
    )
    assert rc == 0, output[-4000:]
    steps = _steps(tel, 1)
    assert sorted(steps) == [1, 2, 3] and all(r["loss"] > 0 for r in steps.values())
    for rank in (0, 1):  # the target rank (sends) and the drafter (receives) both split their steps
        assert all(r["compute_s"] > 0 and r["wait_s"] >= 0 for r in _steps(tel, rank).values())
