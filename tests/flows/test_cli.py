"""CLI behaviour on bad input: one clear line naming the argument and value, non-zero exit,
no traceback; nothing here needs the stack (input is checked before anything starts)."""

import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from paperline.flows.cli import app
from paperline.infra.settings import get_settings

runner = CliRunner()


def run_cli(*args, env=None):
    get_settings.cache_clear()
    try:
        return runner.invoke(app, list(args), env=env)
    finally:
        get_settings.cache_clear()


def assert_one_line_error(result, *fragments):
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.output.split())  # rich may wrap long lines
    assert "error:" in text
    for f in fragments:
        assert f in text, text


def assert_refused_before_anything_starts(pipeline, cases, tmp_path, *, preset=None, env=None):
    """Each ``(sets, fragments)`` case of ``paperline run PIPELINE --set ...`` is one error line with
    the fragments, and no stack was started. Should a case slip past validation, the stack it starts
    lives in tmp_path, not ~/.paperline, and is stopped again (a failed run left three running)."""
    env = {"PAPERLINE_STATE_DIR": str(tmp_path / "state"), **(env or {})}
    try:
        for sets, fragments in cases:
            presets = [preset] if isinstance(preset, str) else preset or []
            args = ["run", pipeline, *[a for p in presets for a in ("--preset", p)]]
            for item in sets:
                args += ["--set", item]
            assert_one_line_error(run_cli(*args, env=env), *fragments)
        assert not (tmp_path / "state").exists()
    finally:
        if (tmp_path / "state").exists():
            run_cli("down", env=env)


@pytest.fixture
def parquet(tmp_path):
    def write(name, table=None, raw=None):
        path = tmp_path / name
        if raw is not None:
            path.write_bytes(raw)
        else:
            pq.write_table(table, path)
        return str(path)

    return write


@pytest.mark.parametrize("sets, fragments", [
    (["rank=0"], ["rank=0", "greater than 0"]),
    (["rank=-3"], ["rank=-3"]),
    (["datasets=nope"], ["datasets='nope'", "unknown dataset"]),
    (["datasets=flights", "n_parts=106"], ["n_parts=106", "P larger than the number of slices", "'flights' (105)"]),
    (["bogus=1"], ["--set='bogus'", "unknown parameter; known: datasets, "]),  # (no guess for a word unlike any)
    (["rnak=3"], ["--set='rnak'", "unknown parameter; did you mean rank? known: "]),  # (a trial's typo)
    (["datasets=prodcu"], ["datasets='prodcu'", "unknown dataset; did you mean produc? known: "]),
    (["rank"], ["--set='rank'", "expected key=value"]),
    (["seed=-1"], ["seed=-1", "greater than or equal to 0"]),
    (["rank=true"], ["rank=true:", "expected a number, not a boolean"]),  # pydantic would read it as 1
    # an empty item was dropped (ranks=1,,2 ran [1, 2]: a trial)
    (["splits=random,,temporal"], ["splits='random,,temporal'", "item 1 is empty: separate the values with single "
                                                                "commas, with none at either end"]),
    (["datasets=produc,"], ["item 1 is empty"]),
    (["rank=100000"], ["rank=100000", "less than or equal to 512"]),
    (["splits=random,weird"], ["splits[1]='weird'"]),
    (["rank=3", "rank=4"], ["--set='rank'", "given twice ('3', then '4'); give it once"]),  # 4 silently won
    (["datasets=2024"], ["datasets='2024'", "unknown dataset"]),  # a name, not the number 2024
    (["lr=nan"], ["lr='nan'", "Input should be a finite number"]),  # was "greater than 0"
    (["rank=null"], ["rank=null", "valid integer"]),  # as typed: it said rank=None
    (["rank=[1,2]"], ["rank=[1,2]", "valid integer"]),
    (["rank=1e9"], ["rank=1e9:", "less than or equal to 512"]),
    # accepted, then ran the workers out of memory for minutes (a trial): refused with what fits
    (["rank=512"], ["rank=512: fitting 'kinetic' (shape (64, 12, 10, 60)) at rank 512 with mini-batches of 4096 "
                    "entries would take about 12.30 GiB per worker (limit 2.00 GiB): set rank at most 205 or "
                    "batch_size at most 599"]),  # a number, unquoted as typed (was rank='1e9')
    (["rank=2.5"], ["rank=2.5", "fractional part"]),
    # fitted once, recorded twice (another comparison key than the list without the repeat: a trial)
    (["datasets=produc,produc"], ["datasets=['produc', 'produc']", "produc listed twice: each is fitted once"]),
    (["splits=random,temporal,random"], ["splits=['random', 'temporal', 'random']", "random listed twice"]),
])
def test_bad_parameters(sets, fragments):
    args = ["run", "tensor-factorization"]
    for s in sets:
        args += ["--set", s]
    assert_one_line_error(run_cli(*args), *fragments)


def test_names_that_read_as_numbers_are_names():
    """`--set` reads JSON: dataset=2024 was refused as "Input should be a valid string"."""
    from paperline.flows.pipelines import build_parameters, get_pipeline

    assert build_parameters(get_pipeline("video-curation"), "demo", ["dataset=2024"]).dataset == "2024"
    assert build_parameters(get_pipeline("nas"), "demo", ["campaign=123"]).campaign == "123"
    assert build_parameters(get_pipeline("nas"), "demo", ["campaign=true"]).campaign == "true"
    params = build_parameters(get_pipeline("tensor-factorization"), "demo", ["datasets=produc,2024", "rank=3"])
    assert params.datasets == ["produc", "2024"] and params.rank == 3  # numbers stay numbers where they are ones


def test_every_pipelines_number_fields_refuse_a_boolean_from_python_too():
    """`--set m=true` was refused while ``GemmParameters(m=True)`` (Python, a deployment run's
    parameters, the Prefect UI) multiplied a 1-row matrix: pydantic's lax mode reads True as 1."""
    from pydantic import ValidationError

    from paperline.flows.pipelines import _numeric_not_bool, get_pipeline, pipeline_names

    checked = []
    for name in pipeline_names():
        model = get_pipeline(name).parameters
        for field, info in model.model_fields.items():
            if not _numeric_not_bool(info.annotation):
                continue
            with pytest.raises(ValidationError) as exc:
                model(**{field: True})
            (error,) = exc.value.errors()
            assert error["loc"] == (field,) and "expected a number, not a boolean" in error["msg"], (name, field)
            checked.append(f"{name}.{field}")
    assert {"gemm.m", "gemm.alpha", "gemm.memory_budget", "nas.q", "tensor-factorization.rank"} <= set(checked)
    # in a list of numbers too (a list of names keeps what it is given, as --set's lists do)
    with pytest.raises(ValidationError, match=r"expected numbers, not a boolean \(item 1\)"):
        get_pipeline("nas").parameters(ref_point=[80, True])
    assert get_pipeline("nas").parameters(ref_point=[80, 2.5]).ref_point == [80.0, 2.5]
    # ... a tuple, a set, a dict's values (a package's model may have them: a trial's were taken as 1)
    from typing import Annotated

    from pydantic import Field

    from paperline.flows.pipelines import PipelineParameters

    class Mine(PipelineParameters):
        ranks: list[Annotated[int, Field(ge=1)]] = [1]
        pair: tuple[int, float] | None = None
        weights: dict[str, float] = {}
        names: list[str] = []
        flag: bool = False

    for given, where in (({"ranks": (1, True)}, "item 1"), ({"pair": (True, 2.0)}, "item 0"),
                         ({"weights": {"a": 1.0, "b": False}}, "the value of 'b'"), ({"ranks": {2, True}}, "item")):
        with pytest.raises(ValidationError, match=rf"expected numbers, not a boolean \({where}"):
            Mine(**given)
    assert Mine(names=["true"], flag=True, pair=(1, 2.5), weights={"a": 2}).weights == {"a": 2.0}
    # and a package's model gets the built-in ones' strictness: an unknown (misspelt) field, NaN
    for given in ({"rank": [2]}, {"weights": {"a": float("nan")}}):
        with pytest.raises(ValidationError):
            Mine(**given)
    # booleans stay booleans, numbers numbers
    gemm = get_pipeline("gemm").parameters
    assert gemm(check_finite=False, m=3, alpha=0.5).model_dump(include={"check_finite", "m", "alpha"}) == {
        "check_finite": False, "m": 3, "alpha": 0.5}


def test_unknown_pipeline_and_preset():
    assert_one_line_error(run_cli("run", "nope"), "pipeline='nope'", "known: compressed-training, gemm, nas, tensor-factorization, video-curation")
    assert_one_line_error(run_cli("run", "tensor-factorization", "--preset", "huge"), "--preset='huge'")


def test_a_preset_given_twice_is_refused(tmp_path):
    """The last --preset silently won (a fresh-user trial ran the demo for `--preset default
    --preset demo`); a repeated --set was already refused."""
    assert_refused_before_anything_starts("gemm", [([], ["--preset='demo': given twice ('default', 'demo'); "
                                                         "give it once"])], tmp_path, preset=["default", "demo"])
    assert_one_line_error(run_cli("params", "gemm", "--preset", "full", "--preset", "demo"),
                          "--preset='demo': given twice ('full', 'demo'); give it once")


