"""The ranks' rendezvous and checkpoints are not a way in: a two-rank gloo group joined through
:func:`paperline.kernels.train.ddp.process_group` listens on loopback only (torch's own
``tcp://`` rendezvous listens on every interface), and a resume checkpoint whose pickle would run
code is refused, naming the checkpoint, without running it, while every compressor's real
checkpoint still loads with ``weights_only=True`` and resumes."""

import io
import ipaddress
import json
import os
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from paperline.kernels.errors import InputError
from paperline.kernels.train.ddp import TrainConfig, load_checkpoint, parse_init_method, train_rank

CFG = dict(model="resnet", model_options={"width": 4, "blocks": 1}, epochs=1, batch_size=16, max_steps_per_epoch=5)
# every registered compressor with memory where it has one (a NumPy option: the config holds it as given)
COMPRESSORS = {
    "none": {},
    "fp16": {},
    "fft": {"theta": np.float64(0.3), "error_feedback": True},
    "topk": {"fraction": 0.1, "error_feedback": True},
    "powersgd": {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, "min_compression_rate": 0.0},
}
SOURCE = "s3://bucket/prefix/rank-0/epoch-0000.pt"


def _non_loopback_interface() -> str | None:
    """A network interface with a non-loopback IPv4 address (to point gloo at), if any."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback for a in addrs):
            return name
    return None


def _listening(pid: int | None = None) -> list[tuple[str, int]]:
    import psutil

    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN]


# -- workers (subprocesses, see the __main__ block) ------------------------------------------------

def _rendezvous_worker(rank: int, port: int, out: str) -> None:
    """Join through process_group, allreduce, record this process's listening sockets while the
    group is up (both ranks in it: a barrier on each side), and the environment after."""
    import torch.distributed as dist

    from paperline.kernels.train.ddp import process_group

    before = os.environ.get("GLOO_SOCKET_IFNAME")
    with process_group("gloo", f"tcp://127.0.0.1:{port}", rank, 2, timeout_s=60):
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t)
        dist.barrier()
        listening = _listening()
        dist.barrier()
    Path(out, f"rdv{rank}.json").write_text(json.dumps({
        "sum": t.tolist(), "listening": listening, "env_before": before,
        "env_after": os.environ.get("GLOO_SOCKET_IFNAME")}))


def _nccl_worker(rank: int, port: int, out: str) -> None:
    """One NCCL rank on GPU 0, bound to it (eager communicator init): its listening sockets with
    the communicator up (NCCL's bootstrap listens on NCCL_SOCKET_IFNAME's interface)."""
    import torch.distributed as dist

    from paperline.kernels.train.ddp import process_group

    torch.cuda.set_device(0)
    with process_group("nccl", f"tcp://127.0.0.1:{port}", rank, 1, timeout_s=60, device_id=torch.device("cuda", 0)):
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        listening = _listening()
    Path(out, "nccl.json").write_text(json.dumps({"sum": t.tolist(), "listening": listening}))


def _checkpoint_worker(rank: int, ports: str, out: str) -> None:
    """Per compressor: train one epoch (checkpoint kept), then resume from that checkpoint through
    train_rank for a second epoch; the checkpoints and results go to ``out``."""
    import gc

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ports_left = [int(p) for p in ports.split(",")]
    results = {}
    # how many DDP modules are alive as each group is destroyed: a module left for later freed the
    # group with the GIL held, and the rank could hang for good (see train_rank)
    alive_at_destroy, destroy = [], dist.destroy_process_group

    def counting_destroy(*args, **kwargs):
        alive_at_destroy.append(sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()))
        return destroy(*args, **kwargs)

    dist.destroy_process_group = counting_destroy
    for name, options in COMPRESSORS.items():
        saved = {}
        cfg = TrainConfig(**CFG, compressor=name, compressor_options=options)
        first = train_rank(rank, 2, f"tcp://127.0.0.1:{ports_left.pop()}", cfg, threads=1,
                           save_checkpoint=lambda e, b: saved.__setitem__(e, b))
        Path(out, f"{name}-ck{rank}.pt").write_bytes(saved[0])
        cfg2 = TrainConfig(**{**CFG, "epochs": 2}, compressor=name, compressor_options=options)
        resumed = train_rank(rank, 2, f"tcp://127.0.0.1:{ports_left.pop()}", cfg2, threads=1, resume_bytes=saved[0],
                             resume_source=f"s3://b/{name}/rank-{rank}/epoch-0000.pt")
        results[name] = {"first": first["restored_memory_buckets"], "resumed": resumed["restored_memory_buckets"],
                         "epochs": [e["epoch"] for e in resumed["epochs"]],
                         "loss": resumed["epochs"][-1]["train_loss"]}
    Path(out, f"ck{rank}.json").write_text(json.dumps({"compressors": results, "ddp_alive_at_destroy": alive_at_destroy}))


# -- rendezvous ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["env://", "file:///tmp/rdv", "tcp://127.0.0.1", "tcp://:29500",
                                   "tcp://127.0.0.1:0", "tcp://127.0.0.1:70000", "tcp://127.0.0.1:x",
                                   "127.0.0.1:29500", "tcp://127.0.0.1:29500/path", None])
def test_only_a_tcp_host_and_port_rendezvous_is_taken(value):
    with pytest.raises(InputError, match="init_method=.*expected tcp://host:port"):
        parse_init_method(value)


def test_init_methods_parse_to_host_and_port():
    assert parse_init_method("tcp://127.0.0.1:29500") == ("127.0.0.1", 29500)
    assert parse_init_method("tcp://[::1]:29500") == ("::1", 29500)
    assert parse_init_method("tcp://node-3.cluster:1234") == ("node-3.cluster", 1234)


def test_a_bad_init_method_fails_before_anything_listens():
    with pytest.raises(InputError, match="init_method='env://'"):
        train_rank(0, 2, "env://", TrainConfig(**CFG), threads=1)


def test_rank_0_fails_with_oserror_when_its_port_is_taken():
    from paperline.kernels.train.ddp import rendezvous_store

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        with pytest.raises(OSError):
            rendezvous_store(f"tcp://127.0.0.1:{s.getsockname()[1]}", 0, 2, timeout_s=5)


def test_two_gloo_ranks_listen_on_loopback_only_and_allreduce(tmp_path, free_port, run_ranks, monkeypatch):
    """The store (rank 0) and gloo's own listeners (every rank) are on 127.0.0.1. gloo is pointed
    at a non-loopback interface first, if the host has one (as when the host name resolves to a
    LAN address): for a loopback rendezvous process_group overrides that, and restores it after."""
    iface = _non_loopback_interface()
    if iface is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", iface)
    port = free_port()
    run_ranks(__file__, [["--rendezvous", str(r), str(port), str(tmp_path)] for r in range(2)], tmp_path, timeout=120)
    ranks = [json.loads((tmp_path / f"rdv{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["sum"] == [3.0] * 4
        assert r["listening"], "gloo listens for its peers"
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in r["listening"]), r["listening"]
        assert r["env_after"] == r["env_before"] == iface
    assert ("127.0.0.1", port) in [tuple(x) for x in ranks[0]["listening"]]  # the store, bound to the host
    assert port not in [p for _, p in ranks[1]["listening"]]


def _cuda_usable() -> bool:
    from paperline.infra.device import gpu_usable

    return gpu_usable()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_usable(), reason="no usable CUDA device")
def test_an_nccl_rank_listens_on_loopback_only(tmp_path, free_port, run_ranks):
    """NCCL: the store and NCCL's bootstrap sockets on 127.0.0.1 (one rank: one GPU is enough)."""
    port = free_port()
    run_ranks(__file__, [["--nccl", "0", str(port), str(tmp_path)]], tmp_path, timeout=120)
    r = json.loads((tmp_path / "nccl.json").read_text())
    assert r["sum"] == [1.0] * 4
    assert ("127.0.0.1", port) in [tuple(x) for x in r["listening"]]
    assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in r["listening"]), r["listening"]


