#!/usr/bin/env bash
# The sharded training state's cost (DESIGN §15, gdncp train --zero): the same run at levels 0-3
# on N ranks, alternated over ROUNDS rounds, each level's median step time (steps 2.., the first
# warms up), its ratio to level 0's from the same rounds, the fraction of the peak the trainer
# measured in the same run, the bytes each rank moved a step, every rank's peak RSS, and the
# losses against level 0's (the oracle here: the unsharded run, equal bit for bit).
# Usage: scripts/bench_zero.sh [BUILD_DIR] [N] [ROUNDS] -- [gdncp train options]
#   default: build 2 3 -- --model qwen3.5-0.8b --layers 4 --seq 1024 --cp 2 --batch 1 --steps 6
set -uo pipefail
cd "$(dirname "$0")/.."
bd=${1:-build}; n=${2:-2}; rounds=${3:-3}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
opts=("$@"); [ ${#opts[@]} -eq 0 ] && opts=(--model qwen3.5-0.8b --layers 4 --seq 1024 --cp 2 --batch 1 --steps 6)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
bash scripts/fortunes_text.sh "$work/text.txt" >/dev/null 2>&1 || { echo "no fortunes text"; exit 1; }
echo "gdncp train ${opts[*]} on $n ranks, levels 0-3 alternated over $rounds rounds; CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) cores"
for r in $(seq 1 "$rounds"); do
  for z in 0 1 2 3; do
    OMP_NUM_THREADS=1 ${MPIEXEC:-mpiexec.mpich} -n "$n" "$bd/gdncp" train --data "$work/text.txt" --eval-every 0 \
      "${opts[@]}" --zero "$z" --log "$work/z$z.r$r.csv" > "$work/z$z.r$r.out" 2>&1 ||
      { echo "level $z round $r failed:"; tail -3 "$work/z$z.r$r.out"; exit 1; }
  done
done
median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
ms0=$(for r in $(seq 1 "$rounds"); do tail -n +3 "$work/z0.r$r.csv" | cut -d, -f8; done | median)
printf "%-6s %10s %8s %8s %10s %14s %s\n" level "ms/step" "x lvl 0" "% peak" "tok/s" "moved a step" "peak RSS MB (each rank), losses vs level 0"
for z in 0 1 2 3; do
  ms=$(for r in $(seq 1 "$rounds"); do tail -n +3 "$work/z$z.r$r.csv" | cut -d, -f8; done | median)
  tps=$(for r in $(seq 1 "$rounds"); do tail -n +3 "$work/z$z.r$r.csv" | cut -d, -f4; done | median)
  peak=$(sed -n 's/.*measured peak \([0-9.]*\) GFLOP.*/\1/p' "$work/z$z.r1.out")
  fpt=$(sed -n 's/.*: \([0-9.e+]*\) FLOP per token.*/\1/p' "$work/z$z.r1.out")
  moved=$(sed -n 's/.*moved \(.*\) a step on the busiest.*/\1/p' "$work/z$z.r1.out")
  rss=$(grep -E '^step' "$work/z$z.r1.out" | tail -1 | sed 's/.*rss MB //')
  same=$(cmp -s <(cut -d, -f2 "$work/z$z.r1.csv") <(cut -d, -f2 "$work/z0.r1.csv") && echo "equal" || echo "DIFFER")
  printf "%-6s %10.1f %8.3f %8.1f %10.0f %14s %s, %s\n" "$z" "$ms" "$(awk -v a="$ms" -v b="$ms0" 'BEGIN { print a / b }')" \
    "$(awk -v t="$tps" -v f="$fpt" -v p="$peak" 'BEGIN { print 100 * t * f / (p * 1e9) }')" "$tps" "$moved" "$rss" "$same"
done
