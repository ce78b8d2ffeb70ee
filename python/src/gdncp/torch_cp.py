"""Context parallelism over a torch.distributed process group (torchrun, gloo), in
flash-linear-attention's calling shape (fla.ops.cp):

    import torch.distributed as dist
    from gdncp.torch_cp import build_cp_context, chunk_gated_delta_rule, causal_conv1d
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    ctx = build_cp_context(cu_seqlens_global, group=dist.group.WORLD, conv1d_kernel_size=W)
    x_local = ctx.shard(x_global)                        # this rank's tokens, [B, T_r, ...]
    y, _ = causal_conv1d(x_local, weight, bias, activation="swish", cp_context=ctx)
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=ctx.cu_seqlens, cp_context=ctx)

Every rank passes its own token slice (rank order = token order) and gets o for its tokens; the
result equals one process running the whole sequence, up to fp32 rounding. Autograd runs
through every op (each backward is collective: every rank's loss must depend on the op's output).

What FLA's CP refuses, this takes: shards of any length >= 1 (build_cp_context(...,
shard_lengths=[...]); the default splits evenly, the first ranks one token longer when the total
does not divide), B >= 1 dense rows (cu_seqlens_global = [0, T], or the int T) as well as B = 1
packed documents that cross the ranks, initial_state and output_final_state:
  * initial_state [N, Hv, K, V] (N = B dense, the number of documents packed): each rank applies
    the rows of the documents that start on it (dense: rank 0; the others may pass None). Its
    gradient is that of the copy that was read: those rows on that rank, zeros elsewhere; sum
    initial_state.grad over the ranks for a state shared by all of them.
  * the final state [N, Hv, K, V] is returned on every rank (each document's from the rank where
    it ends); its gradient is the sum of every rank's.

The design (issue 40): the strategies are not written a second time. The C library's local
primitives do the work and only their small results travel, through a Transport (allgather of
equal-size tensors, its adjoint reduce-scatter, allreduce-sum, allgather of small Python objects)
that torch.distributed (a gloo group) or mpi4py backs:
  * the rule (FLA's "all-gather + merge", gdncp's `allgather` strategy): each rank forms the
    affine map of its shard, S_out = A S_in + B (gdn_summary; a constant map (0, the last
    document's final state) where a document starts on the shard, gdn_forward), the maps are
    all-gathered and each rank folds its predecessors' in rank order (gdn_summary_apply), then
    replays its first document's piece from that state (gdn_forward with h0). The backward is
    the mirror: adjoint pairs (A^T, G) (gdn_summary_adjoint; constant where a document starts),
    folded in reverse rank order, then the local backward (gdn_backward) from the incoming state
    gradient. One all-gather of B Hv K (K + V) floats per rank each way.
  * the conv (causal_conv1d): each rank's last W-1 rows all-gathered (the halo), their gradient
    returned to the owners by a reduce-scatter (an all-to-all and a sum: gloo has no
    reduce-scatter of its own).
  * attention: keys and values all-gathered (the `kv` strategy), the core PyTorch's SDPA over the
    causal prefix (documents masked); their gradients reduce-scattered back.
Every call first agrees on the options and shapes (core._agree over the transport): a bad input
on one rank raises on every rank, the failing one its own error, the others one naming it; a
rank whose C call fails reports it in the exchange that follows, and every rank raises. A rank
that never calls waits for nobody: the others get gloo's timeout (set it in
init_process_group / new_group). Only gloo groups and CPU tensors: a NCCL group or a CUDA
tensor raises ValueError.

The same functions take an mpi4py communicator as `group` (the MPI transport): the tests run on
both. gdncp.cp (the C library's own MPI CP: scan, relay, heads strategies) is unchanged.
"""
import ctypes
import hashlib
import pickle
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import _lib as L
from . import core
from .torch import _check_tensor, _cu_numpy, _no_double_backward, _threads

__all__ = ["build_cp_context", "CPContext", "chunk_gated_delta_rule", "causal_conv1d",
           "attention", "TorchTransport", "MPITransport", "FAULTS", "set_test_fault"]

_apply_map = L._proto("gdn_summary_apply", ctypes.c_int, L.P_float, L.P_float, L.P_float,
                      L.P_float, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)

# Testing hooks for negative controls only: each makes the results deliberately WRONG through the
# real code path (set_test_fault). Never set one in a real run.
FAULTS = ("drop_state",        # the rule replays from zeros instead of the incoming state
          "drop_state_grad",   # the local backward from dS_out = 0 instead of the received one
          "drop_halo",         # the conv halo from the predecessors replaced by zeros
          "drop_kv")           # attention: the earlier ranks' keys and values not attended


# ---------------------------------------------------------------------------- the transports

class Transport:
    """The collectives the CP ops use, over one group (rank order = token order): allgather
    (every rank's equal-shape tensor, stacked [size, ...]), reduce_scatter (the adjoint of
    allgather: blocks [size, ...] on every rank -> the sum over the ranks of block[rank], by an
    all-to-all and a sum in rank order), allreduce_ (sum, in place) and allgather_object (small
    picklable values: the agreement). Keeps its accounting (stats)."""
    rank = 0
    size = 1
    name = "?"

    def __init__(self):
        self.stats = dict(comm_s=0.0, bytes_sent=0, bytes_recv=0, calls=0)

    def _count(self, t0, sent, recv):
        s = self.stats
        s["comm_s"] += time.perf_counter() - t0
        s["bytes_sent"] += int(sent)
        s["bytes_recv"] += int(recv)
        s["calls"] += 1

    # the duck-typed communicator core._agree talks to (st.py.allgather(obj))
    @property
    def py(self):
        return self

    def allgather(self, obj):   # core._agree's name for allgather_object
        return self.allgather_object(obj)


