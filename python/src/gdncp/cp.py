"""Context parallelism from PyTorch: gdncp.torch's chunk_gated_delta_rule with the sequence split
over the ranks of an mpi4py communicator.

    from mpi4py import MPI
    import gdncp.cp
    o, ht = gdncp.cp.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                            output_final_state=True,
                                            use_qk_l2norm_in_kernel=True,
                                            comm=MPI.COMM_WORLD, strategy="scan")

Every rank passes its own token slice (rank order = token order; shards may differ in length,
down to one token): q, k [B,T_r,Hk,K], v [B,T_r,Hv,V], g, beta [B,T_r,Hv], and gets o for its
tokens. The result equals one rank running the whole sequence, up to rounding (DESIGN §4). The
backward is gdncp's CP backward (gdn_cp_backward): o.backward() on every rank gives each rank the
gradients of its own slice. Calls are collective: every rank of comm calls the forward, and the
backward (every rank's loss must depend on o or ht, or the others wait for it).

Strategies (include/gdncp/cp.h): "scan" (log-depth prefix scan of the shards' affine maps),
"allgather", "relay" (the state passed rank to rank), "heads" (all-to-all to head-parallel and
back; the number of ranks must divide Hk).

States. initial_state enters the sequence on rank 0: dense, only rank 0's is read (others may pass
None). The final state of the whole sequence comes from the last rank and is returned on every
rank. Gradients follow the autograd meaning of that: the gradient of the final state is the sum of
every rank's (summed over the communicator before the backward); the gradient of initial_state is
the one of the copy that was read, so rank 0's (zeros on the others). Sum initial_state.grad over
the ranks (e.g. comm.Allreduce) for the gradient of a state shared by all of them.

Packed documents (cu_seqlens, B = 1): every rank passes the whole stream's offsets (the same
tensor everywhere; the documents may cross the shard boundaries), and initial_state /
final_state are [n_docs,Hv,K,V] on every rank: a rank applies the initial states of the documents
that start on it, and its initial_state.grad holds those rows (zeros elsewhere; again, the sum
over the ranks is the full dh0). Every strategy takes packed streams (heads needs the ranks to
divide Hk, as for dense input).

The other two pieces of a GatedDeltaNet model split over ranks, as autograd functions:
causal_conv1d(x, weight, comm=) (the layer's depthwise causal conv with its Kc-1 halo rows from
the previous ranks, gdn_cp_halo_forward / _backward; packed documents via cu_seqlens) and
attention(q, k, v, comm=) (causal SDPA with GQA across the ranks: keys and values all-gathered,
their gradients reduce-scattered back). gdncp.transformers.patch(comm=...) runs whole
transformers models this way, with gdncp's C layers (gdncp.cp_layers).

Precision: inputs of any float dtype run gdncp's fp32 kernel (there is no float64 CP path); o
comes back in q's dtype, the final state in float32, gradients in their inputs' dtypes.

A bad input on one rank (a wrong shape, an unknown strategy, the ranks disagreeing on options) is
raised on every rank before any data moves: the failing rank raises its own TypeError or
ValueError, the others one that names it. Only a bad `comm` itself (not an mpi4py communicator)
is raised locally, since there is nothing to agree over.
"""
import numpy as np

try:
    import torch
except ImportError as e:
    raise ImportError("gdncp.cp needs PyTorch: pip install torch (the NumPy entry points are "
                      "gdncp.cp_forward / gdncp.cp_backward)") from e

from . import _lib as L
from . import core
from .torch import _check_tensor, _cu_numpy, _no_double_backward, _np, _threads

core._mpi()   # ImportError now when mpi4py is missing or runs another MPI than libgdncp.so

__all__ = ["chunk_gated_delta_rule", "causal_conv1d", "attention", "STRATEGIES"]

STRATEGIES = core.STRATEGIES


