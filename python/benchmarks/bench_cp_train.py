"""python python/benchmarks/bench.py --what cp-train: a training step of transformers' own Qwen3_5ForCausalLM
with its sequence split over 1, 2 and 4 MPI ranks (gdncp.transformers.patch(comm=...)), and over
a torchrun gloo group (patch(group=...), side "patched gloo": its CP bytes per step from
gdncp.torch_cp's transport), against
transformers unpatched on one process, and against gdncp's own C trainer (`gdncp train`) on the
same model and grid: tokens/s and the peak memory per rank.

Each (model, side, ranks, T) runs in fresh processes (`mpiexec.mpich -n D python
bench_cp_train.py --worker ...`), so its peak resident memory (ru_maxrss, the largest rank's;
the model, the optimizer state and the step) is its own. A watchdog sums the resident memory of
the run's processes every 50 ms and stops it past --mem-gib (default 20 of this machine's 24):
such a run is reported as "does not fit". The step: forward with labels, backward,
all_reduce_grads (the ranks' gradient sum), AdamW; one warm-up step, then the median of --reps.
Tokens are random bytes (vocabulary 256), B = 1, the whole sequence T split as evenly as the
ranks allow. Models: gdncp's named hybrid configurations (`gdncp train --model tiny|small`,
every fourth layer full attention) built in transformers with random weights.

--cp-max: the longest T (doubling from --cp-T's first value) each of transformers unpatched on
one process and the patched model over 4 ranks completes within --mem-gib, the issue's target
being a ratio of at least 4.
"""
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def hf_config(name):
    """transformers' Qwen3_5TextConfig of gdncp's named model `name` (gdn_model_config_named)."""
    import ctypes
    from transformers import Qwen3_5TextConfig
    from gdncp import _lib as L
    from gdncp.model import ModelConfig
    c = L.ModelConfig()
    if not L.gdn_model_config_named(name.encode(), ctypes.byref(c)):
        raise ValueError(f"no named model {name!r} (tiny, small, long)")
    m = ModelConfig._from_c(c)
    return Qwen3_5TextConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_hidden_layers, layer_types=list(m.layer_types),
        linear_num_key_heads=m.linear_num_key_heads, linear_num_value_heads=m.linear_num_value_heads,
        linear_key_head_dim=m.linear_key_head_dim, linear_value_head_dim=m.linear_value_head_dim,
        linear_conv_kernel_dim=m.linear_conv_kernel_dim, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_key_value_heads, head_dim=m.head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta,
                         "partial_rotary_factor": m.rotary_dims / m.head_dim},
        max_position_embeddings=1 << 30, rms_norm_eps=m.rms_norm_eps,
        tie_word_embeddings=m.tie_word_embeddings, use_cache=False)


