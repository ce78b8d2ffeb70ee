"""gdncp.torch against PyTorch autograd: gradcheck through the float64 oracle, and the fp32 kernel
against transformers' own torch_chunk_gated_delta_rule (its fallback), forward and backward.
Tolerance vs transformers: 2e-5 relative (max-abs error / max-abs reference) for o, final state
and every gradient: both sides are fp32 chunked algorithms with different summation orders.
Every comparison is repeated with a deliberately wrong variant that must fail it."""
import numpy as np
import pytest
import torch

import gdncp.torch as gt
from conftest import problem, rel_err

TF_TOL = 2e-5


def _tensors(arrays, dtype=torch.float32, grad=True):
    return [torch.tensor(a, dtype=dtype, requires_grad=grad) for a in arrays]


def _hf_rule():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    return m.torch_chunk_gated_delta_rule


def test_gradcheck_float64_oracle_and_wrong_backward_fails(rng):
    q, k, v, g, beta, h0 = _tensors(problem(rng, B=1, T=7, Hk=1, Hv=2, K=3, V=2),
                                    dtype=torch.float64)

    def f(q, k, v, g, beta, h0):
        return gt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)

    assert torch.autograd.gradcheck(f, (q, k, v, g, beta, h0), eps=1e-6, atol=1e-7, rtol=1e-5)

    class WrongBackward(gt._ChunkRule):   # control: dg dropped from the backward
        @staticmethod
        def backward(ctx, do, dht):
            grads = list(gt._ChunkRule.backward(ctx, do, dht))
            grads[3] = torch.zeros_like(grads[3])
            return tuple(grads)

    def f_bad(q, k, v, g, beta, h0):
        return WrongBackward.apply(q, k, v, g, beta, h0, None, True, True, None, True)

    assert not torch.autograd.gradcheck(f_bad, (q, k, v, g, beta, h0), eps=1e-6, atol=1e-7,
                                        rtol=1e-5, raise_exception=False)


def _compare_with_transformers(q, k, v, g, beta, h0, l2norm):
    """o, ht and the gradients of a fixed random loss from gdncp and from transformers' rule."""
    w_o = torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
    w_h = torch.randn(h0.shape, generator=torch.Generator().manual_seed(2))
    out = {}
    for name, rule in (("gdncp", gt.chunk_gated_delta_rule), ("hf", _hf_rule())):
        xs = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
        o, ht = rule(xs[0], xs[1], xs[2], g=xs[3], beta=xs[4], initial_state=xs[5],
                     output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        ((o * w_o).sum() + (ht * w_h).sum()).backward()
        out[name] = [o, ht] + [x.grad for x in xs]
    return out


def test_fp32_forward_backward_match_transformers_and_wrong_head_mapping_fails(rng):
    # transformers repeats the key heads to Hv before calling the rule (repeat_interleave):
    # give both sides Hk = Hv
    arrays = problem(rng, B=2, T=150, Hk=4, Hv=4, K=16, V=24)
    q, k, v, g, beta, h0 = _tensors(arrays)
    out = _compare_with_transformers(q, k, v, g, beta, h0, True)
    names = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")
    errs = {n: rel_err(a.detach(), b.detach()) for n, a, b in zip(names, out["gdncp"], out["hf"])}
    assert max(errs.values()) < TF_TOL, errs
    # control: the key heads rolled by one (a wrong head mapping) fails the same comparison
    roll = lambda x: torch.roll(x, 1, dims=2)
    o_bad, _ = gt.chunk_gated_delta_rule(roll(q), roll(k), v, g, beta, initial_state=h0,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_err(o_bad.detach(), out["hf"][0].detach()) > 100 * TF_TOL


def test_grouped_heads_equal_repeat_interleave(rng):
    q, k, v, g, beta, h0 = _tensors(problem(rng, B=1, T=70, Hk=2, Hv=6, K=8, V=8), grad=False)
    o, ht = gt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True)
    r = 3
    o2, ht2 = gt.chunk_gated_delta_rule(q.repeat_interleave(r, 2), k.repeat_interleave(r, 2), v,
                                        g, beta, initial_state=h0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    assert rel_err(o, o2) < 1e-6 and rel_err(ht, ht2) < 1e-6
    o3, _ = gt.chunk_gated_delta_rule(q.repeat(1, 1, r, 1), k.repeat(1, 1, r, 1), v, g, beta,
                                      initial_state=h0, use_qk_l2norm_in_kernel=True)
    assert rel_err(o3, o2) > 1e-3   # control: j % Hk is not the mapping


def test_noncontiguous_and_bf16_inputs(rng):
    q, k, v, g, beta, h0 = _tensors(problem(rng, B=2, T=40, Hk=2, Hv=2, K=8, V=8), grad=False)
    o, _ = gt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0)
    # the same values in [B,H,T,D] storage, viewed as [B,T,H,D] (what transformers' transposes give)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    vt = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert not qt.is_contiguous()
    o_nc, _ = gt.chunk_gated_delta_rule(qt, k, vt, g, beta, initial_state=h0)
    assert torch.equal(o, o_nc)
    # bf16 in, bf16 out; gradients come back in the inputs' dtypes
    qb, kb, vb = (x.to(torch.bfloat16).requires_grad_(True) for x in (q, k, v))
    ob, _ = gt.chunk_gated_delta_rule(qb, kb, vb, g, beta, use_qk_l2norm_in_kernel=True)
    assert ob.dtype == torch.bfloat16
    ob.float().sum().backward()
    assert qb.grad.dtype == torch.bfloat16 and vb.grad.dtype == torch.bfloat16
    o32, _ = gt.chunk_gated_delta_rule(qb.detach().float(), kb.detach().float(),
                                       vb.detach().float(), g, beta, use_qk_l2norm_in_kernel=True)
    assert rel_err(ob.float(), o32) < 1e-2   # bf16 output rounding


def test_cu_seqlens_equal_documents_alone_and_without_offsets_differs(rng):
    cu = torch.tensor([0, 30, 64, 65, 100])
    q, k, v, g, beta, h0 = _tensors(problem(rng, B=1, T=100, Hk=2, Hv=2, K=8, V=8, n_states=4))
    w = torch.randn(v.shape)
    o, ht = gt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ((o * w).sum() + ht.sum()).backward()
    for d in range(4):
        s = slice(int(cu[d]), int(cu[d + 1]))
        xs = [x.detach()[:, s].clone().requires_grad_(True) for x in (q, k, v, g, beta)]
        h = h0.detach()[d:d + 1].clone().requires_grad_(True)
        o_d, ht_d = gt.chunk_gated_delta_rule(*xs, initial_state=h, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
        ((o_d * w[:, s]).sum() + ht_d.sum()).backward()
        assert rel_err(o[:, s].detach(), o_d.detach()) < 1e-5
        assert rel_err(ht[d:d + 1].detach(), ht_d.detach()) < 1e-5
        for full, part in zip((q, k, v, g, beta), xs):
            assert rel_err(full.grad[:, s], part.grad) < 1e-4
        assert rel_err(h0.grad[d:d + 1], h.grad) < 1e-4
    o_dense, _ = gt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0[:1],
                                           use_qk_l2norm_in_kernel=True)   # control
    assert rel_err(o_dense.detach(), o.detach()) > 1e-3


def test_fused_recurrent_decode_equals_chunk_and_dropped_state_fails(rng):
    q, k, v, g, beta, h0 = _tensors(problem(rng, B=2, T=12, Hk=2, Hv=4, K=8, V=8), grad=False)
    o_all, ht_all = gt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    state, outs = h0, []
    for t in range(12):
        o_t, state = gt.fused_recurrent_gated_delta_rule(
            q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], g=g[:, t:t + 1], beta=beta[:, t:t + 1],
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o_t)
    assert rel_err(torch.cat(outs, 1), o_all) < 1e-5 and rel_err(state, ht_all) < 1e-5
    # several tokens at once: the chunked forward
    o_many, ht_many = gt.fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    assert rel_err(o_many, o_all) < 1e-6
    o_last, _ = gt.fused_recurrent_gated_delta_rule(   # control: no state before the last token
        q[:, 11:], k[:, 11:], v[:, 11:], g=g[:, 11:], beta=beta[:, 11:],
        use_qk_l2norm_in_kernel=True)
    assert rel_err(o_last, o_all[:, 11:]) > 1e-3
    with pytest.raises(NotImplementedError, match="per-key"):
        gt.fused_recurrent_gated_delta_rule(q, k, v, gk=torch.zeros(q.shape))