def test_bad_user_data(parquet):
    cases = [
        (parquet("junk.parquet", raw=b"\x00not parquet at all"), ["junk.parquet", "not a readable Parquet file"]),
        (parquet("cut.parquet", raw=b"PAR1PAR1"), ["cut.parquet': a damaged or truncated Parquet file ("]),
        (parquet("half.parquet", raw=b"PAR1" + b"\x15\x04" * 40), ["half.parquet': a damaged or truncated Parquet"]),
        # whole (its two magics and a footer length) but unreadable: pyarrow's own words
        (parquet("odd.parquet", raw=b"PAR1" + b"\x00" * 8 + b"\x04\x00\x00\x00PAR1"), ["odd.parquet': not a readable "
                                                                                      "Parquet file ("]),
        (parquet("mine.csv", raw=b"i,j,t,value\n0,0,0,1.5\n"), ["mine.csv': a text file (CSV?); this takes a Parquet "
                                                                 "table", "pandas.read_csv(path).to_parquet("]),
        (parquet("dense.npy", raw=b"\x93NUMPY\x01\x00" + b" " * 100), ["dense.npy", "a NumPy .npy file; this takes a "
                                                                          "Parquet table of the observed entries"]),
        (parquet("nan.parquet", pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": [1.0, float("nan")]})),
         ["data['value']=<1 NaN and 0 inf of 2>: observed values must be finite"]),
        (parquet("inf.parquet", pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": [1.0, float("inf")]})),
         ["data['value']=<0 NaN and 1 inf of 2>"]),
        (parquet("empty.parquet", pa.table({"i": pa.array([], pa.int64()), "j": pa.array([], pa.int64()),
                                            "t": pa.array([], pa.int64()), "value": pa.array([], pa.float64())})),
         ["empty tensor"]),
        ("/no/such/file.parquet", ["data='/no/such/file.parquet'", "no such file"]),
        ("", ["data=''", "must not be empty"]),
        # a null index read as a huge negative number ("must be >= 0"); a repeated coordinate was
        # accepted silently; a stray column was called an index column without saying why
        (parquet("null.parquet", pa.table({"i": pa.array([0, None]), "j": [0, 1], "t": [0, 1], "value": [1.0, 2.0]})),
         ["data['i']=<1 null>", "no missing entries"]),
        (parquet("dup.parquet", pa.table({"i": [0, 1, 1], "j": [0, 1, 1], "t": [0, 1, 1], "value": [1.0, 2.0, 5.0]})),
         ["1 coordinate(s) appear more than once (first: i=1, j=1, t=1, values 2 and 5)"]),
        (parquet("note.parquet", pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": [1.0, 2.0],
                                           "note": ["a", "b"]})),
         ["data['note']='string'", "'note' holds labels", "or drop the column if it is not a mode"]),
        (str(Path(parquet("x.parquet", raw=b"")).parent), ["is a directory"]),
        (parquet("tiny.parquet", pa.table({"i": [0, 1, 2], "j": [0, 1, 0], "t": [0, 1, 2], "value": [1.0, 2.0, 3.0]})),
         ["tiny.parquet", "cannot make the random split", "too few observed entries to split into training, "
          "validation and test sets (0.1 and 0.1 of them held out: 6 at least)"]),
        # a tensor too short in time for the temporal split: the error says how to go on (a trial)
        (parquet("short.parquet", pa.table({"i": list(range(40)), "j": [k % 5 for k in range(40)], "t": [0] * 40,
                                            "value": [1.0] * 40})),
         ["short.parquet", "cannot make the temporal split: leaves fewer than 2 training time slices of 1 (its "
          "validation and test sets are the last 1 time step(s) each, at least 1 of the 1 steps of 't'; it needs at "
          "least 4 steps)", "--set splits=random fits it without the temporal split"]),
        (parquet("wide.parquet", pa.table({"i": [2_000_000] + list(range(59)), "j": [3000] + [7] * 59,
                                           "t": list(range(60)), "value": [1.0] * 60})),
         ["baseline=True", "needs 'data' dense", "--set baseline=false"]),
        (parquet("huge.parquet", pa.table({"i": [19_000_000] + list(range(59)), "j": [3000] + [7] * 59,
                                           "t": list(range(60)), "value": [1.0] * 60})),
         ["rank=6", "the factors of 'data'", "GiB (limit 4.00 GiB); at most rank 3 fits"]),
        # a column named twice was "not a readable Parquet file" with pyarrow's internals (a trial)
        (parquet("dupcols.parquet", pa.Table.from_arrays([pa.array([0, 1]), pa.array([0, 1]), pa.array([0, 1]),
                                                          pa.array([1.0, 2.0])], names=["i", "i", "t", "value"])),
         ["dupcols.parquet", "column(s) 'i' appear more than once (columns: ['i', 'i', 't', 'value'])"]),
        # years as 't', ids as indices: the errors say what to renumber (a trial)
        (parquet("years.parquet", pa.table({"i": [k % 5 for k in range(600)], "j": [k // 5 % 4 for k in range(600)],
                                            "t": [1995 + k // 20 for k in range(600)], "value": [1.0] * 600})),
         ["cannot make the temporal split: the train slices hold no observed entries (its validation and test sets "
          "are the last 202 time step(s) each, a tenth of the 2025 steps of 't')", "'t' starts at 1995, so 1995 empty time steps come "
          "first", "subtract 1995; or --set splits=random fits it without the temporal split (counting those empty "
          "indices)"]),
        (parquet("ids.parquet", pa.table({"i": [k % 10 * 10**12 for k in range(300)], "j": [k // 10 % 5 for k in range(300)],
                                          "t": [k // 50 for k in range(300)], "value": [1.0] * 300})),
         ["even at rank 1", "'i' has 10 distinct values up to 9000000000000", "renumber them 0..9"]),
        # a mode too long for any rank is the data's fault (it was blamed on rank)
        (parquet("giant.parquet", pa.table({"i": [200_000_000] + list(range(59)), "j": [30] + [7] * 59,
                                            "t": list(range(60)), "value": [1.0] * 60})),
         ["data=", "giant.parquet", "shape (200000001, 31, 60): its factors would take 8.94 GiB even at rank 1"]),
    ]
    # found by a later trial: a FIFO's open() blocked the run for good, past Ctrl-C and SIGTERM; a
    # dangling link was named by its target; a name that is not UTF-8 was pyarrow's UnicodeEncodeError
    base = Path(parquet("x.parquet", raw=b"")).parent
    os.mkfifo(base / "fifo.parquet")
    (base / "dangling.parquet").symlink_to("/nonexistent-target.parquet")
    cases += [(str(base / "fifo.parquet"), ["data=", "fifo.parquet", "not a regular file (a FIFO, socket or device)"]),
              (str(base / "dangling.parquet"), ["data=", "a symbolic link to a missing target (",
                                                "dangling.parquet -> /nonexistent-target.parquet)"]),
              (os.fsdecode(os.fsencode(str(base)) + b"/lat\xe9in.parquet"), ["data=", "lat\\xe9in.parquet is not valid "
                                                                                     "UTF-8: rename the file"])]
    for path, fragments in cases:
        assert_one_line_error(run_cli("run", "tensor-factorization", "--set", f"data={path}"), *fragments)
    # the random split is offered only where it can be made (it was, to a file too small for it)
    tiny = run_cli("run", "tensor-factorization", "--set", f"data={next(p for p, _ in cases if p.endswith('tiny.parquet'))}", "--set", "splits=temporal")
    assert_one_line_error(tiny, "tiny.parquet", "cannot make the temporal split")
    assert "splits=random" not in tiny.output


def test_data_and_datasets_together_are_refused(parquet):
    path = parquet("ok.parquet", pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": [1.0, 2.0]}))
    assert_one_line_error(run_cli("run", "tensor-factorization", "--set", f"data={path}", "--set", "datasets=produc"),
                          "datasets=['produc']", "either `datasets` or `data`")


def test_debug_shows_the_traceback():
    result = run_cli("--debug", "run", "tensor-factorization", "--set", "rank=0")
    assert result.exit_code != 0
    assert result.exception is not None  # re-raised for the traceback


def test_a_down_service_is_named(tmp_path, free_port):
    dead = free_port()
    env = {
        "PAPERLINE_STATE_DIR": str(tmp_path),
        "PAPERLINE_S3_ENDPOINT_URL": f"http://127.0.0.1:{dead}",
        "PAPERLINE_S3_ACCESS_KEY_ID": "x",
        "PAPERLINE_S3_SECRET_ACCESS_KEY": "y",
        "PAPERLINE_PREFECT_API_URL": f"http://127.0.0.1:{dead}/api",
        "PAPERLINE_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{dead}",
        "PAPERLINE_STARTUP_TIMEOUT_S": "3",
    }
    result = run_cli("run", "tensor-factorization", "--set", "datasets=produc", env=env)
    assert_one_line_error(result, "is not available", f"127.0.0.1:{dead}")
    assert any(name in result.output for name in ("s3", "prefect", "mlflow"))


def test_the_down_that_found_nothing_to_stop_says_nothing_of_running_runs(tmp_path, monkeypatch):
    """Two `paperline down` at once under a running flow run: both warned "stopping the stack under
    1 Running flow run(s)", and the one that lost the race then said "nothing to stop" (a trial).
    The warning is said by the `down` that stopped the stack; here the loser's view: the stack was
    running as it looked, the other `down` stopped it first."""
    import types

    from paperline.infra import stack

    monkeypatch.setattr(stack, "running_local_stack", lambda settings: types.SimpleNamespace(
        prefect_api_url="http://127.0.0.1:1/api", prefect_login="paperline:x"))
    monkeypatch.setattr(stack, "running_flow_runs", lambda info: ["probe-run (Running)"])
    monkeypatch.setattr("paperline.infra.flow_runs.local_worker_pids", lambda url, login: [])
    result = run_cli("down", env={"PAPERLINE_STATE_DIR": str(tmp_path)})
    out = " ".join(result.output.split())
    assert result.exit_code == 0 and out == f"nothing to stop in {tmp_path}", out


def test_a_warning_about_the_data_is_printed_before_the_run_starts(parquet, tmp_path, free_port):
    """Indices spread over a large range (20 values of 'i' up to 95000): the renumbering hint,
    and that the dense baseline computes mostly empty indices, come before anything starts (here
    the stack, which is down); they came under the results, after a baseline had run for
    minutes (a fresh-user trial)."""
    cells = [(i, j, t) for i in range(20) for j in range(15) for t in range(30) if (i + j + t) % 3 == 0]
    path = parquet("spread.parquet", pa.table({"i": [5000 * i for i, _, _ in cells], "j": [j for _, j, _ in cells],
                                               "t": [t for _, _, t in cells], "value": [1.0] * len(cells)}))
    dead = free_port()
    env = {"PAPERLINE_STATE_DIR": str(tmp_path / "state"), "PAPERLINE_S3_ENDPOINT_URL": f"http://127.0.0.1:{dead}",
           "PAPERLINE_S3_ACCESS_KEY_ID": "x", "PAPERLINE_S3_SECRET_ACCESS_KEY": "y",
           "PAPERLINE_PREFECT_API_URL": f"http://127.0.0.1:{dead}/api",
           "PAPERLINE_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{dead}", "PAPERLINE_STARTUP_TIMEOUT_S": "3"}
    hint = ("warning: user-spread: 'i' has 20 distinct values up to 95000: indices are positions in the shape; "
            "renumber them 0..19 (e.g. pandas.factorize): the fits count those empty indices")
    baseline = ("; the TensorLy baseline computes the dense shape (95001, 15, 30), 4.28e+07 cells, in each of its 100 "
                "iterations: 4.75e+03 times the 9e+03 cells its indices occupy (20 x 15 x 30), so it may take "
                "minutes; --set baseline=false fits P²T²F alone, or renumber as above")
    for sets, said in (([], hint + baseline), (["baseline=false"], hint),
                       (["baseline_iterations=20"], hint)):  # 20 iterations of 4.28e7 cells: not minutes
        result = run_cli("run", "tensor-factorization", "--set", f"data={path}",
                         *[a for s in sets for a in ("--set", s)], env=env)
        assert_one_line_error(result, "is not available")
        text = " ".join(result.output.split())
        assert text.startswith(said + " error:"), (sets, text)  # the whole warning, once, then the stack's error


def test_datasets_lists_the_bundled_data():
    result = run_cli("datasets")
    assert result.exit_code == 0
    for name in ("kinetic", "produc", "flights"):
        assert name in result.output
    # and the images compressed-training trains on (only tensors and nas problems were listed: a trial)
    assert "mnist-5k" in result.output and "fashion-mnist" in result.output


def test_the_training_datasets_say_whether_fashion_mnist_is_installed(tmp_path):
    from paperline.kernels.train.data import dataset_rows

    rows = {r["name"]: r for r in dataset_rows(tmp_path)}
    assert rows["mnist-5k"]["installed"] == "yes"
    assert rows["fashion-mnist"]["installed"] == (f"no ({'train-images-idx3-ubyte.gz'} is missing): apt-get install "
                                                  "dataset-fashion-mnist")
    for name in ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                 "t10k-labels-idx1-ubyte.gz"):
        (tmp_path / name).write_bytes(b"")
    assert {r["name"]: r for r in dataset_rows(tmp_path)}["fashion-mnist"]["installed"] == "yes"


def test_params_lists_a_pipelines_parameters_and_the_optimizers_options():
    """`paperline params nas` shows what --set takes, with the preset's values, and each
    optimizer's options (a user found `run nas --help` identical to `run --help`)."""
    result = run_cli("params", "nas", "--preset", "demo")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for name in ("optimizer", "problem", "budget", "n_init", "ref_point", "optimizer_options", "live"):
        assert f"│ {name} " in text
    assert '"nasbench201-cifar10"' in text and "│ 40 │" in text  # the demo preset's values
    assert "│ enumerate_max │ 50000 │" in text and "│ pool_size │ 1000 │" in text  # lamoo's and qehvi's options
    assert "polish the greedy batch by L-BFGS-B" in text  # what lamoo's refine does
    gemm = run_cli("params", "gemm", "--preset", "full")
    assert gemm.exit_code == 0 and "tile" in gemm.output and "8192" in gemm.output
    assert_one_line_error(run_cli("params", "nope"), "pipeline='nope'", "unknown pipeline")
    # none named: Typer's usage box said neither which nor where to look (`params` alone lists
    # them: tests/flows/test_plugins.py)
    assert_one_line_error(run_cli("run"), "name a pipeline: paperline run PIPELINE, one of compressed-training, gemm, nas")
    assert_one_line_error(run_cli("params", "nas", "--preset", "x"), "--preset='x'", "unknown preset")


def test_run_help_of_a_pipeline_lists_its_parameters():
    """`paperline run nas --help` showed the generic help, the same for every pipeline: it now
    adds the pipeline's parameters (the preset given, else demo) and option tables, as `params`."""
    text = " ".join(run_cli("run", "nas", "--help").output.split())
    assert "Usage: " in text and "│ optimizer " in text and "│ enumerate_max │ 50000 │" in text
    full = run_cli("run", "--set", "m=5", "gemm", "--preset", "full", "--help")  # options before the name
    assert full.exit_code == 0 and "--preset full" in full.output and "8192" in full.output
    assert "│ tile " not in run_cli("run", "--help").output  # no pipeline named: the help alone
    for args, said in ((("nope",), "pipeline='nope': unknown pipeline"), (("nas", "--preset", "x"), "--preset='x'"),
                       (("gemm", "--preset", "demo", "--preset", "full"), "--preset='full': given twice"),
                       (("gemm", "nas"), "one pipeline at a time: 'gemm' and 'nas' given")):
        result = run_cli("run", *args, "--help")
        assert result.exit_code == 2 and said in result.output and "Traceback" not in result.output, result.output


def test_version_names_paperline_and_its_main_libraries():
    """There was no `--version` (a trial); a bug report needs the libraries' too."""
    from importlib.metadata import version

    result = run_cli("--version")
    lines = result.output.splitlines()
    assert result.exit_code == 0 and lines[0] == f"paperline {version('paperline')}", result.output
    assert f"prefect {version('prefect')}" in lines[1] and f"mlflow {version('mlflow')}" in lines[1], lines


def test_help_names_what_each_argument_and_option_takes():
    """Typer's default help showed `{pipeline}` and `<list[str]>` for --set."""
    text = " ".join(run_cli("run", "--help").output.split())
    assert "run [OPTIONS] [PIPELINE]" in text and "{pipeline}" not in text
    assert "--set KEY=VALUE" in text and "--summary-json FILE" in text and "list[str]" not in text
    text = " ".join(run_cli("compare", "--help").output.split())
    assert "--metric -m METRIC" in text and "--top N" in text and "--out DIR" in text
    # typer 0.29 wrote `<bool>` beside flags (as if `--log true` were wanted), `<str>` beside named
    # arguments, and `{EXPERIMENT}` (braces read as choices) in the usage line
    assert "compare [OPTIONS] EXPERIMENT " in text and "{" not in text
    import typer.main

    names = sorted(typer.main.get_command(app).commands)
    assert {"compare", "run", "upload", "worker"} <= set(names)
    from paperline.flows.pipelines import builtin_pipeline_names

    text = " ".join(run_cli("run", "--help", env={"COLUMNS": "250"}).output.split())  # the names, which `run` alone listed
    builtin = builtin_pipeline_names()
    assert ", ".join(builtin[:-1]) + " or " + builtin[-1] + ", or one an installed package adds" in text
    for command in ((), *((name,) for name in names)):
        help_text = run_cli(*command, "--help").output
        assert "Usage: " in help_text, (command, help_text)
        assert "<bool>" not in help_text and "<str>" not in help_text, (command, help_text)
        assert "<int>" not in help_text and "<path>" not in help_text.lower(), (command, help_text)


@pytest.fixture
def npy(tmp_path):
    import numpy as np

    def write(name, array=None, raw=None, cut=0):
        path = tmp_path / name
        if raw is not None:
            path.write_bytes(raw)
        else:
            np.save(path, array)
            if cut:
                path.write_bytes(path.read_bytes()[:-cut])
        return str(path)

    return write


def test_bad_gemm_input_is_refused_before_anything_starts(npy, tmp_path):
    import numpy as np

    a = npy("a.npy", np.ones((40, 30)))
    nan = np.ones((40, 30))
    nan[3, 4] = np.nan
    zero_diag = np.eye(40)
    zero_diag[7, 7] = 0.0

    def hard_link(target, name):
        os.link(target, tmp_path / name)
        return tmp_path / name

    cases = [
        (["tile=0"], ["tile=0", "greater than 0"]),
        (["routine=foo"], ["routine='foo'"]),
        (["memory_budget=lots"], ["memory_budget='lots'", "expected bytes"]),
        (["memory_budget=1KiB", "m=64", "n=64", "k=64", "tile=64"], ["memory_budget='1KiB'", "1024 bytes are below the working set"]),
        ([f"a={tmp_path / 'missing.npy'}"], ["a=", "missing.npy", "no such file"]),
        (["a=http://example.com/A.npy"], ["a='http://example.com/A.npy'", "a local .npy path or an s3:// URI"]),
        ([f"a={npy('empty.npy', np.ones((0, 30)))}"], ["a=", "empty.npy", "an empty matrix (shape (0, 30))"]),
        ([f"a={npy('cut.npy', np.ones((40, 30)), cut=50)}"], ["a=", "cut.npy", "truncated"]),
        ([f"a={npy('text.npy', raw=b'hello')}"], ["a=", "text.npy", "not a .npy file"]),
        ([f"a={npy('cube.npy', np.ones((2, 2, 2)))}"], ["expected a 2-D matrix"]),
        ([f"a={npy('int.npy', np.ones((4, 4), dtype=np.int64))}"], ["expected float32 or float64"]),
        # an operand's error names its file (it named the shape, the dtype, the entry alone: a trial)
        ([f"a={a}", f"b={npy('b.npy', np.ones((31, 20)))}"],
         [f"b='{tmp_path / 'b.npy'}': shape (31, 20) does not conform: op(b) has 31 rows"]),
        ([f"a={a}", f"b={npy('b32.npy', np.ones((30, 20), dtype=np.float32))}"],
         [f"b='{tmp_path / 'b32.npy'}': dtype float32 differs from a (float64); mixed dtypes"]),
        (["routine=trsm", f"a={npy('z.npy', zero_diag)}", "m=40", "n=10"],
         [f"a='{tmp_path / 'z.npy'}': TRSM needs a nonzero diagonal, found a[7,7] = 0"]),
        # what the routine does not read is refused, not ignored (and recorded in MLflow as if used)
        (["routine=trsm", "c=random"], ["c='random'", "TRSM does not use it"]),
        (["routine=syrk", f"b={a}"], ["b=", "SYRK does not use it"]),
        (["routine=trmm", "trans_b=T"], ["trans_b='T'", "TRMM does not use it"]),
        (["beta=0.5"], ["beta=0.5", "scales c, which is not given"]),
        (["c=random"], ["c='random'", "GEMM reads c only as beta * c, and beta is 0"]),  # never read (a trial)
        # sizes the operand files or the routine override are refused, not ignored (a trial's m=1000
        # ran 512 x 512); the preset's own m (full: 8192) does not count as given
        ([f"a={a}", f"b={npy('b20.npy', np.ones((30, 20)))}", "m=1000"],
         ["m=1000", "the operands (a=", "give m=40; leave it out"]),
        ([f"a={a}", f"b={npy('b20x.npy', np.ones((30, 20)))}", "dtype=float32"],
         ["dtype='float32'", "give dtype=float64; leave it out"]),
        (["routine=syrk", "m=100", "n=64", "k=32", "tile=32"], ["m=100", "SYRK does not use it (its result is n x n)"]),
        (["routine=trsm", "m=64", "n=48", "k=100", "tile=32"], ["k=100", "TRSM does not use it (its A is square"]),
        ([f"output={tmp_path / 'nowhere' / 'c.npy'}"], ["output=", "directory does not exist"]),
        ([f"output={tmp_path}"], ["output=", "is a directory"]),
        ([f"output={tmp_path / 'c.txt'}"], ["output=", "name the file *.npy"]),
        ([f"a={a}", f"output={a}", "m=40", "k=30"], ["output=", "is operand a"]),
        # a hard link to an operand too (it was refused only inside the run, leaving a failed MLflow run: a trial)
        ([f"a={a}", f"output={hard_link(a, 'a_link.npy')}", "m=40", "k=30"],
         [f"output='{tmp_path / 'a_link.npy'}': is operand a: writing it would destroy the input"]),
        (["output=s3://paperline-data/"], ["output=", "name an object"]),
        (["b=s3://paperline-data/"], ["b=", "name an object"]),  # not "s3 is not available"
        (["output=s3://Bad_Bucket!/x.npy"], ["output=", "not a valid S3 bucket name"]),
        # one slash was taken as a local path ("its directory does not exist": a trial)
        (["output=s3:/paperline-data/x.npy"], ["output='s3:/paperline-data/x.npy': looks like an S3 URI: start it with s3://"]),
        (["b=s3:/paperline-data/b.npy"], ["b='s3:/paperline-data/b.npy': looks like an S3 URI"]),
        (["output="], ["output=''", "must not be empty"]),  # without pydantic's "Value error, "
        (["m=2048", "n=2048", "k=2048", "tile=1"], ["tile=1", "4,194,304 tile tasks", "raise the tile size"]),
        (["m=500000000", "tile=8192", "memory_budget=3GiB"],
         ["m=500000000", "the staged random operands (14.90 TiB), the 500000000x4096 float64 result, staged for S3 "
          "(14.90 TiB) and its copy in the local SeaweedFS (14.90 TiB) need together 44.70 TiB on disk at",
          "free; lower the sizes"]),
        (["m=1000000", "n=1000000", "k=1000", "tile=8192", "memory_budget=3GiB", "stage_random=false"],
         ["output='s3://<data bucket>/gemm/<flow run id>/result.npy'", "the 1000000x1000000 float64 result, "
          "staged for S3 (7.28 TiB) and its copy in the local SeaweedFS (7.28 TiB) need together 14.55 TiB on disk"]),
        (["memory_budget=1PiB"], ["memory_budget='1PiB'", "more than a worker's memory", "over 2 workers"]),
        (["output=/proc/c.npy"], ["output='/proc/c.npy'", "cannot create a file in /proc (the system says: "]),
    ]
    assert_refused_before_anything_starts("gemm", cases, tmp_path, env={"PAPERLINE_N_WORKERS": "2"})
    assert not list((tmp_path).glob("*partial*"))


def test_an_operand_is_named_as_given(npy, tmp_path, monkeypatch):
    """A relative path is named as typed in every refusal: the shape and dtype errors named the
    resolved path while 'no such file' and 'truncated' named it as typed (a trial)."""
    import numpy as np

    npy("a.npy", np.ones((40, 30)))
    npy("b.npy", np.ones((31, 20)))
    monkeypatch.chdir(tmp_path)
    assert_refused_before_anything_starts("gemm", [(["a=a.npy", "b=b.npy"], ["b='b.npy': shape (31, 20) does not conform"])],
                                          tmp_path, env={"PAPERLINE_N_WORKERS": "2"})


def test_a_budget_that_is_not_bytes_is_refused_as_the_model_is_built():
    """From Python, `GemmParameters(memory_budget="lots")` was accepted and failed the flow run
    later (a trial of the library): refused at construction, the value kept as given otherwise."""
    from pydantic import ValidationError

    from paperline.flows.gemm import GemmParameters

    for bad, why in (("lots", "expected bytes as an integer or with a unit"), ("0", "must be positive"), (-5, "must be positive")):
        with pytest.raises(ValidationError, match=why):
            GemmParameters(memory_budget=bad)
    assert GemmParameters(memory_budget="512MiB").memory_budget == "512MiB"


def test_a_presets_values_are_not_given_parameters(npy):
    """`--preset full` sets m = n = k = 8192; with operand files of another shape that is not a
    contradiction the user made (their own --set m would be)."""
    import numpy as np

    from paperline.flows.pipelines import build_parameters, get_pipeline

    a, b = npy("a.npy", np.ones((40, 30))), npy("b.npy", np.ones((30, 20)))
    params = build_parameters(get_pipeline("gemm"), "full", [f"a={a}", f"b={b}", "scaling=false"])
    assert params.m == 8192 and params.model_fields_set == {"a", "b", "scaling"}
    problem = params.validate_inputs()
    assert problem.out_shape == (40, 20) and problem.inner == 30


def test_a_bad_paperline_variable_is_one_line_naming_it(tmp_path):
    env = {"PAPERLINE_STATE_DIR": str(tmp_path / "state")}
    assert_one_line_error(run_cli("run", "compressed-training", env={**env, "PAPERLINE_N_WORKERS": "0"}),
                          "PAPERLINE_N_WORKERS='0'", "greater than or equal to 1")
    assert_one_line_error(run_cli("status", env={**env, "PAPERLINE_DEVICE": "gpu"}),
                          "PAPERLINE_DEVICE='gpu'", "'auto', 'cpu' or 'cuda'")
    assert not (tmp_path / "state").exists()
    (tmp_path / "afile").write_text("")  # `up` said FileExistsError without naming the variable
    for command in ("up", "status"):
        assert_one_line_error(run_cli(command, env={"PAPERLINE_STATE_DIR": str(tmp_path / "afile")}),
                              f"PAPERLINE_STATE_DIR='{tmp_path / 'afile'}'", "exists and is not a directory")
        assert_one_line_error(run_cli(command, env={"PAPERLINE_STATE_DIR": str(tmp_path / "afile" / "sub")}),
                              "PAPERLINE_STATE_DIR=", f"{tmp_path / 'afile'} is a file, not a directory")


def test_long_paths_in_the_compare_table_are_cut_to_their_end():
    from paperline.flows.cli import _short

    path = "/home/someone/.paperline/gemm/operands/0123456789abcdef01234567.npy"
    assert _short(path) == "…" + path[-35:] and len(_short(path)) == 36
    assert _short("s3://paperline-data/gemm/result.npy") == "s3://paperline-data/gemm/result.npy"  # fits
    assert _short("a long value without any slash in it at all, kept whole") .endswith("kept whole")


def test_bad_video_settings_are_refused_before_anything_starts(tmp_path):
    """Found by a fresh-user trial: these started the flow (or, a bad preset, 'succeeded' with every
    video reported broken) before failing."""
    notes = tmp_path / "notes.txt"
    notes.write_text("not a video")
    (tmp_path / "loop1.mp4").symlink_to("loop2.mp4")
    (tmp_path / "loop2.mp4").symlink_to("loop1.mp4")
    cases = [
        (["preset=bogus"], ["preset='bogus'", "not a libx264 preset"]),
        (["splitter=content", 'splitter_options={"bogus": 1}'], ["content takes no option 'bogus'", "min_score"]),
        (["splitter=content", 'splitter_options={"min_score": "x"}'], ["min_score must be a number"]),
        (["splitter=stride", 'splitter_options={"stride_s": 0}'], ["splitter_options=", "stride: stride_s=0",
                                                                    "must be positive"]),
        # its network is not built to check (a later trial: every curate task failed on threshold=5)
        (["splitter=transnetv2", 'splitter_options={"threshold": 5, "device": "cpu"}'],
         ["splitter_options={'threshold': 5, 'device': 'cpu'}: transnetv2: threshold=5: must be in (0, 1)"]),
        (["min_clip_s=5", "max_clip_s=3"], ["max_clip_s=3.0", "must be >= min_clip_s"]),
        ([f"source={tmp_path / 'nope'}"], ["source=", "no such file or directory"]),
        ([f"source={tmp_path / 'loop1.mp4'}"], ["source=", f"a symbolic link loop ({tmp_path / 'loop1.mp4'} -> loop2.mp4)"]),
        (["source=http://example.com/x.mp4"], ["source=", "unsupported scheme"]),
        # it curated into the demo's dataset name, and every later demo failed on the taken name
        ([f"source={tmp_path}"], ["dataset='demo': the demo videos' dataset; curating source=",
                                  "needs a name of its own (--set dataset=NAME)"]),
        # found by a later trial: hours of read-back, a local path, a flow run and a cluster first
        (["world_size=1000000"], ["world_size=1000000", "4096"]),
        (["source=s3:/paperline-data/videos/", "dataset=x"], ["source='s3:/paperline-data/videos/'",
                                                              "start it with s3://"]),
        ([f"source={notes}", "dataset=x"], [f"source='{notes}': not named like a video (one of .mp4"]),
        # SeaweedFS answered a bare "400 Bad Request"; a bad bucket was blamed on S3's health (a trial)
        (["output=s3://paperline-data/a/../c"], ["output=", "'..' or space-padded segment"]),
        (["output=s3://Bad_Bucket!/x"], ["output=", "'Bad_Bucket!' is not a valid S3 bucket name"]),
        (["source=s3://paperline-data/in//x/"], ["source=", "empty, '.', '..'"]),
        (["shard_target_mb=1e-9"], ["shard_target_mb=1e-9", "greater than or equal to 0.001"]),
        # the clips' staging prefix: deleting the dataset deleted every cached curate task's clips
        (["dataset=staging"], ["dataset='staging'", "where the curate tasks stage clips"]),
        # was pydantic's raw regex (a trial)
        (["dataset=my videos!"], ["dataset='my videos!'", "characters ' !' are not allowed", "daily-{date}"]),
        (["dataset=-x"], ["dataset='-x'", "must start with a letter, a digit or {date}"]),
        (["fps=0.01"], ["fps=0.01: gives fewer than 2 frames in a clip of min_clip_s=2.0 s", "fps >= 1"]),
        # found by a later trial: every window dropped (and counted as 2 shots) after decoding every video
        (["splitter=stride", 'splitter_options={"stride_s": 0.05}'],
         ["stride: stride_s=0.05 s is shorter than min_clip_s=2 s", "use a stride_s >= min_clip_s"]),
        (["min_motion=2"], ["min_motion=2", "less than or equal to 1"]),
    ]
    assert_refused_before_anything_starts("video-curation", cases, tmp_path)


def test_bad_nas_parameters_are_refused_before_anything_starts(tmp_path):
    cases = [
        (["problem=knapsack"], ["problem='knapsack'", "unknown problem"]),
        (["budget=5"], ["budget=5", "smaller than the initial design"]),
        (["budget=1e12"], ["budget=1000000000000: more than the 15,625 distinct points of nasbench201-cifar10's"]),
        (["q=0"], ["q=0"]),
        (["ref_point=[99.0, 2.0]"], ["no point dominates"]),
        (["problem=branin-currin", "optimizer=qehvi"], ["objectives=['val_accuracy_pct', 'model_size_mb']: "
                                                        "branin-currin has fixed objectives"]),
        (['optimizer_options={"n_candidates": -3}'], ["optimizer_options.n_candidates=-3: must be an integer >= 1"]),
        # named as set, not as passed on (it said problem_options.objectives: a trial)
        (["objectives=val_accuracy_pct,foo"], ["objectives='foo': unknown NAS-Bench-201 objective"]),
        (['problem_options={"objectives": ["foo"]}', "objectives=null"],
         ["problem_options.objectives='foo': unknown NAS-Bench-201 objective"]),
        (['live={"optimizer": "nope", "problem": "live-mnist"}'], ["live.optimizer='nope': unknown optimizer"]),
        # broken JSON was "Input should be a valid dictionary" (a fresh-user trial)
        (["problem_options={bad json"], ["problem_options='{bad json': not valid JSON (Expecting property name"]),
    ]  # and `optimizer=annealing` through a `paperline` process: tests/flows/test_nas.py
    assert_refused_before_anything_starts("nas", cases, tmp_path, preset="demo")


def test_bad_compressed_training_parameters_are_refused_before_anything_starts(tmp_path):
    small = ["epochs=2", "max_steps_per_epoch=12", "model_options={\"width\": 8, \"blocks\": 1}", "n_train=2000"]
    cases = [
        ([*small, "fft_theta=1.5"], ["fft_theta=1.5", "theta"]),
        ([*small, "world_size=3"], ["world_size=3", "larger than the number of Dask workers (2)"]),
        # width 8: the largest matrix is 16 x 144; rank 8 would send every gradient dense (ratio 1)
        ([*small, "compressors=powersgd", "powersgd_rank=8"],
         ["powersgd_rank=8: compresses no gradient of the model (each would be sent dense: ratio 1); the largest "
          "that compresses any is 7"]),
        # a JSON value that is not an object was "Input should be a valid dictionary" alone (a trial)
        ([*small[:2], "model_options=abc"], ["model_options='abc': Input should be a valid dictionary: give a "
                                             'JSON object, e.g. {"name": value}']),
        ([*small[:2], "model_options=[1]"], ["model_options=[1]: Input should be a valid dictionary: give a JSON"]),
    ]  # and a checkpoint bucket that does not exist, on the stack: tests/flows/test_compressed_training.py
    assert_refused_before_anything_starts("compressed-training", cases, tmp_path, preset="demo",
                                          env={"PAPERLINE_N_WORKERS": "2"})


def test_more_ranks_than_a_configured_schedulers_workers_are_refused_before_anything_starts(tmp_path):
    """On a scheduler of the user's own with 2 workers, world_size=3 was refused inside the run,
    after its flow run had been created and failed (a trial): the CLI counts the workers first."""
    from distributed import LocalCluster

    small = ["epochs=1", "max_steps_per_epoch=2", "n_train=2000"]
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None, protocol="tcp",
                      host="127.0.0.1") as cluster:
        assert_refused_before_anything_starts(
            "compressed-training", [([*small, "world_size=2"], ["world_size=2", "larger than the number of Dask "
                                                                "workers (1)", "more `dask worker` processes"])],
            tmp_path, preset="demo", env={"PAPERLINE_DASK_SCHEDULER_ADDRESS": cluster.scheduler_address})


def test_a_summary_path_that_cannot_be_written_is_refused_before_the_run(tmp_path):
    """A directory failed with IsADirectoryError after the whole run (and its MLflow run)."""
    env = {"PAPERLINE_STATE_DIR": str(tmp_path / "state")}
    (tmp_path / "file").write_text("")
    for path, fragment in ((tmp_path, "is a directory"), (tmp_path / "file" / "s.json", "is a file, not a directory"),
                           (tmp_path / "state" / "stack.json", "is inside paperline's state directory")):  # its record
        assert_one_line_error(run_cli("run", "tensor-factorization", "--summary-json", str(path), env=env),
                              f"--summary-json='{path}'", fragment)
    assert not (tmp_path / "state").exists()


def test_env_without_a_running_stack_is_one_line(tmp_path):
    """`eval "$(paperline env)"` must not export URLs of servers that are not there."""
    result = run_cli("env", env={"PAPERLINE_STATE_DIR": str(tmp_path / "state")})
    assert_one_line_error(result, "not running; start it with `paperline up`")
    assert "export" not in result.output


def test_status_exits_1_when_a_service_is_down(tmp_path, free_port):
    result = run_cli("status", env={"PAPERLINE_STATE_DIR": str(tmp_path / "state")})
    assert result.exit_code == 1 and "not running: s3, prefect, mlflow" in result.output, result.output
    # a configured Dask scheduler that nothing answers at is down too (it said "existing Dask
    # scheduler at ..." and nothing else: a trial)
    dead = f"tcp://127.0.0.1:{free_port()}"
    result = run_cli("status", env={"PAPERLINE_STATE_DIR": str(tmp_path / "state"),
                                    "PAPERLINE_DASK_SCHEDULER_ADDRESS": dead})
    assert result.exit_code == 1 and f"Dask: dask scheduler is not available at {dead}: cannot connect" in \
        " ".join(result.output.split()), result.output


def test_the_pipelines_modules_load_without_mlflow():
    """A `paperline run` refused for its --set waits for the pipeline's module: MLflow (0.8 s of
    gemm's 2 s) is imported when a run is tracked, not with the module."""
    import subprocess
    import sys

    from paperline.flows.pipelines import _BUILTIN

    modules = ", ".join(module for module, *_ in _BUILTIN.values())
    code = f"import sys, {modules}; print(sorted(m for m in sys.modules if m.startswith('mlflow')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout[-2000:] + out.stderr[-2000:]


def test_parameter_types_are_shown_as_written():
    """`params` showed a package's ``Literal['x.y', 1]`` inside a constrained list as
    ``Literal['a', 1, 'y']``: the text form's module stripping ate a dotted value's head."""
    from typing import Annotated, Literal, Optional

    from pydantic import Field

    from paperline.flows.cli import _shown_type

    cases = {
        Literal["N", "T"]: "Literal['N', 'T']",
        list[Annotated[Literal["a", 1, "x.y"], Field()]]: "list[Literal['a', 1, 'x.y']]",
        list[Literal["a.b", 2]] | None: "list[Literal['a.b', 2]] | None",
        list[Annotated[int, Field(ge=1)]]: "list[int]",
        Optional[int]: "int | None",
        tuple[float, ...]: "tuple[float, ...]",
        dict[str, list[str]]: "dict[str, list[str]]",
        str: "str",
    }
    assert {a: _shown_type(a) for a in cases} == cases


def test_tiny_values_are_not_shown_as_zero():
    """compare's table showed gemm's verification residual (about 1e-17) as 0.0000."""
    from paperline.flows.cli import _fmt

    assert [_fmt(v) for v in (1.2e-17, 0.0, 93.6, -2e-5, float("nan"), 7)] == \
        ["1.200e-17", "0.0000", "93.6000", "-2.000e-05", "nan", "7"]


def test_columns_of_whole_numbers_are_shown_without_decimals():
    """compare showed byte counts as 78824.0000 (MLflow keeps metrics as floats)."""
    from paperline.flows.cli import _integral_columns

    rows = [["run-a", 78824.0, 0.5, float("nan"), 3.0], ["run-b", 1024.0, 1.0, 2.0, 3.5]]
    assert _integral_columns(rows) == {1, 3}
    assert _integral_columns([]) == set()


def test_worker_pool_is_checked_before_the_stack_starts(tmp_path):
    """An unknown pool, and the gpu pool on a machine without a usable GPU (every run it took
    would fail on device=cuda; a fresh-user trial's started silently), are one line; no stack."""
    from paperline.infra.device import gpu_usable

    env = {"PAPERLINE_STATE_DIR": str(tmp_path / "state")}
    assert_one_line_error(run_cli("worker", "--pool", "tpu", env=env), "--pool='tpu': expected one of cpu, gpu")
    if not gpu_usable():
        assert_one_line_error(run_cli("worker", "--pool", "gpu", env=env),
                              "--pool='gpu': no usable CUDA device on this machine")
    assert not (tmp_path / "state").exists()


def test_an_interrupted_run_says_what_the_same_command_does_next():
    """nas with resume=false was told it would resume (a trial): it starts over."""
    from paperline.flows.cli import _again
    from paperline.flows.pipelines import build_parameters, get_pipeline

    nas = get_pipeline("nas")
    assert _again("nas", build_parameters(nas, "demo", [])).startswith("the same command resumes the campaign")
    assert _again("nas", build_parameters(nas, "demo", ["resume=false"])).startswith(
        "the same command starts the campaign over")
    assert "resumes training" in _again("compressed-training", object())


def test_compare_headers_break_at_dots_not_mid_word_when_the_table_is_too_wide():
    from rich.console import Console
    from rich.table import Column, Table

    from paperline.flows.cli import _headers

    columns = ["run", "params.routine", "produc.random.p2t2f.test_rmse", "produc.temporal.tensorly_cp.test_rmse"]
    rows = [["1a2b3c4d", "gemm", "0.4123", "0.9876"]]
    assert _headers(columns, rows, 120) == columns  # fits: as they are
    narrow = _headers(columns, rows, 52)
    assert narrow[1] == "params.\nroutine" and narrow[2] == "produc.\nrandom.\np2t2f.\ntest_rmse"
    console = Console(width=52, record=True)
    table = Table(*[Column(h, overflow="fold") for h in narrow])
    table.add_row(*rows[0])
    console.print(table)
    text = console.export_text()
    assert "routine" in text and "test_rmse" in text and "tensorly_cp" in text, text  # no word folded


def test_compare_table_never_folds_the_run_name_and_status_columns():
    """With many columns, `compare` folded the run id and status mid-value (``3045c8e│d``,
    ``FINISHE│D``: a fresh-user trial); the parameter and metric columns give way instead."""
    from rich.console import Console

    from paperline.flows.cli import _runs_table

    params = ["params.routine", "params.tile", "params.a", "params.b", "params.output"]
    metrics = ["throughput_gflop_per_s", "wall_s", "peer_wall_s", "speedup_vs_peer", "verify.max_rel_residual",
               "scaling.efficiency_at_max"]
    rows = [[f"3045c8e{i}", f"resilient-toucan-{i}", "FINISHED", "gemm", "1024", f"/data/operands/a{i}.npy",
             f"/data/operands/b{i}.npy", f"/data/gemm/run-{i}/result.npy", *[1234.56789 * (i + 1)] * 6]
            for i in range(3)]
    result = {"columns": ["run", "name", "status", *params, *metrics], "rows": rows, "selection": "all runs"}
    console = Console(width=140, record=True)
    console.print(_runs_table("gemm", result, 140))
    lines = console.export_text().splitlines()
    for i in range(3):
        assert any(f"3045c8e{i}" in line and f"resilient-toucan-{i}" in line and "FINISHED" in line
                   for line in lines), "\n".join(lines)


def test_compare_table_never_folds_a_value_and_says_which_columns_it_left_out(monkeypatch):
    """Piped or in an 80-column terminal a test RMSE of 0.0469 showed as "0.0" over "469" (a
    trial): values keep their width, and the columns that do not fit are named instead."""
    monkeypatch.delenv("COLUMNS", raising=False)  # (the hint depends on it)
    from rich.console import Console

    from paperline.flows.cli import _runs_table

    metrics = [f"produc.{split}.{method}.test_rmse" for split in ("random", "temporal")
               for method in ("p2t2f", "tensorly_cp")]
    rows = [[f"3045c8e{i}", f"resilient-toucan-{i}", "FINISHED", *[0.0469123 + i / 1000] * 4, 12.75, 0.125]
            for i in range(3)]
    result = {"columns": ["run", "name", "status", *metrics, "fit_s", "params.rank"], "rows": rows,
              "selection": "all runs"}
    console = Console(width=80, record=True)
    console.print(_runs_table("tensor-factorization", result, 80))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert text.count("0.0469") >= 2 and text.count("0.0489") >= 2, text  # whole values, every row
    assert "column(s) left out for the console's width (80): " in " ".join(text.split()), text
    assert "or name the metrics to show with --metric" in " ".join(text.split()), text  # metrics among them
    # a named metric takes the room before the parameters: at 80 columns gemm's throughput was left
    # out for params.output, a path different in every run (a trial)
    long_param = [[*row[:3], f"/home/someone/results/run-{i}/result-of-a-long-name.npy", 51.5] for i, row in enumerate(rows)]
    named = {"columns": ["run", "name", "status", "params.output", "throughput_gflop_per_s"], "rows": long_param,
             "selection": "all runs", "metrics": ["throughput_gflop_per_s"]}
    console = Console(width=80, record=True)
    console.print(_runs_table("gemm", named, 80))
    narrow = " ".join(console.export_text().split())
    assert "51.5" in narrow and "left out for the console's width (80): params.output;" in narrow, narrow
    assert "or widen the terminal (or set COLUMNS)" in narrow and "--metric" not in narrow, narrow
    monkeypatch.setenv("COLUMNS", "80")  # set already: it decides the width, not the terminal (a trial, a review)
    console = Console(width=80, record=True)
    console.print(_runs_table("gemm", named, 80))
    said = " ".join(console.export_text().split())
    assert "or set a larger COLUMNS (now 80)" in said and "widen" not in said, said
    monkeypatch.delenv("COLUMNS")
    for width in (140, 200):  # wide enough: nothing left out
        console = Console(width=width, record=True)
        console.print(_runs_table("tensor-factorization", result, width))
        wide = console.export_text()
        assert "left out" not in wide and "rank" in wide and "12.75" in wide, wide


def test_compare_table_shortens_long_run_names_for_the_ranking_metric():
    """At 80 columns `compare nas` left out final_hypervolume, the metric its runs are sorted by,
    for the campaigns' long names, and showed params.budget instead (a trial): the names give way."""
    from rich.console import Console

    from paperline.flows.cli import _runs_table

    rows = [[f"3045c8e{i}", f"nasbench201-cifar10-lamoo-seed0-16641aab3f-{i}", "FINISHED", 40, 5659579209.5 + i]
            for i in range(2)]
    result = {"columns": ["run", "name", "status", "params.budget", "final_hypervolume"], "rows": rows,
              "selection": "all runs", "metrics": ["final_hypervolume"]}
    console = Console(width=80, record=True)
    console.print(_runs_table("nas", result, 80))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert "hypervolume" in text and "5659579209" in text and "5659579210" in text, text
    assert "params.budget" not in text.split("left out")[0], text  # the parameter gives way, not the metric
    names = [line.split("│")[2].strip() for line in text.splitlines() if "3045c8e" in line]
    assert len(names) == 2 and all("…" in n and n.startswith("nasbench201-") for n in names), names
    assert names[0].endswith("aab3f-0") and names[1].endswith("aab3f-1"), names  # still told apart


def test_compare_table_makes_room_for_every_named_metric_before_whole_names(monkeypatch):
    """`compare compressed-training --metric final_test_accuracy_pct --metric bytes_sent_per_step`
    at 80 columns left the second named metric out for whole run names, and the caption told to
    name the metrics to show with --metric, as they were (a trial)."""
    monkeypatch.delenv("COLUMNS", raising=False)  # (the hint depends on it)
    from rich.console import Console

    from paperline.flows.cli import _runs_table

    metrics = ["final_test_accuracy_pct", "bytes_sent_per_step"]
    rows = [[f"3045c8e{i}", f"fft@powersgd-bytes-{i}", "FINISHED", 92.5 + i, 5269.0 * (i + 1), "fft", "0.2"]
            for i in range(2)]
    result = {"columns": ["run", "name", "status", *metrics, "params.compressor", "params.theta"], "rows": rows,
              "selection": "all runs", "metrics": metrics}
    console = Console(width=80, record=True)
    console.print(_runs_table("compressed-training", result, 80, named=True))
    text = console.export_text()
    flat = " ".join(text.split())
    assert all(len(line) <= 80 for line in text.splitlines()), text
    table = text.split("left out")[0]  # headers broken after '_' where the table would not fit
    assert "bytes_sent_" in table and "per_step" in table and "10538" in table and "93.5" in table, text
    assert "fft@powersgd-bytes-1" in table, text  # whole names where both metrics fit beside them
    assert "left out for the console's width (80): params.compressor, params.theta;" in flat, text
    assert "widen the terminal (or set COLUMNS)" in flat and "--metric" not in flat, text
    # a header with spaces breaks at them: "regression vs best earlier" was left out at 80 columns (a trial)
    flagged = {**result, "columns": [*result["columns"][:5], "regression vs best earlier"],
               "rows": [[row[0], f"fft-{i}", *row[2:5], "none"] for i, row in enumerate(rows)]}
    console = Console(width=80, record=True)
    console.print(_runs_table("compressed-training", flagged, 80, named=True))
    shown = console.export_text()
    assert "regression" in shown and "earlier" in shown and "left out" not in shown, shown
    # too narrow for both named metrics: the one left out is named, and no --metric advice either
    console = Console(width=60, record=True)
    console.print(_runs_table("compressed-training", result, 60, named=True))
    narrow = " ".join(console.export_text().split())
    assert "left out for the console's width (60): bytes_sent_per_step" in narrow, narrow
    assert "--metric" not in narrow, narrow


def test_a_configured_endpoint_refusing_the_login_is_not_called_unreachable():
    """`status` said "not reachable: mlflow at ... (configured endpoint): not authorized (HTTP 401)"
    (a trial): a server that answers 401 was reached."""
    from paperline.flows.cli import _down_lines
    from paperline.infra.stack import Service

    services = [Service("mlflow", "http://127.0.0.1:5000", managed=False, healthy=False,
                        problem="not authorized (HTTP 401): set MLFLOW_TRACKING_USERNAME"),
                Service("prefect", "http://127.0.0.1:9/api", managed=False, healthy=False,
                        problem="GET /api/health failed: ConnectError")]
    assert _down_lines(services) == [
        "refused: mlflow at http://127.0.0.1:5000 (configured endpoint): not authorized (HTTP 401): set "
        "MLFLOW_TRACKING_USERNAME",
        "not reachable: prefect at http://127.0.0.1:9/api (configured endpoint): GET /api/health failed: ConnectError"]


def test_an_option_users_reach_for_names_the_one_there_is():
    """`compare --sort` got click's guess "Possible options: --out" (a trial); other unknown
    options keep click's own message."""
    for args, said in ((["compare", "nas", "--sort", "x"], "--sort: runs are sorted by the first --metric"),
                       (["compare", "nas", "--limit=3"], "--limit: --top N shows at most N runs"),
                       (["run", "gemm", "-p", "m=3"], "-p: --set KEY=VALUE sets a parameter"),
                       (["run", "gemm", "--debug"], "--debug: it is paperline's own option: give it before the command"),
                       (["status", "--debug"], "--debug: it is paperline's own option")):
        result = run_cli(*args)
        flat = " ".join(result.output.replace("│", " ").split())
        assert result.exit_code == 2 and said in flat and "Possible options" not in flat, (args, result.output)
    flat = " ".join(run_cli("compare", "nas", "--bogus").output.replace("│", " ").split())
    assert "No such option: --bogus (Possible options: --log, --out)" in flat, flat


def test_a_mistyped_name_gets_a_guess():
    """`--set optimizer=lamoa` got the list of optimizers alone, where `--set rnak=4` got "did you
    mean rank?" (a trial); names far from every known one get the list as before."""
    for args, said in ((["run", "nas", "--set", "optimizer=lamoa"], "optimizer='lamoa': unknown optimizer; did you "
                                                                     "mean lamoo? known: alphax, "),
                       (["run", "nas", "--set", "problem=brannin-currin"], "unknown problem; did you mean branin-currin?"),
                       (["run", "gem"], "pipeline='gem': unknown pipeline; did you mean gemm? known: "),
                       (["run", "gemm", "--preset", "dmeo"], "--preset='dmeo': unknown preset; did you mean demo? known: "),
                       (["run", "nas", "--set", "optimizer=annealing"], "unknown optimizer; known: alphax, ")):
        result = run_cli(*args)
        flat = " ".join(result.output.split())
        assert result.exit_code == 1 and said in flat, (args, flat)


def test_serve_names_kill_when_it_ignores_ctrl_c():
    """`paperline serve &` from a script ignores SIGINT: it said "Ctrl-C stops serving", and a
    SIGINT did nothing (a trial); it names `kill PID` then."""
    import signal

    from paperline.flows.cli import _stop_serving_hint

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ignored = _stop_serving_hint()
    finally:
        signal.signal(signal.SIGINT, before)
    assert ignored.startswith(f"`kill {os.getpid()}` stops serving (Ctrl-C does not"), ignored
    assert _stop_serving_hint() == "Ctrl-C stops serving"


def test_compares_note_is_wrapped_at_the_terminals_width(monkeypatch):
    """The table kept to 80 columns, the note under it ran to the 140 the CLI's console keeps for
    URLs (a trial); paths stay whole (soft-wrapped)."""
    from rich.console import Console

    from paperline.flows import cli

    recording = Console(width=140, record=True)
    monkeypatch.setattr(cli, "console", recording)
    note = ("left out: 3 run(s) without final_test_accuracy_pct (named with --metric): 0a1b2c3d, 4e5f6a7b, "
            "8c9d0e1f; 2 comparison run(s) of `paperline compare --log` (--all-runs lists them)")
    result = {"columns": ["run", "name", "status", "m"], "rows": [["0a1b2c3d", "a", "FINISHED", 1.0]],
              "selection": "all runs", "metrics": ["m"], "note": note, "plot": "/tmp/" + "p" * 100 + ".png",
              "parquet": "/tmp/runs.parquet", "comparison_run_id": None}
    cli._print_comparison("nas", result, 80, named=False)
    text = recording.export_text()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines if not line.startswith("plot:")), text
    assert " ".join(text.split()).count(note) == 1  # all of it, wrapped
    assert f"plot: {result['plot']}" in lines, text


def test_env_with_a_failing_configured_endpoint_says_why(tmp_path, free_port):
    """`env` said `stack is not available: not running; start it with paperline up` for a configured
    MLflow URI with a bad port: `up` starts nothing for it (a fresh-user trial)."""
    uri = f"http://127.0.0.1:{free_port()}"
    result = run_cli("env", env={"PAPERLINE_STATE_DIR": str(tmp_path), "PAPERLINE_MLFLOW_TRACKING_URI": uri})
    text = " ".join(result.output.split())
    assert result.exit_code != 0
    assert f"not reachable: mlflow at {uri} (configured endpoint): GET /health failed: ConnectError" in text, text
    assert "check PAPERLINE_MLFLOW_TRACKING_URI" in text, text


@pytest.mark.parametrize("uri", ["http://127.0.0.1:notaport", "http://bob:qz/xk@127.0.0.1:5000",
                                 "http://bob:vv#zzq@127.0.0.1:5000", "127.0.0.1:5000"])
def test_a_malformed_endpoint_url_is_refused_without_its_password(tmp_path, uri):
    """A password with a raw '/' or '#' ended the host early, and its halves were printed in
    "GET /cdef@127.0.0.1:5000/health failed: InvalidURL: Invalid port: 'ab'" (a trial)."""
    for command in ("status", "env"):
        result = run_cli(command, env={"PAPERLINE_STATE_DIR": str(tmp_path), "PAPERLINE_MLFLOW_TRACKING_URI": uri})
        text = " ".join(result.output.split())
        assert result.exit_code != 0 and "error: PAPERLINE_MLFLOW_TRACKING_URI=" in text, text
        hint = "a password with '/', '?', '#' or '@' must be percent-encoded"
        assert (hint in text) == ("@" in uri), text  # (only where a login is: an infra trial)
        if uri.endswith("notaport"):
            assert "its port is not a number" in text, text
        assert not any(secret in text for secret in ("qz", "xk", "vv", "zzq")), text


def test_a_password_in_a_failing_s3_endpoint_is_never_printed(tmp_path, free_port):
    """botocore's "Could not connect to the endpoint URL: ..." quoted the configured URL with its
    password in `status` and `env`, though the row's own URL was redacted (a security review)."""
    uri = f"http://carol:pw9@127.0.0.1:{free_port()}/"
    env = {"PAPERLINE_STATE_DIR": str(tmp_path), "PAPERLINE_S3_ENDPOINT_URL": uri,
           "PAPERLINE_S3_ACCESS_KEY_ID": "k", "PAPERLINE_S3_SECRET_ACCESS_KEY": "s"}
    for command in ("status", "env"):
        result = run_cli(command, env=env)
        assert "carol@127.0.0.1" in result.output and "pw9" not in result.output, result.output


def test_redact_url_and_text():
    from paperline.infra.errors import redact_text, redact_url

    assert redact_url("http://alice:s3cret@h:5000/x") == "http://alice@h:5000/x"
    assert redact_url("http://token@h/") == "http://h/"  # a bare user part may be a token
    # a '/', '?' or '#' in the password ends the URL's authority early: still no password shown
    for url in ("http://bob:pa/ss@h:9000/x", "http://bob:pa?ss@h:9000/x", "http://bob:pa#ss@h:9000/x"):
        assert redact_url(url) == "http://bob@h:9000/x", url
    assert redact_url("http://h:5000/users/a@b.example") == "http://h:5000/users/a@b.example"  # no user info
    assert redact_text('Could not connect to the endpoint URL: "http://carol:pw9@127.0.0.1:3/"; retry') == \
        'Could not connect to the endpoint URL: "http://carol@127.0.0.1:3/"; retry'


def test_a_login_in_a_url_is_split_off_for_prefects_auth_string():
    from paperline.infra.stack import split_url_login

    assert split_url_login("http://alice:s3cret@h:4200/api") == ("http://h:4200/api", "alice:s3cret")
    assert split_url_login("https://al%40ce:p%3Aw%25@h/api") == ("https://h/api", "al@ce:p:w%")  # escapes decoded
    for url in ("http://bob:pa/ss@h:9000/api", "http://bob:pa?ss@h:9000/api", "http://bob:pa#ss@h:9000/api"):
        assert split_url_login(url) == ("http://h:9000/api", f"bob:{url[11:16]}"), url
    for url in ("http://h:4200/api", "http://token@h/api", "http://h:4200/users/a@b.example"):  # no login: as it is
        assert split_url_login(url) == (url, None)


def test_a_prefect_server_gone_during_a_run_is_named():
    """A Prefect server killed (or `paperline down`) under a run ended it, minutes later, with
    `error: ConnectError: [Errno 111] Connection refused` (a trial): the error now names Prefect
    and what to do; a connection error to another server is left as it was."""
    import types

    import httpx

    from paperline.flows.cli import _prefect_gone
    from paperline.infra.errors import ServiceError

    info = types.SimpleNamespace(prefect_api_url="http://127.0.0.1:4200/api", prefect_ui_url="http://127.0.0.1:4200")
    refused = httpx.ConnectError("[Errno 111] Connection refused",
                                 request=httpx.Request("POST", "http://localhost:4200/api/flow_runs/x/set_state"))
    error = _prefect_gone(refused, info)
    assert isinstance(error, ServiceError)
    assert str(error).startswith("prefect is not available at http://127.0.0.1:4200: the server stopped answering "
                                 "during the run (ConnectError: [Errno 111] Connection refused)")
    assert "`paperline up` restarts it" in str(error)
    # the other services down too are named (the whole stack killed under a run: the error named
    # Prefect alone, a trial); this process's state directory has no stack running
    assert "is not recorded there; also down: s3, mlflow; `paperline status`" in str(error)
    elsewhere = httpx.ConnectError("refused", request=httpx.Request("GET", "http://127.0.0.1:5000/health"))
    assert _prefect_gone(elsewhere, info) is None
    assert _prefect_gone(ValueError("x"), info) is None
    # `down` as a run started: Prefect's version check raised "RuntimeError: Failed to reach API at ..." (a trial)
    try:
        raise RuntimeError("Failed to reach API at http://127.0.0.1:4200/api/") from refused
    except RuntimeError as exc:
        assert "the server stopped answering during the run (ConnectError" in str(_prefect_gone(exc, info))
    assert _prefect_gone(RuntimeError("Failed to reach API at http://127.0.0.1:4200/api/"), info) is None


def test_exit_hooks_that_hang_are_cut_short():
    """With the stack stopped as a run finished, its results printed, `paperline run` sat 72 s in
    Prefect's exit drains retrying the dead server (a trial): the hooks get EXIT_HOOKS_S."""
    import subprocess
    import sys
    import time

    for hang in ("atexit.register(time.sleep, 120)",
                 # Prefect's queue services drain in threading's exit callbacks (a trial: minutes)
                 "threading._register_atexit(time.sleep, 120)"):
        code = (f"import atexit, threading, time; {hang}; from paperline.flows import cli; "
                "cli.EXIT_HOOKS_S = 2.0; print('done', flush=True); cli._exit(0)")
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
        assert proc.returncode == 0 and proc.stdout == "done\n", proc.stdout + proc.stderr
        assert time.monotonic() - start < 60
        assert "exiting without Prefect's last logs and events: its server did not take them within 2 s" in proc.stderr
    # hooks that finish, and a non-daemon thread, are waited for and exit at once (threading._shutdown
    # called off the main thread waited for the main thread: every exit took EXIT_HOOKS_S)
    code = ("import atexit, threading, time; threading._register_atexit(print, 'drained'); "
            "atexit.register(print, 'flushed'); threading.Thread(target=time.sleep, args=(1,)).start(); "
            "from paperline.flows import cli; cli.EXIT_HOOKS_S = 30.0; cli._exit(3)")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert (proc.returncode, proc.stdout, proc.stderr) == (3, "drained\nflushed\n", ""), proc
    assert time.monotonic() - start < 15


def test_a_second_ctrl_c_while_the_exit_hooks_wait_exits_at_once(terminal_signals):
    """A second Ctrl-C while `paperline run` waited on Prefect's exit drains printed a
    KeyboardInterrupt traceback and went on waiting (a trial)."""
    import signal
    import subprocess
    import sys
    import time

    code = ("import threading, time; threading._register_atexit(time.sleep, 120); from paperline.flows import cli; "
            "cli.EXIT_HOOKS_S = 90.0; print('done', flush=True); cli._exit(0)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=terminal_signals)
    assert proc.stdout.readline() == "done\n"
    time.sleep(1.0)  # waiting in _exit now
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < 30 and proc.returncode == 130, (proc.returncode, err)
    assert "interrupted again: exiting without Prefect's last logs" in err and "Traceback" not in err, err


def test_up_interrupted_while_starting_says_what_it_left(monkeypatch):
    """`paperline up` stopped by Ctrl-C while its servers started exited 130 without a word (a
    trial); ensure_stack stops what it had started (tests/infra/test_down.py), and `up` says so."""
    from paperline.flows import cli

    def interrupted(**_):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_ensure_stack", interrupted)
    result = run_cli("up")
    assert result.exit_code != 0
    assert "interrupted: the servers this `up` had started are stopped again" in " ".join(result.output.split())


def test_an_event_prefect_could_not_send_is_one_short_line_once(monkeypatch):
    import logging

    from prefect.events import Event

    from paperline.flows.cli import _short_event_failures
    from paperline.infra import worker_exit

    monkeypatch.setattr(worker_exit, "_SAID", {})  # this process's first ones
    event = Event(event="prefect.task-run.Completed", resource={"prefect.resource.id": "x" * 3000})

    def failed() -> logging.LogRecord:
        return logging.LogRecord("prefect._internal.concurrency", logging.ERROR, __file__, 1,
                                 "Service %r failed to process item %r", ("EventsWorker", event), None)

    def unreachable() -> logging.LogRecord:
        return logging.LogRecord("prefect.events.clients", logging.WARNING, __file__, 1,
                                 "Unable to connect to %r. Please check your network settings", ("ws://x/in",), None)

    record = failed()
    assert _short_event_failures(record) and record.getMessage() == \
        "Prefect's events worker could not send an event to the server (the next ones for 10 minutes are not shown)"
    # its pair (the same outage said twice) and the next ones, every few seconds from every process
    # until the run gave up: not shown
    assert not _short_event_failures(unreachable())
    assert not _short_event_failures(failed()) and not _short_event_failures(unreachable())
    monkeypatch.setattr(worker_exit, "QUIET_REPEATS_S", 0.0)  # (as 10 minutes later: a serve's next outage)
    assert _short_event_failures(unreachable()) and _short_event_failures(failed())
    other = logging.LogRecord("prefect", logging.ERROR, __file__, 1, "Service %r failed to process item %r",
                              ("LogsWorker", {"x": 1}), None)
    assert _short_event_failures(other) and "LogsWorker" in other.getMessage()


def test_what_an_interrupt_ends_is_not_reported_as_a_fault():
    """Prefect's "Finished in state Running()" and Dask's "still alive ..., killing" lines after Ctrl-C."""
    import logging

    from paperline.flows.cli import _no_unfinished_finish

    def record(name: str, message: str) -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, None)

    assert not _no_unfinished_finish(record("prefect.task_runs", "Finished in state Running()"))
    from paperline.flows.cli import _no_kill_notice

    assert not _no_kill_notice(record("distributed.nanny", "Worker process still alive after 4.0 seconds, killing"))
    assert _no_kill_notice(record("distributed.nanny", "Restarting worker"))
    from paperline.flows.cli import _no_gather_exit

    gather = ("Task exception was never retrieved\nfuture: <Task finished name='Task-681' coro=<Client._gather."
              "<locals>.wait() done, defined at .../distributed/client.py:2367> exception=AllExit()>")
    assert not _no_gather_exit(record("asyncio", gather))
    assert _no_gather_exit(record("asyncio", gather.replace("AllExit()", "ValueError('x')")))
    assert _no_gather_exit(record("paperline", gather))
    for kept in (record("prefect.task_runs", "Finished in state Failed('Task run encountered an exception')"),
                 record("prefect.task_runs", "Finished in state Crashed()"),
                 record("paperline", "Finished in state Running()")):
        assert _no_unfinished_finish(kept)


def test_a_run_queued_for_its_deployments_slot_is_said_to_wait_not_to_be_aborted():
    """serve's log said "Aborted submission of flow run '...': Server returned a non-pending state
    'SCHEDULED'" for a run waiting behind its deployment's one concurrency slot (a trial read it as
    a failure; the run ran later), and so did `paperline worker`'s Prefect worker, in its own
    formatted words (a review). Other aborts keep Prefect's words."""
    import logging

    from paperline.infra.prefect_worker import queued_not_aborted

    def record(msg: str, args: tuple) -> logging.LogRecord:
        return logging.LogRecord("prefect.runner.state_proposer", logging.INFO, __file__, 1, msg, args, None)

    runner = "Aborted submission of flow run '%s': Server returned a non-pending state %r"
    waits = ("flow run '71795212' waits Scheduled for its deployment's concurrency slot (one run at a time): it "
             "starts when the run before it ends")
    for queued in (record(runner, ("71795212", "SCHEDULED")), record(runner % ("71795212", "SCHEDULED"), ())):
        assert queued_not_aborted(queued)
        assert queued.getMessage() == waits
    for other in (record(runner, ("71795212", "CANCELLED")), record(runner % ("71795212", "CANCELLED"), ()),
                  record("Aborted submission of flow run '%s'. Server sent an abort signal: %s", ("7", "gone"))):
        assert queued_not_aborted(other) and other.getMessage().startswith("Aborted submission")


def test_the_prefect_workers_failed_polls_are_reported_without_tracebacks(capsys):
    """Prefect's worker loop, its polls failing three times in a row (the stack stopped under it),
    printed each error's whole traceback with ``print`` (a trial): through
    :func:`short_service_report` each is its exception's line."""
    import asyncio

    import httpx
    from prefect.utilities.services import critical_service_loop

    from paperline.infra.prefect_worker import _short_service_reports

    async def poll() -> None:
        raise httpx.ConnectError("All connection attempts failed")

    with pytest.raises(RuntimeError, match="Service exceeded error threshold"):
        asyncio.run(_short_service_reports(critical_service_loop)(workload=poll, interval=0.0, backoff=1))
    out = capsys.readouterr().out
    assert out.splitlines() == ["Failed the last 3 attempts. Please check your environment and configuration.",
                                "Examples of recent errors:",
                                "  httpx.ConnectError: All connection attempts failed"], out
    # an exception whose message has lines of its own is said by its type's line (a review)
    from paperline.infra.prefect_worker import short_service_report

    short_service_report("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nhttpx.HTTPStatusError: "
                         "Server error '503 Service Unavailable' for url 'http://x/api'\nFor more information check: "
                         "https://httpstatuses.com/503\n")
    assert capsys.readouterr().out == ("  httpx.HTTPStatusError: Server error '503 Service Unavailable' for url "
                                       "'http://x/api'\n")


def test_paperline_workers_prefect_worker_says_a_queued_run_waits(tmp_path, monkeypatch):
    """`paperline worker` runs Prefect's CLI through ``paperline.infra.prefect_worker``: the
    arguments reach Prefect's own `worker start`, and the worker's flow-run logger (whose records
    go to the terminal and to the run's log in the UI) carries the rewrite."""
    import logging
    import subprocess

    from paperline.infra import prefect_worker

    out = subprocess.run([sys.executable, "-m", "paperline.infra.prefect_worker", "worker", "start", "--help"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "--pool" in out.stdout and "--type" in out.stdout  # Prefect's `worker start` answered
    logger = logging.getLogger(prefect_worker.WORKER_LOGGER)
    try:
        # main() puts the filter in place before Prefect's CLI runs, and hands it the arguments
        import prefect.cli

        seen = {}

        def app() -> None:
            seen["argv"], seen["filtered"] = list(sys.argv), prefect_worker.queued_not_aborted in logger.filters
        monkeypatch.setattr(prefect.cli, "app", app)
        monkeypatch.setattr(sys, "argv", list(sys.argv))
        monkeypatch.delenv("PAPERLINE_DEBUG", raising=False)  # (an in-process `--debug` test sets it for good)
        prefect_worker.main(["worker", "start", "--pool", "paperline-cpu"])
        assert seen == {"argv": ["prefect", "worker", "start", "--pool", "paperline-cpu"], "filtered": True}
        # and a stack gone under it is one line per record on its terminal, not ~220 lines (a trial)
        from prefect.logging.handlers import PrefectConsoleHandler

        from paperline.infra.worker_exit import ServerGoneOneLine, short_event_failure

        consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
        assert consoles and all(short_event_failure in h.filters and any(isinstance(f, ServerGoneOneLine)
                                                                          for f in h.filters) for h in consoles)
        from prefect.workers import base

        assert base.critical_service_loop._paperline_short
        prefect_worker.install()
        assert logger.filters.count(prefect_worker.queued_not_aborted) == 1
        # the logger Prefect's worker gives a flow run's records
        import uuid

        from prefect.client.schemas.objects import FlowRun
        from prefect.workers.process import ProcessWorker

        run = FlowRun(flow_id=uuid.uuid4(), name="queued-run")
        worker_logger = ProcessWorker(work_pool_name="cpu").get_flow_run_logger(run)
        assert worker_logger.logger is logger
    finally:
        from prefect.workers import base

        base.critical_service_loop = getattr(base.critical_service_loop, "__wrapped__", base.critical_service_loop)
        logger.removeFilter(prefect_worker.queued_not_aborted)
        from prefect.logging.handlers import PrefectConsoleHandler

        from paperline.infra.worker_exit import ServerGoneOneLine, short_event_failure

        for handler in logging.getLogger().handlers:  # (this test's process goes on to other tests)
            if isinstance(handler, PrefectConsoleHandler):
                handler.removeFilter(short_event_failure)
                for f in [f for f in handler.filters if isinstance(f, ServerGoneOneLine)]:
                    handler.removeFilter(f)


def test_a_401_is_said_as_a_refused_login_with_what_to_do(capsys):
    """`paperline serve` on a stack whose login was made anew died with `PrefectHTTPStatusError:
    Client error '401 Unauthorized' ...`, a worker's runs with MLflow's 40-line 401 (a trial)."""
    import httpx
    import typer
    from mlflow.exceptions import MlflowException

    from paperline.flows.cli import _friendly, _unauthorized

    request = httpx.Request("GET", "http://paperline:s3cret@127.0.0.1:4200/api/deployments/x")
    status = httpx.HTTPStatusError("Client error '401 Unauthorized'", request=request,
                                   response=httpx.Response(401, request=request))
    grouped = ExceptionGroup("worker", [RuntimeError("x"), status])
    assert "Prefect at http://127.0.0.1:4200 refused this process's login" in _unauthorized(grouped)
    mlflow = MlflowException("API request to endpoint /api/2.0/mlflow/runs/create failed with error code 401 != 200")
    wrapped = RuntimeError("the flow run failed")
    wrapped.__cause__ = mlflow
    assert "MLflow refused this process's login" in _unauthorized(wrapped)
    forbidden = httpx.HTTPStatusError("403", request=request, response=httpx.Response(403, request=request))
    assert _unauthorized(forbidden) is None and _unauthorized(ValueError("error code 401")) is None

    def serve():
        raise grouped

    with pytest.raises(typer.Exit):
        _friendly(serve)()
    err = " ".join(capsys.readouterr().err.split())
    assert "error: not authorized (HTTP 401)" in err and "restart this command" in err and "s3cret" not in err


def test_a_worker_that_exits_unasked_says_why_and_fails(stack):
    """The stack's login made anew under a running `paperline worker`: its `prefect worker` died
    with a 401 traceback, and `paperline worker` exited 0 as if stopped (a trial). A child that
    exits unasked is now an error, named as a refused login when the server refuses the one it had."""
    import os
    import sys

    from paperline.flows.cli import _supervise, _worker_failed
    from paperline.infra.errors import PaperlineError

    _, info = stack
    assert _supervise([sys.executable, "-c", "raise SystemExit(3)"], env=dict(os.environ), cwd=".") == (3, False)
    with pytest.raises(PaperlineError, match=r"^not authorized \(HTTP 401\): Prefect at http://127\.0\.0\.1:\d+ "
                                             r"refused this process's login"):
        _worker_failed(1, info.prefect_api_url, "paperline:not-the-login")
    with pytest.raises(PaperlineError, match=r"^the Prefect worker exited with status 1 \(its output above says why\)"):
        _worker_failed(1, info.prefect_api_url, info.prefect_login)


def test_a_supervised_child_stops_when_its_supervisor_is_killed(tmp_path, script_job_signals):
    """`paperline worker` killed with SIGKILL left its `prefect worker` running and taking runs,
    while `status` said no worker was online and `down` left it (a trial)."""
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    import psutil

    pid_file = tmp_path / "child.pid"
    child = f"import os, pathlib, time; pathlib.Path({str(pid_file)!r}).write_text(f'{{os.getpid()}}\\n'); time.sleep(120)"
    code = ("import os, sys\nfrom paperline.flows.cli import _supervise\n"
            f"_supervise([sys.executable, '-c', {child!r}], env=dict(os.environ), cwd='.')")
    # started as a script's `&` starts it: SIGINT ignored, so that its child has a session of its own
    supervisor = subprocess.Popen([sys.executable, "-c", code], preexec_fn=script_job_signals)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text().endswith("\n"):
            assert supervisor.poll() is None and time.monotonic() < deadline, supervisor.returncode
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        assert psutil.Process(pid).ppid() == supervisor.pid
        supervisor.kill()
        supervisor.wait()
        _, alive = psutil.wait_procs([psutil.Process(pid)], timeout=20)
        assert not alive, "the supervised child outlived its supervisor's SIGKILL"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()
        if pid_file.exists() and pid_file.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_a_failed_verification_is_one_line_like_other_refusals(capsys):
    """It printed "error: VerificationError: Freivalds' check failed ..." and "(run with --debug for
    the traceback)", unlike the input errors' one line (a trial)."""
    import typer

    from paperline.flows.cli import _friendly
    from paperline.tasks.gemm import VerificationError

    @_friendly
    def fails() -> None:
        raise VerificationError("Freivalds' check failed: residual 1 > tolerance 1e-12; the output was not written")

    with pytest.raises(typer.Exit):
        fails()
    err = " ".join(capsys.readouterr().err.split())
    assert "error: Freivalds' check failed: residual 1" in err, err
    assert "--debug" not in err and "VerificationError" not in err, err


@pytest.mark.parametrize("reason, said", [
    ("already forgotten", "Dask cancelled it, as it does when the worker running it is lost or restarted"),
    ("scheduler-connection-lost", "here the run's client lost the Dask scheduler (stopped, or the network "
                                  "failed): `paperline status` checks it"),
])
def test_a_run_ended_by_a_lost_dask_worker_or_scheduler_says_so_in_words(capsys, reason, said):
    """On a Dask cluster of a trial's own, killed workers and a stopped scheduler ended runs with a
    bare "error: FutureCancelledError: ... cancelled for reason: ..." (a trial)."""
    import typer
    from distributed.client import FutureCancelledError

    from paperline.flows.cli import _friendly

    @_friendly
    def fails() -> None:
        raise FutureCancelledError("split_tensor-1", reason)

    with pytest.raises(typer.Exit):
        fails()
    err = " ".join(capsys.readouterr().err.split())
    assert f"error: FutureCancelledError: split_tensor-1 cancelled for reason: {reason}." in err, err
    assert said in err, err


def test_the_error_line_starts_a_line_after_a_library_wrote_half_of_one(monkeypatch):
    """Prefect's log worker writes "--- Error logging to API ---" then its error with no newline
    when the server has gone: the CLI's `error: ...` line was glued onto it ("All connection
    attempts failederror: prefect is not available ...", a trial), so `grep '^error:'` missed it."""
    import io

    import typer

    from paperline.flows.cli import LineEndTracker, _friendly
    from paperline.infra.errors import ServiceError

    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", LineEndTracker(out))

    @_friendly
    def fails() -> None:
        sys.stderr.write("--- Error logging to API ---\nAll connection attempts failed")
        raise ServiceError("prefect", "the server stopped answering during the run")

    with pytest.raises(typer.Exit):
        fails()
    lines = out.getvalue().splitlines()
    assert lines[1] == "All connection attempts failed" and lines[2].startswith("error: prefect"), lines
    # (and Prefect's error text after its "--- Error logging to API ---" line is ended, so that the
    # next log record, written past this stream by a log handler, starts a line too)
    sys.stderr.write("--- Error logging to API ---\n")
    sys.stderr.write("All connection attempts failed")
    assert out.getvalue().endswith("--- Error logging to API ---\nAll connection attempts failed\n")
    assert LineEndTracker(io.StringIO()).at_line_start and sys.stderr.isatty() is False  # forwarded


@pytest.mark.parametrize("interrupted", [True, False])
def test_an_error_a_ctrl_c_became_before_the_flow_run_ends_the_run_as_the_interrupt(interrupted, monkeypatch, capsys):
    """pydantic turned an early Ctrl-C into "PydanticSerializationError: Error calling function
    `_ser_model`: KeyboardInterrupt" and the run ended "error: ..." with exit 1 (a stress test of
    early Ctrl-Cs); an error with no Ctrl-C behind it stays the error."""
    import signal
    import time

    from paperline.flows import cli
    from paperline.infra import interrupts

    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # (restored: install() wraps it)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        interrupts.install()
        with pytest.raises(KeyboardInterrupt if interrupted else ValueError), cli._said_if_interrupted():
            try:
                if interrupted:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(2)
            except KeyboardInterrupt as exc:  # a library wrapping it, as pydantic's serializer does
                raise ValueError("Error calling function `_ser_model`: KeyboardInterrupt") from exc
            raise ValueError("a plain error")
    finally:
        signal.signal(signal.SIGINT, previous)
    said = "interrupted before the flow run started: nothing ran" in capsys.readouterr().out
    assert said == interrupted


def test_a_printed_command_is_one_the_shell_finds(monkeypatch, tmp_path):
    """`serve` printed `paperline env` and `prefect deployment run ...` to a user whose shell finds
    neither (the README runs .venv/bin/paperline; a trial): the venv's path unless PATH leads there."""
    from paperline.flows.cli import _on_path

    venv_bin = Path(sys.executable).parent
    monkeypatch.setenv("PATH", str(tmp_path))
    assert _on_path("prefect") == str(venv_bin / "prefect")
    monkeypatch.setenv("PATH", f"{venv_bin}{os.pathsep}{tmp_path}")
    assert _on_path("prefect") == "prefect"
    assert _on_path("no-such-command-here") == "no-such-command-here"


def test_serve_stopped_after_its_prefect_server_went_away_says_so_and_exits_0(stack, stack_cli, monkeypatch):
    """A serve stopped after `paperline down`: Prefect's runner, failing its goodbye to the gone
    server as it stopped, raised, and serve ended "error: ConnectError: All connection attempts
    failed", exit 1 (a trial). Any other error from the runner is still an error."""
    import httpx
    import prefect

    _, info = stack
    gone = httpx.ConnectError("All connection attempts failed",
                              request=httpx.Request("POST", f"{info.prefect_api_url}/deployments/x/pause_deployment"))
    monkeypatch.setattr("paperline.flows.cli.served_elsewhere", lambda names: None)  # a module's serve may have polled

    def runner_raising(error):
        def serve(*deployments, **kwargs):
            assert len(deployments) == 5
            raise error
        return serve

    monkeypatch.setattr(prefect, "serve", runner_raising(gone))
    result = stack_cli("serve")
    text = " ".join(result.output.split())
    assert result.exit_code == 0, text
    assert (f"stopped serving; its Prefect server at {info.prefect_ui_url} is not answering (ConnectError: All "
            "connection attempts failed): `paperline status` shows what is down") in text
    assert "their runs execute here, each on local CPU cluster (" in text  # (where, as `run` says)
    # its pause of a deployment deleted while it served ("error: ObjectNotFound: None", exit 1: a trial)
    from prefect.exceptions import ObjectNotFound

    monkeypatch.setattr(prefect, "serve", runner_raising(ObjectNotFound(None)))
    result = stack_cli("serve")
    text = " ".join(result.output.split())
    assert result.exit_code == 0 and "stopped serving; " in text, text
    assert "had been deleted from the Prefect server meanwhile (the next `paperline serve` makes it again)" in text
    monkeypatch.setattr(prefect, "serve", runner_raising(ValueError("a runner fault")))
    assert_one_line_error(stack_cli("serve"), "ValueError: a runner fault")


def test_serve_polls_on_while_its_prefect_server_is_away_and_says_so_once_each_way(monkeypatch):
    """Prefect's runner stopped serving after three failed polls (~90 s after its server went),
    with a page of tracebacks, though `paperline down` says a serve goes on after the next `up` (a
    trial): a failed poll is said once, the return once, and nothing is raised into Prefect's loop;
    the runner's cancellation observer (dead for good after an outage) finds nothing meanwhile."""
    import asyncio
    import datetime

    import httpx
    from prefect._internal.observers import FlowRunCancellingObserver
    from prefect.runner._scheduled_run_poller import ScheduledRunPoller

    from paperline.flows import cli

    request = httpx.Request("GET", "http://127.0.0.1:4200/api/x")
    unavailable = httpx.HTTPStatusError("503", request=request, response=httpx.Response(503, request=request))
    outcomes = [httpx.ReadTimeout("timed out"), None,  # one failed poll alone: a hiccup, nothing said
                httpx.ConnectError("All connection attempts failed"), unavailable, "check", None, None]

    async def poll(self, *args, **kwargs):
        if (outcome := outcomes.pop(0)) == "check":  # while the server is away: the observer finds nothing
            await FlowRunCancellingObserver._check_for_cancelled_flow_runs(None)
        elif outcome is not None:
            raise outcome

    async def check(self):
        raise httpx.ConnectError("refused")

    monkeypatch.setattr(ScheduledRunPoller, "_get_and_submit_flow_runs", poll)
    monkeypatch.setattr(FlowRunCancellingObserver, "_check_for_cancelled_flow_runs", check)
    said: list[str] = []
    monkeypatch.setattr(cli, "_say", said.append)
    back: list = []  # the lost runs' check, once the server is back, given when the outage began
    before = datetime.datetime.now(datetime.timezone.utc)
    with cli._serving_through_outages("http://127.0.0.1:4200", back.append):
        for _ in range(2):
            asyncio.run(ScheduledRunPoller._get_and_submit_flow_runs(None))
        assert said == [] and back == []
        before = datetime.datetime.now(datetime.timezone.utc)
        for _ in range(5):
            asyncio.run(ScheduledRunPoller._get_and_submit_flow_runs(None))
        with pytest.raises(httpx.ConnectError):  # not away: Prefect's own loop counts it
            asyncio.run(FlowRunCancellingObserver._check_for_cancelled_flow_runs(None))
        with pytest.raises(ValueError):  # (not an outage: Prefect's loop sees it)
            outcomes.append(ValueError("a bug"))
            asyncio.run(ScheduledRunPoller._get_and_submit_flow_runs(None))
    assert len(back) == 1 and before <= back[0] <= datetime.datetime.now(datetime.timezone.utc)
    assert len(said) == 2, said
    assert said[0].startswith("the Prefect server at http://127.0.0.1:4200 is not answering (HTTPStatusError: 503); "
                              "serving waits for it")
    assert said[1].startswith("the Prefect server at http://127.0.0.1:4200 answers again after 0 s: serving goes on")
    assert ScheduledRunPoller._get_and_submit_flow_runs is poll  # (Prefect's own again once serve stops)
    assert FlowRunCancellingObserver._check_for_cancelled_flow_runs is check


def test_prefects_service_loop_ends_after_three_failed_polls_but_not_under_serve(monkeypatch):
    """What the patch above is for, on Prefect's own loop (``critical_service_loop``, which its
    runner polls with): three connection errors in a row end it; under serve it polls on."""
    import asyncio

    import httpx
    from prefect.runner._scheduled_run_poller import ScheduledRunPoller
    from prefect.utilities.services import critical_service_loop

    from paperline.flows import cli

    polls: list[int] = []

    async def refused(self, *args, **kwargs):
        polls.append(1)
        raise httpx.ConnectError("All connection attempts failed")

    async def loop(seconds: float) -> bool:
        """Whether the loop was still polling after ``seconds``."""
        task = asyncio.ensure_future(critical_service_loop(
            workload=lambda: ScheduledRunPoller._get_and_submit_flow_runs(None), interval=0.01,
            printer=lambda *a: None))
        done, _ = await asyncio.wait([task], timeout=seconds)
        task.cancel()
        return not done

    monkeypatch.setattr(ScheduledRunPoller, "_get_and_submit_flow_runs", refused)
    monkeypatch.setattr(cli, "_say", lambda line: None)
    assert asyncio.run(loop(2.0)) is False and len(polls) == 3
    with cli._serving_through_outages("http://127.0.0.1:4200"):
        assert asyncio.run(loop(0.5)) is True and len(polls) > 10


def test_a_serves_stop_is_said_as_a_stop_without_an_asyncio_traceback():
    """Prefect's runner ends on its last call (pausing its deployments) when its server is gone:
    asyncio's "unhandled exception during asyncio.run() shutdown" ERROR is dropped for that; and a
    SIGTERM is not said as a KeyboardInterrupt."""
    import logging

    import httpx

    from paperline.flows.cli import _no_shutdown_connect_error

    def record(exc: BaseException, name: str = "asyncio") -> logging.LogRecord:
        return logging.LogRecord(name, logging.ERROR, __file__, 1, "unhandled exception during asyncio.run() "
                                 "shutdown\ntask: <Task finished name='Task-63' coro=<Runner.start() done>>", None,
                                 (type(exc), exc, None))

    from paperline.flows.cli import _stop_not_keyboard

    stop = logging.LogRecord("prefect.flows", logging.INFO, __file__, 1, "Received %s, shutting down...",
                             ("KeyboardInterrupt",), None)
    assert _stop_not_keyboard(stop) and stop.getMessage() == "Stopping (Ctrl-C or SIGTERM): shutting down..."
    other = logging.LogRecord("prefect.flows", logging.INFO, __file__, 1, "Received SystemExit, shutting down...",
                              (), None)
    assert _stop_not_keyboard(other) and other.getMessage() == "Received SystemExit, shutting down..."
    assert not _no_shutdown_connect_error(record(httpx.ConnectError("All connection attempts failed")))
    assert _no_shutdown_connect_error(record(ValueError("a fault")))
    assert _no_shutdown_connect_error(record(httpx.ConnectError("x"), name="prefect.runner"))


def test_every_pipeline_flow_reads_its_parameters_in_its_own_module():
    """Each pipeline flow's function runs under the server watch (``infra/pipeline_flow.py``); the
    wrapper made Prefect read the flow's text annotations in the wrong module, and every deployment
    run failed with "`NasModel` is not fully defined" (seen while building it). Prefect's version
    hash is still the pipeline's own file's."""
    from prefect.utilities.hashing import file_hash

    from paperline.flows.pipelines import builtin_pipeline_names, get_pipeline

    for name in builtin_pipeline_names():
        flow = get_pipeline(name).flow
        params = flow.validate_parameters({"params": {}})["params"]
        assert type(params).__name__.endswith("Parameters") and type(params).__module__ == flow.fn.__module__
        assert flow.with_options(name="x").validate_parameters({"params": {}})["params"] == params
        assert flow.version == file_hash(sys.modules[flow.fn.__module__].__file__)
        assert flow.fn._paperline_watched and flow.fn.__wrapped__.__name__ == flow.fn.__name__


def test_a_deployment_runs_parameters_refused_by_their_model_name_the_field_and_value():
    """Values that pass Prefect's JSON schema but not the model's validators (a deployment run's
    ``memory_budget: "lots"``) failed as the run started with Prefect's raw pydantic list and a
    ParameterTypeError traceback in the serve log (a trial): an InputError naming the field and
    the value, as `--set` says it, for every pipeline."""
    from paperline.flows.pipelines import get_pipeline
    from paperline.infra.errors import InputError

    cases = {"gemm": ({"memory_budget": "lots"}, "memory_budget='lots': expected bytes"),
             "video-curation": ({"dataset": "../evil"}, "dataset='../evil': "),
             "tensor-factorization": ({"data": "s3://bucket/prefix/"}, "data='s3://bucket/prefix/': an S3 prefix"),
             "nas": ({"budget": 0}, "budget=0: "),
             "compressed-training": ({"fft_theta": 2.0}, "fft_theta=2.0: ")}
    for name, (given, said) in cases.items():
        flow = get_pipeline(name).flow
        with pytest.raises(InputError) as caught:
            flow.validate_parameters({"params": given})
        assert str(caught.value).startswith(said), (name, str(caught.value))
    assert get_pipeline("gemm").flow.validate_parameters({"params": {"m": 64}})["params"].m == 64
    # ... and a model instance changed after it was built, from Python: a trial's `params.m = True`
    # multiplied one row, verified; built anew, as it is now, with the fields it was given and its
    # private state kept (gemm's "given" fields; tensor-factorization's data warnings)
    flow, model = get_pipeline("gemm").flow, get_pipeline("gemm").parameters
    params = model(m=64, n=32)
    params.m = True
    with pytest.raises(InputError, match=r"^m=True: expected a number, not a boolean"):
        flow.validate_parameters({"params": params})
    changed = model(m=64).model_copy(update={"routine": "SYRK", "tile": 0})
    with pytest.raises(InputError, match=r"^tile=0: Input should be greater than 0"):
        flow.validate_parameters({"params": changed})
    params = model(m=64)
    params.routine = "SYRK"
    checked = flow.validate_parameters({"params": params})["params"]
    assert (checked.routine, checked.m, checked.model_fields_set) == ("syrk", 64, {"m", "routine"})
    tensor = get_pipeline("tensor-factorization").parameters(rank=3)
    tensor._data_warnings.append("a warning")
    checked = get_pipeline("tensor-factorization").flow.validate_parameters({"params": tensor})["params"]
    assert checked._data_warnings == ["a warning"] and checked.model_fields_set == {"rank"}


def test_a_pipeline_flows_function_runs_under_a_server_watch(monkeypatch, tmp_path):
    """What the engine calls (``flow.fn``: `paperline run`, a deployment's run, a script) is
    watched, once, and the watch ends with it outside a process started for one run."""
    from paperline.infra import watch
    from paperline.infra.pipeline_flow import pipeline_flow

    seen: list[int] = []

    @pipeline_flow(name="watched")
    def watched(x: int = 1) -> int:
        seen.append(len(watch._ACTIVE))
        return x + 1

    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(tmp_path / "state"))
    for name in ("PAPERLINE_S3_ENDPOINT_URL", "PAPERLINE_PREFECT_API_URL", "PAPERLINE_MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    get_settings.cache_clear()
    try:
        assert watched.fn(2) == 3 and seen == [1] and watch._ACTIVE == []
        assert watched.with_options(name="again").fn(x=4) == 5 and seen == [1, 1]
    finally:
        get_settings.cache_clear()


def test_paperline_worker_starts_its_prefect_worker_again_after_an_outage(monkeypatch):
    """Prefect's worker gives up after ~7 minutes of failed polls (its backoff), and `paperline
    worker` ended "exited with status 1" though `down` says it takes runs again after the next
    `up`: an exit while its server does not answer waits for the server, then starts it again."""
    import itertools
    import os
    import signal

    from paperline.flows import cli

    said: list[str] = []
    monkeypatch.setattr(cli, "_say", said.append)
    problems = iter(["GET /health failed: ConnectError: refused"] * 3 + [None])
    monkeypatch.setattr("paperline.infra.stack.prefect_problem", lambda url: next(problems))
    exits = iter([(1, False), (0, True)])
    started: list[list[str]] = []

    def supervise(cmd, **kwargs):
        started.append(cmd)
        return next(exits)

    monkeypatch.setattr(cli, "_supervise", supervise)
    monkeypatch.setattr(cli, "WORKER_WAIT_POLL_S", 0.01)
    assert cli._worker_through_outages(["prefect", "worker"], env={}, cwd=".", api_url="http://127.0.0.1:1/api") is None
    assert len(started) == 2
    assert said[0] == ("the Prefect worker stopped: its Prefect server at http://127.0.0.1:1/api is not answering (GET "
                       "/health failed: ConnectError: refused); it starts again when the server answers (`paperline "
                       "up`; Ctrl-C stops waiting)")
    assert said[1].startswith("the Prefect server answers again after 0 s: starting the Prefect worker again")

    # a failure with the server answering is the worker's own: its status is returned, not retried
    monkeypatch.setattr("paperline.infra.stack.prefect_problem", lambda url: None)
    exits = iter([(1, False)])
    said.clear()
    assert cli._worker_through_outages(["prefect", "worker"], env={}, cwd=".", api_url="http://127.0.0.1:1/api") == 1
    assert said == []

    # SIGTERM while waiting stops `paperline worker` (its handler restored after)
    exits = itertools.repeat((1, False))
    before = signal.getsignal(signal.SIGTERM)
    checks: list[int] = []

    def away_then_sigterm(url):  # the second check is inside the wait, its handler installed
        checks.append(1)
        if len(checks) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return "GET /health failed"

    monkeypatch.setattr("paperline.infra.stack.prefect_problem", away_then_sigterm)
    assert cli._worker_through_outages(["prefect", "worker"], env={}, cwd=".", api_url="http://127.0.0.1:1/api") is None
    assert signal.getsignal(signal.SIGTERM) is before


def test_the_runs_an_outage_lost_are_those_not_executing(monkeypatch):
    """Once serve's Prefect server is back: runs whose process ended meanwhile go to
    crash_lost_runs, and the claimed ones with no process (excluding those) to crash_unstarted_runs,
    only if claimed before the outage began (a run stuck "Submitting" held its deployment's slot)."""
    import datetime

    from paperline.flows import cli
    from paperline.infra import flow_runs

    calls: dict[str, tuple] = {}
    monkeypatch.setattr(flow_runs, "flow_run_processes", lambda pid: {"running": 11})
    monkeypatch.setattr(flow_runs, "crash_lost_runs", lambda seen, who, **kw: calls.update(lost=(seen, who, kw)))
    monkeypatch.setattr(flow_runs, "crash_unstarted_runs", lambda names, who, **kw: calls.update(unstarted=(names, kw)))
    began = datetime.datetime(2026, 12, 5, tzinfo=datetime.timezone.utc)
    cli._crash_runs_lost_in_outage({"running": 11, "ended": 12}, ["gemm/local"], began)
    seen, who, kw = calls["lost"]
    assert seen == {"ended": 12} and who == "paperline serve" and kw["wait_s"] == 0.0
    assert kw["why"] == "its process ended while the Prefect server was away"
    names, kw = calls["unstarted"]
    assert names == ["gemm/local"] and kw["executing"] == {"running", "ended"} and kw["before"] is began
    assert "mlflow" not in calls  # (no tracking URI given)
    # and the MLflow runs of those that ended, on a thread of their own, tried again while Prefect
    # may not yet have marked them (a trial's stayed RUNNING until `paperline compare`)
    import threading

    from paperline.infra import tracking

    ended = threading.Event()
    monkeypatch.setattr(tracking, "end_runs_of_ended_flow_runs",
                        lambda ids, uri, **kw: (calls.update(mlflow=(ids, uri, kw["waits_s"])), ended.set()))
    cli._crash_runs_lost_in_outage({"running": 11, "ended": 12}, ["gemm/local"], began, "http://127.0.0.1:1")
    assert ended.wait(30) and calls["mlflow"] == (["ended"], "http://127.0.0.1:1", (0.0, 30.0, 60.0))


def test_trigger_refuses_bad_parameters_before_anything_starts(tmp_path):
    """`paperline trigger` checks --set and --preset as `run` does, before the stack (and so before
    a flow run exists)."""
    env = {"PAPERLINE_STATE_DIR": str(tmp_path / "state")}
    for args, fragments in ((["trigger", "gemm", "--set", "nope=1"], ["--set='nope': unknown parameter"]),
                            (["trigger", "gemm", "--set", "m"], ["--set='m': expected key=value"]),
                            (["trigger", "nas", "--preset", "x"], ["--preset='x': unknown preset"]),
                            (["trigger"], ["name a pipeline: paperline trigger PIPELINE, one of"]),
                            (["trigger", "gemmm"], ["pipeline='gemmm'", "did you mean gemm?"]),
                            # JSON has no NaN: Prefect sent it as null (a review)
                            (["trigger", "gemm", "--set", "alpha=NaN"], ["alpha=NaN: not a finite number"]),
                            # the full name trigger prints is taken too (a ValueError of Prefect's: a trial)
                            (["trigger", "gemm", "--deployment", "nas/local"],
                             ["--deployment='nas/local': a deployment of flow 'nas', not of 'gemm'; give NAME or gemm/NAME"]),
                            (["trigger", "gemm", "--deployment", ""], ["--deployment='': empty; give local or gemm"]),
                            # no stack: said, not started (it started a whole one to say "no deployment": a trial)
                            (["trigger", "gemm"], ["no running stack or configured endpoints; `paperline up`"])):
        assert_one_line_error(run_cli(*args, env=env), *fragments)
    assert not (tmp_path / "state").exists()


def test_trigger_sends_relative_local_paths_as_absolute_ones(tmp_path, monkeypatch):
    """`trigger gemm --set a=a.npy` passed the check made here and failed the run, which starts in
    its serve's or worker's own directory (a trial): each parameter naming a local path relative to
    this directory is sent absolute; S3 URIs, absolute paths and names that are not paths are not."""
    import numpy as np

    from paperline.flows.cli import _absolute_paths
    from paperline.flows.pipelines import build_parameters, get_pipeline

    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ops").mkdir()
    np.save(tmp_path / "ops" / "A.npy", np.ones((4, 3)))
    np.save(tmp_path / "B.npy", np.ones((3, 2)))
    gemm = get_pipeline("gemm")
    params = build_parameters(gemm, "demo", ["a=ops/A.npy", f"b={tmp_path / 'B.npy'}", "output=out/C.npy"])
    assert _absolute_paths(params) == {"a": str(tmp_path / "ops" / "A.npy"), "output": str(tmp_path / "out" / "C.npy")}
    s3 = build_parameters(gemm, "demo", ["a=s3://paperline-data/A.npy", "b=random", "output=s3://paperline-results/C"])
    assert _absolute_paths(s3) == {}
    video = get_pipeline("video-curation")
    assert _absolute_paths(build_parameters(video, "demo", [])) == {}  # "demo" names the bundled videos
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.mp4").write_bytes(b"not checked here")
    assert _absolute_paths(build_parameters(video, "demo", ["source=clips"])) == {"source": str(tmp_path / "clips")}


def test_serve_lists_each_schedule_on_its_one_line():
    """serve's "serving N deployments: ..." line: an rrule's DTSTART line broke it in two (a trial);
    a schedule in another timezone is named with it and said to differ from the pipeline's."""
    from types import SimpleNamespace

    from prefect.client.schemas.schedules import CronSchedule, RRuleSchedule

    from paperline.flows.cli import _schedules_said

    rrule = RRuleSchedule(rrule="DTSTART:20200101T000000\nFREQ=WEEKLY;BYDAY=MO", timezone="Europe/Berlin")
    said = _schedules_said([SimpleNamespace(schedule=rrule, active=True)], "30 3 * * *")
    assert "\n" not in said and said.startswith("DTSTART:20200101T000000 FREQ=WEEKLY;BYDAY=MO Europe/Berlin; "), said
    berlin = CronSchedule(cron="30 3 * * *", timezone="Europe/Berlin")
    assert _schedules_said([SimpleNamespace(schedule=berlin, active=False)], "30 3 * * *") == (
        "30 3 * * * Europe/Berlin, schedule paused; as set on the Prefect server (the pipeline's: 30 3 * * *)")
    assert _schedules_said([], None) == "no schedule"
