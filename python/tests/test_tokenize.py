"""python -m gdncp.tokenize: a tiny tokenizer trained here with `tokenizers` (WordLevel, and a
BPE one past 65,536 ids for uint32), text tokenized into a token file, the file read back (header
and ids) both by the module's reader and by the C library's (gdn_data_open / gdn_data_read, the
trainer's reader), which refuses a wrong header (the negative control) and an id beyond the
model's vocabulary."""
import ctypes
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from gdncp import _lib  # noqa: E402
from gdncp import tokenize as gtok  # noqa: E402

LINES = ["the cat sat on the mat", "a dog ate the cat food", "the mat was red and the dog was brown",
         "on monday the cat slept"]


def word_level(tmp_path, with_config=True):
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<eot>"]))
    d = tmp_path / "tok"
    d.mkdir(exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    if with_config:
        (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eot>"}}))
    return tok, d


def c_reader():
    lib = _lib.lib
    lib.gdn_data_open.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_double, ctypes.c_int64]
    lib.gdn_data_read.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.POINTER(ctypes.c_int32)]
    lib.gdn_data_split_len.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.gdn_data_split_len.restype = ctypes.c_int64
    lib.gdn_data_close.argtypes = [ctypes.c_void_p]
    return lib


def c_read_all(path, vocab, val_fraction=0.25):
    """(status, message, every id of both splits) through the C reader."""
    lib = c_reader()
    d = ctypes.c_void_p()
    rc = lib.gdn_data_open(ctypes.byref(d), str(path).encode(), val_fraction, vocab)
    if rc:
        return rc, (_lib.gdn_errmsg() or b"").decode(), None
    try:
        ids = []
        for split in (0, 1):
            n = lib.gdn_data_split_len(d, split)
            buf = np.zeros(n, np.int32)
            rc = lib.gdn_data_read(d, split, 0, n, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))
            if rc:
                return rc, (_lib.gdn_errmsg() or b"").decode(), None
            ids += buf.tolist()
        return 0, "", ids
    finally:
        lib.gdn_data_close(d)


def test_round_trip_uint16(tmp_path):
    tok, d = word_level(tmp_path)
    text = tmp_path / "in.txt"
    text.write_text("\n%\n".join(LINES))
    out = tmp_path / "out.tok"
    n_docs, count, width, vocab, eot = gtok.tokenize(str(d), [str(text)], str(out), split="\\n%\\n", log=None)
    assert (n_docs, width, vocab, eot) == (4, 2, tok.get_vocab_size(), tok.token_to_id("<eot>"))
    want = []
    for line in LINES:
        want += tok.encode(line, add_special_tokens=False).ids + [eot]
    head, ids = gtok.read_tokens(str(out))
    assert head == {"magic": 20261201, "version": 1, "count": len(want), "width": 2, "vocab": vocab}
    assert ids == want and count == len(want)
    raw = out.read_bytes()
    assert len(raw) == 1024 + 2 * len(want) and raw[24:1024] == bytes(1000)
    # the trainer's reader (C) gives the same ids
    rc, msg, c_ids = c_read_all(out, vocab)
    assert rc == 0, msg
    assert c_ids == want
    # negative control: the same ids under a wrong header (version 2) are refused, naming it
    bad = tmp_path / "bad.tok"
    bad.write_bytes(raw[:4] + struct.pack("<I", 2) + raw[8:])
    rc, msg, _ = c_read_all(bad, vocab)
    assert rc != 0 and "token file version 2" in msg, msg
    # ... and a model vocabulary smaller than the file's
    rc, msg, _ = c_read_all(out, vocab - 1)
    assert rc != 0 and f"vocabulary has {vocab} ids" in msg, msg
    # the ids one position later are not what was read (the comparison can fail)
    assert c_ids != want[1:] + want[:1]
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # the temporary file is gone


