"""The benchmarks refuse bad arguments with argparse's one line (exit status 2) before measuring
anything; a fresh-user trial met tracebacks (``--sizes abc``, ``--repeats 0``, ``--device cuda``
without a GPU) and a silently defaulted ``--tile 0``. The measurements themselves are not run here
(minutes each; README, "The benchmarks")."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def refuse(script, *args):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(("args", "message"), [
    (["--sizes", "abc"], "argument --sizes: 'abc' is not a whole number"),
    (["--sizes", "4096,,"], "argument --sizes: '' is not a whole number"),
    (["--sizes", "-5"], "argument --sizes: '-5': at least 16"),
    (["--sizes", "3"], "argument --sizes: '3': at least 16"),  # (a tile of 0, refused as a --tile never given: a trial)
    (["--dtypes", "float16"], "argument --dtypes: 'float16': expected float32 and/or float64"),
    (["--tile", "0"], "argument --tile: '0': at least 1"),
    (["--repeats", "0"], "argument --repeats: '0': at least 1"),
    (["--workers", "0"], "argument --workers: '0': at least 1"),
    # measured every size, then died at the out-of-core step (a trial)
    (["--sizes", "512", "--tile", "256"], "--tile=256: too large for the out-of-core measurement at n=512: its budget, "
                                          "a quarter of the operands' bytes (1048576 per worker), holds 6 tiles of at "
                                          "most 147x147 float64; use --tile 147 or less (or a larger size)"),
])
def test_gemm_benchmark_bad_arguments(args, message):
    assert refuse("gemm.py", *args) == f"gemm.py: error: {message}"


def test_gemm_benchmark_refuses_a_size_that_cannot_fit_before_the_cluster_starts():
    """`--sizes 100000 --dtypes float64` started the cluster, then ended in a traceback
    (_ArrayMemoryError: Unable to allocate 74.5 GiB: a trial). 10^6 fits no machine's memory."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gemm.py"), "--sizes", "1000000", "--dtypes",
                           "float64"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout == ""  # neither NumPy's BLAS line nor "cluster: ..." came before
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("gemm.py: error: --sizes=1000000: n=1000000 float64 needs about 21.83 TiB of memory "
                           "(numpy.matmul's A, B and product"), line
    assert line.endswith(" available; lower --sizes"), line


def _benchmark(monkeypatch, name):
    """The benchmark script ``name`` (``gemm``), loaded under a name of its own (a bare import could
    get a flow module of that name: see the video test below)."""
    import importlib.util

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # its `_args`
    spec = importlib.util.spec_from_file_location(f"paperline_benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gemm_benchmark(monkeypatch):
    return _benchmark(monkeypatch, "gemm")


def test_a_benchmark_killed_with_sigterm_removes_its_temporary_files_and_processes(monkeypatch, tmp_path, capsys):
    """A gemm run stopped by `kill` (or `timeout`) left 385 MB of operand files in TMPDIR, a
    compressed_training run its two ranks training, and a Ctrl-C ended in a KeyboardInterrupt
    traceback (trials)."""
    import signal
    import tempfile
    import time

    import psutil

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from _args import interruptible

    made = []
    previous = signal.getsignal(signal.SIGTERM)

    started = []

    def main():
        with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
            made.append(tmp)
            (Path(tmp) / "a.npy").write_bytes(b"operand")
            # a rank and its own child, as the benchmarks start them (they went on training: a trial)
            started.append(subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen("
                                             "[sys.executable, '-c', 'import time; time.sleep(300)']); time.sleep(300)"]))
            while len(psutil.Process(started[0].pid).children()) < 1:
                time.sleep(0.01)
            started.extend(psutil.Process(started[0].pid).children())
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pthread_kill(signal.pthread_self(), 0)  # (the handler runs before this returns)
            return 0

    # a process started before (here as the session stack's servers are, by this pytest) is left alone (a review)
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        assert interruptible(main) == 128 + signal.SIGTERM
        assert server.poll() is None
    finally:
        server.kill()
        server.wait()
    assert made and not os.path.exists(made[0])
    started[0].wait(timeout=10)  # (reaped: no zombie left behind to test)
    assert not psutil.pid_exists(started[1].pid) or psutil.Process(started[1].pid).status() == psutil.STATUS_ZOMBIE
    assert capsys.readouterr().err == "interrupted: the run stopped\n"
    assert signal.getsignal(signal.SIGTERM) == previous  # restored

    def ctrl_c():
        raise KeyboardInterrupt

    assert interruptible(ctrl_c) == 130 and interruptible(lambda: None) == 0 and interruptible(lambda: 1) == 1


