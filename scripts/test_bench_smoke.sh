#!/usr/bin/env bash
# The benchmarks run and their every row's error against the oracle is small (a smoke test: the
# speed itself is measured by the benchmarks, never asserted in a test). Usage:
# scripts/test_bench_smoke.sh BUILD_DIR. Ends with "N passed, N failed"; exits 1 on a failure.
. "$(dirname "$0")/test_common.sh"
echo "== benchmark smoke (gdncp bench kernel --json --quick)"
if $L bench kernel --json --quick > "$logs/bench.json" 2>&1 &&
   grep -q '"direction":"forward"' "$logs/bench.json" &&
   ! grep -q '"rel_err_vs_oracle":\(nan\|[0-9.]*e-0[0-4]\|[0-9.]*e+\)' "$logs/bench.json"; then
  echo "PASS  bench kernel runs, every row's error vs the oracle below 1e-5"; passed=$((passed + 1))
else
  echo "FAIL  bench kernel smoke"; cat "$logs/bench.json"; failed=$((failed + 1))
fi
echo "== benchmark smoke (gdncp bench layer --json --quick)"
if $L bench layer --json --quick > "$logs/bench_layer.json" 2>&1 &&
   grep -q '"direction":"layer_fwd_bwd"' "$logs/bench_layer.json" && grep -q '"direction":"layer_decode"' "$logs/bench_layer.json" &&
   ! grep -q '"rel_err_vs_reference":\(nan\|[0-9.]*e-0[0-4]\|[0-9.]*e+\)' "$logs/bench_layer.json"; then
  echo "PASS  bench layer runs, every row's error vs the double layer below 1e-5"; passed=$((passed + 1))
else
  echo "FAIL  bench layer smoke"; cat "$logs/bench_layer.json"; failed=$((failed + 1))
fi
echo "== benchmark smoke (gdncp bench train --json --quick)"
if $L bench train --json --quick > "$logs/bench_train.json" 2>&1 &&
   grep -q '"direction":"train_step"' "$logs/bench_train.json" && grep -q '"packed_docs":[1-9]' "$logs/bench_train.json" &&
   grep -q '"grad_rel_err_vs_fd":[0-9.]*e-0[3-9]' "$logs/bench_train.json"; then
  echo "PASS  bench train runs, the gradient within 1e-2 of finite differences"; passed=$((passed + 1))
else
  echo "FAIL  bench train smoke"; cat "$logs/bench_train.json"; failed=$((failed + 1))
fi
finish
