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
    from paperline.flows.pipelines import pipeline_names

    assert names == set(pipeline_names())
