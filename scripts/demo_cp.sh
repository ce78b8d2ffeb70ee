#!/usr/bin/env bash
# The kernel and layer demo (scripts/demo.sh runs it after training): one long sequence split over several MPI ranks (context parallelism), forward
# and backward, checked tensor by tensor against the single-rank run, with each rank's time
# split, bytes sent and how much the state coming from the earlier ranks changed its outputs;
# beside each comparison a negative control (the incoming state deliberately dropped) that must
# fail it; then the golden files, the Qwen3.5 layer from transformers' checkpoint (single rank,
# over ranks, BF16 decode) and short layer and kernel benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
bd=${GDN_DEMO_BUILD:-build} # build folder (default build/)
bash scripts/deps.sh
bash scripts/build.sh "$bd"
T=${GDN_DEMO_T:-32768}
golden=${GDN_GOLDEN_DIR:-tests/data}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== one sequence of T=$T tokens (B=1, Hk=2, Hv=4, K=V=128, gates like a trained Qwen3.5 layer's:"
echo "   per value head from fast decay, mean g -1, to slow, mean g -1e-5)"
./"$bd"/gdncp gen --gates qwen --T "$T" --out "$work/seq.safetensors"
echo "== single rank, all threads (the reference for the split runs)"
./"$bd"/gdncp run --backward --in "$work/seq.safetensors" --out "$work/single.safetensors"
for spec in "4 scan" "3 allgather" "2 relay" "2 heads"; do
  set -- $spec
  echo "== split over $1 ranks, strategy '$2' (1 thread per rank; this machine has $(nproc) cores)"
  echo "   in_rel: how much the state coming from the earlier ranks changes each rank's outputs"
  OMP_NUM_THREADS=1 mpiexec.mpich -n "$1" ./"$bd"/gdncp run --cp "$2" --backward --stats \
    --in "$work/seq.safetensors" --out "$work/cp.safetensors"
  ./"$bd"/gdncp diff "$work/cp.safetensors" "$work/single.safetensors" --tol 2e-5
  if [ "$2" = heads ]; then
    echo "   (no negative control for 'heads': it forms no per-shard incoming state to drop)"
    continue
  fi
  echo "== negative control: the same run (forward only, to save time) and comparison with the incoming"
  echo "   state dropped (GDNCP_MUTATE='cp: incoming state dropped', deliberately wrong); the comparison must FAIL"
  GDNCP_MUTATE="cp: incoming state dropped" OMP_NUM_THREADS=1 mpiexec.mpich -n "$1" ./"$bd"/gdncp run --cp "$2" \
    --in "$work/seq.safetensors" --out "$work/dropped.safetensors"
  rc=0
  out=$(./"$bd"/gdncp diff "$work/dropped.safetensors" "$work/single.safetensors" --tol 2e-5) || rc=$?
  printf '%s\n' "$out" | sed 's/^/   | /'
  if [ "$rc" -ne 1 ] || ! grep -q '^o  *OVER' <<<"$out"; then
    echo "demo: FAILED: the negative control (incoming state dropped) passed the comparison (diff exit $rc):" >&2
    echo "demo: the check of the split run cannot tell a right answer from a wrong one" >&2
    exit 1
  fi
  echo "   negative control failed the comparison, as it must"
done
if [ -d "$golden" ]; then
  for name in gdn_small gdn_strong_gates gdn_qwen_heads; do
    echo "== golden $name over 3 ranks vs the float64 Hugging Face-semantics reference"
    mpiexec.mpich -n 3 ./"$bd"/gdncp run --cp scan --backward --in "$golden/$name.safetensors" --out "$work/$name.safetensors"
    ./"$bd"/gdncp diff "$work/$name.safetensors" "$golden/$name.safetensors" --tol 2e-5
  done
fi
if [ -d "$golden/qwen35_tiny" ]; then
  tiny=$golden/qwen35_tiny
  tw=(--weights "$tiny/model.safetensors" --config "$tiny/config.json" --prefix model.layers.0.linear_attn.)
  echo "== the Qwen3.5 GatedDeltaNet layer from a checkpoint written by transformers (qwen35_tiny, layer 0):"
  echo "   forward + backward against transformers' own outputs and gradients (its fp32 rule leaves its"
  echo "   A_log / dt_bias gradients ~1e-2 off with these strong gates: tolerance 2e-2 here; README)"
  ./"$bd"/gdncp layer "${tw[@]}" --in "$tiny/layer0.io.safetensors" --out "$work/l0.safetensors" --backward
  ./"$bd"/gdncp diff "$work/l0.safetensors" "$tiny/layer0.io.safetensors" --tol 2e-2
  echo "== the same layer over 3 ranks, shards of 1, 2 and 147 tokens (the conv halo spans two ranks)"
  mpiexec.mpich -n 3 ./"$bd"/gdncp layer "${tw[@]}" --in "$tiny/layer0.io.safetensors" --out "$work/l0cp.safetensors" \
    --backward --cp scan --shards 1,2,147
  ./"$bd"/gdncp diff "$work/l0cp.safetensors" "$work/l0.safetensors" --tol 1e-4
  echo "== BF16 weights kept BF16: prefill 37 tokens, then decode 8 one at a time = the whole sequence at once"
  bw=(--weights "$tiny/model.bf16.safetensors" --config "$tiny/config.json" --prefix model.layers.0.linear_attn.)
  ./"$bd"/gdncp layer "${bw[@]}" --in "$tiny/decode0.io.safetensors" --out "$work/whole.safetensors"
  ./"$bd"/gdncp layer "${bw[@]}" --in "$tiny/decode0.io.safetensors" --out "$work/decode.safetensors" --decode 8
  ./"$bd"/gdncp diff "$work/decode.safetensors" "$work/whole.safetensors" --tol 1e-5
fi
echo "== layer benchmark (short; 'build/gdncp bench layer' for T=4096)"
./"$bd"/gdncp bench layer --quick
echo "== kernel benchmark (short; 'build/gdncp bench kernel' for the full one)"
./"$bd"/gdncp bench kernel --quick
