"""gdncp.torch_cp (FLA-shaped context parallelism over a transport) against one process running
the whole sequence. Runs on two transports, never in the plain pytest run (conftest.py leaves it
out unless one of the variables below is set):

  torch.distributed (gloo):  GDNCP_TORCHRUN_TESTS=1 torchrun --nproc-per-node 3 -m pytest test_torch_cp.py
  mpi4py:                    GDNCP_MPI_TESTS=1 mpiexec.mpich -n 3 python -m pytest test_torch_cp.py

Every rank builds the same random problem, runs gdncp.torch on the whole sequence (the reference)
and gdncp.torch_cp on its own tokens, and compares its slice of o and of every input gradient,
the final state, and the sum over the ranks of the gradients that are shares (initial_state,
the conv's weight and bias). Relative error max|a - b| / max|b| under 2e-5 (fp32 against fp32,
DESIGN §4). The ranks exchange their errors before asserting, so every rank passes or fails each
test alike. Every comparison runs deliberate mistakes through the same check (the module's test
faults, inside the real code path: the state not passed between ranks, its gradient not passed
back, the conv halo dropped, the earlier ranks' keys dropped), which must fail it.
"""
import datetime
import os
import time

import numpy as np
import pytest
import torch

import gdncp.torch as gt
import gdncp.torch_cp as tcp
from conftest import world_group

TORCH = os.environ.get("GDNCP_TORCHRUN_TESTS") == "1"
GROUP, R, D, _ = world_group()
if TORCH:
    import torch.distributed as dist
assert D >= 2, "test_torch_cp.py runs with 2 or more ranks (scripts/test_python.sh: 3)"
torch.set_num_threads(1)   # 3 ranks share 2 cores

TOL = 2e-5
T = 90
SHARDS = [37, 1, 52] if D == 3 else None   # uneven: rank 1 holds one token


def _shards():
    if SHARDS is not None:
        return SHARDS
    base = [T // D] * D
    base[-1] += T - sum(base)
    return base


_TR = None


def _gather_obj(x):
    global _TR
    if _TR is None:
        _TR = tcp._transport(GROUP)
    return _TR.allgather_object(x)


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    s = b.abs().max().item()
    return (a - b).abs().max().item() / (s if s > 0 else 1.0)


def _sum_ranks(t):
    return sum(torch.as_tensor(x) for x in _gather_obj(t.detach().numpy()))


def _max_over_ranks(errs):
    table = _gather_obj(errs)
    return {n: max(t[n] for t in table) for n in errs}


def _problem(seed, B, n_states, Hk=2, Hv=4, K=16, V=12):
    rng = np.random.default_rng(seed)
    t = lambda a: torch.tensor(a, dtype=torch.float32)
    q, k = t(rng.standard_normal((B, T, Hk, K))), t(rng.standard_normal((B, T, Hk, K)))
    v = t(rng.standard_normal((B, T, Hv, V)))
    g = t(rng.uniform(-0.5, -1e-3, (B, T, Hv)))
    beta = t(rng.uniform(0.05, 0.95, (B, T, Hv)))
    h0 = t(rng.standard_normal((n_states, Hv, K, V)) * 0.5)
    w_o = t(rng.standard_normal(v.shape))
    w_h = [t(rng.standard_normal(h0.shape)) for _ in range(D)]   # each rank's loss weights ht
    return [q, k, v, g, beta, h0], w_o, w_h


# ---------------------------------------------------------------------------- the rule

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0 (summed over ranks)")


def _reference(xs, w_o, w_h, cu, use_h0):
    leaves = [x.clone().requires_grad_(True) for x in xs]
    o, ht = gt.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5] if use_h0 else None,
                                      output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=cu)
    ((o * w_o).sum() + (ht * sum(w_h)).sum()).backward()
    dh0 = leaves[5].grad if use_h0 else torch.zeros_like(xs[5])
    return [o.detach(), ht.detach()] + [x.grad for x in leaves[:5]] + [dh0]


