"""PyTorch entry points with flash-linear-attention's signatures (the functions transformers calls):

    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                            output_final_state=False,
                                            use_qk_l2norm_in_kernel=False, cu_seqlens=None)
    o, final_state = fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None,
                                                      beta=None, scale=None, ...)

q, k [B,T,Hk,K]; v [B,T,Hv,V]; g, beta [B,T,Hv]; initial_state / final_state [N,Hv,K,V] (N = B,
or the documents of cu_seqlens). Hk may divide Hv (value head j reads key head j // (Hv//Hk), as
PyTorch's repeat_interleave). CPU tensors only.

Precision: float32, bfloat16 and float16 inputs run gdncp's fp32 chunked kernel (inputs converted
to float32, o returned in q's dtype, final_state in float32 as FLA does). When q, k and v are all
float64 the float64 oracle (the token-by-token recurrence and its exact backward) runs instead:
slow, for checking (torch.autograd.gradcheck). Both are a torch.autograd.Function whose backward
is gdncp's.
"""
import numpy as np

try:
    import torch
except ImportError as e:  # the NumPy entry points (gdncp.chunk_forward, ...) need no torch
    raise ImportError("gdncp.torch and gdncp.transformers need PyTorch: pip install torch") from e

from . import core

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "moe_block", "adopt_moe_weights"]

_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _check_tensor(name, t, optional=False):
    if t is None:
        if optional:
            return
        raise TypeError(f"{name} is required")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: gdncp runs on the CPU (move it with .cpu())")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{name} has dtype {t.dtype}; gdncp takes float32, bfloat16, float16 "
                        "or float64 (the oracle)")


def _np(t, dtype):
    """A C-contiguous numpy view of t in dtype (a copy only when t is not one already)."""
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    return t.detach().to(tdt).contiguous().numpy()


def _cu_numpy(cu_seqlens):
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
            raise TypeError(f"cu_seqlens must hold integers, not {cu_seqlens.dtype}")
        return cu_seqlens.detach().cpu().to(torch.int64).contiguous().numpy()
    return np.asarray(cu_seqlens, dtype=np.int64)


def _no_double_backward(what):
    """Called first in every backward of gdncp's autograd Functions: the gradients they return come
    from the C library, not from differentiable torch operations, so create_graph=True (double
    backward: gradient penalties, Hessian-vector products) would silently get detached ones."""
    if torch.is_grad_enabled():   # backward runs with grad mode on only under create_graph=True
        raise RuntimeError(f"{what}: double backward is not supported (backward was called with "
                           "create_graph=True; gdncp's gradients are not themselves differentiable)")


class _ChunkRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, scale, want_ht, l2norm, cu, oracle):
        tdt = torch.float64 if oracle else torch.float32
        # The converted inputs are what the backward reads again: keep them (they are the
        # caller's own tensors when already contiguous in the kernel's dtype).
        xs = [x.detach().to(tdt).contiguous() for x in (q, k, v, g, beta)]
        h0c = None if h0 is None else h0.detach().to(tdt).contiguous()
        arrays = [x.numpy() for x in xs]
        h0a = None if h0c is None else h0c.numpy()
        opts = dict(scale=scale, l2norm=l2norm, cu_seqlens=cu)
        ck = None
        if oracle:
            o, ht = core.reference_forward(*arrays, h0a, **opts)
        elif any(ctx.needs_input_grad[:6]):
            o, ht, ck = core.chunk_forward(*arrays, h0a, save=True, threads=_threads(), **opts)
        else:
            o, ht = core.chunk_forward(*arrays, h0a, output_final_state=want_ht,
                                       threads=_threads(), **opts)
        ctx.save_for_backward(*xs, h0c, None if ck is None else torch.from_numpy(ck))
        ctx.opts, ctx.oracle = opts, oracle
        ctx.in_dtypes = [None if x is None else x.dtype for x in (q, k, v, g, beta, h0)]
        o_t = torch.from_numpy(o).to(q.dtype)
        # the state stays in the kernel's precision (float32 as FLA's, float64 from the oracle)
        ht_t = torch.from_numpy(ht) if want_ht else None
        return o_t, ht_t

    @staticmethod
    def backward(ctx, do, dht):
        _no_double_backward("gdncp.torch.chunk_gated_delta_rule")
        q, k, v, g, beta, h0, ck = ctx.saved_tensors
        dt = np.float64 if ctx.oracle else np.float32
        arrays = [x.numpy() for x in (q, k, v, g, beta)]
        h0a = None if h0 is None else h0.numpy()
        do_a = _np(do, dt) if do is not None else np.zeros(v.shape, dt)
        dht_a = None if dht is None else _np(dht, dt)
        if ctx.oracle:
            grads = core.reference_backward(*arrays, do_a, h0a, dht_a, **ctx.opts)
        else:
            grads = core.chunk_backward(*arrays, do_a, h0a, dht_a, threads=_threads(),
                                        saved=None if ck is None else ck.numpy(), **ctx.opts)
        out = [None if a is None else torch.from_numpy(a).to(d)
               for a, d in zip(grads, ctx.in_dtypes)]
        return (*out, None, None, None, None, None)


