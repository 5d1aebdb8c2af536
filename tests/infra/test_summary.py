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
    from paperline.flows.tensor_factorization import rmse_table

    rows = [{"dataset": "user-[x]", "split": "random", "method": "p2t2f", "test_rmse": 0.1, "validation_rmse": 0.2,
             "fit_seconds": None, "epochs": 3}]
    text = summary_text("tensor-factorization", {"rows": rows, "table": rmse_table(rows)})
    assert "held-out RMSE (the file's own units)" in text and "user-[x]" in text and "0.1000" in text, text
    rows[0].update(dataset="nyc-taxi", fit_seconds=1.234)
    assert rmse_table(rows)["title"] == "tensor-factorization: held-out RMSE (standardized units)"
    assert rmse_table(rows)["rows"] == [["nyc-taxi", "random", "p2t2f", "0.1000", "0.2000", "1.23", "3"]]
    # a package's summary with a top-level `rows` of its own is data, not tensor-factorization's table (a
    # KeyError warning said its table could not be shown)
    assert summary_text("mine", {"rows": [{"a": 1}], "lines": ["done"]}) == "done"
    assert summary_text("gemm", {"lines": []}) == ""


def test_a_logged_table_is_as_wide_as_its_rows_up_to_a_limit():
    """Logged at 120 columns, a nas campaign's table cut its runs' names (in the Prefect UI and in
    `trigger --watch`: a trial): a wider table gets the columns it needs, up to 240."""
    from paperline.infra.summary import LOG_WIDTH, WIDEST_LOG_TABLE, summary_text

    def table(cell: str) -> dict:
        return {"table": {"title": "t", "columns": ["campaign", "value"], "rows": [[cell, "0.5"]]},
                "lines": ["x" * 300]}

    narrow = summary_text("nas", table("short"))
    assert max(len(line) for line in narrow.splitlines()[:-1]) <= LOG_WIDTH
    name = "lamoo-nasbench201-cifar10-" + "q" * 120  # 146 characters: cut at 120
    wide = summary_text("nas", table(name)).splitlines()
    assert any(name in line for line in wide), wide
    assert "x" * 300 in wide  # a line is never folded (soft wrap), whatever the width
    huge = summary_text("nas", table("y" * 400)).splitlines()
    assert max(len(line) for line in huge if "y" in line) <= WIDEST_LOG_TABLE
    assert not any(name in line for line in summary_text("nas", table(name), width=80).splitlines())  # a given width
