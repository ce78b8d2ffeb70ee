#!/usr/bin/env bash
# Build and run every test: the CTest suites of the MPICH build (unit suites, the CP suites under
# mpiexec at D = 1..8, the command line, training, MPMD, benchmark smoke), libgdncp alone built
# without MPI and its suites, the MPI suites again against Open MPI, the Python package, the unit suites under AddressSanitizer + UBSan, and 60 s
# of fuzzing. Ends with "N passed, N failed" (the checks of every suite added up); exits non-zero
# on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh || exit 1
passed=0; failed=0
logs=$(mktemp -d)
tally() { # tally LOG: add the log's closing "N passed, N failed" to the totals
  local line; line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1" | tail -1)
  if [ -z "$line" ]; then failed=$((failed + 1)); echo "FAIL  $1 has no summary line (crash?)"; return; fi
  passed=$((passed + $(echo "$line" | cut -d' ' -f1))); failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
}
ctest_tally() { # ctest_tally BUILD_DIR LOG [CTEST ARGS...]: run ctest, add every suite's checks
  local bd=$1 log=$2; shift 2
  ctest --test-dir "$bd" -V "$@" > "$log" 2>&1
  local rc=$? p f n
  # ctest -V prefixes a test's output with "N: "; each suite closes with "N passed, N failed"
  p=$(grep -E '^[0-9]+: [0-9]+ passed, [0-9]+ failed$' "$log" | awk '{ s += $2 } END { print s + 0 }')
  f=$(grep -E '^[0-9]+: [0-9]+ passed, [0-9]+ failed$' "$log" | awk '{ s += $4 } END { print s + 0 }')
  grep -E '^[0-9]+: (FAIL|==)' "$log" | sed 's/^[0-9]*: //' | grep -v '^== ' | head -50
  grep -E '(Passed|\*\*\*Failed|\*\*\*Timeout|Not Run|\*\*\*Exception)' "$log" | grep -E '^ *[0-9]+/[0-9]+ Test' | sed 's/^ */    /'
  n=$(grep -cE '^ *[0-9]+/[0-9]+ Test .*(\*\*\*Failed|\*\*\*Timeout|Not Run|\*\*\*Exception)' "$log")
  passed=$((passed + p)); failed=$((failed + f))
  # a suite that died before its summary line (crash, timeout) still counts as a failure
  if [ "$rc" != 0 ] && [ "$f" = 0 ]; then failed=$((failed + (n > 0 ? n : 1))); fi
  echo "    checks: $p passed, $f failed; CTest: $(grep -oE '[0-9]+ tests failed out of [0-9]+' "$log" | tail -1 | sed 's/tests failed out of/of/' || echo '?') suites failed"
}

echo "== build (Release, -march=native, MPICH) and ctest"
bash scripts/build.sh build || { echo "0 passed, 1 failed"; exit 1; }
ctest_tally build "$logs/ctest.log"

# The next two builds are portable (-DGDN_PORTABLE=ON: x86-64-v3, AVX2 + FMA) and run capped at
# GDNCP_ISA=avx2: the paths of a CPU without AVX-512 or BF16 instructions (8-lane kernels, BF16 on
# the FMA path, the AVX512-BF16 and AMX paths only emulated), checked on whatever CPU CI has.
echo "== libgdncp alone (-DGDN_MPI=OFF: no MPI looked for or linked; the single-process suites, the layer check, the decode example), portable, GDNCP_ISA=avx2"
if bash scripts/build.sh build-nompi -DGDN_MPI=OFF -DGDN_PORTABLE=ON; then
  GDNCP_ISA=avx2 ctest_tally build-nompi "$logs/ctest-nompi.log"
else
  echo "FAIL  the build without MPI"; failed=$((failed + 1))
fi

echo "== the MPI suites under Open MPI (CP at D = 1..4, MPMD, training: its grids, hybrid, MoE, sample, tokens), portable, GDNCP_ISA=avx2"
if GDN_MPICC=$(command -v mpicc.openmpi) bash scripts/build.sh build-openmpi \
     "-DGDN_TEST_RANKS=1;2;3;4" -DGDN_TEST_SHELL_SUITES=OFF -DGDN_PORTABLE=ON; then
  GDNCP_ISA=avx2 ctest_tally build-openmpi "$logs/ctest-openmpi.log" -LE unit
else
  echo "FAIL  Open MPI build"; failed=$((failed + 1))
fi

echo "== Python package (scripts/test_python.sh: venv reused, pip install ./python, pytest python/tests)"
bash scripts/test_python.sh build > "$logs/python.log" 2>&1
grep -E '^(FAILED|ERROR|FAIL|==)' "$logs/python.log"; tail -1 "$logs/python.log"; tally "$logs/python.log"

echo "== unit suites under AddressSanitizer + UndefinedBehaviorSanitizer"
if bash scripts/build.sh build-asan -DGDN_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug; then
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest_tally build-asan "$logs/asan.log" -L unit
  grep -E 'ERROR|runtime error' "$logs/asan.log" | head -40
else
  echo "FAIL  sanitizer build"; failed=$((failed + 1))
fi

echo "== fuzz: libFuzzer + ASan + UBSan on the safetensors reader, the loaders and the training data reader, 60 s (scripts/fuzz.sh)"
if bash scripts/fuzz.sh 60 > "$logs/fuzz.log" 2>&1; then
  grep -E '^PASS' "$logs/fuzz.log" | sed "s/^/    /"
  echo "PASS  fuzz harnesses ran 60 s without a crash, hang, leak or sanitizer report"; passed=$((passed + 1))
else
  tail -40 "$logs/fuzz.log"; echo "FAIL  fuzz (scripts/fuzz.sh 60)"; failed=$((failed + 1))
fi

# The reference files live in tests/data; a ../shared/golden beside the checkout is only compared.
if [ -d ../shared/golden ]; then
  if diff -rq tests/data ../shared/golden -x README.md >/dev/null 2>&1; then echo "note: tests/data matches ../shared/golden"
  else echo "note: tests/data differs from ../shared/golden (the tests use tests/data):"; diff -rq tests/data ../shared/golden -x README.md | head; fi
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
