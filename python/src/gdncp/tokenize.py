"""Text to a gdncp token file with a Hugging Face tokenizer (the `tokenizers` package).

    python -m gdncp.tokenize --tokenizer DIR --in TEXT [--in TEXT2 ...] --out FILE
                             [--eot ID] [--split SEP]

DIR holds tokenizer.json (a tokenizer.json file itself is taken too). Every --in file is one
document, or several when --split SEP is given (SEP with the escapes \\n \\t \\r \\\\ \\xHH, e.g.
'\\n%\\n' for fortunes; a separator is dropped). After each document comes the end-of-text id:
--eot, or the tokenizer's eos token (tokenizer_config.json's "eos_token", else one of
<|endoftext|>, </s>, <|im_end|>, <eos> in its vocabulary); without either it is an error. Train on
the file with `gdncp train --data FILE --vocab N --pack-id EOT` (N: the vocabulary printed here).

The format (docs/training.md "Token files"; include/gdncp/data.h): a 1024-byte header of 256
little-endian uint32 words, then the ids, little-endian, uint16 when the vocabulary has at most
65,536 ids, else uint32:

    word 0  magic 20261201       word 1  version 1
    word 2  id count, low bits   word 3  id count, high bits
    word 4  bytes per id (2, 4)  word 5  vocabulary size
    words 6..255  0

The file is written to a temporary name beside FILE, flushed and fsync'ed, then renamed into place:
an interrupted run leaves no partial FILE. Only the `tokenizers` package is needed (not torch).
"""
import argparse
import array
import json
import os
import struct
import sys

# the token file header's constants: include/gdncp/train.h's, from the generated gdncp/_abi.py
from ._abi import GDN_TOKENS_HEADER_BYTES as HEADER_BYTES
from ._abi import GDN_TOKENS_MAGIC as MAGIC
from ._abi import GDN_TOKENS_VERSION as VERSION

EOS_NAMES = ("<|endoftext|>", "</s>", "<|im_end|>", "<eos>")


def width_for(vocab):
    """Bytes per id: 2 (uint16) for a vocabulary of at most 65,536 ids, else 4 (uint32)."""
    return 2 if vocab <= 65536 else 4


def header(count, width, vocab):
    """The 1024-byte header of a token file."""
    words = [MAGIC, VERSION, count & 0xFFFFFFFF, count >> 32, width, vocab]
    return struct.pack("<6I", *words) + bytes(HEADER_BYTES - 24)


def read_tokens(path):
    """(header fields as a dict, the ids as a list): the reader the tests use. Raises ValueError
    on a malformed file (the C reader, gdn_data_open, is the one that training uses)."""
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            raise ValueError(f"{path}: shorter than the {HEADER_BYTES}-byte header")
        magic, version, lo, hi, width, vocab = struct.unpack("<6I", head[:24])
        if magic != MAGIC or version != VERSION or width not in (2, 4):
            raise ValueError(f"{path}: magic {magic}, version {version}, width {width}")
        count = lo | hi << 32
        ids = array.array("H" if width == 2 else "I")
        if ids.itemsize != width:
            raise ValueError("this Python's array type codes have other sizes")
        data = f.read()
        if len(data) != count * width:
            raise ValueError(f"{path}: header says {count} ids, the file has {len(data)} bytes after it")
        ids.frombytes(data)
        if sys.byteorder != "little":
            ids.byteswap()
    return {"magic": magic, "version": version, "count": count, "width": width, "vocab": vocab}, list(ids)


def _unescape(sep):
    out, i = bytearray(), 0
    b = sep.encode("utf-8")
    simple = {ord("n"): 10, ord("t"): 9, ord("r"): 13, ord("\\"): 92}
    while i < len(b):
        if b[i] == 92 and i + 1 < len(b) and b[i + 1] in simple:
            out.append(simple[b[i + 1]])
            i += 2
        elif b[i] == 92 and i + 3 < len(b) and b[i + 1] == ord("x"):
            out.append(int(b[i + 2:i + 4].decode(), 16))
            i += 4
        elif b[i] == 92:
            raise ValueError(f"--split {sep!r}: unknown escape (\\n \\t \\r \\\\ or \\xHH)")
        else:
            out.append(b[i])
            i += 1
    if not out:
        raise ValueError("--split needs a non-empty separator")
    return out.decode("utf-8", errors="strict")


