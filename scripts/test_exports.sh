#!/usr/bin/env bash
# libgdncp.so exports exactly the documented API: the functions declared GDN_API in
# include/gdncp/*.h, nothing internal and no data. The control runs the same comparison on the
# static archive, which keeps every internal symbol for the tests: it must find the difference.
# Usage: scripts/test_exports.sh BUILD_DIR. Ends with "N passed, N failed"; exits 1 on a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bd=${1:-build}
passed=0; failed=0
declared=$(mktemp); trap 'rm -f "$declared"' EXIT
grep -ohE '^GDN_API [^(]*\bgdn_[a-z0-9_]+\(' include/gdncp/*.h | grep -oE 'gdn_[a-z0-9_]+\($' | tr -d '(' | sort -u > "$declared"
compare() { # compare LABEL EXPECT(same|differ) SYMBOLS...: the defined global symbols against the declared list
  local label=$1 expect=$2 got; shift 2
  got=$(diff <(printf '%s\n' "$@" | sort -u) "$declared" | grep -E '^[<>]' | head -8)
  if { [ "$expect" = same ] && [ -z "$got" ]; } || { [ "$expect" = differ ] && [ -n "$got" ]; }; then
    echo "PASS  $label"; passed=$((passed + 1))
  else echo "FAIL  $label (< exported but not declared, > declared but not exported):"; echo "$got"; failed=$((failed + 1)); fi
}
so=$bd/libgdncp.so; a=$bd/libgdncp.a
if [ -f "$so" ] && [ -f "$a" ]; then
  compare "nm -D libgdncp.so: exactly the $(wc -l < "$declared") functions declared GDN_API in include/gdncp/*.h" same \
    $(nm -D --defined-only "$so" | awk '$2 ~ /^[A-Za-z]$/ { print $3 }')
  compare "libgdncp.a's global symbols (every internal one kept for the tests) differ from that list (control)" differ \
    $(nm -g --defined-only "$a" 2>/dev/null | awk 'NF == 3 && $2 ~ /^[A-Z]$/ { print $3 }')
  # the export list itself is not empty or truncated: it names the core entry points
  if grep -qx gdn_forward "$declared" && grep -qx gdn_cp_forward "$declared" && grep -qx gdn_version "$declared"; then
    echo "PASS  the declared list holds gdn_forward, gdn_cp_forward, gdn_version"; passed=$((passed + 1))
  else echo "FAIL  the declared list from include/gdncp/*.h is incomplete"; failed=$((failed + 1)); fi
else
  echo "FAIL  $so or $a missing"; failed=$((failed + 1))
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
