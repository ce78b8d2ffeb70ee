"""python/benchmarks/bench.py (the benchmarks, outside the package): every section runs (--quick: toy sizes) and prints its numbers; the
rule section's two sides agree (the comparison of test_torch.py, whose negative control covers
it), and the model section's sides (each a process of its own) give transformers' first loss,
while a deliberately wrong rule under the patch and other ids do not (the controls of that
check). The generate
section's greedy ids are transformers' (test_model.py holds that comparison's controls). The attention
section's gdncp core agrees with torch's scaled_dot_product_attention (o, dq, dk, dv), and not with
torch's unmasked attention (its control)."""
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench  # noqa: E402  (python/benchmarks/bench.py)
import gdncp.transformers as gtf


def test_bench_quick_runs_every_section(capsys):
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for needle in ("[rule]", "speed-up (transformers / gdncp)", "forward+backward", "[model]",
                   "speed-up (transformers / patched)", "gdncp.Model step / gdncp train step",
                   "% fp32 pk", "peak RSS", "first losses relative to transformers'",
                   "[overhead]",
                   "gdncp.torch / C ", "[conv]", "% of the patched layer", "threads", "CPU ",
                   "[bf16]", "gdncp bf16 / fp32 speed-up", "the autocast step",
                   "[attention]", "speed-up (torch SDPA / gdncp core)", "[generate]",
                   "speed-up (transformers / gdncp.Model)", "ids equal", "[gemm]",
                   "gdncp bf16 vs torch bf16"):
        assert needle in out, (needle, out)
    rows, err = bench.run(T=80, Hk=1, Hv=2, K=16, V=16, reps=1)
    assert err < 2e-5 and [r[0] for r in rows] == ["transformers", "gdncp"]


def test_bench_bf16_rows_within_bf16_accuracy():
    """Every BF16 row's y within BF16's accuracy of gdncp's fp32 (measured ~1e-2), the fp32 rows
    within fp32's; control: the BF16 rows are not the fp32 result (the bf16 products ran)."""
    rows, path, _ = bench.run_bf16(T=80, E=32, Hk=1, Hv=2, K=16, V=16, reps=1)
    errs = {n: e for n, t, e in rows if t is not None}
    assert set(errs) >= {"transformers patched fp32", "gdncp C fp32", "gdncp C bf16"}, rows
    assert errs["transformers patched fp32"] < 1e-5 and errs["gdncp C fp32"] == 0
    for n in ("gdncp C bf16", "transformers patched autocast bf16"):
        if n in errs:
            assert 1e-5 < errs[n] < 5e-2, (n, errs[n])
    assert "bf16" in path


def test_bench_gemm_rows_within_their_precision():
    """Every side of the GEMM section against the float64 product: fp32 sides within fp32's
    accumulation error, BF16 sides within BF16's (operands rounded: ~1e-2 relative to max|y|);
    control: the BF16 sides are off by more than the fp32 ones (their products did run in bf16)."""
    rows, pk32, pkbf, path = bench.run_gemm(T=40, reps=1, shapes=(("toy", 48, 200),))
    errs = {side: e for side, _, e in rows[0][4]}
    assert set(errs) == {"torch fp32", "torch bf16 (bf16 operands)", "torch autocast bf16",
                         "gdncp fp32", "gdncp bf16"}, errs
    for side in ("torch fp32", "gdncp fp32"):
        assert errs[side] < 1e-5, (side, errs)
    for side in ("torch bf16 (bf16 operands)", "torch autocast bf16", "gdncp bf16"):
        assert 1e-4 < errs[side] < 3e-2, (side, errs)
    assert pk32 > 0 and "bf16" in path


def test_bench_model_sides_run_in_their_own_processes_and_agree(monkeypatch, tmp_path):
    """--what model at the tiny shape: every side a process of its own (bench.py
    --model-worker SIDE; pids differ from this one's and from each other), each row with its
    step time, tokens/s, fractions of the measured peaks and peak memory; the first-step losses of
    the patched model and gdncp.Model fp32 equal transformers' within 1e-5, the BF16 sides' within
    BF16's accuracy and not fp32's (their bf16 products ran); `gdncp train` (when a gdncp command
    is found) runs the same checkpoint. Controls through the same 1e-5 check, run in this process
    on the same checkpoint: the patched side with the rule's g dropped, and gdncp.Model fp32 on
    other ids."""
    import os
    rows, info = bench.run_model("tiny", B=1, T=47, reps=1)
    got = {n: (r, why) for n, r, why in rows}
    assert list(got) == list(bench.MODEL_SIDES)
    pids = []
    for n, (r, why) in got.items():
        if n.startswith("gdncp train") and r is None:
            assert "no gdncp command" in why, why
            continue
        assert r is not None, (n, why)
        assert r["step_s"] > 0 and r["tok_s"] > 0 and 0 < r["frac32"] and 0 < r["frac16"], r
        assert r["peak_mb"] > 50, r
        pids += [p for p in r.get("pids", []) if p is not None]
    assert len(pids) == len(set(pids)) >= 5 and os.getpid() not in pids, pids
    assert info["B"] == 1 and info["T"] == 47 and info["flops_per_token"] > 0 and info["peak32"] > 0

    lt = got["transformers"][0]["loss"]

    def agrees(loss):   # the check of every fp32 side
        return abs(loss - lt) / abs(lt) < 1e-5
    assert agrees(got["patched"][0]["loss"]) and agrees(got["gdncp.Model fp32"][0]["loss"]), rows
    for n in ("patched autocast bf16", "gdncp.Model bf16"):
        rel = abs(got[n][0]["loss"] - lt) / abs(lt)
        assert 1e-7 < rel < 2e-2, (n, rows)
    d = str(tmp_path / "ckpt")
    bench.save_model_checkpoint(bench.model_shape_config("tiny"), d)
    assert agrees(bench.model_side("gdncp.Model fp32", d, 1, 47, 1, 1)["loss"])   # this process, same checkpoint
    assert not agrees(bench.model_side("gdncp.Model fp32", d, 1, 47, 1, 1, seed=4)["loss"])   # control: other ids
    real = gtf._RULES["chunk_gated_delta_rule"]
    monkeypatch.setitem(gtf._RULES, "chunk_gated_delta_rule",   # control: g dropped
                        lambda q, k, v, g=None, **kw: real(q, k, v, g=torch.zeros_like(g), **kw))
    assert not agrees(bench.model_side("patched", d, 1, 47, 1, 1)["loss"])


