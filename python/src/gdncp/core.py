"""NumPy entry points: the chunked kernel (forward, backward, decode step), its float64 oracle,
and the Qwen3.5 GatedDeltaNet layer. Layouts are the C library's (BTHD, DESIGN §1):

    q, k [B,T,Hk,K]; v, o [B,T,Hv,V]; g, beta [B,T,Hv]; states h0, ht [N,Hv,K,V]

with N = B, or the number of documents when cu_seqlens packs several into one row (B = 1).
Value head j uses key head j // (Hv // Hk). float32 C-contiguous arrays are passed to C without a
copy; other float dtypes and strided views are converted (one copy), anything else is refused.
"""
import ctypes
import math
import threading

import numpy as np

from . import _lib as L
from ._plans import PLANS, Plan, config_key

__all__ = ["chunk_forward", "chunk_backward", "reference_forward", "reference_backward",
           "step", "Layer", "layer_param_names"]


# ----------------------------------------------------------------------------- input checking

def _array(name, a, dtype):
    """a as a C-contiguous array of dtype: no copy when it already is one."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, not {type(a).__name__}")
    if not np.issubdtype(a.dtype, np.floating):
        raise TypeError(f"{name} must hold floating-point values, not {a.dtype}")
    return np.ascontiguousarray(a, dtype=dtype)


def _shape(name, a, want):
    """Check a's shape against want (ints, or None for 'any'); names the first mismatch."""
    if a.ndim != len(want):
        raise ValueError(f"{name} must have {len(want)} dimensions {_fmt(want)}, "
                         f"got shape {tuple(a.shape)}")
    for i, (got, w) in enumerate(zip(a.shape, want)):
        if w is not None and got != w:
            raise ValueError(f"{name} has shape {tuple(a.shape)}: dimension {i} is {got}, "
                             f"expected {w} ({_fmt(want)})")


def _fmt(want):
    return "[" + ",".join("*" if w is None else str(w) for w in want) + "]"


def _cu(cu_seqlens, B, T):
    """cu_seqlens as a C-contiguous int64 array, checked enough to give a Python message (the
    library checks the rest)."""
    if cu_seqlens is None:
        return None
    cu = np.ascontiguousarray(np.asarray(cu_seqlens), dtype=np.int64)
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"cu_seqlens must be a 1-D array of n_docs + 1 offsets, got shape {cu.shape}")
    if B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (the documents packed in one row), got B = {B}")
    if cu[0] != 0 or cu[-1] != T or np.any(np.diff(cu) <= 0):
        raise ValueError(f"cu_seqlens must start at 0, increase strictly and end at T = {T}; "
                         f"got {cu.tolist() if cu.size <= 16 else cu[:16].tolist() + ['...']}")
    return cu


class _Problem:
    """The kernel's inputs checked against each other, as float32 (or float64 for the oracle)."""

    def __init__(self, q, k, v, g, beta, h0, cu_seqlens, dtype=np.float32):
        self.q = _array("q", q, dtype)
        if self.q.ndim != 4:
            raise ValueError(f"q must be [B,T,Hk,K], got shape {tuple(self.q.shape)}")
        B, T, Hk, K = self.q.shape
        self.k = _array("k", k, dtype)
        _shape("k", self.k, (B, T, Hk, K))
        self.v = _array("v", v, dtype)
        _shape("v", self.v, (B, T, None, None))
        Hv, V = self.v.shape[2], self.v.shape[3]
        if Hk == 0 or Hv % Hk:
            raise ValueError(f"the value heads (v: {Hv}) must be a multiple of the key heads "
                             f"(q, k: {Hk})")
        self.g = _array("g", g, dtype)
        _shape("g", self.g, (B, T, Hv))
        self.beta = _array("beta", beta, dtype)
        _shape("beta", self.beta, (B, T, Hv))
        self.cu = _cu(cu_seqlens, B, T)
        self.N = B if self.cu is None else self.cu.size - 1
        self.h0 = None
        if h0 is not None:
            self.h0 = _array("initial_state (h0)", h0, dtype)
            _shape("initial_state (h0)", self.h0, (self.N, Hv, K, V))
        self.B, self.T, self.Hk, self.Hv, self.K, self.V = B, T, Hk, Hv, K, V
        self.dtype = dtype

    def state_shape(self):
        return (self.N, self.Hv, self.K, self.V)

    def grad_input(self, name, a, shape):
        if a is None:
            return None
        a = _array(name, a, self.dtype)
        _shape(name, a, shape)
        return a


def _scale_value(scale):
    if scale is None:
        return 0.0  # GDN_SCALE_DEFAULT: 1/sqrt(K)
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def _config(p, scale, l2norm, chunk, threads, seq_offset=0, strategy=0):
    cfg = L.gdn_config_default(p.B, p.T, p.Hk, p.Hv, p.K, p.V)
    cfg.cp = int(strategy)   # its CP calls' strategy (gdn_cp_strategy); one rank ignores it
    cfg.scale = _scale_value(scale)
    cfg.l2norm = 1 if l2norm else 0
    cfg.chunk = int(chunk)
    cfg.threads = int(threads)
    if p.cu is not None:
        cfg.cu_seqlens = p.cu.ctypes.data_as(L.P_int64)
        cfg.n_docs = p.cu.size - 1
        cfg.seq_offset = int(seq_offset)
    return cfg


