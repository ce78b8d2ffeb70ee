#!/usr/bin/env bash
# gdncp attention end to end against transformers' exact (float64) references for qwen35_tiny's
# layer 3 (tests/data/qwen35_tiny/attn.io.safetensors): forward, backward and every weight
# gradient; positions from --position-offset, from a position_ids tensor, packed documents (from
# restarting position_ids, --cu-seqlens or a cu_seqlens tensor, each document checked against
# its rows run alone); [T, E] inputs; prefill + decode through the KV cache; each comparison beside
# a negative control that must fail it; refusals (exit status and a word of the message). The
# context-parallel cases (mpiexec, gdn_attn_cp_*) are in attn_cp_cases below and run only with
# GDN_TEST_ATTN_CP=1 (they are not counted otherwise).
# Usage: scripts/test_attention.sh BUILD_DIR. Ends with "N passed, N failed"; exits 1 on a failure.
. "$(dirname "$0")/test_common.sh"
tiny=$golden/qwen35_tiny
ref=$tiny/attn.io.safetensors
W=(--weights "$tiny/model.safetensors" --config "$tiny/config.json" --prefix model.layers.3.self_attn.)
SL="python3 scripts/st_slice.py"
A=$logs/a; mkdir -p "$A"
acase() { # acase EXPECT(pass|fail) LABEL CMD...: run a shell command line, compare with EXPECT
  local expect=$1 label=$2; shift 2
  if timeout 300 "$@" >"$A/log" 2>&1; then got=pass; else got=fail; fi
  if [ "$got" = "$expect" ]; then echo "PASS  $label ($expect as expected)"; passed=$((passed + 1))
  else echo "FAIL  $label (expected $expect)"; cat "$A/log"; failed=$((failed + 1)); fi
}
Wargs="${W[*]}" # (no blanks in these paths)
run() { $L attention $Wargs "$@"; }
# diffn OURS REF N: every tensor within 1e-5 of the exact reference, and exactly N of them compared
diffn() { $L diff "$1" "$2" --tol 1e-5 >"$A/diff" 2>&1; local st=$?; cat "$A/diff"; [ $st = 0 ] && grep -q "^$3 tensor(s) compared" "$A/diff"; }
export -f run diffn; export L A Wargs

# Inputs cut from the reference file (st_slice.py: --rename, --f32, --squeeze, --position-ids).
$SL "$ref" "$A/nopos.st" --keep x,dy                                          # no position_ids: 0..T-1
$SL "$ref" "$A/off.st" --rename x_off=x,x=x0 --keep x                         # x_off alone
$SL "$ref" "$A/offref.st" --rename y_off=y,y=y0 --keep y                      # its reference y
$SL "$ref" "$A/offpos.st" --rename x_off=x,x=x0,position_ids_off=position_ids,position_ids=p0 --keep x,position_ids
$SL "$ref" "$A/off2d.st" --rename x_off=x,x=x0 --keep x --f32 --squeeze       # [64, 96]
$SL "$ref" "$A/off2dref.st" --rename y_off=y,y=y0 --keep y --f32 --squeeze
$SL "$tiny/model.safetensors" "$A/swapped.st" \
  --rename model.layers.3.self_attn.q_norm.weight=model.layers.3.self_attn.k_norm.weight,model.layers.3.self_attn.k_norm.weight=model.layers.3.self_attn.q_norm.weight
Wsw=(--weights "$A/swapped.st" --config "$tiny/config.json" --prefix model.layers.3.self_attn.)

echo "== gdncp attention: qwen35_tiny layer 3 against transformers' exact references (tol 1e-5)"
acase pass "forward + backward (positions from the file's position_ids 0..149): y, dx and the 6 weight gradients" \
  bash -c "run --in $ref --out $A/o.st --backward && diffn $A/o.st $ref 8"