class TorchTransport(Transport):
    """torch.distributed over a gloo ProcessGroup (None: the default group)."""
    name = "torch.distributed (gloo)"

    def __init__(self, group=None):
        super().__init__()
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("gdncp.torch_cp: torch.distributed is not initialised (call "
                               "dist.init_process_group('gloo', ...) first, e.g. under torchrun)")
        self.dist = dist
        self.group = dist.group.WORLD if group is None else group
        backend = str(dist.get_backend(self.group)).lower()
        # "gloo", or a device map whose CPU backend is gloo ("cpu:gloo,cuda:nccl")
        if backend != "gloo" and "cpu:gloo" not in backend:
            raise ValueError(f"gdncp.torch_cp runs on the CPU over a gloo process group; this "
                             f"group's backend is {backend!r} (NCCL and other GPU backends are not "
                             "supported: make one with dist.new_group(backend='gloo'))")
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    def allgather(self, t):
        if not isinstance(t, torch.Tensor):          # (the agreement's objects)
            return self.allgather_object(t)
        t = t.contiguous()
        out = torch.empty((self.size,) + tuple(t.shape), dtype=t.dtype)
        t0 = time.perf_counter()
        self.dist.all_gather(list(out.unbind(0)), t, group=self.group)
        self._count(t0, t.nbytes * (self.size - 1), t.nbytes * (self.size - 1))
        return out

    def allreduce_(self, t):
        t0 = time.perf_counter()
        self.dist.all_reduce(t, group=self.group)
        self._count(t0, t.nbytes, t.nbytes)
        return t

    def reduce_scatter(self, blocks):
        blocks = blocks.contiguous()
        got = torch.empty_like(blocks)
        t0 = time.perf_counter()
        self.dist.all_to_all_single(got, blocks, group=self.group)
        self._count(t0, blocks[0].nbytes * (self.size - 1), blocks[0].nbytes * (self.size - 1))
        return got.sum(0)

    def allgather_object(self, obj):
        """Every rank's obj. The agreements mostly find every rank holding the same value: a
        fixed-size probe (the pickle's length and digest) settles that in one collective; only
        when the probes differ do the objects travel (torch's all_gather_object: two more)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little",
                                signed=True)
        probes = self.allgather(torch.tensor([len(data), digest], dtype=torch.int64))
        if bool((probes == probes[0]).all()):
            return [obj] * self.size
        out = [None] * self.size
        t0 = time.perf_counter()
        self.dist.all_gather_object(out, obj, group=self.group)
        self._count(t0, len(data) * (self.size - 1), 0)
        return out


class MPITransport(Transport):
    """mpi4py over a duplicate of an intracommunicator."""
    name = "mpi4py"

    def __init__(self, comm):
        super().__init__()
        from mpi4py import MPI
        if comm == MPI.COMM_NULL or comm.Is_inter():
            raise ValueError("gdncp.torch_cp needs an mpi4py intracommunicator")
        self.MPI = MPI
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def allgather(self, t):
        if not isinstance(t, torch.Tensor):
            return self.allgather_object(t)
        t = t.contiguous()
        out = torch.empty((self.size,) + tuple(t.shape), dtype=t.dtype)
        t0 = time.perf_counter()
        self.comm.Allgather(t.numpy(), out.numpy())
        self._count(t0, t.nbytes * (self.size - 1), t.nbytes * (self.size - 1))
        return out

    def allreduce_(self, t):
        t0 = time.perf_counter()
        self.comm.Allreduce(self.MPI.IN_PLACE, t.numpy(), op=self.MPI.SUM)
        self._count(t0, t.nbytes, t.nbytes)
        return t

    def reduce_scatter(self, blocks):
        blocks = blocks.contiguous()
        got = torch.empty_like(blocks)
        t0 = time.perf_counter()
        self.comm.Alltoall(blocks.numpy(), got.numpy())
        self._count(t0, blocks[0].nbytes * (self.size - 1), blocks[0].nbytes * (self.size - 1))
        return got.sum(0)

    def allgather_object(self, obj):
        t0 = time.perf_counter()
        out = self.comm.allgather(obj)
        self._count(t0, 0, 0)
        return out


def _transport(group):
    if isinstance(group, Transport):
        return group
    try:
        from mpi4py import MPI
        if isinstance(group, MPI.Comm):
            return MPITransport(group)
    except ImportError:
        pass
    return TorchTransport(group)


# ---------------------------------------------------------------------------- the context

@dataclass
class CPContext:
    """This rank's place in the split sequence (build_cp_context). FLA's fields: group,
    cu_seqlens (this rank's local document offsets, int64, [0, T_r] with one document),
    is_first_rank, is_last_rank, pre_num_ranks / post_num_ranks (the ranks before / after this
    one that share its first / last document), conv1d_kernel_size, pre_num_conv_tokens (the
    tokens of this rank's first document before its shard, as FLA counts them).
    gdncp's: rank, world_size, shards (every rank's token count), offset (this rank's first
    global token), total, cu_seqlens_global (None for dense), transport."""
    group: object
    transport: Transport
    rank: int
    world_size: int
    shards: list
    offset: int
    total: int
    cu_seqlens_global: object
    cu_seqlens: object
    is_first_rank: bool
    is_last_rank: bool
    pre_num_ranks: int
    post_num_ranks: int
    conv1d_kernel_size: object
    pre_num_conv_tokens: int
    fault: object = field(default=None, repr=False)

    @property
    def T(self):
        return self.shards[self.rank]

    @property
    def packed(self):
        return self.cu_seqlens_global is not None and self.cu_seqlens_global.size > 2

    @property
    def n_docs(self):
        return 1 if self.cu_seqlens_global is None else self.cu_seqlens_global.size - 1

    @property
    def is_cp_enabled(self):
        return self.group is not None

    # the rest of FLA's FLACPContext: everything here is on the CPU already
    @property
    def cu_seqlens_cpu(self):
        return self.cu_seqlens

    @property
    def num_seqs(self):
        """The documents (pieces of documents) on this rank, as FLA counts them."""
        return len(self.cu_seqlens) - 1

    def copy_for_backward(self):
        return self

    def shard(self, x, dim=1):
        """This rank's tokens of a whole-sequence tensor (dim: the token axis)."""
        return x.narrow(dim, self.offset, self.T)

    def pieces(self):
        """This rank's tokens cut at document starts: (a, b, doc, starts_here, ends_here) local
        ranges; dense: one piece, the document index None."""
        D, r, o, T = self.world_size, self.rank, self.offset, self.T
        if not self.packed:
            return [(0, T, None, r == 0, r == D - 1)]
        cu = self.cu_seqlens_global
        d0 = int(np.searchsorted(cu, o, side="right")) - 1
        d1 = int(np.searchsorted(cu, o + T - 1, side="right")) - 1
        return [(int(max(cu[d], o) - o), int(min(cu[d + 1], o + T) - o), d, bool(cu[d] >= o),
                 bool(cu[d + 1] <= o + T)) for d in range(d0, d1 + 1)]


_default_fault = None   # what contexts made from now on start with (set_test_fault(None, ...))


def set_test_fault(ctx, fault):
    """Testing hook (negative controls): one of FAULTS, or None. Makes this rank's results
    deliberately wrong through the real code path: ctx's, or (ctx None) those of every context
    built from now on (a patched model builds one per forward)."""
    global _default_fault
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}: one of {FAULTS}")
    if ctx is None:
        _default_fault = fault
    else:
        ctx.fault = fault