class _CPRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, comm, strategy, scale, want_ht, l2norm, cu):
        xs = [x.detach().to(torch.float32).contiguous() for x in (q, k, v, g, beta)]
        h0c = None if h0 is None else h0.detach().to(torch.float32).contiguous()
        call = core._CPCall(comm, strategy, *(x.numpy() for x in xs),
                            None if h0c is None else h0c.numpy(), cu, scale, l2norm, 64,
                            _threads(), flags=(("output_final_state", want_ht),))
        o, ht, s_in = call.forward(want_ht=want_ht, want_s_in=True)
        ctx.call, ctx.want_ht = call, want_ht
        ctx.has_h0 = h0 is not None
        ctx.in_dtypes = [None if x is None else x.dtype for x in (q, k, v, g, beta, h0)]
        ctx.h0_shape = None if h0 is None else tuple(h0.shape)
        # the call holds the float32 arrays it was given (views of xs), and s_in is reused
        ctx.s_in = s_in
        ctx.keep = xs, h0c
        return torch.from_numpy(o).to(q.dtype), (torch.from_numpy(ht) if want_ht else None)

    @staticmethod
    def backward(ctx, do, dht):
        _no_double_backward("gdncp.cp.chunk_gated_delta_rule")
        call = ctx.call
        p = call.p
        do_a = _np(do, np.float32) if do is not None else np.zeros(p.v.shape, np.float32)
        dht_a = None
        if ctx.want_ht:
            # every rank holds the final state: its gradient is the sum of the ranks' (a
            # collective every rank makes, with zeros where the rank's loss does not use ht)
            dht_a = np.zeros(p.state_shape(), np.float32) if dht is None else _np(dht, np.float32).copy()
            call.st.py.Allreduce(call.st.MPI.IN_PLACE, dht_a, op=call.st.MPI.SUM)
        # ds_in: packed, every document's dh0 (gathered: every rank asks or none, and has_h0 is
        # agreed); dense, only rank 0's is dh0
        want = ctx.has_h0 and (call.packed or call.rank == 0)
        dq, dk, dv, dg, dbeta, ds_in = call.backward(do_a, dht_a, ctx.s_in, want_ds_in=want)
        dh0 = None
        if ctx.has_h0:
            if call.packed:
                dh0 = ds_in * call.doc_starts()[:, None, None, None]
            elif call.rank == 0:
                dh0 = ds_in
            else:
                dh0 = np.zeros(ctx.h0_shape, np.float32)
        out = [None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(d)
               for a, d in zip((dq, dk, dv, dg, dbeta, dh0), ctx.in_dtypes)]
        return (*out, None, None, None, None, None, None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, *, comm, strategy="scan"):
    """gdncp.torch.chunk_gated_delta_rule on this rank's token slice, the sequence split over
    comm's ranks (collective; see the module's docstring): (o, final_state), final_state None
    unless output_final_state."""
    try:
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            _check_tensor(name, t)
        _check_tensor("initial_state", initial_state, optional=True)
        cu = _cu_numpy(cu_seqlens)
    except (TypeError, ValueError) as e:
        # shared with the other ranks before it is raised (they would wait for this one)
        core._CPCall(comm, strategy, *([None] * 6), None, scale, use_qk_l2norm_in_kernel, 64, 0,
                     flags=(("output_final_state", bool(output_final_state)),), error=e)
        raise
    return _CPRule.apply(q, k, v, g, beta, initial_state, comm, strategy, scale,
                         bool(output_final_state), bool(use_qk_l2norm_in_kernel), cu)


# ---------------------------------------------------------------- the conv halo and attention

