#!/usr/bin/env python3
"""Cut one document out of a packed problem or result file (safetensors, standard library only),
so that scripts/test.sh can run it alone and compare it with the packed run's rows.

  st_slice.py IN OUT [--batch B] [--rows A:B] [--doc D] [--drop NAME,...] [--keep NAME,...]
              [--cu-seqlens 0,a,..]

--batch B keeps batch row B of every per-token tensor ([B, T, ...] -> [1, T, ...]); --rows A:B
keeps token rows [A, B) of every per-token tensor ([1, T, ...]: q k v g beta do and the outputs
o dq dk dv dg dbeta; the layer's x dy y dx); --doc D keeps row D of every per-document state
tensor (h0 ht dht dh0, [N_docs, Hv, K, V]) as [1, Hv, K, V]; --drop leaves tensors out, --keep all but the named ones;
--cu-seqlens writes the offsets as an I64 tensor "cu_seqlens". cu_seqlens is always dropped when
cutting rows (one document is a dense problem). Only F32 tensors are cut."""
import json, struct, sys

TOKEN = {"q", "k", "v", "g", "beta", "do", "o", "dq", "dk", "dv", "dg", "dbeta", "x", "dy", "y", "dx"}
STATE = {"h0", "ht", "dht", "dh0"}


def main(argv):
    src, dst, rows, doc, drop, batch, cu, keep = argv[0], argv[1], None, None, set(), None, None, None
    i = 2
    while i < len(argv):
        if argv[i] == "--rows": a, b = argv[i + 1].split(":"); rows = (int(a), int(b))
        elif argv[i] == "--doc": doc = int(argv[i + 1])
        elif argv[i] == "--drop": drop |= set(argv[i + 1].split(","))
        elif argv[i] == "--batch": batch = int(argv[i + 1])
        elif argv[i] == "--keep": keep = set(argv[i + 1].split(","))
        elif argv[i] == "--cu-seqlens": cu = [int(x) for x in argv[i + 1].split(",")]
        else: sys.exit(f"st_slice.py: unknown option {argv[i]!r}")
        i += 2
    if rows or cu: drop.add("cu_seqlens")
    with open(src, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    header.pop("__metadata__", None)
    out, blobs, off = {}, [], 0
    for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if name in drop or (keep is not None and name not in keep): continue
        shape, raw = list(t["shape"]), data[t["data_offsets"][0]:t["data_offsets"][1]]
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
        out[name] = {"dtype": t["dtype"], "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    if cu is not None:
        raw = struct.pack(f"<{len(cu)}q", *cu)
        out["cu_seqlens"] = {"dtype": "I64", "shape": [len(cu)], "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    text = json.dumps(out).encode()
    text += b" " * (-len(text) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


if __name__ == "__main__":
    main(sys.argv[1:])
