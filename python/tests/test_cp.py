"""gdncp.cp (context parallelism over mpi4py) against one rank running the whole sequence.

Run under MPI, never in the plain pytest run (conftest.py leaves this file out unless
GDNCP_MPI_TESTS=1):  GDNCP_MPI_TESTS=1 mpiexec.mpich -n 3 python -m pytest python/tests/test_cp.py

Every rank builds the same random problem, runs gdncp.torch on the whole sequence (the
reference) and gdncp.cp on its own token slice, and compares its slice of o and of every
gradient, the final state, and the sum over the ranks of initial_state.grad (DESIGN §4's
exactness: 2e-5 relative, max-abs error / max-abs reference). The ranks exchange their errors
before asserting, so every rank passes or fails each test alike (a rank that failed alone would
leave the others waiting in the next test's collectives). Each comparison also runs a deliberate
mistake through the same check, which must fail it: one rank's shard shifted by a token (any
strategy), and for scan/allgather/relay the library's fault hook that drops the state entering a
rank (GDNCP_MUTATE, the real code path with zeros in place of the received state).
"""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import gdncp
import gdncp.cp as gcp
import gdncp.torch as gt
from gdncp import _lib as L
from gdncp import core

from conftest import mutate as _mutate

TOL = 2e-5
COMM = MPI.COMM_WORLD
R, D = COMM.Get_rank(), COMM.Get_size()
assert D >= 2, "test_cp.py runs under mpiexec with 2 or more ranks (scripts/test_python.sh: 3)"
torch.set_num_threads(1)   # 3 ranks share 2 cores
Hk = D                      # heads needs the ranks to divide Hk


def _cuts(T):
    """Uneven shards: rank 0 a long one, rank 1 a single token, the rest share what is left."""
    cuts = [0, 37, 38]
    rest = D - 2
    for i in range(1, rest + 1):
        cuts.append(38 + (T - 38) * i // rest)
    return cuts[:D + 1] if D > 2 else [0, 37, T]


def _problem(seed, B=2, T=90, Hv=None, K=16, V=12, n_states=None):
    rng = np.random.default_rng(seed)
    Hv = Hv or 2 * Hk
    t = lambda a: torch.tensor(a, dtype=torch.float32)
    q, k = t(rng.standard_normal((B, T, Hk, K))), t(rng.standard_normal((B, T, Hk, K)))
    v = t(rng.standard_normal((B, T, Hv, V)))
    g = t(rng.uniform(-0.5, -1e-3, (B, T, Hv)))
    beta = t(rng.uniform(0.05, 0.95, (B, T, Hv)))
    h0 = t(rng.standard_normal((n_states or B, Hv, K, V)) * 0.5)
    w_o = t(rng.standard_normal(v.shape))
    w_h = [t(rng.standard_normal(h0.shape)) for _ in range(D)]  # each rank's loss weights ht
    return (q, k, v, g, beta, h0), w_o, w_h


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    s = b.abs().max().item()
    return (a - b).abs().max().item() / (s if s > 0 else 1.0)


def _reference(xs, w_o, w_h, cu=None):
    """One rank, the whole sequence (gdncp.torch): o, ht and the gradients of
    sum(o * w_o) + sum(ht * sum_r w_h[r]) -- the CP loss summed over the ranks."""
    leaves = [x.clone().requires_grad_(True) for x in xs]
    o, ht = gt.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                      output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=cu)
    ((o * w_o).sum() + (ht * sum(w_h)).sum()).backward()
    return [o.detach(), ht.detach()] + [x.grad for x in leaves]


