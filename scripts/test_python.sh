#!/usr/bin/env bash
# The Python package's tests (python/tests, pytest): a virtual environment with torch, transformers, tokenizers,
# numpy, pytest and scikit-build-core, made once and reused (GDN_PY_VENV, default
# ~/.cache/gdncp/venv-py: outside the work tree, so CI's fresh clones reuse it too); the package
# installed with `pip install ./python` (scikit-build-core runs the project's CMake for
# libgdncp.so, in build-pywheel/); the gdncp command built into BUILD (default build-py; the test
# script passes its own build/) for the trained-checkpoint test; then python/tests/test_cp.py, test_cp_train.py
# and test_torch_cp.py (context parallelism over mpi4py) and test_sharded.py (sharded data-parallel
# AdamW) under `mpiexec.mpich -n 3`, one pytest per rank, and test_torch_cp.py, test_torch_cp_train.py
# and test_sharded.py again under `torchrun --nproc-per-node 3` (torch.distributed, gloo). mpi4py is
# built from source against the MPI libgdncp.so links (MPICC=mpicc.mpich, or GDN_MPICC): a binary
# wheel may load another MPI (the PyPI wheel picks Open MPI when both are installed), which gdncp
# refuses. Ends with "N passed, N failed" (both pytest runs' summaries added; errors count as
# failed) and exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-py}
venv=${GDN_PY_VENV:-$HOME/.cache/gdncp/venv-py}
fail() { echo "FAIL  $1"; echo "0 passed, 1 failed"; exit 1; }

# The Python packages the tests import. Plain names from the Python package registry: torch's
# default Linux wheel (it pulls CUDA libraries that the CPU never loads, ~4 GB once, then reused).
pkgs=(torch transformers tokenizers numpy pytest scikit-build-core)
need_py() { "$venv/bin/python" -c "import torch, transformers, tokenizers, numpy, pytest, scikit_build_core" 2>/dev/null; }
if ! need_py; then
  if ! command -v python3 >/dev/null || ! python3 -c "import venv, ensurepip" 2>/dev/null; then
    # Debian's python3 (its venv module is a package of its own)
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3 python3-venv >/dev/null ||
      fail "python3 and python3-venv could not be installed"
  fi
  echo "== creating $venv (${pkgs[*]}; the first time downloads torch: minutes)"
  rm -rf "$venv"   # a half-made one (an interrupted install) is not reused
  python3 -m venv "$venv" &&
    "$venv/bin/python" -m pip install -q --upgrade pip &&
    "$venv/bin/python" -m pip install -q "${pkgs[@]}" || fail "pip could not install ${pkgs[*]} into $venv"
  need_py || fail "$venv lacks one of ${pkgs[*]} after installing them"
fi

echo "== build the gdncp command ($build) and install the Python package (pip install ./python)"
bash scripts/build.sh "$build" || fail "C build into $build"
# No build isolation: scikit-build-core is in the venv already, so installing needs no download.
"$venv/bin/python" -m pip install -q --no-build-isolation ./python > "$build/pip-install.log" 2>&1 ||
  { cat "$build/pip-install.log"; fail "pip install ./python"; }

# mpi4py for the MPI tests, from source against gdncp's MPI (checked by gdncp itself: core._mpi()
# compares the two libraries' version strings); rebuilt when missing or running another MPI
mpicc=${GDN_MPICC:-$(command -v mpicc.mpich || command -v mpicc)}
mpi_ok() { "$venv/bin/python" -c "import gdncp.core as c; c._mpi()" > "$build/mpi4py-check.log" 2>&1; }
if ! mpi_ok; then
  echo "== mpi4py: building it from source against $mpicc ($(head -c 300 "$build/mpi4py-check.log" | tail -1))"
  MPICC="$mpicc" "$venv/bin/python" -m pip install -q --force-reinstall --no-deps --no-binary mpi4py mpi4py \
    > "$build/mpi4py-install.log" 2>&1 || { tail -20 "$build/mpi4py-install.log"; fail "pip install mpi4py (from source, MPICC=$mpicc)"; }
  mpi_ok || { cat "$build/mpi4py-check.log"; fail "mpi4py does not run libgdncp's MPI after a source build"; }
fi

echo "== pytest python/tests"
log="$build/pytest.log"
GDNCP_CLI="$PWD/$build/gdncp" GDN_GOLDEN_DIR="${GDN_GOLDEN_DIR:-$PWD/tests/data}" \
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" \
  timeout 1200 "$venv/bin/python" -m pytest python/tests -q -rfE -p no:cacheprovider > "$log" 2>&1
rc=$?
grep -E '^(FAILED|ERROR)' "$log"
line=$(grep -E '^=* ?[0-9]+ (passed|failed|error)' "$log" | tail -1)
[ -z "$line" ] && line=$(grep -E '[0-9]+ (passed|failed|errors?) in ' "$log" | tail -1)
num() { echo "$line" | grep -oE "[0-9]+ $1" | head -1 | cut -d' ' -f1; }
p=$(num passed); f=$(num failed); e=$(num 'errors?')
p=${p:-0}; f=$((${f:-0} + ${e:-0}))
echo "$line"
if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then   # a crash, a timeout or no test collected
  tail -30 "$log"; f=1; echo "FAIL  pytest exited $rc"
fi

