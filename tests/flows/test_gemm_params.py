"""The gemm flow's parameter checks that need no stack (flows/gemm.py, GemmParameters): what the
routine does not read is refused (c without beta). The CLI's wording of each refusal is in
test_cli.py."""

from __future__ import annotations

import pytest

from paperline.infra.errors import InputError

@pytest.fixture
def params(monkeypatch, tmp_path):
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(tmp_path))
    monkeypatch.setenv("PAPERLINE_N_WORKERS", "2")
    monkeypatch.delenv("PAPERLINE_S3_ENDPOINT_URL", raising=False)
    from paperline.flows.gemm import GemmParameters  # noqa: PLC0415
    from paperline.infra.settings import get_settings  # noqa: PLC0415

    getattr(get_settings, "cache_clear", lambda: None)()
    yield GemmParameters
    getattr(get_settings, "cache_clear", lambda: None)()


def test_c_without_beta_is_refused_where_beta_is_its_only_use(params):
    for routine in ("gemm", "symm"):
        with pytest.raises(InputError, match="reads c only as beta \\* c, and beta is 0: set beta") as e:
            params(routine=routine, c="random").check_used()
        assert e.value.argument == "c" and e.value.value == "random"
    params(routine="gemm", c="random", beta=1.0).check_used()
    # SYRK/SYR2K return C's other triangle, so they read c with beta 0 too
    params(routine="syrk", c="random").check_used()
    params(routine="syr2k", c="random").check_used()
