"""Tasks of the ``video-curation`` pipeline: per-video curation on the workers (cached), shard
writing with the manifest as commit point, read-back, and the contact sheet.

A video's cache key is its content (SHA-256 of a local file, or the S3 ETag and size), the clip and
filter settings, the staging prefix and the sources of the video kernels, plus the task's source:
re-running the flow on the same inputs with the same code decodes nothing again. Kept clips are staged in S3 content-addressed
(``{staging}/{sha256}.mp4``) as soon as each is encoded, so a task result holds only metadata.

The flow takes each source's :func:`source_fingerprint` when it lists the sources, and the task
curates that version or fails with :class:`SourceChangedError`: a file rewritten while its task ran
was decoded half-written, and the "truncated" verdict was cached under the intact file's key, so
the restored file stayed rejected on every later run (a trial).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy

from paperline.infra.errors import PaperlineError
from paperline.infra.storage import ObjectChangedError, ObjectNotFoundError, ObjectStore, split_uri
from paperline.kernels.errors import InputError
from paperline.kernels.video.clips import Clip, ClipConfig, FilterConfig, extract_clips, key_stem
from paperline.kernels.video.probe import Rejected, file_sha256, probe
from paperline.kernels.video.shards import MANIFEST, ShardPlan, iter_samples, write_dataset
from paperline.tasks.retry import HOUR, retry_unless, retry_unless_bad_input
from paperline.tasks.versions import sources_sha256


class SourceChangedError(PaperlineError):
    """A source video was rewritten, replaced or removed while its task curated it: what was decoded
    is not the version the run listed, so nothing of it is kept (and no result is cached)."""


def source_fingerprint(source: str, store: ObjectStore) -> str:
    """The version of ``source`` a run curates: for a local file its inode, size, and modification
    and change times in ns (a write changes them; the content is hashed for the cache key); for an
    S3 object its ETag and size (``"absent"`` when there is none).

    Raises:
        ServiceError: S3 is unreachable or rejects the credentials.
    """
    if source.startswith("s3://"):
        head = store.head(source)
        return "absent" if head is None else f"{head.get('ETag')}:{head.get('ContentLength')}"
    return _file_fingerprint(source)


def _file_fingerprint(source: str) -> str:
    try:
        st = os.stat(source)
    except OSError as exc:  # missing, a link loop, ...: the probe records why
        return f"unreadable:{type(exc).__name__}"
    if not stat.S_ISREG(st.st_mode):  # a FIFO named like a video: never opened (it blocked a run: a trial)
        return "not-a-regular-file"
    return f"file:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def source_fingerprints(sources: list[str], store: ObjectStore, threads: int = 8) -> list[str]:
    """:func:`source_fingerprint` of each source (S3 HEADs in parallel)."""
    if not any(s.startswith("s3://") for s in sources):
        return [source_fingerprint(s, store) for s in sources]
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda s: source_fingerprint(s, store), sources))


def _changed(source: str, now: str) -> SourceChangedError:
    what = "removed" if now in ("absent", "unreadable:FileNotFoundError") else "rewritten or replaced"
    return SourceChangedError(f"{source}: {what} while it was being curated (the run listed another version): "
                              "nothing of it is kept; run again to curate it as it is now")


def _video_key(_ctx: Any, p: dict[str, Any]) -> str:
    src = p["source"]
    listed = p.get("fingerprint")
    if src.startswith("s3://"):  # the task reads exactly this version (If-Match) or fails
        ident = listed or source_fingerprint(src, p["store"])
    else:
        before = _file_fingerprint(src)
        ident = before
        if before.startswith("file:"):
            try:
                ident = file_sha256(src)
            except OSError as exc:
                ident = f"unreadable:{type(exc).__name__}"
            if _file_fingerprint(src) != before or (listed is not None and listed != before):
                ident = f"changed:{uuid.uuid4().hex}"  # the task fails (SourceChangedError): no result is kept
    blob = json.dumps([src, ident, p["clip_cfg"], p["filter_cfg"], p["staging"], sources_sha256("paperline.kernels.video")], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _local_name(source: str) -> str:
    """A file name for an S3 object's download: its own name, unless that is near the file
    system's 255-byte limit (an S3 key's last part may have up to 1024), then :func:`key_stem`
    of it, which gives the clips the same keys."""
    name = Path(split_uri(source)[1]).name
    return name if len(name.encode()) <= 200 else key_stem(name) + Path(name).suffix[:16]


@task(name="video-curate", cache_policy=TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=_video_key), persist_result=True,
      retries=1, retry_condition_fn=retry_unless(InputError, SourceChangedError), task_run_name="curate-{label}",
      timeout_seconds=6 * HOUR)
def curate_video(source: str, clip_cfg: dict[str, Any], filter_cfg: dict[str, Any], store: ObjectStore,
                 staging: str, label: str, fingerprint: str | None = None) -> dict[str, Any]:
    """Probe, split, transcode, filter and embed one video; stage its kept clips in S3.

    Args:
        fingerprint: The version to curate (:func:`source_fingerprint`, taken when the run listed
            its sources); None: the version there now.

    Returns:
        ``{"source", "info", "rejected", "rows", "stats"}``: ``rows`` are the clips' index fields plus
        ``embedding``, ``thumbnail_jpeg`` and ``staged_uri``; ``rejected`` is the reason row or None
        (``no_clips`` for a video that decodes but has no shot of ``min_clip_s``).
        Bad files are recorded, never raised.

    Raises:
        SourceChangedError: the source is not (or no longer) the ``fingerprint`` version.
    """
    expected = fingerprint if fingerprint is not None else source_fingerprint(source, store)
    with tempfile.TemporaryDirectory() as tmp:
        local = source
        if source.startswith("s3://"):
            local = str(Path(tmp) / _local_name(source))
            if expected == "absent":
                raise _changed(source, "absent")
            try:
                store.get_file(source, local, etag=expected.rpartition(":")[0])
            except (ObjectChangedError, ObjectNotFoundError):
                raise _changed(source, source_fingerprint(source, store)) from None
        elif (now := source_fingerprint(source, store)) != expected:
            raise _changed(source, now)
        out = _curate(source, local, clip_cfg, filter_cfg, store, staging)
        # a local file written to while it was decoded: its verdict (e.g. "truncated") is not the file's
        if local == source and (now := source_fingerprint(source, store)) != expected:
            raise _changed(source, now)
    return out


def _curate(source: str, local: str, clip_cfg: dict[str, Any], filter_cfg: dict[str, Any], store: ObjectStore,
            staging: str) -> dict[str, Any]:
    cfg = ClipConfig(**clip_cfg)
    filt = FilterConfig(**filter_cfg)
    info = probe(local)
    if isinstance(info, Rejected):  # (details name the S3 object, not its download's temp file)
        rej = Rejected(source, info.reason, info.detail.replace(local, source))
        return {"source": source, "info": None, "rejected": rej.as_dict(), "rows": [], "stats": video_stats(None)}
    bucket, prefix = split_uri(staging)
    staged: dict[str, str] = {}

    def upload(clip: Clip) -> None:
        if clip.mp4 is not None:
            staged[clip.key] = store.put_bytes(clip.mp4, bucket=bucket, prefix=prefix, suffix=".mp4").uri
            clip.mp4 = None  # uploaded: free the bytes

    result = extract_clips(info, cfg, filt, on_clip=upload)
    info_d = dict(info.as_dict(), source=source)
    if result.rejected is not None:
        rej = Rejected(source, result.rejected.reason, result.rejected.detail.replace(local, source))
        return {"source": source, "info": info_d, "rejected": rej.as_dict(), "rows": [], "stats": video_stats(result)}
    if not result.clips:  # decoded, but no shot was long enough: it was in neither table (a trial)
        detail = (f"{result.short_dropped} shot(s) in {result.video_s:.1f} s of video, each shorter than "
                  f"min_clip_s={cfg.min_clip_s:g} s")
        return {"source": source, "info": info_d, "rejected": Rejected(source, "no_clips", detail).as_dict(),
                "rows": [], "stats": video_stats(result)}
    rows = []
    for c in result.clips:
        row = c.row()
        row.update(source=source, embedding=c.embedding, thumbnail_jpeg=c.thumbnail_jpeg,
                   staged_uri=staged.get(c.key))
        rows.append(row)
    return {"source": source, "info": info_d, "rejected": None, "rows": rows, "stats": video_stats(result)}


def unstaged(store: ObjectStore, results: list[dict[str, Any]], threads: int = 8) -> list[int]:
    """Indices of ``results`` (:func:`curate_video`'s) holding a kept clip whose staged object is
    gone: the staging prefix was cleaned (by hand or by a lifecycle rule) after the task was
    cached, and the shards could not be written from it (the run failed at write-shards, and so
    did every re-run). Their videos must be curated again (``refresh_cache``).

    Raises:
        ServiceError: S3 is unreachable or rejects the credentials.
    """
    from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415

    checks = [(i, row["staged_uri"]) for i, r in enumerate(results) for row in r["rows"] if row.get("staged_uri")]
    with ThreadPoolExecutor(threads) as pool:  # one HEAD per clip, a few ms each (boto3 pools 10 connections)
        found = list(pool.map(lambda c: store.exists(c[1]), checks))
    return sorted({i for (i, _), ok in zip(checks, found) if not ok})


def video_stats(result: Any) -> dict[str, Any]:
    """A video's decode counts for the flow's report: ``frames_decoded``, ``video_s`` (seconds of
    video), ``shots``, ``short_dropped`` and ``seconds`` (wall seconds of its clip extraction), all zero when
    ``result`` (a :class:`~paperline.kernels.video.clips.VideoResult`) is None.
    """
    if result is None:
        return {"frames_decoded": 0, "video_s": 0.0, "shots": 0, "short_dropped": 0, "seconds": 0.0}
    return {"frames_decoded": result.frames_decoded, "video_s": result.video_s, "shots": result.shots,
            "short_dropped": result.short_dropped, "seconds": result.seconds}


@task(name="video-write-shards", retries=1, retry_condition_fn=retry_unless_bad_input, timeout_seconds=6 * HOUR)
def write_shards(store: ObjectStore, output: str, plans: list[ShardPlan], rows: dict[str, dict[str, Any]],
                 extra: dict[str, bytes], meta: dict[str, Any]) -> dict[str, Any]:
    """Pack the staged clips into tar shards under ``output`` and commit the manifest (see
    :func:`paperline.kernels.video.shards.write_dataset`), holding the dataset's write lease
    (``<output>/.write-lease.json``, :meth:`~paperline.infra.storage.ObjectStore.lease`): a second
    run writing the same dataset waits for the first, then finds it committed (the same plan:
    nothing written; another: refused), instead of rewriting its shards (a trial's two runs both
    reported success, the second having replaced the first's shards and manifest)."""
    from paperline.infra.regression import run_logger  # noqa: PLC0415

    output = output.rstrip("/")

    def waiting(holder: str) -> None:
        run_logger().info("waiting for %s, which is writing %s now", holder, output)

    def taking_over(why: str) -> None:
        run_logger().warning("took over the write lease of %s (%s)", output, why)

    with store.lease(f"{output}/{WRITE_LEASE}", _lease_owner(), on_wait=waiting,
                     on_takeover=taking_over) as still_held:
        # a run that waited for the lease finds what the run before it committed: of other
        # settings whose clips came out the same it said "committed by an earlier run", and of
        # other filters it blamed a changed video (a trial): its inputs are compared first
        manifest = f"{output}/{MANIFEST}"
        if store.exists(manifest):
            committed = json.loads(store.get_bytes(manifest)).get("meta", {})
            if committed.get("inputs_key") not in (None, meta.get("inputs_key")):
                differ = inputs_differ(committed.get("inputs"), meta.get("inputs"))
                raise InputError("output", output, f"another run committed a dataset here, curated from other "
                                                   f"sources or settings{f' ({differ})' if differ else ''}, while "
                                                   "this one curated; a committed dataset is never rewritten: "
                                                   "choose another dataset name")
        return write_dataset(store, output, plans, rows,
                             lambda r: store.get_bytes(r["staged_uri"], sha256=r["mp4_sha256"]), extra, meta,
                             check_lease=still_held)


def inputs_differ(committed: Any, here: dict[str, Any] | None, shown: int = 5) -> str:
    """Which settings and source videos differ between a committed dataset's inputs and this
    run's (both :meth:`paperline.flows.video_curation.VideoCurationParameters.inputs`), in words; "" when either is unknown
    (a dataset committed before 2026-12-06 stores only their digest: a trial could not tell what
    differed)."""
    if not isinstance(committed, dict) or here is None:
        return ""

    absent = object()

    def differ(a: dict[str, Any], b: dict[str, Any], skip: set[str] = frozenset(), suffix: str = "") -> list[str]:
        def said(v: Any) -> str:  # (a setting another paperline version has not: not "null")
            return "absent" if v is absent else _short(v)

        return [f"{k}{suffix}={said(b.get(k, absent))} here, {said(a.get(k, absent))} in it"
                for k in sorted(set(a) | set(b)) if k not in skip and a.get(k, absent) != b.get(k, absent)]

    old_params, params = committed.get("params", {}), here.get("params", {})
    both = set(old_params) | set(params)
    parts = differ(old_params, params)
    # a setting as it ran (the encoder "auto" as libx264 or NVENC, by the machine): where the
    # parameter itself is the same
    old_clip, clip = committed.get("clip_config", {}), here.get("clip_config", {})
    parts += differ({k: v for k, v in old_clip.items() if k not in both},
                    {k: v for k, v in clip.items() if k not in both})
    parts += differ(old_clip, clip, skip={k for k in set(old_clip) | set(clip)
                                          if k not in both or old_params.get(k) != params.get(k)}, suffix=" (as run)")
    if old_params.get("embedder") == params.get("embedder"):
        parts += differ({"embedder": committed.get("embedder")}, {"embedder": here.get("embedder")},
                        suffix=" (as run)")
    more = len(parts) - shown
    parts = parts[:shown] + ([f"{more} more setting(s)"] if more > 0 else [])
    # as multisets: the sources are file names, and a.mp4 in two folders curated, then in one, said
    # nothing of what differed (a trial)
    import collections  # noqa: PLC0415

    mine, theirs = collections.Counter(here.get("sources", [])), collections.Counter(committed.get("sources", []))
    new, gone = sorted((mine - theirs).elements()), sorted((theirs - mine).elements())
    for words, names in (("videos not in it", new), ("its videos not in this run", gone)):
        if names:
            parts.append(f"{words}: {', '.join(names[:shown])}{' ...' if len(names) > shown else ''}")
    return "; ".join(parts)


def _short(value: Any, limit: int = 40) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


WRITE_LEASE = ".write-lease.json"  # beside a dataset's shards while a run writes them


def _lease_owner() -> str:
    """This run in words: its Prefect flow run's name and id, when it has one."""
    from prefect.runtime import flow_run  # noqa: PLC0415

    return f"flow run {flow_run.name} ({flow_run.id})" if flow_run.id else "a run outside Prefect"


@task(name="video-read-back", retries=1, retry_condition_fn=retry_unless_bad_input, timeout_seconds=6 * HOUR)
def read_back(store: ObjectStore, output: str, world_size: int) -> dict[str, Any]:
    """Stream the committed dataset for every rank of ``world_size`` and check it: equal samples
    per rank, every mp4 matching its recorded SHA-256, every key of the manifest seen.

    Raises:
        InputError: a damaged shard (see :func:`~paperline.kernels.video.shards.iter_samples`),
            saying that running the curation again cannot mend it (a trial re-ran it, failing
            here each time): a committed dataset is never rewritten.
    """
    per_rank, seen = [], set()
    try:
        for rank in range(world_size):
            n = 0
            for sample in iter_samples(store, output, rank, world_size):
                seen.add(sample["__key__"])
                n += 1
            per_rank.append(n)
    except InputError as exc:
        if exc.argument != "shard":
            raise
        raise InputError("shard", exc.value, f"{exc.problem} (the dataset at {output} is committed and never "
                                             "rewritten, so running this curation again fails here too: curate "
                                             "under a new dataset name or output)") from None
    return {"samples_per_rank": per_rank, "distinct": len(seen)}


def contact_sheet(items: list[dict[str, Any]], path: Path, columns: int = 6, title: str | None = None) -> Path:
    """A PNG grid of clip thumbnails: kept clips framed green, filtered or duplicate ones red with
    their reason. ``items``: ``{"thumbnail_jpeg", "key", "label", "kept"}``."""
    from PIL import Image  # noqa: PLC0415

    from paperline.tasks.reporting import _plt  # noqa: PLC0415

    plt = _plt()
    n = max(1, len(items))
    rows = -(-n // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(2.2 * columns, 1.6 * rows + 0.4), squeeze=False)
    for ax in axes.ravel():
        ax.axis("off")
    for ax, it in zip(axes.ravel(), items):
        ax.imshow(Image.open(io.BytesIO(it["thumbnail_jpeg"])))
        key = it["key"] if len(it["key"]) <= 26 else f"{it['key'][:13]}~{it['key'][-12:]}"
        ax.set_title(f"{key}\n{it['label']}", fontsize=6, color="green" if it["kept"] else "red")
        for side in ax.spines.values():
            side.set_visible(True)
            side.set_color("green" if it["kept"] else "red")
            side.set_linewidth(3)
        ax.axis("on")
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title or "video-curation: clips kept (green) and dropped by filters or dedup (red)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