# ----------------------------------------------------------------------------- plans

_PLAN_CACHE = 8  # plans hold workspace: a few shapes (a model's layers share one) are enough


def _plan(p, scale, l2norm, chunk, threads, seq_offset=0, strategy=0):
    """The kernel plan of this problem and these options (gdncp._plans.PLANS, kind "rule")."""
    key = ("rule", p.B, p.T, p.Hk, p.Hv, p.K, p.V, _scale_value(scale), bool(l2norm), int(chunk),
           int(threads), None if p.cu is None else p.cu.tobytes(), int(seq_offset), int(strategy))
    # the plan copies the offsets; p.cu is kept with it only for the config's pointer
    return PLANS.get(key, lambda: Plan(L.gdn_plan_create, L.gdn_plan_destroy,
                                       _config(p, scale, l2norm, chunk, threads, seq_offset, strategy),
                                       "gdn_plan_create", keep=p.cu), _PLAN_CACHE)


# ----------------------------------------------------------------------------- the kernel

def _inputs(p, f64=False):
    """The problem's arrays as the rule's input bundle (gdn_rule_inputs; h0 None: zeros)."""
    return L.rule_inputs(p.q, p.k, p.v, p.g, p.beta, p.h0, f64=f64)


def chunk_forward(q, k, v, g, beta, h0=None, *, scale=None, l2norm=True, cu_seqlens=None,
                  chunk=64, threads=0, output_final_state=True, save=False):
    """The gated delta rule forward (the fast fp32 chunked path).

    Returns (o [B,T,Hv,V], ht [N,Hv,K,V] or None); with save=True also the checkpoint array
    that chunk_backward(..., saved=...) starts from (no forward sweep in the backward).
    l2norm: the in-kernel L2 norm of q and k (Qwen's use_qk_l2norm_in_kernel); scale None means
    1/sqrt(K); cu_seqlens packs documents in one row (B = 1), each starting from h0[d] or zeros.
    """
    p = _Problem(q, k, v, g, beta, h0, cu_seqlens)
    plan = _plan(p, scale, l2norm, chunk, threads)
    o = np.empty((p.B, p.T, p.Hv, p.V), np.float32)
    ht = np.empty(p.state_shape(), np.float32) if output_final_state else None
    with plan.lock:
        if save:
            ck = np.empty(L.describe(L.gdn_plan_describe, L.PlanInfo, plan.h).checkpoint_floats, np.float32)
            L.check(L.gdn_forward_save(plan.h, L.f32p(o), L.f32p(ht), L.f32p(ck),
                                       ctypes.byref(_inputs(p))), "gdn_forward_save")
            return o, ht, ck
        L.check(L.gdn_forward(plan.h, L.f32p(o), L.f32p(ht), ctypes.byref(_inputs(p))),
                "gdn_forward")
    return o, ht


def chunk_backward(q, k, v, g, beta, do, h0=None, dht=None, *, scale=None, l2norm=True,
                   cu_seqlens=None, chunk=64, threads=0, saved=None):
    """Gradients of loss = sum(o * do) + sum(ht * dht) with respect to the (un-normalised) q, k
    and to v, g, beta, h0: returns (dq, dk, dv, dg, dbeta, dh0), dh0 None when h0 is None.
    saved: the checkpoints of chunk_forward(..., save=True) on the same inputs (optional)."""
    p = _Problem(q, k, v, g, beta, h0, cu_seqlens)
    do = p.grad_input("do", do, (p.B, p.T, p.Hv, p.V))
    if do is None:
        raise TypeError("do (the gradient of the output) is required")
    dht = p.grad_input("dht", dht, p.state_shape())
    plan = _plan(p, scale, l2norm, chunk, threads)
    dq, dk = np.empty_like(p.q), np.empty_like(p.k)
    dv, dg, dbeta = np.empty_like(p.v), np.empty_like(p.g), np.empty_like(p.beta)
    dh0 = np.empty(p.state_shape(), np.float32) if p.h0 is not None else None
    with plan.lock:
        if saved is not None:
            ck = _array("saved", saved, np.float32)
            if ck.size != L.describe(L.gdn_plan_describe, L.PlanInfo, plan.h).checkpoint_floats:
                raise ValueError(f"saved holds {ck.size} floats, this problem's checkpoints "
                                 f"are {L.describe(L.gdn_plan_describe, L.PlanInfo, plan.h).checkpoint_floats}: it comes from "
                                 "another shape")
        else:
            ck = None
        grads = L.rule_grads(dq, dk, dv, dg, dbeta, dh0)
        L.check(L.gdn_backward_saved(plan.h, ctypes.byref(grads), ctypes.byref(_inputs(p)),
                                     L.f32p(ck), L.f32p(do), L.f32p(dht)), "gdn_backward")
    return dq, dk, dv, dg, dbeta, dh0