# -- checkpoints -----------------------------------------------------------------------------------

class _Planted:
    """Unpickling it calls ``open(path, "w")``: creates the file (stands in for ``os.system``)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _planted_checkpoint(path: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"model": _Planted(path), "optimizer": {}, "epoch": 0, "epochs": [], "skipped_steps": []}, buf)
    return buf.getvalue()


def test_a_checkpoint_that_would_run_code_is_refused_naming_it(tmp_path):
    marker = tmp_path / "ran"
    data = _planted_checkpoint(marker)
    with pytest.raises(InputError) as err:
        load_checkpoint(data, SOURCE)
    text = str(err.value)
    assert f"checkpoint='{SOURCE}': refused" in text and "GLOBAL io.open" in text, text
    assert "weights_only" not in text and "set to `False`" not in text, text  # not torch's advice to reload unsafely
    assert not marker.exists()
    torch.load(io.BytesIO(data), weights_only=False)  # the payload is real: a full unpickle runs it
    assert marker.exists()


def test_train_rank_refuses_a_planted_resume_checkpoint_before_joining_the_group(tmp_path, free_port):
    """No peer is started: the refusal comes before the rendezvous (else this would wait for rank 1)."""
    marker = tmp_path / "ran"
    with pytest.raises(InputError, match=f"checkpoint='{SOURCE}': refused"):
        train_rank(0, 2, f"tcp://127.0.0.1:{free_port()}", TrainConfig(**CFG), threads=1,
                   resume_bytes=_planted_checkpoint(marker), resume_source=SOURCE, timeout_s=5)
    assert not marker.exists()


@pytest.mark.parametrize("cut, match", [(0.5, "not a readable torch checkpoint"), (None, "not a training checkpoint")])
def test_truncated_or_foreign_checkpoints_are_refused_naming_them(cut, match):
    buf = io.BytesIO()
    torch.save({"weights": torch.zeros(2)}, buf)
    data = buf.getvalue() if cut is None else buf.getvalue()[: int(cut * len(buf.getvalue()))]
    way_out = "; delete it and the run resumes from the epoch before, which every rank checkpointed"
    with pytest.raises(InputError, match=f"checkpoint='{SOURCE}': {match}.*{way_out}"):
        load_checkpoint(data, SOURCE)


def test_running_out_of_memory_while_loading_is_not_called_a_damaged_checkpoint(monkeypatch):
    """A sound checkpoint loaded onto a full device is no reason to delete it (a review)."""
    buf = io.BytesIO()
    torch.save({"weights": torch.zeros(2)}, buf)

    def full(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch, "load", full)
    with pytest.raises(RuntimeError, match="out of memory"):
        load_checkpoint(buf.getvalue(), SOURCE)


@pytest.mark.parametrize("data, said", [
    (b"hello world\n", r"not a torch checkpoint \(neither a zip archive, as torch.save writes, nor a pickle\): "
                       r"it begins b'hello world\\n'"),  # (a bare KeyError the rank retried 3 times: a trial)
    (b"garbage" * 10, r"not a torch checkpoint .*it begins b'garbagegarbagega'"),  # (said "tampered with": a trial)
    (b"", r"not a readable torch checkpoint: it is empty \(0 bytes\)"),  # (ended "checkpoint: ": a trial)
    (b"PK\x03\x04" + bytes(40), r"not a readable torch checkpoint: "),  # a damaged zip archive
    (b"\x80\x02}q\x00X", r"not a readable torch checkpoint: "),  # a cut pickle
])
def test_a_checkpoint_that_is_no_torch_file_says_so_and_the_way_out(data, said):
    with pytest.raises(InputError, match=f"^checkpoint='{SOURCE}': {said}") as err:
        load_checkpoint(data, SOURCE)
    assert str(err.value).endswith("(or set another checkpoint_prefix to start over)"), str(err.value)
    assert "tampered" not in str(err.value)


def test_every_compressors_checkpoint_loads_weights_only_and_resumes(tmp_path, free_port, run_ranks):
    """Two gloo ranks per compressor: the epoch-0 checkpoint loads with weights_only=True (NumPy
    values of the config made plain at save time) and a run resumed from it restores the
    compressor's memory (error-feedback residuals, PowerSGD's factors) and finishes epoch 1."""
    ports: set[int] = set()
    while len(ports) < 2 * len(COMPRESSORS):
        ports.add(free_port())
    run_ranks(__file__, [["--checkpoints", str(r), ",".join(map(str, sorted(ports))), str(tmp_path)] for r in range(2)],
              tmp_path, timeout=400)
    for r in range(2):
        written = json.loads((tmp_path / f"ck{r}.json").read_text())
        # no DDP module outlived its group (one did: a hang, 1 in ~70 calls under load)
        assert written["ddp_alive_at_destroy"] == [0] * 2 * len(COMPRESSORS), written["ddp_alive_at_destroy"]
        results = written["compressors"]
        for name, options in COMPRESSORS.items():
            ck = load_checkpoint((tmp_path / f"{name}-ck{r}.pt").read_bytes(), name)
            memory = ck["compressor_memory"]
            assert ck["config"]["compressor_options"] == {k: (v.item() if isinstance(v, np.generic) else v)
                                                          for k, v in options.items()}
            res = results[name]
            assert res["first"] == [] and res["epochs"] == [0, 1] and np.isfinite(res["loss"])
            if name in ("fft", "topk"):
                assert memory["residuals"] and res["resumed"] == sorted(memory["residuals"])
            elif name == "powersgd":
                assert memory["p_memory_dict"] and res["resumed"], memory.keys()
            else:
                assert memory == {} and res["resumed"] == []


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] in ("--rendezvous", "--nccl", "--checkpoints"):
    import faulthandler

    # a rank still here after 270 s is stuck (a CI run: rank 0's store waited its 300 s for rank 1,
    # whose log was empty): its threads' stacks go to its log before the others time out
    faulthandler.dump_traceback_later(270)
    if sys.argv[1] in ("--rendezvous", "--nccl"):
        (_rendezvous_worker if sys.argv[1] == "--rendezvous" else _nccl_worker)(int(sys.argv[2]), int(sys.argv[3]),
                                                                                sys.argv[4])
    else:
        _checkpoint_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (gloo threads; see tests/kernels/test_train.py)


_TRAININGS = """
import gc, socket, sys
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from paperline.kernels.comm import compressors
from paperline.kernels.train.ddp import process_group

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def train(options):
    with process_group("gloo", f"tcp://127.0.0.1:{port()}", 0, 1):
        ddp = DDP(torch.nn.Linear(50, 20))
        state, hook = compressors.make_hook("powersgd", **options)
        ddp.register_comm_hook(state, hook)
        for step in range(8):
            ddp.zero_grad(set_to_none=True)
            x = torch.randn(16, 50)
            if step == 4:
                x[0, 0] = float("nan")  # a skipped step: the hook keeps its memory from before it
            ddp(x).square().mean().backward()

for i in range(int(sys.argv[1])):
    train({} if i % 2 else {"use_error_feedback": False, "warm_start": False})
    garbage = [[j] * 3 for j in range(200_000)]  # what the caller does next: allocations, GC passes
    del garbage
print("done", flush=True)
"""


def test_process_groups_left_one_after_another_neither_hang_nor_abort(tmp_path):
    """A process that trained in one process group after another (DDP, a comm hook) hung in
    ``~ProcessGroupGloo`` or aborted ("Resource deadlock avoided") in 2 of 4 loops of 40 against
    the old code, as a pytest worker did in a full run: a GC pass freed a left group while gloo's
    thread still released its last collective. :func:`process_group` now keeps it a few seconds."""
    import subprocess

    script = tmp_path / "trainings.py"
    script.write_text(_TRAININGS)
    try:
        proc = subprocess.run([sys.executable, str(script), "40"], capture_output=True, text=True, timeout=150)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"40 trainings one after another still ran after 150 s (hung): {exc.stderr}")
    assert proc.returncode == 0 and proc.stdout.strip() == "done", (proc.returncode, proc.stderr[-3000:])
