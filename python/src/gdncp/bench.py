"""python -m gdncp.bench: transformers' reference PyTorch rule (its CPU fallback,
torch_chunk_gated_delta_rule) against gdncp.torch.chunk_gated_delta_rule on the same inputs, in
one run: forward, and forward + backward of sum(o * w). Prints the times, their ratio and the
agreement of the outputs (max-abs error / max-abs of transformers' output).

    python -m gdncp.bench [--T 1024] [--B 1] [--Hk 16] [--Hv 32] [--K 128] [--V 128]
                          [--reps 3] [--threads N]

The default shape is Qwen3.5-35B's GatedDeltaNet layer (Hk = 16, Hv = 32, K = V = 128). Both
sides run with torch.get_num_threads() threads (--threads sets it).
"""
import argparse
import time

import torch

from .torch import chunk_gated_delta_rule


def _inputs(B, T, Hk, Hv, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, K, generator=gen)
    k = torch.randn(B, T, Hk, K, generator=gen)
    v = torch.randn(B, T, Hv, V, generator=gen)
    # Qwen-like gates: per-head decays from fast to slow
    g = -torch.rand(B, T, Hv, generator=gen) * torch.logspace(-3, 0, Hv)
    beta = torch.rand(B, T, Hv, generator=gen)
    return q, k, v, g, beta


def _time(fn, reps):
    fn()  # warm-up: plans, allocator
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def run(B=1, T=1024, Hk=16, Hv=32, K=128, V=128, reps=3, backward=True):
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as hf
    xs = _inputs(B, T, Hk, Hv, K, V)
    w = torch.randn(B, T, Hv, V, generator=torch.Generator().manual_seed(1))
    rows = []
    outs = {}
    for name, rule in (("transformers", hf), ("gdncp", chunk_gated_delta_rule)):
        def fwd():
            with torch.no_grad():
                outs[name] = rule(*xs[:3], g=xs[3], beta=xs[4], use_qk_l2norm_in_kernel=True)[0]

        def fwd_bwd():
            leaves = [x.clone().requires_grad_(True) for x in xs]
            o, _ = rule(*leaves[:3], g=leaves[3], beta=leaves[4], use_qk_l2norm_in_kernel=True)
            (o * w).sum().backward()

        rows.append((name, _time(fwd, reps), _time(fwd_bwd, reps) if backward else None))
    ref = outs["transformers"]
    err = ((outs["gdncp"] - ref).abs().max() / ref.abs().max()).item()
    return rows, err


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m gdncp.bench", description=__doc__.split("\n\n")[0])
    for name, default in (("B", 1), ("T", 1024), ("Hk", 16), ("Hv", 32), ("K", 128), ("V", 128),
                          ("reps", 3)):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-backward", action="store_true", help="forward only")
    a = ap.parse_args(argv)
    for name in ("B", "T", "Hk", "Hv", "K", "V", "reps"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    if a.Hv % a.Hk:
        ap.error(f"--Hv {a.Hv} must be a multiple of --Hk {a.Hk}")
    if a.threads:
        torch.set_num_threads(a.threads)
    rows, err = run(a.B, a.T, a.Hk, a.Hv, a.K, a.V, a.reps, not a.no_backward)
    print(f"shape B={a.B} T={a.T} Hk={a.Hk} Hv={a.Hv} K={a.K} V={a.V}, "
          f"{torch.get_num_threads()} threads, best of {a.reps}")
    for name, f, fb in rows:
        print(f"  {name:12s} forward {f * 1e3:9.1f} ms"
              + ("" if fb is None else f"   forward+backward {fb * 1e3:9.1f} ms"))
    (_, f0, fb0), (_, f1, fb1) = rows
    print(f"  speed-up (transformers / gdncp): forward {f0 / f1:.1f}x"
          + ("" if fb0 is None else f", forward+backward {fb0 / fb1:.1f}x"))
    print(f"  o: max|gdncp - transformers| / max|transformers| = {err:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
