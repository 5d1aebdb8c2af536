"""WebDataset shards ([NeMoVideo2025]_ Sec. 2.5) written so that a reader never sees a partial
dataset, and read back with equal samples per rank, optionally shuffled per epoch and split among
a rank's DataLoader workers (:class:`ShardDataset`, the one part that needs torch).

Layout under the output prefix ``s3://bucket/prefix``::

    shard-000000.tar ...   members <key>.mp4 and <key>.json, in key order
    index.parquet          one row per clip (kept, filtered and duplicates)
    rejected.parquet       one row per rejected input
    manifest.json          written last: the commit point

Clips are assigned to shards deterministically: kept clips sorted by key, packed in order until a
shard reaches ``target_bytes`` (a larger clip gets a shard of its own). Tar members carry fixed
metadata (mtime 0, uid/gid 0, mode 0644), so the same clips give the same shard bytes. A shard
object is uploaded only when no object with its SHA-256 is there already, so re-running never
rewrites a finished shard, and an interrupted run resumes where it stopped. A prefix whose manifest
lists other shards is refused rather than overwritten.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from paperline.kernels.errors import InputError, check_int, check_number

MANIFEST = "manifest.json"
SHARD_PATTERN = "shard-{:06d}.tar"
META_FIELDS = ("key", "source", "source_sha256", "start_s", "end_s", "duration_s", "start_frame", "end_frame",
               "frames", "fps", "width", "height", "motion", "sharpness", "black_fraction", "phash",
               "dedup_cluster", "mp4_sha256")


class NotCommitted(FileNotFoundError):
    """The output prefix has no manifest: the dataset was never committed."""


@dataclass(frozen=True)
class ShardPlan:
    """One shard: its name and member keys (in order), and the bytes of its clips."""

    name: str
    keys: tuple[str, ...]
    clip_bytes: int


def plan_shards(rows: list[dict[str, Any]], target_bytes: int) -> list[ShardPlan]:
    """Assign clips to shards: sorted by key, packed in order up to ``target_bytes`` each.

    Args:
        rows: Kept clips with ``key`` (str) and ``mp4_size_bytes`` (int >= 0).
        target_bytes: Target shard size in bytes (tar overhead excluded), a finite number > 0.

    Raises:
        InputError: ``target_bytes`` not a finite number > 0 (NaN packed everything into one
            shard); a row without a str ``key`` or an integer ``mp4_size_bytes`` >= 0 (named
            ``rows[i]``); duplicate keys.
    """
    check_number("target_bytes", target_bytes, low=0, low_open=True)
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or not isinstance(r.get("key"), str):
            raise InputError(f"rows[{i}]", r if not isinstance(r, dict) else r.get("key"), "needs a str 'key'")
        check_int(f"rows[{i}].mp4_size_bytes", r.get("mp4_size_bytes"), 0, unit="bytes")
    keys = [r["key"] for r in rows]
    if len(set(keys)) != len(keys):
        raise InputError("rows", len(keys), "clip keys must be unique")
    plans: list[ShardPlan] = []
    cur: list[str] = []
    size = 0
    for r in sorted(rows, key=lambda r: r["key"]):
        n = int(r["mp4_size_bytes"])
        if cur and size + n > target_bytes:
            plans.append(ShardPlan(SHARD_PATTERN.format(len(plans)), tuple(cur), size))
            cur, size = [], 0
        cur.append(r["key"])
        size += n
    if cur:
        plans.append(ShardPlan(SHARD_PATTERN.format(len(plans)), tuple(cur), size))
    return plans


def member_metadata(row: dict[str, Any], shard: str) -> dict[str, Any]:
    """The ``<key>.json`` member of a clip: its index fields plus shard and member names."""
    meta = {k: row[k] for k in META_FIELDS if k in row}
    meta.update(shard=shard, member=f"{row['key']}.mp4")
    return meta


def _plain(o: Any) -> Any:
    if hasattr(o, "tolist"):  # NumPy arrays and scalars (rows read back from the Parquet index)
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON-serialisable")


def _member_bytes(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), default=_plain).encode()


def build_shard(members: list[tuple[str, bytes, dict[str, Any]]]) -> bytes:
    """A deterministic tar of ``<key>.mp4`` and ``<key>.json`` members, in the given order.

    Args:
        members: ``(key, mp4 bytes, metadata dict)``; keys must not contain ``.`` or ``/``.

    Raises:
        InputError: a key with ``.`` or ``/`` (WebDataset splits keys at the first dot), or a key
            given twice (both were written: readers saw one sample or two).
    """
    buf = io.BytesIO()
    seen: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for key, mp4, meta in members:
            if not isinstance(key, str) or "." in key or "/" in key or not key:
                raise InputError("key", key, "must be a non-empty str without '.' or '/'")
            if key in seen:
                raise InputError("key", key, "given twice: a shard holds each sample once")
            seen.add(key)
            for name, data in ((f"{key}.mp4", mp4), (f"{key}.json", _member_bytes(meta))):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_dataset(store: Any, output: str, plans: list[ShardPlan], rows: dict[str, dict[str, Any]],
                  read_clip: Callable[[dict[str, Any]], bytes], extra: dict[str, bytes],
                  meta: dict[str, Any], check_lease: Callable[[], None] | None = None) -> dict[str, Any]:
    """Upload shards, then ``extra`` objects (index, rejected table), then the manifest (last).

    Args:
        store: An object store with ``head(uri)``, ``put_bytes_to(data, uri)``, ``get_bytes(uri)``,
            ``exists(uri)``, ``list(prefix)`` and ``delete(uri)``
            (:class:`paperline.infra.storage.ObjectStore`). Shards of an earlier uncommitted
            write to ``output`` that this plan does not name are deleted before the commit.
        output: ``s3://bucket/prefix`` of the dataset.
        plans: From :func:`plan_shards`.
        rows: Clip rows by key (index fields; ``mp4_sha256`` checked against the bytes read).
        read_clip: Returns a kept clip's mp4 bytes.
        extra: Object name -> bytes, written after the shards and before the manifest.
        meta: JSON-serialisable run facts stored in the manifest.
        check_lease: Called before each write to ``output`` (every shard, the sweep of stale
            shards, the extra objects, the manifest); what it raises stops the write there (a
            write lease's check: :meth:`paperline.infra.storage.ObjectStore.lease`).

    Writers of one ``output`` must not overlap (the caller holds a lease): two interleaved writes
    overwrite each other's shards. The manifest is created only where none is (a create-only
    PUT), so a commit never replaces another writer's manifest (one made after this writer's
    lease was lost past its last check, or by a writer that took no lease); a shard upload in
    flight when a lease is lost can still replace a shard of the other's (reading with
    ``verify`` tells).

    Returns:
        The manifest (a dict; each shard lists its members' SHA-256 in ``member_sha256``, in the
        order of ``keys``), with these added (not stored): ``uploaded`` (shard names written
        now), ``skipped`` (already present), ``committed_earlier`` (True when ``output`` already
        held this very plan: then nothing is written, a committed dataset is never rewritten),
        ``kept_committed`` (the ``extra`` objects whose bytes differ from the committed ones) and
        ``clips_differ`` (the keys whose clip bytes differ from the committed ones; None when the
        committed manifest records no member digests, as before 2026-12-05), so the caller can
        say what was kept; ``committed_meanwhile`` (True, with ``committed_earlier``) when another
        writer committed this very plan while this one wrote.

    Raises:
        InputError: the prefix already holds a committed dataset with other shards, another
            writer committed other shards there while this one wrote, or a clip's bytes do not
            match its SHA-256.
    """
    output = output.rstrip("/")
    planned = [{"name": p.name, "keys": list(p.keys)} for p in plans]
    manifest_uri = f"{output}/{MANIFEST}"
    if store.exists(manifest_uri):
        old = json.loads(store.get_bytes(manifest_uri))
        if [{"name": s["name"], "keys": s["keys"]} for s in old["shards"]] == planned:
            committed = old.get("objects", {})
            kept = sorted(n for n, data in extra.items()
                          if committed.get(n, {}).get("sha256") != hashlib.sha256(data).hexdigest())
            # (the same clips, encoded to other bytes by a newer paperline, were "already there" and
            # this run's index described clips the dataset does not hold, unsaid: an upgrade trial)
            digests = {k: d for s in old["shards"] for k, d in zip(s["keys"], s.get("member_sha256") or [])}
            differ = (sorted(k for p in plans for k in p.keys if digests[k] != rows[k]["mp4_sha256"])
                      if len(digests) == sum(len(p.keys) for p in plans) else None)
            return dict(old, uploaded=[], skipped=[s["name"] for s in old["shards"]], committed_earlier=True,
                        kept_committed=kept, clips_differ=differ)
        raise InputError("output", output, f"already holds a committed dataset with other shards{_what_differs(old, plans)}; "
                                           "a committed dataset is never rewritten: choose another dataset name (or "
                                           "output prefix)")
    def held() -> None:
        if check_lease is not None:
            check_lease()

    shards, uploaded, skipped = [], [], []
    for plan in plans:
        members = []
        for key in plan.keys:
            row = rows[key]
            data = read_clip(row)
            if hashlib.sha256(data).hexdigest() != row["mp4_sha256"]:
                raise InputError("clip", key, "staged mp4 does not match its recorded SHA-256")
            members.append((key, data, member_metadata(row, plan.name)))
        tar = build_shard(members)
        sha = hashlib.sha256(tar).hexdigest()
        uri = f"{output}/{plan.name}"
        head = store.head(uri)
        if head is not None and head.get("Metadata", {}).get("sha256") == sha and int(head["ContentLength"]) == len(tar):
            skipped.append(plan.name)
        else:
            held()
            store.put_bytes_to(tar, uri)
            uploaded.append(plan.name)
        shards.append({"name": plan.name, "uri": uri, "sha256": sha, "size_bytes": len(tar), "keys": list(plan.keys),
                       "member_sha256": [rows[k]["mp4_sha256"] for k in plan.keys], "n_samples": len(plan.keys)})
    # shards of an earlier, uncommitted write to this prefix (interrupted, with other inputs or
    # settings) that this plan does not name: a later commit left them beside its own, outside
    # the manifest, where a glob of shard-*.tar read them (a trial)
    names = {p.name for p in plans}
    held()
    for uri in store.list(f"{output}/shard-"):
        name = uri[len(output) + 1:]  # a dataset nested at output/shard-x/ keeps its own shards
        if name not in names and re.fullmatch(r"shard-\d{6}\.tar", name):
            store.delete(uri)
    objects = {}
    held()
    for name, data in extra.items():
        uri = f"{output}/{name}"
        store.put_bytes_to(data, uri)
        objects[name] = {"uri": uri, "sha256": hashlib.sha256(data).hexdigest(), "size_bytes": len(data)}
    manifest = {"version": 1, "format": "webdataset", "prefix": output, "shards": shards, "objects": objects,
                "n_samples": sum(s["n_samples"] for s in shards), "meta": meta}
    json.dumps(manifest)  # fail before committing
    held()
    try:
        # create-only: a commit never replaces another writer's manifest, lease or no lease (a
        # writer whose lease was lost after its last check, or a caller that took none)
        store.put_bytes_to(json.dumps(manifest, sort_keys=True, indent=1).encode(), manifest_uri, if_absent=True)
    except FileExistsError:
        other = json.loads(store.get_bytes(manifest_uri))
        if [(s["name"], s["keys"], s.get("sha256")) for s in other["shards"]] != \
                [(s["name"], s["keys"], s["sha256"]) for s in shards]:
            raise InputError("output", output, "another run committed a dataset here while this one wrote its shards "
                                               "(this run's write lease was lost, or not taken); this run committed "
                                               "nothing. A shard it wrote after the other's commit may have replaced "
                                               "one of the other's: read the dataset with verify=True to check, or "
                                               "write to another dataset name") from None
        # the same shards, committed by the other run meanwhile; this run's extra objects were
        # written after that commit, over the ones it records where they differ
        committed = other.get("objects", {})
        replaced = sorted(n for n, o in objects.items() if committed.get(n, {}).get("sha256") != o["sha256"])
        if replaced:
            raise InputError("output", output, f"another run committed the same shards here while this one wrote "
                                               f"them (this run's write lease was lost, or not taken), and this "
                                               f"run's {', '.join(replaced)} then replaced the ones its manifest "
                                               "records (their SHA-256 now differs from the manifest's; the shards "
                                               "are as committed): write to another dataset name for a consistent "
                                               "dataset") from None
        return dict(other, uploaded=uploaded, skipped=skipped, committed_earlier=True, kept_committed=[],
                    clips_differ=[], committed_meanwhile=True)
    return dict(manifest, uploaded=uploaded, skipped=skipped, committed_earlier=False, kept_committed=[], clips_differ=[])


def _what_differs(old: dict[str, Any], plans: list[ShardPlan]) -> str:
    """Which videos' clips differ between a committed manifest and a plan (clip keys are
    ``<stem>-<10 hex of the video's SHA-256>-<start frame>``): a source changed in place was
    refused only as "other shards" (a trial)."""
    def videos(keys: Any) -> set[str]:
        return {k.rsplit("-", 1)[0] for k in keys if isinstance(k, str) and "-" in k}

    committed = videos(k for s in old.get("shards", []) for k in s.get("keys", []))
    planned = videos(k for p in plans for k in p.keys)
    gone, new = sorted(committed - planned), sorted(planned - committed)
    # a video still there whose clips were all dropped as duplicates of another video with the same
    # content (the same id) was said to be "not in this run" (a trial copied one video over another)
    same = {v.rsplit("-", 1)[-1]: v for v in sorted(planned)}

    def said(v: str) -> str:
        twin = same.get(v.rsplit("-", 1)[-1])
        return f"{v} (the same content as {twin}, whose clips were kept)" if twin and twin != v else v

    parts = []
    if new:
        parts.append(f"videos not in it: {', '.join(new[:5])}{' ...' if len(new) > 5 else ''}")
    if gone:
        parts.append(f"its videos without clips in this run: {', '.join(map(said, gone[:5]))}"
                     f"{' ...' if len(gone) > 5 else ''}")
    if not parts:
        return " (the same videos, cut, filtered or packed into shards otherwise)"
    return f" ({'; '.join(parts)}: a video whose content changed has a new id)"


def dataset_prefix(output: str) -> str:
    """A dataset's prefix as the readers take it: without a trailing ``/``, and without a final
    ``/manifest.json`` (the address `paperline run` prints was refused as "never committed": a
    trial)."""
    output = output.rstrip("/")
    return output[:-len(MANIFEST) - 1] if output.endswith(f"/{MANIFEST}") else output


def read_manifest(store: Any, output: str) -> dict[str, Any]:
    """The committed manifest of the dataset at ``output`` (its prefix, or its manifest's URI).

    Raises:
        NotCommitted: no manifest: no such bucket, nothing under the prefix (no dataset of that
            name), or objects but no manifest (its writer failed before the end, or runs).
    """
    output = dataset_prefix(output)
    uri = f"{output}/{MANIFEST}"
    if not store.exists(uri):
        bucket = output[len("s3://"):].split("/", 1)[0] if output.startswith("s3://") else None
        if bucket and hasattr(store, "bucket_exists") and not store.bucket_exists(bucket):
            # (it read as a write that failed or runs: a trial's typo in the bucket)
            raise NotCommitted(f"{output}: the bucket {bucket!r} does not exist")
        empty = (not store.any_under(f"{output}/")) if hasattr(store, "any_under") else \
            (hasattr(store, "list") and not store.list(f"{output}/"))
        if empty:  # (a misspelt name read as a failed write: a trial)
            raise NotCommitted(f"{output}: no dataset there (nothing under this prefix; a dataset named NAME is at "
                               f"s3://<data bucket>/video-curation/NAME, as `paperline run video-curation` prints)")
        raise NotCommitted(f"{output}: no {MANIFEST}; the dataset was never committed (a failed or running write)")
    return json.loads(store.get_bytes(uri))


def rank_indices(n: int, rank: int, world_size: int, drop_last: bool = False) -> list[int]:
    """Global sample indices of one rank: contiguous, equal counts for every rank.

    ``drop_last=False`` pads by wrapping around to the first samples (as
    ``torch.utils.data.DistributedSampler``); True drops the remainder.

    Raises:
        InputError: ``world_size`` < 1, ``rank`` outside ``[0, world_size)``, no samples, or (with
            ``drop_last``) fewer samples than ranks. Without ``drop_last`` more ranks than samples
            is allowed: every rank gets one sample, repeated.
    """
    n = check_int("n", n, 0)  # a str rank failed in a comparison, a float world size in range() (a trial)
    world_size = check_int("world_size", world_size, 1)
    rank = check_int("rank", rank, 0)
    if rank >= world_size:
        raise InputError("rank", rank, f"must be in [0, {world_size})")
    if type(drop_last).__name__ not in ("bool", "bool_"):  # Python's or NumPy's
        raise InputError("drop_last", drop_last, "must be True or False")
    if n < world_size and (drop_last or n == 0):
        raise InputError("world_size", world_size, f"more ranks than samples ({n})")
    per = n // world_size if drop_last else -(-n // world_size)
    return [(rank * per + j) % n for j in range(per)]


def read_plan(shards: list[dict[str, Any]], rank: int = 0, world_size: int = 1, drop_last: bool = False, *,
              shuffle_seed: int | None = None, epoch: int = 0, worker: int = 0,
              num_workers: int = 1) -> list[tuple[dict[str, Any], list[str]]]:
    """Which samples one rank's loader worker reads, shard by shard, in one epoch.

    The dataset's samples are in manifest order (shards in order, keys in order within each),
    or, when ``shuffle_seed`` is given, in a seeded order of the shards with each shard's samples
    in a seeded order (a generator seeded with ``(shuffle_seed, epoch)``, NumPy's ``default_rng``:
    the same on every rank for the same seed, epoch and NumPy version; WebDataset's shard shuffle
    rather than ``DistributedSampler``'s sample shuffle, which makes every rank read nearly every
    shard); then each rank takes a contiguous, equal slice (:func:`rank_indices`): whole shards,
    at most the two at its ends shared with its neighbours, so an epoch streams the dataset about
    once over all ranks. The rank's samples are grouped by shard (the shards in the order their
    first sample comes) and cut into ``num_workers`` contiguous parts (sizes differing by at most
    one), one per worker: a worker reads only the shards holding its part, and a shard is split
    between at most two neighbouring workers.

    Args:
        shards: The manifest's ``shards`` (dicts with ``name`` and ``keys``).
        rank, world_size, drop_last: See :func:`rank_indices`.
        shuffle_seed: None keeps key order; else an int >= 0.
        epoch: Int >= 0, mixed into the seed (ignored without ``shuffle_seed``).
        worker: This worker's index in ``[0, num_workers)``
            (``torch.utils.data.get_worker_info().id``).
        num_workers: Loader workers sharing the rank's samples, >= 1. With more workers than
            samples some workers get none.

    Returns:
        ``[(shard dict, [key, ...]), ...]`` in reading order; over ``worker`` in
        ``range(num_workers)`` the keys are the rank's samples, each once.

    Raises:
        InputError: bad ``rank``/``world_size``/``drop_last`` (see :func:`rank_indices`), a
            ``shuffle_seed`` or ``epoch`` that is not an int >= 0, ``num_workers`` < 1 or not an
            int, ``worker`` outside ``[0, num_workers)``.
    """
    if shuffle_seed is not None:
        shuffle_seed = check_int("shuffle_seed", shuffle_seed, 0, unit="None for key order")
    epoch = check_int("epoch", epoch, 0)
    num_workers = check_int("num_workers", num_workers, 1, unit="loader worker processes")
    worker = check_int("worker", worker, 0, num_workers - 1)
    if shuffle_seed is None:
        flat = [(i, k) for i, s in enumerate(shards) for k in s["keys"]]
    else:
        import numpy as np  # noqa: PLC0415  (only a shuffled read needs it)

        # the shards in a seeded order, each one's samples in a seeded order, before the rank
        # split: a rank's share is a run of whole shards (at most two shared with its neighbours),
        # so an epoch reads the dataset about once over all ranks. Permuting the samples
        # themselves (DistributedSampler's way) spread each rank's share over nearly every shard:
        # every rank streamed about the whole dataset each epoch (a review)
        rng = np.random.default_rng([shuffle_seed, epoch])
        flat = [(int(i), k) for i in rng.permutation(len(shards))
                for k in [shards[int(i)]["keys"][int(j)] for j in rng.permutation(len(shards[int(i)]["keys"]))]]
    picked = rank_indices(len(flat), rank, world_size, drop_last)
    groups: dict[int, list[str]] = {}  # dicts keep insertion order: shards by their first sample
    for i in picked:
        shard, key = flat[i]
        groups.setdefault(shard, []).append(key)
    grouped = [(shard, key) for shard, keys in groups.items() for key in keys]
    m = len(grouped)
    part = grouped[worker * m // num_workers:(worker + 1) * m // num_workers]
    plan: list[tuple[dict[str, Any], list[str]]] = []
    for shard, key in part:
        if not plan or plan[-1][0] is not shards[shard]:
            plan.append((shards[shard], []))
        plan[-1][1].append(key)
    return plan


def iter_samples(store: Any, output: str, rank: int = 0, world_size: int = 1, drop_last: bool = False,
                 verify: bool = True, *, shuffle_seed: int | None = None, epoch: int = 0, worker: int = 0,
                 num_workers: int = 1) -> Iterator[dict[str, Any]]:
    """Stream a committed dataset's samples for one rank (and one of its loader workers), shard by
    shard: only the shards holding them are read, each at most once, as a stream, and only one
    shard's needed samples are held in memory at a time.

    Shards are read under ``output``, by the names the manifest lists, not at the URIs it
    recorded when written: a dataset copied to another prefix or bucket reads its own shards (it
    read the original's, and failed once that was gone: a trial).

    For training, :class:`ShardDataset` wraps this for ``torch.utils.data.DataLoader``.

    Args:
        store: Object store with ``exists``, ``get_bytes`` and ``open_stream(uri)`` (a readable
            file object).
        output: The dataset's ``s3://`` prefix (or its ``manifest.json``'s URI).
        rank, world_size, drop_last: See :func:`rank_indices`.
        verify: Check each mp4 against the SHA-256 in its metadata, and each shard read against
            the SHA-256 and size the manifest records for it.
        shuffle_seed, epoch, worker, num_workers: Which samples, in which order: see
            :func:`read_plan`. The defaults give the rank's samples in key order.

    Yields:
        ``{"__key__": key, "mp4": bytes, "json": dict}`` in :func:`read_plan`'s order.

    Raises:
        NotCommitted: no manifest. InputError: bad rank, world size, seed, epoch or worker (see
            :func:`read_plan`); a shard that is truncated, not a tar archive, lacks a member the
            manifest lists, or (``verify``) differs from its recorded digest or size; a member
            failing its check (each naming the shard).
    """
    output = dataset_prefix(output)
    manifest = read_manifest(store, output)
    plan = read_plan(manifest["shards"], rank, world_size, drop_last, shuffle_seed=shuffle_seed, epoch=epoch,
                     worker=worker, num_workers=num_workers)
    for shard, keys in plan:
        # one shard's needed samples in memory at a time (released as the next shard is read)
        found = _read_members(store, f"{output}/{shard['name']}", shard, set(keys), verify)
        for key in keys:
            sample = found[key]
            meta = json.loads(sample["json"])
            if verify and hashlib.sha256(sample["mp4"]).hexdigest() != meta.get("mp4_sha256"):
                raise InputError("shard", shard["name"], f"member {key}.mp4 does not match its SHA-256")
            yield {"__key__": key, "mp4": sample["mp4"], "json": meta}
        del found


class _Hashing:
    """A readable stream's bytes counted and hashed as they are read."""

    def __init__(self, body: Any):
        self.body, self.sha, self.size = body, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.body.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def _read_members(store: Any, uri: str, shard: dict[str, Any], keys: set[str], verify: bool) -> dict[str, dict]:
    """The members ``keys`` of one shard, ``{key: {"__key__", "mp4", "json"}}``, read as one
    stream; a damaged shard is an :class:`InputError` naming it (it was tarfile's bare
    ``ReadError``, or a ``KeyError`` of a member: a trial)."""
    name = shard["name"]
    found: dict[str, dict[str, Any]] = {}
    try:
        with store.open_stream(uri) as body:
            stream = _Hashing(body)
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for m in tar:
                    k, _, ext = m.name.partition(".")
                    if k not in keys or not m.isfile():
                        continue
                    f = tar.extractfile(m)
                    found.setdefault(k, {"__key__": k})[ext] = f.read() if f is not None else b""
            stream.drain()
    except (tarfile.TarError, EOFError) as exc:
        raise InputError("shard", name, f"{uri} is truncated or not a tar archive ({exc})") from None
    recorded = shard.get("size_bytes")
    if verify and recorded is not None and stream.size < recorded:
        raise InputError("shard", name, f"{uri} is truncated: {stream.size:,} of the {recorded:,} bytes the manifest "
                                        "records")
    for k in sorted(keys):
        missing = [ext for ext in ("mp4", "json") if ext not in found.get(k, {})]
        if missing:
            raise InputError("shard", name, f"{uri} lacks {', '.join(f'{k}.{e}' for e in missing)}, which the "
                                            "manifest lists in it")
    if verify and shard.get("sha256") and (stream.sha.hexdigest(), stream.size) != (shard["sha256"], recorded):
        raise InputError("shard", name, f"{uri} ({stream.size:,} bytes) differs from the manifest's record of it "
                                        f"({recorded:,} bytes, SHA-256 {shard['sha256'][:12]}...): changed or damaged "
                                        "after the commit")
    return found