def reference_forward(q, k, v, g, beta, h0=None, *, scale=None, l2norm=True, cu_seqlens=None):
    """The token-by-token recurrence in float64 (the oracle): (o, ht), both float64."""
    p = _Problem(q, k, v, g, beta, h0, cu_seqlens, dtype=np.float64)
    cfg = _config(p, scale, l2norm, 64, 1)
    o = np.empty((p.B, p.T, p.Hv, p.V), np.float64)
    ht = np.empty(p.state_shape(), np.float64)
    L.check(L.gdn_reference_forward(ctypes.byref(cfg), L.f64p(o), L.f64p(ht),
                                    ctypes.byref(_inputs(p, f64=True))), "gdn_reference_forward")
    return o, ht


def reference_backward(q, k, v, g, beta, do, h0=None, dht=None, *, scale=None, l2norm=True,
                       cu_seqlens=None):
    """The oracle's backward in float64: (dq, dk, dv, dg, dbeta, dh0)."""
    p = _Problem(q, k, v, g, beta, h0, cu_seqlens, dtype=np.float64)
    do = p.grad_input("do", do, (p.B, p.T, p.Hv, p.V))
    if do is None:
        raise TypeError("do (the gradient of the output) is required")
    dht = p.grad_input("dht", dht, p.state_shape())
    cfg = _config(p, scale, l2norm, 64, 1)
    dq, dk = np.empty_like(p.q), np.empty_like(p.k)
    dv, dg, dbeta = np.empty_like(p.v), np.empty_like(p.g), np.empty_like(p.beta)
    dh0 = np.empty(p.state_shape(), np.float64) if p.h0 is not None else None
    grads = L.rule_grads(dq, dk, dv, dg, dbeta, dh0, f64=True)
    L.check(L.gdn_reference_backward(ctypes.byref(cfg), ctypes.byref(grads),
                                     ctypes.byref(_inputs(p, f64=True)), L.f64p(do), L.f64p(dht)),
            "gdn_reference_backward")
    return dq, dk, dv, dg, dbeta, dh0


def step(q, k, v, g, beta, state, *, scale=None, l2norm=True, threads=0):
    """One decode token: q, k [B,Hk,K], v [B,Hv,V], g, beta [B,Hv]; state [B,Hv,K,V] float32,
    C-contiguous and writable, updated in place (S_{t-1} -> S_t). Returns o [B,Hv,V]."""
    if not isinstance(state, np.ndarray) or state.dtype != np.float32 \
            or not state.flags.c_contiguous or not state.flags.writeable:
        raise TypeError("state must be a writable C-contiguous float32 numpy array "
                        "(it is updated in place)")
    # One token is the [B,1,H,D] problem: check the token's arrays as such.
    one = []
    for name, a, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        a = _array(name, a, np.float32)
        if a.ndim != nd:
            raise ValueError(f"{name} of one token must have {nd} dimensions "
                             f"({'[B,H,D]' if nd == 3 else '[B,H]'}), got shape {tuple(a.shape)}")
        one.append(a[:, None])
    p = _Problem(*one, None, None)
    B, Hv, K, V = p.B, p.Hv, p.K, p.V
    _shape("state", state, (B, Hv, K, V))
    plan = _plan(p, scale, l2norm, 64, threads)
    o = np.empty((B, Hv, V), np.float32)
    with plan.lock:
        step_in = L.rule_inputs(p.q, p.k, p.v, p.g, p.beta)   # h0 NULL: the state is `state`
        L.check(L.gdn_step(plan.h, L.f32p(o), L.f32p(state), ctypes.byref(step_in)), "gdn_step")
    return o


# ----------------------------------------------------------------------------- the layer

def layer_param_names():
    """The layer's parameters in their flat order, by Hugging Face name (without prefix)."""
    c = L.gdn_layer_config_default(1, 1, 1, 1, 1, 1, 1)
    return [L.param_info(L.gdn_layer_param, c, i)[0] for i in range(L.GDN_P_COUNT)]


