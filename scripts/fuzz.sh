#!/usr/bin/env bash
# Fuzz the safetensors reader, the loaders built on it and the training data reader (libFuzzer +
# ASan + UBSan, clang):
#   bash scripts/fuzz.sh [SECONDS]     # default 60, split evenly between the harnesses
# The longer run, e.g. an hour per harness on every core, keeping what it learns between runs:
#   bash scripts/fuzz.sh 7200          # or, after one build, by hand:
#   mkdir -p /tmp/gdn-corpus && cp tests/fuzz/corpus/* /tmp/gdn-corpus/
#   build-fuzz/fuzz_loaders -max_total_time=3600 -timeout=10 -jobs=$(nproc) -workers=$(nproc) \
#       -artifact_prefix=/tmp/ /tmp/gdn-corpus
# Harnesses: tests/fuzz/fuzz_safetensors.c (gdn_st_open and every read of every tensor),
# tests/fuzz/fuzz_loaders.c (gdn_problem_load[_rows], gdn_layer_weights_load), tests/fuzz/fuzz_attn.c
# (gdn_attn_weights_load: a config.json and a safetensors file in one input), tests/fuzz/fuzz_tokens.c
# (gdn_data_open / gdn_data_read / gdn_data_window_docs: token files and byte text),
# tests/fuzz/fuzz_ckpt.c (gdn_ckpt_load_config / gdn_ckpt_load / the separator readers: config.json,
# trainer_state.json and model.safetensors of one checkpoint directory in one input). Seeds:
# tests/fuzz/corpus/ (copied: new corpus entries are never written into the repository).
# Prints one "PASS"/"FAIL" line per harness; exits non-zero when any harness crashed, hung, leaked
# or tripped a sanitizer. A crashing input is kept as build-fuzz/artifacts/<harness>/crash-*.
set -uo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
harnesses=(fuzz_safetensors fuzz_loaders fuzz_attn fuzz_tokens fuzz_ckpt)
bash scripts/deps.sh fuzz || { echo "FAIL  fuzz: installing dependencies"; exit 1; }
# The harnesses read files with libgdncp's readers: no MPI (GDN_MPI=OFF: none is looked for).
mkdir -p build-fuzz
if ! CC=clang cmake -S . -B build-fuzz -DGDN_FUZZ=ON -DGDN_MPI=OFF -DCMAKE_BUILD_TYPE=Debug > build-fuzz/build.log 2>&1 ||
   ! cmake --build build-fuzz -j"$(nproc)" --target gdn_fuzz >> build-fuzz/build.log 2>&1; then
  tail -30 build-fuzz/build.log; echo "FAIL  fuzz build (see build-fuzz/build.log)"; exit 1
fi
per=$(( secs / ${#harnesses[@]} )); [ "$per" -ge 1 ] || per=1
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
rc=0
for h in "${harnesses[@]}"; do
  mkdir -p "$work/$h" "build-fuzz/artifacts/$h"
  cp tests/fuzz/corpus/* "$work/$h/"
  # -timeout: one input running over 10 s counts as a hang; -rss_limit_mb: a loader that
  # allocates far past what a small file can justify counts as a failure too. The outer timeout
  # only guards against libFuzzer itself not stopping.
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1:symbolize=1 \
  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  timeout $((per + 120)) "build-fuzz/$h" -max_total_time="$per" -timeout=10 -rss_limit_mb=2048 \
    -max_len=16384 -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$h/" \
    "$work/$h" > "$work/$h.log" 2>&1
  st=$?
  runs=$(grep -oE '^stat::number_of_executed_units: *[0-9]+' "$work/$h.log" | grep -oE '[0-9]+$' || true)
  speed=$(grep -oE '^stat::average_exec_per_sec: *[0-9]+' "$work/$h.log" | grep -oE '[0-9]+$' || true)
  cov=$(grep -oE 'cov: [0-9]+' "$work/$h.log" | tail -1 || true)
  if [ "$st" -eq 0 ]; then
    echo "PASS  fuzz $h: ${per}s, ${runs:-?} inputs (${speed:-?}/s), $cov, no crash"
  else
    rc=1
    grep -E 'ERROR|runtime error|SUMMARY|Test unit written|#[0-9]+ 0x' "$work/$h.log" | head -30
    echo "FAIL  fuzz $h: exit $st, crashing input in build-fuzz/artifacts/$h/"
  fi
done
exit $rc
