"""Mixture-of-experts from Python: gdncp.torch.moe_block against transformers' exact block
(tests/data/qwen35_moe_tiny/moe.io), gdncp.transformers.patch() routing transformers' own
Qwen3.5-MoE model to it (loss and every gradient against the exact references, with and without
the aux loss), and gdncp.Model on the MoE checkpoint. Every comparison beside a deliberately wrong
variant run through the same check."""
import os

import numpy as np
import pytest
import torch

import gdncp
import gdncp.torch as gtorch
import gdncp.transformers as gt
from conftest import GOLDEN, rel_err, read_safetensors

MOE = os.path.join(GOLDEN, "qwen35_moe_tiny")
TOL_OUT, TOL_GRAD = 2e-5, 1e-4


def _layer0_weights():
    st = read_safetensors(os.path.join(MOE, "model.safetensors"))
    p = "model.layers.0.mlp."
    n = 8
    gu = np.stack([np.concatenate([st[f"{p}experts.{e}.gate_proj.weight"], st[f"{p}experts.{e}.up_proj.weight"]])
                   for e in range(n)])
    down = np.stack([st[f"{p}experts.{e}.down_proj.weight"] for e in range(n)])
    t = lambda a: torch.tensor(np.asarray(a, np.float32), requires_grad=True)
    return [t(st[p + "gate.weight"]), t(gu), t(down), t(st[p + "shared_expert.gate_proj.weight"]),
            t(st[p + "shared_expert.up_proj.weight"]), t(st[p + "shared_expert.down_proj.weight"]),
            t(st[p + "shared_expert_gate.weight"])]


def test_moe_block_matches_transformers_exact_block():
    """y, dx and every weight's gradient of loss = sum(y dy) against the float64 references of
    transformers' Qwen3_5MoeSparseMoeBlock (2e-5 / 1e-4). Control: the chosen experts' weights not
    renormalised (norm_topk_prob False) fails y and the router's gradient."""
    ref = read_safetensors(os.path.join(MOE, "moe.io.safetensors"))
    names = ["gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_expert.gate_proj.weight",
             "shared_expert.up_proj.weight", "shared_expert.down_proj.weight", "shared_expert_gate.weight"]
    errs = {}
    for norm in (True, False):
        w = _layer0_weights()
        x = torch.tensor(ref["x"].reshape(-1, 64).astype(np.float32), requires_grad=True)
        y = gtorch.moe_block(x, *w, top_k=2, norm_topk_prob=norm)
        (y * torch.tensor(ref["dy"].reshape(-1, 64))).sum().backward()
        errs[norm] = dict(y=rel_err(y, ref["y"].reshape(-1, 64)), dx=rel_err(x.grad, ref["dx"].reshape(-1, 64)),
                          **{n: rel_err(t.grad, ref["grad." + n]) for n, t in zip(names, w)})
    assert errs[True]["y"] < TOL_OUT and errs[True]["dx"] < TOL_GRAD, errs[True]
    assert max(errs[True][n] for n in names) < TOL_GRAD, errs[True]
    assert errs[False]["y"] > TOL_OUT and errs[False]["gate.weight"] > TOL_GRAD, errs[False]


def test_moe_block_refuses_bad_shapes():
    w = _layer0_weights()
    with pytest.raises(ValueError, match="shapes disagree"):
        gtorch.moe_block(torch.zeros(3, 32), *w)
    with pytest.raises(ValueError, match="shared expert needs all"):
        gtorch.moe_block(torch.zeros(3, 64), *w[:3], w[3], None, None, None)
    with pytest.raises(ValueError, match="top_k"):
        gtorch.moe_block(torch.zeros(3, 64), *w, top_k=9)
    x = torch.zeros(3, 64)
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match="x"):
        gtorch.moe_block(x, *w)


@pytest.mark.parametrize("aux", [False, True])
def test_patched_transformers_moe_model_exact(aux, monkeypatch):
    """transformers' own Qwen3_5MoeForCausalLM under gdncp.transformers.patch(): the loss (and with
    output_router_logits the CE + 0.01 aux) and every parameter's gradient against the exact
    references. Control: the same run with the block's top-k weights not renormalised fails."""
    from transformers import AutoModelForCausalLM
    ref = read_safetensors(os.path.join(MOE, "model_grads_aux.io.safetensors" if aux else "model_grads.io.safetensors"))
    ids = torch.tensor(ref["input_ids"])

    def run():
        m = AutoModelForCausalLM.from_pretrained(MOE, dtype=torch.float32)
        with gt.patch():
            out = m(ids, labels=ids, output_router_logits=aux)
            out.loss.backward()
        worst = max(rel_err(p.grad, ref["grad." + n]) for n, p in m.named_parameters())
        return abs(out.loss.item() - float(ref["loss"][0])) / float(ref["loss"][0]), worst

    loss_err, grad_err = run()
    assert loss_err < 1e-5 and grad_err < TOL_GRAD, (loss_err, grad_err)
    real = gtorch.moe_block
    monkeypatch.setattr(gtorch, "moe_block", lambda *a, **k: real(*a, **{**k, "norm_topk_prob": False}))
    loss_bad, grad_bad = run()
    assert grad_bad > TOL_GRAD, grad_bad


