"""python python/benchmarks/bench.py: gdncp from PyTorch against transformers' own CPU code, in one run.
Every time is a median of --reps runs after a warm-up (the sides of a comparison taking
turns, so that a drifting load weighs on both); each section prints its shape, the CPU and
the threads.

  rule      transformers' reference PyTorch rule (its CPU fallback, torch_chunk_gated_delta_rule)
            against gdncp.torch.chunk_gated_delta_rule on the same inputs: forward, and forward +
            backward of sum(o * w); their ratio and the outputs' agreement (max-abs error /
            max-abs of transformers' output). Shape: --B --T --Hk --Hv --K --V (default
            Qwen3.5-35B's GatedDeltaNet layer, Hk = 16, Hv = 32, K = V = 128, T = 1024).
  model     a training step (forward with labels, backward, AdamW), each side in a process of its
            own (bench.py --model-worker SIDE; peak RSS its own), on one random
            checkpoint and the same ids: transformers' Qwen3_5ForCausalLM unpatched, patched
            (gdncp.transformers.patch()), patched under torch.autocast bf16, gdncp.Model's step
            (Model.adamw().step: the C AdamW) in fp32 and bf16, and `gdncp train --init` on the
            same checkpoint (fp32, --compute bf16) when a gdncp command is found (GDNCP_CLI,
            build/gdncp, PATH): median step, tokens/s, fractions of the measured fp32 / BF16 peaks,
            peak RSS, first loss. --model-shape tiny (default; B 8 T 512) | 0.8b (Qwen3.5-0.8B's
            dimensions, vocabulary 248320 tied, 4 layers LLLF, B 1 T 2048) | 2b (E 2048, I 6144);
            --model-layers, --model-B, --model-T, --model-rounds (sides in turn), --model-sides,
            --model-config (a config.json instead of a shape).
  overhead  the binding's cost: gdncp.torch forward + backward (autograd) against the NumPy entry
            points (gdncp.chunk_forward(save=True) + chunk_backward) and against the C functions
            called straight through ctypes with the plan and outputs made once (gdn_forward_save +
            gdn_backward_saved), on the same arrays, at the rule section's shape; and the C calls
            with their outputs allocated per call, as any call that returns new arrays must (the
            first touch of fresh memory is most of what the bindings add).
  conv      the causal conv's share of the patched GatedDeltaNet layer (transformers' module with
            gdncp's rule): the layer's forward + backward against its conv1d + SiLU alone, same
            shapes, and against gdncp.Layer (the whole layer in C, conv included) with the same
            weights (--layer-E; the heads of the rule section).
  attention PyTorch's torch.nn.functional.scaled_dot_product_attention(is_causal=True,
            enable_gqa=True) (fp32, CPU, its q [B, H, T, d] layout) against gdncp's attention core
            alone (gdn_sdpa_forward / gdn_sdpa_backward through ctypes, token-major
            [B, T, H, d], plan and outputs made once), same values, same threads: forward and
            forward + backward of sum(o * dout), GFLOP/s by the causal count 2 T^2 d H (x3.5 with
            the backward), their ratio, and o, dq, dk, dv against torch's; beside them torch's
            SDPA under torch.autocast("cpu", torch.bfloat16) (bf16 operands; gdncp's core
            stays fp32 in either compute mode) and its o's error against torch's fp32 o. Shape: --attn-T
            (default 8192), --attn-H 16, --attn-Hkv 2, --attn-d 256 (Qwen3.5-35B-A3B's heads).
  gemm      the projections' GEMM y = x W^T at the 35B layer's shapes (in_proj_qkv, in_proj_z,
            out_proj; T = --gemm-T rows): torch.matmul in fp32, in BF16 with operands already
            bf16 (oneDNN's brgemm: AMX where the CPU has it) and under torch.autocast (fp32 in,
            conversions included), against gdncp's fp32 GEMM and its BF16 GEMM (fp32 in and out,
            the path dispatch picked); GFLOP/s, the fraction of the fp32 FMA peak and of the BF16
            instruction peak measured in the same run, and each y against a float64 product.
  generate  greedy generation, prompt + new tokens with every cache: transformers'
            Qwen3_5ForCausalLM.generate(do_sample=False) against gdncp.Model.generate (the whole
            model in C) on the same weights (a random model of --model-config's shape, default the
            golden tiny one, saved with save_pretrained and loaded by both), new tokens per second
            of each and whether their ids agree. --gen-B rows of --gen-prompt tokens, --gen-new.

  cp-train  (only when asked for) a training step of transformers' Qwen3_5ForCausalLM with its
            sequence split over 1, 2, 4 MPI ranks by gdncp.transformers.patch(comm=...) and
            over a torchrun gloo group by patch(group=...) ("patched gloo": also its CP bytes
            per step), against transformers unpatched on one process and gdncp's C trainer on
            the same grid: tokens/s and peak memory per rank (bench_cp_train.py). --cp-models tiny,small
            --cp-T 4096,16384 --cp-ranks 1,2,4 --mem-gib 20, --cp-max for the longest T each side
            completes.

  moe       (only when asked for) the sparse MoE block at --moe-shape (35b: Qwen3.5-35B-A3B, E 2048,
            256 experts, top 8, I 512, shared 512; next: Qwen3-Next, 512 experts, top 10) over
            --moe-T tokens: transformers' Qwen3_5MoeSparseMoeBlock (grouped_mm and eager experts,
            fp32, and under bfloat16 autocast) against gdncp.torch.moe_block (fp32 and bf16), forward
            and forward + backward, alternated, and gdncp's errors against transformers' eager fp32.

    python python/benchmarks/bench.py [--what rule,model,overhead,conv,bf16,gemm,attention,generate,moe,cp-train]
                          [--quick] [--reps 5] [--threads N]

--quick runs every section at toy sizes (the test suite's smoke run). --threads sets torch's
thread count (0: torch's default), which gdncp's kernels use too.
"""
import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