acase pass "the same with --recompute (the backward recomputes the forward)" \
  bash -c "run --in $ref --out $A/o.st --backward --recompute && diffn $A/o.st $ref 8"
acase pass "an input without position_ids (positions 0..T-1), --threads 1" \
  bash -c "run --in $A/nopos.st --out $A/o.st --backward --threads 1 && diffn $A/o.st $ref 8"
acase fail "negative control: q_norm and k_norm swapped in the checkpoint" \
  bash -c "$L attention ${Wsw[*]} --in $ref --out $A/o.st --backward && $L diff $A/o.st $ref --tol 1e-5"
# BF16 compute: within BF16's accuracy of the exact references (measured ~4e-3; the exact checks
# are tests/layer/test_compute_bf16.c's); control: the swapped norms through the same tolerance.
acase pass "--compute bf16 forward + backward: the 8 tensors within 5e-2 of the exact references" \
  bash -c "run --in $ref --out $A/ob.st --backward --compute bf16 | grep -q 'products: bf16' && $L diff $A/ob.st $ref --tol 5e-2 | grep -q '^8 tensor(s) compared'"
acase fail "negative control: --compute bf16 with q_norm and k_norm swapped (tol 5e-2)" \
  bash -c "$L attention ${Wsw[*]} --in $ref --out $A/ob.st --backward --compute bf16 && $L diff $A/ob.st $ref --tol 5e-2"
acase fail "negative control: without --config (RoPE theta 1e7 by default, the checkpoint's is 10000)" \
  bash -c "$L attention --weights $tiny/model.safetensors --prefix model.layers.3.self_attn. --in $ref --out $A/o.st && $L diff $A/o.st $ref --tol 1e-5"
acase pass "x_off at positions 1000..1063 by --position-offset 1000 == y_off" \
  bash -c "run --in $A/off.st --out $A/o.st --position-offset 1000 && diffn $A/o.st $A/offref.st 1"
acase pass "x_off with its position_ids tensor (1000..1063) == y_off" \
  bash -c "run --in $A/offpos.st --out $A/o.st && diffn $A/o.st $A/offref.st 1"
acase pass "x_off with position_ids and the same --position-offset 1000 == y_off" \
  bash -c "run --in $A/offpos.st --out $A/o.st --position-offset 1000 && diffn $A/o.st $A/offref.st 1"
# A constant offset cancels in RoPE (q at p and k at p' meet through p - p' only), so x_off at
# positions 0..63 gives y_off too, to rounding: the reference checks the angles at large positions
# (computed in double here), and no offset can serve as a negative control. The controls for
# x_off are a wrong model (swapped norms) and, below, positions that do not shift uniformly
# (packed documents).
acase pass "x_off at positions 0..63 == y_off as well (RoPE sees relative positions only)" \
  bash -c "run --in $A/off.st --out $A/o.st && diffn $A/o.st $A/offref.st 1"
acase fail "negative control: x_off --position-offset 1000 with q_norm and k_norm swapped vs y_off" \
  bash -c "$L attention ${Wsw[*]} --in $A/off.st --out $A/o.st --position-offset 1000 && $L diff $A/o.st $A/offref.st --tol 1e-5"
acase pass "a [T, E] input (x_off as [64, 96], F32) at --position-offset 1000: y [64, 96] == y_off" \
  bash -c "run --in $A/off2d.st --out $A/o.st --position-offset 1000 && diffn $A/o.st $A/off2dref.st 1"

echo "== prefill + decode through the KV cache (gdn_attn_decode) == the exact forward"
$SL "$ref" "$A/xy.st" --keep x,y
acase pass "--decode 8: 142 tokens prefilled, 8 decoded one by one, B = 2: y == the exact y" \
  bash -c "run --in $A/xy.st --out $A/o.st --decode 8 && diffn $A/o.st $A/xy.st 1"
acase pass "--decode 150 (every token decoded, no prefill): y == the exact y" \
  bash -c "run --in $A/xy.st --out $A/o.st --decode 150 && diffn $A/o.st $A/xy.st 1"
