"""The design card's layout rules that code can check."""

import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_kernels_import_no_runtime():
    forbidden = {"prefect", "mlflow", "boto3", "botocore"}
    for path in (ROOT / "kernels").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top not in forbidden, f"{path.relative_to(ROOT)} imports {name}"
                assert not name.startswith(("paperline.flows", "paperline.tasks", "paperline.infra")), \
                    f"{path.relative_to(ROOT)} imports {name}"


def test_prefect_yaml_entrypoints_are_flows():
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    names = set()
    for dep in spec["deployments"]:
        path, _, func = dep["entrypoint"].partition(":")
        flow = load_flow_from_entrypoint(f"{ROOT / path}:{func}")
        names.add(flow.name)
    from paperline.flows.pipelines import builtin_pipeline_names

    assert names == set(builtin_pipeline_names())


def test_prefect_yaml_schedules_and_parameters_are_serves():
    """`prefect deploy --all` and `paperline serve` deploy the same pipelines on the same UTC
    schedules with the same parameters (they had drifted: video-curation at 01:00 against 02:00,
    serve's without the incoming/ source, nas resuming its finished campaign every week)."""
    from paperline.flows.pipelines import builtin_pipeline_names, get_pipeline

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    by_flow = {}
    for dep in spec["deployments"]:
        path, _, func = dep["entrypoint"].partition(":")
        by_flow[func.replace("_", "-")] = dep
    assert sorted(by_flow) == builtin_pipeline_names()
    for name, dep in by_flow.items():
        p = get_pipeline(name)
        assert [(s["cron"], s["timezone"]) for s in dep["schedules"]] == [(p.cron, "UTC")], name
        assert (dep.get("parameters") or {}) == p.deployment_params("paperline-data"), name
        assert dep["concurrency_limit"] == 1


def test_readme_names_each_flows_own_parameter_model():
    """The README's `nas(CampaignParameters(...))` failed as written (the flow takes NasParameters,
    which adds `live`): every `flow(Model(...))` it shows is the flow's own parameter type."""
    import importlib
    import re
    import typing

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    calls = re.findall(r"`(\w+)\((\w+Parameters)\(\.\.\.\)\)`", readme)
    assert {flow for flow, _ in calls} >= {"gemm", "nas"}, calls
    for flow_name, model_name in calls:
        module = importlib.import_module(f"paperline.flows.{flow_name}")
        flow = getattr(module, flow_name)
        hint = typing.get_type_hints(flow.fn)["params"]
        assert getattr(module, model_name) in typing.get_args(hint), (flow_name, model_name, hint)
