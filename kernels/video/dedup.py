"""De-duplication of clips ([NeMoVideo2025]_ Sec. 2.4; SemDeDup, Abbas et al. 2023):

1. **exact**: identical decoded content (SHA-256 of the clip's analysis frames);
2. **near**: perceptual hashes (DCT pHash of the first, middle and last frame, via ``imagehash``)
   within ``phash_max_distance`` bits at all three positions;
3. **semantic**: k-means (scikit-learn) on the L2-normalised clip embeddings, then inside each
   cluster, a clip whose cosine similarity to an already kept clip is >= ``semantic_threshold``
   is a duplicate of it.

Within each group the representative is the longest clip (ties: the smaller key), so the result is
deterministic and independent of input order. A clip's reason is the stage that dropped it: an
exact duplicate is ``exact`` whatever the later stages did with its twin.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from paperline.kernels.errors import InputError


_FIELDS = ("key", "duration_s", "content_sha256", "phash", "embedding")


def _check_rows(rows: list[dict[str, Any]]) -> None:
    """Refuse rows :func:`deduplicate` would misread: a bare string as ``phash`` was read one hex
    digit per hash (so nearly every clip was a "near duplicate"), a NaN duration changed which
    clip was kept, a NaN embedding failed deep in scikit-learn."""
    seen: set[str] = set()
    n_hashes = None
    for i, r in enumerate(rows):
        missing = [f for f in _FIELDS if f not in r]
        if missing:
            raise InputError(f"rows[{i}]", sorted(r)[:8], f"missing {', '.join(missing)}")
        key = r["key"]
        if not isinstance(key, str) or key in seen:
            raise InputError(f"rows[{i}].key", key, "must be a string, unique among the rows")
        seen.add(key)
        d = r["duration_s"]
        if isinstance(d, bool) or not isinstance(d, (int, float, np.number)) or not math.isfinite(d) or d < 0:
            raise InputError(f"rows[{i}].duration_s", d, "must be a finite number of seconds >= 0")
        ph = r["phash"]
        if isinstance(ph, (str, bytes)) or not isinstance(ph, (list, tuple)) or not ph or not all(
                isinstance(h, str) and 0 < len(h) <= 16 and all(c in "0123456789abcdefABCDEF" for c in h) for h in ph):
            raise InputError(f"rows[{i}].phash", ph, "must be a list of 64-bit hashes as hex strings (one per "
                                                     "sampled frame), e.g. ['c3a1...', ...]")
        if n_hashes is not None and len(ph) != n_hashes:
            raise InputError(f"rows[{i}].phash", ph, f"has {len(ph)} hashes, the rows before it {n_hashes}")
        n_hashes = len(ph)
        try:
            emb = np.asarray(r["embedding"], dtype=np.float64)
        except (TypeError, ValueError):
            raise InputError(f"rows[{i}].embedding", r["embedding"], "must be a list of numbers") from None
        if emb.ndim != 1 or emb.size == 0 or not np.isfinite(emb).all():
            raise InputError(f"rows[{i}].embedding", r["embedding"], "must be a non-empty list of finite numbers")


def _phash_bits(rows: list[dict[str, Any]]) -> np.ndarray:
    return np.array([[int(h, 16) for h in r["phash"]] for r in rows], dtype=np.uint64).reshape(len(rows), -1)


def _popcount(x: np.ndarray) -> np.ndarray:
    return np.unpackbits(x.view(np.uint8), axis=-1).reshape(*x.shape, 64).sum(-1)


def deduplicate(rows: list[dict[str, Any]], *, phash_max_distance: int = 4, semantic_threshold: float = 0.98,
                n_clusters: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Mark duplicates among clips.

    Args:
        rows: Clips, each with ``key``, ``duration_s``, ``content_sha256``, ``phash`` (hex strings,
            same count per row) and ``embedding`` (floats, same length per row).
        phash_max_distance: Largest Hamming distance (bits of 64) of a near duplicate; -1 disables.
        semantic_threshold: Cosine similarity at or above which two clips of a cluster are
            duplicates; > 1 disables.
        n_clusters: k-means clusters (default ``ceil(sqrt(n / 2))``, capped at n).
        seed: k-means seed.

    Returns:
        New dicts, sorted by key, each with ``dedup_cluster`` (int; -1 for a clip dropped before
        clustering, as an exact or near duplicate), ``duplicate_of`` (key or None) and
        ``dedup_reason`` (``exact``/``near``/``semantic``/None: the stage that dropped the clip).
        ``duplicate_of`` is always a clip that is kept (its own ``dedup_reason`` None): a clip
        whose match was itself dropped by a later stage (an exact duplicate of a clip that is a
        semantic duplicate) points to the clip that stands for both, and keeps its own reason
        (``exact``: its twin, with the same ``content_sha256``, is among the dropped clips).

    Raises:
        InputError: thresholds, ``n_clusters`` or ``seed`` out of range or of the wrong type; a row
            missing a field, with a duplicate key, a negative or non-finite duration, ``phash``
            not a list of hex strings (or of another length than the other rows'), or an
            embedding that is empty, non-finite or of another size than the other rows'.
    """
    if phash_max_distance > 64:
        raise InputError("phash_max_distance", phash_max_distance, "must be <= 64 bits (-1 disables)")
    if not semantic_threshold > 0:
        raise InputError("semantic_threshold", semantic_threshold, "must be > 0 (> 1 disables)")
    if isinstance(phash_max_distance, bool) or not isinstance(phash_max_distance, (int, np.integer)) \
            or phash_max_distance < -1:
        raise InputError("phash_max_distance", phash_max_distance, "must be a whole number of bits, 0-64 (-1 disables)")
    if not isinstance(semantic_threshold, (int, float, np.number)) or isinstance(semantic_threshold, bool) \
            or math.isnan(semantic_threshold):
        raise InputError("semantic_threshold", semantic_threshold, "must be a number > 0 (> 1 disables)")
    for name, v, low in (("n_clusters", n_clusters, 1), ("seed", seed, 0)):
        if v is None and name == "n_clusters":
            continue
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
            raise InputError(name, v, f"must be a whole number >= {low}")
    _check_rows(rows)
    out = [dict(r, dedup_cluster=-1, duplicate_of=None, dedup_reason=None) for r in sorted(rows, key=lambda r: r["key"])]
    if not out:
        return out
    order = sorted(range(len(out)), key=lambda i: (-out[i]["duration_s"], out[i]["key"]))

    # 1. exact
    first: dict[str, int] = {}
    for i in order:
        sha = out[i]["content_sha256"]
        if sha in first:
            out[i].update(duplicate_of=out[first[sha]]["key"], dedup_reason="exact")
        else:
            first[sha] = i
    # 2. near (perceptual hash)
    if phash_max_distance >= 0:
        bits = _phash_bits(out)
        kept: list[int] = []
        for i in order:
            if out[i]["dedup_reason"]:
                continue
            if kept:
                dist = _popcount(bits[kept] ^ bits[i]).max(axis=1)
                j = int(np.argmin(dist))
                if dist[j] <= phash_max_distance:
                    out[i].update(duplicate_of=out[kept[j]]["key"], dedup_reason="near")
                    continue
            kept.append(i)
    # 3. semantic (k-means + cosine within clusters)
    alive = [i for i in order if not out[i]["dedup_reason"]]
    dims = {len(out[i]["embedding"]) for i in alive}
    if len(dims) > 1:
        raise InputError("embedding", sorted(dims), "clips have embeddings of different sizes")
    if alive:
        emb = np.array([out[i]["embedding"] for i in alive], dtype=np.float64)
        emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
        k = min(len(alive), n_clusters or max(1, math.ceil(math.sqrt(len(alive) / 2))))
        if k > 1:
            from sklearn.cluster import KMeans  # noqa: PLC0415

            labels = KMeans(n_clusters=k, n_init=4, random_state=seed).fit_predict(emb)
        else:
            labels = np.zeros(len(alive), dtype=int)
        kept_in: dict[int, list[int]] = {}
        for pos, i in enumerate(alive):  # alive is in preference order
            c = int(labels[pos])
            out[i]["dedup_cluster"] = c
            members = kept_in.setdefault(c, [])
            if members and semantic_threshold <= 1:
                sims = emb[members] @ emb[pos]
                j = int(np.argmax(sims))
                if sims[j] >= semantic_threshold:
                    out[i].update(duplicate_of=out[alive[members[j]]]["key"], dedup_reason="semantic")
                    continue
            members.append(pos)
    # a duplicate_of pointing at a clip a later stage dropped left readers at a clip not in the
    # dataset (a trial): follow to the kept one (a chain is at most exact -> near -> semantic).
    # The reason stays the stage that dropped the clip: taking the loosest on the way called the
    # clips of two byte-identical videos "semantic" duplicates, with no cluster, once semantic
    # dedup was on (a trial)
    by_key = {r["key"]: r for r in out}
    for r in out:
        while r["duplicate_of"] is not None and by_key[r["duplicate_of"]]["duplicate_of"] is not None:
            r["duplicate_of"] = by_key[r["duplicate_of"]]["duplicate_of"]
    return out