def _cp_run(xs, w_o, w_h, cuts, strategy, cu=None, shift=False, fault=0):
    """This rank's slice through gdncp.cp: its o, ht and gradients, and dh0 summed over the
    ranks. shift: rank 1 takes its tokens one later (a control); fault: a site of _CP_SITES (GDNCP_MUTATE)."""
    a, b = cuts[R], cuts[R + 1]
    if shift and R == 1:
        a, b = a + 1, b + 1
    leaves = [x[:, a:b].clone().requires_grad_(True) for x in xs[:5]]
    h0 = xs[5].clone().requires_grad_(True)
    if fault:
        _mutate(fault)
    try:
        o, ht = gcp.chunk_gated_delta_rule(*leaves, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                           comm=COMM, strategy=strategy)
        ((o * w_o[:, cuts[R]:cuts[R + 1]]).sum() + (ht * w_h[R]).sum()).backward()
    finally:
        if fault:
            _mutate(0)
    dh0 = h0.grad.clone()
    COMM.Allreduce(MPI.IN_PLACE, dh0.numpy(), op=MPI.SUM)
    return [o.detach(), ht.detach()] + [x.grad for x in leaves] + [dh0]


NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0 (summed over ranks)")


def _errors(got, ref, cuts):
    """Every rank's errors, gathered: {name: max over the ranks}."""
    a, b = cuts[R], cuts[R + 1]
    mine = {}
    for i, (n, x, y) in enumerate(zip(NAMES, got, ref)):
        if i in (0, 2, 3, 4, 5, 6):       # per-token tensors: this rank's slice
            y = y[:, a:b]
            if x.shape != y.shape:        # the shifted control may run past the end
                mine[n] = float("inf")
                continue
        mine[n] = _rel(x, y)
    table = COMM.allgather(mine)
    return {n: max(t[n] for t in table) for n in NAMES}


def _passes(errs):
    return max(errs.values()) < TOL


@pytest.mark.parametrize("strategy", ["scan", "allgather", "relay", "heads"])
def test_dense_uneven_shards_with_states_match_one_rank(strategy):
    T = 90
    full, w_o, w_h = _problem(1, T=T + 1)   # one spare token for the shifted control
    xs = [x[:, :T] if i < 5 else x for i, x in enumerate(full)]
    w_o = w_o[:, :T]
    cuts = _cuts(T)
    ref = _reference(xs, w_o, w_h)
    errs = _errors(_cp_run(xs, w_o, w_h, cuts, strategy), ref, cuts)
    assert _passes(errs), errs
    # controls through the same check: rank 1's shard one token late (tokens from the spare)
    bad = _errors(_cp_run(full, w_o, w_h, cuts, strategy, shift=True), ref, cuts)
    assert not _passes(bad) and bad["o"] > 100 * TOL, bad
    if strategy != "heads":   # the state entering ranks >= 1 dropped (heads forms none)
        bad = _errors(_cp_run(xs, w_o, w_h, cuts, strategy, fault=2), ref, cuts)
        assert not _passes(bad) and bad["o"] > 100 * TOL, bad
        bad = _errors(_cp_run(xs, w_o, w_h, cuts, strategy, fault=3), ref, cuts)
        assert not _passes(bad) and bad["dk"] > 100 * TOL, bad   # the gradient passed back dropped


@pytest.mark.parametrize("strategy", ["scan", "allgather", "relay", "heads"])
def test_packed_documents_across_shards_match_one_rank(strategy):
    T = 90
    cuts = _cuts(T)
    # documents crossing shard boundaries, a one-token document, one inside rank 0's shard
    cu = torch.tensor([0, 20, 36, 37, 40, 75, 90])
    n = cu.numel() - 1
    full, w_o, w_h = _problem(2, B=1, T=T + 1, n_states=n)
    xs = [x[:, :T] if i < 5 else x for i, x in enumerate(full)]
    w_o = w_o[:, :T]
    ref = _reference(xs, w_o, w_h, cu)
    errs = _errors(_cp_run(xs, w_o, w_h, cuts, strategy, cu=cu), ref, cuts)
    assert _passes(errs), errs
    bad = _errors(_cp_run(full, w_o, w_h, cuts, strategy, cu=cu, shift=True), ref, cuts)
    assert not _passes(bad), bad
    if strategy != "heads":   # the state entering ranks >= 1 dropped (heads forms none)
        bad = _errors(_cp_run(xs, w_o, w_h, cuts, strategy, cu=cu, fault=2), ref, cuts)
        assert bad["o"] > 100 * TOL, bad
    # and the documents matter: the dense run of the same tokens fails the same check
    bad = _errors(_cp_run(xs[:5] + [xs[5][:1]], w_o, [w[:1] for w in w_h], cuts, strategy),
                  ref[:1] + [ref[1][:1]] + ref[2:7] + [ref[7][:1]], cuts)
    assert bad["o"] > 100 * TOL, bad


