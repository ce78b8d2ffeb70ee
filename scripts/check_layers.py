#!/usr/bin/env python3
"""The layers of the tree import only downward, and no file includes itself round a cycle.

Layers, lowest first: base, blas, kernel, layer, io, model (libgdncp, no MPI), then cp, train (the
MPI wing, libgdncp_mpi) (src/<layer>/), then tools/ and the tests. A quoted #include is resolved the way the compiler does (the including file's folder, then
the public include/ folder, then the folders of the layers the file may use) and must land in the
file's own layer, a layer below it, or include/; a file under src/ never includes a file of tools/
or tests/. The file-level include graph must have no cycle. Prints one line per check and
"N passed, N failed"; exits 1 on a failure. --control runs the same checks on a copy of the
tree with one deliberately upward include added (kernel -> cp), a cycle, and <mpi.h> in a model
header, and expects them to fail. Only the MPI wing (cp, train, include/gdncp/cp.h, ep.h and train.h) may
reach <mpi.h>.
"""
import os, re, sys, shutil, tempfile

LAYERS = ["base", "blas", "kernel", "layer", "io", "model", "cp", "train"]
WING = ["cp", "train"]  # libgdncp_mpi: the only layers (and public headers) that may see <mpi.h>
WING_HEADERS = [os.path.join("include", "gdncp", h) for h in ("cp.h", "ep.h", "train.h")]
MPI_INC = re.compile(r'^\s*#\s*include\s+<mpi\.h>', re.M)
INC = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(root, path):
    rel = os.path.relpath(path, root).split(os.sep)
    if rel[0] == "src" and len(rel) > 2 and rel[1] in LAYERS:
        return LAYERS.index(rel[1])
    if rel[0] == "include":
        return -1  # the public headers: usable by everyone
    return len(LAYERS)  # tools/, tests/: above every layer


# Headers the build generates into its own directory (not in the tree): their generator.
GENERATED = {"gdn_test_sites.h": "scripts/gen_test_sites.cmake"}


def resolve(root, src, name):
    here = os.path.dirname(src)
    cands = [os.path.join(here, name), os.path.join(root, "include", name)]
    cands += [os.path.join(root, "src", l, name) for l in LAYERS]
    cands += [os.path.join(root, "tools", name), os.path.join(root, "tests", name)]
    for c in cands:
        if os.path.isfile(c):
            return os.path.normpath(c)
    return None


def check(root):
    files = []
    for top in ("src", "include", "tools", "tests"):
        for d, _, fs in os.walk(os.path.join(root, top)):
            files += [os.path.join(d, f) for f in fs if f.endswith((".c", ".h"))]
    bad_layer, unresolved, graph, mpi_direct = [], [], {}, set()
    for f in files:
        text = open(f, errors="replace").read()
        graph[f] = []
        if MPI_INC.search(text):
            mpi_direct.add(f)
        for name in INC.findall(text):
            if name in GENERATED:
                continue
            tgt = resolve(root, f, name)
            if tgt is None:
                unresolved.append(f"{os.path.relpath(f, root)}: \"{name}\"")
                continue
            graph[f].append(tgt)
            lf, lt = layer_of(root, f), layer_of(root, tgt)
            if lt > lf and lf != -1:
                bad_layer.append(f"{os.path.relpath(f, root)} includes {os.path.relpath(tgt, root)}")
            if lf == -1 and lt != -1:
                bad_layer.append(f"public {os.path.relpath(f, root)} includes internal {os.path.relpath(tgt, root)}")
            top_f, top_t = os.path.relpath(f, root).split(os.sep)[0], os.path.relpath(tgt, root).split(os.sep)[0]
            if top_f == "tools" and top_t not in ("tools", "include"):  # the CLI uses the public API only
                bad_layer.append(f"{os.path.relpath(f, root)} (the CLI) includes the internal {os.path.relpath(tgt, root)}")
    # cycles (iterative DFS, colours)
    colour, cycle = {f: 0 for f in graph}, []
    for start in graph:
        if colour[start]:
            continue
        stack = [(start, iter(graph[start]))]
        colour[start] = 1
        path = [start]
        while stack and not cycle:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop(), path.pop()
            elif colour.get(nxt, 2) == 1:
                cycle = path[path.index(nxt):] + [nxt]
            elif colour.get(nxt, 2) == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(graph[nxt])))
                path.append(nxt)
        if cycle:
            break
    # libgdncp links no MPI: no file of its layers and no public header outside the wing's reaches
    # <mpi.h>, directly or through the headers it includes.
    def reaches_mpi(f, seen):
        if f in mpi_direct:
            return True
        seen.add(f)
        return any(t not in seen and reaches_mpi(t, seen) for t in graph.get(f, []))
    mpi_leaks = []
    for f in files:
        rel = os.path.relpath(f, root)
        parts = rel.split(os.sep)
        core = (parts[0] == "src" and len(parts) > 2 and parts[1] in LAYERS and parts[1] not in WING) or \
               (parts[0] == "include" and rel not in WING_HEADERS)
        if core and reaches_mpi(f, set()):
            mpi_leaks.append(f"{rel} reaches <mpi.h>")
    return bad_layer, unresolved, [os.path.relpath(c, root) for c in cycle], len(files), mpi_leaks


