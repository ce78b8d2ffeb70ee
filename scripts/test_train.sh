#!/usr/bin/env bash
# gdncp train and sample end to end, small enough for CI (seconds per run): the same losses over
# CP = 1, 2, 3 and DP x CP = 2 x 2 as on one rank, resume = uninterrupted, checkpoints that load,
# bad input refused with a message; every comparison beside a negative control that must fail it.
# Usage: scripts/test_train.sh BUILD_DIR. Ends with "N passed, N failed"; exits 1 on a failure.
. "$(dirname "$0")/test_train_common.sh"

# A small model with every piece (the tests' size, not a named one).
small=(--hidden 32 --layers 2 --intermediate 64 --key-heads 1 --value-heads 2 --key-dim 16 --value-dim 16
       --seq 66 --warmup 2 --lr 3e-3 --eval-every 0 --threads 1)

echo "== the same losses on any grid (4 steps; fp32, rounding only: tolerance 2e-5)"
train 1 "$work/cp1.csv" --steps 4 --batch 2 || fail "train on 1 rank"
for d in 2 3; do
  train "$d" "$work/cp$d.csv" --steps 4 --batch 2 --cp "$d" || fail "train --cp $d"
  expect_close "--cp $d vs one rank" "$work/cp$d.csv" "$work/cp1.csv" 2e-5
done
train 3 "$work/cp3r.csv" --steps 4 --batch 2 --cp 3 --strategy relay --recompute on || fail "train --cp 3 relay"
expect_close "--cp 3 --strategy relay --recompute on vs one rank" "$work/cp3r.csv" "$work/cp1.csv" 2e-5
GDNCP_MUTATE="cp: incoming state dropped" train 2 "$work/drop.csv" --steps 4 --batch 2 --cp 2 || fail "train incoming state dropped"
expect_far "--cp 2 with the incoming state dropped" "$work/drop.csv" "$work/cp1.csv" 2e-5
train 4 "$work/dp2cp2.csv" --steps 4 --batch 1 --cp 2 || fail "train DP 2 x CP 2"
expect_close "DP 2 x CP 2 (--batch 1 each) vs one rank --batch 2" "$work/dp2cp2.csv" "$work/cp1.csv" 2e-5
train 2 "$work/dp2.csv" --steps 4 --batch 1 --cp 1 --seed 99 || fail "train DP 2, other seed"
expect_far "DP 2 with another --seed (other text windows)" "$work/dp2.csv" "$work/cp1.csv" 2e-5

if [ -n "${GDN_TRAIN_ONLY_GRIDS:-}" ]; then echo "$passed passed, $failed failed"; [ "$failed" -eq 0 ]; exit; fi

echo "== packed documents (--pack): the same losses on any grid; no separator found = not packing"
# fortunes end each fortune with a line "%": sequences of 300 bytes hold one or two starts
pk=(--seq 300 --steps 4 --batch 2 --pack '\n%\n')
train 1 "$work/pk1.csv" "${pk[@]}" || fail "train --pack on 1 rank"
grep -q "packed documents, each ending with the 3 bytes 0a250a" "$work/pk1.csv.out" &&
  pass "--pack '\\n%\\n' is read as the 3 bytes 0a 25 0a" || fail "--pack separator not reported as 0a250a"