acase pass "x_off --decode 5 --position-offset 1000 == y_off" \
  bash -c "run --in $A/off.st --out $A/o.st --decode 5 --position-offset 1000 && diffn $A/o.st $A/offref.st 1"
acase fail "negative control: --decode 8 with q_norm and k_norm swapped vs the exact y" \
  bash -c "$L attention ${Wsw[*]} --in $A/xy.st --out $A/o.st --decode 8 && $L diff $A/o.st $A/xy.st --tol 1e-5"

echo "== packed documents: each document of the stream == its rows run alone"
# batch row 0 of x, dy as F32 [1, 150, 96]; documents of 50, 1 and 99 tokens
$SL "$ref" "$A/r0.st" --f32 --batch 0 --keep x,dy
$SL "$A/r0.st" "$A/pk_pos.st" --position-ids 0:50,0:1,0:99               # restarting position_ids
$SL "$A/r0.st" "$A/pk_cu.st" --cu-seqlens 0,50,51,150                    # a cu_seqlens tensor
run --in "$A/pk_pos.st" --out "$A/pk.st" --backward >/dev/null 2>&1
d=0; for span in 0:50 50:51 51:150; do
  acase pass "document $d (tokens $span) of the stream packed by restarting position_ids == run alone (y, dx; tol 2e-5)" \
    bash -c "$SL $A/r0.st $A/alone_in.st --rows $span && $L attention ${W[*]} --in $A/alone_in.st --out $A/alone.st --backward && $SL $A/pk.st $A/cut.st --rows $span --keep y,dx && $L diff $A/cut.st $A/alone.st --tol 2e-5"
  d=$((d + 1))
done
acase pass "--cu-seqlens 0,50,51,150 == the restarting position_ids (y, dx, grads bit for bit)" \
  bash -c "$L attention ${W[*]} --in $A/r0.st --out $A/pk2.st --backward --cu-seqlens 0,50,51,150 && $L diff $A/pk2.st $A/pk.st --tol 0"
acase pass "a cu_seqlens tensor in the file == the restarting position_ids (bit for bit)" \
  bash -c "$L attention ${W[*]} --in $A/pk_cu.st --out $A/pk2.st --backward && $L diff $A/pk2.st $A/pk.st --tol 0"
acase pass "a cu_seqlens tensor and the position_ids that agree with it, both in the file (bit for bit)" \
  bash -c "$SL $A/pk_cu.st $A/pk_both.st --position-ids 0:50,0:1,0:99 && $L attention ${W[*]} --in $A/pk_both.st --out $A/pk2.st --backward && $L diff $A/pk2.st $A/pk.st --tol 0"
acase fail "negative control: the same stream dense (no offsets): document 2 != run alone" \
  bash -c "$L attention ${W[*]} --in $A/r0.st --out $A/dense.st && $SL $A/dense.st $A/cut.st --rows 51:150 --keep y && $SL $A/alone.st $A/alone_y.st --keep y && $L diff $A/cut.st $A/alone_y.st --tol 2e-5"

