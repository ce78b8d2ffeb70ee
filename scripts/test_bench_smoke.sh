#!/usr/bin/env bash
# The benchmarks run and their every row's error against the oracle is small (a smoke test: the
# speed itself is measured by the benchmarks, never asserted in a test). Usage:
# scripts/test_bench_smoke.sh BUILD_DIR. Ends with "N passed, N failed"; exits 1 on a failure.
. "$(dirname "$0")/test_common.sh"
# smoke "BENCH [OPTIONS]" LABEL PATTERN...: `gdncp bench BENCH [OPTIONS] --json --quick` runs; each
# PATTERN must be found in its rows (a pattern starting with ! must not be)
smoke() {
  local bench=$1 label=$2 out="$logs/bench_${1%% *}.json" ok=1 pat; shift 2
  echo "== benchmark smoke (gdncp bench $bench --json --quick)"
  # shellcheck disable=SC2086 # BENCH and its options are words
  $L bench $bench --json --quick > "$out" 2>&1 || ok=0
  for pat in "$@"; do
    if [ "${pat:0:1}" = '!' ]; then grep -q "${pat:1}" "$out" && ok=0; else grep -q "$pat" "$out" || ok=0; fi
  done
  if [ "$ok" = 1 ]; then echo "PASS  bench $bench runs, $label"; passed=$((passed + 1))
  else echo "FAIL  bench $bench smoke ($label)"; cat "$out"; failed=$((failed + 1)); fi
}
smoke kernel "every fp32 row's error vs the oracle below 1e-5, every bf16 row's within 5e-2 of it and norm-wise below 1e-3 of its bf16-operand oracle" \
  '"direction":"forward"' '"compute":"bf16"' \
  '!"compute":"fp32",.*"rel_err_vs_oracle":\(nan\|[0-9.]*e-0[0-4]\|[0-9.]*e+\)' \
  '!"compute":"bf16",.*"rel_err_vs_oracle":\(nan\|[0-9.]*e-0[0-1]\|[5-9][0-9.]*e-02\|[0-9.]*e+\)' \
  '!"l2_err_vs_bf16_oracle":\(nan\|inf\|[0-9.]*e-0[0-3]\|[0-9.]*e+\)'
smoke layer "every fp32 row's error vs the double layer below 1e-5, every bf16 row's within 5e-2 of it and below 1e-3 of its bf16-operand oracle (which rounds the same operands, the kernel's included)" \
  '"direction":"layer_fwd_bwd"' '"direction":"layer_decode"' '"compute":"bf16"' \
  '!"compute":"fp32",.*"rel_err_vs_reference":\(nan\|[0-9.]*e-0[0-4]\|[0-9.]*e+\)' \
  '!"compute":"bf16",.*"rel_err_vs_reference":\(nan\|[0-9.]*e-0[0-1]\|[5-9][0-9.]*e-02\|[0-9.]*e+\)' \
  '!"rel_err_vs_bf16_oracle":\(nan\|[0-9.]*e-0[0-3]\|[0-9.]*e+\)'
smoke attention "every fp32 row's error vs double loops / the double layer below 1e-5, every bf16 row's within 5e-2" \
  '"direction":"core_fwd_bwd"' '"direction":"core_fwd_bwd_bf16"' '"direction":"layer_fwd_bwd"' '"direction":"layer_fwd_bwd_bf16"' \
  '!"direction":"\(core_forward\|core_fwd_bwd\|layer_forward\|layer_fwd_bwd\)",.*"rel_err_vs_reference":\(nan\|[0-9.]*e-0[0-4]\|[0-9.]*e+\)' \
  '!"direction":"\(core\|layer\)_[a-z_]*_bf16",.*"rel_err_vs_reference":\(nan\|[0-9.]*e-0[0-1]\|[5-9][0-9.]*e-02\|[0-9.]*e+\)'
smoke train "the gradient within 1e-2 of finite differences" '"direction":"train_step"' '"packed_docs":[1-9]' \
  '"grad_rel_err_vs_fd":[0-9.]*e-0[3-9]'