def _threads():
    # The caller's torch thread count is their statement of how many cores this process may use.
    return torch.get_num_threads()


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, head_first=False):
    """flash-linear-attention's chunk_gated_delta_rule on gdncp's CPU kernel: (o, final_state),
    final_state None unless output_final_state. See the module's docstring for layouts."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        _check_tensor(name, t)
    _check_tensor("initial_state", initial_state, optional=True)
    if head_first:
        raise ValueError("head_first=True is not supported (FLA deprecated it): pass [B,T,H,D] "
                         "tensors")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be [B,T,H,D]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    cu = _cu_numpy(cu_seqlens)
    if cu is not None and initial_state is not None and initial_state.shape[0] != cu.size - 1:
        raise ValueError(f"initial_state holds {initial_state.shape[0]} states; cu_seqlens "
                         f"packs {cu.size - 1} sequences and needs one each")
    oracle = q.dtype == k.dtype == v.dtype == torch.float64
    return _ChunkRule.apply(q, k, v, g, beta, initial_state, scale, bool(output_final_state),
                            bool(use_qk_l2norm_in_kernel), cu, oracle)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """flash-linear-attention's fused_recurrent_gated_delta_rule (decode; forward only, as in
    FLA): (o, final_state). One token (T = 1, dense) runs gdncp's decode step; longer inputs
    run the chunked forward, which computes the same recurrence."""
    if gk is not None or gv is not None:
        raise NotImplementedError("gdncp implements the scalar per-head gate g; per-key (gk) "
                                  "and per-value (gv) gates are not supported")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if g is None:
        g = torch.zeros(v.shape[:3], dtype=torch.float32)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=torch.float32)
    _check_tensor("g", g)
    _check_tensor("beta", beta)
    _check_tensor("initial_state", initial_state, optional=True)
    if q.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v must be [B,T,H,D]; got q {tuple(q.shape)}, "
                         f"v {tuple(v.shape)}")
    B, T = q.shape[0], q.shape[1]
    with torch.no_grad():
        if T == 1 and cu_seqlens is None:
            Hv, V, K = v.shape[2], v.shape[3], q.shape[3]
            if initial_state is not None:
                _shape_state(initial_state, (B, Hv, K, V))
                state = initial_state.detach().to(torch.float32).contiguous().clone().numpy()
            else:
                state = np.zeros((B, Hv, K, V), np.float32)
            o = core.step(_np(q[:, 0], np.float32), _np(k[:, 0], np.float32),
                          _np(v[:, 0], np.float32), _np(g[:, 0], np.float32),
                          _np(beta[:, 0], np.float32), state, scale=scale,
                          l2norm=use_qk_l2norm_in_kernel, threads=_threads())
            o_t = torch.from_numpy(o)[:, None].to(q.dtype)
            return o_t, (torch.from_numpy(state) if output_final_state else None)
        o, ht = core.chunk_forward(
            _np(q, np.float32), _np(k, np.float32), _np(v, np.float32), _np(g, np.float32),
            _np(beta, np.float32),
            None if initial_state is None else _np(initial_state, np.float32),
            scale=scale, l2norm=use_qk_l2norm_in_kernel, cu_seqlens=_cu_numpy(cu_seqlens),
            output_final_state=output_final_state, threads=_threads())
        return (torch.from_numpy(o).to(q.dtype),
                torch.from_numpy(ht) if output_final_state else None)


def _shape_state(t, want):
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"initial_state has shape {tuple(t.shape)}, expected {tuple(want)} "
                         "[B,Hv,K,V]")


# ----------------------------------------------------------------------------- the sparse MoE MLP

_MOE_FLAT = {}               # the router's data_ptr and the shapes -> the block's flat weights (reused)
_MOE_ADOPTED = {}   # id(router tensor) -> (a weak reference to it, the flat tensor its block lives in)


def _big_empty(n):
    """An uninitialised float32 array of n in transparent huge pages (gdncp._lib.huge_empty: a
    private mapping, 2 MiB-aligned, MADV_HUGEPAGE): a fresh gradient of a real block is GBs, and
    4 KiB pages made its first writes a second of page faults."""
    from ._lib import huge_empty
    return huge_empty(n, np.float32)


def _moe_layout(weights):
    """[(offset, numel)] of the op's flat layout for the block's tensors, and its floats."""
    from . import _lib as L
    import ctypes
    n, E = weights[0].shape
    I = weights[2].shape[2]
    Is = 0 if weights[3] is None else weights[3].shape[0]
    cfg = L.gdn_moe_config_default(1, E, n, 1, I, Is)
    offs = [(L.param_info(L.gdn_moe_param, cfg, i)[2], 0 if t is None else t.numel())
            for i, t in enumerate(weights)]
    return offs, L.gdn_moe_param_floats(ctypes.byref(cfg))


def _adopted(weights, offs):
    """The flat tensor the weights live in, in the op's layout (adopt_moe_weights), or None."""
    entry = _MOE_ADOPTED.get(id(weights[0]))
    if entry is None or entry[0]() is not weights[0]:
        return None
    flat = entry[1]
    base = flat.data_ptr()
    ok = all(t is None or (t.dtype == torch.float32 and t.data_ptr() == base + 4 * o) for t, (o, _) in zip(weights, offs))
    return flat if ok else None