echo "== refusals: exit status and a word of the message"
$SL "$ref" "$A/nody.st" --keep x,position_ids
$SL "$ref" "$A/jump.st" --keep x,dy --position-ids 0:10,11:151               # skips position 10 (B = 2)
$SL "$ref" "$A/short.st" --keep x --position-ids 0:100
$SL "$ref" "$A/rows.st" --keep x --position-ids "0:150;5:155"               # a different offset per row
$SL "$A/r0.st" "$A/late.st" --position-ids 0:50,0:1,3:102                   # a restart, then a jump (B = 1)
$SL "$A/r0.st" "$A/r0pos.st" --position-ids 0:150                           # dense position_ids, B = 1
$SL "$A/r0.st" "$A/t2.st" --rows 0:2                                         # 2 tokens
$SL "$ref" "$A/pkb2.st" --keep x --position-ids 0:50,0:100                  # packed, but B = 2
$SL "$golden/layer_small.io.safetensors" "$A/w64.st" --keep x                # x of width 64
while IFS='|' read -r want msg cmd; do
  if eval "timeout 120 $cmd" >"$A/log" 2>&1 </dev/null; then got=0; else got=$?; fi
  if [ "$got" = "$want" ] && grep -q -- "$msg" "$A/log"; then
    echo "PASS  ${cmd//"$L attention ${W[*]} "/attention LAYER3 }: exit $got, \"$(grep -m1 -o -- "$msg.*" "$A/log" | cut -c1-100)\""; passed=$((passed + 1))
  else echo "FAIL  $cmd (exit $got, wanted $want and '$msg')"; cat "$A/log"; failed=$((failed + 1)); fi
done <<LIST
1|cannot open|$L attention --weights $A/missing.safetensors --in $ref --out $A/x.st
1|no attention weights under the prefix 'model.layers.0.self_attn.'|$L attention --weights $tiny/model.safetensors --prefix model.layers.0.self_attn. --in $ref --out $A/x.st
1|prefix 'model.layers.3.self_attn.'|$L attention --weights $tiny/model.safetensors --in $ref --out $A/x.st
1|has width 64, but the layer's hidden size E is 96|$L attention ${W[*]} --in $A/w64.st --out $A/x.st
1|no tensor 'dy'|$L attention ${W[*]} --in $A/nody.st --out $A/x.st --backward
1|must be 0..T-1 plus one offset per sequence|$L attention ${W[*]} --in $A/jump.st --out $A/x.st
1|'position_ids' must be \[T = 150\]|$L attention ${W[*]} --in $A/short.st --out $A/x.st
1|one position offset for every row|$L attention ${W[*]} --in $A/rows.st --out $A/x.st
1|neither the next position nor a document start|$L attention ${W[*]} --in $A/late.st --out $A/x.st
1|packed documents: one row|$L attention ${W[*]} --in $A/pkb2.st --out $A/x.st
1|but position_ids start at 1000|$L attention ${W[*]} --in $A/offpos.st --out $A/x.st --position-offset 7
1|positions restart at 0|$L attention ${W[*]} --in $A/r0.st --out $A/x.st --cu-seqlens 0,50,150 --position-offset 3
1|position_ids hold 3 document(s), cu_seqlens 2 (the first 2 start alike)|$L attention ${W[*]} --in $A/pk_pos.st --out $A/x.st --cu-seqlens 0,50,150
1|without restarting, but cu_seqlens holds 2|$L attention ${W[*]} --in $A/r0pos.st --out $A/x.st --cu-seqlens 0,50,150
1|must end at T|$L attention ${W[*]} --in $A/r0.st --out $A/x.st --cu-seqlens 0,50,149
1|needs B = 1|$L attention ${W[*]} --in $A/nopos.st --out $A/x.st --cu-seqlens 0,50,150
1|beyond max_position = 32768|$L attention ${W[*]} --in $A/off.st --out $A/x.st --position-offset 40000
1|--decode 151 asks for more tokens|$L attention ${W[*]} --in $ref --out $A/x.st --decode 151
1|does not combine with packed|$L attention ${W[*]} --in $A/pk_pos.st --out $A/x.st --decode 2
2|does not combine with --backward|$L attention ${W[*]} --in $ref --out $A/x.st --decode 2 --backward
2|need --cp|$L attention ${W[*]} --in $ref --out $A/x.st --stats
2|they need --backward|$L attention ${W[*]} --in $ref --out $A/x.st --recompute
2|--position-offset|$L attention ${W[*]} --in $ref --out $A/x.st --position-offset -1
2|--threads|$L attention ${W[*]} --in $ref --out $A/x.st --threads 0
2|unknown option or missing value: --bogus|$L attention ${W[*]} --in $ref --out $A/x.st --bogus
2|are required|$L attention ${W[*]} --in $ref
1|unknown --cp strategy 'spiral'|$MPIEXEC -n 2 $L attention ${W[*]} --in $ref --out $A/x.st --cp spiral
1|--cp heads needs the number of ranks D = 3 to divide H = 4|$MPIEXEC -n 3 $L attention ${W[*]} --in $ref --out $A/x.st --cp heads
1|more ranks than tokens|$MPIEXEC -n 3 $L attention ${W[*]} --in $A/t2.st --out $A/x.st --cp kv
LIST
if ! ls "$A" | grep -q 'st.tmp'; then echo "PASS  no temporary output file left behind"; passed=$((passed + 1))
else echo "FAIL  a temporary output file was left in $A"; failed=$((failed + 1)); fi