def test_an_interrupted_dask_benchmark_does_not_log_asyncio_tracebacks(monkeypatch):
    """tensor_factorization's Ctrl-C printed Dask's "Task exception was never retrieved ... AllExit"
    tracebacks (asyncio's log) before the one line (a trial); the clean path leaves the log alone."""
    import logging

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from _args import quiet_dask_close

    log = logging.getLogger("asyncio")
    monkeypatch.setattr(log, "level", logging.NOTSET)
    with quiet_dask_close():
        pass
    assert log.level == logging.NOTSET
    with pytest.raises(KeyboardInterrupt), quiet_dask_close():
        raise KeyboardInterrupt
    assert log.level == logging.CRITICAL


def test_compressed_training_benchmark_says_which_targets_fft_meets(monkeypatch):
    """Its rows were printed without issue 5's targets (a trial)."""
    bench = _benchmark(monkeypatch, "compressed_training")

    def row(name, accuracy, nbytes, codec_s):
        return {"name": name, "result": {"epochs": [{"test_accuracy_pct": accuracy, "bytes_sent_per_step": nbytes,
                                                      "compress_s": codec_s, "decompress_s": codec_s, "step_s": 1.0}]}}

    rows = [row("none", 93.6, 78824, 0.01), row("fft", 92.5, 5269, 0.04)]
    assert bench.target_lines(rows) == ["at least 10x fewer bytes per step than none: 15.0x: met",
                                        "final test accuracy within 1 point of none: -1.1 points: missed",
                                        "compress + decompress at most 10% of the step: 8.0%: met"]
    rows += [row("powersgd", 89.3, 8640, 0.07), row("fft@powersgd-bytes (θ=0.328)", 93.2, 7827, 0.05)]
    assert bench.target_lines(rows)[3] == "fft against powersgd at equal bytes (a comparison, no target): +3.9 points"
    assert bench.target_lines(rows[:1]) == []  # no fft run: nothing to judge
    unmeasured = bench.target_lines([row("none", 93.6, 78824, 0.01), {"name": "fft", "result": {"epochs": [
        {"test_accuracy_pct": 93.0, "bytes_sent_per_step": 0, "compress_s": 0, "decompress_s": 0, "step_s": 0}]}}])
    # (it said "inf x: met": a review)
    assert unmeasured[0].endswith(": not measured (no step timed)") and unmeasured[2].endswith("not measured (no step timed)")
    # judged as printed: 9.96x fewer bytes reads "10.0x", -1.04 points "-1.0", a 10.04% codec share "10.0%"
    edge = bench.target_lines([row("none", 93.6, 9960, 0.01), row("fft", 92.56, 1000, 0.0502)])
    assert [line.rsplit(": ", 2)[-2:] for line in edge] == [["10.0x", "met"], ["-1.0 points", "met"], ["10.0%", "met"]]


