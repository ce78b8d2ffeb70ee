"""transformers' Qwen3_5ForCausalLM (the golden tiny checkpoint) with and without
gdncp.transformers.patch(): logits, loss and every parameter gradient agree within 1e-4 relative
(max-abs error / max-abs reference, per tensor), greedy generation with the cache gives the same
tokens. The patched rule is counted (it must run), and a deliberately wrong rule put in its place
must fail the same comparison."""
import os

import numpy as np
import pytest
import torch

import gdncp.torch as gt
import gdncp.transformers as gtf
from conftest import TINY, read_safetensors, rel_err

TOL = 1e-4


def _model():
    from transformers import Qwen3_5ForCausalLM
    m = Qwen3_5ForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    m.eval()
    return m


def _ids():
    return torch.tensor(read_safetensors(os.path.join(TINY, "logits.io.safetensors"))["input_ids"]
                        ).long().reshape(1, -1)


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach().clone(), out.loss.detach().clone(), grads


def _tol(name):
    # dA_log and ddt_bias sum dg * (...) over the tokens, and those terms cancel to ~1e-2 of
    # their size: each side's fp32 rounding shows 100x larger there (the C tests' 1e-3 too)
    return 1e-3 if name.endswith(("A_log", "dt_bias")) else TOL


def _errors(a, b):
    errs = {"logits": rel_err(a[0], b[0]), "loss": rel_err(a[1], b[1])}
    errs.update({n: rel_err(a[2][n], b[2][n]) for n in a[2]})
    return errs


@pytest.fixture(scope="module")
def model():
    return _model()


def test_patched_model_matches_unpatched_and_wrong_rule_fails(model, monkeypatch):
    ids = _ids()
    ref = _run(model, ids)
    golden = read_safetensors(os.path.join(TINY, "logits.io.safetensors"))["logits"]
    assert rel_err(ref[0].numpy().reshape(golden.shape), golden) < TOL  # the file's own model
    calls = []
    real = gt.chunk_gated_delta_rule

    def counted(*a, **kw):
        calls.append(a[0].shape)
        return real(*a, **kw)

    monkeypatch.setitem(gtf._RULES, "chunk_gated_delta_rule", counted)
    with gtf.patch():
        got = _run(model, ids)
    assert len(calls) == 3, calls   # three GatedDeltaNet layers ran gdncp's rule
    errs = _errors(got, ref)
    print("relative errors, patched vs transformers' own rule:",
          {n: f"{e:.1e}" for n, e in errs.items()})
    for name, e in errs.items():
        assert e < _tol(name), (name, e)
    # after the block, transformers' own rule again: no more calls
    _run(model, ids)
    assert len(calls) == 3 and not gtf.is_patched()

    def wrong(q, k, v, **kw):   # control: value heads paired with the wrong key heads
        return real(torch.roll(q, 1, dims=2), torch.roll(k, 1, dims=2), v, **kw)

    monkeypatch.setitem(gtf._RULES, "chunk_gated_delta_rule", wrong)
    with gtf.patch():
        bad = _run(model, ids)
    errs_bad = _errors(bad, ref)
    assert errs_bad["logits"] > 100 * TOL and errs_bad["loss"] > TOL, errs_bad


def test_patch_nests_and_undoes_exactly():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    before = m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule
    p1 = gtf.patch()
    p2 = gtf.patch()
    try:
        assert m.torch_chunk_gated_delta_rule is gtf.chunk_rule
        assert m.torch_recurrent_gated_delta_rule is gtf.recurrent_rule
        p2.undo()
        assert gtf.is_patched() and m.torch_chunk_gated_delta_rule is gtf.chunk_rule
    finally:
        p2.undo()
        p1.undo()
    assert not gtf.is_patched()
    assert (m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule) == before


def test_generation_with_cache_same_tokens(model):
    ids = _ids()[:, :40]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True)
        with gtf.patch():
            got = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True)
    assert torch.equal(ref, got), (ref[0, 40:].tolist(), got[0, 40:].tolist())
    # and the cached decode's logits agree with the full forward's
    with torch.no_grad(), gtf.patch():
        full = model(input_ids=got, use_cache=False).logits[0, 40:-1]
        out = model(input_ids=ids, use_cache=True)
        cache, steps = out.past_key_values, [out.logits[0, -1]]
        for t in range(40, got.shape[1] - 1):
            o = model(input_ids=got[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            steps.append(o.logits[0, -1])
    # steps[0] is the prompt's last position (39); steps[1:] are positions 40.. like full
    assert rel_err(torch.stack(steps[1:]), full) < TOL
