#!/usr/bin/env bash
# The command line end to end against the reference files in tests/data: gdncp run / layer under
# mpiexec (every strategy, uneven shards) against the golden tensors and the single-rank runs,
# packed documents (each document cut out and run alone), option values, memory refusals; every
# comparison beside a negative control that must fail it. Usage: scripts/test_cli.sh BUILD_DIR
# (MPIEXEC: the launcher, default mpiexec.mpich). Ends with "N passed, N failed"; exits 1 on a failure.
. "$(dirname "$0")/test_common.sh"
echo "== gdncp run --cp under mpiexec against the golden files"
cpcase() { # cpcase EXPECT(pass|fail) D ARGS...: run, then diff against the golden file
  local expect=$1 d=$2; shift 2
  local out="$logs/cp_cli.safetensors" g="$golden/gdn_qwen_heads.safetensors"
  if $MPIEXEC -n "$d" $L run "$@" --in "$g" --out "$out" >"$logs/cp_cli.log" 2>&1 &&
     $L diff "$out" "$g" --tol 2e-5 >>"$logs/cp_cli.log" 2>&1; then got=pass; else got=fail; fi
  if [ "$got" = "$expect" ]; then echo "PASS  mpiexec -n $d gdncp run $* ($expect as expected)"; passed=$((passed + 1))
  else echo "FAIL  mpiexec -n $d gdncp run $* (expected $expect)"; cat "$logs/cp_cli.log"; failed=$((failed + 1)); fi
}
cpcase pass 3 --cp scan --backward
cpcase pass 4 --cp allgather --backward --shards 1,64,1,64
cpcase pass 2 --cp relay --backward --stats
cpcase pass 2 --cp heads --backward
cpcase fail 3 --cp scan --backward --no-l2norm            # negative control: wrong model
cpcase fail 3 --cp scan --shards 1,2                       # wrong shard count: clear error
cpcase fail 2 --cp spiral                                  # unknown strategy: clear error

$L gen --T 2 --out "$logs/t2.safetensors" >/dev/null 2>&1
if timeout 60 $MPIEXEC -n 3 $L run --cp scan --in "$logs/t2.safetensors" --out "$logs/t2o.safetensors" \
     >"$logs/t2.log" 2>&1; then got=0; else got=$?; fi
if [ "$got" = 1 ] && grep -q "more ranks than tokens" "$logs/t2.log"; then
  echo "PASS  3 ranks for 2 tokens: every rank exits 1, rank 0 says why"; passed=$((passed + 1))
else echo "FAIL  3 ranks for 2 tokens (exit $got; 124 = hang)"; cat "$logs/t2.log"; failed=$((failed + 1)); fi
# An MPI that cannot give MPI_THREAD_FUNNELED (a PMPI shim asks for MPI_THREAD_SINGLE instead):
# the CLI says so and exits non-zero; the control, the same run without the shim, succeeds.
case $MPIEXEC in *openmpi*) shimcc=mpicc.openmpi ;; *) shimcc=mpicc.mpich ;; esac
printf '#include <mpi.h>\nint MPI_Init_thread(int *c, char ***v, int r, int *p) { (void)r; return PMPI_Init_thread(c, v, MPI_THREAD_SINGLE, p); }\n' >"$logs/single.c"
if $shimcc -shared -fPIC -o "$logs/single.so" "$logs/single.c" 2>"$logs/shim.log"; then
  if timeout 60 $MPIEXEC -n 2 env LD_PRELOAD="$logs/single.so" $L run --cp scan --in "$logs/t2.safetensors" \
       --out "$logs/t2s.safetensors" >"$logs/single.log" 2>&1; then got=0; else got=$?; fi
  if timeout 60 $MPIEXEC -n 2 $L run --cp scan --in "$logs/t2.safetensors" --out "$logs/t2s.safetensors" \
       >"$logs/funneled.log" 2>&1; then ctl=0; else ctl=$?; fi
  if [ "$got" = 1 ] && grep -q "below MPI_THREAD_FUNNELED" "$logs/single.log" && [ "$ctl" = 0 ]; then
    echo "PASS  an MPI giving only MPI_THREAD_SINGLE: gdncp run --cp exits 1 saying so (control: 0 without the shim)"; passed=$((passed + 1))
  else echo "FAIL  MPI_THREAD_SINGLE: exit $got (want 1 and a message), control exit $ctl (want 0)"; cat "$logs/single.log" "$logs/funneled.log"; failed=$((failed + 1)); fi
else echo "FAIL  could not build the MPI_THREAD_SINGLE shim with $shimcc"; cat "$logs/shim.log"; failed=$((failed + 1)); fi
for bad in "9223372036854775807,9223372036854775807" "99999999999999999999,1"; do
  if timeout 60 $MPIEXEC -n 2 $L run --cp scan --shards "$bad" --in "$golden/gdn_qwen_heads.safetensors" \
       --out "$logs/t2o.safetensors" >"$logs/t2.log" 2>&1; then got=0; else got=$?; fi
  if [ "$got" = 1 ] && grep -q "shards" "$logs/t2.log"; then echo "PASS  --shards $bad: clear error"; passed=$((passed + 1))
  else echo "FAIL  --shards $bad (exit $got)"; cat "$logs/t2.log"; failed=$((failed + 1)); fi
done

