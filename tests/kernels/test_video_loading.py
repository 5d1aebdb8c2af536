"""Training from the curated shards: the samples a rank's DataLoader workers read, shuffled per
epoch before the rank split, each exactly once, each shard opened at most once per worker (a
fresh-user trial: every loader worker read everything, and ranks got contiguous runs of key order,
so with 3 ranks each saw two of six videos)."""

import hashlib
import io
import json
import itertools
import subprocess
import sys
from collections import Counter

import pytest

from paperline.kernels.errors import InputError
from paperline.kernels.video.shards import iter_samples, plan_shards, read_plan, rank_indices, write_dataset

OUTPUT = "s3://bucket/ds"


class MemoryStore:
    """The store calls write_dataset and iter_samples make, on a dict; counts open_stream calls."""

    def __init__(self):
        self.objects: dict[str, bytes] = {}
        self.opened: list[str] = []

    def head(self, uri):
        data = self.objects.get(uri)
        return None if data is None else {"ContentLength": len(data), "Metadata": {}}

    def put_bytes_to(self, data, uri, *, if_absent=False):
        if if_absent and self.objects.get(uri, bytes(data)) != bytes(data):
            raise FileExistsError(uri)
        self.objects[uri] = bytes(data)

    def get_bytes(self, uri):
        return self.objects[uri]

    def exists(self, uri):
        return uri in self.objects

    def list(self, prefix):
        return sorted(u for u in self.objects if u.startswith(prefix))

    def delete(self, uri):
        self.objects.pop(uri, None)

    def open_stream(self, uri):
        self.opened.append(uri.rsplit("/", 1)[1])
        return io.BytesIO(self.objects[uri])


def _dataset(videos=6, clips=3, target=1000):
    """``videos`` x ``clips`` samples in shards of about ``target`` bytes (uneven: 2 or 3 clips)."""
    data = {f"v{v}-{v:010x}-{c:06d}": bytes([v * clips + c]) * (300 + 60 * ((v + c) % 3))
            for v in range(videos) for c in range(clips)}
    rows = {k: {"key": k, "mp4_sha256": hashlib.sha256(b).hexdigest(), "mp4_size_bytes": len(b)}
            for k, b in data.items()}
    store = MemoryStore()
    manifest = write_dataset(store, OUTPUT, plan_shards(list(rows.values()), target), rows,
                             lambda r: data[r["key"]], {}, {})
    return store, manifest["shards"], data


def test_a_commit_never_replaces_another_writers():
    """The manifest is created only where none is: a writer that lost its lease during a long
    shard upload is refused at its commit, and the other run's manifest stays as it was."""
    data = {f"v{v}-{v:010x}-000000": bytes([v]) * 400 for v in range(4)}
    rows = {k: {"key": k, "mp4_sha256": hashlib.sha256(b).hexdigest(), "mp4_size_bytes": len(b)}
            for k, b in data.items()}
    plans = plan_shards(list(rows.values()), 1000)
    store = MemoryStore()
    theirs = b'{"shards": [{"name": "shard-000000.tar", "keys": ["another-run"]}]}'

    def another_run_commits():  # (the lease check before the commit: the other run's commit lands then)
        if store.list(f"{OUTPUT}/index") and f"{OUTPUT}/manifest.json" not in store.objects:
            store.objects[f"{OUTPUT}/manifest.json"] = theirs

    with pytest.raises(InputError, match=r"^output=.*another run committed a dataset here while this one wrote"):
        write_dataset(store, OUTPUT, plans, rows, lambda r: data[r["key"]], {"index.parquet": b"i"}, {},
                      check_lease=another_run_commits)
    assert store.objects[f"{OUTPUT}/manifest.json"] == theirs
    # the same plan committed by the other run (the same shards): taken as committed, not an error
    store = MemoryStore()
    done = write_dataset(store, OUTPUT, plans, rows, lambda r: data[r["key"]], {"index.parquet": b"i"}, {})
    theirs = store.objects.pop(f"{OUTPUT}/manifest.json").replace(b'"meta": {}', b'"meta": {"run": "B"}')
    again = write_dataset(store, OUTPUT, plans, rows, lambda r: data[r["key"]], {"index.parquet": b"i"}, {},
                          check_lease=another_run_commits)
    assert again["committed_earlier"] and again["committed_meanwhile"] and again["meta"] == {"run": "B"}
    assert again["shards"] == done["shards"]
    # ... but this run's index, written after that commit, replaced the one it records: said
    store.objects.pop(f"{OUTPUT}/manifest.json")
    theirs = json.dumps({**json.loads(theirs), "objects": {"index.parquet": {"sha256": "0" * 64}}}).encode()
    with pytest.raises(InputError, match=r"this run's index\.parquet then replaced the ones its manifest records"):
        write_dataset(store, OUTPUT, plans, rows, lambda r: data[r["key"]], {"index.parquet": b"i"}, {},
                      check_lease=another_run_commits)


