#!/usr/bin/env bash
# Ranks launched with different arguments (MPMD): every rank stops with one message naming the
# disagreement, and none hangs. Usage: scripts/test_mpmd.sh BUILD_DIR; MPIEXEC is the launcher
# (default mpiexec.mpich; Open MPI's with --allow-run-as-root --oversubscribe --bind-to none).
# Ends with "N passed, N failed"; exits 1 on a failure.
. "$(dirname "$0")/test_common.sh"
echo "== ranks launched with different arguments (MPMD): every rank stops with one message, no hang"
mpmd() { # mpmd LAUNCHER LABEL ARGS_RANK0 -- ARGS_RANK1: expect a clean failure naming the disagreement
  local launcher=$1 label=$2 a=$3 b=$4 g="$golden/gdn_qwen_heads.safetensors"
  if OMPI_MCA_btl_vader_single_copy_mechanism=none timeout 120 $launcher -n 1 $L run --in "$g" \
       --out "$logs/mpmd.safetensors" $a : -n 1 $L run --in "$g" --out "$logs/mpmd.safetensors" $b \
       >"$logs/mpmd.log" 2>&1; then got=0; else got=$?; fi
  if [ "$got" != 0 ] && [ "$got" != 124 ] && grep -qE "disagree|rank [0-9]+ failed" "$logs/mpmd.log"; then
    echo "PASS  $label: exit $got, \"$(grep -m1 -oE 'ranks disagree on [^:]*|rank [0-9]+ failed[^;]*' "$logs/mpmd.log")\""; passed=$((passed + 1))
  else echo "FAIL  $label (exit $got; 124 = hang)"; cat "$logs/mpmd.log"; failed=$((failed + 1)); fi
}
name=${MPIEXEC%% *}
mpmd "$MPIEXEC" "$name: strategies scan / relay" "--cp scan" "--cp relay"
mpmd "$MPIEXEC" "$name: --backward on rank 0 only" "--cp scan --backward" "--cp scan"
mpmd "$MPIEXEC" "$name: different --shards lists" "--cp scan --shards 1,63" "--cp scan --shards 2,62"
mpmd "$MPIEXEC" "$name: --stats on rank 0 only" "--cp scan --stats" "--cp scan"
mpmd "$MPIEXEC" "$name: an invalid --chunk on rank 0 only" "--cp scan --chunk 7" "--cp scan"
lw=(--weights "$golden/layer_small.weights.safetensors" --in "$golden/layer_small.io.safetensors" --out "$logs/mpmd.safetensors")
for spec in "--cp spiral|--cp scan|an unknown strategy on rank 0 only" "--cp scan --backward|--cp scan|--backward on rank 0 only"; do
  IFS='|' read -r a b label <<<"$spec"
  if timeout 120 $MPIEXEC -n 1 $L layer "${lw[@]}" $a : -n 1 $L layer "${lw[@]}" $b \
       >"$logs/mpmd.log" 2>&1; then got=0; else got=$?; fi
  if [ "$got" = 1 ] && grep -qE "disagree|rank [0-9]+ failed" "$logs/mpmd.log"; then echo "PASS  gdncp layer MPMD: $label: exit 1, one message"; passed=$((passed + 1))
  else echo "FAIL  gdncp layer MPMD: $label (exit $got; 124 = hang)"; cat "$logs/mpmd.log"; failed=$((failed + 1)); fi
done
finish