def test_model_from_pretrained_moe_loss_and_grads():
    """gdncp.Model on the Qwen3.5-MoE checkpoint: loss_and_grads equals the exact references
    (names and shapes as transformers' parameters, the experts fused); its config says MoE."""
    ref = read_safetensors(os.path.join(MOE, "model_grads.io.safetensors"))
    with gdncp.Model.from_pretrained(MOE, threads=1) as m:
        assert m.config.mlp_types == ("moe",) * 4 and m.config.num_experts == 8
        loss, grads = m.loss_and_grads(ref["input_ids"])
        assert abs(loss - float(ref["loss"][0])) / float(ref["loss"][0]) < 1e-5
        worst = max(rel_err(g, ref["grad." + n]) for n, g in grads.items())
        assert worst < TOL_GRAD, worst
        # control: another row's tokens give other gradients
        other = np.roll(ref["input_ids"], 1, axis=1)
        _, g2 = m.loss_and_grads(other)
        assert max(rel_err(g, ref["grad." + n]) for n, g in g2.items()) > TOL_GRAD


def test_patched_block_reads_its_weights_in_place_and_sees_updates():
    """Under the patch a block's parameters move into the op's flat layout once (the same
    Parameter objects, their data views of it) and are read there without a copy; an in-place
    update of a parameter (an optimizer's step) is what the next call computes with: the patched
    loss equals transformers' own on the updated weights (1e-5). Control: the update changed the
    loss."""
    from transformers import AutoModelForCausalLM
    ref = read_safetensors(os.path.join(MOE, "model_grads.io.safetensors"))
    ids = torch.tensor(ref["input_ids"])
    m = AutoModelForCausalLM.from_pretrained(MOE, dtype=torch.float32)
    mlp = m.model.layers[0].mlp
    params_before = [id(p) for p in m.parameters()]
    with torch.no_grad(), gt.patch():
        before = m(ids, labels=ids).loss.item()
    flat = gtorch._MOE_ADOPTED[id(mlp.gate.weight)][1]
    lo, hi = flat.data_ptr(), flat.data_ptr() + 4 * flat.numel()
    assert lo <= mlp.experts.gate_up_proj.data_ptr() < hi and lo <= mlp.shared_expert_gate.weight.data_ptr() < hi
    assert [id(p) for p in m.parameters()] == params_before
    with torch.no_grad():
        mlp.experts.gate_up_proj.mul_(3.0)
        mlp.gate.weight.add_(0.05)
        with gt.patch():
            after = m(ids, labels=ids).loss.item()
        theirs = m(ids, labels=ids).loss.item()
    assert abs(after - theirs) / theirs < 1e-5, (after, theirs)
    assert abs(after - before) / before > 1e-5, (after, before)


def test_norm_topk_prob_false_is_computed_as_transformers_does(tmp_path, monkeypatch):
    """A Qwen3.5-MoE config saying norm_topk_prob false: transformers' router never reads the field
    and renormalises the top-k weights; gdncp computes the same (warning that the field is
    ignored) and equals transformers' logits on that checkpoint. Control through the same check:
    transformers' router made to honour the false (no renormalisation), what gdncp once did."""
    import json
    import shutil
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mq
    d = tmp_path / "moe_no_renorm"
    shutil.copytree(MOE, d)
    cfg = json.loads((d / "config.json").read_text())
    (cfg.get("text_config") or cfg)["norm_topk_prob"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    ids = np.random.default_rng(3).integers(0, 200, size=(1, 24))
    with pytest.warns(UserWarning, match="norm_topk_prob' false is ignored"):
        m = gdncp.Model.from_pretrained(d, threads=1)
    with m:
        got = m.logits(ids)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    assert rel_err(got, ref) < TOL_OUT

    def no_renorm(self, hidden_states):
        h = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h, self.weight)
        top, idx = torch.topk(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k, dim=-1)
        return logits, top.to(logits.dtype), idx
    monkeypatch.setattr(mq.Qwen3_5MoeTopKRouter, "forward", no_renorm)
    with torch.no_grad():
        bad = hf(torch.tensor(ids)).logits.numpy()
    assert rel_err(got, bad) > 10 * TOL_OUT, rel_err(got, bad)