from gdncp.torch import chunk_gated_delta_rule


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
    """Median wall time of reps calls after one warm-up (plans, allocator)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rounds(fns, reps):
    """reps rounds, each calling every fn once in turn (after one warm-up round), so that a
    machine whose load drifts weighs on every side alike: [[s per round] per fn]."""
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(times, fns):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return times


def _time_rounds(fns, reps):
    """[median s per fn] of _rounds."""
    return [statistics.median(t) for t in _rounds(fns, reps)]


def _cpu():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _where():
    return f"CPU {_cpu()} ({os.cpu_count()} logical), {torch.get_num_threads()} threads"


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


# ----------------------------------------------------------------------------- model training step

# The golden qwen35_tiny checkpoint's shape (tests/data/qwen35_tiny/config.json), so that the
# bench needs no file: E = 96, linear heads Hk = 2, Hv = 6, K = 16, V = 24, 3 GatedDeltaNet layers
# and one attention layer, vocabulary 256.
TINY_CONFIG = {
    "model_type": "qwen3_5_text", "hidden_size": 96, "intermediate_size": 192,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 6, "linear_value_head_dim": 24, "vocab_size": 256,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
}


def _model(config_path=None):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = dict(TINY_CONFIG)
    if config_path:
        with open(config_path) as f:
            cfg = json.load(f)
    cfg = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).float()
    model.train()
    return model


# The real shapes (the 248,320-token vocabulary, tied embeddings; issue 41): Qwen3.5-0.8B's and a
# 2B-class model's dimensions (gdncp's named qwen3.5-0.8b / qwen3.5-2b) with --model-layers layers
# (default 4: three GatedDeltaNet, one full attention), random weights.
def _qwen35_config(E, I, layers):
    return {
        "model_type": "qwen3_5_text", "hidden_size": E, "intermediate_size": I,
        "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "layer_types": ["full_attention" if (l + 1) % 4 == 0 else "linear_attention" for l in range(layers)],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 16, "linear_value_head_dim": 128, "vocab_size": 248320,
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    }


MODEL_SHAPES = {   # name -> (config maker(layers), default layers, default B, default T)
    "tiny": (lambda layers: dict(TINY_CONFIG), 4, 8, 512),
    "0.8b": (lambda layers: _qwen35_config(1024, 3584, layers), 4, 1, 2048),
    "2b": (lambda layers: _qwen35_config(2048, 6144, layers), 4, 1, 2048),
}

# The sides of the model section, each run in a process of its own (its peak resident memory is
# its own): transformers' model unpatched, patched, patched under BF16 autocast; gdncp.Model's
# training step (gdncp.Model.adamw().step: forward, backward, clipping, the C AdamW) in fp32 and
# BF16 compute; and the `gdncp train` command on the same checkpoint (--init), when one is found.
MODEL_SIDES = ("transformers", "patched", "patched autocast bf16", "gdncp.Model fp32", "gdncp.Model bf16",
               "gdncp train fp32", "gdncp train bf16")


def model_shape_config(shape="tiny", layers=None, config_path=None):
    """The transformers config dict of a model-section shape (or of config_path's config.json)."""
    if config_path:
        with open(config_path) as f:
            cfg = json.load(f)
        return {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    make, dl, _, _ = MODEL_SHAPES[shape]
    return make(layers or dl)


def save_model_checkpoint(cfg, d):
    """A random Qwen3_5ForCausalLM of config cfg (seed 0), saved into d (save_pretrained: the
    checkpoint every side loads)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).float()
    model.save_pretrained(d)


def _model_ids(vocab, B, T, seed):
    """The step's B rows of T + 1 ids (T predicted positions, as `gdncp train --seq T`)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T + 1), generator=gen)


def model_side(side, d, B, T, reps, threads, seed=3):
    """Run one side in this process: load checkpoint d, a warm-up step, then reps timed steps
    (forward with labels, backward, AdamW with torch.optim.AdamW's defaults: lr 1e-3, betas
    0.9 / 0.999, eps 1e-8, weight decay 0.01; the same ids every step). Returns {"times": [s],
    "loss": the first step's loss, "peak_mb": this process's peak resident memory}."""
    import resource
    times, losses = [], []
    if side.startswith("gdncp.Model"):
        from gdncp.model import Model
        compute = "bf16" if side.endswith("bf16") else "fp32"
        m = Model.from_pretrained(d, threads=threads)
        ids = _model_ids(m.config.vocab_size, B, T, seed).numpy()
        opt = m.adamw(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            losses.append(opt.step(ids, compute=compute))
            times.append(time.perf_counter() - t0)
        m.close()
    elif side in ("transformers", "patched", "patched autocast bf16"):
        from transformers import Qwen3_5ForCausalLM
        from gdncp import transformers as gtf
        torch.set_num_threads(threads)
        model = Qwen3_5ForCausalLM.from_pretrained(d, dtype=torch.float32)
        model.train()
        ids = _model_ids(model.config.vocab_size, B, T, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            with gtf.patch() if side != "transformers" else contextlib.nullcontext(), \
                    torch.autocast("cpu", dtype=torch.bfloat16, enabled=side.endswith("bf16")):
                opt.zero_grad(set_to_none=True)
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    else:
        raise ValueError(f"model_side: unknown side {side!r} (of {', '.join(MODEL_SIDES[:5])})")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"times": times[1:], "loss": losses[0], "peak_mb": peak, "pid": os.getpid()}


def _gdncp_cli():
    """The gdncp command: GDNCP_CLI, else build/gdncp beside the repository's python/, else PATH."""
    import shutil
    exe = os.environ.get("GDNCP_CLI")
    if exe:
        return exe if os.access(exe, os.X_OK) else None
    here = os.path.dirname(os.path.abspath(__file__))
    for root in (os.getcwd(), os.path.join(here, "..", "..", "..")):
        p = os.path.join(root, "build", "gdncp")
        if os.access(p, os.X_OK):
            return os.path.abspath(p)
    return shutil.which("gdncp")


def _cli_side(side, d, B, T, reps, threads, mem_mb, timeout_s, vocab, seed=3):
    """`gdncp train --init d` (the same checkpoint) for reps + 1 steps over a token file of random
    ids of the vocabulary (the sides' distribution, not their rows): ms/step of its log after the
    first step, its first loss, its peak resident memory (the log's, and the watchdog's)."""
    from bench_cp_train import run_guarded
    from gdncp.tokenize import header
    exe = _gdncp_cli()
    if not exe:
        return None, "no gdncp command (GDNCP_CLI, build/gdncp or PATH)"
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data.tok")
        n = max(4 * B * (T + 1) * (reps + 2), 1 << 16)
        ids = np.random.default_rng(seed).integers(0, vocab, n, dtype=np.uint32)
        with open(data, "wb") as f:
            f.write(header(n, 4, vocab))
            f.write(ids.astype("<u4").tobytes())
        log = os.path.join(tmp, "log.csv")
        cmd = [exe, "train", "--data", data, "--init", d, "--seq", str(T), "--batch", str(B),
               "--steps", str(reps + 1), "--eval-every", "0", "--recompute", "off", "--threads", str(threads),
               "--log", log, "--progress", "lines"]
        if side.endswith("bf16"):
            cmd += ["--compute", "bf16"]
        out, why = run_guarded(cmd, mem_mb, timeout_s)
        if why:
            return None, why
        with open(log) as f:
            rows = [line.strip().split(",") for line in f][1:]
    if len(rows) < 2:
        return None, f"the log has {len(rows)} steps"
    return {"times": [float(r[7]) / 1e3 for r in rows[1:]], "loss": float(rows[0][1]),
            "peak_mb": max(float(r[4]) for r in rows)}, None


def _model_worker(side, d, B, T, reps, threads, seed):
    """The internal --model-worker entry: one side in this process, its result as one line."""
    if side == "save":
        with open(os.path.join(d, "shape.json")) as f:
            save_model_checkpoint(json.load(f), d)
        print("GDNCP_BENCH {}")
        return 0
    print("GDNCP_BENCH " + json.dumps(model_side(side, d, B, T, reps, threads, seed)), flush=True)
    return 0


def _run_worker(args, mem_mb, timeout_s, threads):
    from bench_cp_train import run_guarded, _parse
    cmd = [sys.executable, os.path.abspath(__file__)] + [str(a) for a in args]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out, why = run_guarded(cmd, mem_mb, timeout_s, env)
    if why:
        return None, why
    r = _parse(out)
    return (r, None) if r is not None else (None, "no result line: " + " | ".join(out.strip().splitlines()[-3:])[-300:])


def model_peaks(threads):
    """(fp32 FMA peak, BF16 instruction peak, its path's name), GFLOP/s on threads threads, measured
    as the gemm section measures them."""
    from gdncp import _lib as L
    info = L.Bf16PathInfo()
    L.check(L.gdn_bench_bf16(0, 0, ctypes.byref(info)), "gdn_bench_bf16")
    pk32 = L.gdn_measure_peak_gflops(threads)
    L.check(L.gdn_bench_bf16(0, threads, ctypes.byref(info)), "gdn_bench_bf16")
    return (pk32, info.peak_gflops, info.name.decode())


def run_model(shape="tiny", B=None, T=None, reps=3, rounds=1, config_path=None, layers=None,
              sides=MODEL_SIDES, threads=None, mem_gib=20.0, timeout_s=3600, seed=3, report=None):
    """A training step (forward with labels, backward, AdamW) of every side in `sides`, each side a
    process of its own (bench.py --model-worker SIDE: a warm-up step, then reps timed
    ones), all on one checkpoint (random weights of the shape, saved once by a process of its own)
    and the same ids; `rounds` times over the sides in turn (a drifting load weighs on every side).
    Returns (rows [(side, result or None, why)], info): result {"times": every timed step's s,
    "step_s": their median, "loss": the first step's loss, "peak_mb", "tok_s", "frac32", "frac16":
    the model's FLOPs a second over the measured fp32 / BF16 peaks}; info {"shape": a description,
    "flops_per_token", "peak32", "peak16", "bf16_path", "B", "T", "threads"}. report(side, result,
    why) is called as each run ends."""
    import tempfile
    from gdncp import _lib as L
    _, _, dB, dT = MODEL_SHAPES.get(shape, MODEL_SHAPES["tiny"])
    B, T = B or dB, T or dT
    threads = threads or torch.get_num_threads()
    cfg = model_shape_config(shape, layers, config_path)
    mem_mb = mem_gib * 1024
    res = {s: [] for s in sides}
    why = {}
    # the peaks before and after the sides; the larger of each (a peak measured while something
    # else runs on the cores comes out low, and every fraction of it high)
    before = model_peaks(threads)
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "shape.json"), "w") as f:
            json.dump(cfg, f)
        r, w = _run_worker(["--model-worker", "save", "--model-dir", d], mem_mb, timeout_s, threads)
        if r is None:
            raise RuntimeError(f"bench model: saving the {shape} checkpoint failed: {w}")
        c = L.ModelConfig()
        L.check(L.gdn_ckpt_load_config(os.fsencode(d), ctypes.byref(c)), "bench model: config.json")
        flops = L.gdn_model_train_flops_per_token(ctypes.byref(c), T)
        for _ in range(rounds):
            for s in sides:
                if s in why:
                    continue
                if s.startswith("gdncp train"):
                    r, w = _cli_side(s, d, B, T, reps, threads, mem_mb, timeout_s, cfg["vocab_size"], seed)
                else:
                    r, w = _run_worker(["--model-worker", s, "--model-dir", d, "--model-B", B, "--model-T", T,
                                        "--reps", reps, "--threads", threads, "--model-seed", seed],
                                       mem_mb, timeout_s, threads)
                if r is None:
                    why[s] = w
                else:
                    res[s].append(r)
                if report:
                    report(s, r, w)
    after = model_peaks(threads)
    pk32, pk16, path = max(before[0], after[0]), max(before[1], after[1]), after[2]
    rows = []
    for s in sides:
        if s in why or not res[s]:
            rows.append((s, None, why.get(s, "not run")))
            continue
        times = [t for r in res[s] for t in r["times"]]
        step = statistics.median(times)
        tok_s = B * T / step
        rows.append((s, {"times": times, "step_s": step, "loss": res[s][0]["loss"],
                         "pids": [r.get("pid") for r in res[s]],
                         "peak_mb": max(r["peak_mb"] for r in res[s]), "tok_s": tok_s,
                         "frac32": tok_s * flops / (pk32 * 1e9),
                         "frac16": tok_s * flops / (pk16 * 1e9) if pk16 > 0 else float("nan")}, None))
    lt = cfg["layer_types"]
    desc = (f"Qwen3_5ForCausalLM E={cfg['hidden_size']} I={cfg['intermediate_size']} layers={len(lt)} "
            f"({lt.count('linear_attention')} GatedDeltaNet) Hk={cfg['linear_num_key_heads']} "
            f"Hv={cfg['linear_num_value_heads']} K={cfg['linear_key_head_dim']} V={cfg['linear_value_head_dim']} "
            f"attention {cfg['num_attention_heads']}/{cfg['num_key_value_heads']}x{cfg['head_dim']} "
            f"vocab={cfg['vocab_size']}{' tied' if cfg.get('tie_word_embeddings') else ''}, B={B} T={T}")
    return rows, {"shape": desc, "flops_per_token": flops, "peak32": pk32, "peak16": pk16, "bf16_path": path,
                  "peaks_before": before[:2], "peaks_after": after[:2],
                  "B": B, "T": T, "threads": threads}


# ----------------------------------------------------------------------------- generation

def run_generate(B=1, P=64, N=128, reps=3, config_path=None):
    """Greedy generation of N tokens after P-token prompts, B rows: transformers' generate
    against gdncp.Model.generate on the same weights. [(name, median s)], ids equal, shape."""
    import tempfile
    from gdncp.model import Model
    base = _model(config_path).eval()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, base.config.vocab_size, (B, P), generator=gen)
    out = {}
    with tempfile.TemporaryDirectory() as d:
        base.save_pretrained(d)
        m = Model.from_pretrained(d, threads=torch.get_num_threads())

        def hf():
            with torch.no_grad():
                o = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                  min_new_tokens=N, do_sample=False, pad_token_id=0)
            out["transformers"] = o[:, P:].numpy()

        def ours():
            out["gdncp"] = m.generate(ids.numpy(), max_new_tokens=N)
        try:
            rows = list(zip(("transformers", "gdncp.Model"), _time_rounds([hf, ours], reps)))
        finally:
            m.close()
    same = bool(np.array_equal(out["transformers"], out["gdncp"]))
    cfg = base.config
    shape = (f"Qwen3_5ForCausalLM E={cfg.hidden_size} layers={cfg.num_hidden_layers} "
             f"({cfg.layer_types.count('linear_attention')} GatedDeltaNet) vocab={cfg.vocab_size}, "
             f"B={B}, prompt {P}, {N} new tokens")
    return rows, same, shape


