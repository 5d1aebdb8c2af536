"""Pipelines that other packages add through the ``paperline.pipelines`` entry-point group (README,
"Your own pipeline"): the README's example package, written from the README's own text, found by
its installed metadata, loaded, checked, listed, deployed and run end to end on the session stack;
and the packages whose entry points are broken, named in one line."""

import re
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

README = Path(__file__).resolve().parents[2] / "README.md"


def _readme_example() -> tuple[str, str, dict]:
    """The README's example: the package's ``__init__.py``, its name and its ``pyproject.toml``."""
    section = README.read_text().split("## Your own pipeline", 1)[1].split("\n## ", 1)[0]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    code = re.search(r"```python\n# (\w+)/__init__.py\n(.*?)```", section, re.S)
    return code.group(2), code.group(1), tomllib.loads(toml)


def _install(site: Path, dist: str, version: str, entry_points: dict[str, str],
             modules: dict[str, str] | None = None) -> None:
    """An installed distribution as pip leaves one in site-packages: its modules and a
    ``.dist-info`` whose ``entry_points.txt`` holds the ``paperline.pipelines`` group."""
    for name, code in (modules or {}).items():
        (site / name).mkdir(parents=True, exist_ok=True)
        (site / name / "__init__.py").write_text(code)
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(
        "[paperline.pipelines]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))


def _readme_site(site: Path) -> str:
    """The README's example installed under ``site``; returns the pipeline's name."""
    code, package, pyproject = _readme_example()
    (name, value), = pyproject["project"]["entry-points"]["paperline.pipelines"].items()
    _install(site, pyproject["project"]["name"], pyproject["project"]["version"], {name: value}, {package: code})
    return name


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A directory on ``sys.path`` for installed test distributions; what they registered and
    imported is forgotten afterwards."""
    from paperline.flows import pipelines

    path = tmp_path / "site"
    path.mkdir()
    monkeypatch.syspath_prepend(str(path))
    pipelines._entry_points.cache_clear()
    pipelines._FAILED.clear()
    before = set(pipelines.PIPELINES.names())
    modules = set(sys.modules)
    yield path
    for name in set(pipelines.PIPELINES.names()) - before:
        del pipelines.PIPELINES._items[name]
    for name in set(sys.modules) - modules:
        if getattr(sys.modules[name], "__file__", "") and str(path) in sys.modules[name].__file__:
            del sys.modules[name]
    pipelines._entry_points.cache_clear()
    pipelines._FAILED.clear()


def test_the_readme_example_is_found_loaded_and_checked_as_the_cli_takes_it(site):
    from paperline.flows.pipelines import (build_parameters, builtin_pipeline_names, get_pipeline,
                                           package_of_pipeline, pipeline_names)
    from paperline.infra.errors import InputError

    name = _readme_site(site)
    assert name in pipeline_names() and name not in builtin_pipeline_names()
    assert "paperline_rsvd" not in sys.modules  # listed from metadata alone
    assert package_of_pipeline(name) == "paperline-rsvd 0.1" and package_of_pipeline("gemm") == "paperline"
    spec = get_pipeline(name)
    assert spec.name == name and spec.flow.name == name and spec.cron == "0 6 * * *"
    params = build_parameters(spec, "demo", ["ranks=2,3", "dataset=flights", "mode=1"])
    assert params.ranks == [2, 3] and params.dataset == "flights" and params.mode == 1
    params.validate_inputs()
    with pytest.raises(InputError, match=r"ranks=\[200\]: at most 105, the unfolding's smaller side"):
        build_parameters(spec, "demo", ["ranks=200", "dataset=flights", "mode=1"]).validate_inputs()
    with pytest.raises(InputError, match=r"ranks=\[2, 2\]: list each rank once"):  # (one result row for both: a trial)
        build_parameters(spec, "demo", ["ranks=2,2"]).validate_inputs()
    with pytest.raises(InputError, match=r"power_iterations=true: expected a number, not a boolean"):
        build_parameters(spec, "demo", ["power_iterations=true"])
    with pytest.raises(InputError, match=r"ranks\[0\]=0: .*greater than or equal to 1"):
        build_parameters(spec, "demo", ["ranks=0"])
    with pytest.raises(InputError, match=r"ranks=\[\]: .*at least 1 item"):  # (ran, and logged nothing: a trial)
        build_parameters(spec, "demo", ["ranks=[]"])
    with pytest.raises(InputError, match="dataset='kinetic': 1754 entries missing: an SVD needs them all"):
        build_parameters(spec, "demo", ["dataset=kinetic"]).validate_inputs()  # (LinAlgError in its tasks: a trial)
    # a deployment's run of it gets the same one-line refusal as the built-in pipelines' runs
    with pytest.raises(InputError, match="power_iterations=-1"):
        spec.flow.validate_parameters({"params": {"power_iterations": -1}})


def test_the_readme_examples_kernel_reaches_the_optimal_error(site):
    """HMT's randomized subspace iteration with q = 2 on a matrix with a decaying spectrum is within
    a hair of the Eckart-Young optimum; without power iterations it is measurably worse."""
    _readme_site(site)
    from paperline_rsvd import rsvd_errors

    rng = np.random.default_rng(1)
    u, _ = np.linalg.qr(rng.normal(size=(60, 60)))
    v, _ = np.linalg.qr(rng.normal(size=(90, 60)))
    matrix = (u * 0.7 ** np.arange(60)) @ v.T
    sigma = 0.7 ** np.arange(60)
    for rank in (1, 5, 10):
        optimal = np.sqrt(np.sum(sigma[rank:] ** 2)) / np.sqrt(np.sum(sigma ** 2))
        errors = rsvd_errors.fn(matrix, rank, 2, 5, 0)
        assert errors["optimal_error"] == pytest.approx(optimal, rel=1e-9)
        assert optimal <= errors["rsvd_error"] <= optimal * 1.01
        assert rsvd_errors.fn(matrix, rank, 0, 0, 0)["rsvd_error"] > optimal * 1.05


def test_a_package_pipeline_is_deployed_by_serve_on_its_schedule(site):
    from prefect.deployments.runner import RunnerDeployment

    from paperline.deployments import local_deployments

    name = _readme_site(site)
    _install(site, "broken-pipelines", "2.0", {"missing": "no_such_module:PIPELINE"})  # left out, not fatal
    deployments = local_deployments("paperline-data")
    assert sorted(d.flow_name for d in deployments) == ["compressed-training", "gemm", "nas", name,
                                                         "tensor-factorization", "video-curation"]
    deployment, = [d for d in deployments if d.flow_name == name]
    assert isinstance(deployment, RunnerDeployment) and deployment.name == "local"
    assert deployment.entrypoint == "paperline_rsvd.rsvd" and deployment.tags == ["paperline", name]
    assert deployment.schedules[0].schedule.cron == "0 6 * * *"


BAD_MODULE = '''
from pydantic import BaseModel
from paperline.flows.pipelines import Pipeline
from paperline.infra.pipeline_flow import pipeline_flow


class P(BaseModel):
    x: int = 1


@pipeline_flow(name="noparams")
def no_params(config: P | None = None) -> dict:
    return {}


def flow_named(name):
    @pipeline_flow(name=name)
    def fine(params: P | None = None) -> dict:
        return {}

    return fine


NOT_A_PIPELINE = {"name": "plain"}
MISNAMED = Pipeline("other", flow_named("other"), P, presets={"demo": {}})
NO_PARAMS = Pipeline("noparams", no_params, P, presets={"default": {}, "full": {"x": "many"}})
BAD_PRESET = Pipeline("badpreset", flow_named("badpreset"), P, presets={"demo": {}, "full": {"x": "many"}})
UNKNOWN_KEY = Pipeline("unknownkey", flow_named("unknownkey"), P, presets={"demo": {"bogus": 1, "x": 2}})
NOT_A_FLOW = Pipeline("notaflow", print, dict, presets={"demo": {}})
TAKES_GEMM = Pipeline("takesgemm", flow_named("gemm"), P, presets={"demo": {}})
BAD_CRON = Pipeline("badcron", flow_named("badcron"), P, presets={"demo": {}}, cron="every day")
BAD_DEPLOYMENT = Pipeline("baddeployment", flow_named("baddeployment"), P, presets={"demo": {}},
                          deployment_parameters={"params": {"x": "many"}})
PRESETS_LIST = Pipeline("presetslist", flow_named("presetslist"), P, presets=[("demo", {})])
MARKUP = Pipeline("markup", flow_named("markup"), P, presets={"demo": {}}, description="uses [/tmp] scratch, [rank] k")
'''


def test_broken_entry_points_are_named_with_their_package_and_what_is_wrong(site):
    from paperline.flows.pipelines import get_pipeline, pipeline_names
    from paperline.infra.errors import PaperlineError

    entry_points = {"missing": "no_such_module:PIPELINE", "plain": "bad_pipelines:NOT_A_PIPELINE",
                    "misnamed": "bad_pipelines:MISNAMED", "noparams": "bad_pipelines:NO_PARAMS",
                    "badpreset": "bad_pipelines:BAD_PRESET", "notaflow": "bad_pipelines:NOT_A_FLOW",
                    "unknownkey": "bad_pipelines:UNKNOWN_KEY", "takesgemm": "bad_pipelines:TAKES_GEMM",
                    "badcron": "bad_pipelines:BAD_CRON", "baddeployment": "bad_pipelines:BAD_DEPLOYMENT",
                    "presetslist": "bad_pipelines:PRESETS_LIST"}
    _install(site, "broken-pipelines", "2.0", entry_points, {"bad_pipelines": BAD_MODULE})
    assert set(entry_points) <= set(pipeline_names())
    where = "(paperline.pipelines entry point {!r} of broken-pipelines 2.0)"
    cases = {
        "missing": "could not be loaded: ModuleNotFoundError: No module named 'no_such_module'",
        "plain": "names a dict, not a paperline.flows.pipelines.Pipeline",
        "misnamed": "its name is 'other', not the entry point's 'misnamed'",
        "noparams": "its flow 'noparams' takes no `params` argument (deployments and `paperline run` pass the "
                    "parameters as params); it has no `demo` preset (presets: default, full;",
        "badpreset": "its preset 'full' is not valid for P: x: Input should be a valid integer",
        "notaflow": "its flow is a builtin_function_or_method, not a Prefect flow",
        # (a trial's preset key was dropped unsaid, and a flow named gemm took gemm/local and its schedule over)
        "unknownkey": "its preset 'demo' sets bogus, not parameters of P",
        "takesgemm": "its flow is named 'gemm', not 'takesgemm' (a flow's deployments are <flow name>/local",
        # (what `serve` deploys: a bad cron stopped serving every pipeline, a review)
        "badcron": "its cron 'every day' is not a cron schedule (",
        "baddeployment": "its deployment_parameters are not valid for P: x: Input should be a valid integer",
        "presetslist": "it could not be checked (TypeError: ",
    }
    for name, problem in cases.items():
        with pytest.raises(PaperlineError) as exc:
            get_pipeline(name)
        assert f"pipeline {name!r} {where.format(entry_points[name])}" in str(exc.value), str(exc.value)
        assert problem in str(exc.value), str(exc.value)
        assert str(exc.value).count("; ") == {"noparams": 2, "notaflow": 1}.get(name, 0), str(exc.value)  # those problems alone
    with pytest.raises(PaperlineError, match="not a pydantic model class"):
        get_pipeline("notaflow")


def test_compare_of_a_package_that_cannot_load_says_so_not_to_run_it(site):
    """`compare` of a package's pipeline with no runs advised `paperline run` it, which cannot load."""
    from paperline.flows.compare import _not_run_yet

    _install(site, "broken-pipelines", "2.0", {"missing": "no_such_module:PIPELINE"})
    name = _readme_site(site)
    said = _not_run_yet("missing")
    assert said.startswith(" (the missing pipeline has not run here yet, and it cannot run: ") and \
        "No module named 'no_such_module'" in said and "paperline run" not in said, said
    assert _not_run_yet(name) == f" (the {name} pipeline has not run here yet: run `paperline run {name}` first)"
    assert _not_run_yet("gemm") == " (the gemm pipeline has not run here yet: run `paperline run gemm` first)"


def test_a_package_cannot_take_a_built_in_pipelines_name_and_two_cannot_share_one(site, capsys):
    """A package's ``gemm`` would replace the stack's GEMM pipeline unseen (its deployments, its
    MLflow experiment): it is left out, saying so in one line (Python's warnings printed a path
    and a line of paperline's code with it: a trial); of two packages naming one pipeline the
    first listed is used, said too."""
    from paperline.flows import pipelines

    _install(site, "impostor", "1.0", {"gemm": "impostor:PIPELINE", "mine": "impostor:MINE"},
             {"impostor": "raise RuntimeError('imported')"})
    _install(site, "rival", "2.0", {"mine": "rival:MINE"})
    names = pipelines.pipeline_names()
    pipelines.pipeline_names()  # said once per process
    assert names.count("gemm") == 1 and "mine" in names
    lines = capsys.readouterr().err.splitlines()
    # the first importlib.metadata lists wins (its order is sys.path's, then the directory's)
    first = next(pipelines._package_of(ep) for ep in pipelines._installed_entry_points() if ep.name == "mine")
    assert pipelines.package_of_pipeline("mine") == first
    assert lines == [
        "warning: paperline.pipelines entry point 'gemm' = 'impostor:PIPELINE' of impostor 1.0 is left out: gemm is "
        "a built-in pipeline's name; give it another",
        *[line for line in lines if line.startswith("warning: paperline.pipelines entry point 'mine' is named by ")
          and line.endswith(f": {first}'s is used; uninstall one, or rename its entry point")]], lines
    assert len(lines) == 2, lines
    assert pipelines.get_pipeline("gemm").flow.fn.__module__ == "paperline.flows.gemm"
    assert pipelines.package_of_pipeline("gemm") == "paperline"


def test_params_lists_every_pipeline_and_a_broken_one_as_a_row_and_run_refuses_it_in_one_line(site, tmp_path):
    from paperline.flows.cli import app
    from paperline.infra.settings import get_settings

    name = _readme_site(site)
    _install(site, "broken-pipelines", "2.0", {"missing": "no_such_module:PIPELINE", "markup": "bad_pipelines:MARKUP"},
             {"bad_pipelines": BAD_MODULE})
    env = {"PAPERLINE_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "250"}
    get_settings.cache_clear()
    try:
        listed = CliRunner().invoke(app, ["params"], env=env)
        run = CliRunner().invoke(app, ["run", "missing"], env=env)
        preset_alone = CliRunner().invoke(app, ["params", "--preset", "full"], env=env)
    finally:
        get_settings.cache_clear()
    assert listed.exit_code == 0, listed.output
    rows = {line.split("│")[1].strip(): line for line in listed.output.splitlines() if line.count("│") > 3}
    assert {"gemm", "nas", "video-curation", "compressed-training", "tensor-factorization", name, "missing"} <= set(rows)
    assert "paperline-rsvd 0.1" in rows[name] and "0 6 * * *" in rows[name] and "default, demo" in rows[name]
    assert "paperline " in rows["gemm"] and "30 3 * * *" in rows["gemm"]
    assert "broken-pipelines 2.0" in rows["missing"] and "cannot be loaded" in rows["missing"]
    assert "uses [/tmp] scratch, [rank] k" in rows["markup"]  # as text (a MarkupError: a review)
    assert run.exit_code == 1 and "Traceback" not in run.output
    text = " ".join(run.output.split())
    assert ("error: pipeline 'missing' (paperline.pipelines entry point 'no_such_module:PIPELINE' of broken-pipelines "
            "2.0) could not be loaded: ModuleNotFoundError: No module named 'no_such_module'") in text
    assert preset_alone.exit_code != 0 and "--preset='full': name a pipeline too" in " ".join(preset_alone.output.split())
    assert not (tmp_path / "state").exists()  # nothing started


def test_the_readme_example_runs_on_the_stack_tracked_in_mlflow(stack, cli_env, run_cli, tmp_path):
    """`paperline run rsvd` of an installed package (here: on PYTHONPATH, as the Dask workers get
    it too) runs on the stack's cluster, prints its table and URLs, and its MLflow run in the
    ``rsvd`` experiment holds each rank's errors at its step and the artifact in S3."""
    import json

    from mlflow.tracking import MlflowClient

    _, info = stack
    site = tmp_path / "site"
    name = _readme_site(site)
    env = {**cli_env, "PYTHONPATH": str(site)}
    out = tmp_path / "summary.json"
    result = run_cli(env, "run", name, "--set", "ranks=1,3", "--summary-json", str(out), check=True)
    assert "rsvd: produc mode-0 unfolding (48, 136)" in result.stdout and "randomized SVD error" in result.stdout
    summary = json.loads(out.read_text())
    assert summary["parameters"]["ranks"] == [1, 3]
    assert [row[0] for row in summary["table"]["rows"]] == [1, 3]
    for k in (1, 3):  # q = 2 power iterations on this 48 x 136 matrix: the optimum, to the printed digits
        assert summary["metrics"][f"rank_{k}.rsvd_error"] == pytest.approx(summary["metrics"][f"rank_{k}.optimal_error"],
                                                                            rel=1e-3)
    client = MlflowClient(info.mlflow_tracking_uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["prefect.flow_run_id"] == summary["prefect_flow_run_id"]
    assert client.get_experiment(run.info.experiment_id).name == name
    history = client.get_metric_history(run.info.run_id, "rsvd_error")
    assert sorted(m.step for m in history) == [1, 3]
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["errors.json"]
    assert run.info.artifact_uri.startswith("mlflow-artifacts:") or run.info.artifact_uri.startswith("s3://")
    # its headline, through check_latest: the first run has nothing to compare with, the second the first
    assert run.data.metrics["worst_error_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert "first finished run with these parameters" in result.stdout, result.stdout
    again = run_cli(env, "run", name, "--set", "ranks=1,3", check=True)
    said = " ".join(again.stdout.split())
    assert "no regression against the best of 1 earlier run(s) with these parameters" in said, said
    assert "all 1 metric(s) equal: worst_error_ratio" in said, said
    # ... and `compare` shows it without --metric (the run's headline tag), both runs, best first
    compared = run_cli(env, "compare", name, "--out", str(tmp_path / "compare"), check=True)
    assert "worst_error_" in compared.stdout and compared.stdout.count("FINISHED") == 2, compared.stdout  # (folded)
    assert client.get_run(summary["mlflow_run_id"]).data.tags["paperline.headlines"] == '[["worst_error_ratio", false]]'


def test_a_flow_that_returns_no_summary_dict_is_reported_as_what_it_returned(tmp_path, capsys):
    """A package's flow returning None (or no URLs) failed its finished run's report with a
    TypeError/KeyError: what it returned is said, the URLs it gives are printed."""
    import json
    from types import SimpleNamespace

    from paperline.flows import cli

    spec = SimpleNamespace(name="mine")
    out = tmp_path / "s.json"
    cli._report(spec, {"x": 1}, None, out)
    cli._report(spec, {"x": 1}, {"mlflow_run_url": "http://127.0.0.1:5000/#/runs/abc"}, None)
    text = " ".join(capsys.readouterr().out.split())
    assert "mine's flow returned None, not a summary dict" in text
    assert "MLflow run: http://127.0.0.1:5000/#/runs/abc" in text and "Prefect flow run:" not in text
    assert json.loads(out.read_text())["result"] is None


def test_demo_names_a_broken_package_pipeline_runs_the_others_and_then_fails(site, tmp_path, monkeypatch):
    """One package's broken entry point stopped every demo (`make run`): it is named first, left
    out, and the command fails after the others ran. (What running a demo does is the stack
    tests'; here each run is recorded.)"""
    from paperline.flows import cli
    from paperline.infra.settings import get_settings

    name = _readme_site(site)
    _install(site, "broken-pipelines", "2.0", {"missing": "no_such_module:PIPELINE"})
    ran = []
    monkeypatch.setattr(cli, "_run_one", lambda spec, params, *_: ran.append((spec.name, params)))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli.app, ["demo"], env={"PAPERLINE_STATE_DIR": str(tmp_path / "state"),
                                                            "COLUMNS": "250"})
    finally:
        get_settings.cache_clear()
    text = " ".join(result.output.split())
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert text.index("error: pipeline 'missing'") < text.index("error: demos left out: missing, whose packages'")
    assert "the other pipelines' demos run" in text
    assert [n for n, _ in ran] == ["compressed-training", "gemm", "nas", name, "tensor-factorization", "video-curation"]
    assert dict(ran)[name].ranks == [1, 2, 4]  # its demo preset
    assert text.endswith("`paperline params` lists every pipeline); 6 ran"), text


def test_a_failing_demo_is_said_and_the_others_run(tmp_path, monkeypatch):
    """The first demo that failed ended `paperline demo` (and `make run`): compressed-training,
    first in the list, needs 2 ranks, and on a 1-worker cluster nothing ran at all (a fresh-user
    trial). Each failure is said as it comes, the other demos run, and the command fails naming
    them; a failure of the stack itself (the next demo would meet it too) ends them all at once."""
    from paperline.flows import cli
    from paperline.infra.errors import InputError, ServiceError
    from paperline.infra.settings import get_settings

    ran = []

    def run_one(spec, params, *_):
        ran.append(spec.name)
        if spec.name == "compressed-training":
            raise InputError("world_size", 2, "larger than the number of Dask workers (1)")
        if spec.name == "nas":
            raise RuntimeError("a bug of its own")
        if spec.name == "tensor-factorization" and stack_down:
            raise ServiceError("prefect", "is down")

    monkeypatch.setattr(cli, "_run_one", run_one)
    get_settings.cache_clear()
    try:
        for stack_down in (False, True):
            ran.clear()
            result = CliRunner().invoke(cli.app, ["demo"], env={"PAPERLINE_STATE_DIR": str(tmp_path / "state"),
                                                                "COLUMNS": "250"})
            text = " ".join(result.output.split())
            assert result.exit_code == 1 and "Traceback" not in result.output, result.output
            assert text.index("error: compressed-training demo: world_size=2: larger than the number of Dask workers") \
                < text.index("error: nas demo: RuntimeError: a bug of its own"), text
            if not stack_down:
                assert ran == ["compressed-training", "gemm", "nas", "tensor-factorization", "video-curation"]
                assert text.endswith("error: demos failed: compressed-training, nas (above); 3 ran"), text
            else:
                assert ran == ["compressed-training", "gemm", "nas", "tensor-factorization"]
                assert text.endswith("error: prefect is not available: is down"), text
    finally:
        get_settings.cache_clear()


def test_a_malformed_summary_table_is_a_warning_not_a_failed_command(tmp_path, capsys):
    """A package's table without its columns failed `paperline run` of a finished run with
    "KeyError: 'columns'" and wrote no --summary-json (a trial): a warning, the rest printed."""
    import json
    from types import SimpleNamespace

    from paperline.flows import cli

    out = tmp_path / "s.json"
    cli._report(SimpleNamespace(name="mine"), {}, {"table": {"title": "t", "rows": [[1, 2]]}, "lines": ["done"],
                                                   "mlflow_run_url": "http://127.0.0.1:5000/#/runs/abc"}, out)
    captured = capsys.readouterr()
    assert "warning: mine summary's table could not be shown (KeyError: 'columns')" in " ".join(captured.err.split())
    assert "done" in captured.out and "MLflow run:" in captured.out
    assert json.loads(out.read_text())["table"]["rows"] == [[1, 2]]


def test_a_package_flow_refused_for_its_input_is_one_line_in_a_deployments_log(site):
    """The built-in flows' modules import ``paperline.tasks``, which cuts a refused run's log
    records to one line; a package's flow did not, and a serve logged two tracebacks for its
    InputError (a trial). Importing a package's pipeline installs the same filter."""
    import subprocess

    _readme_site(site)
    code = ("import logging, paperline_rsvd; from paperline.infra.errors import RUN_LOGGERS, ExpectedErrorOneLine; "
            "print(all(any(isinstance(f, ExpectedErrorOneLine) for f in logging.getLogger(n).filters) "
            "for n in RUN_LOGGERS))")
    import os

    env = {k: v for k, v in os.environ.items() if k != "PAPERLINE_DEBUG"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "PYTHONPATH": str(site)})
    assert out.stdout.strip() == "True", out.stdout + out.stderr[-3000:]


def test_a_broken_package_is_imported_once_per_process(site):
    """Each look at a broken package's pipeline imported it again (three times per `serve`, a
    review): its error is kept."""
    from paperline.flows.pipelines import get_pipeline, loadable_pipelines
    from paperline.infra.errors import PaperlineError

    counter = site / "imports"
    _install(site, "slow-broken", "1.0", {"slow": "slow_broken:PIPELINE"}, {"slow_broken": (
        "import pathlib\n"
        f"p = pathlib.Path({str(counter)!r})\n"
        "p.write_text(str(int(p.read_text() if p.exists() else '0') + 1))\n"
        "raise RuntimeError('cannot start')\n")})
    for _ in range(2):
        with pytest.raises(PaperlineError, match="could not be loaded: RuntimeError: cannot start"):
            get_pipeline("slow")
    _, broken = loadable_pipelines(packages_only=True)
    assert list(broken) == ["slow"] and counter.read_text() == "1"