train 2 "$work/pk2.csv" "${pk[@]}" --cp 2 || fail "train --pack --cp 2"
expect_close "--pack, --cp 2 vs one rank" "$work/pk2.csv" "$work/pk1.csv" 2e-5
train 3 "$work/pk3.csv" "${pk[@]}" --cp 3 --strategy relay --recompute on || fail "train --pack --cp 3 relay"
expect_close "--pack, --cp 3 --strategy relay --recompute on vs one rank" "$work/pk3.csv" "$work/pk1.csv" 2e-5
train 4 "$work/pk22.csv" --seq 300 --steps 4 --batch 1 --pack '\n%\n' --cp 2 || fail "train --pack DP 2 x CP 2"
expect_close "--pack, DP 2 x CP 2 (--batch 1 each) vs one rank --batch 2" "$work/pk22.csv" "$work/pk1.csv" 2e-5
train 1 "$work/pkh1.csv" "${pk[@]}" --key-heads 2 || fail "train --pack, 2 key heads, 1 rank"
train 2 "$work/pkh2.csv" "${pk[@]}" --key-heads 2 --cp 2 --strategy heads || fail "train --pack --cp 2 --strategy heads"
expect_close "--pack, --cp 2 --strategy heads (2 key heads) vs one rank" "$work/pkh2.csv" "$work/pkh1.csv" 2e-5
train 1 "$work/nopk.csv" --seq 300 --steps 4 --batch 2 || fail "train without --pack"
expect_far "the same windows without --pack (no resets, every byte predicted)" "$work/nopk.csv" "$work/pk1.csv" 2e-5
train 2 "$work/pkx.csv" --seq 300 --steps 4 --batch 2 --cp 2 --pack '\x01' || fail "train --pack with an absent separator"
expect_close "--pack '\\x01' (never in the text: one document per window) --cp 2 vs no --pack" "$work/pkx.csv" "$work/nopk.csv" 2e-5
train 1 "$work/pkr.csv" "${pk[@]}" --out "$work/pkck" || fail "train --pack --out"
refuse "resume a --pack checkpoint without --pack" "different --pack" \
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --seq 300 --steps 8 --resume "$work/pkck"
refuse "resume a --pack checkpoint with another separator" "different --pack" \
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --seq 300 --steps 8 --resume "$work/pkck" --pack '\n'
# sample stops at the end of a document: the checkpoint's separator set to the byte greedy
# decoding writes first, so the stop is certain; --stop none as the control
cp -r "$work/pkck/checkpoint-00000004" "$work/pkstop"
first=$($g sample --ckpt "$work/pkstop" --prompt "The " --tokens 1 --temperature 0 --stop none 2>/dev/null | head -c 5 | tail -c 1 | od -An -tx1 | tr -d ' \n')
sed -i "s/\"pack_separator_hex\": \"[0-9a-f]*\"/\"pack_separator_hex\": \"$first\"/" "$work/pkstop/trainer_state.json"
$g sample --ckpt "$work/pkstop" --prompt "The " --tokens 40 --temperature 0 >/dev/null 2>"$work/stop.err"
grep -q "+ 1 new.*stopped at the end of the document" "$work/stop.err" &&
  pass "sample from a --pack checkpoint stops once it writes the separator (hex $first, its first byte)" ||
  { fail "sample did not stop at the separator $first"; cat "$work/stop.err"; }
$g sample --ckpt "$work/pkstop" --prompt "The " --tokens 40 --temperature 0 --stop none >/dev/null 2>"$work/stop.err"
grep -q "+ 40 new" "$work/stop.err" && ! grep -q stopped "$work/stop.err" &&
  pass "negative control: --stop none writes all 40 bytes" || { fail "--stop none"; cat "$work/stop.err"; }
refuse "--pack ''" "non-empty" $MPIEXEC -n 1 $g train --data "$text" --pack ''
refuse "--pack with an unknown escape" "unknown escape" $MPIEXEC -n 1 $g train --data "$text" --pack '\q'
refuse "--pack with a NUL byte" "NUL" $MPIEXEC -n 1 $g train --data "$text" --pack 'a\x00'
refuse "ranks launched with different --pack (MPMD)" "disagree.*--pack" \
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --steps 1 --pack '\n' : -n 1 $g train --data "$text" "${small[@]}" --steps 1 --pack '%'

echo "== checkpoints: resume repeats the uninterrupted run exactly"
train 2 "$work/full.csv" --steps 6 --batch 2 --cp 2 --out "$work/full" --save-every 3 --keep 0 || fail "train 6 steps"
mkdir -p "$work/part" && cp -r "$work/full/checkpoint-00000003" "$work/part/"
train 2 "$work/resumed.csv" --steps 6 --batch 2 --cp 2 --resume "$work/part" --out "$work/part" || fail "resume"
if [ "$(tail -n +5 "$work/full.csv" | cut -d, -f2)" = "$(tail -n +2 "$work/resumed.csv" | cut -d, -f2)" ] &&
   [ "$(tail -n +2 "$work/resumed.csv" | wc -l)" = 3 ]; then
  pass "resume from step 3: steps 4-6 have bit-identical losses ($(tail -n +2 "$work/resumed.csv" | cut -d, -f2 | tr '\n' ' '))"