# ----------------------------------------------------------------------------- binding overhead

def run_overhead(B=1, T=1024, Hk=16, Hv=32, K=128, V=128, reps=5):
    """Forward + backward through gdncp.torch (autograd), the NumPy entry points and ctypes
    straight to the C functions, same arrays: [(name, median s)]."""
    from gdncp import _lib as L
    from gdncp import core
    xs = [x.contiguous() for x in _inputs(B, T, Hk, Hv, K, V)]
    w = torch.randn(B, T, Hv, V, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    arrays = [x.numpy() for x in xs]
    do = w.numpy()

    def via_torch():
        leaves = [x.detach().requires_grad_(True) for x in xs]
        o, _ = chunk_gated_delta_rule(*leaves[:3], g=leaves[3], beta=leaves[4],
                                      use_qk_l2norm_in_kernel=True)
        o.backward(w)

    def via_numpy():
        _, _, ck = core.chunk_forward(*arrays, save=True, threads=threads,
                                      output_final_state=False)
        core.chunk_backward(*arrays, do, saved=ck, threads=threads)

    # The C calls alone: the plan (the one gdncp.torch uses, from the cache) and every output
    # allocated once
    prob = core._Problem(*arrays, None, None)
    plan = core._plan(prob, None, True, 64, threads)
    o = np.empty_like(arrays[2])
    ck = np.empty(L.describe(L.gdn_plan_describe, L.PlanInfo, plan.h).checkpoint_floats, np.float32)
    grads = [np.empty_like(a) for a in arrays]
    In = ctypes.byref(L.rule_inputs(*arrays))
    Po, Pck, Pdo = L.f32p(o), L.f32p(ck), L.f32p(do)
    Gr = ctypes.byref(L.rule_grads(*grads))

    def via_ctypes():
        L.check(L.gdn_forward_save(plan.h, Po, None, Pck, In), "gdn_forward_save")
        L.check(L.gdn_backward_saved(plan.h, Gr, In, Pck, Pdo, None), "gdn_backward_saved")

    def via_ctypes_fresh():   # outputs allocated per call, as any call returning new arrays
        fo, fck = np.empty_like(o), np.empty_like(ck)
        fg = [np.empty_like(a) for a in arrays]
        L.check(L.gdn_forward_save(plan.h, L.f32p(fo), None, L.f32p(fck), In),
                "gdn_forward_save")
        L.check(L.gdn_backward_saved(plan.h, ctypes.byref(L.rule_grads(*fg)), In, L.f32p(fck),
                                     Pdo, None), "gdn_backward_saved")

    names = ("gdncp.torch", "NumPy", "C via ctypes", "C, new outputs")
    times = _rounds((via_torch, via_numpy, via_ctypes, via_ctypes_fresh), reps)
    return [(n, statistics.median(t), min(t)) for n, t in zip(names, times)]


# ----------------------------------------------------------------------------- the causal conv

def _hf_gdn_layer(B, T, E, Hk, Hv, K, V):
    """transformers' Qwen3_5GatedDeltaNet (fp32, seeded) at a shape, with an input x and a
    gradient dy: (config, layer, x, dy)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    cfg = Qwen3_5TextConfig(hidden_size=E, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
                            linear_key_head_dim=K, linear_value_head_dim=V,
                            linear_conv_kernel_dim=4, num_hidden_layers=1,
                            layer_types=["linear_attention"], vocab_size=16)
    torch.manual_seed(0)
    layer = m.Qwen3_5GatedDeltaNet(cfg, 0).float()
    x = torch.randn(B, T, E, generator=torch.Generator().manual_seed(2)) * 0.5
    dy = torch.randn(B, T, E, generator=torch.Generator().manual_seed(3))
    return cfg, layer, x, dy


def run_conv(B=1, T=1024, E=2048, Hk=16, Hv=32, K=128, V=128, reps=5):
    """The patched GatedDeltaNet layer's forward + backward against its causal conv (conv1d +
    SiLU, transformers' CPU path) alone on the same [B, conv_dim, T] input: (layer s, conv s,
    shape)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    from gdncp import transformers as gtf
    cfg, layer, x, dy = _hf_gdn_layer(B, T, E, Hk, Hv, K, V)

    def layer_step():
        xx = x.detach().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        layer(xx).backward(dy)

    mixed = torch.randn(B, layer.conv_dim, T, generator=torch.Generator().manual_seed(4))
    dmix = torch.randn(B, layer.conv_dim, T, generator=torch.Generator().manual_seed(5))

    def conv_step():
        mm = mixed.detach().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        out = m.causal_conv1d_fn(mm, layer.conv1d.weight.squeeze(1), layer.conv1d.bias,
                                 activation=layer.activation)
        out.backward(dmix)

    def patched_layer_step():
        with gtf.patch():
            layer_step()

    # the whole layer in C (gdncp.Layer: projections, conv, rule, norm, output), same weights
    from gdncp.core import Layer
    weights = {n: p.detach().numpy() for n, p in layer.state_dict().items()}
    c_layer = Layer(E, Hk, Hv, K, V, weights, Kc=4, eps=cfg.rms_norm_eps,
                    threads=torch.get_num_threads())
    xa, dya = x.numpy(), dy.numpy()

    def c_layer_step():
        _, saved = c_layer.forward(xa, save=True)
        c_layer.backward(xa, dya, saved)

    t_layer, t_conv, t_c = _time_rounds((patched_layer_step, conv_step, c_layer_step), reps)
    shape = (f"Qwen3_5GatedDeltaNet E={E} Hk={Hk} Hv={Hv} K={K} V={V} conv_dim={layer.conv_dim} "
             f"Kc=4, B={B} T={T}")
    return t_layer, t_conv, t_c, shape


