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

from . import core
from .torch import _check_tensor, _cu_numpy, _np, _threads

core._mpi()   # ImportError now when mpi4py is missing or runs another MPI than libgdncp.so

__all__ = ["chunk_gated_delta_rule", "STRATEGIES"]

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
