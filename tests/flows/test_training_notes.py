"""The compressed-training summary's lines about how each compressor's training went."""

from paperline.flows.compressed_training import _notes
from paperline.kernels.train import format_ratio


def _result(**changes):
    return {"name": "topk", "skipped_steps": [], "failures": [], "resumed_from": [None], **changes}


def test_an_uninterrupted_run_has_nothing_to_say():
    assert _notes(_result()) == []


def test_a_run_resumed_from_an_earlier_runs_checkpoints_says_so():
    """A re-run after Ctrl-C resumed silently (a trial). It no longer differs from an
    uninterrupted run (tests/kernels/test_train.py), and says so."""
    (line,) = _notes(_result(resumed_from=[3]))
    assert line.startswith("topk: resumed from the checkpoints of epoch 3 left by an earlier run of this configuration")
    assert "trained on as an uninterrupted run would have (on a CPU to the same result" in line
    assert line.endswith("set another checkpoint_prefix or seed to train from scratch")


def test_restarts_skipped_steps_and_a_missed_drill_are_named():
    lines = _notes(_result(skipped_steps=[4, 9], failures=["attempt 0: RuntimeError: rank 1 died"], resumed_from=[None, 1]))
    assert lines == ["topk: skipped 2 step(s) with NaN/inf loss or gradients (global steps [4, 9])",
                     "topk: restarted 1 time(s) after a failure, from the checkpoints of epoch 1; attempt 0: "
                     "RuntimeError: rank 1 died"]
    (restarts,) = _notes(_result(failures=["attempt 0: OSError", "attempt 1: OSError"], resumed_from=[None, None, 0]))
    assert restarts == ("topk: restarted 2 time(s) after a failure, from the start (no checkpoint yet), the checkpoints "
                        "of epoch 0; attempt 0: OSError")
    (drill,) = _notes(_result(resumed_from=[2], drill_missed=5))
    assert drill.startswith("topk: the crash drill did not run (crash_rank_at_step=5 was not reached: training "
                            "resumed from the checkpoints of epoch 2)")


def _epochs(n, accuracy=92.0, loss=0.3):
    return [{"epoch": e, "test_accuracy_pct": accuracy, "train_loss": loss} for e in range(n)]


def test_a_run_resumed_from_a_finished_runs_checkpoints_says_nothing_was_trained():
    """Re-run without its crash drill (not part of the checkpoints' key), a finished configuration
    said it resumed the checkpoints of its last epoch "(interrupted)" and "trained on" (a trial)."""
    (line,) = _notes(_result(resumed_from=[1], epochs=_epochs(2)))
    assert line == ("topk: an earlier run of this configuration left the checkpoints of every epoch (the last is "
                    "epoch 1), so nothing was trained: these are its results; set another checkpoint_prefix or "
                    "seed to train from scratch")
    (line,) = _notes(_result(resumed_from=[0], epochs=_epochs(2)))  # one epoch left: trained on
    assert "(interrupted), and trained on as an uninterrupted run would have" in line


def test_a_run_that_learned_nothing_says_so():
    """lr=5 finished at chance accuracy (10.0%) with a mean training loss of 5.46, below the 100x a
    uniform guess's that fails a run as diverged, and nothing said so (a trial)."""
    def run(accuracy, loss, classes=10):
        return _result(epochs=_epochs(2), n_classes=classes, final_test_accuracy_pct=accuracy, final_train_loss=loss,
                       compression_ratio=100.0)

    (line,) = _notes(run(10.0, 5.46))
    assert line == ("topk: learned nothing: test accuracy 10.0% is chance for 10 classes, and the last epoch's mean "
                    "training loss 5.46 is no better than a uniform guess's 2.30; the learning rate (lr) may be too "
                    "large, the run too short, or topk's compression too strong (it sent 100.0x fewer bytes than "
                    "dense)")
    # (fft at theta 1e-6: the note named only lr and the run's length, a trial); none compresses nothing
    (line,) = _notes({**run(10.0, 5.46), "name": "none"})
    assert line.endswith("the learning rate (lr) may be too large, the run too short"), line
    (line,) = _notes({**run(10.0, 5.46), "compression_ratio": 0.97})  # (fft at theta 1: it sent more, a review)
    assert line.endswith("the learning rate (lr) may be too large, the run too short"), line
    assert _notes(run(10.9, float("nan")))  # a NaN loss is no better
    assert _notes(run(10.0, 2.2)) == []  # learning (below ln 10), still at chance after few steps
    assert _notes(run(11.5, 3.0)) == [] and _notes(run(92.5, 0.3)) == []  # above chance
    assert _notes(run(26.5, 1.5, classes=4)) == [] and _notes(run(25.0, 1.5, classes=4))  # chance is 1/C