def test_bench_model_refuses_unknown_side(capsys):
    try:
        bench.main(["--what", "model", "--model-sides", "transformers,gpu"])
    except SystemExit as e:
        assert e.code == 2
    assert "--model-sides" in capsys.readouterr().err


def test_bench_refuses_unknown_section(capsys):
    try:
        bench.main(["--what", "rule,gpu"])
    except SystemExit as e:
        assert e.code == 2
    assert re.search(r"unknown section 'gpu'", capsys.readouterr().err)


def test_bench_attention_agrees_with_torch_sdpa_and_control_differs():
    rows, err, path = bench.run_attention(T=150, H=8, Hkv=2, d=32, reps=1)
    assert [r[0] for r in rows] == ["torch SDPA", "torch SDPA autocast bf16", "gdncp core", "gdncp core bf16"]
    assert "flash" in path and "products bf16" in path, path
    ac = err.pop("o (torch autocast bf16 vs fp32)")
    g16 = {n: err.pop(f"{n} (gdncp core bf16 vs torch fp32)") for n in ("o", "dq", "dk", "dv")}
    assert set(err) == {"o", "dq", "dk", "dv"} and max(err.values()) < 1e-5, err
    assert 1e-4 < ac < 5e-2, ac   # bf16 operands: visibly off fp32, within bf16's accuracy
    assert all(1e-4 < e < 5e-2 for e in g16.values()), g16   # gdncp's bf16 products: the same
    _, bad, _ = bench.run_attention(T=150, H=8, Hkv=2, d=32, reps=1, causal_for_check=False)
    assert bad["o"] > 1e-3, bad   # control: gdncp's causal o against torch's unmasked one


def test_bench_cp_train_quick_runs_every_side(capsys):
    """The cp-train section (its own MPI and torchrun runs): every side completes at a toy size
    and the first losses of transformers and the patched model over 1 and 2 ranks (mpi4py and
    gloo) agree (the same weights and tokens; test_cp_train.py and test_torch_cp_train.py hold
    that comparison's controls)."""
    import bench_cp_train as cpt
    rows, _ = cpt.run(("tiny",), (64,), (1, 2), reps=1, mem_gib=8)
    got = {(side, D): (r, why) for _, _, side, D, r, why in rows}
    ref = got[("transformers", 1)][0]
    assert ref is not None, got
    for D in (1, 2):
        for side in ("patched", "patched gloo"):   # mpi4py, and torchrun's gloo group
            r, why = got[(side, D)]
            assert r is not None, (side, why)
            assert abs(r["loss"] - ref["loss"]) / ref["loss"] < 1e-5, (side, D, r, ref)
    assert got[("patched gloo", 2)][0]["cp_bytes"] > 0
    report = cpt.Report(8)
    for row in rows:
        report.row(row)
    assert "tok/s" in capsys.readouterr().out



def test_bench_moe_quick_rows_and_errors(capsys, monkeypatch):
    """--what moe: every side's row and the speed-up line; gdncp's fp32 block agrees with
    transformers' eager one (y, dx within 2e-5), its BF16 block within BF16's reach of it and of
    transformers' own autocast error. Control: gdncp's block with the top-k weights not
    renormalised fails the same check."""
    assert bench.main(["--what", "moe", "--quick"]) == 0
    out = capsys.readouterr().out
    for needle in ("[moe]", "transformers grouped_mm", "transformers eager", "transformers autocast bf16",
                   "gdncp bf16", "speed-up, fp32", "gdncp vs transformers eager fp32"):
        assert needle in out, (needle, out)
    _, err, _ = bench.run_moe(128, 1, "35b", quick=True)
    assert max(err["gdncp"]) < 2e-5, err
    assert max(err["gdncp bf16"]) <= 2 * max(err["transformers autocast bf16"]) + 1e-2, err
    import gdncp.torch as gt
    real = gt.moe_block
    monkeypatch.setattr(gt, "moe_block", lambda *a, **k: real(*a, **{**k, "norm_topk_prob": False}))
    _, bad, _ = bench.run_moe(128, 1, "35b", quick=True)
    assert max(bad["gdncp"]) > 2e-5, bad