echo "== gdncp layer: golden checkpoints through the command line"
tiny=$golden/qwen35_tiny
tinyw=(--weights "$tiny/model.safetensors" --config "$tiny/config.json" --prefix model.layers.0.linear_attn.)
clicase() { # clicase EXPECT(pass|fail) LABEL CMD...: run a shell command line, compare with EXPECT
  local expect=$1 label=$2; shift 2
  if "$@" >"$logs/layer_cli.log" 2>&1; then got=pass; else got=fail; fi
  if [ "$got" = "$expect" ]; then echo "PASS  $label ($expect as expected)"; passed=$((passed + 1))
  else echo "FAIL  $label (expected $expect)"; cat "$logs/layer_cli.log"; failed=$((failed + 1)); fi
}
g1="$golden/gdn_qwen_heads.safetensors"
clicase pass "run --cp over 3 ranks writes each rank's rows into one file: the single-rank header byte for byte, values within 2e-5, no temporary left" bash -c \
  "$L run --backward --in $g1 --out $logs/s1.st && $MPIEXEC -n 3 $L run --cp scan --backward --shards 1,64,65 --in $g1 --out $logs/cp3.st && n=\$(( \$(od -An -t u8 -N8 $logs/s1.st) + 8 )) && cmp -n \$n $logs/s1.st $logs/cp3.st && $L diff $logs/cp3.st $logs/s1.st --tol 2e-5 && ! ls $logs | grep -q 'st.tmp'"
clicase pass "layer_small forward+backward vs the float64 golden file (tol 1e-4)" bash -c \
  "$L layer --weights $golden/layer_small.weights.safetensors --in $golden/layer_small.io.safetensors --out $logs/ls.safetensors --backward && $L diff $logs/ls.safetensors $golden/layer_small.io.safetensors --tol 1e-4"
clicase pass "qwen35_tiny layer 0 (config.json + prefix) y, dx vs transformers (tol 1e-4)" bash -c \
  "$L layer ${tinyw[*]} --in $tiny/layer0.io.safetensors --out $logs/l0.safetensors --backward --keep proj && $L diff $logs/l0.safetensors $tiny/layer0.io.safetensors --tol 1e-4 | grep -E '^(y|dx) +ok'  | wc -l | grep -qx 2"
clicase fail "qwen35_tiny layer 1's weights against layer 0's references (negative control)" bash -c \
  "$L layer --weights $tiny/model.safetensors --config $tiny/config.json --prefix model.layers.1.linear_attn. --in $tiny/layer0.io.safetensors --out $logs/l1.safetensors && $L diff $logs/l1.safetensors $tiny/layer0.io.safetensors --tol 1e-4"
# BF16 compute (--compute bf16): transformers' fp32 references within BF16's accuracy (measured
# ~1e-2 on y and dx; tests/layer/test_compute_bf16.c holds the exact checks); control: layer 1's weights.
clicase pass "qwen35_tiny layer 0 --compute bf16 y, dx vs transformers' fp32 (tol 5e-2), the path printed" bash -c \
  "$L layer ${tinyw[*]} --in $tiny/layer0.io.safetensors --out $logs/l0b.safetensors --backward --compute bf16 | grep -q 'products: bf16' && $L diff $logs/l0b.safetensors $tiny/layer0.io.safetensors --tol 5e-2 | grep -E '^(y|dx) +ok' | wc -l | grep -qx 2"
clicase fail "qwen35_tiny layer 1's weights --compute bf16 against layer 0's references (negative control)" bash -c \
  "$L layer --weights $tiny/model.safetensors --config $tiny/config.json --prefix model.layers.1.linear_attn. --in $tiny/layer0.io.safetensors --out $logs/l1b.safetensors --compute bf16 && $L diff $logs/l1b.safetensors $tiny/layer0.io.safetensors --tol 5e-2"
clicase fail "gdncp layer --compute fp16: refused (usage)" \
  $L layer ${tinyw[*]} --in $tiny/layer0.io.safetensors --out $logs/l0c.safetensors --compute fp16
# Split runs against the single-rank file: layer_small (mild gates) every tensor at the kernel's CP
# tolerance; qwen35_tiny (strong gates) y and dx at it: its dA_log is a sum of dg*g over 300 tokens
# that cancels to 1e-2 of its terms, so summation order alone moves it by ~2e-5.
ls_w=(--weights "$golden/layer_small.weights.safetensors")
$L layer "${ls_w[@]}" --in "$golden/layer_small.io.safetensors" --out "$logs/ls1.safetensors" --backward >/dev/null 2>&1
for spec in "3 scan 1,2,87" "2 allgather 89,1" "5 relay 1,1,1,1,86" "2 heads 45,45"; do
  set -- $spec
  clicase pass "mpiexec -n $1 gdncp layer --cp $2 --shards $3 --backward = single rank, layer_small (tol 2e-5)" bash -c \
    "$MPIEXEC -n $1 $L layer ${ls_w[*]} --in $golden/layer_small.io.safetensors --out $logs/lscp.safetensors --backward --cp $2 --shards $3 && $L diff $logs/lscp.safetensors $logs/ls1.safetensors --tol 2e-5"
done
clicase pass "mpiexec -n 3 gdncp layer --cp scan --shards 1,2,147 --backward = single rank, qwen35_tiny y and dx (tol 2e-5)" bash -c \
  "$MPIEXEC -n 3 $L layer ${tinyw[*]} --in $tiny/layer0.io.safetensors --out $logs/l0cp.safetensors --backward --cp scan --shards 1,2,147 && $L diff $logs/l0cp.safetensors $logs/l0.safetensors --tol 2e-5 | grep -E '^(y|dx) +ok' | wc -l | grep -qx 2"
clicase fail "gdncp layer --cp heads over 3 ranks (3 does not divide Hk = 2): clear error" \
  $MPIEXEC -n 3 $L layer "${tinyw[@]}" --in "$tiny/layer0.io.safetensors" --out "$logs/bad.safetensors" --cp heads
clicase pass "BF16 checkpoint: prefill 37 + decode 8 = the BF16 forward of all 45 (tol 1e-5)" bash -c \
  "$L layer --weights $tiny/model.bf16.safetensors --config $tiny/config.json --prefix model.layers.0.linear_attn. --in $tiny/decode0.io.safetensors --out $logs/d_all.safetensors && $L layer --weights $tiny/model.bf16.safetensors --config $tiny/config.json --prefix model.layers.0.linear_attn. --in $tiny/decode0.io.safetensors --out $logs/d_dec.safetensors --decode 8 && $L diff $logs/d_dec.safetensors $logs/d_all.safetensors --tol 1e-5"
