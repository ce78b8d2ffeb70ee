#!/usr/bin/env python3
"""The sharded training state on paper (DESIGN §15, gdncp train --zero): per-rank state and the bytes
each rank moves a step for Qwen3.5-9B, Qwen3.5-27B, Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B trained on
one 128K-token sequence a step split over N ranks (CP N: every rank a replica of every dense weight;
under EP the experts' slices replicated N / EP times), and the link speed at which the exchange
hides behind the step's compute. Prints the markdown table docs/training.md quotes.

The MoE models' parameter counts come from the library (scripts/ep_scale.py's configs); the dense
ones from their names (9.0 B and 27.0 B parameters; hidden 4096 and 5120, untied embeddings of
Qwen3.5's 248,320 ids, which set the largest unit a rank gathers). Arithmetic, per rank, fp32:
  state      level 0: 16 P;  3: 16 P/N + 12 U (the dense part over N ranks, the experts' slice over
             its N / EP replicas; U the largest unit, the untied lm_head (vocab x hidden): its
             weights gathered, its gradient in the model's plan and in the unit's gradient while
             the backward starts; a layer's units are far smaller)
  moved      level 0: 8 P (N-1)/N (the all-reduce); 1: 12 P (N-1)/N; 2: 8 P (N-1)/N;
             3: 12 P (N-1)/N (a reduce-scatter, a gather for the forward and one for the backward)
  compute    6 x active parameters x 131072 / N FLOPs a rank (the attention and the kernel left out:
             a floor on the time), at F = 1 TFLOP/s (a socket with AMX BF16)
  hides at   moved / (compute / F): the link speed at which a perfectly overlapped exchange costs
             nothing. (gdncp overlaps level 3's gathers and level 2-3's reduce-scatters with the
             model's compute; levels 0-1 sum after the backward and add their time.)

Usage: GDNCP_LIBRARY=build/libgdncp.so PYTHONPATH=python/src python3 scripts/zero_scale.py
"""
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from ep_scale import MODELS, config  # noqa: E402
from gdncp import _lib  # noqa: E402

TOKENS = 131072
F = 1e12  # FLOP/s a rank


def moe(name, ep):
    c = config(MODELS[name], ep)
    if _lib.gdn_model_config_check(ctypes.byref(c)) != 0:
        raise SystemExit(f"{name}: {_lib.gdn_errmsg().decode()}")
    whole = config(MODELS[name], 1)
    p_all = _lib.gdn_model_param_count(ctypes.byref(whole))
    p_rank = _lib.gdn_model_param_count(ctypes.byref(c))
    m = MODELS[name]
    experts_whole = m["L"] * m["n_experts"] * 3 * m["moe_I"] * m["E"]
    dense = p_all - experts_whole
    active = dense + m["L"] * m["top_k"] * 3 * m["moe_I"] * m["E"]
    return dense, p_rank - dense, active, m["vocab"] * m["E"]


def main():
    rows = []
    for name, p, e in (("Qwen3.5-9B", 9.0e9, 4096), ("Qwen3.5-27B", 27.0e9, 5120)):
        for n in (8, 16, 32, 64):
            rows.append((name, n, 1, p, 0.0, p, 248320 * e))
    for name in ("Qwen3.5-35B-A3B", "Qwen3-Next-80B-A3B"):
        for n, ep in ((8, 8), (16, 8), (32, 16), (64, 32)):
            dense, slice_, active, unit = moe(name, ep)
            rows.append((name, n, ep, dense, slice_, active, unit))
    gb = 1e-9
    print("| model | ranks N | EP | level | state a rank | moved a step a rank | compute a step a rank at 1 TFLOP/s | hides at |")
    print("|---|---|---|---|---|---|---|---|")
    for name, n, ep, dense, slice_, active, unit in rows:
        r = n // ep  # the experts' slice's replicas
        for level in (0, 3):
            if level == 0:
                state = 16 * (dense + slice_)
                moved = 8 * dense * (n - 1) / n + 8 * slice_ * (r - 1) / r
            else:
                state = 16 * dense / n + 16 * slice_ / r + 12 * unit
                moved = 12 * dense * (n - 1) / n + 12 * slice_ * (r - 1) / r
            secs = 6 * active * TOKENS / n / F
            print(f"| {name} | {n} | {ep if ep > 1 else '-'} | {level} | {state * gb:.1f} GB | {moved * gb:.1f} GB | "
                  f"{secs:.1f} s | {moved / secs * gb:.2f} GB/s |")


if __name__ == "__main__":
    main()