def test_cli_and_eot(tmp_path):
    tok, d = word_level(tmp_path, with_config=False)
    text = tmp_path / "in.txt"
    text.write_text(LINES[0])
    out = tmp_path / "cli.tok"
    env = dict(os.environ)
    r = subprocess.run([sys.executable, "-m", "gdncp.tokenize", "--tokenizer", str(d), "--in", str(text),
                        "--out", str(out)], capture_output=True, text=True, env=env)
    # no tokenizer_config.json and no well-known eos name: --eot is required
    assert r.returncode != 0 and "--eot" in r.stderr, r.stderr
    assert not out.exists()
    r = subprocess.run([sys.executable, "-m", "gdncp.tokenize", "--tokenizer", str(d), "--in", str(text),
                        "--out", str(out), "--eot", "1"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    head, ids = gtok.read_tokens(str(out))
    assert ids == tok.encode(LINES[0], add_special_tokens=False).ids + [1]
    r = subprocess.run([sys.executable, "-m", "gdncp.tokenize", "--tokenizer", str(d), "--in", str(text),
                        "--out", str(out), "--eot", str(tok.get_vocab_size())], capture_output=True, text=True)
    assert r.returncode != 0 and "outside the vocabulary" in r.stderr


def test_uint32_past_65536(tmp_path):
    # a WordLevel vocabulary of 70,000 words: ids past uint16
    words = [f"w{i}" for i in range(70000)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<|endoftext|>"] + words)},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    d = tmp_path / "big"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    text = tmp_path / "in.txt"
    text.write_text("w0 w69999 w65535 w65536 w3")
    out = tmp_path / "big.tok"
    _, count, width, vocab, eot = gtok.tokenize(str(d), [str(text)], str(out), log=None)
    assert (width, vocab, eot) == (4, 70002, 1)  # eos found by its well-known name
    want = [2, 70001, 65537, 65538, 5, 1]
    assert gtok.read_tokens(str(out))[1] == want
    rc, msg, c_ids = c_read_all(out, vocab, 0.5)
    assert rc == 0 and c_ids == want, msg
    # an id beyond the model's vocabulary is refused with the file, offset and id (header
    # vocabulary 0: not given, so only the ids are checked)
    raw = bytearray(out.read_bytes())
    raw[20:24] = bytes(4)
    unk = tmp_path / "novocab.tok"
    unk.write_bytes(bytes(raw))
    rc, msg, _ = c_read_all(unk, 70001, 0.5)
    assert rc != 0 and "token id 70001 at byte offset 1028" in msg, msg


def test_gdncp_trains_on_the_tokenized_file(tmp_path):
    """End to end: gdncp.tokenize's file trains with `gdncp train --vocab N --pack-id EOT` (the
    first step's loss, before any update, near ln(vocab) from a 0.02-scale initialisation);
    control: the same file for a model of a smaller vocabulary is refused, naming both sizes."""
    cli = os.environ.get("GDNCP_CLI")
    if not cli or not os.access(cli, os.X_OK):
        pytest.fail("GDNCP_CLI must name the built gdncp command (scripts/test_python.sh sets it)")
    mpiexec = os.environ.get("GDN_MPIEXEC", "mpiexec.mpich")
    tok, d = word_level(tmp_path)
    text = tmp_path / "in.txt"
    text.write_text("\n%\n".join(LINES * 200))
    out = tmp_path / "train.tok"
    _, count, _, vocab, eot = gtok.tokenize(str(d), [str(text)], str(out), split="\\n%\\n", log=None)
    log = tmp_path / "log.csv"
    base = [mpiexec, "-n", "1", cli, "train", "--data", str(out), "--hidden", "32", "--layers", "2",
            "--intermediate", "64", "--key-heads", "1", "--value-heads", "2", "--key-dim", "16",
            "--value-dim", "16", "--seq", "32", "--batch", "2", "--steps", "2", "--eval-every", "0",
            "--threads", "1", "--pack-id", str(eot)]
    r = subprocess.run(base + ["--vocab", str(vocab), "--log", str(log)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"token file of uint16 ids, header vocabulary {vocab}" in r.stdout + r.stderr
    loss1 = float(log.read_text().splitlines()[1].split(",")[1])
    assert abs(loss1 - np.log(vocab)) < 0.1 * np.log(vocab), (loss1, np.log(vocab))
    r = subprocess.run(base + ["--vocab", str(vocab - 1)], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and f"vocabulary has {vocab} ids (its header), the model's {vocab - 1}" in r.stderr, \
        r.stderr