class _Halo(torch.autograd.Function):
    """The `rows` token rows before this rank's slice (zeros before the sequence start), from
    however many previous ranks hold them (gdn_cp_halo_forward); the backward sends their
    gradient back to the owners (gdn_cp_halo_backward)."""

    @staticmethod
    def forward(ctx, x, rows, cp, status):
        xa = x.detach().to(torch.float32).contiguous()
        B, T, C = xa.shape
        halo = torch.zeros(B, rows, C, dtype=torch.float32)
        L.check(L.gdn_cp_halo_forward(cp, L.f32p(halo.numpy()), L.f32p(xa.numpy()), B, T, C, C,
                                      rows, status), "gdn_cp_halo_forward")
        ctx.meta = (cp, B, T, C, rows, x.dtype)
        return halo.to(x.dtype)

    @staticmethod
    def backward(ctx, dhalo):
        _no_double_backward("gdncp.cp (the conv halo)")
        cp, B, T, C, rows, dtype = ctx.meta
        dx = torch.zeros(B, T, C, dtype=torch.float32)
        dh = dhalo.detach().to(torch.float32).contiguous()
        L.check(L.gdn_cp_halo_backward(cp, L.f32p(dx.numpy()), L.f32p(dh.numpy()), B, T, C, C,
                                       rows, 0), "gdn_cp_halo_backward")
        return dx.to(dtype), None, None, None


def _doc_start_of(cu, offset, T):
    """For each of this rank's tokens, the global index where its document starts (packed)."""
    g = np.arange(offset, offset + T)
    return torch.from_numpy(cu[np.searchsorted(cu, g, side="right") - 1] - offset)


