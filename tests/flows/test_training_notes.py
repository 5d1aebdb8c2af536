"""The compressed-training summary's lines about how each compressor's training went."""

from paperline.flows.compressed_training import _notes


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