clicase pass "BF16 checkpoint kept BF16 in memory = the same values as fp32 (--f32), prefill + decode (tol 1e-6)" bash -c \
  "$L layer --weights $tiny/model.bf16.safetensors --config $tiny/config.json --prefix model.layers.0.linear_attn. --in $tiny/decode0.io.safetensors --out $logs/d_f32.safetensors --decode 8 --f32 && $L diff $logs/d_dec.safetensors $logs/d_f32.safetensors --tol 1e-6"
clicase fail "gdncp layer with a prefix that names no layer: clear error" \
  $L layer --weights "$tiny/model.safetensors" --config "$tiny/config.json" --prefix model.layers.9.linear_attn. --in "$tiny/layer0.io.safetensors" --out "$logs/bad.safetensors"
clicase fail "gdncp layer --decode with --backward: clear error" \
  $L layer "${tinyw[@]}" --in "$tiny/layer0.io.safetensors" --out "$logs/bad.safetensors" --decode 2 --backward

echo "== packed documents through the command line: gdncp run / gdncp layer --cu-seqlens, a cu_seqlens tensor (issue 11)"
# A stream of 4 documents (a chunk boundary at 16, a length-1 document, one crossing chunks) with
# per-document h0 and dht, chunk 16. Each document is cut out with scripts/st_slice.py and run
# alone (dense): the packed run's rows and states for it must match; a run that ignores the
# offsets must not (the negative control).
P=$logs/pk; mkdir -p "$P"; CU=0,16,17,50,100; C16="--chunk 16 --backward"
SL="python3 scripts/st_slice.py"
pkcase() { # pkcase EXPECT(pass|fail) LABEL CMD...: like clicase, logging to the pack log
  local expect=$1 label=$2; shift 2
  if "$@" >"$P/log" 2>&1; then got=pass; else got=fail; fi
  if [ "$got" = "$expect" ]; then echo "PASS  $label ($expect as expected)"; passed=$((passed + 1))
  else echo "FAIL  $label (expected $expect)"; cat "$P/log"; failed=$((failed + 1)); fi
}
$L gen --T 100 --Hk 1 --Hv 2 --K 16 --V 16 --gates mild --cu-seqlens $CU --out "$P/p.st" >/dev/null 2>&1
$SL "$P/p.st" "$P/q.st" --drop cu_seqlens,h0,dht   # the same tokens, no offsets, no states
$SL "$P/p.st" "$P/nocu.st" --drop cu_seqlens        # per-document states, no offsets
$L run $C16 --in "$P/p.st" --out "$P/packed.st" >/dev/null 2>&1
pkcase pass "packed run, offsets from the file's cu_seqlens tensor == the same with --cu-seqlens $CU given too (bit for bit)" bash -c \
  "$L run $C16 --in $P/p.st --out $P/both.st --cu-seqlens $CU && $L diff $P/both.st $P/packed.st --tol 0"
d=0; for span in 0:16 16:17 17:50 50:100; do
  pkcase pass "packed document $d (tokens $span) == that document run alone: o, ht, gradients, dh0 (tol 2e-5)" bash -c \
    "$SL $P/p.st $P/d.st --rows $span --doc $d && $L run $C16 --in $P/d.st --out $P/alone.st && $SL $P/packed.st $P/cut.st --rows $span --doc $d && $L diff $P/cut.st $P/alone.st --tol 2e-5"
  d=$((d + 1))
done
# --cu-seqlens on a file without offsets or states (zero initial states): document 2 alone; the
# token rows compared (a dense run's ht is the whole stream's, not comparable)
$SL "$P/q.st" "$P/q2.st" --rows 17:50
$L run $C16 --in "$P/q2.st" --out "$P/q2alone.st" >/dev/null 2>&1
pkcase pass "--cu-seqlens $CU on a file without offsets: document 2 == run alone (tol 2e-5)" bash -c \
  "$L run $C16 --in $P/q.st --out $P/qp.st --cu-seqlens $CU && $SL $P/qp.st $P/cut.st --rows 17:50 --drop ht && $L diff $P/cut.st $P/q2alone.st --tol 2e-5"
pkcase fail "the same file WITHOUT --cu-seqlens: document 2 != run alone (negative control: no reset)" bash -c \
  "$L run $C16 --in $P/q.st --out $P/qd.st && $SL $P/qd.st $P/cut.st --rows 17:50 --drop ht && $L diff $P/cut.st $P/q2alone.st --tol 2e-5"
for spec in "3 scan -" "3 scan 10,40,50" "4 allgather 16,1,33,50" "3 relay 60,39,1"; do
  set -- $spec; sh=; [ "$3" != - ] && sh="--shards $3"
  pkcase pass "mpiexec -n $1 gdncp run --cp $2 $sh --backward, offsets from the file == single-rank packed run (tol 2e-5)" bash -c \
    "$MPIEXEC -n $1 $L run --cp $2 $sh $C16 --in $P/p.st --out $P/cp.st && $L diff $P/cp.st $P/packed.st --tol 2e-5"
done
pkcase pass "mpiexec -n 3 gdncp run --cp scan --cu-seqlens $CU --backward == single-rank packed run (tol 2e-5)" bash -c \
  "$MPIEXEC -n 3 $L run --cp scan --cu-seqlens $CU $C16 --in $P/q.st --out $P/cp.st && $L diff $P/cp.st $P/qp.st --tol 2e-5"
