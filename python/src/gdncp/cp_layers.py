"""gdncp's two Qwen3.5 token mixers over an mpi4py communicator, as PyTorch autograd functions:
the GatedDeltaNet layer (gdn_layer_cp_forward/backward: the conv's halo from the previous ranks,
the rule under a CP strategy) and the gated full-attention layer (gdn_attn_cp_forward/backward:
keys and values passed along the ranks, or head-parallel; RoPE at global positions), each with
its weights as one flat fp32 vector in the C layout. gdncp.transformers.patch(comm=...) runs
transformers' layers through them; they are usable on their own:

    shard = Shard(comm, B, T_local)                  # collective: the ranks' token ranges
    y = gdn_layer(x, weights_flat, shard, LayerDims(...))
    y = attention_layer(x, weights_flat, shard, AttnDims(...))

`weights_flat` is built from the module's own parameters by flat_params() (differentiable, so
the weight gradient flows back to each parameter, fused or not). The weight gradient a rank gets
is its share (its tokens' contribution); sum it over the ranks for the whole sequence's, as for
any data-parallel gradient. Calls are collective, forward and backward alike: every rank runs
the same layers in the same order (the same model on its own tokens).
"""
import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from . import _lib as L
from . import core
from ._plans import PLANS, Plan
from .torch import _no_double_backward

__all__ = ["Shard", "LayerDims", "AttnDims", "flat_params", "gdn_layer", "attention_layer",
           "GDN_STRATEGIES", "ATTN_STRATEGIES"]

GDN_STRATEGIES = core.STRATEGIES
ATTN_STRATEGIES = ("kv", "heads")


def check_options(gdn, attention, compute):
    """ValueError unless gdn is one of GDN_STRATEGIES, attention one of ATTN_STRATEGIES and
    compute 'fp32' or 'bf16'."""
    if not isinstance(gdn, str) or gdn not in GDN_STRATEGIES:
        raise ValueError(f"unknown GatedDeltaNet CP strategy {gdn!r}: use one of "
                         f"{', '.join(GDN_STRATEGIES)}")
    if attention not in ATTN_STRATEGIES:
        raise ValueError(f"unknown attention CP strategy {attention!r}: use one of "
                         f"{', '.join(ATTN_STRATEGIES)}")
    if compute not in ("fp32", "bf16"):
        raise ValueError(f"compute must be 'fp32' or 'bf16', got {compute!r}")


class Shard:
    """This rank's place in the sequence: B rows, its T_local tokens at offset `offset` of the
    whole `total`, the ranks' shard lengths, and the packing (cu_seqlens of the whole stream,
    B = 1) or the position of token 0 (pos_offset, dense). Made collectively (one allgather);
    the strategies: gdn one of GDN_STRATEGIES, attention one of ATTN_STRATEGIES."""

    def __init__(self, comm, B, T_local, cu_seqlens=None, pos_offset=0, gdn="scan",
                 attention="kv", compute="fp32", threads=0, error=None):
        st = core._comm_state(comm)
        self.st, self.rank, self.size = st, st.rank, st.size
        err = error
        sig = None
        try:
            if err is not None:
                raise err
            check_options(gdn, attention, compute)
            if B < 1 or T_local < 1:
                raise ValueError(f"every rank needs at least one token (B = {B}, T = {T_local})")
            cu = None
            if cu_seqlens is not None:
                cu = core._cp_cu(cu_seqlens, B)
            sig = (gdn, attention, compute, B, -1 if cu is None else cu.size - 1,
                   None if cu is None else cu.tobytes(), int(pos_offset))
        except Exception as e:  # noqa: BLE001 -- shared with every rank, then re-raised
            err = e
        names = ("the GatedDeltaNet strategy", "the attention strategy", "compute",
                 "the batch size B (every rank passes the same rows)",
                 "the number of documents (-1: dense)", "the documents' offsets",
                 "the position of the first token")
        self.shards = core._agree(st, err, sig, names, int(T_local))
        self.offset = sum(self.shards[:self.rank])
        self.total = sum(self.shards)
        self.B, self.T = int(B), int(T_local)
        self.cu = cu
        if cu is not None and cu[-1] != self.total:
            raise ValueError(f"the documents end at {int(cu[-1])} but the {self.size} ranks hold "
                             f"{self.total} tokens ({self.shards})")
        self.pos_offset = int(pos_offset)
        self.gdn, self.attention, self.compute = gdn, attention, compute
        self.threads = int(threads)
        self.cp = st.cp()   # collective on first use (agreed above)


