#!/usr/bin/env bash
# The main job: train the byte-level hybrid language model (`tiny`: Qwen3.5's stack, layers
# GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, gated full attention) on real English text (Debian's
# fortunes) with its sequences split over 2 MPI ranks (context parallelism), printing the falling
# losses, then plot them, sample from the checkpoint, show that the split run's losses are the
# single-rank run's (and that dropping the GatedDeltaNet state passed between the ranks, or the
# attention's keys and values of the earlier rank, changes them), the
# same with packed documents (--pack), and finally run the kernel and layer demo
# (scripts/demo_cp.sh).
# Outputs stay in demo-out/: train.csv, loss.png, ckpt/checkpoint-N/ (transformers' layout).
# GDN_DEMO_STEPS (default 800) sets the training length; GDN_DEMO_SKIP_CP=1 skips demo_cp.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bd=${GDN_DEMO_BUILD:-build}
bash scripts/deps.sh
bash scripts/build.sh "$bd"
g=./$bd/gdncp
out=demo-out
steps=${GDN_DEMO_STEPS:-800}
rm -rf "$out" && mkdir -p "$out"
text=$out/fortunes.txt
bash scripts/fortunes_text.sh "$text"
echo "== text: $(wc -c < "$text") bytes of English from Debian's fortunes package (the last 5 % held out for validation)"

echo "== train the hybrid 'tiny' (3 GatedDeltaNet + 1 attention layer) for $steps steps: 8 sequences of 512 bytes per step, each split over 2 ranks (256 tokens each)"
# a full line every 50 steps and at each validation (the CSV keeps every step); on a terminal, one
# status line (step, loss, tokens/s, elapsed, ETA) updates in place between them
progress=lines; [ -t 1 ] && progress=line
OMP_NUM_THREADS=1 mpiexec.mpich -n 2 "$g" train --data "$text" --model tiny --cp 2 --seq 512 --batch 8 \
  --steps "$steps" --warmup 30 --lr 4e-3 --eval-every 50 --eval-seqs 32 --log "$out/train.csv" \
  --out "$out/ckpt" --save-every 100 --seed 1234 --log-every 50 --progress "$progress"
bash scripts/plot_loss.sh "$out/train.csv" "$out/loss.png" "gdncp train: tiny on fortunes, 2 CP ranks"
val=$(awk -F, 'NR > 1 && $3 != "" { v = $3 } END { print v }' "$out/train.csv")
first=$(awk -F, 'NR == 2 { print $2 }' "$out/train.csv")
# measured at 800 steps: 1.81 (the hybrid tiny; the GatedDeltaNet-only tiny of before: 1.86); 2.0 is
# reached near step 300, so the target fails a run that stopped learning but not another CPU's rounding
echo "== loss: $first at step 1 -> validation $val nats per byte at step $steps (target below 2.0; unigram English is ~3)"
if ! awk -v v="$val" 'BEGIN { exit !(v < 2.0) }'; then
  echo "demo: FAILED: validation loss $val did not fall below 2.0" >&2; exit 1
fi

echo "== sample from the checkpoint (the layers' decode path, temperature 0.7)"
"$g" sample --ckpt "$out/ckpt" --prompt "The meaning of life is" --tokens 300 --temperature 0.7 --seed 7

echo "== exactness: 10 steps of 8 x 64 bytes on 1 rank, on 2 CP ranks, and on 2 ranks deliberately wrong:"
echo "   GDNCP_MUTATE='cp: incoming state dropped' (the GatedDeltaNet state not passed on) and"
echo "   GDNCP_MUTATE='attention cp: keys and values of earlier ranks dropped' (the attention"
echo "   layer not attending to the earlier rank's keys and values); their losses must differ, or the check"
echo "   proves nothing"
for run in "1 one" "2 cp2" "2 dropped" "2 dropkv"; do
  set -- $run
  extra=(); [ "$2" != one ] && extra=(--cp 2); mutate=
  [ "$2" = dropped ] && mutate="cp: incoming state dropped"
  [ "$2" = dropkv ] && mutate="attention cp: keys and values of earlier ranks dropped"
  GDNCP_MUTATE=$mutate OMP_NUM_THREADS=1 mpiexec.mpich -n "$1" "$g" train --data "$text" --model tiny --seq 64 --batch 8 --steps 10 \
    --eval-every 0 --log "$out/exact_$2.csv" "${extra[@]}" > /dev/null
done
cmp_losses() { # the largest relative difference of the loss column of two logs
  paste -d, "$1" "$2" | awk -F, 'NR > 1 { n = NF / 2; d = ($2 - $(n + 2)) / $(n + 2); if (d < 0) d = -d; if (d > m) m = d }
                                 END { printf "%.2e", m }'
}
same=$(cmp_losses "$out/exact_cp2.csv" "$out/exact_one.csv")
dropped=$(cmp_losses "$out/exact_dropped.csv" "$out/exact_one.csv")
dropkv=$(cmp_losses "$out/exact_dropkv.csv" "$out/exact_one.csv")
echo "   2 CP ranks vs 1 rank: largest relative loss difference $same (tolerance 2e-5: rounding only)"
echo "   incoming state dropped vs 1 rank: $dropped (must exceed 2e-5)"
echo "   earlier rank's keys and values dropped vs 1 rank: $dropkv (must exceed 2e-5)"
if ! awk -v a="$same" -v b="$dropped" -v c="$dropkv" 'BEGIN { exit !(a <= 2e-5 && b > 2e-5 && c > 2e-5) }'; then
  echo "demo: FAILED: the split run does not match the single-rank run, or a negative control passed" >&2; exit 1
fi

echo "== packed documents: 10 steps of 8 x 256 bytes with --pack '\\n%\\n' (each fortune its own document:"
echo "   the state, the conv and the attention restart after every '%' line, and no loss crosses one), 1 rank vs 2 CP ranks"
for n in 1 2; do
  OMP_NUM_THREADS=1 mpiexec.mpich -n "$n" "$g" train --data "$text" --model tiny --seq 256 --batch 8 --steps 10 \
    --eval-every 0 --cp "$n" --pack '\n%\n' --log "$out/packed_$n.csv" > /dev/null
done
same_packed=$(cmp_losses "$out/packed_2.csv" "$out/packed_1.csv")
echo "   2 CP ranks vs 1 rank, packed: largest relative loss difference $same_packed (tolerance 2e-5)"
if ! awk -v a="$same_packed" 'BEGIN { exit !(a <= 2e-5) }'; then
  echo "demo: FAILED: the packed split run does not match the single-rank run" >&2; exit 1
fi

echo "== done: $out/train.csv, $out/loss.png, $(ls -d "$out"/ckpt/checkpoint-* | tail -1) (config.json + model.safetensors: transformers' Qwen3.5 layout)"
if [ -z "${GDN_DEMO_SKIP_CP:-}" ]; then
  echo
  echo "==== the kernel and layer under context parallelism (scripts/demo_cp.sh)"
  GDN_DEMO_BUILD="$bd" GDN_DEMO_T="${GDN_DEMO_T:-16384}" bash scripts/demo_cp.sh
fi