def adopt_moe_weights(router, gate_up, down, shared_gate=None, shared_up=None, shared_down=None,
                      shared_expert_gate=None):
    """Move a block's fp32 parameters into one flat tensor in the MoE op's layout (each
    parameter's .data becomes a view of it; the Parameter objects, and so an optimizer's references,
    stay), so that moe_block reads them in place instead of copying them each call. Idempotent;
    a parameter later replaced (.data or .to()) is adopted again at the next call."""
    weights = (router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate)
    offs, floats = _moe_layout(weights)
    if _adopted(weights, offs) is not None:
        return
    flat = torch.zeros(floats, dtype=torch.float32)
    with torch.no_grad():
        for t, (o, k) in zip(weights, offs):
            if t is not None:
                view = flat[o:o + k].view(t.shape)
                view.copy_(t)
                t.data = view
    key = id(router)   # the entry leaves with the router tensor (its id may be reused after)
    _MOE_ADOPTED[key] = (__import__("weakref").ref(router, lambda _r, k=key: _MOE_ADOPTED.pop(k, None)), flat)
_MOE_LOCK = __import__("threading").Lock()


def _moe_plan(key):
    """The MoE plan of key = (N, E, n, k, I, Is, norm, threads, compute): gdncp._plans.PLANS,
    kind "moe", one per shape in use (decode, prefill, training rows): a few kept."""
    from . import _lib as L
    from ._plans import PLANS, Plan

    def make():
        N, E, n, k, I, Is, norm, threads, compute = key
        cfg = L.gdn_moe_config_default(N, E, n, k, I, Is)
        cfg.norm_topk, cfg.threads, cfg.compute = int(norm), threads, compute
        return Plan(L.gdn_moe_plan_create, L.gdn_moe_plan_destroy, cfg, "gdncp.torch.moe_block")
    return PLANS.get(("moe",) + tuple(key), make, 4)