def load_tokenizer(path):
    """A tokenizers.Tokenizer from DIR/tokenizer.json (or the file itself) and the directory."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise SystemExit("gdncp.tokenize needs the `tokenizers` package: pip install tokenizers") from e
    file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise SystemExit(f"gdncp.tokenize: {file} does not exist (--tokenizer DIR must hold tokenizer.json)")
    return Tokenizer.from_file(file), os.path.dirname(os.path.abspath(file))


def find_eos(tok, directory):
    """The tokenizer's end-of-text id, or None: tokenizer_config.json's eos_token, else a
    well-known name in its vocabulary."""
    cfg = os.path.join(directory, "tokenizer_config.json")
    names = []
    if os.path.isfile(cfg):
        with open(cfg, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
    for name in names + list(EOS_NAMES):
        i = tok.token_to_id(name)
        if i is not None:
            return i
    return None


def documents(paths, split):
    """The documents: each file whole, or split at `split` (empty pieces dropped)."""
    for p in paths:
        with open(p, encoding="utf-8") as f:
            text = f.read()
        pieces = text.split(split) if split else [text]
        for d in pieces:
            if d:
                yield d


def tokenize(tokenizer, inputs, out, eot=None, split=None, batch=256, log=sys.stderr):
    """Write the token file `out`; returns (documents, ids, width, vocab, eot)."""
    tok, directory = load_tokenizer(tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if eot is None:
        eot = find_eos(tok, directory)
        if eot is None:
            raise SystemExit("gdncp.tokenize: the tokenizer names no end-of-text token (tokenizer_config.json's "
                             "eos_token, or one of " + ", ".join(EOS_NAMES) + "): give --eot ID")
    if not 0 <= eot < vocab:
        raise SystemExit(f"gdncp.tokenize: --eot {eot} is outside the vocabulary [0, {vocab})")
    width = width_for(vocab)
    code = "H" if width == 2 else "I"
    sep = _unescape(split) if split else None
    out_dir = os.path.dirname(os.path.abspath(out))
    tmp = os.path.join(out_dir, f".{os.path.basename(out)}.tmp-{os.getpid()}")
    count = n_docs = 0
    try:
        with open(tmp, "wb") as f:
            f.write(header(0, width, vocab))  # the count is written at the end
            pending = []

            def flush():
                nonlocal count
                ids = array.array(code)
                for enc in tok.encode_batch(pending, add_special_tokens=False):
                    ids.extend(enc.ids)
                    ids.append(eot)
                if ids and max(ids) >= vocab:
                    raise SystemExit(f"gdncp.tokenize: the tokenizer produced id {max(ids)} >= its vocabulary {vocab}")
                if sys.byteorder != "little":
                    ids.byteswap()
                f.write(ids.tobytes())
                count += len(ids)
                pending.clear()

            for d in documents(inputs, sep):
                pending.append(d)
                n_docs += 1
                if len(pending) >= batch:
                    flush()
            if pending:
                flush()
            if count == 0:
                raise SystemExit("gdncp.tokenize: the input holds no text")
            f.seek(0)
            f.write(header(count, width, vocab))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        dfd = os.open(out_dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if log:
        print(f"gdncp.tokenize: {out}: {n_docs} documents, {count} ids (uint{8 * width}), vocabulary {vocab}, "
              f"end-of-text id {eot}; train with --vocab {vocab} --pack-id {eot}", file=log)
    return n_docs, count, width, vocab, eot


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gdncp.tokenize",
                                 description="Tokenize text into a gdncp token file (docs/training.md).")
    ap.add_argument("--tokenizer", required=True, help="a directory holding tokenizer.json (or the file)")
    ap.add_argument("--in", dest="inputs", action="append", required=True, help="a UTF-8 text file (repeatable)")
    ap.add_argument("--out", required=True, help="the token file to write")
    ap.add_argument("--eot", type=int, default=None, help="the end-of-text id after every document "
                    "(default: the tokenizer's eos token)")
    ap.add_argument("--split", default=None, help="the text separating documents inside a file (escapes "
                    "\\n \\t \\r \\\\ \\xHH; default: one document per file)")
    a = ap.parse_args(argv)
    try:
        tokenize(a.tokenizer, a.inputs, a.out, a.eot, a.split)
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise SystemExit(f"gdncp.tokenize: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
