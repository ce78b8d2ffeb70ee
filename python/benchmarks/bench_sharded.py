"""gdncp.Model.adamw(group=, zero=0|1|2) (gdncp.sharded) against the plain AdamW step on the same
per-rank batch, under mpiexec: what summing the gradient over the group and sharding the state
cost a step.

    mpiexec.mpich -n 2 python python/benchmarks/bench_sharded.py CHECKPOINT [--T 256] [--rounds 3]

CHECKPOINT: any gdncp.Model checkpoint (e.g. `gdncp train --model qwen3.5-0.8b --layers 4 --steps 1
--out DIR`). Every rank steps on the same random ids (so the plain steps keep the ranks' weights
equal, which the sharded optimizers check when they are made), one optimizer at a time (each holds
its gradient and moments), one untimed step each first; the sides alternate round by round (and
their order flips); a step's time is the slowest rank's; medians. Printed: the CPU, the shape,
each side's ms, its ratio to the plain step, the bytes a rank moves a step (levels 0 and 1: the
gradient's sum and its broadcast, plus level 1's weight broadcast; level 2: the sum and the
weights), and whether levels 1 and 2 left the same weights as level 0 after a step from the same
weights (their arithmetic is the same: they must). The step's own FLOP rate and fraction of the
peak are `python/benchmarks/bench.py --what model`'s (the plain side here is that step); this
measures what the group adds to it.
"""
import argparse
import gc
import platform
import time

import numpy as np
from mpi4py import MPI

import gdncp


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--T", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    c = MPI.COMM_WORLD
    r, n = c.Get_rank(), c.Get_size()
    m = gdncp.Model.from_pretrained(a.checkpoint, threads=1)
    ids = np.random.default_rng(0).integers(0, m.config.vocab, size=(1, a.T + 1))
    make = {"plain": lambda: m.adamw(lr=1e-4),
            **{f"zero={z}": (lambda z=z: m.adamw(lr=1e-4, group=c, zero=z)) for z in (0, 1, 2)}}
    times = {k: [] for k in make}
    start = {k: None for k in make}
    after = {}
    w0 = m._w.copy()
    for rd in range(a.rounds):
        for k in (list(make) if rd % 2 == 0 else list(make)[::-1]):
            if rd == 0:   # the first round also checks the levels' weights: one step from w0 each
                m._w[:] = w0
            opt = make[k]()
            opt.step(ids)
            if rd == 0:   # every tensor (not the padding between them, which nothing writes)
                after[k] = None if k == "plain" else np.concatenate([v.ravel() for v in m.state_dict().values()])
            c.Barrier()
            t0 = time.perf_counter()
            opt.step(ids)
            times[k].append(c.allreduce(time.perf_counter() - t0, op=MPI.MAX))
            del opt
            gc.collect()
    same = {k: bool(c.allreduce(int(np.array_equal(after[k], after["zero=0"])), op=MPI.MIN))
            for k in ("zero=1", "zero=2")}
    if r == 0:
        nw = m.grad_size * 4
        moved = {"plain": 0, "zero=0": 2 * nw, "zero=1": 3 * nw, "zero=2": 2 * nw}
        med = {k: float(np.median(v)) for k, v in times.items()}
        print(f"bench_sharded: CPU {cpu_name()}; {n} ranks of 1 thread over mpi4py; {m.grad_size / 1e6:.0f} M "
              f"floats ({nw / 1e9:.2f} GB of weights); B 1, T {a.T} a rank; medians of {a.rounds} alternated rounds")
        for k, v in med.items():
            extra = "" if k in ("plain", "zero=0") else f"; weights after a step = zero=0's: {same[k]}"
            print(f"  {k:7s} {v * 1e3:9.0f} ms  x{v / med['plain']:.3f} of the plain step  "
                  f"moves ~{moved[k] / 1e9:.2f} GB a rank{extra}")


if __name__ == "__main__":
    main()