def run_bf16(B=1, T=1024, E=2048, Hk=16, Hv=32, K=128, V=128, reps=5):
    """The GatedDeltaNet layer forward + backward in BF16 against fp32, side by side on the same
    weights and inputs: transformers' layer with gdncp.transformers.patch() in fp32 and under
    torch.autocast("cpu", torch.bfloat16) (oneDNN's BF16 GEMMs; the rule itself is gdncp's), and
    gdncp.Layer in C with compute="fp32" and "bf16". Returns ([(name, seconds, rel err of y vs
    gdncp fp32) or (name, None, why)], the BF16 path, shape)."""
    from gdncp import transformers as gtf
    from gdncp.core import Layer
    from gdncp import _lib as L
    cfg, layer, x, dy = _hf_gdn_layer(B, T, E, Hk, Hv, K, V)
    weights = {n: p.detach().numpy() for n, p in layer.state_dict().items()}
    layers = {c: Layer(E, Hk, Hv, K, V, weights, Kc=4, eps=cfg.rms_norm_eps,
                       threads=torch.get_num_threads(), compute=c) for c in ("fp32", "bf16")}
    xa, dya = x.numpy(), dy.numpy()
    outs = {}

    def torch_step(autocast, name):
        def step():
            xx = x.detach().requires_grad_(True)
            layer.zero_grad(set_to_none=True)
            with gtf.patch(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                y = layer(xx)
            y.float().backward(dy)
            outs[name] = y.detach().float().numpy()
        return step

    def c_step(c):
        def step():
            y, saved = layers[c].forward(xa, save=True)
            layers[c].backward(xa, dya, saved)
            outs["gdncp C " + c] = y
        return step

    names = ["transformers patched fp32", "transformers patched autocast bf16", "gdncp C fp32",
             "gdncp C bf16"]
    fns = [torch_step(False, names[0]), torch_step(True, names[1]), c_step("fp32"), c_step("bf16")]
    ok = []
    for n, f in zip(names, fns):   # a path that cannot run here is reported, not timed
        try:
            f()
            ok.append((n, f))
        except Exception as e:  # noqa: BLE001 (reported in the table)
            outs[n] = f"not run: {type(e).__name__}: {str(e)[:120]}"
    times = _time_rounds([f for _, f in ok], reps)
    ref = outs["gdncp C fp32"]
    rows = []
    for n in names:
        if isinstance(outs.get(n), str):
            rows.append((n, None, outs[n]))
            continue
        t = times[[k for k, _ in ok].index(n)]
        err = float(np.abs(outs[n] - ref).max() / np.abs(ref).max())
        rows.append((n, t, err))
    path = L.gdn_compute_path(1).decode()
    shape = f"Qwen3_5GatedDeltaNet E={E} Hk={Hk} Hv={Hv} K={K} V={V}, B={B} T={T}"
    return rows, path, shape


# ----------------------------------------------------------------------------- projection GEMM

GEMM_SHAPES = (("in_proj_qkv", 8192, 2048), ("in_proj_z", 4096, 2048), ("out_proj", 2048, 4096))


def run_gemm(T=4096, reps=5, shapes=GEMM_SHAPES):
    """y = x W^T (x [T, K], W [N, K], fp32 in memory) per projection shape: torch fp32, torch
    bf16 with bf16 operands (oneDNN), torch autocast bf16 (fp32 operands converted per call) and
    gdncp fp32 / bf16 (gdn_bench_projection), sides alternating. Returns (rows of (shape name,
    M, N, K, [(side, median s, rel err vs float64)]), fp32 peak, bf16 peak, bf16 path name)."""
    from gdncp import _lib as L
    lib = L.lib
    lib.gdn_measure_peak_gflops.restype = ctypes.c_double
    lib.gdn_measure_peak_gflops.argtypes = [ctypes.c_int]
    lib.gdn_bench_projection.restype = None
    lib.gdn_bench_projection.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    threads = torch.get_num_threads()
    info = L.Bf16PathInfo()
    L.check(L.gdn_bench_bf16(0, 0, ctypes.byref(info)), "gdn_bench_bf16")
    path = info.path
    gen = torch.Generator().manual_seed(5)
    out = []
    for name, N, K in shapes:
        x = torch.randn(T, K, generator=gen)
        W = torch.randn(N, K, generator=gen) / K ** 0.5
        xb, Wb = x.bfloat16(), W.bfloat16()
        ys = {}
        yc = {c: np.empty((T, N), np.float32) for c in ("fp32", "bf16")}

        def c_side(p, c):
            def f():
                lib.gdn_bench_projection(p, T, N, K, x.data_ptr(), W.data_ptr(), yc[c].ctypes.data, threads)
                ys["gdncp " + c] = yc[c]
            return f

        def t_side(n, fn):
            def f():
                ys[n] = fn()
            return f

        def autocast():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return torch.nn.functional.linear(x, W)

        sides = [("torch fp32", t_side("torch fp32", lambda: x @ W.t())),
                 ("torch bf16 (bf16 operands)", t_side("torch bf16 (bf16 operands)", lambda: xb @ Wb.t())),
                 ("torch autocast bf16", t_side("torch autocast bf16", autocast)),
                 ("gdncp fp32", c_side(-1, "fp32")), ("gdncp bf16", c_side(path, "bf16"))]
        times = _time_rounds([f for _, f in sides], reps)
        ref = (x.double() @ W.double().t()).numpy()
        scale = np.abs(ref).max()
        res = []
        for (n, _), t in zip(sides, times):
            y = ys[n]
            y = y.float().numpy() if isinstance(y, torch.Tensor) else y
            res.append((n, t, float(np.abs(y - ref).max() / scale)))
        out.append((name, T, N, K, res))
    pk32 = lib.gdn_measure_peak_gflops(threads)
    L.check(L.gdn_bench_bf16(path, threads, ctypes.byref(info)), "gdn_bench_bf16")
    return (out, pk32, info.peak_gflops, info.name.decode())


# ----------------------------------------------------------------------------- attention core

def attention_flops(T, H, d, backward, B=1):
    """The causal count: QK^T and PV, 2d FLOPs per (query, key) pair each over the T^2/2 pairs a
    causal row sees, 2 T^2 d H per batch row forward; x3.5 forward + backward (the backward
    recomputes QK^T and runs dP, dV, dK, dQ: five such products)."""
    f = 2.0 * T * T * d * H * B
    return 3.5 * f if backward else f


class _SDPA:
    """gdn_sdpa_* over float32 token-major NumPy arrays, one plan, outputs made once."""

    def __init__(self, B, T, H, Hkv, d, threads, compute=0):
        from gdncp import _lib as L
        self.L = L
        cfg = L.gdn_attn_config_default(B, T, 0, H, Hkv, d)
        cfg.threads, cfg.compute = threads, compute
        self.h = ctypes.c_void_p()
        L.check(L.gdn_sdpa_plan_create(ctypes.byref(self.h), ctypes.byref(cfg)), "gdn_sdpa_plan_create")
        self.o = np.empty((B, T, H, d), np.float32)
        self.lse = np.empty((B, T, H), np.float32)
        self.dq = np.empty((B, T, H, d), np.float32)
        self.dk = np.empty((B, T, Hkv, d), np.float32)
        self.dv = np.empty((B, T, Hkv, d), np.float32)

    def path(self):
        return self.L.gdn_sdpa_plan_path(self.h).decode()

    def forward(self, q, k, v):
        L, p = self.L, self.L.f32p
        L.check(L.gdn_sdpa_forward(self.h, p(self.o), p(self.lse), p(q), p(k), p(v)), "gdn_sdpa_forward")

    def backward(self, q, k, v, dout):
        L, p = self.L, self.L.f32p
        L.check(L.gdn_sdpa_backward(self.h, p(self.dq), p(self.dk), p(self.dv), p(q), p(k), p(v),
                                    p(self.o), p(self.lse), p(dout)), "gdn_sdpa_backward")

    def __del__(self):
        if getattr(self, "h", None):
            self.L.gdn_sdpa_plan_destroy(self.h)


def run_attention(T=8192, H=16, Hkv=2, d=256, reps=3, B=1, causal_for_check=True):
    """torch SDPA against gdncp's core, forward and forward + backward in alternating rounds:
    (rows [(name, fwd s, fwd+bwd s)], errors {o, dq, dk, dv} of gdncp against torch, gdncp path).
    causal_for_check=False compares gdncp's causal result with torch's non-causal one (the
    negative control of the agreement)."""
    import torch.nn.functional as F
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, T, d, generator=gen)
    k = torch.randn(B, Hkv, T, d, generator=gen)
    v = torch.randn(B, Hkv, T, d, generator=gen)
    dout = torch.randn(B, H, T, d, generator=gen)
    # gdncp's token-major copies of the same values (made once, outside the timing)
    tm = [np.ascontiguousarray(x.transpose(1, 2).numpy()) for x in (q, k, v, dout)]
    core = _SDPA(B, T, H, Hkv, d, torch.get_num_threads())
    core16 = _SDPA(B, T, H, Hkv, d, torch.get_num_threads(), compute=1)  # its products in bf16
    got = {}

    def t_fwd():
        with torch.no_grad():
            got["o"] = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def t_fwd_bwd():
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        o.backward(dout)
        got["grads"] = (qq.grad, kk.grad, vv.grad)

    def a_fwd():   # torch under autocast: SDPA runs on bf16 copies of q, k, v (oneDNN / its flash kernel)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            got["o_bf16"] = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def a_fwd_bwd():
        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        o.backward(dout.to(o.dtype))

    def g_fwd():
        core.forward(*tm[:3])

    def g_fwd_bwd():
        core.forward(*tm[:3])
        core.backward(*tm)

    def h_fwd():
        core16.forward(*tm[:3])

    def h_fwd_bwd():
        core16.forward(*tm[:3])
        core16.backward(*tm)

    tf, ta, tg, th, tfb, tab, tgb, thb = _time_rounds(
        (t_fwd, a_fwd, g_fwd, h_fwd, t_fwd_bwd, a_fwd_bwd, g_fwd_bwd, h_fwd_bwd), reps)
    # agreement with torch (on the last calls' outputs; the control: torch without the mask)
    if not causal_for_check:
        with torch.no_grad():
            got["o"] = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=True)
    ref = {"o": got["o"]}
    ref["dq"], ref["dk"], ref["dv"] = got["grads"]
    ours = {"o": core.o, "dq": core.dq, "dk": core.dk, "dv": core.dv}
    err = {}
    for n, r in ref.items():
        r = r.detach().transpose(1, 2).double().numpy()
        err[n] = float(np.max(np.abs(ours[n] - r)) / np.max(np.abs(r)))
    # what bf16 costs in accuracy, on the same scale: autocast's o and gdncp bf16's o, dq, dk, dv
    # against torch's fp32 ones
    r = got["o"].double()
    err["o (torch autocast bf16 vs fp32)"] = float((got["o_bf16"].double() - r).abs().max() / r.abs().max())
    ours16 = {"o": core16.o, "dq": core16.dq, "dk": core16.dk, "dv": core16.dv}
    for n, r in ref.items():
        r = r.detach().transpose(1, 2).double().numpy()
        err[f"{n} (gdncp core bf16 vs torch fp32)"] = float(np.max(np.abs(ours16[n] - r)) / np.max(np.abs(r)))
    return ([("torch SDPA", tf, tfb), ("torch SDPA autocast bf16", ta, tab), ("gdncp core", tg, tgb),
             ("gdncp core bf16", th, thb)], err, core.path() + " | bf16: " + core16.path())


