#!/usr/bin/env bash
# gdncp train and sample on token files (docs/training.md "Token files"), small enough for CI: a
# token file whose ids are the text's bytes trains bit for bit as the text does (uint16 and uint32,
# one rank and two CP ranks, --pack-id as --pack), a vocabulary of 300 trains over CP 2 as on one
# rank and samples ids; bad token files, ids beyond the vocabulary, --pack with a token file
# refused with a message on every rank. Each comparison beside a negative control that must fail it.
# Usage: scripts/test_tokens.sh BUILD_DIR. Ends with "N passed, N failed"; exits 1 on a failure.
. "$(dirname "$0")/test_train_common.sh"
head -c 200000 "$text" > "$work/t.txt" && text=$work/t.txt

# tokfile IN OUT WIDTH VOCAB [MAP]: a token file of IN's bytes as ids (perl; MAP, a perl
# expression of $_, maps each byte, and "skip1" drops the first id: the shifted control)
tokfile() {
  perl -e 'my ($w, $v, $map) = @ARGV; local $/; my $t = <STDIN>; my @b = unpack("C*", $t);
           if ($map eq "skip1") { shift @b } elsif ($map ne "") { @b = map { eval $map } @b }
           my $n = scalar @b;
           print pack("V6", 20261201, 1, $n & 0xffffffff, $n >> 32, $w, $v), "\0" x 1000,
                 pack(($w == 2 ? "v" : "V") . "*", @b)' "$3" "$4" "${5:-}" < "$1" > "$2"
}
tokfile "$text" "$work/t16.tok" 2 256
tokfile "$text" "$work/t32.tok" 4 0
tokfile "$text" "$work/shift.tok" 2 256 skip1

small=(--hidden 32 --layers 2 --intermediate 64 --key-heads 1 --value-heads 2 --key-dim 16 --value-dim 16
       --seq 66 --warmup 2 --lr 3e-3 --eval-every 0 --threads 1 --steps 4 --batch 2)
train() { # train RANKS LOG DATA ARGS...
  local n=$1 log=$2 data=$3; shift 3
  timeout 300 $MPIEXEC -n "$n" $g train --data "$data" "${small[@]}" --log "$log" "$@" >"$log.out" 2>&1
}
losses() { tail -n +2 "$1" | cut -d, -f2 | tr '\n' ' '; }
same() { # same LABEL A B: bit-identical loss columns
  if [ -s "$2" ] && [ "$(losses "$2")" = "$(losses "$3")" ]; then pass "$1: bit-identical losses ($(losses "$2"))"
  else fail "$1: '$(losses "$2")' vs '$(losses "$3")'"; cat "$2.out"; fi
}
differ() {
  if [ -s "$2" ] && [ "$(losses "$2")" != "$(losses "$3")" ]; then pass "negative control: $1 differs ($(losses "$2"))"
  else fail "negative control: $1 gives the same losses (the check cannot tell)"; fi
}

echo "== a token file of the text's bytes trains exactly as the text"
train 1 "$work/text1.csv" "$text" || fail "train on the text"
train 1 "$work/t16.csv" "$work/t16.tok" || fail "train on the uint16 token file"
same "uint16 token file (ids = bytes) vs the text, 1 rank" "$work/t16.csv" "$work/text1.csv"
grep -q "token file of uint16 ids" "$work/t16.csv.out" && pass "the trainer reports the token file (uint16)" ||
  fail "no token-file line in the trainer's output"
train 1 "$work/t32.csv" "$work/t32.tok" || fail "train on the uint32 token file"
same "uint32 token file vs the text, 1 rank" "$work/t32.csv" "$work/text1.csv"
train 1 "$work/shift.csv" "$work/shift.tok" || fail "train on the shifted token file"
differ "the token file shifted by one id" "$work/shift.csv" "$work/text1.csv"
train 2 "$work/text2.csv" "$text" --cp 2 || fail "train on the text, CP 2"
train 2 "$work/t16cp2.csv" "$work/t16.tok" --cp 2 || fail "train on the token file, CP 2"
same "uint16 token file vs the text, CP 2" "$work/t16cp2.csv" "$work/text2.csv"

echo "== packed documents: --pack-id N on a token file is --pack on the text"
# '%' (37) starts every fortune's closing line: a one-byte separator
train 1 "$work/pktext.csv" "$text" --seq 300 --pack '%' || fail "train the text with --pack %"
train 1 "$work/pkid.csv" "$work/t16.tok" --seq 300 --pack-id 37 || fail "train the token file with --pack-id 37"
same "--pack-id 37 on the token file vs --pack '%' on the text" "$work/pkid.csv" "$work/pktext.csv"
train 1 "$work/pkid2.csv" "$work/t16.tok" --seq 300 --pack-id 10 || fail "train with --pack-id 10"
differ "--pack-id 10 (another separator)" "$work/pkid2.csv" "$work/pktext.csv"
refuse "--pack SEP with a token file" "--pack-id" $MPIEXEC -n 1 $g train --data "$work/t16.tok" "${small[@]}" --pack '%'
refuse "--pack-id beyond the vocabulary" "outside the model's vocabulary" \
  $MPIEXEC -n 1 $g train --data "$work/t16.tok" "${small[@]}" --pack-id 256