class Layer:
    """The Qwen3.5 GatedDeltaNet layer (DESIGN §5) over NumPy arrays.

    Layer(E, Hk, Hv, K, V, weights, Kc=4, eps=1e-6): weights is a dict of Hugging Face names
    (in_proj_qkv.weight, ..., with or without a common prefix) to arrays in PyTorch's [out, in]
    shapes, or the flat float32 vector of gdn_layer_param's offsets. Plans are made per (B, T)
    and reused. compute="bf16": in_proj_qkv, in_proj_z and out_proj (forward and backward) with
    bfloat16 operands and fp32 accumulation on the CPU's best BF16 path (gdncp/compute.h;
    ~1e-2 relative on outputs), the rest fp32.
    """

    def __init__(self, E, Hk, Hv, K, V, weights, Kc=4, eps=1e-6, chunk=64, threads=0,
                 keep_projections=False, compute="fp32"):
        if compute not in ("fp32", "bf16"):
            raise ValueError(f"compute must be 'fp32' or 'bf16', got {compute!r}")
        self._base = L.gdn_layer_config_default(0, 0, E, Hk, Hv, K, V)
        self._base.Kc, self._base.eps = Kc, eps
        self._base.chunk, self._base.threads = chunk, threads
        self._base.keep = 1 if keep_projections else 0
        self._base.compute = 1 if compute == "bf16" else 0
        self.compute = compute
        probe = self._cfg(1, 1)
        L.check(L.gdn_layer_config_check(ctypes.byref(probe)), "layer config")
        self.E, self.Hk, self.Hv, self.K, self.V, self.Kc = E, Hk, Hv, K, V, Kc
        self.conv_dim = int(L.gdn_layer_conv_dim(ctypes.byref(probe)))
        self.n_params = int(L.gdn_layer_param_floats(ctypes.byref(probe)))
        self.w = self._flat(weights, probe)

    def _cfg(self, B, T):
        c = L.LayerConfig.from_buffer_copy(self._base)
        c.B, c.T = B, T
        return c

    def param_layout(self):
        """[(name, shape, offset)] of the flat parameter vector."""
        probe = self._cfg(1, 1)
        return [L.param_info(L.gdn_layer_param, probe, i)[:3] for i in range(L.GDN_P_COUNT)]

    def _flat(self, weights, probe):
        if isinstance(weights, np.ndarray) and weights.ndim == 1:
            w = _array("weights", weights, np.float32)
            if w.size != self.n_params:
                raise ValueError(f"the flat weights hold {w.size} floats, this layer has "
                                 f"{self.n_params}")
            return w
        if not isinstance(weights, dict):
            raise TypeError("weights must be a dict {name: array} or the flat float32 vector")
        w = np.zeros(self.n_params, np.float32)
        for name, shape, off in self.param_layout():
            hits = [key for key in weights if key == name or key.endswith("." + name)]
            if len(hits) != 1:
                raise ValueError(f"weights: {'no' if not hits else 'several'} tensor(s) named "
                                 f"{name}{'' if not hits else ': ' + ', '.join(hits)}")
            a = np.asarray(weights[hits[0]])
            if tuple(a.shape) != shape:
                raise ValueError(f"weights: {hits[0]} has shape {tuple(a.shape)}, expected "
                                 f"{shape}")
            w[off:off + a.size] = _array(hits[0], a, np.float32).ravel()
        return w

    def grads_by_name(self, dw):
        """The flat gradient as {name: array in the weight's shape} (views into dw)."""
        return {name: dw[off:off + int(np.prod(shape))].reshape(shape)
                for name, shape, off in self.param_layout()}

    def _plan(self, B, T):
        """The layer plan of (B, T) (gdncp._plans.PLANS, kind "layer", keyed by the whole config:
        layers of one configuration share theirs); prompts of ever new lengths: a few kept."""
        cfg = self._cfg(B, T)
        return PLANS.get(("layer",) + config_key(cfg), lambda: Plan(
            L.gdn_layer_plan_create, L.gdn_layer_plan_destroy, cfg, "gdn_layer_plan_create"),
            _PLAN_CACHE)

    def _x(self, name, x):
        x = _array(name, x, np.float32)
        if x.ndim != 3 or x.shape[2] != self.E or x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"{name} must be [B,T,E] with E = {self.E}, got shape {tuple(x.shape)}")
        return x

    def _states(self, B, conv_state, rec_state, required):
        for name, s, shape in (("conv_state", conv_state, (B, self.conv_dim, self.Kc)),
                               ("rec_state", rec_state, (B, self.Hv, self.K, self.V))):
            if s is None:
                if required:
                    raise TypeError(f"{name} is required")
                continue
            if not isinstance(s, np.ndarray) or s.dtype != np.float32 \
                    or not s.flags.c_contiguous or not s.flags.writeable:
                raise TypeError(f"{name} must be a writable C-contiguous float32 numpy array "
                                "(it is updated in place)")
            _shape(name, s, shape)
        if (conv_state is None) != (rec_state is None):
            raise TypeError("conv_state and rec_state go together: give both or neither")

    def forward(self, x, conv_state=None, rec_state=None, save=False):
        """y [B,T,E]; conv_state [B,conv_dim,Kc] and rec_state [B,Hv,K,V] (Hugging Face's cache
        layout), when given, are read and updated in place. save=True also returns what
        backward() needs: (y, saved)."""
        x = self._x("x", x)
        B, T, _ = x.shape
        self._states(B, conv_state, rec_state, False)
        plan = self._plan(B, T)
        y = np.empty_like(x)
        with plan.lock:
            saved = np.empty(L.describe(L.gdn_layer_plan_describe, L.LayerPlanInfo, plan.h).saved_floats, np.float32) if save else None
            L.check(L.gdn_layer_forward(plan.h, L.f32p(y), L.f32p(saved), L.f32p(x),
                                        self.w.ctypes.data_as(ctypes.c_void_p),
                                        L.f32p(conv_state), L.f32p(rec_state)),
                    "gdn_layer_forward")
        return (y, saved) if save else y

    def backward(self, x, dy, saved=None):
        """(dx [B,T,E], dw flat) for loss = sum(y * dy), zero initial states; saved from
        forward(x, save=True) or None (everything recomputed). grads_by_name(dw) names them."""
        x = self._x("x", x)
        dy = self._x("dy", dy)
        if dy.shape != x.shape:
            raise ValueError(f"dy has shape {tuple(dy.shape)}, x has {tuple(x.shape)}")
        B, T, _ = x.shape
        plan = self._plan(B, T)
        dx = np.empty_like(x)
        dw = np.empty(self.n_params, np.float32)
        with plan.lock:
            if saved is not None:
                saved = _array("saved", saved, np.float32)
                if saved.size != L.describe(L.gdn_layer_plan_describe, L.LayerPlanInfo, plan.h).saved_floats:
                    raise ValueError("saved does not come from forward() of this shape")
            L.check(L.gdn_layer_backward(plan.h, L.f32p(dx), L.f32p(dw), L.f32p(x),
                                         L.f32p(self.w), L.f32p(saved), L.f32p(dy)),
                    "gdn_layer_backward")
        return dx, dw

    def reference_forward(self, x):
        """The layer in float64 with plain loops (the oracle; zero initial states): y."""
        x = _array("x", x, np.float64)
        self._x("x", x)
        cfg = self._cfg(*x.shape[:2])
        w = self.w.astype(np.float64)
        y = np.empty_like(x)
        L.check(L.gdn_layer_reference_forward(ctypes.byref(cfg), L.f64p(y), L.f64p(x), L.f64p(w)),
                "gdn_layer_reference_forward")
        return y

    def reference_backward(self, x, dy):
        """The oracle's backward in float64: (dx, dw flat)."""
        x = _array("x", x, np.float64)
        dy = _array("dy", dy, np.float64)
        self._x("x", x)
        if dy.shape != x.shape:
            raise ValueError(f"dy has shape {tuple(dy.shape)}, x has {tuple(x.shape)}")
        cfg = self._cfg(*x.shape[:2])
        w = self.w.astype(np.float64)
        dx = np.empty_like(x)
        dw = np.empty(self.n_params, np.float64)
        L.check(L.gdn_layer_reference_backward(ctypes.byref(cfg), L.f64p(dx), L.f64p(dw),
                                               L.f64p(x), L.f64p(w), L.f64p(dy)),
                "gdn_layer_reference_backward")
        return dx, dw

    def decode(self, x, conv_state, rec_state):
        """One token per sequence: x [B,1,E] (or [B,E]) -> y of the same shape; the states are
        required and updated in place."""
        x = _array("x", x, np.float32)
        squeeze = x.ndim == 2
        if squeeze:
            x = x[:, None, :]
        x = self._x("x", x)
        if x.shape[1] != 1:
            raise ValueError(f"decode takes one token per sequence, got x of shape {tuple(x.shape)}")
        B = x.shape[0]
        self._states(B, conv_state, rec_state, True)
        plan = self._plan(B, 1)
        y = np.empty_like(x)
        with plan.lock:
            L.check(L.gdn_layer_decode(plan.h, L.f32p(y), L.f32p(x),
                                       self.w.ctypes.data_as(ctypes.c_void_p),
                                       L.f32p(conv_state), L.f32p(rec_state)), "gdn_layer_decode")
        return y[:, 0] if squeeze else y


