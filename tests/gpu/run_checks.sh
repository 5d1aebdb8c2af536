#!/usr/bin/env bash
# Every GPU check of the project in one bounded run, for a GPU machine that is lent for minutes:
# the device, the `gpu`-marked tests, then the GPU benchmarks (issue 4's GEMM against cupy.matmul,
# issue 5's memory report, and, with two GPUs or more, the NCCL collectives), each under a time
# limit so that one hang cannot take the others' time. Each step's output goes to the terminal and
# to a log under OUTDIR (default ./gpu-check); the summary at the end says each step's exit status.
#
#   tests/gpu/run_checks.sh [OUTDIR]              # after `make install-gpu`: .venv/bin/python
#   PYTHON=python3 tests/gpu/run_checks.sh OUTDIR  # another interpreter (its packages: see README)
#
# Limits (seconds) can be set: GPU_TESTS_S (default 210), GEMM_S (180), MEMORY_S (90),
# COLLECTIVES_S (60): 540 s in all, inside a 10-minute window. GEMM_SIZES narrows the GEMM
# benchmark (default its own: 16384,32768).
# Exit status: 0 when every step that ran passed, 1 otherwise; 2 when no GPU is usable; 3 when
# torch or paperline cannot be imported (on a host without the project's venv: PYTHONPATH).
set -uo pipefail
caller=$PWD
cd "$(dirname "$0")/../.."
# OUTDIR and a relative PYTHON path as the caller meant them (the defaults are the repository's)
OUTDIR=${1:+$(cd "$caller" && realpath -m -- "$1")}
OUTDIR=${OUTDIR:-$PWD/gpu-check}
if [[ "${PYTHON:-}" == */* && "$PYTHON" != /* ]]; then PYTHON=$caller/$PYTHON; fi
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
summary=()
failed=0

step() {  # step NAME LIMIT_S COMMAND...: run it under `timeout`, its output teed to OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s): $*"
    local start=$SECONDS
    # --foreground: the step stays in this script's process group, so a Ctrl-C stops it (and the
    # script) rather than leave it running unseen; at its limit it gets SIGTERM (the benchmarks
    # then stop the processes they started), and SIGKILL 20 s later
    timeout --foreground --kill-after=20 "$limit" "$@" 2>&1 | tee "$OUTDIR/$name.log"
    local rc=${PIPESTATUS[0]} took=$((SECONDS - start))
    local said="exit $rc"
    # (137 is also a kill by the kernel's OOM killer, before the limit)
    if [ "$rc" = 124 ] || { [ "$rc" = 137 ] && [ "$took" -ge "$limit" ]; }; then
        said="stopped at its limit of ${limit} s"
    fi
    summary+=("$name: $said, $took s")
    [ "$rc" = 0 ] || failed=1
}

"$PYTHON" - <<'EOF' 2>&1 | tee "$OUTDIR/device.log"
import sys
try:
    import torch
    from paperline.infra.device import gpu_usable
except ImportError as exc:  # (said "no usable GPU" before: a review)
    print(f"cannot import {exc.name}: {exc} ({sys.executable}; paperline and its packages must be importable: "
          "make install-gpu, or PYTHONPATH)")
    raise SystemExit(3)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs visible: {torch.cuda.device_count()}, "
      f"paperline's gpu_usable(): {gpu_usable()}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs")
raise SystemExit(0 if gpu_usable() else 2)
EOF
case "${PIPESTATUS[0]}" in
    0) ;;
    2) echo "no usable GPU: nothing to check" >&2; exit 2 ;;
    *) echo "the device check failed (above): nothing checked" >&2; exit 3 ;;
esac
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')

# every module with gpu-marked tests (tests/gpu and some in tests/infra, tests/kernels); a module
# whose imports fail here is reported and the others still run
gpu_modules=$(grep -rlE "mark\.gpu\b" tests --include='test_*.py' | sort)
# shellcheck disable=SC2086 # (one path a word)
step gpu-tests "${GPU_TESTS_S:-210}" "$PYTHON" -m pytest -m gpu $gpu_modules -p no:cacheprovider -rA -q \
    --continue-on-collection-errors
step gemm "${GEMM_S:-180}" "$PYTHON" benchmarks/gemm.py --device cuda ${GEMM_SIZES:+--sizes "$GEMM_SIZES"}
step memory "${MEMORY_S:-90}" "$PYTHON" benchmarks/compressed_training.py --device cuda
if [ "$gpus" -ge 2 ]; then
    step collectives "${COLLECTIVES_S:-60}" "$PYTHON" benchmarks/collectives.py --backend nccl --world-sizes 2 \
        --sizes 64M 256M
else
    summary+=("collectives: not run (NCCL ranks need a GPU each; $gpus visible)")
fi

echo
echo "== summary (logs in $OUTDIR)"
printf '%s\n' "${summary[@]}" | tee "$OUTDIR/summary.txt"
exit $failed