def test_a_ratio_near_one_shows_which_side_of_one_it_is():
    """fft at θ=1 and 32 bits sent 81,259 bytes to none's 78,824, and the table said 1.0 / 1.0x."""
    got = [format_ratio(x) for x in (78824 / 81259, 1.0, 1.04, 0.5, 15.0, 14.96)]
    assert got == ["0.97", "1.0", "1.04", "0.5", "15.0", "15.0"]


def test_the_table_says_fewer_or_more_bytes_than_none_and_isgds_counts_when_on():
    """fft at theta 1 and 32 bits sends 3% more than none: "0.97x" in a column of "fewer bytes"
    read as fewer (a trial); ISGD's flagged batches and extra steps were only in MLflow (a trial)."""
    from types import SimpleNamespace

    from paperline.flows.compressed_training import _summary, bytes_vs_none

    assert [bytes_vs_none(x) for x in (15.0, 78824 / 81259, 1.0, None)] == ["15.0x fewer", "1.03x more", "same", "-"]

    def ran(name, sent, flagged):
        return {**_result(name=name), "final_test_accuracy_pct": 92.0, "bytes_sent_per_step": sent,
                "compression_ratio": 78824 / sent, "codec_fraction_of_step": 0.01, "wall_s": 10.0, "restarts": 0.0,
                "versus_lines": [], "epochs": [{"isgd_flagged": flagged, "isgd_extra_steps": 2 * flagged}] * 2}

    tracker = SimpleNamespace(run_url=lambda run_id: f"http://mlflow/{run_id}")
    runs = [ran("none", 78824, 1), ran("fft", 81259, 0)]
    table = _summary(runs, "p", tracker, "http://prefect/x", "x", isgd=True)["table"]
    assert table["columns"][4] == "bytes vs none" and table["columns"][-1] == "isgd flagged / extra steps"
    assert [row[4] for row in table["rows"]] == ["same", "1.03x more"]
    assert [row[-1] for row in table["rows"]] == ["2 / 4", "0 / 0"]
    assert "isgd flagged / extra steps" not in _summary(runs, "p", tracker, "u", "x")["table"]["columns"]


def test_a_result_served_from_the_task_cache_names_the_run_that_trained_it():
    """A re-run after an interruption printed the finished compressor's "no regression ... all 3
    metrics equal" as if it had trained again (a trial). The restarts and resume of the run that
    trained are its own, said there, not here."""
    earlier = {"id": "0f3c", "name": "brave-otter"}
    lines = _notes(_result(cached_from=earlier, skipped_steps=[3], failures=["attempt 0: OSError"],
                           resumed_from=[None, 0], epochs=_epochs(2)))
    assert lines == ["topk: trained by an earlier flow run of this configuration (brave-otter, 0f3c) and served from "
                     "the task cache: nothing was trained now, and its MLflow run repeats that run's metrics; set "
                     "another seed or checkpoint_prefix to train again",
                     "topk: skipped 1 step(s) with NaN/inf loss or gradients (global steps [3])"]
    assert _notes(_result(cached_from=None, resumed_from=[1], epochs=_epochs(3)))[0].startswith("topk: resumed from")
