#!/usr/bin/env bash
# The whole test suite on a GPU machine, in one command (README, "Tests on a GPU machine").
#
#   bash benchmarks/gpu_tests.sh [single|nccl|all] [more pytest arguments]
#
#   single  every test except the multi-GPU NCCL ones (one GPU is enough), in parallel with
#           pytest-xdist; the multi-rank tests share their spawned ranks in a few process groups (tests/ranks.py)
#   nccl    the NCCL tests (tests/test_fsdp.py -k nccl, one per model): 2 GPUs, 4 for the 4-rank ones;
#           NCCL_WORKERS (default 4) of them at a time
#   all     both (the default)
#
# SPLIT=i/n runs the i-th of n parts of the single-GPU tests (whole test files, balanced by their
# measured cost), for machines that limit one command's time: SPLIT=1/2 then SPLIT=2/2 is the whole suite.
#
# A machine without network: test extras that are missing (pytest-xdist, expecttest, opacus, ...) are
# installed from the wheels in $WHEELS (default .whl/, carried there) into $SITE; dpcompile itself is
# installed editable when it is not (the entry-point and subprocess tests need it installed).
# Logs: $OUT/gpu_tests_<part>.log (OUT defaults to /tmp/dpcompile-gpu-tests). Prints one line per part:
#   gpu_tests <part>: <pytest's summary> | torch <version>, <n> x <GPU>
# and exits non-zero when a part has failures or errors.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
shift || true
case "$part" in single|nccl|all) ;; *) echo "usage: $0 [single|nccl|all] [pytest args]" >&2; exit 2;; esac
OUT=${OUT:-/tmp/dpcompile-gpu-tests}
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/dpcompile-site}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# every rank a fresh interpreter, as torchrun starts them (tests/ranks.py; CI forks them from one server to save
# the imports): ranks with their own hash seeds and address layouts must still agree
export DPCOMPILE_TEST_RANKS_START=${DPCOMPILE_TEST_RANKS_START:-spawn}

missing=$(python3 - <<'PY'
import importlib.util
need = ["pytest", "xdist", "execnet", "expecttest", "opacus", "opt_einsum", "scipy", "transformers", "tqdm", "matplotlib",
        "sklearn", "timm"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
import importlib.metadata as md
try:  # pytest 9.2 ignores pytest-xdist's group marks (pyproject.toml's test extra): a carried pytest<9.2 instead
    if tuple(int(p) for p in md.version("pytest").split(".")[:2]) >= (9, 2):
        missing.append("pytest<9.2")
except md.PackageNotFoundError:
    pass
print(" ".join(missing))
PY
)
if [ -n "$missing" ]; then
  echo "installing missing test extras from $WHEELS: $missing"
  wheels=$(ls "$WHEELS"/*.whl 2>/dev/null)
  case " $missing " in *" matplotlib "*) wheels="$wheels $(ls "$WHEELS"/mpl/*.whl 2>/dev/null)";; esac
  if [ -z "$wheels" ]; then
    echo "no wheels in $WHEELS: pip install -e '.[test]' pytest-xdist, or carry the wheels" >&2
    exit 2
  fi
  # --no-deps: the machine's torch and numpy stay as they are
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" $wheels \
    > "$OUT/install.log" 2>&1 || { tail -5 "$OUT/install.log"; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! python3 -c "import importlib.metadata as m; m.version('dpcompile')" 2>/dev/null; then
  python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . >> "$OUT/install.log" 2>&1 \
    || { echo "pip install -e . failed"; tail -5 "$OUT/install.log"; exit 2; }
fi
machine=$(python3 -c "import torch; n = torch.cuda.device_count(); print(f'torch {torch.__version__}, {n} x ' + (torch.cuda.get_device_name() if n else 'no GPU'))")

workers=${WORKERS:-$(( $(nproc) * 3 / 4 ))}
targets=tests  # unless the arguments name tests themselves
for a in "$@"; do case "$a" in tests*) targets=;; esac; done
if [ -n "${SPLIT:-}" ] && [ -n "$targets" ]; then
  targets=$(SPLIT=$SPLIT python3 - <<'PY'
import glob, os
i, n = (int(v) for v in os.environ["SPLIT"].split("/"))
# minutes on 10 workers of an H100 machine's CPUs, roughly; files not listed count 1
cost = {"test_fsdp.py": 9, "test_per_sample_clipping.py": 6, "test_aligned_contractions.py": 3,
        "test_checkpoint.py": 3, "test_norm_contractions.py": 2, "test_accumulation.py": 2, "test_train.py": 2}
files = sorted(glob.glob("tests/test_*.py"), key=lambda f: (-cost.get(os.path.basename(f), 1), f))
bins = [[0, []] for _ in range(n)]
for f in files:  # greedy: the next costliest file to the lightest part
    b = min(bins, key=lambda b: b[0])
    b[0] += cost.get(os.path.basename(f), 1)
    b[1].append(f)
print(" ".join(bins[i - 1][1]))
PY
)
fi
status=0
run_part() {  # name, pytest arguments...
  local name=$1
  shift
  local log="$OUT/gpu_tests_$name.log"
  python3 -m pytest -o addopts= -p no:cacheprovider -q -rfEs --durations=20 "$@" > "$log" 2>&1
  local rc=$?
  local summary
  summary=$(grep -E "[0-9]+ (passed|failed|errors?|skipped|deselected|tests? collected)|no tests ran" "$log" | tail -1 \
    | sed -E 's/^=+ //; s/ =+$//')
  echo "gpu_tests $name: ${summary:-no summary (rc $rc), see $log} | $machine"
  [ $rc -eq 0 ] || { grep -E "^(FAILED|ERROR) " "$log" | head -30; status=1; }
}
if [ "$part" != nccl ]; then
  # one Inductor compile thread and one intra-op thread per worker: the workers already fill the cores
  # (16 workers of 16 threads each ran the suite several times slower). The NCCL part keeps both: its
  # few processes compile Triton kernels, serially with one thread.
  # --extended: both test tiers (tests/tiers.py); CI runs the default one only. (No comment line may sit
  # between the variables and the command: it ends the command, and the variables then reach no worker.)
  TORCHINDUCTOR_COMPILE_THREADS=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
  run_part single -n "$workers" --dist loadgroup --extended -k "not nccl" $targets "$@"
fi
if [ "$part" != single ]; then
  # NCCL_WORKERS tests at a time (pytest-xdist), each with its own ranks on the same GPUs: one at a time the
  # 2-GPU ones alone ran past 200 s on two H200s (five at a time: 173 s), mostly each rank's Triton compiles
  run_part nccl -n "${NCCL_WORKERS:-4}" tests/test_fsdp.py -k nccl "$@"
fi
exit $status