def test_numpy_entry_points_match_chunk_forward_backward():
    T = 90
    cuts = _cuts(T)
    xs, _, _ = _problem(3, T=T)
    a = [x.numpy() for x in xs]
    rng = np.random.default_rng(4)
    do = rng.standard_normal(a[2].shape).astype(np.float32)
    dht = rng.standard_normal(a[5].shape).astype(np.float32)
    o_ref, ht_ref = gdncp.chunk_forward(*a[:5], a[5])
    g_ref = gdncp.chunk_backward(*a[:5], do, a[5], dht)
    s = slice(cuts[R], cuts[R + 1])
    loc = [x[:, s] for x in a[:5]]

    def run(fault):
        _mutate(fault)
        try:
            o, ht, s_in = gdncp.cp_forward(COMM, *loc, a[5], threads=1)
            grads = gdncp.cp_backward(COMM, *loc, do[:, s], a[5], dht, s_in=s_in, threads=1)
        finally:
            _mutate(0)
        e = {"o": _rel(torch.from_numpy(o), torch.from_numpy(o_ref[:, s])),
             "ht": _rel(torch.from_numpy(ht), torch.from_numpy(ht_ref))}
        for n, x, y in zip(("dq", "dk", "dv", "dg", "dbeta"), grads, g_ref):
            e[n] = _rel(torch.from_numpy(x), torch.from_numpy(y[:, s]))
        if R == 0:   # dense: rank 0's ds_in is dh0
            e["dh0"] = _rel(torch.from_numpy(grads[5]), torch.from_numpy(g_ref[5]))
        table = COMM.allgather(e)
        return {n: max(t.get(n, 0.0) for t in table) for n in e | {"dh0": 0}}

    errs = run(0)
    assert max(errs.values()) < TOL, errs
    bad = run(2)   # control: the incoming state dropped
    assert bad["o"] > 100 * TOL, bad


def _all_raise(exc, fn, must_name=None):
    """fn raises exc on every rank (message checked on each); the ranks compare notes."""
    try:
        fn()
        got = None
    except exc as e:
        got = str(e)
    except Exception as e:  # noqa: BLE001
        got = f"WRONG TYPE {type(e).__name__}: {e}"
    table = COMM.allgather(got)
    for r, m in enumerate(table):
        assert m is not None and not m.startswith("WRONG TYPE"), (r, m)
        if must_name:
            assert must_name in m, (r, m)
    return table


