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
# gdncp train: the run's configuration agreed before any collective depends on it (the model's
# every dimension and layer kind, the optimiser, the data, the starting weights): each case stops
# every rank with a non-zero exit and the message naming the value; the control, everything equal,
# trains
text=$logs/mpmd_text.txt
bash scripts/fortunes_text.sh "$text" >/dev/null 2>&1 || true
head -c 3000 "$text" > "$logs/mpmd_other.txt"; echo "another file" >> "$logs/mpmd_other.txt"
T=(train --data "$text" --steps 2 --seq 16 --batch 1 --eval-every 0 --threads 1)
for spec in "--hidden 64||hidden_size (--hidden)" \
            "--layers 3||num_hidden_layers (--layers)" \
            "--intermediate 96||intermediate_size (--intermediate)" \
            "--attn-interval 2||layer 1's kind" \
            "--attn-heads 4 --kv-heads 2||num_attention_heads (--attn-heads)" \
            "--layer-types linear,linear,full,linear|--layer-types linear,linear,linear,full|layer 2's kind" \
            "--cp 2 --lr 3e-3|--cp 2 --lr 1e-3|--lr: rank 1 has 0.001, rank 0 has 0.003" \
            "--clip 0.5||--clip" \
            "--model tiny-moe|--model tiny-moe --experts 4|num_experts (--experts)" \
            "--model tiny-moe --router-aux-coef 0.01|--model tiny-moe|--router-aux-coef" \
            "--data $logs/mpmd_other.txt||the --data file" \
            "--init tests/data/qwen35_tiny|--init tests/data/qwen35_moe_tiny|hidden_size (--hidden)"; do
  IFS='|' read -r a b want <<<"$spec"
  if OMPI_MCA_btl_vader_single_copy_mechanism=none timeout 120 $MPIEXEC -n 1 $L "${T[@]}" $a : -n 1 $L "${T[@]}" $b \
       >"$logs/mpmd.log" 2>&1; then got=0; else got=$?; fi
  if [ "$got" = 1 ] && grep -qF -- "ranks disagree on $want" "$logs/mpmd.log"; then
    echo "PASS  gdncp train MPMD: '$a' / '${b:-(defaults)}': exit 1, \"$(grep -m1 -oE 'ranks disagree on .*' "$logs/mpmd.log" | cut -c1-140)\""
    passed=$((passed + 1))
  else echo "FAIL  gdncp train MPMD: '$a' / '${b:-(defaults)}' (exit $got; 124 = hang; wanted 'ranks disagree on $want')"
    cat "$logs/mpmd.log"; failed=$((failed + 1)); fi
done
if OMPI_MCA_btl_vader_single_copy_mechanism=none timeout 120 $MPIEXEC -n 1 $L "${T[@]}" --model tiny-moe : -n 1 $L "${T[@]}" \
     --model tiny-moe >"$logs/mpmd.log" 2>&1 && grep -q "step     2/2" "$logs/mpmd.log"; then
  echo "PASS  gdncp train MPMD control: the same arguments on both ranks train"; passed=$((passed + 1))
else echo "FAIL  gdncp train MPMD control: the same arguments did not train"; cat "$logs/mpmd.log"; failed=$((failed + 1)); fi
finish
