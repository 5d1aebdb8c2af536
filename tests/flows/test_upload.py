"""`paperline upload`: a user's file into the stack's S3 (how README's s3:// operands get there)."""

import numpy as np
import pytest

pytestmark = pytest.mark.stack


def test_upload_puts_the_file_at_the_uri_and_refuses_bad_input(stack_cli, stack, tmp_path):
    from paperline.infra.storage import ObjectStore

    settings, info = stack
    store = ObjectStore.from_stack(info)
    path = tmp_path / "B.npy"
    np.save(path, np.arange(12.0).reshape(3, 4))
    res = stack_cli("upload", str(path), f"s3://{info.data_bucket}/trial/B.npy")
    assert res.exit_code == 0 and f"to s3://{info.data_bucket}/trial/B.npy" in " ".join(res.output.split()), res.output
    assert store.get_bytes(f"s3://{info.data_bucket}/trial/B.npy") == path.read_bytes()
    res = stack_cli("upload", str(path), f"s3://{info.data_bucket}/kept/")  # a prefix keeps the name
    assert res.exit_code == 0 and store.exists(f"s3://{info.data_bucket}/kept/B.npy"), res.output
    for args, *fragments in (([str(tmp_path / "nope.npy"), f"s3://{info.data_bucket}/x.npy"], "path=", "no such file"),
                             ([str(tmp_path), f"s3://{info.data_bucket}/x.npy"], "path=", "not a file"),
                             ([str(path), "/tmp/B.npy"], "uri='/tmp/B.npy'", "expected s3://bucket/key"),
                             ([str(path), "s3://no-such-bucket-9/B.npy"], "uri=", "no such bucket 'no-such-bucket-9'")):
        res = stack_cli("upload", *args)
        text = " ".join(res.output.split())
        assert res.exit_code == 1 and "error:" in text and all(f in text for f in fragments), text
    assert not store.exists(f"s3://{info.data_bucket}/x.npy")