def test_bad_inputs_fail_on_every_rank_and_a_good_call_follows():
    T = 90
    cuts = _cuts(T)
    xs, _, _ = _problem(5, T=T)
    s = slice(cuts[R], cuts[R + 1])
    loc = [x[:, s] for x in xs[:5]]
    call = lambda **kw: gcp.chunk_gated_delta_rule(*kw.pop("xs", loc), comm=kw.pop("comm", COMM),
                                                   **kw)
    _all_raise(ValueError, lambda: call(strategy="ring"), "unknown CP strategy 'ring'")
    _all_raise(TypeError, lambda: call(strategy=3), "strategy must be")
    _all_raise(TypeError, lambda: call(comm="world"), "mpi4py communicator")
    # only rank 1 wrong: it raises its own error, the others name it (nobody waits)
    t = _all_raise(ValueError, lambda: call(strategy="relay" if R == 1 else "scan"),
                   "disagree on the CP strategy")
    bad_k = [x if i != 1 or R != 1 else x[..., :8] for i, x in enumerate(loc)]
    t = _all_raise(ValueError, lambda: call(xs=bad_k), "k has shape")
    assert all(("rank 1 failed" in m) == (r != 1) for r, m in enumerate(t)), t
    bad_dtype = [x if i != 4 or R != D - 1 else x.to(torch.int32) for i, x in enumerate(loc)]
    t = _all_raise(TypeError, lambda: call(xs=bad_dtype), "beta has dtype")
    _all_raise(ValueError, lambda: call(output_final_state=R == 0), "disagree on output_final_state")
    other_V = [x if i != 2 or R != 0 else x[..., :6] for i, x in enumerate(loc)]
    _all_raise(ValueError, lambda: call(xs=other_V), "disagree on V")
    _all_raise(ValueError, lambda: call(strategy="heads", xs=[x[:, :, :1] if i < 2 else x
                                                             for i, x in enumerate(loc)]),
               "divide the key heads")
    one = [x[:1] for x in loc]
    _all_raise(ValueError, lambda: call(xs=one, cu_seqlens=torch.tensor([0, 40, T + 5])),
               "cu_seqlens ends at")
    _all_raise(ValueError, lambda: call(xs=one, cu_seqlens=torch.tensor([0, 40 + R, T])),
               "disagree on the cu_seqlens offsets")
    _all_raise(ValueError, lambda: call(xs=loc, cu_seqlens=torch.tensor([0, T])), "batch size 1")
    _all_raise(ValueError, lambda: call(initial_state=torch.zeros(5, 2, 2, 2)), "initial_state")
    # failures found inside the C library (NaN inputs: its finiteness check) on one rank, in the
    # forward and in the backward (a NaN gradient of o), reach every rank too
    nan_v = [x if i != 2 or R != D - 1 else torch.full_like(x, float("nan"))
             for i, x in enumerate(loc)]
    _all_raise(ValueError, lambda: call(xs=nan_v), "non-finite")
    leaves = [x.clone().requires_grad_(True) for x in loc]
    o, _ = call(xs=leaves)
    w = torch.ones_like(o) if R != 1 else torch.full_like(o, float("nan"))
    _all_raise(ValueError, lambda: o.backward(w), "non-finite")
    # after all that, a good call still runs and agrees with one rank
    o, _ = call()
    o_ref, _ = gt.chunk_gated_delta_rule(*xs[:5])
    e = max(COMM.allgather(_rel(o, o_ref[:, s])))
    assert e < TOL, e


def test_mpi4py_runs_gdncps_mpi_and_another_is_refused(monkeypatch):
    assert MPI.Get_library_version().strip("\0 \n") == core._gdncp_mpi_version().strip("\0 \n")
    # control: libgdncp reporting another MPI makes the same check refuse, naming both
    monkeypatch.setattr(core, "_MPI", None)
    monkeypatch.setattr(core, "_gdncp_mpi_version", lambda: "Open MPI v4.1.4, package: Debian")
    with pytest.raises(ImportError, match="another MPI library.*Open MPI v4.1.4.*mpicc.mpich"):
        core._mpi()
    monkeypatch.undo()
    assert core._mpi() is MPI


# ---------------------------------------------------------------- the conv halo and attention ops

