#!/usr/bin/env bash
# Bad invocations a careless or hostile user tries (issue 42's probe), kept as a table: each line
# the exit status wanted, words the output must hold, and the command. Each refusal names the
# option, field, file or tensor at fault (the old messages named the wrong one: a missing weights
# file as "neither config.json nor model.safetensors", --score blamed on max_position, a vocab_size
# beside too few rows as "out of memory", ...); a few lines are controls that must run (exit 0).
# The multi-rank cases are in scripts/test_mpmd.sh. Usage: scripts/test_probe.sh BUILD_DIR.
# Ends with "N passed, N failed"; exits 1 on a failure.
. "$(dirname "$0")/test_common.sh"
tiny=$golden/qwen35_tiny
P=$logs/probe; mkdir -p "$P"
SL="python3 scripts/st_slice.py"

# checkpoints with one file wrong: config.json beside a missing, directory, FIFO or /dev/zero (a
# link to a character device) model.safetensors; config.json alone is the directory's only file
for kind in missing dir fifo zero; do
  mkdir -p "$P/m_$kind"; cp "$tiny/config.json" "$P/m_$kind/"
  case $kind in dir) mkdir "$P/m_$kind/model.safetensors" ;; fifo) mkfifo "$P/m_$kind/model.safetensors" ;;
                zero) ln -s /dev/zero "$P/m_$kind/model.safetensors" ;; esac
done
mkdir -p "$P/empty"
edited() { # edited DIR PYTHON: qwen35_tiny's weights (linked) beside its config.json edited by PYTHON (on c)
  mkdir -p "$1"; ln -sf "$(cd "$tiny" && pwd)/model.safetensors" "$1/model.safetensors"
  python3 -c "import json; c = json.load(open('$tiny/config.json')); $2; json.dump(c, open('$1/config.json', 'w'))"
}
edited "$P/vocab30" "c['vocab_size'] = 2**30"                              # 256 rows of weights
edited "$P/pos64" "c['max_position_embeddings'] = 64"
edited "$P/dense_moe" "c['num_experts'] = 4"                               # model_type qwen3_5_text
ids60=$(seq -s, 1 60)

# a trainer state to resume from, then copies with "step": -5 and without "seed"
bash scripts/fortunes_text.sh "$P/text.txt" >/dev/null 2>&1 || true
T="$L train --data $P/text.txt --seq 16 --batch 1 --eval-every 0 --threads 1"
$T --steps 2 --out "$P/run" >/dev/null 2>&1
ck=$(ls -d "$P"/run/checkpoint-* 2>/dev/null | tail -1)
for k in neg noseed; do cp -r "$P/run" "$P/$k"; done
python3 - "$P/neg/${ck##*/}/trainer_state.json" "$P/noseed/${ck##*/}/trainer_state.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); j["step"] = -5; json.dump(j, open(sys.argv[1], "w"))
j = json.load(open(sys.argv[2])); del j["seed"]; json.dump(j, open(sys.argv[2], "w"))
PY
# a token file whose header counts 2^63 ids (an unsigned field; printed negative before)
python3 -c "
import struct
open('$P/huge.tok', 'wb').write(struct.pack('<IIQII', 20261201, 1, 2**63, 2, 256) + bytes(1000) + bytes(200))"

# 16 tokens of layer 3's input as two documents by restarting position_ids (0..4, 0..10), a stream
# that restarts and then jumps, and the same rows with no position_ids
$SL "$tiny/attn.io.safetensors" "$P/r0.st" --f32 --batch 0 --keep x,dy
$SL "$P/r0.st" "$P/r16.st" --rows 0:16
$SL "$P/r16.st" "$P/pos5.st" --position-ids 0:5,0:11
$SL "$P/r16.st" "$P/jump.st" --position-ids 0:5,0:1,3:13
WA="--weights $tiny/model.safetensors --config $tiny/config.json --prefix model.layers.3.self_attn."
WL="--weights $tiny/model.safetensors --config $tiny/config.json --prefix model.layers.0.linear_attn."
S="$L sample --ckpt $tiny --threads 1"

