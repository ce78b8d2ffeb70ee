"""python -m gdncp.bench: runs the benchmarks of a repository checkout.

The benchmarks are not part of the package (nor of its wheel): they live in the repository's
python/benchmarks/ (bench.py, bench_cp_train.py; `python python/benchmarks/bench.py --help`).
This shim runs that bench.py with the same arguments when the package is imported from the
checkout's python/src (PYTHONPATH=python/src), and says where to find it otherwise."""
import os
import runpy
import sys

BENCHMARKS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                           "benchmarks"))


def main():
    path = os.path.join(BENCHMARKS, "bench.py")
    if not os.path.isfile(path):
        raise SystemExit("gdncp.bench: the benchmarks are not installed with the package; run "
                         "`python python/benchmarks/bench.py` in a gdncp repository checkout")
    sys.path.insert(0, BENCHMARKS)
    sys.argv[0] = path
    runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