def worker(model_name, T, reps, patched, strategy, attention):
    """One run (every rank of mpiexec, or the one process): prints a JSON line on rank 0."""
    import torch
    from transformers import Qwen3_5ForCausalLM
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(hf_config(model_name)).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, T), generator=gen)
    rank, size, comm, group = 0, 1, None, None
    if patched == "gloo":   # patch(group=...) under torchrun
        import torch.distributed as dist
        import gdncp.transformers as gtr
        import gdncp.transformers_torch_cp as ttcp
        dist.init_process_group("gloo")
        group = dist.group.WORLD
        rank, size = dist.get_rank(), dist.get_world_size()
        cp_bytes = []
    elif patched:
        from mpi4py import MPI
        import gdncp.transformers as gtr
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
    a, b = T * rank // size, T * (rank + 1) // size
    x = ids[:, a:b]
    times, losses = [], []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        opt.zero_grad()
        if group is not None:
            with gtr.patch(group=group):
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                st = ttcp._settings.stats   # this step's CP exchanges (a fresh transport a patch)
                cp_bytes.append(st["bytes_sent"])
            gtr.all_reduce_grads(model, group)
        elif patched:
            with gtr.patch(comm=comm, strategy=strategy, attention=attention):
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
            gtr.all_reduce_grads(model, comm)
        else:
            loss = model(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
        opt.step()
        if comm is not None:
            comm.Barrier()
        if group is not None:
            dist.barrier()
        if i:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    extra = {}
    if comm is not None:
        peak_mb = comm.allreduce(peak_mb, op=MPI.MAX)
        times = [comm.allreduce(t, op=MPI.MAX) for t in times]
    if group is not None:
        import torch
        t = torch.tensor([peak_mb] + times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak_mb, times = float(t[0]), t[1:].tolist()
        b = torch.tensor([float(statistics.median(cp_bytes))], dtype=torch.float64)
        dist.all_reduce(b, op=dist.ReduceOp.MAX)
        # the CP exchanges of a step (forward, backward; the largest rank's bytes sent) and the
        # gradient all-reduce (every parameter's fp32 gradient)
        extra = {"cp_bytes": float(b[0]), "grad_bytes": 4 * sum(p.numel() for p in model.parameters())}
    if rank == 0:
        print("GDNCP_BENCH " + json.dumps({"step_s": statistics.median(times), "peak_mb": peak_mb,
                                           "loss": losses[0],
                                           "params": sum(p.numel() for p in model.parameters()),
                                           **extra}),
              flush=True)
    if group is not None:
        # every rank past the last collective, then out without tearing the gloo group down:
        # its teardown at exit aborts a rank now and then ("terminate called without an active
        # exception", about 1 run in 12 here), which failed a run whose result was printed
        dist.barrier()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


def _rss_mb(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _tree(pid):
    """pid and every descendant (from /proc)."""
    kids = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                kids.setdefault(ppid, []).append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def run_guarded(cmd, mem_mb, timeout_s, env=None):
    """(stdout, None) or (None, why): the command stopped past mem_mb resident (all of its
    processes) or timeout_s."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    why, peak = [], [0.0]

    def watch():
        t0 = time.time()
        while p.poll() is None:
            rss = _rss_mb(_tree(p.pid))
            peak[0] = max(peak[0], rss)
            if rss > mem_mb:
                why.append(f"does not fit: {rss / 1024:.1f} GiB resident > --mem-gib")
            elif time.time() - t0 > timeout_s:
                why.append(f"stopped after {timeout_s} s")
            if why:
                try:
                    os.killpg(p.pid, 9)
                except OSError:
                    pass
                return
            time.sleep(0.05)
    th = threading.Thread(target=watch, daemon=True)
    th.start()
    out = p.communicate()[0]
    th.join()
    if why:
        return None, why[0]
    if p.returncode != 0:
        tail = " | ".join(out.strip().splitlines()[-3:])
        return None, f"exit {p.returncode}: {tail[-300:]}"
    return out, None


def _parse(out):
    for line in out.splitlines():
        if line.startswith("GDNCP_BENCH "):
            return json.loads(line[len("GDNCP_BENCH "):])
    return None


def _torchrun():
    near = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return near if os.access(near, os.X_OK) else (shutil.which("torchrun") or "torchrun")


def _side(model, T, D, patched, reps, mem_mb, timeout_s, threads):
    """patched: False (transformers, one process), True (patch(comm=) under mpiexec) or "gloo"
    (patch(group=) under torchrun)."""
    flag = "gloo" if patched == "gloo" else ("1" if patched else "0")
    args = ["--worker", model, str(T), str(reps), flag]
    py = [sys.executable, os.path.abspath(__file__)] + args
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, threads // D)))
    if patched == "gloo":
        cmd = [_torchrun(), "--standalone", "--nproc-per-node", str(D),
               os.path.abspath(__file__)] + args
    else:
        cmd = (["mpiexec.mpich", "-n", str(D)] + py) if patched else py
    out, why = run_guarded(cmd, mem_mb, timeout_s, env)
    if why:
        return None, why
    r = _parse(out)
    return (r, None) if r else (None, "no result line")


def _c_trainer(model, T, D, reps, mem_mb, timeout_s, threads):
    """gdncp's own C trainer, same model, T and grid (--cp D), random-byte text."""
    exe = os.environ.get("GDNCP_CLI") or shutil.which("gdncp")
    if not exe:
        return None, "no gdncp command (set GDNCP_CLI)"
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data.bin")
        with open(data, "wb") as f:
            # random printable bytes (the trainer takes only text as byte data)
            f.write(bytes(32 + b % 95 for b in os.urandom(max(4 * T, 1 << 16))))
        log = os.path.join(tmp, "log.csv")
        cmd = ["mpiexec.mpich", "-n", str(D), exe, "train", "--data", data, "--model", model,
               "--seq", str(T), "--batch", "1", "--cp", str(D), "--steps", str(reps + 1),
               "--eval-every", "0",
               "--log", log, "--out", os.path.join(tmp, "out"), "--threads",
               str(max(1, threads // D)), "--progress", "lines"]
        out, why = run_guarded(cmd, mem_mb, timeout_s)
        if why:
            return None, why
        with open(log) as f:
            rows = [line.strip().split(",") for line in f][1:]
    ms = [float(r[7]) for r in rows[1:]]
    return {"step_s": statistics.median(ms) / 1e3, "peak_mb": max(float(r[4]) for r in rows),
            "loss": float(rows[0][1])}, None


SIDES = ("transformers", "patched", "patched gloo", "gdncp C")


def run(models=("tiny", "small"), Ts=(4096, 16384), ranks=(1, 2, 4), reps=2, mem_gib=20.0,
        timeout_s=900, cp_max=False, threads=None, sides=SIDES, report=None):
    """Rows (model, T, side, ranks, result or None, why), each also given to report.row as it
    finishes; and with cp_max, the longest T per (model, side)."""
    threads = threads or os.cpu_count() or 1
    mem_mb = mem_gib * 1024
    rows = []

    def add(row):
        rows.append(row)
        if report:
            report.row(row)
    for model in models:
        for T in Ts:
            if "transformers" in sides:
                r, why = _side(model, T, 1, False, reps, mem_mb, timeout_s, threads)
                add((model, T, "transformers", 1, r, why))
            for D in ranks:
                if "patched" in sides:
                    r, why = _side(model, T, D, True, reps, mem_mb, timeout_s, threads)
                    add((model, T, "patched", D, r, why))
                if "patched gloo" in sides:
                    r, why = _side(model, T, D, "gloo", reps, mem_mb, timeout_s, threads)
                    add((model, T, "patched gloo", D, r, why))
                if "gdncp C" in sides:
                    r, why = _c_trainer(model, T, D, reps, mem_mb, timeout_s, threads)
                    add((model, T, "gdncp C", D, r, why))
    if not cp_max:
        return rows, {}
    longest = {}
    for model in models:
        for side, D, patched in (("transformers", 1, False), ("patched", 4, True)):
            if side not in sides:
                continue
            T, best = Ts[0], None
            while True:
                r, why = _side(model, T, D, patched, 1, mem_mb, timeout_s, threads)
                if report:
                    report.probe(model, side, T, r, why)
                if r is None:
                    break
                best = (T, r["peak_mb"])
                T *= 2
            longest[(model, side)] = (best, T, why)
    return rows, longest


class Report:
    """Prints the section as its runs finish (a long --cp-max search shows what it found so far)."""

    def __init__(self, mem_gib):
        from bench import _where
        print(f"[cp-train] a training step (forward with labels, backward, gradient sum, AdamW), "
              f"B=1, random bytes; {_where()}; peak resident memory of the largest rank; "
              f"--mem-gib {mem_gib:g}", flush=True)
        self.ref = {}

    def row(self, row):
        model, T, side, D, r, why = row
        tag = f"  {model:5s} T={T:<7d} {side:12s} ranks={D}"
        if r is None:
            print(f"{tag}  -- {why}", flush=True)
            return
        self.ref[(model, T, side, D)] = r["step_s"]
        extra = ""
        if side == "gdncp C" and (model, T, "patched", D) in self.ref:
            extra = f"   patched / C {self.ref[(model, T, 'patched', D)] / r['step_s']:.2f}x"
        elif side == "patched" and (model, T, "transformers", 1) in self.ref:
            extra = f"   {self.ref[(model, T, 'transformers', 1)] / r['step_s']:.2f}x transformers"
        elif side == "patched gloo":
            if (model, T, "patched", D) in self.ref:
                extra = f"   gloo / mpi4py {r['step_s'] / self.ref[(model, T, 'patched', D)]:.2f}x"
            extra += (f"   CP bytes/step/rank {r['cp_bytes'] / 2**20:.2f} MiB, gradients "
                      f"{r['grad_bytes'] / 2**20:.1f} MiB")
        print(f"{tag}  {r['step_s'] * 1e3:10.1f} ms/step {T / r['step_s']:9.0f} tok/s  peak "
              f"{r['peak_mb'] / 1024:6.2f} GiB/rank  loss {r['loss']:.4f}{extra}", flush=True)

    def probe(self, model, side, T, r, why):
        got = f"completes, peak {r['peak_mb'] / 1024:.2f} GiB/rank" if r else why
        print(f"  --cp-max {model} {side} T={T}: {got}", flush=True)

    def longest(self, longest):
        for (model, side), (best, stop_T, why) in longest.items():
            if best is None:
                print(f"  longest T, {model} {side}: none (T={stop_T}: {why})")
            else:
                print(f"  longest T, {model} {side}: {best[0]} (peak {best[1] / 1024:.2f} "
                      f"GiB/rank; T={stop_T}: {why})")
        for model in {m for m, _ in longest}:
            a, b = longest.get((model, "transformers")), longest.get((model, "patched"))
            if a and b and a[0] and b[0]:
                print(f"  longest T ratio, {model}: patched over 4 ranks / transformers on one "
                      f"process = {b[0][0] / a[0][0]:.1f}x")


def main(argv):
    if argv and argv[0] == "--worker":
        _, model, T, reps, patched = argv[:5]
        strategy = os.environ.get("GDNCP_BENCH_STRATEGY", "scan")
        attention = os.environ.get("GDNCP_BENCH_ATTENTION", "kv")
        worker(model, int(T), int(reps), "gloo" if patched == "gloo" else patched == "1",
               strategy, attention)
        return 0
    raise SystemExit("run it as python python/benchmarks/bench.py --what cp-train")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
