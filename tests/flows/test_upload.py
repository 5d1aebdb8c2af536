"""`paperline upload`: a user's file into the stack's S3 (how README's s3:// operands get there)."""

import os

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
    # a directory: its files under the prefix, relative paths kept (one call per file before: a trial)
    videos = tmp_path / "videos"
    (videos / "day2").mkdir(parents=True)
    (videos / "a.mp4").write_bytes(b"a")
    (videos / "day2" / "b.mp4").write_bytes(b"bb")
    (videos / "link.mp4").symlink_to(path)  # not followed
    (videos / "loop").symlink_to(videos)  # a directory's link: said too (it was skipped silently: a trial)
    os.mkfifo(videos / "fifo.mp4")  # and a FIFO (a later trial)
    res = stack_cli("upload", str(videos), f"s3://{info.data_bucket}/incoming/")
    assert res.exit_code == 0, res.output
    assert "skipping 1 special file(s) (a FIFO, socket or device: not uploaded): fifo.mp4" in \
        " ".join(res.output.split()), res.output
    os.unlink(videos / "fifo.mp4")
    assert store.get_bytes(f"s3://{info.data_bucket}/incoming/a.mp4") == b"a"
    assert store.get_bytes(f"s3://{info.data_bucket}/incoming/day2/b.mp4") == b"bb"
    assert not store.exists(f"s3://{info.data_bucket}/incoming/link.mp4")
    assert "skipping 2 symbolic link(s) (not followed): link.mp4, loop" in res.output
    assert [u for u in store.list(f"s3://{info.data_bucket}/incoming/") if "loop" in u] == []
    # a name that is not UTF-8 (Latin-1) failed the whole upload with a UnicodeEncodeError naming no file (a trial)
    latin = os.fsdecode(os.fsencode(str(videos)) + b"/lat\xe9in.mp4")
    with open(latin, "wb") as f:
        f.write(b"ccc")
    res = stack_cli("upload", str(videos), f"s3://{info.data_bucket}/incoming2/")
    text = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "skipping 1 file(s) whose names are not valid UTF-8" in text and "lat\\xe9in.mp4" in text, text
    assert store.get_bytes(f"s3://{info.data_bucket}/incoming2/a.mp4") == b"a"
    assert [u for u in store.list(f"s3://{info.data_bucket}/incoming2/") if "lat" in u] == []
    res = stack_cli("upload", latin, f"s3://{info.data_bucket}/one/")  # alone: refused, naming it
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and "lat\\\\xe9in.mp4" in text and "not valid UTF-8" in text, text
    res = stack_cli("upload", latin, f"s3://{info.data_bucket}/one/latin.mp4")  # a key of its own: fine
    assert res.exit_code == 0 and store.get_bytes(f"s3://{info.data_bucket}/one/latin.mp4") == b"ccc", res.output
    os.unlink(latin)
    (tmp_path / "empty").mkdir()
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "a.mp4").symlink_to(path)
    (tmp_path / "self.mp4").symlink_to("self.mp4")
    for args, *fragments in (([str(tmp_path / "nope.npy"), f"s3://{info.data_bucket}/x.npy"], "path=", "no such file"),
                             ([str(videos), f"s3://{info.data_bucket}/x.npy"], "uri=", "is a directory: give a prefix"),
                             # it said "no such file or directory" (a trial)
                             ([str(tmp_path / "self.mp4"), f"s3://{info.data_bucket}/x/"], "path=",
                              f"a symbolic link loop ({tmp_path / 'self.mp4'} -> self.mp4)"),
                             ([str(tmp_path / "empty"), f"s3://{info.data_bucket}/x/"], "path=", "with no files"),
                             ([str(tmp_path / "links"), f"s3://{info.data_bucket}/x/"], "path=",
                              "with no files (symbolic links are not followed)"),
                             ([str(path), f"s3://{info.data_bucket}//x/"], "uri=", "expected s3://bucket/key"),
                             ([str(path), "/tmp/B.npy"], "uri='/tmp/B.npy'", "expected s3://bucket/key"),
                             ([str(path), "s3://no-such-bucket-9/B.npy"], "uri=", "no such bucket 'no-such-bucket-9'"),
                             # S3's refusals were raw S3UploadFailedError tracebacks' last line (a trial)
                             ([str(path), f"s3://{info.data_bucket}/t/../y.npy"], "uri=", "a key with . or .. segments"),
                             ([str(path), f"s3://{info.data_bucket}/{'k' * 1100}.npy"], "uri=",
                              "a key of 1104 bytes: S3 takes at most 1024"),
                             # the curation's content-addressed clips (runs refuse it; upload took it: a trial)
                             ([str(videos), f"s3://{info.data_bucket}/video-curation/staging/"], "uri=",
                              "where the video curation's tasks stage the clips they cut")):
        res = stack_cli("upload", *args)
        text = " ".join(res.output.split())
        assert res.exit_code == 1 and "error:" in text and all(f in text for f in fragments), text
    assert not store.exists(f"s3://{info.data_bucket}/x.npy")
    assert not store.exists(f"s3://{info.data_bucket}/video-curation/staging/a.mp4")