def _cp(xs, w_o, w_h, ctx, use_h0, fault=None, fla_cu=True):
    leaves = [ctx.shard(x).clone().requires_grad_(True) for x in xs[:5]]
    h0 = xs[5].clone().requires_grad_(True)
    tcp.set_test_fault(ctx, fault)
    try:
        o, ht = tcp.chunk_gated_delta_rule(
            *leaves, initial_state=h0 if use_h0 else None, output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=ctx.cu_seqlens if fla_cu and leaves[0].shape[0] == 1 else None,
            cp_context=ctx)
        ((o * ctx.shard(w_o)).sum() + (ht * w_h[R]).sum()).backward()
    finally:
        tcp.set_test_fault(ctx, None)
    dh0 = _sum_ranks(h0.grad) if use_h0 else torch.zeros_like(xs[5])
    return [o.detach(), ht.detach()] + [x.grad for x in leaves] + [dh0]


def _errors(got, ref, ctx):
    mine = {}
    for i, (n, x, y) in enumerate(zip(NAMES, got, ref)):
        if i in (0, 2, 3, 4, 5, 6):
            y = ctx.shard(y)
        mine[n] = _rel(x, y)
    return _max_over_ranks(mine)


def _passes(errs):
    return max(errs.values()) < TOL


def _check_rule(xs, w_o, w_h, cu, ctx, use_h0, crosses=True):
    ref = _reference(xs, w_o, w_h, cu, use_h0)
    errs = _errors(_cp(xs, w_o, w_h, ctx, use_h0), ref, ctx)
    assert _passes(errs), errs
    if not crosses:   # every document starts at a shard boundary: no state crosses the ranks
        bad = _errors(_cp(xs, w_o, w_h, ctx, use_h0, fault="drop_state"), ref, ctx)
        assert _passes(bad), bad
        return errs
    # controls through the same check: the state entering a rank dropped (forward), and the
    # gradient of the state leaving a rank dropped (backward)
    bad = _errors(_cp(xs, w_o, w_h, ctx, use_h0, fault="drop_state"), ref, ctx)
    assert bad["o"] > 100 * TOL, bad
    bad = _errors(_cp(xs, w_o, w_h, ctx, use_h0, fault="drop_state_grad"), ref, ctx)
    assert bad["o"] < TOL and max(bad["dk"], bad["dv"], bad["dg"]) > 100 * TOL, bad
    return errs


@pytest.mark.parametrize("use_h0", [True, False])
def test_dense_rows_uneven_shards_match_one_process(use_h0):
    xs, w_o, w_h = _problem(1, B=2, n_states=2)
    ctx = tcp.build_cp_context(T, group=GROUP, shard_lengths=_shards())
    assert ctx.cu_seqlens.tolist() == [0, ctx.T] and ctx.shards == _shards()
    _check_rule(xs, w_o, w_h, None, ctx, use_h0)


@pytest.mark.parametrize("cu", [
    [0, 10, 60, 75, 90],          # a document through every rank (rank 1 inside it)
    [0, 20, 37, 38, 70, 90],      # starts at shard boundaries; rank 1 one whole document
    [0, 36, 39, 41, 90],          # a 3-token document across ranks 0, 1, 2
])
def test_packed_documents_across_ranks_match_one_process(cu):
    cu = torch.tensor(cu)
    n = cu.numel() - 1
    xs, w_o, w_h = _problem(2, B=1, n_states=n)
    ctx = tcp.build_cp_context(cu, group=GROUP, conv1d_kernel_size=4, shard_lengths=_shards())
    inner = np.cumsum(_shards())[:-1].tolist()   # the shard boundaries inside the stream
    crosses = any(c not in cu.tolist() for c in inner)
    _check_rule(xs, w_o, w_h, cu, ctx, use_h0=True, crosses=crosses)
    # and the documents matter: the same tokens as one dense row fail the same check
    dense = tcp.build_cp_context(T, group=GROUP, shard_lengths=_shards())
    ref = _reference(xs, w_o, w_h, cu, True)
    got = _cp(xs[:5] + [xs[5][:1]], w_o, [w[:1] for w in w_h], dense, True)
    errs = _max_over_ranks({"o": _rel(got[0], dense.shard(ref[0]))})
    assert errs["o"] > 100 * TOL, errs


