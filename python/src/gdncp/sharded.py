"""Data-parallel training of a gdncp.Model with its training state sharded over the ranks
(ZeRO levels 0-2, DESIGN §15), over an mpi4py communicator or a torch.distributed (gloo) group.

    opt = model.adamw(lr=1e-3, group=MPI.COMM_WORLD, zero=1)   # or group=dist.group.WORLD
    for batch in my_batches:             # each rank its own [B, T] token ids
        loss = opt.step(batch)           # the loss of every rank's batch together

A step is `gdncp train`'s over the group: every rank runs the forward and backward of its own batch
with the loss's denominator the token count of all the ranks' batches (and, for an MoE model with
the aux loss, the routers' statistics summed over the ranks before the backward), so the summed
gradient is the one of the mean loss over all of them: one process stepping on the ranks' batches
stacked gives the same weights within rounding (a different summation order). The gradient of
element range [i n / N, (i + 1) n / N) of the flat parameter array (n = model.grad_size, N ranks:
uneven slices are fine) is summed onto its owner, rank i (MPI_Reduce / dist.reduce, in pieces of
at most 2^24 floats); the gradient norm is the sum of the owners' slices' squares.

    zero=0  every rank holds the moments of every parameter; the summed gradient is broadcast
            from the owners and every rank applies the whole update (replicated state)
    zero=1  each rank holds only its slice's moments (2 n / N floats instead of 2 n), updates
            its slice of the weights and broadcasts it (the weights all-gathered)
    zero=2  as 1, and the summed gradient stays on its owner (no gradient broadcast: half of
            level 1's traffic); opt.grad is then the sum only on [lo, hi) = opt.slice

Levels 0, 1 and 2 are the same arithmetic in the same order: bit for bit the same weights and
losses, as in the C trainer. Level 3 (only a slice of the weights between uses) is the C
trainer's (`gdncp train --zero 3`): gdncp.Model's forward reads its whole weight array.

Every rank of the group makes the optimizer and calls step alike (collective). The ranks agree
before anything moves: the model's configuration, the settings and a digest of every weight when
the optimizer is made; each step's lr, compute and recompute, and whether each phase (the batch's
checks, the forward, the backward) succeeded on every rank. A failure on one rank raises on every
rank (the failing one its own exception, the others a RuntimeError naming its rank), before any
weight changes; a loss or gradient norm that is not finite raises FloatingPointError on every
rank, the weights and moments unchanged. No rank waits for ever on another's error.
"""
import hashlib
import math
import numbers

import ctypes
import numpy as np

from . import _lib as L
from .model import AdamW, Model, _float_arg

__all__ = ["ShardedAdamW", "FAULTS", "set_test_fault"]

# Collectives move at most this many floats at a time (MPI counts are ints; the root's scratch
# of a reduce over mpi4py is one piece: 64 MiB).
_PIECE = 1 << 24

# Deliberate mistakes for the negative controls (set_test_fault): the weights not all-gathered
# after the update (the other ranks' slices a step stale), one rank's gradient left out of the
# sums, this rank's slice updated twice.
FAULTS = ("weights not gathered", "one rank's gradient left out", "a slice updated twice")


class _MPIGroup:
    """The collectives over a duplicate of an mpi4py intracommunicator."""
    name = "mpi4py"

    def __init__(self, comm):
        MPI = self.MPI = _mpi4py()
        if comm == MPI.COMM_NULL or comm.Is_inter():
            raise ValueError("gdncp.sharded needs an mpi4py intracommunicator")
        self.comm = comm.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._scratch = None

    def allgather(self, obj):
        return self.comm.allgather(obj)

    def reduce(self, a, root):   # a: float32 numpy, summed into root's a
        # not MPI_IN_PLACE: MPICH 4.0's MPI_Reduce in place at a root other than 0 writes
        # through a wild pointer (segfault, 3 ranks, any count); the sum lands in a scratch piece
        if self.rank == root:
            if self._scratch is None or self._scratch.size < a.size:
                self._scratch = np.empty(min(max(a.size, 1 << 16), _PIECE), np.float32)
            out = self._scratch[:a.size]
            self.comm.Reduce(a, out, op=self.MPI.SUM, root=root)
            a[:] = out
        else:
            self.comm.Reduce(a, None, op=self.MPI.SUM, root=root)

    def bcast(self, a, root):
        self.comm.Bcast(a, root=root)