else fail "resume from step 3 differs:"; paste -d' ' "$work/full.csv" "$work/resumed.csv"; fi
train 2 "$work/init.csv" --steps 6 --batch 2 --cp 2 --init "$work/part/checkpoint-00000003" || fail "init"
expect_far "--init (the weights, a fresh optimiser and schedule) vs the uninterrupted run" "$work/init.csv" "$work/full.csv" 1e-4
s1=$($g sample --ckpt "$work/full" --prompt "The " --tokens 40 --temperature 0 2>/dev/null)
s2=$($g sample --ckpt "$work/full/checkpoint-00000006" --prompt "The " --tokens 40 --temperature 0 2>/dev/null)
s3=$($g sample --ckpt "$work/full/checkpoint-00000003" --prompt "The " --tokens 40 --temperature 0 2>/dev/null)
if [ -n "$s1" ] && [ "$s1" = "$s2" ]; then pass "sample from the newest checkpoint (greedy) is reproducible: $(printf %q "$s1")"
else fail "sample: '$s1' vs '$s2'"; fi
if [ "$s1" != "$s3" ]; then pass "negative control: sample from step 3's weights differs"
else fail "negative control: step 3 and 6 sample the same text"; fi
# a run never replaces or prunes another run's checkpoints: a new run into $work/full (whose
# steps 3 and 6 it would replace, and prune with --keep 1) is refused, the directory unchanged;
# the same run resumed there goes on (its own checkpoints pruned)
before=$(ls "$work/full" | tr '\n' ' '); sum6=$(md5sum < "$work/full/checkpoint-00000006/model.safetensors")
refuse "a new run into a directory of another run's checkpoints" "another run's checkpoint" \
  $MPIEXEC -n 2 $g train --data "$text" "${small[@]}" --steps 6 --batch 2 --cp 2 --save-every 3 --keep 1 --out "$work/full"
if [ "$(ls "$work/full" | tr '\n' ' ')" = "$before" ] && [ "$(md5sum < "$work/full/checkpoint-00000006/model.safetensors")" = "$sum6" ]; then
  pass "the refused run left $work/full as it was ($before)"
else fail "the refused run changed $work/full: $(ls "$work/full")"; fi
cp -r "$work/full" "$work/own"
if train 2 "$work/own.csv" --steps 8 --batch 2 --cp 2 --resume "$work/own" --out "$work/own" --save-every 1 --keep 2 &&
   [ "$(ls "$work/own" | tr '\n' ' ')" = "checkpoint-00000007 checkpoint-00000008 " ]; then
  pass "the run resumed in its own directory saves and prunes its own checkpoints (kept: $(ls "$work/own" | tr '\n' ' '))"
else fail "resume into its own directory: $(ls "$work/own" | tr '\n' ' ')"; cat "$work/own.csv.out"; fi
# the newest checkpoint losing a file afterwards: the newest complete one is used, and that is said
rm -f "$work/own/checkpoint-00000008/model.safetensors"
if $g sample --ckpt "$work/own" --prompt "a" --tokens 2 >/dev/null 2>"$work/own.err" &&
   grep -q "checkpoint-00000008: no complete checkpoint.*model.safetensors is missing.*using checkpoint-00000007" "$work/own.err"; then
  pass "a newest checkpoint that lost its model.safetensors: passed over for checkpoint-00000007, and said"