# ----------------------------------------------------------------------------- context parallelism
#
# One sequence split over the ranks of an mpi4py communicator (include/gdncp/cp.h): rank order is
# token order, rank r passes its own tokens [t_r, t_r + T_r) of every batch row (T_r may differ
# between ranks). Every call is collective: all ranks of the communicator make it, with the same
# options. Before any data moves, the ranks exchange their local checks and options (one small
# allgather); a failure or a disagreement on any rank is raised on every rank (the failing rank
# raises its own exception, the others say which rank failed and why), so no rank is left waiting.

STRATEGIES = ("scan", "allgather", "relay", "heads")

_MPI = None
_comm_type = None


def _gdncp_mpi_version():
    buf = ctypes.create_string_buffer(8192)  # MPI_MAX_LIBRARY_VERSION_STRING is 8192 in MPICH
    n = ctypes.c_int()
    if L.MPI_Get_library_version(buf, ctypes.byref(n)) != 0:
        return None
    return buf.value.decode(errors="replace")


def _first_line(text):
    return (text or "?").strip("\0 \n\t").splitlines()[0].strip("\0 \t")


def _mpi():
    """mpi4py's MPI module, once checked to run the same MPI library as libgdncp.so. Two MPI
    libraries in one process (e.g. an mpi4py wheel built for Open MPI beside gdncp's MPICH) would
    pass handles of one to the other: refused here, with what to install instead."""
    global _MPI, _comm_type
    if _MPI is not None:
        return _MPI
    ours = _gdncp_mpi_version()
    how = ("install mpi4py built from source against the same MPI: "
           "MPICC=mpicc.mpich pip install --no-binary mpi4py mpi4py")
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(f"gdncp's context parallelism takes an mpi4py communicator; {how}") from e
    theirs = MPI.Get_library_version()
    if ours is None or ours.strip("\0 \n") != theirs.strip("\0 \n"):
        raise ImportError(
            "gdncp: mpi4py runs another MPI library than libgdncp.so: mpi4py has "
            f"{_first_line(theirs)!r}, libgdncp.so was linked against {_first_line(ours)!r}; "
            f"{how}")
        # (compared in full: two builds of one MPI version with other ABIs differ in the text)
    inited = ctypes.c_int()
    L.MPI_Initialized(ctypes.byref(inited))
    if not inited.value:
        raise ImportError("gdncp: MPI is not initialised in the library libgdncp.so uses after "
                          "`from mpi4py import MPI` (mpi4py.rc.initialize = False? call "
                          "MPI.Init_thread() first)")
    size = MPI._sizeof(MPI.Comm)
    _comm_type = {4: ctypes.c_uint32, 8: ctypes.c_uint64}.get(size)
    if _comm_type is None:
        raise ImportError(f"gdncp: MPI_Comm of {size} bytes is not supported")
    for name, (_, args) in L._abi.PROTOTYPES.items():   # gdn_cp_create, gdn_train, ...
        if "MPI_Comm" in args:
            setattr(L, name, L.bind(name, MPI_Comm=_comm_type))
    _MPI = MPI
    return MPI