smoke "train --model tiny-moe,tiny --layers 2" "--model and --layers: the models given, in their order, with 2 layers" \
  '"direction":"train_step","model":"tiny-moe","layers":2' '"direction":"train_step","model":"tiny","layers":2' \
  '!"model":"small' '!"layers":4'
smoke decode "the prefill of the last logits within 1e-5 of the training forward's in fp32, 5e-2 in BF16 compute, at a measured fraction of the peak" \
  '"direction":"model_prefill","model":"small","layers":4' \
  '"direction":"model_prefill",.*"fraction_of_peak":0\.[0-9]*[1-9]' \
  '"direction":"model_prefill",.*"compute":"fp32",.*"rel_err_vs_forward":[0-9.]*e-\(0[6-9]\|[1-9][0-9]\)' \
  '"direction":"model_prefill",.*"compute":"bf16",.*"rel_err_vs_forward":\([0-4][0-9.]*e-02\|[0-9.]*e-0[3-9]\)'
smoke matmul "the BF16 GEMM within 1e-2 of fp32 on every row" '"direction":"matmul"' \
  '"bf16_rel_err_vs_fp32":[0-9.]*e-0[3-9]' '!"bf16_rel_err_vs_fp32":\(nan\|-nan\|inf\|[0-9.]*e-0[0-2]\|[0-9.]*e+\)'
smoke "decode --ckpt $golden/qwen35_tiny" "the golden checkpoint generating: the last step's logits within 1e-5 of the forward's with an F32 cache, 1e-2 with a BF16 one" \
  '"direction":"model_decode","model":"ckpt"' '"cache_dtype":"f32",.*"rel_err_vs_forward":[0-9.]*e-\(0[5-9]\|[1-9][0-9]\)' \
  '!"cache_dtype":"f32",.*"rel_err_vs_forward":\(nan\|-nan\|inf\|[0-9.]*e-0[0-4]\|[0-9.]*e+\)' \
  '!"cache_dtype":"bf16",.*"rel_err_vs_forward":\(nan\|-nan\|inf\|[0-9.]*e-0[0-2]\|[0-9.]*e+\)'
smoke moe "every fp32 row's error vs the float64 block below 1e-5, every bf16 row's below 5e-2; the load spread and the decode bound printed" \
  '"direction":"moe_forward"' '"direction":"moe_fwd_bwd"' '"direction":"moe_decode"' '"compute":"bf16"' \
  '"load_min":[0-9]*,"load_mean":[0-9.]*,"load_max":[0-9]*' '"bound_us":[0-9.]*,"fraction_of_bound":[0-9.]*' \
  '!"compute":"fp32",.*"rel_err_vs_reference":\(nan\|-nan\|inf\|[0-9.]*e-0[0-5]\|[0-9.]*e+\)' \
  '!"compute":"bf16",.*"rel_err_vs_reference":\(nan\|-nan\|inf\|[0-9.]*e-0[0-1]\|[5-9][0-9.]*e-02\|[0-9.]*e+\)'
echo "== gdncp bench moe --quick (text), and a bad option"
out="$logs/bench_moe.txt"
if $L bench moe --quick > "$out" 2>&1 && grep -q '^moe_fwd_bwd .* GFLOP/s .* % of fp32 peak .* % of bf16 peak .*load [0-9]*/[0-9.]*/[0-9]*  err ' "$out" \
   && grep -q '^moe_decode .* bound .* % of bound' "$out" && grep -q '^GEMM path: fp32 ' "$out"; then
  echo "PASS  bench moe --quick prints its rows (GFLOP/s, both peaks, the load spread, err, the decode bound, the path)"; passed=$((passed + 1))
else echo "FAIL  bench moe --quick (text)"; cat "$out"; failed=$((failed + 1)); fi
$L bench moe --quick --bogus-option > "$out" 2>&1; rc=$?
if [ "$rc" = 2 ] && grep -q 'unknown option or missing value: --bogus-option' "$out"; then
  echo "PASS  bench moe --bogus-option exits 2 naming it"; passed=$((passed + 1))
else echo "FAIL  bench moe --bogus-option: exit $rc"; cat "$out"; failed=$((failed + 1)); fi
finish