# The CP tests: every rank runs pytest on test_cp.py (the rule over mpi4py) and test_cp_train.py
# (transformers' whole models under patch(comm=...)); the tests compare notes between ranks, so
# every rank reports the same outcome); rank r's output goes to $build/pytest-cp.log.r. Their negative
# controls break the library through GDNCP_MUTATE, which the wheel (no test hooks) cannot: they load
# BUILD's libgdncp.so (GDNCP_LIBRARY), built with the hooks.
echo "== mpiexec.mpich -n 3 pytest python/tests/test_cp.py python/tests/test_cp_train.py python/tests/test_torch_cp.py python/tests/test_sharded.py"
cplog="$build/pytest-cp.log"
rm -f "$cplog".*
GDNCP_LIBRARY="$PWD/$build/libgdncp.so" GDNCP_MPI_TESTS=1 OMP_NUM_THREADS=1 timeout 600 mpiexec.mpich -n 3 bash -c \
  'exec "$0" -m pytest python/tests/test_cp.py python/tests/test_cp_train.py python/tests/test_torch_cp.py python/tests/test_sharded.py -q -rfE -p no:cacheprovider > "$1.$PMI_RANK" 2>&1' \
  "$venv/bin/python" "$cplog"
crc=$?
cline=$(grep -hE '[0-9]+ (passed|failed|errors?)' "$cplog.0" 2>/dev/null | tail -1)
cp_num() { echo "$cline" | grep -oE "[0-9]+ $1" | head -1 | cut -d' ' -f1; }
cp=$(cp_num passed); cf=$(cp_num failed); ce=$(cp_num 'errors?')
cp=${cp:-0}; cf=$((${cf:-0} + ${ce:-0}))
grep -hE '^(FAILED|ERROR)' "$cplog.0" 2>/dev/null
echo "${cline:-no summary from rank 0} (each of 3 ranks)"
for r in 1 2; do   # the ranks must agree (a rank that failed alone would not show in rank 0's)
  other=$(grep -hE '[0-9]+ (passed|failed|errors?)' "$cplog.$r" 2>/dev/null | tail -1)
  if [ "${other% in *}" != "${cline% in *}" ]; then
    echo "FAIL  rank $r's summary '$other' differs from rank 0's"; tail -30 "$cplog.$r"; cf=$((cf + 1))
  fi
done
if [ "$crc" -ne 0 ] && [ "$cf" -eq 0 ]; then
  tail -30 "$cplog.0"; cf=1; echo "FAIL  mpiexec pytest exited $crc"
fi
p=$((p + cp)); f=$((f + cf))

# torchrun_tests N LOG VAR TESTS...: pytest on TESTS in each of N torchrun processes (gloo, a free
# port of their own: --standalone) with VAR=1 (conftest.py collects them only then); rank r's
# output goes to LOG.r. Adds rank 0's summary to p and f; every rank must report the same.
torchrun_tests() {
  local n=$1 log=$2 var=$3; shift 3
  rm -f "$log".*
  env "$var=1" OMP_NUM_THREADS=1 timeout 600 "$venv/bin/torchrun" --standalone --nproc-per-node "$n" \
    --no-python bash -c 'log=$1; shift; exec "$0" -m pytest "$@" -q -rfE -p no:cacheprovider > "$log.$RANK" 2>&1' \
    "$venv/bin/python" "$log" "$@" > "$log.launcher" 2>&1
  local trc=$? tline tp tf te other r
  tline=$(grep -hE '[0-9]+ (passed|failed|errors?)' "$log.0" 2>/dev/null | tail -1)
  tp=$(echo "$tline" | grep -oE "[0-9]+ passed" | head -1 | cut -d' ' -f1)
  tf=$(echo "$tline" | grep -oE "[0-9]+ failed" | head -1 | cut -d' ' -f1)
  te=$(echo "$tline" | grep -oE "[0-9]+ errors?" | head -1 | cut -d' ' -f1)
  tp=${tp:-0}; tf=$((${tf:-0} + ${te:-0}))
  grep -hE '^(FAILED|ERROR)' "$log.0" 2>/dev/null
  echo "${tline:-no summary from rank 0} (each of $n torchrun ranks)"
  for ((r = 1; r < n; r++)); do
    other=$(grep -hE '[0-9]+ (passed|failed|errors?)' "$log.$r" 2>/dev/null | tail -1)
    if [ "${other% in *}" != "${tline% in *}" ]; then
      echo "FAIL  torchrun rank $r's summary '$other' differs from rank 0's"; tail -30 "$log.$r"; tf=$((tf + 1))
    fi
  done
  if [ "$trc" -ne 0 ] && [ "$tf" -eq 0 ]; then
    tail -30 "$log.0" "$log.launcher"; tf=1; echo "FAIL  torchrun pytest exited $trc"
  fi
  p=$((p + tp)); f=$((f + tf))
}

# The same CP tests of gdncp.torch_cp over torch.distributed, 3 processes: test_torch_cp.py (the
# ops), test_torch_cp_train.py (patch(group=...): whole models) and test_sharded.py.
echo "== torchrun --nproc-per-node 3 pytest python/tests/test_torch_cp.py python/tests/test_torch_cp_train.py python/tests/test_sharded.py"
torchrun_tests 3 "$build/pytest-torchrun.log" GDNCP_TORCHRUN_TESTS \
  python/tests/test_torch_cp.py python/tests/test_torch_cp_train.py python/tests/test_sharded.py

# patch(group=) inside PyTorch's FSDP2 on a (dp, cp) = (2, 2) mesh: 4 processes.
echo "== torchrun --nproc-per-node 4 pytest python/tests/test_fsdp_cp.py"
torchrun_tests 4 "$build/pytest-fsdp.log" GDNCP_FSDP_TESTS python/tests/test_fsdp_cp.py
echo "$p passed, $f failed"
[ "$f" -eq 0 ]