def test_compressed_training_benchmark_says_its_epochs_and_progress(monkeypatch):
    """`--epochs 1` judged "within 1 point of none" without saying the target is the default 4
    epochs', and `--epochs 100000` ran for hours without a line (a trial)."""
    bench = _benchmark(monkeypatch, "compressed_training")

    def row(name, accuracy):
        return {"name": name, "result": {"epochs": [{"test_accuracy_pct": accuracy, "bytes_sent_per_step": 1000,
                                                      "compress_s": 0.01, "decompress_s": 0.01, "step_s": 1.0}]}}

    rows = [row("none", 80.0), row("fft", 79.5)]
    assert bench.target_lines(rows, 1)[1] == ("final test accuracy within 1 point of none: -0.5 points: met (the "
                                              "target assumes the default 4 epochs; this run: 1)")
    assert bench.target_lines(rows, 4)[1] == "final test accuracy within 1 point of none: -0.5 points: met"
    record = {"epoch": 1, "wall_s": 20.0, "test_accuracy_pct": 77.94}
    assert bench.progress_line("fft", record, 100000) == ("  fft epoch 2/100000: test accuracy 77.9%, 20.0 s, "
                                                          "about 277.8 h to go")
    assert bench.progress_line("fft", record, 4).endswith(", 20.0 s, about 20 s to go")
    assert bench.progress_line("fft", {**record, "epoch": 99999}, 100000).endswith("test accuracy 77.9%, 20.0 s")


def test_gemm_benchmark_says_which_targets_its_ratios_meet(monkeypatch):
    """It printed ratios and left the user to find the issue's targets (a trial)."""
    gemm = _gemm_benchmark(monkeypatch)
    #        n  dtype      tile flops t_numpy t_paperline t_dask t_gathered error
    rows = [(4096, "float32", 1024, 0, 1.0, 1.0, 2.0, 1.0, 0),
            (8192, "float32", 2048, 0, 9.6, 10.0, 12.0, 10.0, 0),
            (8192, "float64", 2048, 0, 9.0, 10.0, 11.0, 10.0, 0)]
    assert gemm.target_lines(rows, 0.75) == [
        "paperline / numpy.matmul >= 0.95 at n = 8192: 0.960 (float32), 0.900 (float64): missed",
        "paperline / dask.array >= 1.15 (every row): lowest 1.100: missed",
        "out of core / in core >= 0.7: 0.750: met"]
    lines = gemm.target_lines(rows[:1], 0.5)
    assert lines[0].endswith("not measured (--sizes without 8192)") and lines[1].endswith("lowest 2.000: met")
    assert lines[2].endswith("0.500: missed")
    # judged as printed (the GPU line already was): 0.9496 reads "0.950", 1.1496 "1.150", 0.6996 "0.700"
    edge = [(8192, "float32", 2048, 0, 9.496, 10.0, 11.496, 10.0, 0)]
    assert [line.rsplit(": ", 1)[1] for line in gemm.target_lines(edge, 0.6996)] == ["met", "met", "met"]
    assert gemm.target_lines(edge, 0.6996)[0].endswith(": 0.950 (float32): met")


def test_gemm_benchmark_alternates_out_of_core_with_in_core_per_round(monkeypatch):
    """The out-of-core ratio was timed as the in-core repeats, then the out-of-core ones: a loaded
    host's drift went into it (1.63 in one run: a trial)."""
    gemm = _gemm_benchmark(monkeypatch)
    order = []
    best_in, best_out, per_round = gemm.in_and_out_of_core(lambda: order.append("in") or 0.75,
                                                           lambda: order.append("out") or 0.38, 3)
    assert order == ["in", "out"] * 3
    assert best_in[1] == 0.75 and best_out[1] == 0.38 and len(per_round) == 3
    assert best_in[0] >= 0 and best_out[0] >= 0


def test_gemm_benchmark_never_prints_a_ratio_as_zero(monkeypatch):
    """At n=64 paperline's tiny times against NumPy's printed ratios of 0.000 (a trial): three
    significant digits there, three decimals elsewhere, and a target judged on what is printed."""
    gemm = _gemm_benchmark(monkeypatch)
    from _args import ratio_text

    assert [ratio_text(r) for r in (0.9496, 1.2345, 0.0999, 0.0123, 8.65e-05)] == [
        "0.950", "1.234", "0.0999", "0.0123", "8.65e-05"]
    #        n  dtype      tile flops t_numpy t_paperline t_dask t_gathered error
    rows = [(64, "float64", 16, 0, 1e-5, 0.1, 0.3, 0.1, 0)]
    lines = gemm.target_lines(rows, 0.0004)
    assert lines[1] == "paperline / dask.array >= 1.15 (every row): lowest 3.000: met"
    assert lines[2] == "out of core / in core >= 0.7: 0.000400: missed"


