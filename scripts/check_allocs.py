#!/usr/bin/env python3
"""Every allocation of the library goes through base.h's gdn_malloc family (src/base/memory.c), so
that a test can fail any one of them (gdn_test_fault; tests/model/test_alloc_failures.c sweeps
them). This finds a call of the C library's allocators (malloc, calloc, realloc, aligned_alloc,
posix_memalign, strdup, strndup, asprintf, vasprintf, open_memstream, getline, getdelim, and
realpath with a NULL buffer, which allocates) in any C file under src/ but memory.c, outside
comments and strings. Prints one line per check and "N passed, N failed"; exits 1 on a failure.
The control runs the same scan on a copy of a source file with one raw malloc planted (in code;
and one in a comment and one in a string, which must not count) and expects exactly it.
"""
import os, re, sys, tempfile

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
ALLOWED = os.path.join("src", "base", "memory.c")
RAW = re.compile(r"(?<![\w.>])(malloc|calloc|realloc|aligned_alloc|posix_memalign|strdup|strndup|"
                 r"v?asprintf|open_memstream|getline|getdelim)\s*\(|(?<![\w.>])realpath\s*\([^,()]*,\s*NULL\s*\)")


def code_only(text):
    """The text with comments and string / character literals blanked (newlines kept, so that
    line numbers still match)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j])); i = j
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i)); i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + " " * (j - i - 1) + c); i = j + 1
        else:
            out.append(c); i += 1
    return "".join(out)


def raw_allocations(path, label):
    with open(path, encoding="utf-8") as f:
        code = code_only(f.read())
    return [f"{label}:{code.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in RAW.finditer(code)]


def scan(root):
    found, files = [], 0
    for d, _, names in os.walk(os.path.join(root, "src")):
        for name in sorted(names):
            if not name.endswith((".c", ".h")):
                continue
            rel = os.path.relpath(os.path.join(d, name), root)
            if rel == ALLOWED:
                continue
            files += 1
            found += raw_allocations(os.path.join(root, rel), rel)
    return found, files


def main():
    passed = failed = 0

    def report(ok, label, detail=()):
        nonlocal passed, failed
        print(("PASS  " if ok else "FAIL  ") + label)
        for line in detail:
            print("      " + line)
        passed += ok
        failed += not ok

    found, files = scan(ROOT)
    report(not found and files > 50, f"no raw allocation in the {files} C files of src/ but {ALLOWED}", found)
    # The allowed file does hold the real calls (the scan would see them there).
    report(len(raw_allocations(os.path.join(ROOT, ALLOWED), ALLOWED)) >= 4, f"{ALLOWED} holds the wrapped calls")
    # The control: a copy of a source file with a planted raw malloc in code (caught) and the
    # same words in a comment and a string (not counted).
    with open(os.path.join(ROOT, "src", "kernel", "plan.c"), encoding="utf-8") as f:
        text = f.read()
    planted = text + ('\n/* a comment may say malloc(n) */\nstatic const char *planted_text = "calloc(1, 2)";\n'
                      "static void *planted(void) { return malloc(16); }\n")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "plan.c")
        with open(path, "w", encoding="utf-8") as f:
            f.write(planted)
        got = raw_allocations(path, "plan.c")
    want_line = planted.count("\n", 0, planted.index("return malloc(16)")) + 1
    report(len(got) == 1 and got[0].startswith(f"plan.c:{want_line}:"),
           "control: a raw malloc planted in a copy of src/kernel/plan.c is caught, the comment and string are not", got)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