def test_fla_even_split_context_and_call():
    """FLA's own shape: build_cp_context(cu_seqlens, group=, conv1d_kernel_size=) splitting
    evenly, the call with cu_seqlens=ctx.cu_seqlens, no states."""
    cu = torch.tensor([0, 25, 31, 90], dtype=torch.int32)
    ctx = tcp.build_cp_context(cu, group=GROUP, conv1d_kernel_size=4)
    assert sum(ctx.shards) == T and max(ctx.shards) - min(ctx.shards) <= 1
    assert ctx.cu_seqlens[0] == 0 and ctx.cu_seqlens[-1] == ctx.T
    assert ctx.is_first_rank == (ctx.pre_num_ranks == 0)
    assert ctx.cu_seqlens_cpu is ctx.cu_seqlens and ctx.num_seqs == len(ctx.cu_seqlens) - 1
    # FLA's fields for the even split of 90 tokens over the ranks (documents [0,25) [25,31) [31,90))
    if D == 3:   # shards [0,30) [30,60) [60,90)
        want = {0: ([0, 25, 30], 0, 1, 0), 1: ([0, 1, 30], 1, 1, 5), 2: ([0, 30], 1, 0, 29)}[R]
        got = (ctx.cu_seqlens.tolist(), ctx.pre_num_ranks, ctx.post_num_ranks,
               ctx.pre_num_conv_tokens)
        assert got == want, (got, want)
    xs, w_o, w_h = _problem(3, B=1, n_states=3)
    ref = _gt_plain(xs, w_o, cu)
    leaves = [ctx.shard(x).clone().requires_grad_(True) for x in xs[:5]]
    o, ht = tcp.chunk_gated_delta_rule(*leaves, cu_seqlens=ctx.cu_seqlens, cp_context=ctx,
                                       use_qk_l2norm_in_kernel=True)
    assert ht is None
    (o * ctx.shard(w_o)).sum().backward()
    errs = {"o": _rel(o, ctx.shard(ref[0]))}
    for n, x, y in zip(("dq", "dk", "dv", "dg", "dbeta"), leaves, ref[1:]):
        errs[n] = _rel(x.grad, ctx.shard(y))
    errs = _max_over_ranks(errs)
    assert _passes(errs), errs


def _gt_plain(xs, w_o, cu):
    leaves = [x.clone().requires_grad_(True) for x in xs[:5]]
    o, _ = gt.chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    (o * w_o).sum().backward()
    return [o.detach()] + [x.grad for x in leaves]


# ---------------------------------------------------------------------------- conv and attention

def _conv_reference(x, w, b, cu):
    """The depthwise causal conv + SiLU on the whole sequence, each document on its own."""
    C, W = w.shape
    pieces = [(0, x.shape[1])] if cu is None else list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    outs = []
    for a, e in pieces:
        xi = x[:, a:e].transpose(1, 2)
        y = torch.nn.functional.conv1d(xi, w[:, None, :], b, padding=W - 1, groups=C)[..., :e - a]
        outs.append(y.transpose(1, 2))
    return torch.nn.functional.silu(torch.cat(outs, 1))


@pytest.mark.parametrize("cu", [None, [0, 36, 38, 39, 90]])
def test_causal_conv1d_matches_one_process(cu):
    B = 2 if cu is None else 1
    rng = np.random.default_rng(5)
    C, W = 6, 4
    x = torch.tensor(rng.standard_normal((B, T, C)), dtype=torch.float32)
    w = torch.tensor(rng.standard_normal((C, W)), dtype=torch.float32)
    b = torch.tensor(rng.standard_normal(C), dtype=torch.float32)
    wy = torch.tensor(rng.standard_normal((B, T, C)), dtype=torch.float32)
    cu_t = None if cu is None else torch.tensor(cu)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, b)]
    ref_y = _conv_reference(*leaves, cu_t)
    (ref_y * wy).sum().backward()
    ref = [ref_y.detach()] + [t.grad for t in leaves]
    ctx = tcp.build_cp_context(T if cu is None else cu_t, group=GROUP, conv1d_kernel_size=W,
                               shard_lengths=_shards())

    def run(fault=None):
        xl = ctx.shard(x).clone().requires_grad_(True)
        wl, bl = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        tcp.set_test_fault(ctx, fault)
        try:
            y, state = tcp.causal_conv1d(xl, wl, bl, activation="swish", cp_context=ctx,
                                         cu_seqlens=ctx.cu_seqlens)
            assert state is None
            (y * ctx.shard(wy)).sum().backward()
        finally:
            tcp.set_test_fault(ctx, None)
        return _max_over_ranks({"y": _rel(y, ctx.shard(ref[0])),
                                "dx": _rel(xl.grad, ctx.shard(ref[1])),
                                "dweight (summed)": _rel(_sum_ranks(wl.grad), ref[2]),
                                "dbias (summed)": _rel(_sum_ranks(bl.grad), ref[3])})

    errs = run()
    assert _passes(errs), errs
    bad = run("drop_halo")
    assert bad["y"] > 100 * TOL and bad["dx"] > 100 * TOL, bad