# ----------------------------------------------------------------------------- the MoE block

MOE_SHAPES = {  # E, experts, top_k, moe I, shared I
    "35b": (2048, 256, 8, 512, 512),     # Qwen3.5-35B-A3B / Qwen3.6-35B-A3B
    "next": (2048, 512, 10, 512, 512),   # Qwen3-Next-80B-A3B
}


def run_moe(T, reps, shape, quick=False):
    """transformers' Qwen3_5MoeSparseMoeBlock (its default grouped_mm experts and eager, fp32 and
    under bfloat16 autocast) against gdncp.torch.moe_block on the same weights and tokens, the sides
    alternated round by round: [(side, forward s, forward+backward s)], the errors of gdncp's y and
    dx against transformers' eager fp32, the shape's description."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
    from gdncp.torch import moe_block
    E, n, k, I, Is = (64, 16, 4, 32, 32) if quick else MOE_SHAPES[shape]
    cfg = Qwen3_5MoeTextConfig(hidden_size=E, num_experts=n, num_experts_per_tok=k, moe_intermediate_size=I,
                               shared_expert_intermediate_size=Is)
    gen = torch.Generator().manual_seed(5)
    cfg._experts_implementation = "grouped_mm"
    b = Qwen3_5MoeSparseMoeBlock(cfg)   # one block (GBs at the real shapes): its experts' implementation switched
    with torch.no_grad():   # normal(0, 0.02), the router spread (1 / sqrt(E))
        for name, p in b.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (E ** -0.5 if name == "gate.weight" else 0.02))
    x0 = torch.randn(1, T, E, generator=gen)
    dy = torch.randn(1, T, E, generator=gen)
    weights = lambda blk: (blk.gate.weight, blk.experts.gate_up_proj, blk.experts.down_proj,  # noqa: E731
                           blk.shared_expert.gate_proj.weight, blk.shared_expert.up_proj.weight,
                           blk.shared_expert.down_proj.weight, blk.shared_expert_gate.weight)
    out = {}

    def side(name, fn, backward, bf16=False):
        def call():
            x = x0.clone().requires_grad_(backward)
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
            with ctx, (contextlib.nullcontext() if backward else torch.no_grad()):
                y = fn(x)
            if backward:
                for p in b.parameters():
                    p.grad = None
                y.float().backward(dy)
            out[name] = (y.detach().float(), None if not backward else x.grad)
        return call

    def tfm(impl):
        def run(x):
            b.experts.config._experts_implementation = impl
            return b(x)
        return run
    ours = lambda compute: (lambda x: moe_block(x.reshape(-1, E), *weights(b), top_k=k,  # noqa: E731
                                                 compute=compute).reshape(1, T, E))
    sides = [("transformers grouped_mm", tfm("grouped_mm"), False), ("transformers eager", tfm("eager"), False),
             ("transformers autocast bf16", tfm("grouped_mm"), True), ("gdncp", ours("fp32"), False),
             ("gdncp bf16", ours("bf16"), False)]
    fns = []
    for name, fn, bf16 in sides:
        fns.append(side(name + " fwd", fn, False, bf16))
        fns.append(side(name + " fwd+bwd", fn, True, bf16))
    times = _time_rounds(fns, reps)
    rows = [(name, times[2 * i], times[2 * i + 1]) for i, (name, _, _) in enumerate(sides)]
    ref_y, ref_dx = out["transformers eager fwd+bwd"]
    err = {}
    for name in ("gdncp", "gdncp bf16", "transformers autocast bf16"):
        y, dx = out[name + " fwd+bwd"]
        err[name] = (float((y - ref_y).abs().max() / ref_y.abs().max()),
                     float((dx - ref_dx).abs().max() / ref_dx.abs().max()))
    desc = f"T={T} E={E} experts={n} top_k={k} I={I} shared={Is}" + (" (quick)" if quick else f" ({shape})")
    return rows, err, desc


def print_model_section(a, sides):
    """--what model: the rows as each side's process ends, then the table and the ratios."""
    B, T = a.model_B, a.model_T
    print(f"[model] training step (forward with labels, backward, AdamW), each side a process of its "
          f"own, {a.model_rounds} round(s) of a warm-up + {a.reps} steps, {a.threads or torch.get_num_threads()} "
          f"threads; running ({', '.join(sides)}):", flush=True)

    def report(side, r, why):
        got = (f"median {statistics.median(r['times']):.3f} s, loss {r['loss']:.4f}, peak {r['peak_mb'] / 1024:.2f} GiB"
               if r else why)
        print(f"  .. {side}: {got}", flush=True)
    rows, info = run_model(a.model_shape, B, T, a.reps, a.model_rounds, a.model_config, a.model_layers,
                           sides, a.threads or None, a.mem_gib, report=report)
    print(f"[model] {info['shape']}; {_where()}; measured peaks fp32 {info['peak32']:.0f} GFLOP/s, BF16 "
          f"{info['peak16']:.0f} GFLOP/s ({info['bf16_path']}; the larger of before the sides, "
          f"{info['peaks_before'][0]:.0f} / {info['peaks_before'][1]:.0f}, and after, {info['peaks_after'][0]:.0f} / "
          f"{info['peaks_after'][1]:.0f}; a BF16 side may pass the fp32 peak, but a side past 100 % of its own "
          f"precision's peak means other work ran on the cores while a peak was measured); {info['flops_per_token'] / 1e9:.2f} GFLOP a token (gdncp train's count); medians over "
          "every round's steps")
    for name, r, why in rows:
        if r is None:
            print(f"  {name:24s} not run: {why}")
            continue
        print(f"  {name:24s} step {r['step_s'] * 1e3:10.1f} ms {r['tok_s']:9.0f} tok/s {100 * r['frac32']:5.1f} % fp32 pk "
              f"{100 * r['frac16']:5.1f} % bf16 pk  peak RSS {r['peak_mb'] / 1024:6.2f} GiB  loss {r['loss']:.6f}")
    t = {n: r for n, r, _ in rows if r}
    lt = t.get("transformers", {}).get("loss")

    def ratio(x, y):
        return f"{t[x]['step_s'] / t[y]['step_s']:.3f}x" if x in t and y in t else "n/a"
    print(f"  speed-up (transformers / patched): {ratio('transformers', 'patched')}; (patched / gdncp.Model fp32): "
          f"{ratio('patched', 'gdncp.Model fp32')}; BF16 (patched autocast / gdncp.Model bf16): "
          f"{ratio('patched autocast bf16', 'gdncp.Model bf16')}")
    print(f"  gdncp.Model step / gdncp train step: fp32 {ratio('gdncp.Model fp32', 'gdncp train fp32')}, "
          f"bf16 {ratio('gdncp.Model bf16', 'gdncp train bf16')}")
    if lt:
        print("  first losses relative to transformers': " + ", ".join(
            f"{n} {abs(r['loss'] - lt) / abs(lt):.1e}" for n, r in t.items()
            if n != "transformers" and not n.startswith("gdncp train"))
            + " (gdncp train: other ids of the same vocabulary)")
    return rows, info