def report(root):
    bad, unres, cyc, n, leaks = check(root)
    passed = failed = 0
    for label, problems in (("every include goes to the file's own layer, a lower one or include/; tools/ only to "
                             "include/", bad),
                            ("every quoted include resolves to a file of the tree", unres),
                            ("no include cycle between files", [" -> ".join(cyc)] if cyc else []),
                            ("libgdncp's layers and public headers (all but cp.h, ep.h, train.h) never reach <mpi.h>", leaks)):
        if not problems:
            passed += 1
            print(f"PASS  {label} ({n} files)")
        else:
            failed += 1
            print(f"FAIL  {label}: " + "; ".join(problems[:8]))
    return passed, failed


def main():
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    p, f = report(root)
    # The control: the same checks on a copy with one upward include and one cycle added.
    tmp = tempfile.mkdtemp()
    try:
        for top in ("src", "include", "tools", "tests"):
            shutil.copytree(os.path.join(root, top), os.path.join(tmp, top),
                            ignore=shutil.ignore_patterns("data", "corpus"))
        low = sorted(x for x in os.listdir(os.path.join(tmp, "src", "kernel")) if x.endswith(".c"))[0]
        with open(os.path.join(tmp, "src", "kernel", low), "a") as fh:
            fh.write('\n#include "cp_internal.h"\n')
        with open(os.path.join(tmp, "tools", "main.c"), "a") as fh:  # the CLI reaching into the library
            fh.write('\n#include "kernel_internal.h"\n')
        hdr = os.path.join(tmp, "src", "base", "base.h")
        with open(hdr, "a") as fh:  # base.h -> itself through a new header: a cycle
            fh.write('\n#include "cycle_probe.h"\n')
        with open(os.path.join(tmp, "src", "base", "cycle_probe.h"), "w") as fh:
            fh.write('#include "base.h"\n')
        mdl = sorted(x for x in os.listdir(os.path.join(tmp, "src", "model")) if x.endswith(".h"))[0]
        with open(os.path.join(tmp, "src", "model", mdl), "a") as fh:  # MPI leaking into libgdncp
            fh.write('\n#include <mpi.h>\n')
        bad, unres, cyc, _, leaks = check(tmp)
        for label, problems in (("control: a kernel file including cp_internal.h is caught",
                                 [x for x in bad if "cp_internal.h" in x]),
                                ("control: tools/main.c including kernel_internal.h is caught",
                                 [x for x in bad if "the CLI" in x]),
                                ("control: base.h -> cycle_probe.h -> base.h is caught", cyc),
                                ("control: <mpi.h> in a header of src/model is caught (and in the files "
                                 "including it)", leaks)):
            if problems:
                p += 1
                print(f"PASS  {label}")
            else:
                f += 1
                print(f"FAIL  {label}: not caught")
    finally:
        shutil.rmtree(tmp)
    print(f"{p} passed, {f} failed")
    return 1 if f else 0


if __name__ == "__main__":
    sys.exit(main())