class _TorchGroup:
    """The collectives over a torch.distributed process group (gloo: the CPU's)."""
    name = "torch.distributed"

    def __init__(self, group):
        import torch
        import torch.distributed as dist
        if not dist.is_initialized():
            raise RuntimeError("gdncp.sharded: torch.distributed is not initialised (call "
                               "dist.init_process_group('gloo', ...) first, e.g. under torchrun)")
        backend = str(dist.get_backend(group)).lower()
        if backend != "gloo" and "cpu:gloo" not in backend:
            raise ValueError(f"gdncp.sharded runs on the CPU over a gloo process group; this "
                             f"group's backend is {backend!r} (make one with "
                             "dist.new_group(backend='gloo'))")
        self.torch, self.dist, self.group = torch, dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.ranks = [dist.get_global_rank(group, r) for r in range(self.size)]

    def allgather(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def reduce(self, a, root):
        self.dist.reduce(self.torch.from_numpy(a), dst=self.ranks[root],
                         op=self.dist.ReduceOp.SUM, group=self.group)

    def bcast(self, a, root):
        self.dist.broadcast(self.torch.from_numpy(a), src=self.ranks[root], group=self.group)


def _mpi4py():
    from mpi4py import MPI
    return MPI


def _group(group):
    """The collectives of group: an mpi4py communicator or a torch.distributed ProcessGroup."""
    try:
        if isinstance(group, _mpi4py().Comm):
            return _MPIGroup(group)
    except ImportError:
        pass
    try:
        import torch.distributed as dist
        if dist.is_available() and isinstance(group, dist.ProcessGroup):
            return _TorchGroup(group)
    except ImportError:
        pass
    raise TypeError(f"group must be an mpi4py communicator or a torch.distributed ProcessGroup "
                    f"(e.g. dist.group.WORLD), not {type(group).__name__}")


def _config_fields(cfg):
    """The C model configuration as comparable values (every field but pointers)."""
    out = []
    for name, typ in cfg._fields_:
        v = getattr(cfg, name)
        if isinstance(v, ctypes.Array):
            v = list(v)
        elif not isinstance(v, (numbers.Number, bytes)):
            continue
        out.append((name, v))
    return out


class ShardedAdamW(AdamW):
    """AdamW over the ranks of `group`, each stepping on its own batch, the training state
    sharded by `zero` (see the module's text). Made by Model.adamw(..., group=, zero=).

    Attributes as AdamW's, and: zero; rank, size (in the group); slice = (lo, hi), this rank's
    flat elements (its moments' span at zero >= 1: exp_avg[i] is element lo + i); transport
    ("mpi4py" or "torch.distributed"). grad is this rank's own batch's gradient until the sums,
    then the summed gradient where this rank has it (everywhere at zero <= 1, on slice at 2)."""

    def __init__(self, model, group, zero=0, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, clip=0.0):
        if not isinstance(model, Model):
            raise TypeError(f"ShardedAdamW needs a gdncp.Model, not {type(model).__name__}")
        g = self._g = _group(group)
        self.rank, self.size, self.transport = g.rank, g.size, g.name
        self._fault = None
        err, settings, digest = None, None, None
        try:
            if isinstance(zero, bool) or not isinstance(zero, numbers.Integral):
                raise TypeError(f"zero must be an int (0, 1 or 2), not {type(zero).__name__}")
            if zero == 3:
                raise ValueError("zero=3 keeps only a slice of the weights between uses, and "
                                 "gdncp.Model's forward reads its whole weight array: level 3 is "
                                 "`gdncp train --zero 3` (the C trainer); from Python, zero=2 "
                                 "shards the moments and the gradient's sums")
            if not 0 <= zero <= 2:
                raise ValueError(f"zero = {zero}: expected 0 (replicated), 1 (the moments sharded) "
                                 "or 2 (and the gradient's sums)")
            self.zero = int(zero)
            model._live()
            n = model.grad_size
            self._bounds = [i * n // g.size for i in range(g.size + 1)]
            lo, hi = self.slice = (self._bounds[g.rank], self._bounds[g.rank + 1])
            AdamW.__init__(self, model, lr, betas, eps, weight_decay, clip,
                           _moments=(lo, hi) if self.zero else None)
            settings = dict(zero=self.zero, lr=self.lr, betas=self.betas, eps=self.eps,
                            weight_decay=self.weight_decay, clip=self.clip, floats=n,
                            config=_config_fields(model._cfg))
            with model._lock:   # every tensor (not the padding between them: never written)
                h = hashlib.blake2b(digest_size=16)
                for _, o, k, _ in model._tensors():
                    h.update(memoryview(model._w[o:o + k]))
                digest = h.hexdigest()
        except Exception as e:
            err = e
        got = self._agree("making the optimizer", err, (settings, digest))
        for k, (s, d) in enumerate(got):
            for key in settings:
                if s[key] != settings[key]:
                    raise ValueError(f"gdncp.sharded: the ranks disagree on {key}: rank {k} has "
                                     f"{_short(s[key])}, rank {g.rank} has {_short(settings[key])}")
            if d != digest:
                raise ValueError(f"gdncp.sharded: rank {k}'s weights differ from rank {g.rank}'s "
                                 "(every rank must start from the same checkpoint: load the same "
                                 "one everywhere)")

    def _agree(self, what, err, payload):
        """Every rank's payload, once every rank has reached this point; raises on every rank if
        one failed on its way here: the failing rank its own exception, the others one naming it."""
        msg = None if err is None else f"{type(err).__name__}: {err}"
        got = self._g.allgather((msg, payload))
        if err is not None:
            raise err
        for k, (m, _) in enumerate(got):
            if m is not None:
                raise RuntimeError(f"gdncp.sharded: rank {k} of the group ({self.transport}) failed "
                                   f"{what}: {m}")
        return [p for _, p in got]

    def _pieces(self, owner):
        """The (a, b) element ranges, at most _PIECE long, of owner's slice."""
        lo, hi = self._bounds[owner], self._bounds[owner + 1]
        return [(a, min(a + _PIECE, hi)) for a in range(lo, hi, _PIECE)]

    def _each_piece(self, flat, op):
        for owner in range(self.size):
            for a, b in self._pieces(owner):
                op(flat[a:b], owner)

    def step(self, input_ids, compute="fp32", recompute=False, lr=None):
        """One step on this rank's batch input_ids [B, T] (the ranks' shapes may differ) and
        every other rank's: the loss over all of them (returned on every rank, before the
        update), the summed gradient, clipping, the AdamW update. Collective."""
        m, g = self._model, self._g
        with m._lock:
            err, st, key = None, None, None
            try:
                lr = self.lr if lr is None else _float_arg("lr", lr, lambda v: v >= 0,
                                                           "a finite learning rate >= 0")
                key = (lr, compute, bool(recompute), self.steps)
                st = m._train_prepare(input_ids, compute, bool(recompute))
            except Exception as e:
                err = e
            got = self._agree("checking its batch", err, (key, st.denom if st else 0.0))
            for k, (other, _) in enumerate(got):
                if other != key:
                    raise ValueError(f"gdncp.sharded: the ranks' steps disagree: rank {k} steps "
                                     f"with (lr, compute, recompute, step) = {other}, rank "
                                     f"{g.rank} with {key}")
            denom = sum(d for _, d in got)          # every rank's predicted tokens

            stats = None
            try:
                loss_sum = m._train_forward(st, denom, True)
                if st.aux:
                    stats = np.empty(2 * m._cfg.n_experts + 1, np.float64)
                    L.check(L.gdn_model_router_stats(st.plan, L.f64p(stats)), "router statistics")
            except Exception as e:
                err = e
            got = self._agree("in its forward", err, (loss_sum if err is None else 0.0, stats))
            loss_sum = 0.0
            for s, _ in got:                        # in rank order: the same sum on every rank
                loss_sum += s
            if st.aux:                               # the aux loss of every rank's rows together
                total = np.zeros_like(stats)
                for _, s in got:
                    total += s
                L.check(L.gdn_model_set_router_stats(st.plan, L.f64p(total)), "router statistics")
            loss = loss_sum / denom + m._aux_loss(st)

            try:
                m._train_backward(st, self.grad)
                if self._fault == FAULTS[1] and g.rank == g.size - 1:
                    self.grad[:] = 0
            except Exception as e:
                err = e
            self._agree("in its backward", err, None)

            # sums onto the owners; the norm from the owned slices
            self._each_piece(self.grad, g.reduce)
            lo, hi = self.slice
            ss = (ctypes.c_double * 2)()
            L.gdn_grad_sumsq_range(ctypes.byref(m._cfg), L.f32p(self.grad[lo:]), lo, hi, ss)
            sumsq = 0.0
            for s in g.allgather(ss[0] + ss[1]):
                sumsq += s
            gnorm = self.grad_norm = math.sqrt(sumsq)
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                raise FloatingPointError(f"gdncp AdamW step {self.steps + 1}: the loss ({loss}) or the "
                                         f"gradient norm ({gnorm}) is not finite over the {g.size} "
                                         "ranks; the update was not applied (training diverged: "
                                         "lower lr)")
            scale = self.clip / gnorm if self.clip > 0 and gnorm > self.clip else 1.0
            if self.zero <= 1:
                self._each_piece(self.grad, g.bcast)
            a, t = self._config(lr), m._omp_threads()
            for _ in range(2 if self._fault == FAULTS[2] else 1):
                if self.zero == 0:
                    L.gdn_adamw_update(ctypes.byref(a), ctypes.byref(m._cfg), L.f32p(m._w),
                                       L.f32p(self.grad), L.f32p(self.exp_avg),
                                       L.f32p(self.exp_avg_sq), self.steps + 1, lr, scale, t)
                else:
                    L.gdn_adamw_update_range(ctypes.byref(a), ctypes.byref(m._cfg), L.f32p(m._w[lo:]),
                                             L.f32p(self.grad[lo:]), L.f32p(self.exp_avg),
                                             L.f32p(self.exp_avg_sq), lo, hi, self.steps + 1, lr,
                                             scale, t)
            if self.zero >= 1 and self._fault != FAULTS[0]:
                self._each_piece(m._w, g.bcast)
            self.steps += 1
        return loss


def _short(v):
    s = repr(v)
    return s if len(s) <= 200 else s[:200] + "..."


def set_test_fault(opt, fault):
    """Testing hook (negative controls): make opt's steps deliberately wrong through the real code
    path, one of FAULTS, or None to stop."""
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}: one of {FAULTS}")
    opt._fault = fault