# heads needs D | Hk: the same offsets on a stream with Hk = 6 (per-document h0 and dht). Each rank
# runs the whole stream's documents for its heads; states come from / go to their documents' ranks.
$L gen --T 100 --Hk 6 --Hv 6 --K 16 --V 16 --gates mild --cu-seqlens $CU --seed 11 --out "$P/h6.st" >/dev/null 2>&1
$SL "$P/h6.st" "$P/h6q.st" --drop cu_seqlens,h0,dht
$L run $C16 --in "$P/h6.st" --out "$P/h6packed.st" >/dev/null 2>&1
$L run $C16 --in "$P/h6q.st" --out "$P/h6qp.st" --cu-seqlens $CU >/dev/null 2>&1
$SL "$P/h6qp.st" "$P/h6qp_rows.st" --drop ht
for spec in "2 -" "3 10,40,50" "3 60,39,1"; do
  set -- $spec; sh=; [ "$2" != - ] && sh="--shards $2"
  pkcase pass "mpiexec -n $1 gdncp run --cp heads $sh --backward, Hk = 6, offsets and per-document h0/dht from the file == single-rank packed run (tol 2e-5)" bash -c \
    "$MPIEXEC -n $1 $L run --cp heads $sh $C16 --in $P/h6.st --out $P/cp.st && $L diff $P/cp.st $P/h6packed.st --tol 2e-5"
done
pkcase pass "mpiexec -n 3 gdncp run --cp heads --cu-seqlens $CU --backward == single-rank packed run (tol 2e-5)" bash -c \
  "$MPIEXEC -n 3 $L run --cp heads --cu-seqlens $CU $C16 --in $P/h6q.st --out $P/cp.st && $L diff $P/cp.st $P/h6qp.st --tol 2e-5"
pkcase fail "mpiexec -n 3 gdncp run --cp heads WITHOUT --cu-seqlens vs the packed run's rows (negative control)" bash -c \
  "$MPIEXEC -n 3 $L run --cp heads $C16 --in $P/h6q.st --out $P/cp.st && $L diff $P/cp.st $P/h6qp_rows.st --tol 2e-5"
$SL "$P/h6.st" "$P/h6z.st" --drop h0   # the owners' h0 dropped: the states must matter
pkcase fail "mpiexec -n 3 gdncp run --cp heads with the per-document h0 dropped vs the packed run (negative control)" bash -c \
  "$MPIEXEC -n 3 $L run --cp heads $C16 --in $P/h6z.st --out $P/cp.st && $SL $P/cp.st $P/cut.st --drop dh0 && $L diff $P/cut.st $P/h6packed.st --tol 2e-5"
$SL "$P/qp.st" "$P/qp_rows.st" --drop ht   # token rows only: a dense run has one final state
pkcase fail "mpiexec -n 3 gdncp run --cp scan WITHOUT --cu-seqlens vs the packed run's rows (negative control)" bash -c \
  "$MPIEXEC -n 3 $L run --cp scan $C16 --in $P/q.st --out $P/cp.st && $L diff $P/cp.st $P/qp_rows.st --tol 2e-5"
# Refusals: exit status and a word of the message; 2 for option text that is not a list.
$L gen --B 2 --T 100 --Hk 1 --Hv 2 --K 16 --V 16 --out "$P/b2.st" >/dev/null 2>&1
while IFS='|' read -r want msg cmd; do
  if eval "timeout 60 $cmd" >"$P/log" 2>&1 </dev/null; then got=0; else got=$?; fi
  if [ "$got" = "$want" ] && grep -q -- "$msg" "$P/log"; then echo "PASS  $cmd: exit $got, \"$(grep -m1 -o -- "$msg.*" "$P/log" | cut -c1-90)\""; passed=$((passed + 1))
  else echo "FAIL  $cmd (exit $got, wanted $want and '$msg')"; cat "$P/log"; failed=$((failed + 1)); fi
