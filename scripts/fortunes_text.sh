#!/usr/bin/env bash
# Write the English text of Debian's fortunes package (every fortune file, without the offensive
# set and the index files) to OUT: the training text of the demo, the tests and the long run.
# Usage: scripts/fortunes_text.sh OUT
set -euo pipefail
dir=/usr/share/games/fortunes
[ -d "$dir" ] || { echo "fortunes_text: $dir is missing (scripts/deps.sh installs the fortunes package)" >&2; exit 1; }
find "$dir" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort | xargs cat > "$1"
[ -s "$1" ] || { echo "fortunes_text: no text found in $dir" >&2; exit 1; }