# Context parallelism (gdn_attn_cp_forward / gdn_attn_cp_backward): split runs against the exact
# references and the single-rank file; every comparison with a negative control.
attn_cp_cases() {
  echo "== gdncp attention --cp under mpiexec: = the exact references and the single-rank run"
  run --in "$ref" --out "$A/one.st" --backward >/dev/null 2>&1
  for spec in "2 kv -" "3 kv 1,2,147" "3 kv 70,1,79" "2 heads -" "4 heads 40,40,40,30"; do
    set -- $spec; sh=; [ "$3" != - ] && sh="--shards $3"
    acase pass "mpiexec -n $1 --cp $2 $sh --backward: y, dx, 6 grads == the exact references (tol 1e-5)" \
      bash -c "$MPIEXEC -n $1 $L attention ${W[*]} --in $ref --out $A/cp.st --backward --cp $2 $sh && diffn $A/cp.st $ref 8"
    acase pass "mpiexec -n $1 --cp $2 $sh --backward == the single-rank file (tol 2e-5)" \
      bash -c "$L diff $A/cp.st $A/one.st --tol 2e-5"
  done
  acase pass "mpiexec -n 3 --cp kv --backward --recompute --stats: every rank's replay_s and comm_s printed" \
    bash -c "$MPIEXEC -n 3 $L attention ${W[*]} --in $ref --out $A/cp.st --backward --recompute --cp kv --stats && $L diff $A/cp.st $ref --tol 1e-5 && [ \$(grep -cE '^ +[0-2] .*(forward|backward) ' $A/log) = 6 ] && grep -q 'replay_s' $A/log"
  acase fail "negative control: mpiexec -n 3 --cp kv (GDNCP_MUTATE: the keys and values of earlier ranks dropped) vs the exact references" \
    bash -c "GDNCP_MUTATE='attention cp: keys and values of earlier ranks dropped' $MPIEXEC -n 3 $L attention ${W[*]} --in $ref --out $A/cp.st --cp kv && $L diff $A/cp.st $ref --tol 1e-5"
  acase fail "negative control: mpiexec -n 3 --cp kv --backward (GDNCP_MUTATE: the key and value gradients of later ranks dropped) vs the exact references" \
    bash -c "GDNCP_MUTATE='attention cp: key and value gradients of later ranks dropped' $MPIEXEC -n 3 $L attention ${W[*]} --in $ref --out $A/cp.st --backward --cp kv && $L diff $A/cp.st $ref --tol 1e-5"
  acase fail "negative control: mpiexec -n 2 --cp heads (GDNCP_MUTATE: the keys and values of earlier ranks dropped) vs the exact references" \
    bash -c "GDNCP_MUTATE='attention cp: keys and values of earlier ranks dropped' $MPIEXEC -n 2 $L attention ${W[*]} --in $ref --out $A/cp.st --cp heads && $L diff $A/cp.st $ref --tol 1e-5"
  for spec in "3 kv" "2 heads"; do
    set -- $spec
    acase pass "mpiexec -n $1 --cp $2: x_off by --position-offset 1000 == y_off" \
      bash -c "$MPIEXEC -n $1 $L attention ${W[*]} --in $A/off.st --out $A/cp.st --position-offset 1000 --cp $2 && diffn $A/cp.st $A/offref.st 1"
    acase pass "mpiexec -n $1 --cp $2: x_off with its position_ids == y_off" \
      bash -c "$MPIEXEC -n $1 $L attention ${W[*]} --in $A/offpos.st --out $A/cp.st --cp $2 && diffn $A/cp.st $A/offref.st 1"
    acase pass "mpiexec -n $1 --cp $2: packed (restarting position_ids) --backward == the single-rank packed run (tol 2e-5)" \
      bash -c "$MPIEXEC -n $1 $L attention ${W[*]} --in $A/pk_pos.st --out $A/cp.st --backward --cp $2 && $L diff $A/cp.st $A/pk.st --tol 2e-5"
  done
  acase fail "negative control: mpiexec -n 3 --cp kv (GDNCP_MUTATE: the keys and values of earlier ranks dropped): x_off at --position-offset 1000 vs y_off" \
    bash -c "GDNCP_MUTATE='attention cp: keys and values of earlier ranks dropped' $MPIEXEC -n 3 $L attention ${W[*]} --in $A/off.st --out $A/cp.st --position-offset 1000 --cp kv && $L diff $A/cp.st $A/offref.st --tol 1e-5"
  acase fail "negative control: mpiexec -n 3 --cp kv: the stream dense vs the packed run" \
    bash -c "$MPIEXEC -n 3 $L attention ${W[*]} --in $A/r0.st --out $A/cp.st --backward --cp kv && $L diff $A/cp.st $A/pk.st --tol 2e-5"
  acase pass "mpiexec -n 3 --cp kv --shards 50,1,99 --cu-seqlens 0,50,51,150 (a rank per document) == single rank (tol 2e-5)" \
    bash -c "$MPIEXEC -n 3 $L attention ${W[*]} --in $A/r0.st --out $A/cp.st --backward --cp kv --shards 50,1,99 --cu-seqlens 0,50,51,150 && $L diff $A/cp.st $A/pk.st --tol 2e-5"
  acase pass "mpiexec -n 3 --cp kv --decode 8: the prompt prefilled over the ranks, 8 tokens decoded with the cache split: y == the exact y" \
    bash -c "$MPIEXEC -n 3 $L attention ${W[*]} --in $A/xy.st --out $A/cp.st --cp kv --decode 8 && diffn $A/cp.st $A/xy.st 1"
  acase pass "mpiexec -n 2 --cp heads --decode 3 --shards 30,31 --position-offset 1000 (x_off, 64 tokens) == y_off" \
    bash -c "$MPIEXEC -n 2 $L attention ${W[*]} --in $A/off.st --out $A/cp.st --cp heads --decode 3 --shards 30,31 --position-offset 1000 && diffn $A/cp.st $A/offref.st 1"
  acase fail "negative control: mpiexec -n 3 --cp kv --decode 8 (GDNCP_MUTATE: the keys and values of earlier ranks dropped) (the other ranks' cache parts left out) vs the exact y" \
    bash -c "GDNCP_MUTATE='attention cp: keys and values of earlier ranks dropped' $MPIEXEC -n 3 $L attention ${W[*]} --in $A/xy.st --out $A/cp.st --cp kv --decode 8 && $L diff $A/cp.st $A/xy.st --tol 1e-5"
  acase pass "mpiexec -n 3 --cp kv: a [T, E] input at --position-offset 1000 == y_off" \
    bash -c "$MPIEXEC -n 3 $L attention ${W[*]} --in $A/off2d.st --out $A/cp.st --position-offset 1000 --cp kv && diffn $A/cp.st $A/off2dref.st 1"
}
attn_cp_cases
finish