def test_gemm_benchmark_says_whether_its_gpu_ratios_meet_the_target(monkeypatch):
    """--device cuda printed ratios with no verdict (the CPU path had them)."""
    gemm = _gemm_benchmark(monkeypatch)
    #        n      dtype      tile  flops t_device t_host t_paperline error
    rows = [(16384, "float32", 4096, 0, 1.0, 3.0, 1.0, 0),  # a smaller size's ratio is not judged
            (32768, "float32", 8192, 0, 8.6, 20.0, 10.0, 0),
            (32768, "float64", 8192, 0, 7.2, 20.0, 10.0, 0)]
    lines = gemm.gpu_target_lines(rows, 1)
    assert lines[0] == ("paperline / cupy.matmul (device-resident) >= 0.85 at the largest size, n = 32768: "
                        "0.860 (float32), 0.720 (float64): missed")
    assert lines[1].startswith("scaling over GPUs: not measured here (1 GPU(s) visible")
    assert gemm.gpu_target_lines(rows[:2], 2)[0].endswith("n = 32768: 0.860 (float32): met")


def test_gemm_benchmark_counts_memory_and_disk_as_its_measurements_hold_them(monkeypatch):
    import argparse
    import shutil
    from collections import namedtuple

    import psutil

    from paperline.kernels.errors import InputError

    gemm = _gemm_benchmark(monkeypatch)
    memory = namedtuple("Memory", "available")
    usage = namedtuple("Usage", "total used free")
    args = argparse.Namespace(sizes="100000", dtypes="float64", tile=None, workers=2)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(64 << 30))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 50, 0, 1 << 50))
    with pytest.raises(InputError) as e:  # the trial's case: 3 n^2 x 8 bytes for numpy.matmul
        gemm.check_fits(args)
    assert str(e.value).startswith("--sizes=100000: n=100000 float64 needs about 223.52 GiB of memory "
                                   "(numpy.matmul's A, B and product"), str(e.value)
    assert str(e.value).endswith("64.00 GiB available; lower --sizes")
    # memory enough; the operands of every size stay written until the end, with one result file
    args = argparse.Namespace(sizes="4096,8192", dtypes="float32,float64", tile=None, workers=2)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory(1 << 50))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 50, 0, 2 << 30))
    with pytest.raises(InputError) as e:
        gemm.check_fits(args)
    assert str(e.value).startswith("--sizes=8192: n=8192 float64 needs 2.38 GiB on disk at "), str(e.value)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 50, 0, 3 << 30))
    gemm.check_fits(args)  # the defaults: 3 GiB of memory at most, 2.38 GiB of files


@pytest.mark.parametrize("script", ["gemm.py", "compressed_training.py"])
def test_a_benchmark_on_cuda_without_a_gpu_says_so(script):
    from paperline.infra.device import gpu_usable

    if gpu_usable():
        pytest.skip("a GPU is usable here: --device cuda would run the benchmark")
    # (it advised device=auto and PAPERLINE_DEVICE, the pipelines' parameter, which no benchmark takes: a trial)
    assert refuse(script, "--device", "cuda") == (f"{script}: error: --device cuda: no usable CUDA device (the GPU "
                                                  "extra, make install-gpu, on a machine with an NVIDIA driver); leave "
                                                  "--device out to measure on the CPU")


