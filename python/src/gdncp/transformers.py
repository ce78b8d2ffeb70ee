"""Make Hugging Face transformers' GatedDeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) run
gdncp's rule, without editing transformers:

    import gdncp.transformers
    gdncp.transformers.patch()                 # from here on, for every model
    with gdncp.transformers.patch(): ...       # or only inside the block

How. transformers 5 calls the rule through module-level functions of the modeling file
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, looked up when the layer
runs): patch() rebinds those names to gdncp's, which affects models built before and after it.
Older transformers (4.x) chose the rule in the layer's __init__ (`self.chunk_gated_delta_rule =
chunk_gated_delta_rule or torch_chunk_gated_delta_rule`); where a layer class does that, patch()
also puts a data descriptor on the class for those attributes: it wins over the instance's own
attribute, so existing layers call gdncp too, and the layer's own choice, kept in its __dict__,
is what it sees again once the patch is undone.

Context parallelism: patch(comm=comm, strategy="scan", attention="kv") also splits whole
Qwen3.5 / Qwen3.5-MoE / Qwen3-Next causal LMs over an mpi4py communicator, every rank passing its
own slice of each sequence (see gdncp.transformers_cp for what runs where, and
all_reduce_grads for the gradient).
"""
import importlib
import threading

from . import torch as gtorch

__all__ = ["patch", "unpatch", "is_patched", "PATCH_TARGETS", "all_reduce_grads", "causal_lm_loss"]

# (modeling module, GatedDeltaNet class) that patch() knows; absent ones are skipped.
PATCH_TARGETS = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5GatedDeltaNet"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeGatedDeltaNet"),
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextGatedDeltaNet"),
)

# (modeling module, sparse mixture-of-experts block class) whose forward patch() routes to gdncp's
# MoE op (gdncp.torch.moe_block); absent ones are skipped.
MOE_TARGETS = (
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock"),
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextSparseMoeBlock"),
)

# What the adapters call, looked up at call time (tests swap in a deliberately wrong rule).
_RULES = {
    "chunk_gated_delta_rule": gtorch.chunk_gated_delta_rule,
    "recurrent_gated_delta_rule": gtorch.fused_recurrent_gated_delta_rule,
}


def chunk_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
               output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None,
               **unused):
    """transformers' torch_chunk_gated_delta_rule signature on gdncp (chunk_size and the extra
    keyword arguments transformers forwards are ignored, as its own dispatcher does)."""
    return _RULES["chunk_gated_delta_rule"](
        query, key, value, g=g, beta=beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens)


def recurrent_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    """transformers' torch_recurrent_gated_delta_rule signature on gdncp (decode)."""
    return _RULES["recurrent_gated_delta_rule"](
        query, key, value, g=g, beta=beta, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens)


# module-level names -> replacement (the FLA names exist in transformers 4.x modeling files)
_GLOBALS = {
    "torch_chunk_gated_delta_rule": chunk_rule,
    "torch_recurrent_gated_delta_rule": recurrent_rule,
    "chunk_gated_delta_rule": chunk_rule,
    "fused_recurrent_gated_delta_rule": recurrent_rule,
}
# layer attributes (transformers 4.x) -> replacement
_ATTRS = {"chunk_gated_delta_rule": chunk_rule, "recurrent_gated_delta_rule": recurrent_rule}

_lock = threading.Lock()
_depth = 0          # nested patch() calls: the patch is undone when the last one is
_undo = []          # [(object, name, what it had before or _MISSING)]
_MISSING = object()