# ----------------------------------------------------------------------------- command line

SECTIONS = ("rule", "model", "overhead", "conv", "bf16", "gemm", "attention", "generate", "moe", "cp-train")
DEFAULT_SECTIONS = SECTIONS[:-2]   # moe (GBs of experts) and cp-train (minutes of MPI runs) when asked for


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python python/benchmarks/bench.py", description=__doc__.split("\n\n")[0])
    for name, default in (("B", 1), ("T", 1024), ("Hk", 16), ("Hv", 32), ("K", 128), ("V", 128),
                          ("reps", 5), ("layer-E", 2048),
                          ("attn-T", 8192), ("attn-H", 16), ("attn-Hkv", 2), ("attn-d", 256),
                          ("attn-reps", 3), ("gen-B", 1), ("gen-prompt", 64), ("gen-new", 128), ("gemm-T", 4096),
                          ("moe-T", 4096)):
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-backward", action="store_true", help="rule: forward only")
    ap.add_argument("--what", default=",".join(DEFAULT_SECTIONS),
                    help=f"comma-separated sections of {', '.join(SECTIONS)} (default: all but "
                         "cp-train)")
    ap.add_argument("--cp-models", default="tiny,small", help="cp-train: gdncp's named models")
    ap.add_argument("--cp-T", default="4096,16384", help="cp-train: sequence lengths")
    ap.add_argument("--cp-ranks", default="1,2,4", help="cp-train: rank counts of the patched model")
    ap.add_argument("--cp-sides", default="transformers,patched,patched gloo,gdncp C",
                    help="cp-train: which of transformers, patched, 'patched gloo', 'gdncp C' to run")
    ap.add_argument("--cp-max", action="store_true",
                    help="cp-train: also the longest T each side completes within --mem-gib")
    ap.add_argument("--mem-gib", type=float, default=20.0,
                    help="cp-train: a run past this resident memory (all its processes) is stopped")
    ap.add_argument("--model-config", default=None, help="model: a Qwen3.5 config.json (instead of --model-shape)")
    ap.add_argument("--model-shape", default="tiny", choices=sorted(MODEL_SHAPES),
                    help="model: tiny (the golden qwen35_tiny, B 8 T 512), 0.8b (Qwen3.5-0.8B's dimensions, "
                         "vocabulary 248320 tied, B 1 T 2048), 2b (hidden 2048, I 6144, the same heads)")
    ap.add_argument("--model-layers", type=int, default=None, help="model: layers of 0.8b / 2b (default 4: LLLF)")
    ap.add_argument("--model-B", type=int, default=None, help="model: rows (default: the shape's)")
    ap.add_argument("--model-T", type=int, default=None,
                    help="model: predicted positions a row (default: the shape's; T + 1 ids, as gdncp train --seq T)")
    ap.add_argument("--model-rounds", type=int, default=1,
                    help="model: rounds over the sides (each side a process a round; medians over all)")
    ap.add_argument("--model-sides", default=",".join(MODEL_SIDES),
                    help="model: comma-separated sides of: " + ", ".join(MODEL_SIDES))
    ap.add_argument("--model-worker", default=None, help=argparse.SUPPRESS)   # internal: one side
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-seed", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--moe-shape", default="35b", choices=sorted(MOE_SHAPES),
                    help="moe: the block's shape (35b: Qwen3.5-35B-A3B; next: Qwen3-Next-80B-A3B)")
    ap.add_argument("--quick", action="store_true",
                    help="toy sizes for every section (a smoke run, seconds)")
    a = ap.parse_args(argv)
    if a.model_worker:
        if a.threads:
            torch.set_num_threads(a.threads)
        return _model_worker(a.model_worker, a.model_dir, a.model_B, a.model_T, a.reps,
                             a.threads or torch.get_num_threads(), a.model_seed)
    what = [w.strip() for w in a.what.split(",") if w.strip()]
    for w in what:
        if w not in SECTIONS:
            ap.error(f"--what: unknown section {w!r} (sections: {', '.join(SECTIONS)})")
    if a.quick:
        a.T, a.Hk, a.Hv, a.K, a.V, a.reps = 80, 1, 2, 16, 16, 1
        a.model_B, a.model_T, a.layer_E = a.model_B or 2, a.model_T or 64, 32
        a.attn_T, a.attn_reps = 256, 1
        a.gen_prompt, a.gen_new = 8, 16
        a.gemm_T = 64
        a.moe_T = 128
        a.cp_models, a.cp_T, a.cp_ranks = "tiny", "64", "1,2"
    for name in ("B", "T", "Hk", "Hv", "K", "V", "reps", "model_B", "model_T", "model_layers", "model_rounds",
                 "layer_E", "attn_T", "attn_H", "attn_Hkv", "attn_d", "attn_reps", "gen_B", "gen_prompt", "gen_new",
                 "gemm_T", "moe_T"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    model_sides = [x.strip() for x in a.model_sides.split(",") if x.strip()]
    if not model_sides or any(x not in MODEL_SIDES for x in model_sides):
        ap.error(f"--model-sides: some of {', '.join(MODEL_SIDES)}")
    if a.Hv % a.Hk:
        ap.error(f"--Hv {a.Hv} must be a multiple of --Hk {a.Hk}")
    if a.attn_H % a.attn_Hkv:
        ap.error(f"--attn-H {a.attn_H} must be a multiple of --attn-Hkv {a.attn_Hkv}")
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"python/benchmarks/bench.py: {_where()}, medians of {a.reps} after a warm-up")
    shape = f"B={a.B} T={a.T} Hk={a.Hk} Hv={a.Hv} K={a.K} V={a.V}"
    if "moe" in what:
        rows, err, desc = run_moe(a.moe_T, a.reps, a.moe_shape, a.quick)
        print(f"[moe] the sparse MoE block, {desc}: transformers' Qwen3_5MoeSparseMoeBlock vs gdncp.torch.moe_block")
        for name, f, fb in rows:
            print(f"  {name:28s} forward {f * 1e3:9.1f} ms   forward+backward {fb * 1e3:9.1f} ms")
        t = {name: (f, fb) for name, f, fb in rows}
        best = min(("transformers grouped_mm", "transformers eager"), key=lambda n: t[n][1])
        print(f"  speed-up, fp32 (transformers' fastest, {best}, / gdncp): forward {t[best][0] / t['gdncp'][0]:.2f}x, "
              f"forward+backward {t[best][1] / t['gdncp'][1]:.2f}x; BF16 (autocast / gdncp bf16): forward "
              f"{t['transformers autocast bf16'][0] / t['gdncp bf16'][0]:.2f}x, forward+backward "
              f"{t['transformers autocast bf16'][1] / t['gdncp bf16'][1]:.2f}x")
        for name, (ey, edx) in err.items():
            print(f"  {name} vs transformers eager fp32: y {ey:.1e}, dx {edx:.1e}")
    if "rule" in what:
        rows, err = run(a.B, a.T, a.Hk, a.Hv, a.K, a.V, a.reps, not a.no_backward)
        print(f"[rule] {shape}")
        for name, f, fb in rows:
            print(f"  {name:12s} forward {f * 1e3:9.1f} ms"
                  + ("" if fb is None else f"   forward+backward {fb * 1e3:9.1f} ms"))
        (_, f0, fb0), (_, f1, fb1) = rows
        print(f"  speed-up (transformers / gdncp): forward {f0 / f1:.1f}x"
              + ("" if fb0 is None else f", forward+backward {fb0 / fb1:.1f}x"))
        print(f"  o: max|gdncp - transformers| / max|transformers| = {err:.1e}")
    if "model" in what:
        print_model_section(a, model_sides)
    if "overhead" in what:
        rows = run_overhead(a.B, a.T, a.Hk, a.Hv, a.K, a.V, a.reps)
        print(f"[overhead] forward + backward (checkpoints kept, no final state) {shape}")
        for name, t, best in rows:
            print(f"  {name:14s} median {t * 1e3:9.1f} ms   best {best * 1e3:9.1f} ms")
        for i, stat in ((1, "medians"), (2, "best")):
            c, cn = rows[2][i], rows[3][i]
            print(f"  {stat}: gdncp.torch / C {rows[0][i] / c:.3f}x "
                  f"({(rows[0][i] / c - 1) * 100:+.1f} %), NumPy / C {rows[1][i] / c:.3f}x "
                  f"({(rows[1][i] / c - 1) * 100:+.1f} %); against C with new outputs (fresh "
                  f"memory on both sides): gdncp.torch {(rows[0][i] / cn - 1) * 100:+.1f} %, "
                  f"NumPy {(rows[1][i] / cn - 1) * 100:+.1f} %")
    if "conv" in what:
        t_layer, t_conv, t_c, cshape = run_conv(a.B, a.T, a.layer_E, a.Hk, a.Hv, a.K, a.V,
                                                a.reps)
        print(f"[conv] forward+backward, {cshape}")
        print(f"  transformers' layer, patched   {t_layer * 1e3:9.1f} ms")
        print(f"  its causal conv1d+SiLU alone   {t_conv * 1e3:9.1f} ms   "
              f"= {t_conv / t_layer * 100:.1f} % of the patched layer (the most routing the conv "
              "through gdncp could save)")
        print(f"  gdncp.Layer (all of it in C)   {t_c * 1e3:9.1f} ms   "
              f"= {t_c / t_layer * 100:.1f} % of the patched layer")
    if "bf16" in what:
        rows, path, bshape = run_bf16(a.B, a.T, a.layer_E, a.Hk, a.Hv, a.K, a.V, a.reps)
        print(f"[bf16] forward+backward, {bshape}; gdncp's BF16 products on {path}")
        base = {n: t for n, t, _ in rows if t is not None}
        auto = base.get("transformers patched autocast bf16")
        for n, t, e in rows:
            if t is None:
                print(f"  {n:36s} {e}")
                continue
            vs = f"   {auto / t:.2f}x the autocast step" if auto and n.startswith("gdncp") else ""
            print(f"  {n:36s} {t * 1e3:9.1f} ms   y vs gdncp fp32 {e:.1e}{vs}")
        if "gdncp C fp32" in base and "gdncp C bf16" in base:
            print(f"  gdncp bf16 / fp32 speed-up: {base['gdncp C fp32'] / base['gdncp C bf16']:.2f}x")
    if "gemm" in what:
        shapes = GEMM_SHAPES if not a.quick else (("toy", 96, 80),)
        rows, pk32, pkbf, bpath = run_gemm(a.gemm_T, a.reps, shapes)
        print(f"[gemm] y = x W^T, x [T x K], W [N x K] fp32 in memory, {_where()}; measured peaks: "
              f"fp32 FMA {pk32:.0f} GFLOP/s, BF16 instruction {pkbf:.0f} GFLOP/s "
              f"({bpath}); GFLOP/s by 2 T N K")
        for name, M, N, K, res in rows:
            fl = 2.0 * M * N * K
            for side, t, e in res:
                g = fl / t / 1e9
                bf = f"{g / pkbf * 100:5.1f} % of bf16 pk" if pkbf > 0 and "fp32" not in side else " " * 17
                print(f"  {name:12s} {M}x{N}x{K}  {side:27s} {t * 1e3:9.1f} ms {g:8.1f} GFLOP/s "
                      f"{g / pk32 * 100:6.1f} % of fp32 pk  {bf}  err {e:.1e}")
            tt = {side: t for side, t, _ in res}
            print(f"  {name:12s} gdncp bf16 vs torch bf16 (bf16 operands): "
                  f"{tt['torch bf16 (bf16 operands)'] / tt['gdncp bf16']:.2f}x, vs torch autocast: "
                  f"{tt['torch autocast bf16'] / tt['gdncp bf16']:.2f}x; gdncp bf16 / fp32: "
                  f"{tt['gdncp fp32'] / tt['gdncp bf16']:.2f}x")
    if "attention" in what:
        T, H, Hkv, d = a.attn_T, a.attn_H, a.attn_Hkv, a.attn_d
        rows, err, path = run_attention(T, H, Hkv, d, a.attn_reps)
        print(f"[attention] causal SDPA, fp32 and bf16 (torch autocast, gdncp compute bf16), B=1 T={T} H={H} Hkv={Hkv} d={d}, {_where()}, "
              f"medians of {a.attn_reps} alternating rounds; GFLOP/s by 2 T^2 d H forward, "
              "x3.5 forward+backward")
        for name, f, fb in rows:
            print(f"  {name:24s} forward {f * 1e3:9.1f} ms {attention_flops(T, H, d, 0) / f / 1e9:7.1f} "
                  f"GFLOP/s   forward+backward {fb * 1e3:9.1f} ms "
                  f"{attention_flops(T, H, d, 1) / fb / 1e9:7.1f} GFLOP/s")
        (_, f0, fb0), (_, fa, fba), (_, f1, fb1), (_, f2, fb2) = rows
        print(f"  speed-up (torch SDPA / gdncp core): forward {f0 / f1:.2f}x, forward+backward "
              f"{fb0 / fb1:.2f}x; (torch autocast bf16 / gdncp core bf16): forward {fa / f2:.2f}x, "
              f"forward+backward {fba / fb2:.2f}x; gdncp path: {path}")
        print("  gdncp vs torch (max|diff| / max|torch|): "
              + ", ".join(f"{n} {e:.1e}" for n, e in err.items()))
    if "generate" in what:
        rows, same, gshape = run_generate(a.gen_B, a.gen_prompt, a.gen_new, a.reps, a.model_config)
        print(f"[generate] greedy, every cache: {gshape}")
        n = a.gen_B * a.gen_new
        for name, t in rows:
            print(f"  {name:12s} {t * 1e3:9.1f} ms   {n / t:9.0f} new tokens/s")
        (_, t0), (_, t1) = rows
        print(f"  speed-up (transformers / gdncp.Model): {t0 / t1:.1f}x; "
              f"ids {'equal' if same else 'DIFFER'}")
    if "cp-train" in what:
        import bench_cp_train as cpt
        try:
            models = [m for m in a.cp_models.split(",") if m]
            Ts = [int(t) for t in a.cp_T.split(",") if t]
            ranks = [int(d) for d in a.cp_ranks.split(",") if d]
        except ValueError:
            ap.error("--cp-T and --cp-ranks are comma-separated integers")
        if not models or not Ts or not ranks or min(Ts) < 1 or min(ranks) < 1:
            ap.error("--cp-models, --cp-T and --cp-ranks need at least one positive value each")
        sides = [x.strip() for x in a.cp_sides.split(",") if x.strip()]
        if not sides or any(x not in cpt.SIDES for x in sides):
            ap.error(f"--cp-sides: some of {', '.join(cpt.SIDES)}")
        report = cpt.Report(a.mem_gib)
        _, longest = cpt.run(models, Ts, ranks, reps=min(a.reps, 3), mem_gib=a.mem_gib,
                             cp_max=a.cp_max, threads=a.threads or None, sides=sides,
                             report=report)
        report.longest(longest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
