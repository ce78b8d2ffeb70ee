#!/usr/bin/env bash
# gdncp train --zero (DESIGN §15, the training state sharded over the ranks replicating it): levels
# 1, 2 and 3 give the unsharded run's losses and weights over N = 2, 3 (uneven slices) and 4 ranks,
# with tied embeddings and under --ep, bit for bit the same run to run; a failure on one rank in
# the forward or the backward stops every rank at every level, with no hang; checkpoints written in parallel resume onto another
# number of ranks and level (sharded -> unsharded -> sharded) exactly as the uninterrupted run;
# bad input is refused on every rank with no hang and the previous checkpoint intact. Every
# comparison beside a negative control that must fail it.
# Usage: scripts/test_train_zero.sh BUILD_DIR. Ends with "N passed, N failed"; exits 1 on a failure.
. "$(dirname "$0")/test_train_common.sh"

# The test model of test_train.sh: 37,832 parameters (N = 3 does not divide the runs' lengths)
small=(--hidden 32 --layers 2 --intermediate 64 --key-heads 1 --value-heads 2 --key-dim 16 --value-dim 16
       --seq 66 --warmup 2 --lr 3e-3 --eval-every 0 --threads 1 --steps 10)
# Tolerance: the same sums, in the same order at every level with MPICH (losses and weights equal
# bit for bit); Open MPI's non-blocking reduce-scatter (levels 2, 3) associates differently from its
# blocking one (levels 0, 1): the losses still agree to 1e-6, the weights after 10 steps to 5.8e-6
# of each tensor's largest (measured at N = 4 and under --ep; AdamW's first steps divide tiny
# gradients by their own size). The controls move the losses by 1e-3 and more.
TOL=1e-6 WTOL=2e-5
weights_close() { # weights_close LABEL A B: every tensor of A's model.safetensors within WTOL of B's
  if cmp -s "$2/model.safetensors" "$3/model.safetensors"; then pass "$1: every weight bit for bit"; return; fi
  if $g diff "$2/model.safetensors" "$3/model.safetensors" --tol $WTOL >"$work/diff.out" 2>&1; then
    pass "$1: every weight within $WTOL ($(grep -c ' ok ' "$work/diff.out") tensors)"
  else fail "$1: weights differ"; grep OVER "$work/diff.out" | head -5; fi
}
last() { echo "$1/checkpoint-$(printf %08d "$2")"; }

echo "== levels 1, 2 and 3 = level 0 on the same grid (10 steps, fp32; tolerance $TOL on losses and weights)"
for grid in "2 --batch 1" "3 --batch 2 --cp 3" "4 --batch 1 --cp 2"; do
  read -r n rest <<< "$grid"
  train "$n" "$work/z0_$n.csv" $rest --out "$work/z0_$n" || fail "train --zero 0 on $n ranks"
  for z in 1 2 3; do
    train "$n" "$work/z${z}_$n.csv" $rest --zero $z --out "$work/z${z}_$n" || fail "train --zero $z on $n ranks"
    expect_close "--zero $z on $n ranks ($rest) vs --zero 0" "$work/z${z}_$n.csv" "$work/z0_$n.csv" $TOL
    weights_close "--zero $z on $n ranks, step 10" "$(last "$work/z${z}_$n" 10)" "$(last "$work/z0_$n" 10)"
  done
done
grep -q "AdamW moments .*(--zero 2: the moments of this rank's slices" "$work/z2_3.csv.out" &&
  pass "the start-up line gives each rank's memory at its level" || { fail "no memory line"; cat "$work/z2_3.csv.out"; }
train 3 "$work/again.csv" --batch 2 --cp 3 --zero 2 --out "$work/again" || fail "train --zero 2 again"
if cmp -s "$(last "$work/again" 10)/model.safetensors" "$(last "$work/z2_3" 10)/model.safetensors" &&
   cmp -s "$(last "$work/again" 10)/optimizer.safetensors" "$(last "$work/z2_3" 10)/optimizer.safetensors"; then
  pass "--zero 2 on 3 ranks twice: the same weights and moments bit for bit"
