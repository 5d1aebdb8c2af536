"""Tasks of the ``video-curation`` pipeline: per-video curation on the workers (cached), shard
writing with the manifest as commit point, read-back, and the contact sheet.

A video's cache key is its content (SHA-256 of a local file, or the S3 ETag and size), the clip and
filter settings, the staging prefix and the sources of the video kernels, plus the task's source:
re-running the flow on the same inputs with the same code decodes nothing again. Kept clips are staged in S3 content-addressed
(``{staging}/{sha256}.mp4``) as soon as each is encoded, so a task result holds only metadata.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy

from paperline.infra.storage import ObjectStore, split_uri
from paperline.kernels.video.clips import Clip, ClipConfig, FilterConfig, extract_clips
from paperline.kernels.video.probe import Rejected, file_sha256, probe
from paperline.kernels.video.shards import ShardPlan, iter_samples, write_dataset
from paperline.tasks.retry import HOUR, retry_unless_bad_input
from paperline.tasks.versions import sources_sha256


def _video_key(_ctx: Any, p: dict[str, Any]) -> str:
    src = p["source"]
    if src.startswith("s3://"):
        head = p["store"].head(src) or {}
        ident = f"{head.get('ETag')}:{head.get('ContentLength')}"
    elif not Path(src).is_file():  # opening a FIFO named like a video blocked the run for good (a trial);
        ident = "not-a-regular-file"  # probe() rejects it, without opening it
    else:
        try:
            ident = file_sha256(src)
        except OSError as exc:
            ident = f"unreadable:{type(exc).__name__}"
    blob = json.dumps([src, ident, p["clip_cfg"], p["filter_cfg"], p["staging"], sources_sha256("paperline.kernels.video")], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


@task(name="video-curate", cache_policy=TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=_video_key), persist_result=True,
      retries=1, retry_condition_fn=retry_unless_bad_input, task_run_name="curate-{label}", timeout_seconds=6 * HOUR)
def curate_video(source: str, clip_cfg: dict[str, Any], filter_cfg: dict[str, Any], store: ObjectStore,
                 staging: str, label: str) -> dict[str, Any]:
    """Probe, split, transcode, filter and embed one video; stage its kept clips in S3.

    Returns:
        ``{"source", "info", "rejected", "rows", "stats"}``: ``rows`` are the clips' index fields plus
        ``embedding``, ``thumbnail_jpeg`` and ``staged_uri``; ``rejected`` is the reason row or None
        (``no_clips`` for a video that decodes but has no shot of ``min_clip_s``).
        Bad files are recorded, never raised.
    """
    cfg = ClipConfig(**clip_cfg)
    filt = FilterConfig(**filter_cfg)
    with tempfile.TemporaryDirectory() as tmp:
        local = source
        if source.startswith("s3://"):
            local = str(Path(tmp) / Path(split_uri(source)[1]).name)
            store.get_file(source, local)
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
    if result is None:
        return {"frames_decoded": 0, "video_s": 0.0, "shots": 0, "short_dropped": 0, "seconds": 0.0}
    return {"frames_decoded": result.frames_decoded, "video_s": result.video_s, "shots": result.shots,
            "short_dropped": result.short_dropped, "seconds": result.seconds}


@task(name="video-write-shards", retries=1, retry_condition_fn=retry_unless_bad_input, timeout_seconds=6 * HOUR)
def write_shards(store: ObjectStore, output: str, plans: list[ShardPlan], rows: dict[str, dict[str, Any]],
                 extra: dict[str, bytes], meta: dict[str, Any]) -> dict[str, Any]:
    """Pack the staged clips into tar shards under ``output`` and commit the manifest (see
    :func:`paperline.kernels.video.shards.write_dataset`)."""
    return write_dataset(store, output, plans, rows, lambda r: store.get_bytes(r["staged_uri"], sha256=r["mp4_sha256"]),
                         extra, meta)


@task(name="video-read-back", retries=1, timeout_seconds=6 * HOUR)
def read_back(store: ObjectStore, output: str, world_size: int) -> dict[str, Any]:
    """Stream the committed dataset for every rank of ``world_size`` and check it: equal samples
    per rank, every mp4 matching its recorded SHA-256, every key of the manifest seen."""
    per_rank, seen = [], set()
    for rank in range(world_size):
        n = 0
        for sample in iter_samples(store, output, rank, world_size):
            seen.add(sample["__key__"])
            n += 1
        per_rank.append(n)
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