def _conv_reference(x, w, cu=None):
    """transformers' causal conv (conv1d with padding Kc-1, cut to T) then silu, each document
    alone when packed."""
    def conv(xs):
        Kc = w.shape[-1]
        y = torch.nn.functional.conv1d(xs.transpose(1, 2), w, padding=Kc - 1,
                                       groups=xs.shape[2])[..., :xs.shape[1]]
        return torch.nn.functional.silu(y.transpose(1, 2))
    if cu is None:
        return conv(x)
    return torch.cat([conv(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)


def _op_check(run, ref_fn, leaves, cuts, w_out):
    """This rank's slice of the op's output and of every leaf's gradient (of sum(out * w_out))
    against the one-process reference: the worst relative error over the ranks."""
    a, b = cuts[R], cuts[R + 1]
    ref_leaves = [t.clone().requires_grad_(True) for t in leaves]
    ref = ref_fn(*ref_leaves)
    (ref * w_out).sum().backward()
    mine = [t.clone().requires_grad_(True) for t in leaves]
    out = run(*mine, a, b)
    (out * w_out[:, a:b]).sum().backward()
    errs = [_rel(out, ref[:, a:b])]
    for m, r, sliced in zip(mine, ref_leaves, run.sliced):
        # token-sliced inputs: this rank's rows of the gradient; shared ones (the weight): the
        # sum over the ranks
        if sliced:
            errs.append(_rel(m.grad[:, a:b], r.grad[:, a:b]))
        else:
            g = m.grad.detach().clone()
            COMM.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
            errs.append(_rel(g, r.grad))
    return max(max(COMM.allgather(e)) for e in errs)


def test_causal_conv1d_with_halo_matches_one_process():
    T, C, Kc = 60, 10, 4
    cuts = _cuts(T)   # rank 1 holds one token: rank 2's halo comes from ranks 0 and 1
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, T, C, generator=gen)
    w = torch.randn(C, 1, Kc, generator=gen)
    w_out = torch.randn(2, T, C, generator=gen)

    def run(xf, wf, a, b, cu=None):
        # (the slice taken from the full leaf: its gradient lands in this rank's rows)
        return gcp.causal_conv1d(xf[:, a:b], wf, comm=COMM, activation="silu", cu_seqlens=cu)
    run.sliced = (True, False)
    assert _op_check(run, lambda xf, wf: _conv_reference(xf, wf), [x, w], cuts, w_out) <= TOL
    # controls: the halo dropped / its gradient not returned (the library's hooks), and each
    # rank convolving its slice alone
    for fault in (4, 5):
        _mutate(fault)
        try:
            e = _op_check(run, lambda xf, wf: _conv_reference(xf, wf), [x, w], cuts, w_out)
        finally:
            _mutate(0)
        assert e > 100 * TOL, (fault, e)

    def alone(xf, wf, a, b):
        return _conv_reference(xf[:, a:b], wf)
    alone.sliced = run.sliced
    assert _op_check(alone, lambda xf, wf: _conv_reference(xf, wf), [x, w], cuts, w_out) > 100 * TOL
    # packed documents: one starting inside rank 2's halo, a one-token one
    cu = torch.tensor([0, 22, 23, 25, 60])
    x1, w1 = x[:1], w_out[:1]

    def run_packed(xf, wf, a, b):
        return run(xf, wf, a, b, cu=cu)
    run_packed.sliced = run.sliced
    ref_packed = lambda xf, wf: _conv_reference(xf, wf, cu)   # noqa: E731
    assert _op_check(run_packed, ref_packed, [x1, w], cuts, w1) <= TOL
    # control: the dense op on the packed data (taps cross the documents)
    assert _op_check(run, ref_packed, [x1, w], cuts, w1) > 100 * TOL


def _sdpa_reference(q, k, v, cu=None):
    def one(qs, ks, vs):
        o = torch.nn.functional.scaled_dot_product_attention(
            qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2), is_causal=True,
            enable_gqa=True)
        return o.transpose(1, 2)
    if cu is None:
        return one(q, k, v)
    return torch.cat([one(q[:, a:b], k[:, a:b], v[:, a:b])
                      for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], 1)


def test_attention_op_matches_one_process():
    T, H, Hkv, d = 60, 4, 2, 8
    cuts = _cuts(T)
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(2, T, H, d, generator=gen)
    k = torch.randn(2, T, Hkv, d, generator=gen)
    v = torch.randn(2, T, Hkv, d, generator=gen)
    w_out = torch.randn(2, T, H, d, generator=gen)

    def run(qf, kf, vf, a, b, cu=None):
        return gcp.attention(qf[:, a:b], kf[:, a:b], vf[:, a:b], comm=COMM, cu_seqlens=cu)
    run.sliced = (True, True, True)
    assert _op_check(run, _sdpa_reference, [q, k, v], cuts, w_out) <= TOL

    def alone(qf, kf, vf, a, b):   # control: each rank's queries against its own keys only
        return _sdpa_reference(qf[:, a:b], kf[:, a:b], vf[:, a:b])
    alone.sliced = run.sliced
    assert _op_check(alone, _sdpa_reference, [q, k, v], cuts, w_out) > 100 * TOL
    cu = torch.tensor([0, 10, 23, 24, 40, 60])

    def run_packed(qf, kf, vf, a, b):
        return run(qf, kf, vf, a, b, cu=cu)
    run_packed.sliced = run.sliced
    ref_packed = lambda qf, kf, vf: _sdpa_reference(qf, kf, vf, cu)   # noqa: E731
    args = [q[:1], k[:1], v[:1]]
    assert _op_check(run_packed, ref_packed, args, cuts, w_out[:1]) <= TOL
    assert _op_check(run, ref_packed, args, cuts, w_out[:1]) > 100 * TOL


