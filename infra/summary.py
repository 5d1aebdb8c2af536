"""A flow run's summary as the user reads it: its table, its lines and where to look.

`paperline run` prints it on the terminal; a deployment's run (started by `paperline serve` or a
Prefect worker) logs it to the flow run, so that a run triggered from the Prefect UI says what
`paperline run` would have said: a resumed or cached result, a regression, rejected inputs (a
trial's resumed deployment run said none of it).
"""

from __future__ import annotations

import io
import math
from typing import Any


def fmt(x: Any) -> str:
    """Four decimals; a tiny nonzero value (a verification residual of 1e-17) in scientific
    notation, not 0.0000; anything but a finite float as ``str``."""
    if not isinstance(x, float) or not math.isfinite(x):
        return str(x)
    return f"{x:.3e}" if x != 0 and abs(x) < 1e-3 else f"{x:.4f}"


def summary_table(name: str, summary: dict[str, Any]) -> Any:
    """The summary's table as a ``rich.table.Table``: its ``table`` spec (title, columns, rows),
    cells shown as text; None when it has none (a top-level ``rows``, as tensor-factorization's
    summary holds its fits' figures, is data, not a table)."""
    from rich.table import Column, Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    if "table" in summary:
        # as text, not rich markup: a cell with "[/x]" (a user's file name) failed to render, and
        # "[red]ok" printed as "ok" (a review)
        spec = summary["table"]
        table = Table(*[Column(header=Text(str(c))) for c in spec["columns"]], title=Text(str(spec["title"])))
        for row in spec["rows"]:
            table.add_row(*[Text(str(v)) for v in row])
        return table
    return None


LOG_WIDTH = 120  # columns of a logged summary; its table up to WIDEST_LOG_TABLE where it needs them
WIDEST_LOG_TABLE = 240


def summary_text(name: str, summary: dict[str, Any], width: int | None = None) -> str:
    """The summary as plain text (no colour): the table, the lines, the MLflow run's URL, at
    ``width`` columns; by default :data:`LOG_WIDTH`, or as wide as the table's widest row up to
    :data:`WIDEST_LOG_TABLE` (at 120 a nas campaign's table cut its runs' names, in the Prefect UI
    and in `trigger --watch`: a trial)."""
    from rich.console import Console  # noqa: PLC0415

    table = summary_table(name, summary)
    if width is None:
        width = LOG_WIDTH
        if table is not None:
            wide = Console(width=WIDEST_LOG_TABLE, color_system=None)
            width = max(width, min(wide.measure(table).maximum, WIDEST_LOG_TABLE))
    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None, highlight=False, emoji=False)
    if table is not None:
        console.print(table)
    for line in summary.get("lines", []):
        console.print(line, soft_wrap=True, markup=False)
    if summary.get("mlflow_run_url"):
        console.print(f"MLflow run: {summary['mlflow_run_url']}", soft_wrap=True, markup=False)
    return out.getvalue().rstrip("\n")
