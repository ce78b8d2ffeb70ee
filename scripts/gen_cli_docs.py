#!/usr/bin/env python3
"""docs/cli.md's command list and option sections, generated from the gdncp command's option tables.

The command list (the code block that starts "usage: gdncp <command>") is `gdncp help`; each
command's section lies between the marker lines

    <!-- BEGIN gdncp help --markdown: NAME ... -->   ...   <!-- END gdncp help --markdown: NAME -->

and is what `gdncp help --markdown NAME` prints from that command's table (tools/cmd_*.c), the
same table its parser reads and its --help prints.

Usage: scripts/gen_cli_docs.py GDNCP [DOCS] --write    rewrite DOCS (default docs/cli.md)
       scripts/gen_cli_docs.py GDNCP [DOCS] --check    exit 1, naming what differs, when DOCS is
                                                       not what GDNCP generates
       scripts/gen_cli_docs.py GDNCP [DOCS] --control  --check, then its negative controls: copies
                                                       of DOCS with a generated line altered, a table
                                                       row dropped, a section dropped and the command
                                                       list altered must each fail the check (the
                                                       CTest docs.cli runs this)
Ends --control with "N passed, N failed". Stdlib only.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BLOCK = re.compile(r"^<!-- BEGIN gdncp help --markdown: (.+?) \(.*?-->\n.*?^<!-- END gdncp help --markdown: \1 -->\n",
                   re.M | re.S)
OVERVIEW = re.compile(r"^```\n(usage: gdncp <command>.*?)^```\n", re.M | re.S)


def generated(gdncp):
    md = subprocess.run([gdncp, "help", "--markdown"], check=True, capture_output=True, text=True).stdout
    overview = subprocess.run([gdncp, "help"], check=True, capture_output=True, text=True).stdout
    return [(m.group(1), m.group(0)) for m in BLOCK.finditer(md)], overview


def problems(docs_text, blocks, overview):
    """What differs between the docs and the generated text (empty: nothing)."""
    out = []
    m = OVERVIEW.search(docs_text)
    if not m:
        out.append("no command list (a code block starting 'usage: gdncp <command>')")
    elif m.group(1) != overview:
        out.append("the command list differs from `gdncp help`")
    have = [(m.group(1), m.group(0)) for m in BLOCK.finditer(docs_text)]
    names = [n for n, _ in blocks]
    for n, _ in have:
        if n not in names:
            out.append(f"a section of '{n}', which gdncp does not have")
    for n, text in blocks:
        found = [t for h, t in have if h == n]
        if not found:
            out.append(f"no section of '{n}'")
        elif found[0] != text:
            a, b = found[0].splitlines(), text.splitlines()
            i = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
            out.append(f"'{n}' differs from `gdncp help --markdown '{n}'` at its line {i + 1}: "
                       f"docs {a[i] if i < len(a) else '(end)'!r}, generated {b[i] if i < len(b) else '(end)'!r}")
    if not out and [n for n, _ in have] != names:
        out.append("the sections are not in gdncp's order: " + ", ".join(names))
    return out


def write(docs_text, blocks, overview):
    have = {m.group(1) for m in BLOCK.finditer(docs_text)}
    missing = [n for n, _ in blocks if n not in have]
    if missing:
        sys.exit("gen_cli_docs: docs have no section (marker lines) for " + ", ".join(missing) +
                 ": add '<!-- BEGIN gdncp help --markdown: NAME () -->' and its END line where it belongs")
    text = {n: t for n, t in blocks}
    docs_text = BLOCK.sub(lambda m: text.get(m.group(1), m.group(0)), docs_text)
    return OVERVIEW.sub(lambda m: "```\n" + overview + "```\n", docs_text, count=1)


def main(argv):
    flags = [a for a in argv if a.startswith("--")]
    args = [a for a in argv if not a.startswith("--")]
    if len(flags) != 1 or flags[0] not in ("--write", "--check", "--control") or not 1 <= len(args) <= 2:
        sys.exit(__doc__)
    gdncp, docs = args[0], args[1] if len(args) > 1 else os.path.join(ROOT, "docs/cli.md")
    blocks, overview = generated(gdncp)
    if not blocks:
        sys.exit(f"gen_cli_docs: {gdncp} help --markdown printed no section")
    with open(docs) as f:
        text = f.read()
    if flags[0] == "--write":
        new = write(text, blocks, overview)
        if new != text:
            with open(docs, "w") as f:
                f.write(new)
        print(f"{docs}: {'rewritten' if new != text else 'already current'}")
        return 0
    passed = failed = 0

    def case(ok, label):
        nonlocal passed, failed
        print(f"{'PASS' if ok else 'FAIL'}  {label}")
        passed, failed = passed + ok, failed + (not ok)

    found = problems(text, blocks, overview)
    for p in found:
        print(f"  {docs}: {p}")
    case(not found, f"{os.path.relpath(docs, ROOT)} is what gdncp's option tables give (gdncp help, "
                    f"gdncp help --markdown: {len(blocks)} sections)")
    if flags[0] == "--control":
        first = BLOCK.search(text)
        row = re.search(r"^\| `--.*\|\n", first.group(0), re.M) if first else None
        controls = []
        if row:  # a table row's default changed, and a row dropped
            s, e = first.start() + row.start(), first.start() + row.end()
            altered = text[s:e].replace(" | ", " | 12345 ", 1)
            controls.append(("a table row altered", text[:s] + altered + text[e:]))
            controls.append(("a table row dropped", text[:s] + text[e:]))
        last = list(BLOCK.finditer(text))[-1:]
        for m in last:
            controls.append((f"the section of '{m.group(1)}' dropped", text[:m.start()] + text[m.end():]))
        controls.append(("the command list with one line dropped",
                         OVERVIEW.sub(lambda m: "```\n" + "".join(m.group(1).splitlines(True)[1:]) + "```\n", text, 1)))
        for label, copy in controls:
            case(copy != text and bool(problems(copy, blocks, overview)), f"negative control: {label} fails the check")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
