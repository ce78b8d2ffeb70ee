#!/usr/bin/env bash
# Install the Debian packages gdncp builds with; does nothing when they are already there.
# `deps.sh fuzz` also installs what scripts/fuzz.sh needs: clang (Debian 12: clang 14),
# libclang-rt-14-dev (libFuzzer and clang's ASan/UBSan runtimes) and libomp-dev (LLVM's OpenMP,
# which CMake's find_package(OpenMP) needs when the compiler is clang).
set -euo pipefail
# fortunes: English text for gdncp train (the demo, the tests); gnuplot-nox: the loss plot.
pkgs=(build-essential cmake pkg-config libjansson-dev mpich libmpich-dev openmpi-bin libopenmpi-dev python3
      fortunes gnuplot-nox)
if [ "${1:-}" = fuzz ]; then
  pkgs+=(clang libomp-dev)
  # The runtime package is named after clang's major version (14 on Debian 12).
  v=$(apt-cache depends clang 2>/dev/null | grep -oE 'clang-[0-9]+$' | head -1 | cut -d- -f2 || true)
  pkgs+=("libclang-rt-${v:-14}-dev")
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "installing: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