COMBOS = [  # (world_size, num_workers, shuffle_seed, epoch)
    (1, 1, None, 0), (1, 2, None, 0), (3, 2, None, 0), (3, 2, 0, 0), (3, 2, 0, 1), (2, 3, 7, 4),
    (4, 5, 1, 2),  # 18 samples: 5 per rank (2 padded), more workers than the rank's shards
    (1, 40, 3, 0),  # more workers than samples: some read nothing
    (5, 1, 11, 9), (18, 2, 2, 0),
]


@pytest.mark.parametrize("world_size, num_workers, seed, epoch", COMBOS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_and_workers_together_read_every_sample_once(world_size, num_workers, seed, epoch, drop_last):
    _, shards, data = _dataset()
    n = len(data)
    assert len(shards) >= 6
    per_rank = []
    for rank in range(world_size):
        got = []
        for worker in range(num_workers):
            plan = read_plan(shards, rank, world_size, drop_last, shuffle_seed=seed, epoch=epoch, worker=worker,
                             num_workers=num_workers)
            names = [s["name"] for s, _ in plan]
            assert len(names) == len(set(names))  # each shard read at most once by a worker
            assert all(keys and set(keys) <= set(s["keys"]) for s, keys in plan)
            got += [k for _, keys in plan for k in keys]
        assert len(got) == len(set(got)) == len(rank_indices(n, rank, world_size, drop_last))  # each once
        per_rank.append(got)
    assert len({len(g) for g in per_rank}) == 1  # equal counts per rank
    everything = Counter(itertools.chain.from_iterable(per_rank))
    if drop_last:
        assert sum(everything.values()) == (n // world_size) * world_size and max(everything.values()) == 1
    else:
        assert set(everything) == set(data)  # every sample, the padding repeating as few as it must
        assert sum(everything.values()) - n == -n % world_size


def test_a_seeded_order_spans_the_dataset_and_changes_every_epoch():
    _, shards, _ = _dataset()

    def order(rank, epoch, seed=0):
        return [k for _, keys in read_plan(shards, rank, 3, shuffle_seed=seed, epoch=epoch) for k in keys]

    unshuffled = [k for _, keys in read_plan(shards, 0, 3) for k in keys]
    assert len({k.split("-")[0] for k in unshuffled}) == 2  # key order: two of the six videos
    assert len({k.split("-")[0] for k in order(0, 0)}) > 2  # shuffled: from across the dataset
    assert order(0, 0) == order(0, 0)  # the same seed and epoch on every process
    assert order(0, 0) != order(0, 1) and set(order(0, 0)) != set(order(0, 1))
    assert order(0, 0, seed=1) != order(0, 0, seed=0)
    assert not set(order(0, 5)) & set(order(1, 5))  # the ranks of one epoch share no sample


def test_iter_samples_opens_each_shard_at_most_once_per_rank_worker_and_epoch():
    store, shards, data = _dataset()
    for world_size, num_workers, epoch in ((1, 1, 0), (1, 1, 1), (3, 2, 0), (2, 4, 3), (1, 12, 2)):
        seen = []
        for rank, worker in itertools.product(range(world_size), range(num_workers)):
            store.opened.clear()
            samples = list(iter_samples(store, OUTPUT, rank, world_size, shuffle_seed=5, epoch=epoch,
                                        worker=worker, num_workers=num_workers))
            plan = read_plan(shards, rank, world_size, shuffle_seed=5, epoch=epoch, worker=worker,
                             num_workers=num_workers)
            assert [s["__key__"] for s in samples] == [k for _, keys in plan for k in keys]
            assert store.opened == [s["name"] for s, _ in plan]  # only its shards, each once
            assert all(s["mp4"] == data[s["__key__"]] for s in samples)
            seen += [s["__key__"] for s in samples]
        assert sorted(seen) == sorted(data)
    # unshuffled, the defaults: key order, as before
    assert [s["__key__"] for s in iter_samples(store, OUTPUT)] == sorted(data)


def test_a_shard_split_between_workers_is_read_by_each_of_them_only():
    _, shards, _ = _dataset()
    plans = [read_plan(shards, 0, 1, worker=w, num_workers=4) for w in range(4)]
    # contiguous parts of shard order: a worker reads the shards of its part, neighbours share one
    for a, b in zip(plans, plans[1:]):
        assert set(s["name"] for s, _ in a) & set(s["name"] for s, _ in b) <= {a[-1][0]["name"]}
    assert sum(len(p) for p in plans) <= len(shards) + 3


@pytest.mark.parametrize("option, match", [
    ({"shuffle_seed": -1}, r"^shuffle_seed=-1: must be >= 0"),
    ({"shuffle_seed": 1.5}, r"^shuffle_seed=1.5: must be an integer"),
    ({"epoch": 1.0}, r"^epoch=1.0: must be an integer"),
    ({"epoch": -1}, r"^epoch=-1: must be >= 0"),
    ({"num_workers": 0}, r"^num_workers=0: must be >= 1"),
    ({"num_workers": 2, "worker": 2}, r"^worker=2: must be in \[0, 1\]"),
    ({"worker": "0"}, r"^worker='0': must be an integer"),
])
def test_bad_loading_options_are_refused(option, match):
    _, shards, _ = _dataset()
    with pytest.raises(InputError, match=match):
        read_plan(shards, **option)


def test_the_module_imports_without_torch_and_the_dataset_refuses_bad_input():
    code = ("import sys, paperline.kernels.video.shards as s; "
            "assert 'torch' not in sys.modules, 'torch imported'; print(s.read_plan.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    from paperline.kernels.video.shards import ShardDataset

    for args, kw, match in (((2, 2), {}, r"^rank=2: must be in \[0, 1\]"),
                            ((0, 0), {}, r"^world_size=0: must be >= 1"),
                            ((0, 1), {"shuffle_seed": -3}, r"^shuffle_seed=-3"),
                            ((0, 1), {"drop_last": "no"}, r"^drop_last='no'")):
        with pytest.raises(InputError, match=match):
            ShardDataset(MemoryStore(), OUTPUT, *args, **kw)
    with pytest.raises(InputError, match=r"^epoch='1': must be an integer"):
        ShardDataset(MemoryStore(), OUTPUT).set_epoch("1")
    with pytest.raises(InputError, match=r"^epoch=18446744073709551616: must be in \[0, 9223372036854775807\]"):
        ShardDataset(MemoryStore(), OUTPUT).set_epoch(2**64)  # (the shared 64-bit value read it as 0: a trial)


def test_a_dataloader_with_workers_yields_each_sample_of_the_rank_once_per_epoch():
    import torch.utils.data

    from paperline.kernels.video.shards import ShardDataset

    store, _, data = _dataset()
    orders = []
    for rank in range(2):
        ds = ShardDataset(store, OUTPUT, rank=rank, world_size=2, shuffle_seed=0)
        assert len(ds) == 9
        for epoch in range(2):
            ds.set_epoch(epoch)
            keys = [s["__key__"] for s in torch.utils.data.DataLoader(ds, num_workers=2, batch_size=None)]
            assert len(keys) == len(set(keys)) == 9  # (the trial: 2 workers, every sample twice)
            orders.append((rank, epoch, keys))
    assert set(orders[0][2]) | set(orders[2][2]) == set(data)
    assert orders[0][2] != orders[1][2]  # epochs differ


@pytest.mark.parametrize("world_size", [2, 3, 6])
def test_a_shuffled_epoch_reads_the_dataset_about_once_over_all_ranks(world_size):
    """Permuting the samples before the rank split spread each rank's share over nearly every
    shard: every rank streamed about the whole dataset each epoch (a review). Shuffled shard by
    shard, a rank's share is a run of whole shards, sharing at most its two end shards."""
    _, shards, data = _dataset(videos=12)
    assert len(data) % world_size == 0  # (no padding: every sample once)
    for epoch in range(3):
        opened = [s["name"] for rank in range(world_size)
                  for s, _ in read_plan(shards, rank, world_size, shuffle_seed=4, epoch=epoch)]
        assert len(opened) <= len(shards) + world_size - 1, (len(opened), len(shards))


def test_persistent_workers_follow_set_epoch():
    """With persistent_workers=True every epoch repeated the first one's order (a trial): the
    workers' copies never saw set_epoch. The epoch is now in shared memory: a persistent
    loader gives each epoch the order a fresh one does."""
    import pickle

    import torch.utils.data

    from paperline.kernels.video.shards import ShardDataset

    store, _, _ = _dataset()
    ds = ShardDataset(store, OUTPUT, shuffle_seed=3)
    loader = torch.utils.data.DataLoader(ds, num_workers=1, batch_size=None, persistent_workers=True)
    for epoch in range(3):
        ds.set_epoch(epoch)
        fresh = ShardDataset(store, OUTPUT, shuffle_seed=3)
        fresh.set_epoch(epoch)
        assert [s["__key__"] for s in loader] == [s["__key__"] for s in fresh], epoch
    assert [s["__key__"] for s in fresh] != [s["__key__"] for s in ShardDataset(store, OUTPUT, shuffle_seed=3)]
    # pickled other than to start a process (a Dask worker, a file): the epoch goes, not the memory
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.epoch == 2
    ds.epoch = 7  # (the attribute it was, still assignable)
    assert copy.epoch == 2 and ds.epoch == 7
    old = {k: v for k, v in copy.__dict__.items() if k != "_epoch"}  # pickled before 2026-12-06
    old.update(epoch=4, _epochs_here={4})
    unpickled = ShardDataset.__new__(ShardDataset)
    unpickled.__setstate__(old)
    assert unpickled.epoch == 4 and not hasattr(unpickled, "_epochs_here")
    with pytest.raises(InputError, match=r"^verify='no': must be True or False"):
        ShardDataset(store, OUTPUT, verify="no")