echo "== a vocabulary of 300: ids above 255 train over CP 2 as on one rank; sample prints ids"
# bytes b -> (b * 7) % 300: ids up to 299, the same text structure
tokfile "$text" "$work/v300.tok" 2 300 '($_ * 7) % 300'
# (--lr 1e-2: by step 4 the state crossing ranks matters well above the tolerance, in the control)
train 1 "$work/v1.csv" "$work/v300.tok" --vocab 300 --lr 1e-2 --out "$work/v300ck" || fail "train vocab 300, 1 rank"
train 2 "$work/v2.csv" "$work/v300.tok" --vocab 300 --lr 1e-2 --cp 2 || fail "train vocab 300, CP 2"
expect_close "vocab 300, CP 2 vs one rank" "$work/v2.csv" "$work/v1.csv" 2e-5
GDNCP_MUTATE="cp: incoming state dropped" train 2 "$work/v2drop.csv" "$work/v300.tok" --vocab 300 --lr 1e-2 --cp 2 || fail "train vocab 300 drop"
d=$(lossdiff "$work/v2drop.csv" "$work/v1.csv")
awk -v d="$d" 'BEGIN { exit !(d != "inf" && d > 2e-5) }' && pass "negative control: vocab 300, CP 2 with the incoming state dropped: $d" ||
  fail "negative control: dropping the incoming state went unseen ($d)"
refuse "vocab 300 token file for a byte model" "vocabulary has 300 ids" \
  $MPIEXEC -n 1 $g train --data "$work/v300.tok" "${small[@]}"
ids=$($g sample --ckpt "$work/v300ck" --prompt-ids 7,14,280,299 --print-ids --tokens 12 --temperature 0 2>/dev/null)
if echo "$ids" | grep -qE '^[0-9]+(,[0-9]+){11}$' && [ "$(echo "$ids" | tr ',' '\n' | awk '$1 >= 300' | wc -l)" = 0 ]; then
  pass "sample from a vocab-300 checkpoint prints 12 ids below 300: $ids"
else fail "sample --print-ids from the vocab-300 checkpoint: '$ids'"; fi
ids2=$($g sample --ckpt "$work/v300ck" --prompt-ids 7,14,280,299 --print-ids --tokens 12 --temperature 0 2>/dev/null)
ids3=$($g sample --ckpt "$work/v300ck" --prompt-ids 7,14,280,298 --print-ids --tokens 12 --temperature 0 2>/dev/null)
[ "$ids" = "$ids2" ] && pass "greedy sampling of ids is reproducible" || fail "greedy ids differ: $ids vs $ids2"
[ "$ids" != "$ids3" ] && pass "negative control: another prompt id samples other ids" || fail "another prompt gave the same ids"
refuse "sample text from a vocab-300 checkpoint" "--prompt-ids" $g sample --ckpt "$work/v300ck" --prompt "The "
refuse "sample a prompt id beyond the vocabulary" "\[0, 300\)" $g sample --ckpt "$work/v300ck" --prompt-ids 1,300 --print-ids
refuse "resume the vocab-300 checkpoint as a byte model" "vocab_size is 300.*--vocab" \
  $MPIEXEC -n 1 $g train --data "$work/v300.tok" "${small[@]}" --vocab 256 --steps 6 --resume "$work/v300ck"

echo "== bad token files: a clear error on every rank, never a crash or a hang"
tokfile "$text" "$work/big.tok" 2 0 '$_ == 101 ? 999 : $_'    # every 'e' becomes id 999
refuse "an id beyond the model's vocabulary in the data (2 CP ranks)" "token id 999 at byte offset [0-9]+ \(id [0-9]+ of the file\)" \
  $MPIEXEC -n 2 $g train --data "$work/big.tok" "${small[@]}" --cp 2
head -c 5001 "$work/t16.tok" > "$work/trunc.tok"
refuse "a truncated token file" "header says [0-9]+ ids of 2 bytes" $MPIEXEC -n 2 $g train --data "$work/trunc.tok" "${small[@]}"
cp "$work/t16.tok" "$work/ver.tok"; printf '\x07' | dd of="$work/ver.tok" bs=1 seek=4 conv=notrunc 2>/dev/null
refuse "a token file of version 7" "token file version 7" $MPIEXEC -n 1 $g train --data "$work/ver.tok" "${small[@]}"
cp "$work/t16.tok" "$work/width.tok"; printf '\x03' | dd of="$work/width.tok" bs=1 seek=16 conv=notrunc 2>/dev/null
refuse "a token file of 3-byte ids" "id width 3" $MPIEXEC -n 1 $g train --data "$work/width.tok" "${small[@]}"
cp "$work/t16.tok" "$work/magic.tok"; printf 'XX' | dd of="$work/magic.tok" bs=1 seek=0 conv=notrunc 2>/dev/null
refuse "a token file with a wrong magic" "not a token file either" $MPIEXEC -n 1 $g train --data "$work/magic.tok" "${small[@]}"

refuse "ranks launched with different --vocab (MPMD)" "disagree.*--vocab" \
  $MPIEXEC -n 1 $g train --data "$work/v300.tok" "${small[@]}" --vocab 300 : -n 1 $g train --data "$work/v300.tok" "${small[@]}" --vocab 301
refuse "ranks launched with different --pack-id (MPMD)" "disagree.*--pack-id" \
  $MPIEXEC -n 1 $g train --data "$work/t16.tok" "${small[@]}" --pack-id 37 : -n 1 $g train --data "$work/t16.tok" "${small[@]}" --pack-id 10

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