def test_the_gpu_check_script_stops_at_once_without_a_gpu(tmp_path):
    """tests/gpu/run_checks.sh (every GPU check in one bounded run) on this machine: it says there
    is nothing to check and exits 2, before any test or benchmark starts."""
    from paperline.infra.device import gpu_usable

    if gpu_usable():
        pytest.skip("a GPU is usable here: the script would run every check")
    proc = subprocess.run(["bash", str(ROOT / "tests" / "gpu" / "run_checks.sh"), str(tmp_path / "out")],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "paperline's gpu_usable(): False" in proc.stdout and "no usable GPU: nothing to check" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["device.log"]


@pytest.mark.parametrize(("args", "message"), [
    (["--splitters", "bogus"], "--splitters 'bogus': unknown bogus; known: content, stride, transnetv2"),
    (["--splitters", ","], "--splitters ',': unknown (none given); known: content, stride, transnetv2"),
    (["--repeats", "0"], "--repeats 0: at least 1"),
    (["--height", "7"], "--height 7: at least 16"),  # (a traceback after the first measurement: a trial)
])
def test_video_benchmark_bad_arguments(args, message):
    assert refuse("video_curation.py", *args) == f"video_curation.py: error: {message}"


def test_video_benchmark_alternates_its_runs_within_each_round(monkeypatch):
    """Back-to-back repeats of one row then the next put a host's drift into the printed ratio
    (1.17x-1.41x on one idle host): each round runs every row once, and a row limited to fewer
    rounds (TransNetV2's two minutes) drops out after them."""
    import importlib.util

    # loaded from its file under a name of its own: a bare `import video_curation` got the flow
    # module Prefect had loaded from prefect.yaml's entrypoint (flows/video_curation.py) under that
    # name when an earlier test of the same process loaded the deployments
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("paperline_benchmark_video_curation",
                                                  ROOT / "benchmarks" / "video_curation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    interleaved = module.interleaved

    order = []
    runs = {name: (lambda name=name: order.append(name) or name.upper(), reps)
            for name, reps in [("bare", 3), ("pipeline", 3), ("transnetv2", 1)]}
    times = interleaved(runs, 3)
    assert order == ["bare", "pipeline", "transnetv2", "bare", "pipeline", "bare", "pipeline"]
    assert [len(times[n]) for n in runs] == [3, 3, 1]
    assert all(out == name.upper() and seconds >= 0 for name in runs for seconds, out in times[name])


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("[!_]*.py")))
def test_each_benchmarks_help_says_how_long_it_runs_and_how_to_narrow_it(script):
    """`compressed_training.py --help` stopped mid-sentence (its docstring's first line only) and
    said nothing of its 10 minutes or the flags that narrow it (a trial)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    import re

    assert "Run with" in text and re.search(r"\d+ (s|seconds|minutes?)\b", text), text[:600]


@pytest.mark.parametrize(("script", "args", "message"), [
    # tracebacks, some after minutes of measuring (a trial)
    ("tensor_factorization.py", ["--rank", "0"], "argument --rank: '0': at least 1"),
    ("tensor_factorization.py", ["--closing-sweeps", "-1"], "argument --closing-sweeps: '-1': at least 0"),
    ("tensor_factorization.py", ["--datasets", "produc,nope"],
     "argument --datasets: 'nope': unknown; known: flights, kinetic, produc"),
    ("tensor_factorization.py", ["--datasets", ","], "argument --datasets: ',': no dataset named"),
    ("nas.py", ["--q", "0"], "argument --q: '0': at least 1"),
    ("nas.py", ["--processes", "0"], "argument --processes: '0': at least 1"),
    ("nas.py", ["--processes", "1000"], "--processes 1000: at most"),
    ("nas.py", ["--load", "/nonexistent.json"], "--load /nonexistent.json: no such file"),
    ("nas.py", ["--load", str(ROOT / "Makefile")], f"--load='{ROOT / 'Makefile'}': not a file --save wrote "
                                                   "(JSONDecodeError: Expecting value"),
    ("nas.py", ["--optimizers", ""], "--optimizers '' names no optimizer (leave it out for every one)"),  # (ran all)
    ("nas.py", ["--problems", ","], "--problems ',' names no problem"),  # (blamed --optimizers: a trial)
    ("nas.py", ["--budget", "5"], "--budget 5: below --n-init 10"),
    ("nas.py", ["--quick", "--budget", "5"], "--budget 5: below --n-init 10"),  # (--quick overrode it unsaid: a trial)
    ("nas.py", ["--problems", "levy", "--optimizers", "lamcts,qehvl"],  # (qehvl was dropped unsaid: a review)
     "--optimizers: qehvl not among these problems' optimizers (bo, lamcts, random, turbo)"),
    ("gemm.py", ["--workers", "999"], "--workers 999: at most"),  # (64 ran for minutes at a load of 28: a trial)
    ("collectives.py", ["--target-s", "nan"], "argument --target-s: 'nan': a finite number of seconds > 0"),
    ("nas.py", ["--problems", "levy", "--optimizers", "lamcts", "--options", 'lamcts={"foo": 1}'],
     "optimizer_options=['foo']: unknown for lamcts; known: cp, kernel, leaf_size, n_candidates, sampler, turbo_length"),
    ("nas.py", ["--optimizers", "random", "--options", "turbo={}"], "--options for turbo, which no campaign here runs"),
    ("video_curation.py", ["--crf", "99"], "--crf 99: libx264's CRF is 0..51"),
    ("video_curation.py", ["--preset", "nope"], "--preset 'nope': not a libx264 preset; known: ultrafast"),
    ("collectives.py", ["--repeats", "0"], "argument --repeats: '0': at least 1"),
    ("collectives.py", ["--sizes", "3"], "argument --sizes: '3': a message is a positive multiple of 4 bytes (float32)"),
    # (argparse took it for an option: "expected at least one argument", a trial)
    ("collectives.py", ["--sizes", "64M", "-64M"], "argument --sizes: '-64M': a size is a positive multiple of 4 bytes "
                                                  "(float32), e.g. 64M"),
    ("collectives.py", ["--repeats", "-1"], "argument --repeats: '-1': must be positive"),  # (said to be a size: a trial)
    ("collectives.py", ["--world-sizes", "1"], "argument --world-sizes: '1': at least 2"),
    ("collectives.py", ["--world-sizes", "2", "4096"], "--world-sizes 4096: at most"),  # (64 ran 2 minutes: a trial)
    ("collectives.py", ["--chunk-bytes", "0"], "argument --chunk-bytes: '0': a chunk is a positive multiple of 4 bytes"),
    # found only when the results were written, after the measurements (a trial)
    ("compressed_training.py", ["--json", "/"], "argument --json: '/' is a directory; name a file"),
    ("video_curation.py", ["--json", "/nonexistent-dir/x.json"], "argument --json: '/nonexistent-dir/x.json': no "
                                                               "directory '/nonexistent-dir'"),
    ("collectives.py", ["--json", "/nonexistent-dir/x.json"], "argument --json: '/nonexistent-dir/x.json': no directory"),
    ("nas.py", ["--save", "/"], "argument --save: '/' is a directory; name a file"),
    ("nas.py", ["--save", "/proc/x.json"], "argument --save: '/proc/x.json' cannot be written"),  # (after the runs: a trial)
    # each of these started two ranks whose tracebacks buried the reason, or ran silently (a trial)
    ("compressed_training.py", ["--epochs", "0"], "argument --epochs: '0': at least 1"),
    ("compressed_training.py", ["--fft-theta", "2"], "--fft-theta 2.0: must be in (0, 1]"),
    ("compressed_training.py", ["--fft-bits", "64"], "--fft-bits 64: must be in [1, 32]"),
    ("compressed_training.py", ["--compressors", "zip"], "--compressors 'zip': unknown compressor; known: fft, fp16"),
    ("compressed_training.py", ["--compressors", ""], "--compressors '': no compressor named"),
    ("compressed_training.py", ["--target-accuracy", "150"],
     "argument --target-accuracy: '150': a test accuracy in percent, in (0, 100]"),
])
def test_benchmarks_refuse_bad_arguments_before_measuring(script, args, message):
    assert refuse(script, *args).startswith(f"{script}: error: {message}")


def test_tensor_benchmark_refuses_a_rank_too_large_before_loading_anything():
    """`--rank 100000` was refused after ~15 s (a dataset loaded, the cluster started, the warm-up
    begun), as `rank=100000`, not the option's name (a trial)."""
    import time

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tensor_factorization.py"), "--rank", "100000",
                           "--datasets", "produc"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stdout == ""  # no "== speed" line: nothing was loaded or fitted
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("tensor_factorization.py: error: --rank 100000: on kinetic (shape (64, 12, 10, 60)), the "
                           "factors and the fit's scratch would take "), line
    assert line.endswith("available; lower the rank"), line
    assert time.perf_counter() - start < 60


