"""python -m gdncp.bench: every section runs (--quick: toy sizes) and prints its numbers; the
rule section's two sides agree (the comparison of test_torch.py, whose negative control covers
it), and the model section's patched and unpatched first steps give the same loss, while a
deliberately wrong rule under the patch does not (the control of that check). The generate
section's greedy ids are transformers' (test_model.py holds that comparison's controls). The attention
section's gdncp core agrees with torch's scaled_dot_product_attention (o, dq, dk, dv), and not with
torch's unmasked attention (its control)."""
import re

import torch

from gdncp import bench
import gdncp.transformers as gtf


def test_bench_quick_runs_every_section(capsys):
    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for needle in ("[rule]", "speed-up (transformers / gdncp)", "forward+backward", "[model]",
                   "speed-up (transformers / gdncp.transformers.patch())",
                   "speed-up (patched transformers / gdncp C model)", "BF16: patched transformers under",
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


def test_bench_model_losses_agree_and_wrong_rule_differs(monkeypatch):
    _, losses, _ = bench.run_model(B=1, T=48, reps=1)
    rel = abs(losses["gdncp"] - losses["transformers"]) / abs(losses["transformers"])
    assert rel < 1e-5, losses
    rel_c = abs(losses["gdncp C model"] - losses["transformers"]) / abs(losses["transformers"])
    assert rel_c < 1e-5, losses
    for n in ("gdncp autocast bf16", "gdncp C model bf16"):   # BF16's accuracy, and not fp32's
        rel_b = abs(losses[n] - losses["transformers"]) / abs(losses["transformers"])
        assert 1e-7 < rel_b < 2e-2, (n, losses)
    real = gtf._RULES["chunk_gated_delta_rule"]
    monkeypatch.setitem(gtf._RULES, "chunk_gated_delta_rule",   # control: g dropped
                        lambda q, k, v, g=None, **kw: real(q, k, v, g=torch.zeros_like(g), **kw))
    _, bad, _ = bench.run_model(B=1, T=48, reps=1, c_model=False, bf16=False)
    assert abs(bad["gdncp"] - bad["transformers"]) / abs(bad["transformers"]) > 1e-4, bad


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
    """The cp-train section (its own MPI runs): every side completes at a toy size and the first
    losses of transformers and the patched model over 1 and 2 ranks agree (the same weights and
    tokens; test_cp_train.py holds that comparison's controls)."""
    from gdncp import bench_cp_train as cpt
    rows, _ = cpt.run(("tiny",), (64,), (1, 2), reps=1, mem_gib=8)
    got = {(side, D): (r, why) for _, _, side, D, r, why in rows}
    ref = got[("transformers", 1)][0]
    assert ref is not None, got
    for D in (1, 2):
        r, why = got[("patched", D)]
        assert r is not None, why
        assert abs(r["loss"] - ref["loss"]) / ref["loss"] < 1e-5, (D, r, ref)
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
