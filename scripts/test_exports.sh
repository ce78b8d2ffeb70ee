#!/usr/bin/env bash
# The shared libraries export exactly what is declared, and no data:
#   libgdncp.so      the functions declared GDN_API in the public headers of libgdncp (every
#                    include/gdncp/*.h but the wing's cp.h, ep.h, train.h and abi.h), and the internal steps
#                    declared GDN_WING in src/*/*.h, which only the wing calls (base.h says why);
#   libgdncp_mpi.so  the functions declared GDN_API in cp.h, ep.h, train.h and abi.h (the layout table,
#                    which includes every header, the wing's too).
# The control runs the same comparison on the static archive, which keeps every internal symbol
# for the tests: it must find the difference.
# Usage: scripts/test_exports.sh BUILD_DIR. Ends with "N passed, N failed"; exits 1 on a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
bd=${1:-build}
passed=0; failed=0
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
api() { grep -ohE '^GDN_API [^(]*\bgdn_[a-z0-9_]+\(' "$@" | grep -oE 'gdn_[a-z0-9_]+\($' | tr -d '(' | sort -u; }
core_headers=$(ls include/gdncp/*.h | grep -vE '/(cp|ep|train|abi)\.h$')
api $core_headers > "$tmp/core_api"
api include/gdncp/cp.h include/gdncp/ep.h include/gdncp/train.h include/gdncp/abi.h > "$tmp/wing_api"
# a build without test hooks (GDN_TEST_HOOKS=OFF, base.h) has no gdn_test_* at all
hooks=1; grep -q '^GDN_TEST_HOOKS:BOOL=OFF' "$bd/CMakeCache.txt" 2>/dev/null && hooks=0
grep -ohE '^GDN_WING [^(]*\bgdn_[a-z0-9_]+\(' src/*/*.h | grep -oE 'gdn_[a-z0-9_]+\($' | tr -d '(' |
  { if [ "$hooks" = 1 ]; then cat; else grep -v '^gdn_test_'; fi; } | sort -u > "$tmp/wing_internal"
sort -u "$tmp/core_api" "$tmp/wing_internal" > "$tmp/core_exports"
compare() { # compare LABEL EXPECT(same|differ) LIST SYMBOLS...: the defined global symbols against LIST
  local label=$1 expect=$2 list=$3 got; shift 3
  got=$(diff <(printf '%s\n' "$@" | sort -u) "$list" | grep -E '^[<>]' | head -8)
  if { [ "$expect" = same ] && [ -z "$got" ]; } || { [ "$expect" = differ ] && [ -n "$got" ]; }; then
    echo "PASS  $label"; passed=$((passed + 1))
  else echo "FAIL  $label (< exported but not declared, > declared but not exported):"; echo "$got"; failed=$((failed + 1)); fi
}
defined() { nm -D --defined-only "$1" | awk '$2 ~ /^[A-Za-z]$/ { print $3 }'; }
so=$bd/libgdncp.so; a=$bd/libgdncp.a; wing=$bd/libgdncp_mpi.so
if [ -f "$so" ] && [ -f "$a" ]; then
  compare "nm -D libgdncp.so: exactly the $(wc -l < "$tmp/core_api") GDN_API functions of its public headers and the $(wc -l < "$tmp/wing_internal") GDN_WING steps" \
    same "$tmp/core_exports" $(defined "$so")
  compare "libgdncp.a's global symbols (every internal one kept for the tests) differ from that list (control)" differ \
    "$tmp/core_exports" $(nm -g --defined-only "$a" 2>/dev/null | awk 'NF == 3 && $2 ~ /^[A-Z]$/ { print $3 }')
  # the lists themselves are not empty or truncated: they name the entry points
  if grep -qx gdn_forward "$tmp/core_api" && grep -qx gdn_model_forward "$tmp/core_api" && grep -qx gdn_version "$tmp/core_api" &&
     grep -qx gdn_cp_forward "$tmp/wing_api" && grep -qx gdn_train "$tmp/wing_api" && grep -qx gdn_layer_out "$tmp/wing_internal"; then
    echo "PASS  the declared lists hold gdn_forward, gdn_model_forward, gdn_version; gdn_cp_forward, gdn_train; gdn_layer_out"; passed=$((passed + 1))
  else echo "FAIL  the declared lists from include/gdncp/*.h and src/*/*.h are incomplete"; failed=$((failed + 1)); fi
  if [ -f "$wing" ]; then
    compare "nm -D libgdncp_mpi.so: exactly the $(wc -l < "$tmp/wing_api") GDN_API functions of cp.h, ep.h, train.h and abi.h" \
      same "$tmp/wing_api" $(defined "$wing")
    # control: the wing's exports are not libgdncp's
    compare "libgdncp_mpi.so's exports differ from libgdncp.so's list (control)" differ "$tmp/core_exports" $(defined "$wing")
  fi
  echo "public API: $(($(wc -l < "$tmp/core_api") + $(wc -l < "$tmp/wing_api"))) functions ($(wc -l < "$tmp/core_api") libgdncp, $(wc -l < "$tmp/wing_api") libgdncp_mpi)"
else
  echo "FAIL  $so or $a missing"; failed=$((failed + 1))
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