@dataclass(frozen=True)
class LayerDims:
    """The GatedDeltaNet layer's dimensions (gdn_layer_config)."""
    E: int
    Hk: int
    Hv: int
    K: int
    V: int
    Kc: int = 4
    eps: float = 1e-6


@dataclass(frozen=True)
class AttnDims:
    """The gated attention layer's (gdn_attn_config): R rotary dims, max_position 0 = none."""
    E: int
    H: int
    Hkv: int
    d: int
    R: int
    rope_theta: float = 10000.0
    eps: float = 1e-6
    max_position: int = 0


def _layer_cfg(dims, shard, cu):
    """cu: the offsets the config points to (the plan's own copy of shard.cu, or None)."""
    c = L.gdn_layer_config_default(shard.B, shard.T, dims.E, dims.Hk, dims.Hv, dims.K, dims.V)
    c.Kc, c.eps, c.threads = dims.Kc, dims.eps, shard.threads
    c.check_finite = 1
    c.compute = 1 if shard.compute == "bf16" else 0
    c.cp = core._strategy_id(shard.gdn)   # the rule's CP strategy (agreed)
    if cu is not None:
        c.cu_seqlens = cu.ctypes.data_as(L.P_int64)
        c.n_docs = cu.size - 1
        c.seq_offset = shard.offset   # dense: the layer finds its place from the shards
    return c


def _attn_cfg(dims, shard, cu):
    c = L.gdn_attn_config_default(shard.B, shard.T, dims.E, dims.H, dims.Hkv, dims.d)
    c.R, c.rope_theta, c.eps, c.threads = dims.R, dims.rope_theta, dims.eps, shard.threads
    c.check_finite = 1
    c.max_position = dims.max_position
    c.cp = L.gdn_attn_cp_strategy_parse(shard.attention.encode())
    c.compute = 1 if shard.compute == "bf16" else 0
    if cu is not None:
        c.cu_seqlens = cu.ctypes.data_as(L.P_int64)
        c.n_docs = cu.size - 1
    else:
        c.pos_offset = shard.pos_offset
    c.seq_offset = shard.offset
    return c


def layout(kind, dims):
    """[(Hugging Face name, shape, offset)] of the flat vector and its length, for kind 'gdn' or
    'attention'."""
    if kind == "gdn":
        c = L.gdn_layer_config_default(1, 1, dims.E, dims.Hk, dims.Hv, dims.K, dims.V)
        c.Kc = dims.Kc
        n, param, total = L.GDN_P_COUNT, L.gdn_layer_param, L.gdn_layer_param_floats
    else:
        c = L.gdn_attn_config_default(1, 1, dims.E, dims.H, dims.Hkv, dims.d)
        c.R = dims.R
        n, param, total = L.GDN_A_COUNT, L.gdn_attn_param, L.gdn_attn_param_floats
    out = [L.param_info(param, c, i)[:3] for i in range(n)]
    return out, int(total(ctypes.byref(c)))


def flat_params(kind, dims, tensors):
    """The flat fp32 weight vector of a layer from {Hugging Face name: tensor} (every name of
    layout(kind, dims)), by torch.cat: differentiable, so the gradient of the flat vector reaches
    each tensor (and through views, the fused parameters they came from)."""
    entries, total = layout(kind, dims)
    parts, at = [], 0
    ref = next(iter(tensors.values()))
    for name, shape, off in entries:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"gdncp: the {kind} layer needs its {name}")
        if tuple(t.shape) != shape:
            raise ValueError(f"gdncp: {name} has shape {tuple(t.shape)}, the layer's config wants "
                             f"{shape}")
        if off > at:
            parts.append(torch.zeros(off - at, dtype=torch.float32, device=ref.device))
        parts.append(t.reshape(-1).to(torch.float32))
        at = off + int(np.prod(shape))
    if total > at:
        parts.append(torch.zeros(total - at, dtype=torch.float32, device=ref.device))
    return torch.cat(parts)


_PLAN_CACHE = 16