class _MoeBlock(torch.autograd.Function):
    """gdn_moe_forward / gdn_moe_backward on the block's tensors (copied into the op's flat layout)."""

    @staticmethod
    def forward(ctx, x, *args):
        from . import _lib as L
        import ctypes
        weights, (top_k, norm, compute) = args[:-3], args[-3:]
        N, E = x.shape
        n, I = weights[0].shape[0], weights[2].shape[2]
        Is = 0 if weights[3] is None else weights[3].shape[0]
        key = (N, E, n, top_k, I, Is, bool(norm), _threads(), compute)
        with _MOE_LOCK:
            plan = _moe_plan(key)
            offs, floats = _moe_layout(weights)
            adopted = _adopted(weights, offs)
            if adopted is not None:   # the weights live in the op's layout already (adopt_moe_weights)
                w = adopted.detach().numpy()
            else:
                # one flat copy per block, kept (a fresh one a call costs its pages: GBs at real
                # sizes); refilled every call, as the weights change between steps
                fkey = (weights[0].data_ptr(), n, E, I, Is)
                w = _MOE_FLAT.get(fkey)
                if w is None:
                    while len(_MOE_FLAT) >= 256:   # blocks of models gone (one per MoE layer)
                        _MOE_FLAT.pop(next(iter(_MOE_FLAT)))
                    w = _MOE_FLAT[fkey] = np.zeros(floats, np.float32)
                for t, (o, k) in zip(weights, offs):
                    if t is not None:
                        w[o:o + k] = t.detach().to(torch.float32).reshape(-1).numpy()
            xa = x.detach().to(torch.float32).contiguous().numpy()
            y = np.empty((N, E), np.float32)
            grads = any(ctx.needs_input_grad)
            saved = _big_empty(L.describe(L.gdn_moe_plan_describe, L.MoePlanInfo, plan.h).saved_floats) if grads else None
            L.check(L.gdn_moe_forward(plan.h, L.f32p(y), L.f32p(saved), L.f32p(xa), L.f32p(w), None, None, None),
                    "gdncp.torch.moe_block")
        ctx.key, ctx.w, ctx.x, ctx.saved = key, w, xa, saved
        ctx.shapes = [None if t is None else (t.shape, t.dtype) for t in weights]
        ctx.x_dtype = x.dtype
        return torch.from_numpy(y).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        _no_double_backward("gdncp.torch.moe_block")
        from . import _lib as L
        import ctypes
        dya = dy.detach().to(torch.float32).contiguous().numpy()
        dx = np.empty_like(ctx.x)
        dw = _big_empty(ctx.w.size)
        with _MOE_LOCK:
            plan = _moe_plan(ctx.key)
            L.check(L.gdn_moe_backward(plan.h, L.f32p(dx), L.f32p(dw), L.f32p(ctx.x), L.f32p(ctx.w), L.f32p(ctx.saved),
                                       L.f32p(dya), None), "gdncp.torch.moe_block")
            offs = [L.param_info(L.gdn_moe_param, plan.cfg, i)[2] for i in range(L.GDN_MOE_COUNT)]
        out = []
        for i, sd in enumerate(ctx.shapes):
            if sd is None:
                out.append(None)
                continue
            shape, dtype = sd
            numel = int(np.prod(shape))   # views of this call's own dw (no second copy)
            out.append(torch.from_numpy(dw[offs[i]:offs[i] + numel].reshape(shape)).to(dtype))
        return (torch.from_numpy(dx).to(ctx.x_dtype), *out, None, None, None)


def moe_block(x, router, gate_up, down, shared_gate=None, shared_up=None, shared_down=None,
              shared_expert_gate=None, top_k=2, norm_topk_prob=True, compute="fp32"):
    """transformers' sparse MoE block (Qwen3.5-MoE, Qwen3-Next) on gdncp's op (include/gdncp/moe.h):
    x [N, E] -> y [N, E], differentiable in x and every weight. router [n, E]; gate_up [n, 2I, E]
    (each expert's gate rows, then its up rows); down [n, E, I]; the shared expert's gate/up [Is, E],
    down [E, Is] and its sigmoid gate [1, E] (all None: no shared expert). compute "bf16": the
    products with bfloat16 operands. The weights are copied into the op's layout at each call."""
    for name, t in (("x", x), ("router", router), ("gate_up", gate_up), ("down", down)):
        _check_tensor(name, t)
    shared = (shared_gate, shared_up, shared_down, shared_expert_gate)
    if any(t is None for t in shared) and not all(t is None for t in shared):
        raise ValueError("the shared expert needs all of shared_gate, shared_up, shared_down and "
                         "shared_expert_gate (or none of them)")
    if x.dim() != 2 or router.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"x [N, E], router [n, E], gate_up [n, 2I, E], down [n, E, I]; got {tuple(x.shape)}, "
                         f"{tuple(router.shape)}, {tuple(gate_up.shape)}, {tuple(down.shape)}")
    n, E = router.shape
    I = down.shape[2]
    if x.shape[1] != E or tuple(gate_up.shape) != (n, 2 * I, E) or tuple(down.shape) != (n, E, I):
        raise ValueError(f"shapes disagree: x {tuple(x.shape)}, router {tuple(router.shape)}, gate_up "
                         f"{tuple(gate_up.shape)}, down {tuple(down.shape)}")
    if shared_gate is not None:
        Is = shared_gate.shape[0]
        want = {"shared_gate": (Is, E), "shared_up": (Is, E), "shared_down": (E, Is), "shared_expert_gate": (1, E)}
        for (name, shape), t in zip(want.items(), shared):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if compute not in ("fp32", "bf16"):
        raise ValueError(f"compute must be 'fp32' or 'bf16', got {compute!r}")
    return _MoeBlock.apply(x, router, gate_up, down, *shared, int(top_k), bool(norm_topk_prob),
                           1 if compute == "bf16" else 0)