class _Rule:
    """Data descriptor: reads give gdncp's function, writes (the layer's __init__) go to the
    instance's __dict__, where they wait for the patch to be undone."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __get__(self, obj, owner=None):
        return self.fn

    def __set__(self, obj, value):
        obj.__dict__[self.name] = value

    def __delete__(self, obj):
        obj.__dict__.pop(self.name, None)


def _targets(targets=PATCH_TARGETS):
    found = []
    for mod_name, cls_name in targets:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        cls = getattr(mod, cls_name, None)
        if cls is not None:
            found.append((mod, cls))
    return found


def _set(obj, name, value, undo=None, item=False):
    """setattr (item: obj[name] =), remembered in undo (default: the rule patch's list)."""
    undo = _undo if undo is None else undo
    if item:
        undo.append((obj, name, obj.get(name, _MISSING), True))
        obj[name] = value
    else:
        undo.append((obj, name, obj.__dict__.get(name, _MISSING), False))
        setattr(obj, name, value)


_cp_depth = 0       # nested patch(comm=...) calls (all with the same settings)
_cp_settings = None
_cp_undo = []


class _Patch:
    """What patch() returns: already applied; `with` undoes it on exit, so does .undo()."""

    def __init__(self, cp=False):
        self._undone, self._cp = False, cp

    def undo(self):
        if not self._undone:
            self._undone = True
            if self._cp:
                _unpatch_cp()
            unpatch()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()
        return False


def patch(comm=None, strategy="scan", attention="kv", compute="fp32", group=None):
    """Route transformers' GatedDeltaNet layers to gdncp (see the module's docstring). Raises
    ImportError when transformers has none of those layers.

    comm (an mpi4py intracommunicator): also split the whole model's sequence over its ranks,
    the GatedDeltaNet rule under `strategy` (scan, allgather, relay, heads), attention under
    `attention` (kv, heads), the C layers' projections in `compute` (fp32, bf16); see
    gdncp.transformers_cp. group (a torch.distributed gloo ProcessGroup, e.g.
    dist.group.WORLD under torchrun): the same split over it, transformers' own layers with the
    conv, the rule and attention on gdncp.torch_cp (see gdncp.transformers_torch_cp; strategy,
    attention and compute do not apply). Patches with a comm or group nest only with the same
    settings."""
    if comm is not None and group is not None:
        raise ValueError("patch: pass comm= (mpi4py) or group= (torch.distributed), not both")
    if group is not None:
        return _patch_cp(group, strategy, attention, compute, torch_group=True)
    if comm is not None:
        return _patch_cp(comm, strategy, attention, compute)
    return _patch_rule()


def _patch_cp(comm, strategy, attention, compute, torch_group=False):
    global _cp_depth, _cp_settings
    if torch_group:
        from . import transformers_torch_cp as tcp
        settings = ("torch.distributed", comm)
        args = (comm, _RULES)
    else:
        from . import transformers_cp as tcp
        settings = args = (comm, strategy, attention, compute)
    with _lock:
        if _cp_depth and _cp_settings != settings:
            raise RuntimeError("gdncp.transformers.patch(comm=...) is already active with other "
                               "settings (communicator, strategy, attention or compute); undo it "
                               "first")
        if _cp_depth == 0:
            try:
                tcp.install(lambda o, n, v, item=False: _set(o, n, v, _cp_undo, item), *args)
            except Exception:
                _rollback(_cp_undo)
                tcp.uninstall()
                raise
            _cp_settings = settings
        _cp_depth += 1
    try:
        _patch_rule()
    except Exception:
        _unpatch_cp()
        raise
    return _Patch(cp=True)


def _unpatch_cp():
    global _cp_depth, _cp_settings
    with _lock:
        if _cp_depth == 0:
            return
        _cp_depth -= 1
        if _cp_depth == 0:
            _rollback(_cp_undo)
            if _cp_settings[0] == "torch.distributed":
                from . import transformers_torch_cp as tcp
            else:
                from . import transformers_cp as tcp
            tcp.uninstall()
            _cp_settings = None


def all_reduce_grads(model, comm):
    """Sum the parameters' gradients over the ranks: comm an mpi4py communicator
    (gdncp.transformers_cp.all_reduce_grads) or a torch.distributed group
    (gdncp.transformers_torch_cp.all_reduce_grads)."""
    try:
        from mpi4py import MPI
        is_mpi = isinstance(comm, MPI.Comm)
    except ImportError:
        is_mpi = False
    if is_mpi:
        from . import transformers_cp as tcp
    else:
        from . import transformers_torch_cp as tcp
    return tcp.all_reduce_grads(model, comm)


def causal_lm_loss(logits, labels, **kwargs):
    """gdncp.transformers_cp.causal_lm_loss: the whole sequence's causal-LM loss under CP."""
    from . import transformers_cp as tcp
    return tcp.causal_lm_loss(logits, labels, **kwargs)


def _patch_rule():
    global _depth
    with _lock:
        if _depth == 0:
            targets = _targets()
            if not targets:
                raise ImportError("gdncp.transformers.patch(): transformers with a Qwen3.5 or "
                                  "Qwen3-Next model is not installed (looked for "
                                  + ", ".join(f"{m}.{c}" for m, c in PATCH_TARGETS) + ")")
            for mod, cls in targets:
                hits = 0
                for name, fn in _GLOBALS.items():
                    if name in mod.__dict__:
                        _set(mod, name, fn)
                        hits += 1
                init_names = getattr(getattr(cls.__init__, "__code__", None), "co_names", ())
                for name, fn in _ATTRS.items():
                    if name in init_names:
                        _set(cls, name, _Rule(name, fn))
                        hits += 1
                if not hits:
                    _rollback(_undo)
                    raise RuntimeError(f"gdncp.transformers.patch(): {mod.__name__} has none of "
                                       f"{sorted(_GLOBALS)}: this transformers version calls the "
                                       "rule in a way gdncp does not know")
            for mod, cls in _targets(MOE_TARGETS):
                _set(cls, "forward", _moe_forward(cls.forward))
        _depth += 1
    return _Patch()


def _recording_router_logits():
    """Whether transformers is collecting the routers' logits (output_router_logits: the aux loss):
    its hook on the router module records them when the router runs."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return True  # unknown mechanism: run the router so whatever records it sees it
    collected = _active_collector.get()
    return collected is not None and "router_logits" in collected


def _moe_forward(original):
    """The sparse MoE block's forward on gdncp's op: fp32 CPU weights (bfloat16 compute under a
    bfloat16 autocast); other dtypes or devices keep transformers' own forward. When the aux loss
    is being collected the block's router also runs as transformers' module, so its hook records the
    logits (their gradient, the aux loss's, flows through it; gdncp's op gives the rest)."""
    import torch

    def forward(self, hidden_states):
        shared = getattr(self, "shared_expert", None)
        weights = (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj,
                   *((shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight,
                      self.shared_expert_gate.weight) if shared is not None else (None,) * 4))
        if hidden_states.device.type != "cpu" or any(
                w is not None and (w.dtype != torch.float32 or w.device.type != "cpu") for w in weights) or \
                type(getattr(self.experts, "act_fn", None)).__name__ not in ("SiLUActivation", "SiLU"):
            return original(self, hidden_states)
        gtorch.adopt_moe_weights(*weights)   # the parameters into the op's layout, once: no copy a call
        B, T, H = hidden_states.shape
        flat = hidden_states.reshape(-1, H)
        if _recording_router_logits():
            self.gate(flat)
        bf16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        y = gtorch.moe_block(flat, *weights, top_k=self.gate.top_k,
                             norm_topk_prob=getattr(self.gate, "norm_topk_prob", True),
                             compute="bf16" if bf16 else "fp32")
        return y.reshape(B, T, H)

    forward.__wrapped__ = original
    return forward


def _rollback(undo):
    for obj, name, before, item in reversed(undo):
        if item:
            if before is _MISSING:
                obj.pop(name, None)
            else:
                obj[name] = before
        elif before is _MISSING:
            delattr(obj, name)
        else:
            setattr(obj, name, before)
    undo.clear()


def unpatch():
    """Undo one patch() (transformers' own rule again after the last)."""
    global _depth
    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0:
            _rollback(_undo)


def is_patched():
    return _depth > 0
