#!/usr/bin/env bash
# Build and run every test: the suite in the optimised build, the suite again under
# AddressSanitizer + UndefinedBehaviorSanitizer, and a benchmark smoke run.
# Ends with "N passed, N failed"; exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh || exit 1
passed=0; failed=0
tally() { # tally LOG: add the log's closing "N passed, N failed" to the totals
  local line; line=$(grep -E '^[0-9]+ passed, [0-9]+ failed$' "$1" | tail -1)
  if [ -z "$line" ]; then failed=$((failed + 1)); echo "FAIL  $1 has no summary line (crash?)"; return; fi
  passed=$((passed + $(echo "$line" | cut -d' ' -f1))); failed=$((failed + $(echo "$line" | cut -d' ' -f3)))
}
logs=$(mktemp -d)

echo "== build (Release, -march=native)"
bash scripts/build.sh build || { echo "0 passed, 1 failed"; exit 1; }
./build/gdncp_tests > "$logs/release.log" 2>&1
grep -E '^(FAIL|==)' "$logs/release.log"; tail -1 "$logs/release.log"; tally "$logs/release.log"

MPIEXEC=mpiexec.mpich
echo "== context parallelism under MPICH, D = 1 2 3 4 7 8 (oversubscribed)"
for d in 1 2 3 4 7 8; do
  timeout 600 $MPIEXEC -n "$d" ./build/gdncp_cp_tests > "$logs/cp$d.log" 2>&1
  grep -E '^(FAIL|==)' "$logs/cp$d.log"; tail -1 "$logs/cp$d.log"; tally "$logs/cp$d.log"
done

echo "== context parallelism under Open MPI, D = 1 2 3 4 (as root, oversubscribed, unbound)"
if GDN_MPICC=$(command -v mpicc.openmpi) bash scripts/build.sh build-openmpi; then
  for d in 1 2 3 4; do
    OMPI_MCA_btl_vader_single_copy_mechanism=none timeout 600 mpiexec.openmpi --allow-run-as-root \
      --oversubscribe --bind-to none -n "$d" ./build-openmpi/gdncp_cp_tests > "$logs/ompi$d.log" 2>&1
    grep -E '^(FAIL|==)' "$logs/ompi$d.log"; tail -1 "$logs/ompi$d.log"; tally "$logs/ompi$d.log"
  done
else
  echo "FAIL  Open MPI build"; failed=$((failed + 1))
fi

echo "== gdncp run --cp under mpiexec against the golden files"
golden=../shared/golden
cpcase() { # cpcase EXPECT(pass|fail) D ARGS...: run, then diff against the golden file
  local expect=$1 d=$2; shift 2
  local out="$logs/cp_cli.safetensors" g="$golden/gdn_qwen_heads.safetensors"
  if $MPIEXEC -n "$d" ./build/gdncp run "$@" --in "$g" --out "$out" >"$logs/cp_cli.log" 2>&1 &&
     ./build/gdncp diff "$out" "$g" --tol 2e-5 >>"$logs/cp_cli.log" 2>&1; then got=pass; else got=fail; fi
  if [ "$got" = "$expect" ]; then echo "PASS  mpiexec -n $d gdncp run $* ($expect as expected)"; passed=$((passed + 1))
  else echo "FAIL  mpiexec -n $d gdncp run $* (expected $expect)"; cat "$logs/cp_cli.log"; failed=$((failed + 1)); fi
}
cpcase pass 3 --cp scan --backward
cpcase pass 4 --cp allgather --backward --shards 1,64,1,64
cpcase pass 2 --cp relay --backward --stats
cpcase pass 2 --cp heads --backward
cpcase fail 3 --cp scan --backward --no-l2norm            # negative control: wrong model
cpcase fail 3 --cp scan --shards 1,2                       # wrong shard count: clear error
cpcase fail 2 --cp spiral                                  # unknown strategy: clear error

echo "== build (ASan + UBSan)"
if bash scripts/build.sh build-asan -DGDN_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug; then
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ./build-asan/gdncp_tests > "$logs/asan.log" 2>&1
  grep -E '^(FAIL|==)|ERROR|runtime error' "$logs/asan.log" | head -40; tail -1 "$logs/asan.log"; tally "$logs/asan.log"
else
  echo "FAIL  sanitizer build"; failed=$((failed + 1))
fi

echo "== benchmark smoke (gdncp bench kernel --json --quick)"
if ./build/gdncp bench kernel --json --quick > "$logs/bench.json" 2>&1 &&
   grep -q '"direction":"forward"' "$logs/bench.json" &&
   ! grep -q '"rel_err_vs_oracle":\(nan\|[0-9.]*e-0[0-4]\|[0-9.]*e+\)' "$logs/bench.json"; then
  echo "PASS  bench kernel runs, every row's error vs the oracle below 1e-5"; passed=$((passed + 1))
else
  echo "FAIL  bench kernel smoke"; cat "$logs/bench.json"; failed=$((failed + 1))
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