def build_cp_context(cu_seqlens_global, group=None, conv1d_kernel_size=None, *,
                     shard_lengths=None):
    """The CP context of this rank (collective over group: every rank calls it alike).

    cu_seqlens_global: the whole stream's document offsets before the split (a 1-D integer
    tensor, list or array: [0, ..., total]), or an int T for dense rows of T tokens (the same as
    [0, T]). group: a torch.distributed gloo ProcessGroup (None: the default group) or an mpi4py
    communicator. conv1d_kernel_size: W of causal_conv1d. shard_lengths: every rank's token count
    (the same list on every rank; each >= 1, summing to the total); None splits evenly, the first
    total % world_size ranks one token longer."""
    tr = _transport(group)
    err, sig = None, None
    try:
        if isinstance(cu_seqlens_global, (int, np.integer)) and not isinstance(cu_seqlens_global, bool):
            cu = np.array([0, int(cu_seqlens_global)], np.int64)
        else:
            cu = core._cp_cu(_cu_numpy(cu_seqlens_global), 1)
        total = int(cu[-1])
        if total < 1:
            raise ValueError(f"the sequence must hold at least one token, got {total}")
        D = tr.size
        if shard_lengths is None:
            shards = [total // D + (1 if r < total % D else 0) for r in range(D)]
        else:
            shards = [int(x) for x in shard_lengths]
            if len(shards) != D:
                raise ValueError(f"shard_lengths has {len(shards)} entries for {D} ranks")
            if sum(shards) != total:
                raise ValueError(f"shard_lengths sum to {sum(shards)}, the documents end at {total}")
        if min(shards) < 1:
            raise ValueError(f"every rank needs at least one token: {total} tokens over {D} "
                             f"ranks gives shards {shards}")
        W = None if conv1d_kernel_size is None else int(conv1d_kernel_size)
        if W is not None and W < 1:
            raise ValueError(f"conv1d_kernel_size must be >= 1, got {W}")
        sig = (cu.tobytes(), tuple(shards), W)
    except (TypeError, ValueError) as e:
        err = e
    core._agree(tr, err, sig, ("the documents' offsets (cu_seqlens_global)", "shard_lengths",
                               "conv1d_kernel_size"), what="gdncp.torch_cp.build_cp_context")
    r, D = tr.rank, tr.size
    offset = sum(shards[:r])
    T = shards[r]
    packed = cu.size > 2
    starts = np.cumsum([0] + shards)
    first_doc = int(np.searchsorted(cu, offset, side="right")) - 1
    last_doc = int(np.searchsorted(cu, offset + T - 1, side="right")) - 1
    doc_start, doc_end = int(cu[first_doc]), int(cu[last_doc + 1])
    pre = r - (int(np.searchsorted(starts, doc_start, side="right")) - 1)
    post = (int(np.searchsorted(starts, doc_end - 1, side="right")) - 1) - r
    inner = cu[(cu > offset) & (cu < offset + T)] - offset
    local = torch.from_numpy(np.concatenate([[0], inner, [T]]).astype(np.int64))
    return CPContext(group=group, transport=tr, rank=r, world_size=D, shards=shards,
                     offset=offset, total=int(cu[-1]), cu_seqlens_global=cu if packed else None,
                     cu_seqlens=local, is_first_rank=pre == 0, is_last_rank=post == 0,
                     pre_num_ranks=pre, post_num_ranks=post, conv1d_kernel_size=W,
                     pre_num_conv_tokens=offset - doc_start,
                     fault=_default_fault)


def _check_ctx(cp_context):
    if not isinstance(cp_context, CPContext):
        raise TypeError("cp_context must come from gdncp.torch_cp.build_cp_context, not "
                        f"{type(cp_context).__name__}")
    return cp_context


# ---------------------------------------------------------------------------- the rule

def _rows(x, a, b):
    """Tokens [a, b) of a [B, T, ...] float32 array, C-contiguous."""
    return np.ascontiguousarray(x[:, a:b])


class _Shard:
    """One rank's part of a CP call of the rule: its pieces, the C primitives on them, the
    exchange of affine maps."""

    def __init__(self, ctx, xs, h0, scale, l2norm, want_ht):
        self.ctx, self.tr = ctx, ctx.transport
        self.q, self.k, self.v, self.g, self.beta = xs
        self.h0 = h0                          # [N, Hv, K, V] float32 or None
        self.scale, self.l2norm, self.want_ht = scale, l2norm, want_ht
        B, T, Hk, K = self.q.shape
        self.B, self.T, self.Hv, self.K, self.V = B, T, self.v.shape[2], K, self.v.shape[3]
        self.N = B if not ctx.packed else ctx.n_docs
        self.pieces = ctx.pieces()
        self.head = not self.pieces[0][3]     # the first piece continues from the ranks before
        self.inside = self.head and len(self.pieces) == 1 and not self.pieces[0][4]
        self.threads = _threads()
        self.nm = B * self.Hv

    # -- local primitives (C)
    def _cut(self, a, b):
        return [_rows(x, a, b) for x in (self.q, self.k, self.v, self.g, self.beta)]

    def _local_cu(self, pieces):
        if len(pieces) == 1:
            return None
        a0 = pieces[0][0]
        return np.array([p[0] - a0 for p in pieces] + [pieces[-1][1] - a0], np.int64)

    def _h0_rows(self, pieces):
        """The initial states of pieces that start here (zeros without initial_state)."""
        if self.h0 is None:
            return None
        if not self.ctx.packed:
            return self.h0
        return np.ascontiguousarray(self.h0[[p[2] for p in pieces]])

    def _forward(self, pieces, h0):
        a, b = pieces[0][0], pieces[-1][1]
        return core.chunk_forward(*self._cut(a, b), h0, scale=self.scale, l2norm=self.l2norm,
                                  cu_seqlens=self._local_cu(pieces), threads=self.threads)

    def _backward(self, pieces, do, h0, dht):
        a, b = pieces[0][0], pieces[-1][1]
        return core.chunk_backward(*self._cut(a, b), _rows(do, a, b), h0, dht, scale=self.scale,
                                   l2norm=self.l2norm, cu_seqlens=self._local_cu(pieces),
                                   threads=self.threads)

    def _plan(self):
        p = core._Problem(self.q, self.k, self.v, self.g, self.beta, None, None)
        return p, core._plan(p, self.scale, self.l2norm, 64, self.threads)

    def _summary(self):
        p, plan = self._plan()
        B, Hv, K, V = self.B, self.Hv, self.K, self.V
        sa, sb = np.empty((B, Hv, K, K), np.float32), np.empty((B, Hv, K, V), np.float32)
        with plan.lock:
            L.check(L.gdn_summary(plan.h, L.f32p(sa), L.f32p(sb), ctypes.byref(core._inputs(p))),
                    "gdn_summary")
        return sa, sb

    def _adjoint(self, do):
        p, plan = self._plan()
        sg = np.empty((self.B, self.Hv, self.K, self.V), np.float32)
        with plan.lock:
            L.check(L.gdn_summary_adjoint(plan.h, L.f32p(sg), ctypes.byref(core._inputs(p)),
                                          L.f32p(do)), "gdn_summary_adjoint")
        return sg

    # -- the exchange: every rank's map (a constant one: A = 0 and a flag), or its failure
    def _exchange(self, kind, a, b, err):
        """All-gather (flag, A, B): flag 0 affine, 1 constant (A not sent: zeros), 2 this rank
        failed. Raises on every rank when any failed. Returns [(flag, A, B)] of every rank."""
        KK, KV = self.nm * self.K * self.K, self.nm * self.K * self.V
        buf = torch.zeros(1 + KK + KV, dtype=torch.float32)
        if err is not None:
            buf[0] = 2
        elif a is None:
            buf[0] = 1
            buf[1 + KK:] = torch.from_numpy(b.reshape(-1))
        else:
            buf[1:1 + KK] = torch.from_numpy(a.reshape(-1))
            buf[1 + KK:] = torch.from_numpy(b.reshape(-1))
        out = self.tr.allgather(buf)
        flags = out[:, 0].tolist()
        if err is not None:
            raise err
        bad = [r for r, f in enumerate(flags) if f == 2]
        if bad:
            raise RuntimeError(f"gdncp.torch_cp: the {kind} failed on rank {bad[0]}")
        shape_a = (self.B, self.Hv, self.K, self.K)
        shape_b = (self.B, self.Hv, self.K, self.V)
        return [(int(f), out[r, 1:1 + KK].numpy().reshape(shape_a),
                 out[r, 1 + KK:].numpy().reshape(shape_b)) for r, f in enumerate(flags)]

    def _settle(self, kind, err):
        """After the work that follows the exchange (a rank replaying the piece that continues an
        earlier rank's document, or its backward from the folded state gradient): every rank's
        status, so that a failure there (a NaN found in the replay) raises on every rank instead
        of leaving the others to wait in their next collective."""
        flags = self.tr.allgather(torch.tensor([0 if err is None else 1], dtype=torch.int64))
        if err is not None:
            raise err
        bad = [r for r, f in enumerate(flags.view(-1).tolist()) if f]
        if bad:
            raise RuntimeError(f"gdncp.torch_cp: the {kind} failed on rank {bad[0]} (in its work after "
                               "the exchange; that rank raised its own error)")

    def _fold(self, maps, order):
        """The state (or state gradient) after applying maps[j] for j in order, from zeros: the
        fold restarts at the last constant map."""
        order = list(order)
        start = max((i for i, j in enumerate(order) if maps[j][0] == 1), default=None)
        s = np.zeros((self.B, self.Hv, self.K, self.V), np.float32)
        if start is None:
            # no constant map before: impossible (rank 0 and the last rank start and end every
            # row) unless order is empty
            return s
        s = maps[order[start]][2].copy()
        for j in order[start + 1:]:
            _, a, b = maps[j]
            out = np.empty_like(s)
            L.check(_apply_map(L.f32p(out), L.f32p(np.ascontiguousarray(a)),
                               L.f32p(np.ascontiguousarray(b)), L.f32p(s), self.nm, self.K,
                               self.V), "gdn_summary_apply")
            s = out
        return s

    # -- forward
    def forward(self):
        ctx, pieces = self.ctx, self.pieces
        B, T, Hv, V = self.B, self.T, self.Hv, self.V
        o = np.empty((B, T, Hv, V), np.float32)
        ht_pieces = {}                        # piece index -> its final state [rows, Hv, K, V]
        rest = pieces[1:] if self.head else pieces
        err, a, b, self.A = None, None, None, None
        t0 = time.perf_counter()
        try:
            if self.inside:                   # every row runs through: the dense pair
                a, b = self._summary()
                self.A = a
            else:
                if rest:                      # what starts here runs now, from its own h0
                    o_r, ht_r = self._forward(rest, self._h0_rows(rest))
                    o[:, rest[0][0]:] = o_r
                    for i, p in enumerate(rest):
                        ht_pieces[pieces.index(p)] = ht_r[i:i + 1] if ctx.packed else ht_r
                    b = (ht_r[-1:] if ctx.packed else ht_r) if not rest[-1][4] else None
                if b is None:
                    b = np.zeros((B, Hv, self.K, V), np.float32)
        except Exception as e:  # noqa: BLE001 -- shared in the exchange, then raised
            err = e
        self.fold_s = time.perf_counter() - t0
        maps = self._exchange("forward", a, b, err)
        r = ctx.rank
        self.s_in = None
        try:
            if self.head:
                s = self._fold(maps, range(r))
                if ctx.fault == "drop_state":
                    s = np.zeros_like(s)
                self.s_in = s
                p0 = pieces[0]
                o_h, ht_h = self._forward([p0], s)
                o[:, p0[0]:p0[1]] = o_h
                ht_pieces[0] = ht_h
        except Exception as e:  # noqa: BLE001 -- shared below, then raised
            err = e
        self._settle("forward", err)
        ht = None
        if self.want_ht:                      # each row's final state from where it ends
            ht_all = np.zeros((self.N, Hv, self.K, V), np.float32)
            for i, p in enumerate(pieces):
                if p[4]:
                    if ctx.packed:
                        ht_all[p[2]] = ht_pieces[i][0]
                    else:
                        ht_all[:] = ht_pieces[i]
            ht = self.tr.allreduce_(torch.from_numpy(ht_all))
        return o, ht

    # -- backward
    def backward(self, do, dht):
        """do [B, T, Hv, V]; dht [N, Hv, K, V] summed over the ranks or None. Returns dq, dk, dv,
        dg, dbeta and dh0 [N, Hv, K, V] (the rows of the documents that start here) or None."""
        ctx, pieces = self.ctx, self.pieces
        B, T, Hv, K, V = self.B, self.T, self.Hv, self.K, self.V
        dq, dk = np.zeros_like(self.q), np.zeros_like(self.k)
        dv, dg, dbeta = np.zeros_like(self.v), np.zeros_like(self.g), np.zeros_like(self.beta)
        dh0 = None if self.h0 is None else np.zeros((self.N, Hv, K, V), np.float32)

        def put(a, grads):
            n = grads[0].shape[1]
            for dst, src in zip((dq, dk, dv, dg, dbeta), grads[:5]):
                dst[:, a:a + n] = src

        def dht_rows(ps, ds_out):
            """The gradient of each piece's final state: its document's dht where it ends
            here, ds_out where it goes on."""
            rows = []
            for p in ps:
                if not p[4]:
                    rows.append(ds_out)
                elif dht is None:
                    rows.append(np.zeros((B if not ctx.packed else 1, Hv, K, V), np.float32))
                else:
                    rows.append(dht[p[2]:p[2] + 1] if ctx.packed else dht)
            return np.ascontiguousarray(np.concatenate(rows, 0))

        err, a, b = None, None, None
        rest = pieces[1:] if self.head else pieces
        try:
            if self.inside:
                a = np.ascontiguousarray(np.swapaxes(self.A, -1, -2))
                b = self._adjoint(do)
            elif self.head:                   # the head piece ends here: its whole backward now
                p0 = pieces[0]
                g = self._backward([p0], do, self.s_in, dht_rows([p0], None))
                put(p0[0], g)
                b = g[5]
            else:
                b = np.zeros((B, Hv, K, V), np.float32)
        except Exception as e:  # noqa: BLE001
            err = e
        maps = self._exchange("backward", a, b, err)
        try:
            ds_out = self._fold(maps, range(ctx.world_size - 1, ctx.rank, -1))
            if ctx.fault == "drop_state_grad":
                ds_out = np.zeros_like(ds_out)
            if self.inside:
                g = self._backward(pieces, do, self.s_in, ds_out)
                put(0, g)
            elif rest:
                h0r = self._h0_rows(rest)
                if h0r is None:                   # dh0 not wanted, but the C call needs none
                    g = self._backward(rest, do, None, dht_rows(rest, ds_out))
                else:
                    g = self._backward(rest, do, h0r, dht_rows(rest, ds_out))
                    if ctx.packed:
                        dh0[[p[2] for p in rest]] = g[5]
                    else:
                        dh0[:] = g[5]
                put(rest[0][0], g)
        except Exception as e:  # noqa: BLE001
            err = e
        self._settle("backward", err)
        return dq, dk, dv, dg, dbeta, dh0


class _CPRule(torch.autograd.Function):
    @staticmethod
    def forward(fctx, q, k, v, g, beta, h0, ctx, scale, want_ht, l2norm):
        xs = [x.detach().to(torch.float32).contiguous().numpy() for x in (q, k, v, g, beta)]
        h0a = None if h0 is None else h0.detach().to(torch.float32).contiguous().numpy()
        sh = _Shard(ctx, xs, h0a, scale, l2norm, want_ht)
        o, ht = sh.forward()
        fctx.sh = sh
        fctx.in_dtypes = [None if x is None else x.dtype for x in (q, k, v, g, beta, h0)]
        return torch.from_numpy(o).to(q.dtype), ht

    @staticmethod
    def backward(fctx, do, dht):
        _no_double_backward("gdncp.torch_cp.chunk_gated_delta_rule")
        sh = fctx.sh
        do_a = (np.zeros(sh.v.shape, np.float32) if do is None
                else do.detach().to(torch.float32).contiguous().numpy())
        dht_a = None
        if sh.want_ht:   # every rank returned the final state: its gradient is the ranks' sum
            t = (torch.zeros(sh.N, sh.Hv, sh.K, sh.V) if dht is None
                 else dht.detach().to(torch.float32).contiguous().clone())
            dht_a = sh.tr.allreduce_(t).numpy()
        grads = sh.backward(do_a, dht_a)
        fctx.sh = None
        out = [None if a is None else torch.from_numpy(a).to(d)
               for a, d in zip(grads, fctx.in_dtypes)]
        return (*out, None, None, None, None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, *, cp_context, **kwargs):
    """FLA's chunk_gated_delta_rule on this rank's tokens under cp_context (collective):
    q, k [B, T_r, Hk, K], v [B, T_r, Hv, V], g, beta [B, T_r, Hv] -> (o [B, T_r, Hv, V],
    final_state [N, Hv, K, V] or None). cu_seqlens: None or the context's own (ctx.cu_seqlens,
    this rank's local offsets, as FLA passes it); packed contexts need B = 1. See the module's
    docstring for initial_state and the final state. Extra FLA keywords (cu_seqlens_cpu,
    disable_recompute, ...) are accepted and ignored."""
    ctx = _check_ctx(cp_context)
    err, sig = None, None
    try:
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            _check_tensor(name, t)
        _check_tensor("initial_state", initial_state, optional=True)
        if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
            raise ValueError(f"q, k must be [B, T_r, Hk, K] and v [B, T_r, Hv, V]; got q "
                             f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
        B, T, Hk, K = q.shape
        Hv, V = v.shape[2], v.shape[3]
        for name, t in (("g", g), ("beta", beta)):
            if tuple(t.shape) != (B, T, Hv):
                raise ValueError(f"{name} must be [B, T_r, Hv] = {(B, T, Hv)}, got {tuple(t.shape)}")
        if T != ctx.T:
            raise ValueError(f"this rank's tensors hold {T} tokens, its shard is {ctx.T} "
                             f"(cp_context.shards = {ctx.shards})")
        if Hk == 0 or Hv % Hk:
            raise ValueError(f"the value heads ({Hv}) must be a multiple of the key heads ({Hk})")
        if ctx.packed and B != 1:
            raise ValueError(f"packed documents (cu_seqlens) need B = 1, got B = {B}")
        if cu_seqlens is not None:
            cu = _cu_numpy(cu_seqlens)
            want = ctx.cu_seqlens.numpy()
            if not np.array_equal(cu, want):
                raise ValueError(f"cu_seqlens must be cp_context.cu_seqlens (this rank's local "
                                 f"offsets {want.tolist()}), got {cu.tolist()}")
            if B != 1:
                raise ValueError(f"cu_seqlens needs B = 1 (FLA's varlen form), got B = {B}: pass "
                                 "None for dense rows")
        N = ctx.n_docs if ctx.packed else B
        if initial_state is not None and tuple(initial_state.shape) != (N, Hv, K, V):
            raise ValueError(f"initial_state must be [N, Hv, K, V] = {(N, Hv, K, V)} (N: "
                             f"{'the documents' if ctx.packed else 'B'}), got "
                             f"{tuple(initial_state.shape)}")
        sig = (B, Hk, Hv, K, V, core._scale_value(scale), bool(use_qk_l2norm_in_kernel),
               bool(output_final_state))
    except (TypeError, ValueError) as e:
        err = e
    core._agree(ctx.transport, err, sig, ("B", "Hk", "Hv", "K", "V", "scale",
                                          "use_qk_l2norm_in_kernel", "output_final_state"),
                what="gdncp.torch_cp.chunk_gated_delta_rule")
    return _CPRule.apply(q, k, v, g, beta, initial_state, ctx, scale, bool(output_final_state),
                         bool(use_qk_l2norm_in_kernel))


# ---------------------------------------------------------------------------- token exchange

class _AllGather(torch.autograd.Function):
    """Every rank's equal-shape tensor stacked [D, ...] on every rank; the backward gives each
    rank the sum over the ranks of their gradients of its block (reduce_scatter)."""

    @staticmethod
    def forward(fctx, x, tr):
        fctx.tr, fctx.dtype, fctx.rank = tr, x.dtype, tr.rank
        return tr.allgather(x.detach().to(torch.float32)).to(x.dtype)

    @staticmethod
    def backward(fctx, grad):
        _no_double_backward("gdncp.torch_cp (a token exchange)")
        mine = fctx.tr.reduce_scatter(grad.detach().to(torch.float32))
        return mine.to(fctx.dtype), None


def _halo_plan(ctx, rows):
    """[(rank j, first row of j's tail, halo row)]: where each of the `rows` halo rows of this
    rank comes from (the last rows of the ranks before it; rows before the sequence: none)."""
    out, at = [], rows
    for j in range(ctx.rank - 1, -1, -1):
        n = min(ctx.shards[j], at)
        out.append((j, rows - n, at - n, n))
        at -= n
        if at == 0:
            break
    return out


class _Halo(torch.autograd.Function):
    """The `rows` token rows before this rank's x [B, T_r, C] (zeros before the sequence start):
    every rank's last rows all-gathered; the backward reduce-scatters the [D, B, rows, C]
    gradient blocks so each owner gets its rows' gradient back. Collective both ways (a Function
    of its own so that rank 0, whose halo is all zeros, still joins the backward)."""

    @staticmethod
    def forward(fctx, x, ctx, rows):
        xa = x.detach().to(torch.float32)
        B, T, C = xa.shape
        tail = torch.zeros(B, rows, C)
        n = min(T, rows)
        tail[:, rows - n:] = xa[:, T - n:]
        tails = ctx.transport.allgather(tail)            # [D, B, rows, C]
        halo = torch.zeros(B, rows, C)
        for j, src, dst, n in _halo_plan(ctx, rows):
            halo[:, dst:dst + n] = tails[j, :, src:src + n]
        fctx.meta = (ctx, rows, B, T, C, x.dtype)
        return halo.to(x.dtype)

    @staticmethod
    def backward(fctx, dhalo):
        _no_double_backward("gdncp.torch_cp.causal_conv1d (the halo)")
        ctx, rows, B, T, C, dtype = fctx.meta
        dh = dhalo.detach().to(torch.float32)
        blocks = torch.zeros(ctx.world_size, B, rows, C)
        for j, src, dst, n in _halo_plan(ctx, rows):
            blocks[j, :, src:src + n] = dh[:, dst:dst + n]
        mine = ctx.transport.reduce_scatter(blocks)       # [B, rows, C]: this rank's tail's
        dx = torch.zeros(B, T, C)
        n = min(T, rows)
        dx[:, T - n:] = mine[:, rows - n:]
        return dx.to(dtype), None, None


def _gather_tokens(x, ctx, upto):
    """[B, t, ...]: the whole sequence's tokens [0, upto) of x's every rank (x [B, T_r, ...],
    padded to the longest shard for the exchange), differentiable."""
    Tm = max(ctx.shards)
    pad = Tm - x.shape[1]
    xp = torch.cat([x, x.new_zeros((x.shape[0], pad) + tuple(x.shape[2:]))], 1) if pad else x
    full = _AllGather.apply(xp, ctx.transport)          # [D, B, Tm, ...]
    parts, at = [], 0
    for j, n in enumerate(ctx.shards):
        if at >= upto:
            break
        parts.append(full[j, :, :min(n, upto - at)])
        at += n
    return torch.cat(parts, 1)


def _doc_of(ctx, positions):
    cu = ctx.cu_seqlens_global
    return torch.from_numpy(np.searchsorted(cu, positions, side="right") - 1)


def causal_conv1d(x, weight=None, bias=None, residual=None, initial_state=None,
                  output_final_state=False, activation=None, cu_seqlens=None, *, cp_context,
                  **kwargs):
    """FLA's causal_conv1d (fla.modules.convolution) on this rank's tokens x [B, T_r, C] under
    cp_context (collective, autograd): the depthwise causal conv with weight [C, W] (or
    [C, 1, W]), optional bias [C] and residual (added after the activation, as FLA), activation
    None, "silu" or "swish". The W - 1 rows before this rank's tokens come from the ranks before
    (zeros before the sequence start); with packed documents no tap reaches across a document
    start. Returns (y [B, T_r, C], None); initial_state / output_final_state are not supported
    under CP."""
    ctx = _check_ctx(cp_context)
    err, sig = None, None
    try:
        _check_tensor("x", x)
        if x.dim() != 3 or x.shape[1] != ctx.T:
            raise ValueError(f"x must be [B, T_r, C] with T_r = {ctx.T} (this rank's shard), got "
                             f"{tuple(x.shape)}")
        _check_tensor("weight", weight)
        w = weight.reshape(weight.shape[0], -1) if weight.dim() == 3 else weight
        if w.dim() != 2 or w.shape[0] != x.shape[2]:
            raise ValueError(f"weight must be [C, W] with C = {x.shape[2]}, got {tuple(weight.shape)}")
        W = int(w.shape[1])
        if ctx.conv1d_kernel_size is not None and W != ctx.conv1d_kernel_size:
            raise ValueError(f"weight has W = {W}, cp_context was built with "
                             f"conv1d_kernel_size = {ctx.conv1d_kernel_size}")
        _check_tensor("bias", bias, optional=True)
        _check_tensor("residual", residual, optional=True)
        if activation not in (None, "silu", "swish"):
            raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
        if initial_state is not None or output_final_state:
            raise ValueError("causal_conv1d under CP takes no initial_state / output_final_state")
        if ctx.packed and x.shape[0] != 1:
            raise ValueError(f"packed documents need B = 1, got B = {x.shape[0]}")
        if cu_seqlens is not None and not np.array_equal(_cu_numpy(cu_seqlens),
                                                         ctx.cu_seqlens.numpy()):
            raise ValueError("cu_seqlens must be None or cp_context.cu_seqlens")
        sig = (int(x.shape[0]), int(x.shape[2]), W, activation in ("silu", "swish"),
               bias is not None, residual is not None)
    except (TypeError, ValueError) as e:
        err = e
    core._agree(ctx.transport, err, sig, ("B", "C", "W", "the activation (silu)", "bias given",
                                          "residual given"),
                what="gdncp.torch_cp.causal_conv1d")
    B, T, C = x.shape
    rows = W - 1
    o = ctx.offset
    if rows > 0:
        halo = _Halo.apply(x, ctx, rows)
        if ctx.fault == "drop_halo":
            halo = torch.zeros_like(halo)
        xe = torch.cat([halo, x], 1)
    else:
        xe = x
    t = torch.arange(T)
    start = None
    if ctx.packed:
        cu = ctx.cu_seqlens_global
        start = torch.from_numpy(cu[_doc_of(ctx, np.arange(o, o + T)).numpy()] - o)
    y = None
    for j in range(W):                                   # tap j reads token t - j
        tap = xe[:, rows - j:rows - j + T] * w[:, W - 1 - j]
        if start is not None and j:
            tap = tap * (t - j >= start).to(tap.dtype)[None, :, None]
        y = tap if y is None else y + tap
    if bias is not None:
        y = y + bias
    if activation in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    if residual is not None:
        y = y + residual
    return y, None


def attention(q, k, v, scale=None, *, cp_context):
    """Causal softmax attention (GQA) over the split sequence: this rank's queries q [B, T_r, H,
    d] against the keys and values [B, T_r, Hkv, d] of every token up to its own (documents
    masked when packed). Keys and values are all-gathered (gdncp's `kv` strategy), the core is
    PyTorch's scaled_dot_product_attention; their gradients return by a reduce-scatter.
    Collective, autograd. Returns o [B, T_r, H, d]."""
    ctx = _check_ctx(cp_context)
    err, sig = None, None
    try:
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_tensor(name, t)
            if t.dim() != 4 or t.shape[1] != ctx.T:
                raise ValueError(f"{name} must be [B, T_r, heads, d] with T_r = {ctx.T}, got "
                                 f"{tuple(t.shape)}")
        B, T, H, d = q.shape
        if k.shape != v.shape or k.shape[0] != B or k.shape[3] != d or H % k.shape[2]:
            raise ValueError(f"k and v must be [B, T_r, Hkv, d] with Hkv dividing H = {H}; got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if scale is not None and not (float(scale) > 0 and np.isfinite(float(scale))):
            raise ValueError(f"scale must be a positive finite number, got {scale}")
        sig = (B, H, int(k.shape[2]), d, None if scale is None else float(scale))
    except (TypeError, ValueError) as e:
        err = e
    core._agree(ctx.transport, err, sig, ("B", "H", "Hkv", "d", "scale"),
                what="gdncp.torch_cp.attention")
    B, T, H, d = q.shape
    o = ctx.offset
    K = _gather_tokens(k, ctx, o + T)
    V = _gather_tokens(v, ctx, o + T)
    qi = torch.arange(o, o + T)[:, None]
    kj = torch.arange(o + T)[None, :]
    mask = kj <= qi
    if ctx.fault == "drop_kv":
        mask = mask & (kj >= o)
    if ctx.packed:
        doc = _doc_of(ctx, np.arange(o + T))
        mask = mask & (doc[None, :] == doc[o:o + T, None])
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), K.transpose(1, 2).to(q.dtype), V.transpose(1, 2).to(q.dtype),
        attn_mask=mask, scale=scale, enable_gqa=H != k.shape[2])
    return out.transpose(1, 2)