done <<LIST
1|strictly increasing|$L run --in $P/q.st --out $P/x.st --cu-seqlens 0,17,17,100
1|strictly increasing|$L run --in $P/q.st --out $P/x.st --cu-seqlens 0,50,17,100
1|must start at 0|$L run --in $P/q.st --out $P/x.st --cu-seqlens 1,50,100
1|must end at T|$L run --in $P/q.st --out $P/x.st --cu-seqlens 0,50,99
1|must end at T|$L run --in $P/q.st --out $P/x.st --cu-seqlens 0,50,101
1|at least two offsets|$L run --in $P/q.st --out $P/x.st --cu-seqlens 0
1|needs B = 1|$L run --in $P/b2.st --out $P/x.st --cu-seqlens 0,100
1|differs from the cu_seqlens tensor|$L run --in $P/p.st --out $P/x.st --cu-seqlens 0,16,18,50,100
1|'h0' has shape \[4,2,16,16\], expected \[1,|$L run --in $P/nocu.st --out $P/x.st --cu-seqlens 0,100 --reference
2|--cu-seqlens|$L run --in $P/q.st --out $P/x.st --cu-seqlens 0,a,100
2|--cu-seqlens|$L run --in $P/q.st --out $P/x.st --cu-seqlens 0,,100
2|--cu-seqlens|$L run --in $P/q.st --out $P/x.st --cu-seqlens 0,50,
2|--cu-seqlens|$L run --in $P/q.st --out $P/x.st --cu-seqlens -1,100
2|--cu-seqlens|$L run --in $P/q.st --out $P/x.st --cu-seqlens 0,99999999999999999999
2|--cu-seqlens|$L run --in $P/q.st --out $P/x.st --cu-seqlens
1|to divide Hk|$MPIEXEC -n 2 $L run --cp heads --in $P/p.st --out $P/x.st
1|must end at T|$MPIEXEC -n 3 $L run --cp scan --in $P/q.st --out $P/x.st --cu-seqlens 0,50
2|--cu-seqlens|$MPIEXEC -n 3 $L run --cp scan --in $P/q.st --out $P/x.st --cu-seqlens 0,x
LIST

# The layer (gdncp layer --cu-seqlens, or a cu_seqlens tensor beside x): layer_small's batch row 0
# (Hk = 2) as 4 documents (a length-1 one, cuts inside chunks). Each document's rows cut out and run
# alone through gdncp layer == the packed run's y and dx rows; ranks == one rank for y, dx and
# every weight gradient (summed over the documents, so per-document runs cannot give it).
LW="--weights $golden/layer_small.weights.safetensors"; LCU=0,20,21,47,90
$SL "$golden/layer_small.io.safetensors" "$P/x1.st" --batch 0 --keep x,dy
$SL "$P/x1.st" "$P/xc.st" --cu-seqlens $LCU
$L layer $LW $C16 --in "$P/x1.st" --out "$P/lpk.st" --cu-seqlens $LCU >/dev/null 2>&1
pkcase pass "gdncp layer: offsets from the file's cu_seqlens tensor == --cu-seqlens $LCU (y, dx, grads bit for bit)" bash -c \
  "$L layer $LW $C16 --in $P/xc.st --out $P/lf.st && $L diff $P/lf.st $P/lpk.st --tol 0"
for span in 0:20 20:21 21:47 47:90; do
  pkcase pass "gdncp layer --cu-seqlens $LCU: document $span == its rows run alone through gdncp layer (y, dx; tol 2e-5)" bash -c \
    "$SL $P/x1.st $P/ld.st --rows $span && $L layer $LW $C16 --in $P/ld.st --out $P/lalone.st && $SL $P/lpk.st $P/lcut.st --rows $span --keep y,dx && $L diff $P/lcut.st $P/lalone.st --tol 2e-5"
done
$SL "$P/x1.st" "$P/ld.st" --rows 21:47
$L layer $LW $C16 --in "$P/ld.st" --out "$P/lalone.st" >/dev/null 2>&1
pkcase fail "gdncp layer WITHOUT --cu-seqlens: document 21:47 != run alone (negative control: no reset)" bash -c \
  "$L layer $LW $C16 --in $P/x1.st --out $P/ln.st && $SL $P/ln.st $P/lcut.st --rows 21:47 --keep y,dx && $L diff $P/lcut.st $P/lalone.st --tol 2e-5"
for spec in "3 scan 10,30,50" "3 allgather 20,1,69" "3 relay 1,2,87" "2 heads 21,69"; do
  set -- $spec
  pkcase pass "mpiexec -n $1 gdncp layer --cp $2 --shards $3 --cu-seqlens $LCU --backward == single rank (y, dx, grads; tol 2e-5)" bash -c \
    "$MPIEXEC -n $1 $L layer $LW $C16 --in $P/x1.st --out $P/lcp.st --cu-seqlens $LCU --cp $2 --shards $3 && $L diff $P/lcp.st $P/lpk.st --tol 2e-5"
done
pkcase pass "mpiexec -n 3 gdncp layer --cp scan, offsets from the file's tensor == single rank (tol 2e-5)" bash -c \
  "$MPIEXEC -n 3 $L layer $LW $C16 --in $P/xc.st --out $P/lcp.st --cp scan && $L diff $P/lcp.st $P/lpk.st --tol 2e-5"
pkcase fail "mpiexec -n 3 gdncp layer --cp scan WITHOUT --cu-seqlens vs the packed single-rank run (negative control)" bash -c \
  "$MPIEXEC -n 3 $L layer $LW $C16 --in $P/x1.st --out $P/lcp.st --cp scan --shards 10,30,50 && $L diff $P/lcp.st $P/lpk.st --tol 2e-5"
while IFS='|' read -r want msg cmd; do
  if eval "timeout 60 $cmd" >"$P/log" 2>&1 </dev/null; then got=0; else got=$?; fi
  if [ "$got" = "$want" ] && grep -q -- "$msg" "$P/log"; then echo "PASS  ${cmd//"$LW "/}: exit $got, \"$(grep -m1 -o -- "$msg.*" "$P/log" | cut -c1-90)\""; passed=$((passed + 1))
  else echo "FAIL  $cmd (exit $got, wanted $want and '$msg')"; cat "$P/log"; failed=$((failed + 1)); fi
done <<LIST
1|must end at T|$L layer $LW --in $P/x1.st --out $P/x.st --cu-seqlens 0,50,89
1|strictly increasing|$L layer $LW --in $P/x1.st --out $P/x.st --cu-seqlens 0,50,50,90
1|must start at 0|$L layer $LW --in $P/x1.st --out $P/x.st --cu-seqlens 3,50,90
1|needs B = 1|$L layer $LW --in $golden/layer_small.io.safetensors --out $P/x.st --cu-seqlens 0,50,90
1|differs from the cu_seqlens tensor|$L layer $LW --in $P/xc.st --out $P/x.st --cu-seqlens 0,50,90
1|does not combine with packed documents|$L layer $LW --in $P/xc.st --out $P/x.st --decode 3
2|--cu-seqlens|$L layer $LW --in $P/x1.st --out $P/x.st --cu-seqlens 0,50,x
1|strictly increasing|$MPIEXEC -n 3 $L layer $LW --in $P/x1.st --out $P/x.st --cu-seqlens 0,50,50,90 --cp scan
2|--cu-seqlens|$MPIEXEC -n 3 $L layer $LW --in $P/x1.st --out $P/x.st --cu-seqlens 0,9x --cp scan
1|to divide Hk|$MPIEXEC -n 3 $L layer $LW --in $P/xc.st --out $P/x.st --cp heads
LIST
# bench cp's packed-vs-dense rows: every strategy reports a ratio and oracle errors below 1e-5
if OMP_NUM_THREADS=1 timeout 300 $MPIEXEC -n 2 $L bench cp --T 4096 --reps 1 --packed-only --json > "$P/bench.json" 2>&1 &&
   [ "$(grep -c '"bench":"cp_packed"' "$P/bench.json")" = 4 ] && grep -q '"packed_over_dense":[0-9]' "$P/bench.json" &&
   ! grep '"bench":"cp_packed"' "$P/bench.json" | grep -q '_rel_err_[a-z]*":\(nan\|null\|[0-9.]*e-0[0-5]\|[0-9.]*e+\)'; then
  echo "PASS  mpiexec -n 2 gdncp bench cp --packed-only: 4 strategies, packed/dense ratios, errors vs the oracle below 1e-5"; passed=$((passed + 1))
else echo "FAIL  bench cp --packed-only smoke"; cat "$P/bench.json"; failed=$((failed + 1)); fi

echo "== option values: out of range, not a number, trailing characters, overflow, NaN -> exit 2 naming the option"
# Each line: the exit status wanted, the option the message must name, the command (every other
# argument valid). 2 is a usage error; 1 a value that only the input shows wrong (a --decode longer
# than the sequence, a --shards list). The last line is the control: the same options with good
# values must run.
R="--in $g1 --out $logs/opt.st"
LW="--weights $golden/layer_small.weights.safetensors --in $golden/layer_small.io.safetensors --out $logs/opt.st"
while IFS='|' read -r want opt cmd; do
  if eval "timeout 60 $cmd" >"$logs/opt.log" 2>&1 </dev/null; then got=0; else got=$?; fi
  if [ "$got" = "$want" ] && { [ "$want" = 0 ] || grep -q -- "$opt" "$logs/opt.log"; }; then
    lbl=${cmd//"$LW"/LAYER_SMALL}; lbl=${lbl//"$R"/--in gdn_qwen_heads --out OUT}; lbl=${lbl//"$L "/}
    echo "PASS  ${lbl//"$logs/"/} -> exit $got${opt:+: $(grep -m1 -o -- "$opt.*" "$logs/opt.log" | cut -c1-100)}"; passed=$((passed + 1))
  else echo "FAIL  $cmd: exit $got (wanted $want, a message naming '$opt')"; cat "$logs/opt.log"; failed=$((failed + 1)); fi
done <<EOF
2|--chunk|$L run --chunk 12abc $R
2|--chunk|$L run --chunk 99999999999999999999 $R
2|--chunk|$L run --chunk 48 $R
2|--chunk|$L run $R --chunk
2|--threads|$L run --threads -1 $R
2|--threads|$L run --threads 1e9 $R
2|--scale|$L run --scale nan $R
2|--scale|$L run --scale inf $R
2|--scale|$L run --scale 1e300 $R
2|--scale|$L run --scale 0 $R
2|--scale|$L run --scale '' $R
2|--chunk|$MPIEXEC -n 2 $L run --cp scan --chunk 7x $R
1|--shards|$MPIEXEC -n 2 $L run --cp scan --shards 1,63, $R
1|--shards|$MPIEXEC -n 2 $L run --cp scan --shards ' 1,63' $R
2|--T|$L gen --T 0 --out $logs/opt.st
2|--T|$L gen --T 99999999999999999999 --out $logs/opt.st
2|--B|$L gen --B -3 --out $logs/opt.st
2|--Hv|$L gen --Hv 4x --out $logs/opt.st
2|--K|$L gen --K 300 --out $logs/opt.st
2|--seed|$L gen --seed 1.5 --out $logs/opt.st
2|--slow-fraction|$L gen --slow-fraction nan --out $logs/opt.st
2|--slow-fraction|$L gen --slow-fraction 2 --out $logs/opt.st
2|--decode|$L layer $LW --decode 0
2|--decode|$L layer $LW --decode 1e3
1|--decode|$L layer $LW --decode 100000
2|--eps|$L layer $LW --eps nan
2|--eps|$L layer $LW --eps 0
2|--threads|$L layer $LW --threads 0
2|--chunk|$L layer $LW --chunk 48
2|--Kc|$L layer $LW --Kc 17
2|--tol|$L diff $g1 $g1 --tol -1
2|--tol|$L diff $g1 $g1 --tol nan
2|--tol|$L diff $g1 $g1 --tol inf
2|--tol|$L diff $g1 $g1 --tol 1e9
2|--T|$L bench layer --T 0
2|--reps|$MPIEXEC -n 1 $L bench cp --reps 17
2|--T|$MPIEXEC -n 1 $L bench cp --T -5
2|--ckpt|$L bench decode --ckpt
1|no such checkpoint|$L bench decode --ckpt $logs/none
1|no complete checkpoint|$L bench decode --ckpt $golden
0||$L run --chunk 32 --threads 1 --scale 0.125 $R && $L gen --B 1 --T 64 --Hk 1 --Hv 2 --K 16 --V 16 --seed 7 --slow-fraction 0.5 --out $logs/opt2.st && $L diff $g1 $g1 --tol 0 && $L layer $LW --decode 8 --eps 1e-6 --chunk 32 --threads 1
EOF

echo "== memory: sizes that cannot fit are refused before loading, the ranks on one machine counted together"
# Sparse input files (zeros, no disk used). run: q, k, v [1,T,1,128], g, beta [1,T,1], 2056 bytes
# a token held (1544 of inputs, 512 of the output o); at T_alone the inputs alone fit (the
# loader's own check passes), with the output they do not; at T_pair each of 2 ranks' halves fits
# alone, both together do not. layer: x [1,T,64] for layer_small's weights, x and y 512 bytes a
# token. Every run is under `ulimit -v` of 45 % of the memory, below what any case would load,
# so a regression fails with malloc's message instead of waking the OOM killer.
sparse_file() { # sparse_file PATH HEADER_JSON DATA_BYTES
  local h=$2 n i
  while [ $((${#h} % 8)) != 0 ]; do h="$h "; done
  n=${#h}
  { for i in 0 1 2 3 4 5 6 7; do printf "\\x$(printf %02x $(((n >> (8 * i)) & 255)))"; done; printf '%s' "$h"; } >"$1"
  truncate -s $((8 + n + $3)) "$1"
}
sparse_problem() { # sparse_problem PATH T
  local sq=$(($2 * 512)) sg=$(($2 * 4)) t
  t() { echo "\"$1\":{\"dtype\":\"F32\",\"shape\":[1,$2$3],\"data_offsets\":[$4,$5]}"; }
  sparse_file "$1" "{$(t q "$2" ,1,128 0 $sq),$(t k "$2" ,1,128 $sq $((2 * sq))),$(t v "$2" ,1,128 $((2 * sq)) $((3 * sq))),$(t g "$2" ,1 $((3 * sq)) $((3 * sq + sg))),$(t beta "$2" ,1 $((3 * sq + sg)) $((3 * sq + 2 * sg)))}" $((3 * sq + 2 * sg))
}
phys=$(($(getconf _PHYS_PAGES) * $(getconf PAGESIZE)))
T_alone=$((phys * 115 / 100 / 2056)); T_pair=$((phys * 150 / 100 / 2056)); T_layer=$((phys * 120 / 100 / 512))
for spec in "1|run|$T_alone|gdncp run, T = $T_alone: the inputs fit, inputs + output do not|inputs and outputs needs" \
            "2|run|$T_pair|mpiexec -n 2 gdncp run --cp scan, T = $T_pair: each rank's half fits, both do not|2 rank(s) on this machine together" \
            "1|layer|$T_layer|gdncp layer, x of T = $T_layer: x and y do not fit|input and output rows needs" \
            "2|run|64|mpiexec -n 2 gdncp run --cp scan, the same file format at T = 64 (control)|" \
            "1|run|64|gdncp run, T = 64 (control)|" \
            "1|layer|64|gdncp layer, T = 64 (control)|"; do
  IFS='|' read -r d cmd T label needle <<<"$spec"
  if [ "$cmd" = run ]; then sparse_problem "$logs/sparse.st" "$T"; args=(run --in "$logs/sparse.st")
  else sparse_file "$logs/sparse.st" "{\"x\":{\"dtype\":\"F32\",\"shape\":[1,$T,64],\"data_offsets\":[0,$((T * 256))]}}" $((T * 256))
       args=(layer --weights "$golden/layer_small.weights.safetensors" --in "$logs/sparse.st"); fi
  launch=(); [ "$d" = 2 ] && launch=($MPIEXEC -n 2) && args+=(--cp scan)
  if (ulimit -v $((phys * 45 / 100 / 1024)); timeout 120 "${launch[@]}" $L "${args[@]}" --out "$logs/sparse_o.st") >"$logs/mem.log" 2>&1
  then got=0; else got=$?; fi
  if { [ -z "$needle" ] && [ "$got" = 0 ]; } || { [ -n "$needle" ] && [ "$got" = 1 ] && grep -q "$needle" "$logs/mem.log"; }; then
    echo "PASS  $label: exit $got${needle:+, \"$(grep -m1 -o "needs .*memory in all" "$logs/mem.log")\"}"; passed=$((passed + 1))
  else echo "FAIL  $label (exit $got)"; cat "$logs/mem.log"; failed=$((failed + 1)); fi
done
rm -f "$logs/sparse.st" "$logs/sparse_o.st"

echo "== docs/cli.md's command list is gdncp help's own text"
sed -n '/^usage: gdncp <command>/,/^```/p' "$(dirname "$0")/../docs/cli.md" | sed '$d' >"$logs/cli_md_usage.txt"
$L help >"$logs/help.txt" 2>&1
clicase pass "docs/cli.md's usage block = gdncp help, line for line" diff "$logs/help.txt" "$logs/cli_md_usage.txt"
clicase fail "negative control: that block with one line dropped" bash -c "sed 3d $logs/cli_md_usage.txt | diff $logs/help.txt -"
echo "== gdncp COMMAND --help: the command's usage on stdout, exit 0, nothing run"
helpcase() { # helpcase ARGS...: exit 0, stdout begins with a usage line naming the command, stderr empty
  local words="$*"; words=${words% --*}; words=${words% -h}
  "$L" "$@" >"$logs/help_out.txt" 2>"$logs/help_err.txt"; local rc=$?
  [ "$rc" = 0 ] && [ ! -s "$logs/help_err.txt" ] && head -1 "$logs/help_out.txt" | grep -q "^usage: .*gdncp $words"
}
for cmd in run layer attention diff gen train sample "bench" "bench kernel" "bench layer" "bench attention" \
           "bench train" "bench decode" "bench matmul" "bench cp" "bench attention-cp"; do
  clicase pass "gdncp $cmd --help" helpcase $cmd --help
done
clicase pass "gdncp sample -h, after other options" helpcase sample --tokens 3 -h
clicase fail "negative control: gdncp sample --halp (an unknown option) through the same check" helpcase sample --halp
if "$L" sample --halp >/dev/null 2>"$logs/help_err.txt"; then got=0; else got=$?; fi
if [ "$got" = 2 ] && grep -q "unknown option or missing value: --halp" "$logs/help_err.txt"; then
  echo "PASS  gdncp sample --halp: exit 2, the option named on stderr"; passed=$((passed + 1))
else echo "FAIL  gdncp sample --halp: exit $got"; cat "$logs/help_err.txt"; failed=$((failed + 1)); fi

echo "== GDNCP_ISA: the cap of the dispatched instruction sets (docs/design.md, Instruction sets)"
# The levels this CPU and build have, as every benchmark prints them: "[isa L..., fp32 kernels C]".
isa_of() { # isa_of [ENV...]: the header of a quick bench matmul run under that environment
  env "$@" "$L" bench matmul --quick --reps 1 --M 32 2>&1 | head -2
}
head2=$(isa_of)
cpu_isa=$(echo "$head2" | sed -n 's/.*\[isa \([a-z0-9]*\).*/\1/p' | head -1)
# (run under a cap itself: the header names the CPU's own level beside it)
case $head2 in *"the CPU has "*) cpu_isa=$(echo "$head2" | sed -n 's/.*the CPU has \([a-z0-9]*\).*/\1/p' | head -1) ;; esac
built=$(echo "$head2" | sed -n 's/.*fp32 kernels \([a-z0-9]*\)\].*/\1/p' | head -1)
if [ -z "$cpu_isa" ] || [ -z "$built" ]; then echo "FAIL  no '[isa ..., fp32 kernels ...]' in the benchmark header: $head2"; failed=$((failed + 1)); fi
isa_refused() { # isa_refused VALUE NEEDLE LABEL: exit 2 with the needle on stderr, before any run
  if GDNCP_ISA=$1 "$L" gen --T 4 --out "$logs/isa.safetensors" >"$logs/isa.log" 2>&1; then got=0; else got=$?; fi
  if [ "$got" = 2 ] && grep -q "$2" "$logs/isa.log" && [ ! -e "$logs/isa.safetensors" ]; then
    echo "PASS  GDNCP_ISA=$1 refused: $3"; passed=$((passed + 1))
  else echo "FAIL  GDNCP_ISA=$1 (exit $got, want 2 and '$2'): $3"; cat "$logs/isa.log"; failed=$((failed + 1)); fi
  rm -f "$logs/isa.safetensors"
}
isa_refused bogus "expected avx2, avx512, avx512bf16 or amx" "an unknown name"
isa_refused AVX2 "expected avx2" "names are lower case"
levels="avx2 avx512 avx512bf16 amx"
above=""; below=""; seen=0
for l in $levels; do
  [ "$l" = "$cpu_isa" ] && { seen=1; continue; }
  if [ $seen = 1 ] && [ -z "$above" ]; then above=$l; fi
done
for l in $levels; do [ "$l" = "$built" ] && break; below=$l; done
if [ -n "$above" ]; then isa_refused "$above" "run at most $cpu_isa" "a level this CPU ($cpu_isa) lacks"
else echo "NOT RUN  GDNCP_ISA above the CPU's level ($cpu_isa is the highest)"; fi
if [ -n "$below" ]; then isa_refused "$below" "compiled for $built" "below this build's fp32 kernels ($built)"
else echo "NOT RUN  GDNCP_ISA below the build's level ($built: a portable build accepts every level up to the CPU's)"; fi
# control: the CPU's own level and the build's are accepted, and what runs says so
for l in $cpu_isa $built; do
  h=$(isa_of GDNCP_ISA="$l")
  if echo "$h" | grep -q "\[isa $l[ ,]"; then echo "PASS  GDNCP_ISA=$l accepted, the benchmark header names it"; passed=$((passed + 1))
  else echo "FAIL  GDNCP_ISA=$l: $h"; failed=$((failed + 1)); fi
done
# capped below avx512bf16, the BF16 products take the FMA path, never VDPBF16PS or AMX tiles
if [ "$built" != "$cpu_isa" ] && { [ "$built" = avx2 ] || [ "$built" = avx512 ]; }; then
  h=$(isa_of GDNCP_ISA="$built")
  if echo "$h" | grep -q "bf16: bf16 operands on the fp32 FMA micro-kernel"; then
    echo "PASS  GDNCP_ISA=$built: BF16 compute on the FMA path"; passed=$((passed + 1))
  else echo "FAIL  GDNCP_ISA=$built: BF16 compute not on the FMA path: $h"; failed=$((failed + 1)); fi
else echo "NOT RUN  BF16 under a cap below the CPU's BF16 instructions (CPU $cpu_isa, build $built)"; fi
# GDNCP_MUTATE: a name that is no test site is refused naming the nearest (a misspelt control would
# run the clean computation and pass); the control, a real site, runs; every site of the sources
# (the generated table) is documented in docs/testing.md
sites=$bd/generated/gdn_test_sites.h
if [ -f "$sites" ]; then
  out=$(GDNCP_MUTATE="zero: a slice updatd twice" $L run --in "$golden/gdn_small.safetensors" --out "$logs/m.st" 2>&1); rc=$?
  if [ "$rc" = 2 ] && echo "$out" | grep -qF 'no test site of this library' && echo "$out" | grep -qF '"zero: a slice updated twice"'; then
    echo "PASS  GDNCP_MUTATE with a misspelt site: exit 2, the nearest named"; passed=$((passed + 1))
  else echo "FAIL  GDNCP_MUTATE with a misspelt site (exit $rc): $out"; failed=$((failed + 1)); fi
  if GDNCP_MUTATE="zero: a slice updated twice,moe_ep.drop_rows=2" $L run --in "$golden/gdn_small.safetensors" --out "$logs/m.st" >/dev/null 2>&1; then
    echo "PASS  GDNCP_MUTATE naming real sites (one with a value) runs (control)"; passed=$((passed + 1))
  else echo "FAIL  GDNCP_MUTATE naming real sites was refused"; failed=$((failed + 1)); fi
  n=0; missing=""
  while IFS= read -r site; do
    n=$((n + 1)); grep -qF -- "\`$site\`" docs/testing.md || missing="$missing '$site'"
  done < <(grep -oE '^    ".*",' "$sites" | sed -E 's/^    "(.*)",$/\1/')
  if [ "$n" -gt 20 ] && [ -z "$missing" ]; then echo "PASS  all $n test sites of the sources are in docs/testing.md"; passed=$((passed + 1))
  else echo "FAIL  test sites ($n found) missing from docs/testing.md:$missing"; failed=$((failed + 1)); fi
else echo "NOT RUN  GDNCP_MUTATE's site check (a build without test hooks has no site table)"; fi
finish