def _shard_dataset_class() -> type:
    """:class:`ShardDataset`, built on first use: it subclasses ``torch.utils.data.IterableDataset``
    (the DataLoader tells iterable datasets by that base), and this module imports without torch
    (the curation flow's workers need none)."""
    import multiprocessing  # noqa: PLC0415
    import multiprocessing.context  # noqa: PLC0415
    import pickle  # noqa: PLC0415

    import torch.utils.data  # noqa: PLC0415

    class ShardDataset(torch.utils.data.IterableDataset):
        """One rank's samples of a committed dataset, for ``torch.utils.data.DataLoader``.

        ``DataLoader(ShardDataset(store, output, rank, world_size, shuffle_seed=0),
        num_workers=W, batch_size=None)`` yields each of the rank's samples exactly once per
        epoch: the loader's workers share them (``get_worker_info()``), each reading only the
        shards holding its part, each at most once (:func:`read_plan`). Samples are those of
        :func:`iter_samples` (``{"__key__": str, "mp4": bytes, "json": dict}``); decode them in a
        ``collate_fn`` or a wrapping dataset.

        Call :meth:`set_epoch` before each epoch's iteration, as with ``DistributedSampler``.
        The epoch is kept in shared memory, so it reaches loader workers that outlive an epoch
        (``persistent_workers=True``) as well as those the DataLoader starts each epoch.

        Args:
            store: An object store as for :func:`iter_samples`, picklable (worker processes
                receive a copy; :class:`paperline.infra.storage.ObjectStore` is).
            output: The dataset's ``s3://`` prefix (or its ``manifest.json``'s URI).
            rank, world_size, drop_last: See :func:`rank_indices` (usually
                ``torch.distributed.get_rank()`` and ``get_world_size()``).
            shuffle_seed: None for key order; an int >= 0 for a different order every epoch, the
                same on every rank (they must agree, as for ``DistributedSampler``).
            verify: See :func:`iter_samples`.

        Raises:
            InputError: a ``rank``, ``world_size``, ``shuffle_seed`` or ``drop_last`` of the wrong
                type or out of range (here; a rank beyond the samples when iterating).
        """

        def __init__(self, store: Any, output: str, rank: int = 0, world_size: int = 1,
                     shuffle_seed: int | None = None, drop_last: bool = False, verify: bool = True):
            super().__init__()
            world_size = check_int("world_size", world_size, 1)
            rank = check_int("rank", rank, 0, world_size - 1)
            if shuffle_seed is not None:
                shuffle_seed = check_int("shuffle_seed", shuffle_seed, 0, unit="None for key order")
            if type(drop_last).__name__ not in ("bool", "bool_"):
                raise InputError("drop_last", drop_last, "must be True or False")
            self.store, self.output = store, dataset_prefix(output)
            self.rank, self.world_size = rank, world_size
            if type(verify).__name__ not in ("bool", "bool_"):  # ("no" was taken as True: a trial)
                raise InputError("verify", verify, "must be True or False")
            self.shuffle_seed, self.drop_last, self.verify = shuffle_seed, bool(drop_last), verify
            # in shared memory: a persistent loader worker's copy of the dataset sees set_epoch
            # (a plain attribute kept the first epoch's order for every epoch there: a trial)
            self._epoch = multiprocessing.RawValue("q", 0)
            self._len: int | None = None

        @property
        def epoch(self) -> int:
            """The epoch whose order the next iteration gives (:meth:`set_epoch`; assigning it
            is the same)."""
            return int(self._epoch.value)

        @epoch.setter
        def epoch(self, epoch: int) -> None:
            self.set_epoch(epoch)

        def set_epoch(self, epoch: int) -> None:
            """The epoch whose order the next iteration gives (an int >= 0), in this process and
            in every loader worker holding a copy of this dataset.

            Raises:
                InputError: ``epoch`` not an int in [0, 2**63 - 1].
            """
            self._epoch.value = check_int("epoch", epoch, 0, 2**63 - 1)  # (a 64-bit shared value: 2**64 read as 0: a trial)

        def __getstate__(self) -> dict[str, Any]:
            state = self.__dict__.copy()
            if multiprocessing.context.get_spawning_popen() is None:
                # pickled other than to start a process (to a Dask worker, to disk): shared
                # memory cannot travel, the epoch does
                state["_epoch"] = int(self._epoch.value)
            return state

        def __setstate__(self, state: dict[str, Any]) -> None:
            state.pop("_epochs_here", None)  # (a copy pickled before 2026-12-06 kept a plain ``epoch``)
            state.setdefault("_epoch", state.pop("epoch", 0))
            if isinstance(state["_epoch"], int):
                state["_epoch"] = multiprocessing.RawValue("q", state["_epoch"])
            self.__dict__.update(state)

        def __len__(self) -> int:
            """The rank's samples per epoch (reads the manifest once)."""
            if self._len is None:
                shards = read_manifest(self.store, self.output)["shards"]
                n = sum(len(s["keys"]) for s in shards)
                self._len = len(rank_indices(n, self.rank, self.world_size, self.drop_last))
            return self._len

        def __iter__(self) -> Iterator[dict[str, Any]]:
            info = torch.utils.data.get_worker_info()
            store = self.store
            if info is not None:
                # a forked worker inherits the parent's S3 client and its open connections, which
                # two processes must not share: a pickled copy makes its own
                store = pickle.loads(pickle.dumps(store))
            return iter_samples(store, self.output, self.rank, self.world_size, self.drop_last, self.verify,
                                shuffle_seed=self.shuffle_seed, epoch=self.epoch,
                                worker=info.id if info is not None else 0,
                                num_workers=info.num_workers if info is not None else 1)

    ShardDataset.__module__, ShardDataset.__qualname__ = __name__, "ShardDataset"  # pickled by name
    return ShardDataset


def __getattr__(name: str) -> Any:
    # ShardDataset is made on first access (torch imported then); kept as a module attribute so
    # that pickle finds the very class by name (a DataLoader with the "spawn" start method)
    if name == "ShardDataset":
        cls = globals()["ShardDataset"] = _shard_dataset_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
