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
# gdncp layer / attention / run --cp: the weights (a digest of their bytes) and their configuration
# (the problem's shapes, options and whole-sequence states for run) agreed before any exchange: each
# case stops every rank with exit 1 and the message naming what differs (without the agreement the
# first three ran to exit 0 on a mix of two models); the controls, everything equal, run.
tiny=$golden/qwen35_tiny
SL="python3 scripts/st_slice.py"
$SL "$tiny/model.safetensors" "$logs/mpmd_swapped.st" \
  --rename model.layers.3.self_attn.q_norm.weight=model.layers.3.self_attn.k_norm.weight,model.layers.3.self_attn.k_norm.weight=model.layers.3.self_attn.q_norm.weight
$L gen --T 64 --seed 1 --out "$logs/mpmd_s1.st" >/dev/null 2>&1; $L gen --T 64 --seed 2 --out "$logs/mpmd_s2.st" >/dev/null 2>&1
GL="layer --config $tiny/config.json --in $tiny/layer0.io.safetensors --out $logs/mpmd.safetensors --cp scan"
GA="attention --config $tiny/config.json --prefix model.layers.3.self_attn. --in $tiny/attn.io.safetensors --out $logs/mpmd.safetensors --cp kv"
GR="run --out $logs/mpmd.safetensors --cp scan"
while IFS='|' read -r want what a b; do
  if OMPI_MCA_btl_vader_single_copy_mechanism=none timeout 120 $MPIEXEC -n 1 $L $a : -n 1 $L $b >"$logs/mpmd.log" 2>&1 </dev/null
  then got=0; else got=$?; fi
  lbl="gdncp ${a%% *} --cp MPMD: $what"
  if [ "$want" = 0 ] && [ "$got" = 0 ]; then echo "PASS  $lbl: exit 0 (control: everything equal)"; passed=$((passed + 1))
  elif [ "$want" != 0 ] && [ "$got" = 1 ] && grep -qF -- "ranks disagree on $want" "$logs/mpmd.log"; then
    echo "PASS  $lbl: exit 1, \"$(grep -m1 -oE 'ranks disagree on .*' "$logs/mpmd.log" | cut -c1-120)\""; passed=$((passed + 1))
  else echo "FAIL  $lbl (exit $got; 124 = hang; wanted '$want')"; cat "$logs/mpmd.log"; failed=$((failed + 1)); fi