else fail "the incomplete newest checkpoint was not said"; cat "$work/own.err"; fi
# another run's checkpoint appearing beside this run's (a higher step) is never pruned or loaded as this run's
mkdir -p "$work/mix"; train 1 "$work/mix1.csv" --steps 2 --save-every 1 --keep 0 --out "$work/mix/a" || fail "mix a"
train 1 "$work/mix2.csv" --steps 2 --save-every 1 --keep 0 --seed 7 --out "$work/mix/b" || fail "mix b"
cp -r "$work/mix/b/checkpoint-00000002" "$work/mix/a/checkpoint-00000099"
refuse "a resume whose --out also holds another run's checkpoint" "another run's checkpoint" \
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --steps 4 --resume "$work/mix/a/checkpoint-00000002" --out "$work/mix/a" --keep 1

echo "== bad input: a clear error, never a crash or a hang"
: > "$work/empty.txt"; head -c 5000 /dev/urandom > "$work/binary.bin"; mkdir -p "$work/adir"
refuse "missing --data file" "no such file|cannot open" $MPIEXEC -n 1 $g train --data "$work/nope.txt"
refuse "empty --data file" "empty" $MPIEXEC -n 1 $g train --data "$work/empty.txt"
refuse "binary --data file" "NUL|not text|control" $MPIEXEC -n 1 $g train --data "$work/binary.bin"
refuse "a directory as --data" "regular file|directory" $MPIEXEC -n 1 $g train --data "$work/adir"
refuse "a sequence shorter than the grid" "too short" $MPIEXEC -n 3 $g train --data "$text" --cp 3 --seq 2 --steps 1
refuse "world size not divisible by --cp" "not divisible" $MPIEXEC -n 3 $g train --data "$text" --cp 2 --steps 1
refuse "text shorter than a sequence" "needs" $MPIEXEC -n 1 $g train --data "$text" --seq 100000000 --steps 1 --eval-every 0
refuse "--lr nan" "--lr" $MPIEXEC -n 2 $g train --data "$text" --lr nan
refuse "ranks launched with different --seq (MPMD)" "disagree" \
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --seq 64 --steps 1 : -n 1 $g train --data "$text" "${small[@]}" --seq 32 --steps 1
refuse "ranks launched with a bad option on one rank only (MPMD)" "--steps|failed" \
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --steps x : -n 1 $g train --data "$text" "${small[@]}" --steps 1
refuse "resume with another --seq" "cannot resume.*--seq" \
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --seq 50 --steps 8 --resume "$work/full"
# (--init from transformers' hybrid checkpoint, and hybrid refusals: scripts/test_train_hybrid.sh)
cp -r "$work/full/checkpoint-00000006" "$work/trunc"
truncate -s 5000 "$work/trunc/model.safetensors"
refuse "a truncated model.safetensors" "model.safetensors" $g sample --ckpt "$work/trunc" --prompt a
cp -r "$work/full/checkpoint-00000006" "$work/mism"
sed -i 's/"hidden_size": 32/"hidden_size": 48/' "$work/mism/config.json"
refuse "a config.json that does not match the weights" "shape|hidden|\[" $g sample --ckpt "$work/mism" --prompt a
refuse "sample with an empty prompt" "prompt" $g sample --ckpt "$work/full" --prompt ""

echo "== killed while writing checkpoints: the newest complete one always loads"
for delay in 0.7 1.3 1.9; do
  rm -rf "$work/kill"
  $MPIEXEC -n 1 $g train --data "$text" "${small[@]}" --hidden 64 --intermediate 256 --steps 100000 \
    --save-every 1 --keep 2 --out "$work/kill" >/dev/null 2>&1 &
  pid=$!
  sleep "$delay"; pkill -9 -f "gdncp train --data $text" ; wait "$pid" 2>/dev/null
  if [ ! -d "$work/kill" ] || ! ls "$work/kill" | grep -q '^checkpoint-'; then
    pass "kill -9 after ${delay}s: no checkpoint written yet, nothing to lose"; continue; fi
  if $g sample --ckpt "$work/kill" --prompt "a" --tokens 5 >/dev/null 2>"$work/kill.err"; then
    pass "kill -9 after ${delay}s: the newest complete checkpoint loads ($(ls "$work/kill" | grep -c '^checkpoint-') complete, $(ls -a "$work/kill" | grep -c '^\.checkpoint') leftover)"
  else fail "kill -9 after ${delay}s: $(cat "$work/kill.err")"; fi
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
