"""The summary `paperline run` prints and a deployment's run logs (infra/summary.py)."""


def test_a_summary_renders_its_cells_as_text_not_markup():
    """A cell holding "[/x]" (a user's file name) failed to render, and "[red]ok" printed as "ok"
    (a review); a tensor row without fit seconds raised a TypeError."""
    from paperline.infra.summary import summary_text

    text = summary_text("x", {"table": {"title": "t [/x]", "columns": ["name", "b[red]"],
                                        "rows": [["[/x]", 1.5], ["[red]ok", None]]},
                              "lines": ["resumed [b]from[/b] epoch 2"], "mlflow_run_url": "http://127.0.0.1:5000/#/x"})
    for shown in ("t [/x]", "b[red]", "[/x]", "[red]ok", "None", "resumed [b]from[/b] epoch 2",
                  "MLflow run: http://127.0.0.1:5000/#/x"):
        assert shown in text, (shown, text)
    rows = [{"dataset": "user-[x]", "split": "random", "method": "p2t2f", "test_rmse": 0.1, "validation_rmse": 0.2,
             "fit_seconds": None, "epochs": 3}]
    text = summary_text("tensor-factorization", {"rows": rows})
    assert "held-out RMSE (the file's own units)" in text and "user-[x]" in text and "0.1000" in text, text
    assert summary_text("gemm", {"lines": []}) == ""