def causal_conv1d(x, weight, *, comm, activation=None, cu_seqlens=None):
    """The depthwise causal conv of Qwen3.5's GatedDeltaNet (transformers' conv1d with padding
    Kc-1, or causal_conv1d_fn) on this rank's slice x [B, T_r, C], the sequence split over comm:
    the Kc-1 rows before the slice come from the previous ranks (zeros before the sequence start);
    their gradient goes back. weight [C, 1, Kc] or [C, Kc]; activation None or "silu"; cu_seqlens
    (the whole stream's offsets, B = 1): no tap reaches across a document start. Collective, with
    autograd. Returns [B, T_r, C]."""
    err, status, Kc, cu = None, L.GDN_OK, 2, None
    try:
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or 0 in x.shape:
            raise ValueError(f"x must be [B, T_r, C] with every size > 0, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        ok = isinstance(weight, torch.Tensor) and weight.dim() in (2, 3) \
            and weight.shape[0] == x.shape[2] and (weight.dim() == 2 or weight.shape[1] == 1)
        if not ok:
            raise ValueError(f"weight must be [C, 1, Kc] or [C, Kc] with C = {x.shape[2]}, got "
                             f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else weight!r}")
        if activation not in (None, "silu"):
            raise ValueError(f"activation must be None or 'silu', got {activation!r}")
        w = weight.reshape(weight.shape[0], -1)
        Kc = int(w.shape[1])
        cu = None if cu_seqlens is None else core._cp_cu(_cu_numpy(cu_seqlens), x.shape[0])
    except (TypeError, ValueError) as e:
        err, status = e, L.GDN_ERR_SHAPE
    st = core._comm_state(comm)
    cp = st.cp()
    rows = max(Kc - 1, 1)   # (Kc = 1 needs none; one row keeps the call, and the agreement, alike)
    try:   # collective even where this rank failed: status makes the failure every rank's
        halo = _Halo.apply(x if err is None else torch.zeros(1, 1, 1), rows, cp, status)
    except (ValueError, RuntimeError):
        if err is not None:
            raise err from None
        raise
    if err is not None:
        raise err
    B, T, C = x.shape
    offset = (st.py.exscan(T) if st.size > 1 else 0) or 0
    xe = torch.cat([halo[:, rows - (Kc - 1):], x], 1)   # global tokens offset - (Kc-1) ..
    start = None if cu is None else _doc_start_of(cu, offset, T)
    t = torch.arange(T)
    y = x.new_zeros(B, T, C)
    for j in range(Kc):                                   # tap j reads token t - j
        tap = xe[:, Kc - 1 - j:Kc - 1 - j + T] * w[:, Kc - 1 - j]
        if start is not None and j:
            tap = tap * (t - j >= start).to(x.dtype)[None, :, None]
        y = y + tap
    return torch.nn.functional.silu(y) if activation == "silu" else y


class _GatherTokens(torch.autograd.Function):
    """Every rank's [B, T_r, ...] slice gathered along the tokens into [B, T, ...] on every rank;
    the backward sums the gradients over the ranks and gives each its own slice (a
    reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, st, shards):
        xa = x.detach().to(torch.float32).transpose(0, 1).contiguous()   # [T_r, B, ...]
        inner = int(np.prod(xa.shape[1:]))
        full = torch.empty((sum(shards),) + tuple(xa.shape[1:]), dtype=torch.float32)
        counts = [t * inner for t in shards]
        st.py.Allgatherv(xa.numpy(), [full.numpy(), counts])
        ctx.meta = (st, shards, inner, tuple(xa.shape), x.dtype)
        return full.transpose(0, 1).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        _no_double_backward("gdncp.cp (the token gather)")
        st, shards, inner, local_shape, dtype = ctx.meta
        ga = g.detach().to(torch.float32).transpose(0, 1).contiguous()
        out = torch.empty(local_shape, dtype=torch.float32)
        st.py.Reduce_scatter(ga.numpy(), out.numpy(), [t * inner for t in shards])
        return out.transpose(0, 1).to(dtype), None, None


def attention(q, k, v, *, comm, scale=None, cu_seqlens=None):
    """Causal softmax attention (SDPA with is_causal, GQA) over a sequence split on comm's ranks:
    this rank's queries q [B, T_r, H, d] against the keys k and values v [B, T_r, Hkv, d] of every
    token up to its own, each rank's passing its slice (FLA's token-major layout). cu_seqlens (the
    whole stream's offsets, B = 1): no query attends across a document. The keys and values are
    all-gathered (each rank holds the whole sequence's, O(T Hkv d); the backward reduce-scatters
    their gradients to the owners) and the core is PyTorch's scaled_dot_product_attention over
    the causal prefix. (The patched models' attention layers run gdncp's C layer instead, keys
    and values passed point to point.) Collective, with autograd. Returns o [B, T_r, H, d]."""
    err = None
    try:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_tensor(name, t)
            if t.dim() != 4:
                raise ValueError(f"{name} must be [B, T_r, heads, d], got {tuple(t.shape)}")
        B, T, H, d = q.shape
        if k.shape != v.shape or k.shape[0] != B or k.shape[1] != T or k.shape[3] != d:
            raise ValueError(f"k and v must be [B, T_r, Hkv, d] = [{B}, {T}, Hkv, {d}], got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if H % k.shape[2]:
            raise ValueError(f"the query heads ({H}) must be a multiple of the kv heads "
                             f"({k.shape[2]})")
        cu = None if cu_seqlens is None else core._cp_cu(_cu_numpy(cu_seqlens), B)
        sig = (B, H, int(k.shape[2]), d, None if cu is None else cu.tobytes())
    except (TypeError, ValueError) as e:
        err, sig, T = e, None, 0
    st = core._comm_state(comm)
    shards = core._agree(st, err, sig, ("B", "the query heads", "the kv heads", "d",
                                        "the cu_seqlens offsets"), T, what="gdncp CP attention")
    offset, total = sum(shards[:st.rank]), sum(shards)
    if cu is not None and cu[-1] != total:
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])}, the ranks hold {total} tokens")
    K = _GatherTokens.apply(k, st, shards)[:, :offset + T]
    V = _GatherTokens.apply(v, st, shards)[:, :offset + T]
    qi = torch.arange(offset, offset + T)[:, None]
    kj = torch.arange(offset + T)[None, :]
    mask = kj <= qi
    if cu is not None:
        doc = torch.from_numpy(np.searchsorted(cu, np.arange(offset + T), side="right") - 1)
        mask = mask & (doc[None, :] == doc[offset:offset + T, None])
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), K.transpose(1, 2).to(q.dtype), V.transpose(1, 2).to(q.dtype),
        attn_mask=mask, scale=scale, enable_gqa=H != k.shape[2])
    return o.transpose(1, 2)
