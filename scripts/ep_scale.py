#!/usr/bin/env python3
"""Expert parallelism on paper: per-rank memory of a training step and of inference, and the
all-to-all bytes, for Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B at EP = 1, 4, 8, 16, 32.

The parameter counts and the activations come from the library itself (gdn_model_param_count and
gdn_model_plan_estimate on the config with ep_size / ep_rank set: this rank's slice of the
experts), so the table is what `gdncp train --ep N` would allocate; the rest is arithmetic stated
below. Prints the markdown table docs/training.md quotes.

Usage: GDNCP_LIBRARY=build/libgdncp.so PYTHONPATH=python/src python3 scripts/ep_scale.py [T_per_rank]
"""
import ctypes
import sys

from gdncp import _lib

# transformers' config.json values (text_config), the dimensions gdncp's model reads
MODELS = {
    "Qwen3.5-35B-A3B": dict(vocab=248320, E=2048, L=40, Hk=16, Hv=32, K=128, V=128, Kc=4, H=16, Hkv=2, d=256,
                            n_experts=256, top_k=8, moe_I=512, shared_I=512),
    "Qwen3-Next-80B-A3B": dict(vocab=151936, E=2048, L=48, Hk=16, Hv=32, K=128, V=128, Kc=4, H=16, Hkv=2, d=256,
                               n_experts=512, top_k=10, moe_I=512, shared_I=512),
}
EPS = [1, 4, 8, 16, 32]


def config(m, ep):
    c = _lib.ModelConfig()
    for k, v in m.items():
        setattr(c, k, v)
    c.eps, c.R, c.rope_theta, c.norm_topk = 1e-6, m["d"] // 4, 1e7, 1
    _lib.gdn_model_set_attention_interval(ctypes.byref(c), 4)
    for l in range(m["L"]):
        c.moe[l] = 1
    c.ep_size, c.ep_rank = ep, 0
    return c


def main():
    T = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    gb = 1e-9
    print(f"Per rank, T = {T} tokens per rank (B = 1, per-block recompute), fp32 master weights; training state = "
          "weights + gradients + AdamW's two moments (16 B per parameter); inference = the weights alone (fp32 / "
          "BF16). All-to-all: bytes a rank sends and receives per MoE layer per step for its own tokens' rows "
          "(fraction (N-1)/N of them leave the rank).\n")
    print("| model | EP | parameters per rank | training state | activations | training total | inference fp32 "
          "| inference bf16 | all-to-all per layer, forward / backward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in MODELS.items():
        E, k = m["E"], m["top_k"]
        for ep in EPS:
            c = config(m, ep)
            if _lib.gdn_model_config_check(ctypes.byref(c)) != 0:
                raise SystemExit(f"{name} ep {ep}: {_lib.gdn_errmsg().decode()}")
            params = _lib.gdn_model_param_count(ctypes.byref(c))
            run = _lib.ModelRun()
            run.B, run.T, run.threads, run.recompute = 1, T, 1, 1
            acts = _lib.gdn_model_plan_estimate(ctypes.byref(c), ctypes.byref(run))
            leave = (ep - 1) / ep
            # forward: x rows out, expert outputs back (E floats each way); backward: [x | dy | w] out,
            # [dx | c] back (the owner recomputes gate/up from x instead of keeping it)
            fwd = 2 * T * k * E * 4 * leave
            bwd = T * k * ((2 * E + 1) + (E + 1)) * 4 * leave
            state = 16 * params
            print(f"| {name} | {ep} | {params / 1e9:.2f} B | {state * gb:.0f} GB | {acts * gb:.1f} GB | "
                  f"{(state + acts) * gb:.0f} GB | {4 * params * gb:.1f} GB | {2 * params * gb:.1f} GB | "
                  + (f"{fwd / 1e6:.0f} / {bwd / 1e6:.0f} MB |" if ep > 1 else "none |"))
    print()
    for name, m in MODELS.items():
        E, I, k = m["E"], m["moe_I"], m["top_k"]
        flops = 2 * k * 3 * E * I  # a token's routed experts, forward
        byts = 2 * k * E * 4       # its rows out and back, forward
        print(f"{name}: a token's routed experts cost {flops / 1e6:.1f} MFLOP forward against {byts / 1e3:.0f} KB "
              f"of rows out and back ({byts / flops * 1e3:.2f} bytes per kFLOP); a rank whose experts run at F "
              f"GFLOP/s hides the exchange behind them when its link moves {byts / flops:.5f} F GB/s "
              f"(x (N-1)/N): {byts / flops * 100:.1f} GB/s at 100 GFLOP/s (a few cores, fp32), "
              f"{byts / flops * 1000:.0f} GB/s at 1 TFLOP/s (a socket with AMX BF16).")


if __name__ == "__main__":
    main()