else fail "--zero 2 run to run: the checkpoints differ"; fi
for zm in "2:zero: a slice updated twice" "2:zero: one rank's gradient slice left out" \
          "1:zero: the updated weights not gathered (the other ranks' slices a step stale)" \
          "3:zero: a gathered layer stale by one step" "3:zero: one rank's gradient slice left out"; do
  z=${zm%%:*} m=${zm#*:}
  GDNCP_MUTATE="$m" train 3 "$work/mut.csv" --batch 2 --cp 3 --zero "$z" || fail "train GDNCP_MUTATE='$m'"
  expect_far "--zero $z on 3 ranks with '$m'" "$work/mut.csv" "$work/z0_3.csv" $TOL
done
echo "== tied embeddings (lm_head is the embedding: its unit gathered twice a forward), level 3 on DP 2"
tied=(--model qwen3.5-0.8b --layers 4 --hidden 32 --intermediate 64 --key-heads 1 --value-heads 2 --key-dim 16
      --value-dim 16 --attn-heads 2 --kv-heads 1 --head-dim 16 --vocab 256 --steps 6 --batch 1 --seq 64)
train 2 "$work/t0.csv" "${tied[@]}" --out "$work/t0" || fail "train tied --zero 0"
train 2 "$work/t3.csv" "${tied[@]}" --zero 3 --out "$work/t3" || fail "train tied --zero 3"
expect_close "tied embeddings, hybrid LLLF, --zero 3 vs --zero 0" "$work/t3.csv" "$work/t0.csv" $TOL
weights_close "tied embeddings, --zero 3, step 6" "$(last "$work/t3" 6)" "$(last "$work/t0" 6)"

echo "== expert parallelism: --ep 2 on 4 ranks, the experts' state sharded over their 2 replicas"
moe=(--model tiny-moe --seq 64 --batch 1 --ep 2 --steps 4)
small=(--warmup 2 --eval-every 0 --threads 1)
train 4 "$work/e0.csv" "${moe[@]}" --out "$work/e0" || fail "train --ep 2"
for z in 2 3; do
  train 4 "$work/e$z.csv" "${moe[@]}" --zero $z --out "$work/e$z" || fail "train --ep 2 --zero $z"
  expect_close "--ep 2 --zero $z vs --ep 2" "$work/e$z.csv" "$work/e0.csv" $TOL
  weights_close "--ep 2 --zero $z, step 4 (every expert in transformers' layout)" "$(last "$work/e$z" 4)" "$(last "$work/e0" 4)"
done
GDNCP_MUTATE="train: expert gradients not summed over their replicas" train 4 "$work/emut.csv" "${moe[@]}" --zero 3 ||
  fail "train --ep 2 --zero 3, experts' gradients not summed"
expect_far "--ep 2 --zero 3 with the experts' gradients not summed over their replicas" "$work/emut.csv" "$work/e0.csv" $TOL

echo "== resume onto another grid and level: sharded -> unsharded -> sharded equals the uninterrupted run"
small=(--hidden 32 --layers 2 --intermediate 64 --key-heads 1 --value-heads 2 --key-dim 16 --value-dim 16
       --seq 66 --warmup 2 --lr 3e-3 --eval-every 0 --threads 1 --steps 9)
train 2 "$work/full.csv" --batch 1 --zero 2 --save-dtype bf16 --out "$work/full" --save-every 3 --keep 0 ||
  fail "train 9 steps --zero 2"
mkdir -p "$work/p1" && cp -r "$(last "$work/full" 3)" "$work/p1/"
train 1 "$work/r1.csv" --batch 2 --resume "$work/p1" --out "$work/p1" --save-every 3 || fail "resume on 1 rank, --zero 0"
mkdir -p "$work/p2" && cp -r "$(last "$work/p1" 6)" "$work/p2/"
train 3 "$work/r2.csv" --batch 2 --cp 3 --zero 3 --resume "$work/p2" || fail "resume on 3 ranks, --zero 3"
grep -E '^[4-6],' "$work/r1.csv" > "$work/resumed.csv"; grep -E '^[7-9],' "$work/r2.csv" >> "$work/resumed.csv"
if [ "$(tail -n +5 "$work/full.csv" | cut -d, -f1,2)" = "$(grep -E '^[4-9],' "$work/resumed.csv" | cut -d, -f1,2 | sort -n -u)" ]; then
  pass "steps 4-6 on 1 rank (--zero 0) from --zero 2's step 3 (BF16 weights, fp32 masters), 7-9 on 3 ranks (--zero 3) from that: the uninterrupted losses to the printed digits"
else fail "the resumed losses differ:"; paste -d' ' "$work/full.csv" "$work/resumed.csv"; fi
mkdir -p "$work/p3" && cp -r "$(last "$work/full" 3)" "$work/p3/"
cp "$(last "$work/full" 6)/optimizer.safetensors" "$(last "$work/p3" 3)/"
refuse "resume (sharded) with another save's optimizer.safetensors (its masters do not round to the weights)" \
  "different saves" $MPIEXEC -n 2 $g train --data "$text" "${small[@]}" --batch 1 --zero 1 --resume "$work/p3"
cp -r "$(last "$work/full" 3)" "$work/p4" && truncate -s 20000 "$work/p4/optimizer.safetensors"
refuse "resume (sharded) from a truncated optimizer.safetensors" "optimizer.safetensors" \
  $MPIEXEC -n 2 $g train --data "$text" "${small[@]}" --batch 1 --zero 2 --resume "$work/p4"
cp -r "$(last "$work/full" 3)" "$work/p5" && rm "$work/p5/optimizer.safetensors"
refuse "resume (sharded) without the optimizer state" "optimizer state is missing" \
  $MPIEXEC -n 2 $g train --data "$text" "${small[@]}" --batch 1 --zero 2 --resume "$work/p5"

echo "== bad input: a message on every rank, no hang, the previous checkpoint intact"
refuse "--zero 4" "--zero" $MPIEXEC -n 2 $g train --data "$text" "${small[@]}" --zero 4
refuse "ranks launched with different --zero (MPMD)" "disagree.*--zero" \
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --zero 1 : -n 1 $g train --data "$text" "${small[@]}" --zero 2
refuse "a run that does not fit the node's memory (qwen3.5-2b, 30 GB of state, at 4M tokens)" \
  "needs .* on this node .*moments .*available" $MPIEXEC -n 1 $g train --data "$text" --model qwen3.5-2b --seq 4000000 --batch 8
for z in 0 1 2 3; do
  for f in "forward fails at its last layer" "backward fails at its first layer"; do
    refuse "--zero $z, DP 3: rank 2's $f (MPMD): every rank stops" "rank 2 failed" \
      $MPIEXEC -n 2 $g train --data "$text" "${small[@]}" --batch 1 --zero $z \
      : -n 1 env GDNCP_MUTATE="model: this rank's $f (a fault)" $g train --data "$text" "${small[@]}" --batch 1 --zero $z
  done
done
mkdir -p "$work/disk" && cp -r "$(last "$work/full" 3)" "$work/disk/"
before=$(cat "$(last "$work/disk" 3)"/*.safetensors | md5sum)
refuse "one rank's checkpoint write fails (a full disk, MPMD: that rank only)" "no space" \
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --batch 1 --zero 2 --resume "$work/disk" --out "$work/disk" \
  : -n 1 env GDNCP_MUTATE="ckpt part: this process's write fails (as on a full disk)" \
  $g train --data "$text" "${small[@]}" --batch 1 --zero 2 --resume "$work/disk" --out "$work/disk"
if [ "$(ls "$work/disk")" = "checkpoint-00000003" ] && [ "$(cat "$(last "$work/disk" 3)"/*.safetensors | md5sum)" = "$before" ] &&
   [ -z "$(ls -A "$work/disk" | grep '^\.')" ]; then
  pass "after the failed save: the previous checkpoint alone and unchanged, no temporary left"
else fail "after the failed save: $(ls -A "$work/disk" | tr '\n' ' ')"; fi
train 2 "$work/ok.csv" --batch 1 --zero 2 --resume "$work/disk" --out "$work/disk" || fail "the same resume without the fault"
[ -d "$(last "$work/disk" 9)" ] && pass "control: the same run without the fault saves step 9" ||
  { fail "control: no step 9"; cat "$work/ok.csv.out"; }

finish