@pytest.mark.parametrize("case, exc, words", [
    ("device", ValueError, "is on meta"),
    ("dtype", TypeError, "has dtype torch.int64"),
    ("ndim", ValueError, "must be [B,T,H,D]"),
    ("shape", ValueError, "beta has shape"),
    ("states", ValueError, "initial_state holds 2 states"),
    ("head_first", ValueError, "head_first"),
])
def test_bad_inputs(rng, case, exc, words):
    q, k, v, g, beta, h0 = _tensors(problem(rng, B=2, T=10, Hk=2, Hv=2, K=4, V=4), grad=False)
    kw = {}
    if case == "device": q = torch.empty(q.shape, device="meta")
    if case == "dtype": k = k.long()
    if case == "ndim": v = v[0]
    if case == "shape": beta = beta[:, :5]
    if case == "states": q, k, v, g, beta = (x[:1] for x in (q, k, v, g, beta)); kw["cu_seqlens"] = torch.tensor([0, 3, 6, 10])
    if case == "head_first": kw["head_first"] = True
    with pytest.raises(exc) as info:
        gt.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, **kw)
    assert words in str(info.value), str(info.value)


def test_double_backward_refused_single_backward_runs(rng):
    """create_graph=True (a gradient penalty, a Hessian-vector product) needs gradients that are
    themselves differentiable; gdncp's come from the C library, so every autograd Function raises
    instead of returning detached ones (before, torch.autograd.grad(..., create_graph=True) gave
    gradients without a graph and a second backward silently lost gdncp's part). The control: the
    same calls with create_graph=False give the gradients."""
    q, k, v, g, beta, h0 = _tensors(problem(rng, B=1, T=9, Hk=1, Hv=2, K=4, V=3))
    gen = torch.Generator().manual_seed(3)
    E, n, I = 8, 4, 6
    x = torch.randn(5, E, generator=gen, requires_grad=True)
    w = [torch.randn(s, generator=gen, requires_grad=True) * 0.3 for s in ((n, E), (n, 2 * I, E), (n, E, I))]
    w = [t.detach().requires_grad_(True) for t in w]
    calls = {
        "gdncp.torch.chunk_gated_delta_rule": (lambda: gt.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True)[0], (q, k, v, g, beta, h0)),
        "gdncp.torch.moe_block": (lambda: gt.moe_block(x, *w, top_k=2), (x, *w)),
    }
    for what, (call, inputs) in calls.items():
        loss = (call() ** 2).sum()
        with pytest.raises(RuntimeError, match=f"{what}: double backward is not supported"):
            torch.autograd.grad(loss, inputs, create_graph=True)
        grads = torch.autograd.grad((call() ** 2).sum(), inputs)       # control: one backward
        assert all(gr is not None and torch.isfinite(gr).all() and gr.abs().sum() > 0 for gr in grads), what
