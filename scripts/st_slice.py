#!/usr/bin/env python3
"""Cut one document out of a packed problem or result file (safetensors, standard library only),
so that scripts/test.sh can run it alone and compare it with the packed run's rows.

  st_slice.py IN OUT [--batch B] [--rows A:B] [--doc D] [--drop NAME,...] [--keep NAME,...]
              [--cu-seqlens 0,a,..] [--rename OLD=NEW,...] [--f32] [--squeeze]
              [--position-ids A:B,C:D[;...]]

--batch B keeps batch row B of every per-token tensor ([B, T, ...] -> [1, T, ...]); --rows A:B
keeps token rows [A, B) of every per-token tensor ([1, T, ...]: q k v g beta do and the outputs
o dq dk dv dg dbeta; the layer's x dy y dx); --doc D keeps row D of every per-document state
tensor (h0 ht dht dh0, [N_docs, Hv, K, V]) as [1, Hv, K, V]; --drop leaves tensors out, --keep all but the named ones;
--cu-seqlens writes the offsets as an I64 tensor "cu_seqlens". cu_seqlens is always dropped when
cutting rows (one document is a dense problem). Only F32 tensors are cut. --rename renames tensors
(all at once, so A=B,B=A swaps), before anything else; --f32 stores F64 tensors as F32 first (so
they can be cut); --squeeze drops the leading batch dimension of per-token tensors ([1, T, ...] ->
[T, ...]) last; --position-ids writes an I64 "position_ids" made of the ranges A..B-1, C..D-1, ...
([T]; rows separated by ';' give [rows, T])."""
import json, struct, sys

TOKEN = {"q", "k", "v", "g", "beta", "do", "o", "dq", "dk", "dv", "dg", "dbeta", "x", "dy", "y", "dx"}


def position_ids(spec):
    """'0:50,0:100' -> [0..49, 0..99]; rows separated by ';'."""
    rows = []
    for row in spec.split(";"):
        vals = []
        for r in row.split(","):
            a, b = r.split(":")
            vals += range(int(a), int(b))
        rows.append(vals)
    if len({len(r) for r in rows}) != 1: sys.exit("st_slice.py: --position-ids rows differ in length")
    shape = [len(rows[0])] if len(rows) == 1 else [len(rows), len(rows[0])]
    return shape, struct.pack(f"<{len(rows) * len(rows[0])}q", *[v for r in rows for v in r])
STATE = {"h0", "ht", "dht", "dh0"}


def main(argv):
    src, dst, rows, doc, drop, batch, cu, keep = argv[0], argv[1], None, None, set(), None, None, None
    rename, f32, squeeze, pos = {}, False, False, None
    i = 2
    while i < len(argv):
        if argv[i] == "--rows": a, b = argv[i + 1].split(":"); rows = (int(a), int(b))
        elif argv[i] == "--doc": doc = int(argv[i + 1])
        elif argv[i] == "--drop": drop |= set(argv[i + 1].split(","))
        elif argv[i] == "--batch": batch = int(argv[i + 1])
        elif argv[i] == "--keep": keep = set(argv[i + 1].split(","))
        elif argv[i] == "--cu-seqlens": cu = [int(x) for x in argv[i + 1].split(",")]
        elif argv[i] == "--rename": rename = dict(kv.split("=") for kv in argv[i + 1].split(","))
        elif argv[i] == "--position-ids": pos = position_ids(argv[i + 1])
        elif argv[i] in ("--f32", "--squeeze"):
            f32, squeeze = f32 or argv[i] == "--f32", squeeze or argv[i] == "--squeeze"
            i += 1
            continue
        else: sys.exit(f"st_slice.py: unknown option {argv[i]!r}")
        i += 2
    if rows or cu: drop.add("cu_seqlens")
    with open(src, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    header = {rename.get(k, k): v for k, v in header.items()}
    if pos is not None: header.pop("position_ids", None)
    out, blobs, off = {}, [], 0
    for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if name in drop or (keep is not None and name not in keep): continue
        shape, raw = list(t["shape"]), data[t["data_offsets"][0]:t["data_offsets"][1]]
        if f32 and t["dtype"] == "F64":
            n = len(raw) // 8
            raw, t = struct.pack(f"<{n}f", *struct.unpack(f"<{n}d", raw)), dict(t, dtype="F32")
        if batch is not None and name in TOKEN:  # [B, T, ...] -> [1, T, ...]
            if t["dtype"] != "F32": sys.exit(f"st_slice.py: {name} is {t['dtype']}; only F32 is cut")
            inner = 4
            for d in shape[1:]: inner *= d
            raw, shape[0] = raw[batch * inner:(batch + 1) * inner], 1
        if (rows and name in TOKEN) or (doc is not None and name in STATE):
            if t["dtype"] != "F32": sys.exit(f"st_slice.py: {name} is {t['dtype']}; only F32 is cut")
            inner = 4
            for d in shape[2 if name in TOKEN else 1:]: inner *= d
            if name in TOKEN:  # [1, T, ...] -> [1, B - A, ...]
                raw, shape[1] = raw[rows[0] * inner:rows[1] * inner], rows[1] - rows[0]
            else:  # [N, ...] -> [1, ...]
                raw, shape[0] = raw[doc * inner:(doc + 1) * inner], 1
        if squeeze and name in TOKEN and len(shape) >= 3:
            if shape[0] != 1: sys.exit(f"st_slice.py: --squeeze: {name} has {shape[0]} batch rows, not 1")
            shape = shape[1:]
        out[name] = {"dtype": t["dtype"], "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if cu is not None:
        raw = struct.pack(f"<{len(cu)}q", *cu)
        out["cu_seqlens"] = {"dtype": "I64", "shape": [len(cu)], "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if pos is not None:
        shape, raw = pos
        out["position_ids"] = {"dtype": "I64", "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    text = json.dumps(out).encode()
    text += b" " * (-len(text) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


if __name__ == "__main__":
    main(sys.argv[1:])