@pytest.mark.parametrize("cu", [None, [0, 30, 38, 90]])
def test_attention_matches_one_process(cu):
    B = 2 if cu is None else 1
    rng = np.random.default_rng(6)
    H, Hkv, d = 4, 2, 8
    q = torch.tensor(rng.standard_normal((B, T, H, d)), dtype=torch.float32)
    k = torch.tensor(rng.standard_normal((B, T, Hkv, d)), dtype=torch.float32)
    v = torch.tensor(rng.standard_normal((B, T, Hkv, d)), dtype=torch.float32)
    wo = torch.tensor(rng.standard_normal((B, T, H, d)), dtype=torch.float32)
    cu_t = None if cu is None else torch.tensor(cu)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if cu is not None:
        doc = torch.from_numpy(np.searchsorted(np.array(cu), np.arange(T), side="right") - 1)
        mask = mask & (doc[:, None] == doc[None, :])
    ref_o = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in leaves), attn_mask=mask, enable_gqa=True).transpose(1, 2)
    (ref_o * wo).sum().backward()
    ref = [ref_o.detach()] + [t.grad for t in leaves]
    ctx = tcp.build_cp_context(T if cu is None else cu_t, group=GROUP, shard_lengths=_shards())

    def run(fault=None):
        ls = [ctx.shard(t).clone().requires_grad_(True) for t in (q, k, v)]
        tcp.set_test_fault(ctx, fault)
        try:
            o = tcp.attention(*ls, cp_context=ctx)
            (o * ctx.shard(wo)).sum().backward()
        finally:
            tcp.set_test_fault(ctx, None)
        errs = {"o": _rel(o, ctx.shard(ref[0]))}
        for n, x, y in zip(("dq", "dk", "dv"), ls, ref[1:]):
            errs[n] = _rel(x.grad, ctx.shard(y))
        return _max_over_ranks(errs)

    errs = run()
    assert _passes(errs), errs
    bad = run("drop_kv")
    assert bad["o"] > 100 * TOL, bad


# ---------------------------------------------------------------------------- errors

