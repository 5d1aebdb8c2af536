"""The MLflow plots of tasks/reporting.py on edge cases."""

import warnings

import numpy as np


def test_a_pareto_plot_of_a_campaign_whose_every_evaluation_failed_draws_without_warning(tmp_path):
    """An all-failed NAS campaign printed matplotlib's "No artists with labels found to put in
    legend" on the terminal (a trial); the panel now says there is nothing to draw."""
    from paperline.tasks.reporting import pareto_plot

    empty = np.zeros((0, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = pareto_plot(empty, empty, ["val_accuracy_pct", "params_count"], "all failed", tmp_path / "p.png")
        pareto_plot(np.array([[90.0, 1e5], [80.0, 5e4]]), np.array([[90.0, 1e5]]), ["a", "b"], "two", tmp_path / "q.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