done <<LIST
the weights (a digest of the layer's tensors in --weights): rank 1 has|layer 0's weights / layer 1's|$GL --weights $tiny/model.safetensors --prefix model.layers.0.linear_attn.|$GL --weights $tiny/model.safetensors --prefix model.layers.1.linear_attn.
hidden_size E (--weights / --config): rank 1 has 64, rank 0 has 96|qwen35_tiny's layer 0 / layer_small|$GL --weights $tiny/model.safetensors --prefix model.layers.0.linear_attn.|layer --weights $golden/layer_small.weights.safetensors --in $tiny/layer0.io.safetensors --out $logs/mpmd.safetensors --cp scan
--out (rank 0 writes every rank's rows there|layer 0, another --out on rank 1|$GL --weights $tiny/model.safetensors --prefix model.layers.0.linear_attn.|layer --config $tiny/config.json --in $tiny/layer0.io.safetensors --out $logs/mpmd_b.safetensors --cp scan --weights $tiny/model.safetensors --prefix model.layers.0.linear_attn.
--out (rank 0 writes every rank's rows there|run, another --out on rank 1|$GR --in $logs/mpmd_s1.st|run --out $logs/mpmd_b.safetensors --cp scan --in $logs/mpmd_s1.st
0|layer 0's weights on both ranks|$GL --weights $tiny/model.safetensors --prefix model.layers.0.linear_attn.|$GL --weights $tiny/model.safetensors --prefix model.layers.0.linear_attn.
the weights (a digest of the layer's tensors in --weights): rank 1 has|layer 3 / the same with q_norm and k_norm swapped|$GA --weights $tiny/model.safetensors|$GA --weights $logs/mpmd_swapped.st
rope_theta: rank 1 has 1e+07, rank 0 has 10000|--config / none (RoPE theta 1e7 by default)|$GA --weights $tiny/model.safetensors|attention --weights $tiny/model.safetensors --prefix model.layers.3.self_attn. --in $tiny/attn.io.safetensors --out $logs/mpmd.safetensors --cp kv
0|layer 3's weights on both ranks|$GA --weights $tiny/model.safetensors|$GA --weights $tiny/model.safetensors
h0 of the input file (a digest; 0: none): rank 1 has|gen --seed 1 / --seed 2 (another h0)|$GR --in $logs/mpmd_s1.st|$GR --in $logs/mpmd_s2.st
--scale (0 is 1/sqrt(K)): rank 1 has 0.1, rank 0 has 0|--scale on rank 1 only|$GR --in $logs/mpmd_s1.st|$GR --in $logs/mpmd_s1.st --scale 0.1
0|one file on both ranks, --backward|$GR --in $logs/mpmd_s1.st --backward|$GR --in $logs/mpmd_s1.st --backward
LIST

# gdncp train: the run's configuration agreed before any collective depends on it (the model's
# every dimension and layer kind, the optimiser, the data, the starting weights): each case stops
# every rank with a non-zero exit and the message naming the value; the control, everything equal,
# trains
text=$logs/mpmd_text.txt
bash scripts/fortunes_text.sh "$text" >/dev/null 2>&1 || true
head -c 3000 "$text" > "$logs/mpmd_other.txt"; echo "another file" >> "$logs/mpmd_other.txt"
T=(train --data "$text" --steps 2 --seq 16 --batch 1 --eval-every 0 --threads 1)
# equal in size and in all but the last byte (a digest of the first 64 KiB could not tell)
cp "$text" "$logs/mpmd_tail.txt"; printf 'X' | dd of="$logs/mpmd_tail.txt" bs=1 seek=$(($(stat -c %s "$text") - 1)) conv=notrunc 2>/dev/null
# qwen35_moe_tiny with two routed experts' down_proj swapped (the rest equal)
mkdir -p "$logs/mpmd_moe_swapped"; cp "$tiny/../qwen35_moe_tiny/config.json" "$logs/mpmd_moe_swapped/"
e0=model.layers.0.mlp.experts.0.down_proj.weight; e1=model.layers.0.mlp.experts.1.down_proj.weight
$SL "$tiny/../qwen35_moe_tiny/model.safetensors" "$logs/mpmd_moe_swapped/model.safetensors" --rename "$e0=$e1,$e1=$e0"
# a checkpoint and a copy of it whose optimizer.safetensors has two layers' moments swapped
rm -rf "$logs/mpmd_ckpt"; OMP_NUM_THREADS=1 timeout 120 $MPIEXEC -n 2 $L "${T[@]}" --out "$logs/mpmd_ckpt" >/dev/null 2>&1
ck=$(ls -d "$logs"/mpmd_ckpt/checkpoint-* | tail -1); rm -rf "$logs/mpmd_ckpt_b"; cp -r "$ck" "$logs/mpmd_ckpt_b"
m0=exp_avg.model.layers.0.input_layernorm.weight; m1=exp_avg.model.layers.1.input_layernorm.weight
$SL "$ck/optimizer.safetensors" "$logs/mpmd_ckpt_b/optimizer.safetensors" --rename "$m0=$m1,$m1=$m0"
for spec in "--hidden 64||hidden_size (--hidden)" \
            "--layers 3||num_hidden_layers (--layers)" \
            "--intermediate 96||intermediate_size (--intermediate)" \
            "--attn-interval 2||layer 1's kind" \
            "--cp 2 --attn-interval 2|--cp 2 --attn-interval 4|layer 1's kind" \
            "--attn-heads 4 --kv-heads 2||num_attention_heads (--attn-heads)" \
            "--layer-types linear,linear,full,linear|--layer-types linear,linear,linear,full|layer 2's kind" \
            "--cp 2 --lr 3e-3|--cp 2 --lr 1e-3|--lr: rank 1 has 0.001, rank 0 has 0.003" \
            "--clip 0.5||--clip" \
            "--model tiny-moe|--model tiny-moe --experts 4|num_experts (--experts)" \
            "--model tiny-moe --router-aux-coef 0.01|--model tiny-moe|--router-aux-coef" \
            "--data $logs/mpmd_other.txt||the --data file" \
            "--data $logs/mpmd_tail.txt||the --data file" \
            "--init tests/data/qwen35_moe_tiny|--init $logs/mpmd_moe_swapped|the starting weights" \
            "--init tests/data/qwen35_moe_tiny --ep 2|--init $logs/mpmd_moe_swapped --ep 2|the checkpoint (a digest" \
            "--resume $ck --steps 3|--resume $logs/mpmd_ckpt_b --steps 3|the AdamW moments" \
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
if OMPI_MCA_btl_vader_single_copy_mechanism=none timeout 120 $MPIEXEC -n 1 $L "${T[@]}" --resume "$ck" --steps 3 : -n 1 $L \
     "${T[@]}" --resume "$logs/mpmd_ckpt_b" --steps 3 >"$logs/mpmd.log" 2>&1; then got=0; else got=$?; fi
cp "$ck/optimizer.safetensors" "$logs/mpmd_ckpt_b/"   # the copy made equal again: the control
if [ "$got" = 1 ] && OMPI_MCA_btl_vader_single_copy_mechanism=none timeout 120 $MPIEXEC -n 1 $L "${T[@]}" --resume "$ck" \
     --steps 3 : -n 1 $L "${T[@]}" --resume "$logs/mpmd_ckpt_b" --steps 3 >"$logs/mpmd.log" 2>&1 && grep -q "step     3/3" "$logs/mpmd.log"; then
  echo "PASS  gdncp train MPMD control: two equal copies of a checkpoint resume (refused while their moments differed)"; passed=$((passed + 1))
else echo "FAIL  gdncp train MPMD control: equal copies of a checkpoint did not resume"; cat "$logs/mpmd.log"; failed=$((failed + 1)); fi
finish
