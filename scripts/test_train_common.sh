# Sourced by the training suites (scripts/test_train.sh, test_train_hybrid.sh, test_tokens.sh,
# each given BUILD_DIR): test_common.sh's set-up, then $g (the gdncp command), $work (the scratch
# folder), pass / fail, and $text, the fortunes text (scripts/deps.sh installs the package; without
# it the suite fails at once, saying so).
. "$(dirname "$0")/test_common.sh"
g=$L
work=$logs
pass() { echo "PASS  $*"; passed=$((passed + 1)); }
fail() { echo "FAIL  $*"; failed=$((failed + 1)); }
text=$work/text.txt
bash scripts/fortunes_text.sh "$text" || true
[ -s "$text" ] || { fail "no fortunes text (install the fortunes package)"; finish; }

# The suites' shared steps; each suite sets its model's flags in the array `small` first.
train() { # train RANKS LOG ARGS...: run gdncp train, its CSV log in LOG; returns its exit status
  local n=$1 log=$2; shift 2
  timeout 300 $MPIEXEC -n "$n" $g train --data "$text" "${small[@]}" --log "$log" "$@" >"$log.out" 2>&1
}
lossdiff() { # max relative difference of the loss column of two logs (steps present in both)
  awk -F, 'NR == FNR { if (FNR > 1) a[$1] = $2; next }
           FNR > 1 && ($1 in a) { d = ($2 - a[$1]) / a[$1]; if (d < 0) d = -d; if (d > m) m = d; n++ }
           END { if (!n) print "inf"; else printf "%.3e\n", m }' "$1" "$2"
}
expect_close() { # expect_close LABEL LOG REF TOL
  local d; d=$(lossdiff "$2" "$3")
  if awk -v d="$d" -v t="$4" 'BEGIN { exit !(d != "inf" && d <= t) }'; then pass "$1  loss rel diff $d <= $4"
  else fail "$1  loss rel diff $d > $4"; cat "$2.out"; fi
}
expect_far() { # expect_far LABEL LOG REF TOL
  local d; d=$(lossdiff "$2" "$3")
  if awk -v d="$d" -v t="$4" 'BEGIN { exit !(d != "inf" && d > t) }'; then pass "negative control: $1  loss rel diff $d > $4"
  else fail "negative control: $1  loss rel diff $d <= $4 (the check cannot tell)"; fi
}
refuse() { # refuse LABEL PATTERN CMD...: a non-zero exit (not a signal or a timeout) naming PATTERN
  local label=$1 pat=$2; shift 2
  local rc=0; timeout 120 "$@" >"$work/bad.out" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -lt 124 ] && grep -qiE -- "$pat" "$work/bad.out"; then
    pass "$label: exit $rc, \"$(grep -m1 -iE -- "$pat" "$work/bad.out" | cut -c1-160)\""
  else fail "$label (exit $rc; wanted a message matching '$pat')"; cat "$work/bad.out"; fi
}