def test_nas_benchmark_load_refusals_are_the_parsers_one_line(tmp_path):
    """`--load a.json a.json` ended with a bare line, without `nas.py: error:` (a trial): a file
    named twice is read once; a campaign in two files, or files of different settings, are
    refused with the parser's prefix."""
    import json

    def save(name, budget, seed):
        run = {"problem": "levy", "optimizer": "random", "seed": seed, "trace": [1.0, 2.0, 3.0], "suggest_s": 0.1,
               "wall_s": 1.0}
        (tmp_path / name).write_text(json.dumps({"budget": budget, "n_init": 1, "q": 1, "runs": [run]}))
        return str(tmp_path / name)

    a, b, c = save("a.json", 3, 0), save("b.json", 3, 0), save("c.json", 4, 1)
    assert refuse("nas.py", "--load", a, b) == (f"nas.py: error: --load='{b}': ('levy', 'random', 0) is in {a} too; "
                                                "a seed counts once")
    line = refuse("nas.py", "--load", a, c)  # (the value shown is cut at 120 characters)
    assert line.startswith(f"nas.py: error: --load=<{a}") and line.endswith(
        ">: the files were run with different (budget, n_init, q): [(3, 1, 1), (4, 1, 1)]"), line
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "nas.py"), "--load", a, str(tmp_path / "." / "a.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "budget 3, 1 seeds" in proc.stdout and "1/1" in proc.stdout, proc.stdout


def test_gemm_benchmark_reads_its_dtypes_as_typed_with_spaces_each_once(monkeypatch):
    """`--dtypes "float32, float64"` crashed on ' float64' after the first measurements (a trial)."""
    gemm = _gemm_benchmark(monkeypatch)
    assert gemm._dtypes("float32, float64,float64") == "float32,float64"


def test_the_benchmarks_list_options_measure_each_item_once(monkeypatch):
    """`gemm.py --sizes 64,64` and `video_curation.py --splitters content,content` measured the same
    thing twice (a trial): each list option keeps its first of each, in order."""
    gemm = _gemm_benchmark(monkeypatch)
    from _args import each_once  # (benchmarks/ is on the path now)

    assert gemm._sizes("64,128, 64,0064") == "64,128"
    assert each_once(["content", "stride", "content"]) == ["content", "stride"]
    tensor = _benchmark(monkeypatch, "tensor_factorization")
    assert tensor._datasets("produc,kinetic, produc") == ["produc", "kinetic"]
    assert _benchmark(monkeypatch, "compressed_training").compressor_names("fft, none,fft,") == ["fft", "none"]


def test_an_output_file_checked_before_measuring_is_left_as_it_was(monkeypatch, tmp_path):
    """The check opens it for appending: an existing file keeps its bytes, a new one is not left."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from _args import output_file
    kept = tmp_path / "kept.json"
    kept.write_text('{"runs": [1]}')
    assert output_file(str(kept)) == kept and kept.read_text() == '{"runs": [1]}'
    assert output_file(str(tmp_path / "new.json")) == tmp_path / "new.json" and not (tmp_path / "new.json").exists()