while IFS='|' read -r want words cmd; do
  [ -z "$cmd" ] && continue
  if eval "timeout 120 $cmd" >"$P/log" 2>&1 </dev/null; then got=0; else got=$?; fi
  lbl=${cmd//"$L "/}; lbl=${lbl//"$P/"/}; lbl=${lbl//"$tiny/"/}; lbl=${lbl//"$ids60"/1,..,60}
  if [ "$got" = "$want" ] && grep -q -- "$words" "$P/log"; then
    echo "PASS  $lbl -> exit $got, \"$(grep -m1 -o -- "$words.*" "$P/log" | cut -c1-110)\""; passed=$((passed + 1))
  else echo "FAIL  $lbl: exit $got (wanted $want and '$words')"; cat "$P/log"; failed=$((failed + 1)); fi
done <<LIST
1|config.json is here but model.safetensors is missing|$L sample --ckpt $P/m_missing --prompt-ids 1,2
1|model.safetensors is a directory, not a regular file|$L sample --ckpt $P/m_dir --prompt-ids 1,2
1|model.safetensors is a FIFO, not a regular file|$L sample --ckpt $P/m_fifo --prompt-ids 1,2
1|model.safetensors is a character device, not a regular file|$L sample --ckpt $P/m_zero --prompt-ids 1,2
1|model.safetensors is a FIFO, not a regular file|$T --steps 3 --init $P/m_fifo
1|neither config.json nor model.safetensors here|$L sample --ckpt $P/empty --prompt-ids 1,2
0|score: loss [0-9.]* over 59 targets|$L sample --ckpt $P/pos64 --prompt-ids $ids60 --score
1|the prompt's 60 tokens + --tokens 200 = 260 positions are beyond the checkpoint's max_position_embeddings = 64|$L sample --ckpt $P/pos64 --prompt-ids $ids60
2|--score needs a prompt of at least 2 tokens|$S --prompt A --score
0|score: loss [0-9.]* over 1 targets|$S --prompt AB --score
0|1 prompt tokens .* + 3 new|$S --prompt A --top-k 0 --tokens 3
2|option --top-k needs an integer in \[0,|$S --prompt A --top-k -1
2|option --prompt-ids needs comma-separated whole numbers .* (an empty last entry)|$S --prompt-ids 1,2, --print-ids
2|option --prompt-ids needs comma-separated whole numbers|$S --prompt-ids 1,,2 --print-ids
2|--prompt-ids: id 256 (entry 1) is outside the checkpoint's vocabulary|$S --prompt-ids 1,256 --print-ids
1|document 1 starts at token 5 by position_ids, at 6 by cu_seqlens|$L attention $WA --in $P/pos5.st --out $P/x.st --cu-seqlens 0,6,16
1|position_ids hold 2 document(s), cu_seqlens 1|$L attention $WA --in $P/pos5.st --out $P/x.st --cu-seqlens 0,16
1|document 1 starts at token 5 by position_ids, at 6 by cu_seqlens|$L layer $WL --in $P/pos5.st --out $P/x.st --cu-seqlens 0,6,16
0|documents=2|$L layer $WL --in $P/pos5.st --out $P/lpos.st --backward && $L layer $WL --in $P/r16.st --out $P/lcu.st --backward --cu-seqlens 0,5,16 && $L diff $P/lpos.st $P/lcu.st --tol 0
1|over tolerance|$L layer $WL --in $P/r16.st --out $P/ldense.st --backward && $L diff $P/lpos.st $P/ldense.st --tol 1e-6
1|neither the next position nor a document start|$L layer $WL --in $P/jump.st --out $P/x.st
1|does not combine with packed documents (--cu-seqlens, a cu_seqlens tensor or restarting position_ids|$L layer $WL --in $P/pos5.st --out $P/x.st --decode 2
1|tensor 'model.embed_tokens.weight' has shape \[256, 96\], but .*vocab_size 1073741824 and hidden_size 96 need|$L sample --ckpt $P/vocab30 --prompt-ids 1,2
1|tensor 'model.embed_tokens.weight' has shape \[256, 96\]|$T --steps 3 --init $P/vocab30
1|invalid or inconsistent shape: .*'num_experts' = 4 but 'model_type' names a dense Qwen3.5 model|$L sample --ckpt $P/dense_moe --prompt-ids 1,2
1|trainer_state.json has 'step' = -5|$T --steps 3 --resume $P/neg
1|trainer_state.json lacks 'seed'|$T --steps 3 --resume $P/noseed
0|step     3/3|$T --steps 3 --resume $P/run
1|token file header says 9223372036854775808 ids of 2 bytes|$T --steps 3 --data $P/huge.tok
0|step     3/3|$T --steps 3 --init $tiny --vocab 256
0|step     3/3|$T --steps 3 --init $tiny --layers 4
1|its num_hidden_layers is 4, but --layers says 3|$T --steps 3 --init $tiny --layers 3
2|--model needs at most 8 named models separated by single commas, got 'tiny,,small'|$L bench train --model tiny,,small
2|--model needs at most 8 named models separated by single commas, got 'tiny,'|$L bench train --model tiny,
2|--model bogus: no such named model|$L bench train --model bogus
2|option --M needs an integer in \[1, 1048576\], got 'x'|$L bench matmul --M x
2|option --reps needs an integer|$L bench matmul --reps 0
LIST
finish