class _CommState:
    """gdncp's side of one communicator: a duplicate for the Python-side collectives (the
    agreement table, the sum of the final state's gradient) and its one gdn_cp context (which
    duplicates it again; the strategy of a call is its plan's). Made collectively on first use."""

    def __init__(self, MPI, comm):
        self.MPI = MPI
        self.py = comm.Dup()
        self.rank, self.size = self.py.Get_rank(), self.py.Get_size()
        self.ctx = None

    def cp(self):
        """The communicator's gdn_cp context (collective the first time, on every rank alike)."""
        if self.ctx is None:
            h = ctypes.c_void_p()
            L.check(L.gdn_cp_create(ctypes.byref(h), self.MPI._handleof(self.py)), "gdn_cp_create")
            self.ctx = h
        return self.ctx

    def close(self):
        if self.MPI.Is_finalized():
            return
        if self.ctx is not None:
            L.gdn_cp_destroy(self.ctx)
        self.ctx = None
        if self.py != self.MPI.COMM_NULL:
            self.py.Free()


_comms = {}   # id(comm) -> (weakref to comm, its handle, _CommState)
_comms_lock = threading.Lock()


def _close_all():
    with _comms_lock:
        for _, _, st in _comms.values():
            st.close()
        _comms.clear()


def _comm_state(comm):
    MPI = _mpi()
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator (mpi4py.MPI.Comm), not "
                        f"{type(comm).__module__}.{type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError("comm is MPI.COMM_NULL")
    if comm.Is_inter():
        raise ValueError("comm is an intercommunicator; gdncp needs an intracommunicator "
                         "(rank order = token order)")
    import weakref
    handle = MPI._handleof(comm)
    with _comms_lock:
        if not _comms:
            import atexit
            atexit.register(_close_all)   # before mpi4py's MPI_Finalize (registered earlier)
        for key in [key for key, (ref, _, _) in _comms.items() if ref() is None]:
            _comms.pop(key)[2].close()
        hit = _comms.get(id(comm))
        if hit is not None and hit[0]() is comm and hit[1] == handle:
            return hit[2]
        if hit is not None:   # a freed communicator's id reused
            _comms.pop(id(comm))[2].close()
        st = _CommState(MPI, comm)
        _comms[id(comm)] = (weakref.ref(comm), handle, st)
        return st


def _strategy_id(strategy):
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be one of {', '.join(STRATEGIES)} (a str), not "
                        f"{type(strategy).__name__}")
    s = L.gdn_cp_strategy_parse(strategy.encode())
    if s < 0:
        raise ValueError(f"unknown CP strategy {strategy!r}: use one of {', '.join(STRATEGIES)}")
    return s


def _cp_cu(cu_seqlens, B):
    """The whole stream's offsets (every rank passes them all): checked for form here, against
    the ranks' total tokens after the agreement."""
    cu = np.ascontiguousarray(np.asarray(cu_seqlens), dtype=np.int64)
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"cu_seqlens must be a 1-D array of n_docs + 1 offsets, got shape {cu.shape}")
    if B != 1:
        raise ValueError(f"cu_seqlens needs batch size 1 (the documents packed in one row), got B = {B}")
    if cu[0] != 0 or np.any(np.diff(cu) <= 0):
        raise ValueError("cu_seqlens must start at 0 and increase strictly (the whole stream's "
                         "offsets, the same on every rank); got "
                         f"{cu.tolist() if cu.size <= 16 else cu[:16].tolist() + ['...']}")
    return cu