def test_bad_shape_on_one_rank_raises_on_every_rank():
    xs, _, _ = _problem(7, B=1, n_states=1)
    ctx = tcp.build_cp_context(T, group=GROUP, shard_lengths=_shards())
    loc = [ctx.shard(x) for x in xs[:5]]
    bad = list(loc)
    if R == 1:
        bad[3] = bad[3][..., :-1]   # g with one head fewer than v: wrong on this rank alone
    with pytest.raises(ValueError) as e:
        tcp.chunk_gated_delta_rule(*bad, cp_context=ctx)
    assert ("rank 1 failed" if R != 1 else "g must be") in str(e.value), e.value
    # locally valid but not the others' shape (v with one value dim fewer): named everywhere
    bad = list(loc)
    if R == 1:
        bad[2] = bad[2][..., :-1]
    with pytest.raises(ValueError, match="disagree on V: rank 1 has 11"):
        tcp.chunk_gated_delta_rule(*bad, cp_context=ctx)
    # the ranks disagreeing on an option: every rank raises, naming it
    with pytest.raises(ValueError, match="use_qk_l2norm_in_kernel"):
        tcp.chunk_gated_delta_rule(*[ctx.shard(x) for x in xs[:5]], cp_context=ctx,
                                   use_qk_l2norm_in_kernel=R == 0)
    # FLA's varlen form with B > 1 (cu_seqlens is for B = 1)
    with pytest.raises(ValueError, match="B = 1"):
        tcp.chunk_gated_delta_rule(*[torch.cat([ctx.shard(x)] * 2) for x in xs[:5]],
                                   cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
    # a wrong token count on one rank (its shard says otherwise)
    with pytest.raises(ValueError):
        tcp.chunk_gated_delta_rule(*[x[:, :ctx.T + (R == 2)] for x in xs[:5]], cp_context=ctx)
    # the conv's and attention's options agreed too (an activation, a scale on one rank only)
    cctx = tcp.build_cp_context(T, group=GROUP, conv1d_kernel_size=4, shard_lengths=_shards())
    x = torch.randn(1, cctx.T, 6)
    with pytest.raises(ValueError, match="activation"):
        tcp.causal_conv1d(x, torch.randn(6, 4), activation="silu" if R == 2 else None,
                          cp_context=cctx)
    qa = torch.randn(1, cctx.T, 2, 8)
    with pytest.raises(ValueError, match="scale"):
        tcp.attention(qa, qa, qa, scale=0.5 if R == 0 else None, cp_context=cctx)
    # contexts that disagree (another document split on one rank)
    with pytest.raises(ValueError, match="offsets"):
        tcp.build_cp_context([0, 40, T] if R == 0 else [0, 41, T], group=GROUP)
    # and the group still works: a good call after the failures
    o, _ = tcp.chunk_gated_delta_rule(*[ctx.shard(x) for x in xs[:5]], cp_context=ctx)
    assert o.shape == ctx.shard(xs[2]).shape


def test_a_failure_in_the_piece_replayed_after_the_exchange_raises_on_every_rank():
    """The last rank's shard continues a document of the earlier ranks, so it replays that piece
    after the exchange: a NaN there is raised on every rank (that rank its own error, the others
    one naming it), none left waiting in a collective; a good call follows."""
    start = sum(_shards()[:-1])
    cu = torch.tensor([0, start - 3, start + 5, T])
    xs, _, _ = _problem(8, B=1, n_states=3)
    ctx = tcp.build_cp_context(cu, group=GROUP, shard_lengths=_shards())
    loc = [ctx.shard(x).clone() for x in xs[:5]]
    bad = [x.clone() for x in loc]
    if R == D - 1:
        bad[0][0, 0, 0, 0] = float("nan")   # its first token: in the replayed piece
    with pytest.raises(Exception) as e:
        tcp.chunk_gated_delta_rule(*bad, cu_seqlens=ctx.cu_seqlens, output_final_state=True, cp_context=ctx)
    assert R == D - 1 or f"rank {D - 1}" in str(e.value), e.value
    got = _gather_obj(type(e.value).__name__)
    assert all(g is not None for g in got), got
    o, ht = tcp.chunk_gated_delta_rule(*loc, cu_seqlens=ctx.cu_seqlens, output_final_state=True,
                                       cp_context=ctx)
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()


def test_cuda_or_meta_tensors_refused_on_every_rank():
    ctx = tcp.build_cp_context(T, group=GROUP, shard_lengths=_shards())
    xs, _, _ = _problem(8, B=1, n_states=1)
    loc = [ctx.shard(x) for x in xs[:5]]
    if R == 0:
        loc[0] = torch.empty(loc[0].shape, device="meta")
    with pytest.raises(ValueError, match="CPU|rank 0 failed"):
        tcp.chunk_gated_delta_rule(*loc, cp_context=ctx)


# (the two tests below exist only under torch.distributed: not collected, rather than skipped,
# under mpiexec)
if TORCH:
    def test_nccl_group_refused(monkeypatch):
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        with pytest.raises(ValueError, match="gloo"):
            tcp.build_cp_context(T, group=GROUP)
        # a device map with gloo for the CPU is taken (CPU tensors go to gloo)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
        assert tcp.build_cp_context(T, group=GROUP).total == T

    def test_missing_rank_times_out_instead_of_hanging():
        """A rank that never calls: the others get gloo's timeout (3 s on this group), not a
        hang."""
        short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
        ctx = tcp.build_cp_context(T, group=short, shard_lengths=_shards())
        xs, _, _ = _problem(9, B=1, n_states=1)
        loc = [ctx.shard(x) for x in xs[:5]]
        if R != 0:
            t0 = time.perf_counter()
            with pytest.raises(RuntimeError):
                tcp.chunk_gated_delta_rule(*loc, cp_context=ctx)
            assert time.perf_counter() - t0 < 30
        dist.barrier()   # on the world group: every rank leaves the test together