def _plan(kind, dims, shard):
    """The plan of this rank's shard (made locally; a failure on one rank is every rank's):
    gdncp._plans.PLANS, kind "cp-gdn" or "cp-attn"; plan.saved: its saved floats."""
    key = ("cp-" + kind, dims, shard.B, shard.T, shard.offset, shard.pos_offset, shard.gdn, shard.attention,
           shard.compute, shard.threads, None if shard.cu is None else shard.cu.tobytes())

    def make():
        cu = None if shard.cu is None else shard.cu.copy()   # alive as long as the plan
        cfg = (_layer_cfg if kind == "gdn" else _attn_cfg)(dims, shard, cu)
        create, destroy = ((L.gdn_layer_plan_create, L.gdn_layer_plan_destroy) if kind == "gdn"
                           else (L.gdn_attn_plan_create, L.gdn_attn_plan_destroy))
        plan = Plan(create, destroy, cfg, f"gdncp CP {kind} plan", keep=cu)
        plan.saved = (L.describe(L.gdn_layer_plan_describe, L.LayerPlanInfo, plan.h) if kind == "gdn"
                      else L.describe(L.gdn_attn_plan_describe, L.AttnPlanInfo, plan.h)).saved_floats
        return plan
    err, status, plan = None, L.GDN_OK, None
    try:
        plan = PLANS.get(key, make, _PLAN_CACHE)
    except Exception as e:  # noqa: BLE001
        err, status = e, getattr(e, "status", L.GDN_ERR_MPI)
    status = L.gdn_cp_agree_status(shard.cp, status)
    if err is not None:
        raise err
    L.check(status, f"gdncp CP {kind} (another rank failed to make its plan)")
    return plan


class _MixerCP(torch.autograd.Function):
    """y = layer(x; w) on this rank's shard; the backward is the C layer's CP backward."""

    @staticmethod
    def forward(ctx, x, w, kind, dims, shard):
        plan = _plan(kind, dims, shard)
        xa = x.detach().to(torch.float32).contiguous()
        wa = w.detach().to(torch.float32).contiguous()
        y = torch.empty_like(xa)
        saved = np.empty(plan.saved, np.float32)
        fwd = L.gdn_layer_cp_forward if kind == "gdn" else L.gdn_attn_cp_forward
        wp = wa.numpy().ctypes.data_as(ctypes.c_void_p if kind == "gdn" else L.P_float)
        with plan.lock:
            L.check(fwd(shard.cp, plan.h, L.f32p(y.numpy()), L.f32p(saved), L.f32p(xa.numpy()), wp),
                    f"gdncp CP {kind} forward")
        ctx.keep = (plan, shard, kind, xa, wa, saved, x.dtype)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        _no_double_backward("gdncp CP layer (GatedDeltaNet or attention)")
        plan, shard, kind, xa, wa, saved, dtype = ctx.keep
        dya = dy.detach().to(torch.float32).contiguous()
        dx, dw = torch.empty_like(xa), torch.empty_like(wa)
        bwd = L.gdn_layer_cp_backward if kind == "gdn" else L.gdn_attn_cp_backward
        with plan.lock:
            L.check(bwd(shard.cp, plan.h, L.f32p(dx.numpy()), L.f32p(dw.numpy()), L.f32p(xa.numpy()),
                        L.f32p(wa.numpy()), L.f32p(saved), L.f32p(dya.numpy())),
                    f"gdncp CP {kind} backward")
        ctx.keep = None
        return dx.to(dtype), dw, None, None, None


def _check_x(x, shard, E):
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or tuple(x.shape) != (shard.B, shard.T, E):
        raise ValueError(f"gdncp CP: x must be [B, T_local, E] = [{shard.B}, {shard.T}, {E}], got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.device.type != "cpu":
        raise ValueError(f"gdncp runs on the CPU; x is on {x.device}")


def gdn_layer(x, w, shard, dims):
    """The GatedDeltaNet layer (Qwen3.5's linear_attn) on this rank's x [B, T_local, E], the
    sequence split as `shard` says; w the flat weights (flat_params('gdn', dims, ...)).
    Collective."""
    _check_x(x, shard, dims.E)
    return _MixerCP.apply(x, w, "gdn", dims, shard)


def attention_layer(x, w, shard, dims):
    """Qwen3.5's gated full-attention layer (self_attn) on this rank's x [B, T_local, E] at the
    global positions of `shard`; w from flat_params('attention', dims, ...). Collective."""
    _check_x(x, shard, dims.E)
    return _MixerCP.apply(x, w, "attention", dims, shard)