def _agree(st, err, sig=None, names=(), extra=None, what="gdncp CP", show=None):
    """One collective over st's communicator: every rank's local failure (err, this rank's
    exception or None) and the values every rank must share (sig, a tuple; names[i] says what
    its i-th value is), so that a failure anywhere is raised on every rank: the failing rank its
    own exception, the others one of the same type naming it; values that differ from rank 0's
    raise ValueError everywhere. Returns every rank's `extra` (its shard length, say)."""
    table = st.py.allgather((None if err is None else (type(err).__name__, str(err)), sig, extra))
    if err is not None:
        raise err
    for r, (e, _, _) in enumerate(table):
        if e is not None:
            exc = {"TypeError": TypeError, "ValueError": ValueError}.get(e[0], RuntimeError)
            raise exc(f"{what}: rank {r} failed: {e[0]}: {e[1]}")
    shown = show or (lambda i, x: "(differ)" if isinstance(x, bytes) else x)
    for r, (_, s, _) in enumerate(table):
        for i, (a, b) in enumerate(zip(s or (), table[0][1] or ())):
            if a != b:
                name = names[i] if i < len(names) else f"value {i}"
                raise ValueError(f"{what}: the ranks disagree on {name}: rank {r} has "
                                 f"{shown(i, a)}, rank 0 has "
                                 f"{'(its own)' if isinstance(b, bytes) else shown(i, b)}")
    return [x for _, _, x in table]


class _CPCall:
    """One rank's part of a collective CP call, agreed with the other ranks: its problem (float32
    arrays), the plan for its shard, the gdn_cp context, its place in the stream."""

    def __init__(self, comm, strategy, q, k, v, g, beta, h0, cu_seqlens, scale, l2norm, chunk,
                 threads, flags=(), error=None):
        """flags: (name, value) pairs of the caller's options that every rank must share."""
        st = _comm_state(comm)   # TypeError / ValueError for a bad comm: raised before any collective
        self.st, self.rank, self.size = st, st.rank, st.size
        err, sig, T_local = error, None, 0   # error: the caller's own checks failed on this rank
        try:
            if err is not None:
                raise err
            sid = _strategy_id(strategy)
            p = _Problem(q, k, v, g, beta, None, None)
            cu = None if cu_seqlens is None else _cp_cu(cu_seqlens, p.B)
            p.cu = cu
            p.N = p.B if cu is None else cu.size - 1
            if h0 is not None and (self.rank == 0 or cu is not None):
                # dense: only rank 0's initial state is read; packed: every rank's (the
                # documents that start on it)
                p.h0 = _array("initial_state (h0)", h0, np.float32)
                _shape("initial_state (h0)", p.h0, p.state_shape())
            probe = L.gdn_config_default(p.B, p.T, p.Hk, p.Hv, p.K, p.V)
            probe.scale, probe.l2norm = _scale_value(scale), 1 if l2norm else 0
            probe.chunk, probe.threads = int(chunk), int(threads)
            L.check(L.gdn_config_check(ctypes.byref(probe)), "config")
            T_local = p.T
            sig = (sid, p.B, p.Hk, p.Hv, p.K, p.V, probe.scale, probe.l2norm, probe.chunk,
                   -1 if cu is None else cu.size - 1,
                   None if cu is None else cu.tobytes(),
                   -1 if cu is None else int(h0 is not None)) + tuple(v for _, v in flags)
            self.p, self.sid = p, sid
        except Exception as e:   # noqa: BLE001 -- every local failure is shared, then re-raised
            err = e
        # The agreement: every rank's status, options and shard length, in one collective.
        names = ("the CP strategy", "B", "Hk", "Hv", "K", "V", "scale", "use_qk_l2norm_in_kernel",
                 "chunk", "the number of documents of cu_seqlens (-1: dense)",
                 "the cu_seqlens offsets", "initial_state given (packed: on every rank or none)")
        names = names + tuple(name for name, _ in flags)
        self.shards = _agree(st, err, sig, names, T_local,
                             show=lambda i, x: STRATEGIES[x] if i == 0 else
                             ("(differ)" if isinstance(x, bytes) else x))
        self.offset = sum(self.shards[:self.rank])
        self.total = sum(self.shards)
        p = self.p
        if p.cu is not None and p.cu[-1] != self.total:
            raise ValueError(f"cu_seqlens ends at {int(p.cu[-1])} but the {self.size} ranks hold "
                             f"{self.total} tokens in all ({self.shards}): every rank passes the "
                             "whole stream's offsets")
        if self.sid == 3 and p.Hk % self.size:
            raise ValueError(f"strategy 'heads' needs the number of ranks ({self.size}) to divide "
                             f"the key heads Hk = {p.Hk}")
        self.cp = st.cp()   # collective on first use (every rank reaches it: agreed above)
        # The plan for this shard (local; a failure on one rank is made every rank's)
        err, status = None, L.GDN_OK
        try:
            self.plan = _plan(p, scale, l2norm, chunk, threads, self.offset, self.sid)
        except Exception as e:  # noqa: BLE001
            err, status = e, getattr(e, "status", L.GDN_ERR_MPI)
        status = L.gdn_cp_agree_status(self.cp, status)
        if err is not None:
            raise err
        L.check(status, "gdncp CP (another rank failed to make its plan)")

    @property
    def packed(self):
        return self.p.cu is not None

    def doc_starts(self):
        """The documents that start on this rank (packed): a boolean mask over n_docs."""
        cu = self.p.cu[:-1]
        return (cu >= self.offset) & (cu < self.offset + self.p.T)

    def forward(self, want_ht=True, want_s_in=True):
        p = self.p
        o = np.empty((p.B, p.T, p.Hv, p.V), np.float32)
        ht = np.empty(p.state_shape(), np.float32) if want_ht else None
        s_in = np.empty(p.state_shape(), np.float32) if want_s_in else None
        with self.plan.lock:
            L.check(L.gdn_cp_forward(self.cp, self.plan.h, L.f32p(o), L.f32p(ht), L.f32p(s_in),
                                     ctypes.byref(_inputs(p))), "gdn_cp_forward")
        return o, ht, s_in

    def backward(self, do, dht=None, s_in=None, want_ds_in=True):
        """C's gdn_cp_backward: (dq, dk, dv, dg, dbeta, ds_in). want_ds_in must agree across
        ranks for packed streams (the per-document dh0 are gathered)."""
        p = self.p
        do = p.grad_input("do", do, (p.B, p.T, p.Hv, p.V))
        if dht is not None:
            dht = p.grad_input("dht", dht, p.state_shape())
        if s_in is not None:
            s_in = p.grad_input("s_in", s_in, p.state_shape())
        dq, dk = np.empty_like(p.q), np.empty_like(p.k)
        dv, dg, dbeta = np.empty_like(p.v), np.empty_like(p.g), np.empty_like(p.beta)
        ds_in = np.empty(p.state_shape(), np.float32) if want_ds_in else None
        with self.plan.lock:
            grads = L.rule_grads(dq, dk, dv, dg, dbeta, ds_in)   # dh0: this rank's ds_in
            L.check(L.gdn_cp_backward(self.cp, self.plan.h, ctypes.byref(grads),
                                      ctypes.byref(_inputs(p)), L.f32p(s_in), L.f32p(do),
                                      L.f32p(dht)), "gdn_cp_backward")
        return dq, dk, dv, dg, dbeta, ds_in

    def stats(self):
        s = L.gdn_cp_last_stats(self.cp)
        return {name: getattr(s, name) for name, _ in L.CPStats._fields_}