def test_double_backward_refused_on_every_rank():
    """create_graph=True through gdncp.cp's rule, conv halo and attention raises on every rank
    (their gradients come from the library and MPI, not from differentiable torch operations),
    before any collective of the backward, so no rank waits; the control, a plain backward of the
    same calls, gives finite gradients on every rank."""
    T = 60
    cuts = _cuts(T)
    a, b = cuts[R], cuts[R + 1]
    xs, _, _ = _problem(13, T=T)
    gen = torch.Generator().manual_seed(14)
    conv_x, conv_w = torch.randn(2, T, 10, generator=gen), torch.randn(10, 1, 4, generator=gen)
    qkv = [torch.randn(2, T, h, 8, generator=gen) for h in (4, 2, 2)]
    calls = {
        "gdncp.cp.chunk_gated_delta_rule": lambda ins: gcp.chunk_gated_delta_rule(
            *ins, comm=COMM, strategy="scan")[0],
        "gdncp.cp (the conv halo)": lambda ins: gcp.causal_conv1d(ins[0], ins[1], comm=COMM),
        "gdncp.cp (the token gather)": lambda ins: gcp.attention(*ins, comm=COMM),
    }
    inputs = {
        "gdncp.cp.chunk_gated_delta_rule": lambda: [x[:, a:b].clone().requires_grad_(True) for x in xs[:5]],
        "gdncp.cp (the conv halo)": lambda: [conv_x[:, a:b].clone().requires_grad_(True), conv_w.clone().requires_grad_(True)],
        "gdncp.cp (the token gather)": lambda: [t[:, a:b].clone().requires_grad_(True) for t in qkv],
    }
    for what, call in calls.items():
        ins = inputs[what]()
        try:
            torch.autograd.grad((call(ins) ** 2).sum(), ins, create_graph=True)
            said = "no error"
        except RuntimeError as e:
            said = str(e)
        ins = inputs[what]()
        grads = torch.autograd.grad((call(ins) ** 2).sum(), ins)   # control: one backward
        finite = all(bool(torch.isfinite(gr).all()) for gr in grads)
        table = COMM.allgather((said, finite))
        assert all(f"{what}: double backward is not supported" in s and f for s, f in table), table


def test_ops_bad_input_fails_on_every_rank():
    T = 60
    cuts = _cuts(T)
    a, b = cuts[R], cuts[R + 1]
    x = torch.randn(2, T, 6)
    w = torch.randn(6, 1, 4)
    bad_w = torch.randn(5, 1, 4) if R == 1 else w
    errs = []
    for fn in (lambda: gcp.causal_conv1d(x[:, a:b], bad_w, comm=COMM),
               lambda: gcp.attention(torch.randn(2, b - a, 4, 8), torch.randn(2, b - a, 3 if R == 2 % D else 2, 8),
                                     torch.randn(2, b - a, 3 if R == 2 % D else 2, 8), comm=COMM)):
        try:
            fn()
            errs.append(None)
        except (ValueError, TypeError, RuntimeError) as e:
            errs.append(str(e))
    table = COMM.allgather(errs)
    assert all(e is not None for row in table for e in row), table
    # and a good call follows
    y = gcp.causal_conv1d(x[:, a:b], w, comm=COMM)
    assert y.shape == (2, b - a, 6)
