#!/usr/bin/env bash
# libgdncp is the single-process library without MPI: the shared library links no MPI, the
# example program (examples/decode.c) is compiled here with no MPI include path and linked with
# libgdncp alone, and it decodes transformers' golden checkpoint to transformers' own greedy
# tokens. Control: the same program on a changed prompt must not give them.
# Usage: scripts/test_decode_example.sh BUILD_DIR. Prints "N passed, N failed".
set -u
build=${1:-build}
root=$(cd "$(dirname "$0")/.." && pwd)
golden=$root/tests/data/qwen35_tiny
pass=0 fail=0
check() { # name, then 0 when it passed
    if [ "$2" = 0 ]; then pass=$((pass + 1)); echo "  ok   $1"; else fail=$((fail + 1)); echo "  FAIL $1"; fi
}
lib=$build/libgdncp.so
ldd "$lib" > /tmp/gdn_ldd.$$ 2>&1
! grep -qE 'lib(mpi|mpich|open-pal|pmix)' /tmp/gdn_ldd.$$; check "libgdncp.so links no MPI library (ldd)" $?
! nm -D --undefined-only "$lib" | grep -q ' MPI_'; check "libgdncp.so needs no MPI_ symbol" $?
# the control of the two checks above: the wing does link MPI (when it was built)
if [ -f "$build/libgdncp_mpi.so" ]; then
    ldd "$build/libgdncp_mpi.so" | grep -qE 'lib(mpi|mpich)'; check "control: libgdncp_mpi.so does link MPI" $?
fi
# compiled from scratch: the public headers alone, no MPI include directory, libgdncp alone
exe=/tmp/gdn_decode_example.$$
cc -std=c11 -O2 -I "$root/include" "$root/examples/decode.c" -o "$exe" -L "$build" -lgdncp -Wl,-rpath,"$(cd "$build" && pwd)" 2>/tmp/gdn_cc.$$
rc=$?; [ $rc = 0 ] || cat /tmp/gdn_cc.$$
check "examples/decode.c compiles and links without mpi.h or an MPI library" $rc
# control: the same command on a file including the wing's header must fail (mpi.h is not on the
# compiler's default path, so the compile above proves that gdncp.h does not need it)
printf '#include <gdncp/cp.h>\nint main(void) { return 0; }\n' > /tmp/gdn_wing.$$.c
! cc -std=c11 -I "$root/include" -c /tmp/gdn_wing.$$.c -o /tmp/gdn_wing.$$.o 2>/dev/null
check "control: the same compile of a file including gdncp/cp.h fails (no mpi.h)" $?
rm -f /tmp/gdn_wing.$$.c /tmp/gdn_wing.$$.o
ldd "$exe" > /tmp/gdn_ldd.$$ 2>&1
! grep -qE 'lib(mpi|mpich|open-pal|pmix)' /tmp/gdn_ldd.$$; check "the example program loads no MPI library" $?
ids=$(python3 - "$golden/generate.io.safetensors" <<'PY'
import json, struct, sys
f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]; h = json.loads(f.read(n)); body = f.read()
def ids(name):
    a, b = h[name]["data_offsets"]; return [str(v) for v in struct.unpack("<%dq" % ((b - a) // 8), body[a:b])]
print(" ".join(ids("prompt_ids")) + "|" + " ".join(ids("generated_ids")))
PY
)
prompt=${ids%|*} want=${ids#*|}
n=$(echo "$want" | wc -w)
got=$("$exe" "$golden" "$n" $prompt 2>/tmp/gdn_err.$$)
rc=$?; [ "$rc" = 0 ] || cat /tmp/gdn_err.$$
[ "$rc" = 0 ] && [ "$got" = "$want" ]; check "greedy tokens from the golden checkpoint = transformers' generate() ($n tokens)" $?
[ "$got" = "$want" ] || echo "    got:  $got"$'\n'"    want: $want"
# control: the first prompt token changed must change the generation
first=${prompt%% *} rest=${prompt#* }
other=$("$exe" "$golden" "$n" $(( (first + 1) % 256 )) $rest 2>/dev/null)
[ -n "$other" ] && [ "$other" != "$want" ]; check "control: a changed prompt gives other tokens" $?
# bad input: a clear message and a non-zero status
"$exe" "$golden" 4 999999999 >/dev/null 2>/tmp/gdn_err.$$; rc=$?
[ "$rc" != 0 ] && grep -q "not a token id" /tmp/gdn_err.$$; check "an id outside the vocabulary is refused, named" $?
"$exe" /nonexistent 4 1 >/dev/null 2>/tmp/gdn_err.$$; rc=$?
[ "$rc" != 0 ] && grep -q "gdncp_decode_example" /tmp/gdn_err.$$; check "a missing checkpoint is an error with a message" $?
rm -f "$exe" /tmp/gdn_ldd.$$ /tmp/gdn_cc.$$ /tmp/gdn_err.$$
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
