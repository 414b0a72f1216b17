"""``gpudeck.trainers.dflash``'s numbers, pinned: short deterministic CPU runs give the losses they gave before.

The figures were recorded on main before DFlash moved onto the shared loop
(``trainers/common/loop.py``) and must not change with it (or with any refactor):

* colocated, one plain process, plain text: the loss and gradient norm of steps 1-4, the eval's tau
  at start and end, the checkpoints at 2 and 4; a resume from step 2 gives steps 3-4 again;
* colocated, one plain process, prompt/response records with a token budget and a sliding-window
  drafter: steps 1-3;
* split under torchrun, 1 target rank + 1 drafter rank: the drafter's steps 1-3.

A loss is the telemetry's (rounded to 6 places); a gradient norm is the full float. They are compared to a
relative 1e-5 (``_pinned``): CPU kernels sum in another order on another CPU model (on an AVX-512 Xeon the records' step 3
gives a gradient norm of 3.6697555 for the pinned 3.6697590, 3.6697550 with ATEN_CPU_CAPABILITY=avx2, and the last
digit of a loss moves by one), while a change to what is computed moves them by far more. A resume is compared exactly,
with the first run on the same machine.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

from tests.trainer_harness import DFLASH_SMALL, Runs, dflash_records_args

EVAL = ["--eval-prompt-len", "16", "--eval-gen-len", "16", "--eval-samples", "2"]

# step -> (loss, grad_norm), recorded on main at 933bddb (before the move onto the shared loop)
PLAIN = {
    1: (5.811043, 6.621697425842285),
    2: (5.501188, 10.939309120178223),
    3: (5.408652, 5.707473278045654),
    4: (4.713092, 5.592337608337402),
}
PLAIN_TAU = {0: (1.0, 1.0), 4: (1.0, 1.0)}
RECORDS = {1: (5.885247, 9.641548156738281), 2: (5.028758, 6.677329063415527), 3: (4.551142, 3.6697590351104736)}
SPLIT = {1: (5.880691, 7.839277744293213), 2: (5.558774, 9.949166297912598), 3: (5.439144, 4.737680912017822)}


@pytest.fixture(scope="module")
def runs():
    r = Runs()
    yield r
    r.teardown()


def _losses(tel: list[dict], rank: int) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in tel if r["type"] == "step" and r["rank"] == rank}


def _pinned(got: dict[int, tuple[float, float]], want: dict[int, tuple[float, float]]) -> None:
    assert got.keys() == want.keys(), (got, want)
    for step, (loss, norm) in want.items():
        assert got[step] == (pytest.approx(loss, rel=1e-5), pytest.approx(norm, rel=1e-5)), (step, got[step], want[step])


def _taus(tel: list[dict]) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["tau"], r["tau_all_anchors"]) for r in tel if r["type"] == "eval"}


def test_plain_text_losses_and_a_resume_are_pinned(tmp_path, runs) -> None:
    out = tmp_path / "plain"
    args = [*DFLASH_SMALL, *EVAL, "--max-steps", "4", "--checkpoint-every", "2"]
    rc, output, tel, _ = runs.run("gpudeck.trainers.dflash", [*args, "--fresh"], out)
    assert rc == 0, output[-4000:]
    print("PLAIN", _losses(tel, 0))
    print("PLAIN_TAU", _taus(tel))
    _pinned(_losses(tel, 0), PLAIN)
    assert _taus(tel) == PLAIN_TAU
    assert [r["step"] for r in tel if r["type"] == "checkpoint"] == [2, 4]
    # the records' order as main wrote it: the first eval, the checkpoints, the final eval, done
    kinds = [(r["type"], r.get("step")) for r in tel if r["type"] in ("manifest", "eval", "checkpoint", "done")]
    assert kinds == [("manifest", None), ("eval", 0), ("checkpoint", 2), ("checkpoint", 4), ("eval", 4), ("done", None)]
    done = [r for r in tel if r["type"] == "done"]
    assert len(done) == 1 and done[0]["final_step"] == 4 and done[0]["reason"] == "max_steps"
    result = json.loads((out / "result.json").read_text())
    assert result["final_step"] == 4 and result["stopped"] is False and result["eval_last"]["step"] == 4
    assert (out / "drafter" / "model.safetensors").is_file()

    rc, output, tel2, _ = runs.run("gpudeck.trainers.dflash", [*args, "--resume", "2"], out)
    assert rc == 0, output[-4000:]
    first = _losses(tel, 0)
    assert _losses(tel2, 0) == {s: first[s] for s in (3, 4)}  # exactly: the same machine, from the checkpoint


@pytest.fixture()
def records(tmp_path) -> list[str]:
    return [*dflash_records_args(tmp_path), "--no-eval"]


def test_records_losses_are_pinned(tmp_path, runs, records) -> None:
    rc, output, tel, _ = runs.run("gpudeck.trainers.dflash", [*records, "--max-steps", "3", "--fresh"], tmp_path / "rec")
    assert rc == 0, output[-4000:]
    print("RECORDS", _losses(tel, 0))
    _pinned(_losses(tel, 0), RECORDS)


def test_split_losses_are_pinned(tmp_path, runs) -> None:
    split = ["--topology", "split", "--target-ranks", "0", "--drafter-ranks", "1", "--queue-depth", "2"]
    rc, output, tel, _ = runs.run(
        "gpudeck.trainers.dflash", [*DFLASH_SMALL, *split, "--no-eval", "--max-steps", "3", "--fresh"], tmp_path / "split", nproc=2
    )
    assert rc == 0, output[-4000:]
    print("SPLIT", _losses(tel, 1))
    _pinned(_losses(tel, 1), SPLIT)
    assert all(r["loss"] is None for r in tel if r["type"] == "step" and r["rank"] == 0)
