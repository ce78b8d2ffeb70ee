# Sourced by the shell test suites (scripts/test_*.sh BUILD_DIR): the gdncp command of BUILD_DIR
# ($L, an absolute path), the MPI launcher ($MPIEXEC, default mpiexec.mpich), the reference files
# ($golden, default tests/data), a scratch folder ($logs, removed at exit), the counters, and
# `finish`, which prints the closing "N passed, N failed" and exits 1 on a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bd=${1:-build}
case $bd in /*) ;; *) bd=$PWD/$bd ;; esac
L=$bd/gdncp
MPIEXEC=${MPIEXEC:-mpiexec.mpich}
golden=${GDN_GOLDEN_DIR:-tests/data}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
passed=0; failed=0
finish() { echo "$passed passed, $failed failed"; [ "$failed" -eq 0 ] && exit 0; exit 1; }