def cp_forward(comm, q, k, v, g, beta, h0=None, *, strategy="scan", scale=None, l2norm=True,
               cu_seqlens=None, chunk=64, threads=0, output_final_state=True):
    """gdn_cp_forward on this rank's shard (collective: every rank of comm calls it).

    q, k [B,T_r,Hk,K], v [B,T_r,Hv,V], g, beta [B,T_r,Hv]: this rank's tokens (rank order =
    token order). h0 is the state before the whole sequence's first token, read on rank 0 only
    (dense); with cu_seqlens (the whole stream's offsets, the same on every rank, B = 1) h0 is
    [n_docs,Hv,K,V] on every rank, each rank applying the rows of the documents that start on it.
    Returns (o [B,T_r,Hv,V], ht, s_in): ht the final state of the whole sequence (or every
    document's) on every rank, None unless output_final_state; s_in the state entering this
    rank's shard (zeros under 'heads', which forms none), which cp_backward can reuse.
    strategy: scan, allgather, relay or heads (dense only; the ranks must divide Hk)."""
    call = _CPCall(comm, strategy, q, k, v, g, beta, h0, cu_seqlens, scale, l2norm, chunk,
                   threads, flags=(("output_final_state", bool(output_final_state)),))
    return call.forward(want_ht=bool(output_final_state))


def cp_backward(comm, q, k, v, g, beta, do, h0=None, dht=None, *, s_in=None, strategy="scan",
                scale=None, l2norm=True, cu_seqlens=None, chunk=64, threads=0):
    """gdn_cp_backward on this rank's shard (collective): the gradients of
    sum over ranks of sum(o_r * do_r) + sum(ht * dht) for this rank's q, k, v, g, beta, and ds_in.

    dht: dense, read on the last rank only (the final state comes from it); packed, every rank
    passes [n_docs,...] and the rows of the documents that end on it are read. s_in: this rank's
    state from cp_forward, or None (recomputed; give it on every rank or none). Returns
    (dq, dk, dv, dg, dbeta, ds_in): ds_in dense is the gradient of this rank's incoming state
    (on rank 0: dh0); packed, every document's dh0 on every rank."""
    call = _CPCall(comm, strategy, q, k, v, g, beta, h0, cu_seqlens, scale, l2norm, chunk,
                   threads, flags=(("s_in given (on every rank or none)", s_in is not None),))
    return call.backward(do, dht, s_in, want_ds_in=True)
