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
