#!/usr/bin/env bash
# The main job: one long sequence split over several MPI ranks (context parallelism), forward
# and backward, checked tensor by tensor against the single-rank run, with each rank's time
# split and bytes sent; then the golden files and a kernel benchmark.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh build
T=${GDN_DEMO_T:-32768}
golden=${GDN_GOLDEN_DIR:-../shared/golden}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== one sequence of T=$T tokens (B=1, Hk=2, Hv=4, K=V=128, Qwen-like gates)"
./build/gdncp gen --T "$T" --out "$work/seq.safetensors"
echo "== single rank, all threads (the reference for the split runs)"
./build/gdncp run --backward --in "$work/seq.safetensors" --out "$work/single.safetensors"
for spec in "4 scan" "3 allgather" "2 relay" "2 heads"; do
  set -- $spec
  echo "== split over $1 ranks, strategy '$2' (1 thread per rank; this machine has $(nproc) cores)"
  OMP_NUM_THREADS=1 mpiexec.mpich -n "$1" ./build/gdncp run --cp "$2" --backward --stats \
    --in "$work/seq.safetensors" --out "$work/cp.safetensors"
  ./build/gdncp diff "$work/cp.safetensors" "$work/single.safetensors" --tol 2e-5
done
if [ -d "$golden" ]; then
  for name in gdn_small gdn_strong_gates gdn_qwen_heads; do
    echo "== golden $name over 3 ranks vs the float64 Hugging Face-semantics reference"
    mpiexec.mpich -n 3 ./build/gdncp run --cp scan --backward --in "$golden/$name.safetensors" --out "$work/$name.safetensors"
    ./build/gdncp diff "$work/$name.safetensors" "$golden/$name.safetensors" --tol 2e-5
  done
fi
echo "== kernel benchmark (short; 'build/gdncp bench kernel' for the full one)"
./build/gdncp bench kernel --quick
