#!/usr/bin/env bash
# The main job: build gdncp, run the gated delta rule on the golden problems and compare with
# the float64 Hugging Face-semantics references, then benchmark the kernel on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh build
golden=${GDN_GOLDEN_DIR:-../shared/golden}
out=$(mktemp -d)
for name in gdn_small gdn_strong_gates gdn_qwen_heads; do
  [ -f "$golden/$name.safetensors" ] || { echo "missing $golden/$name.safetensors"; exit 1; }
  echo "== $name"
  ./build/gdncp run --in "$golden/$name.safetensors" --out "$out/$name.safetensors"
  ./build/gdncp diff "$out/$name.safetensors" "$golden/$name.safetensors" --tol 1e-5
done
echo "== benchmark"
./build/gdncp bench kernel "$@"
