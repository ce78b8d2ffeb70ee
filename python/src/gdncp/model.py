"""The whole Qwen3.5 model from Python: gdncp.Model runs the C library's hybrid decoder
(GatedDeltaNet and gated full-attention layers, include/gdncp/model.h) on a Hugging Face
Qwen3.5 checkpoint or a `gdncp train` output directory.

    m = gdncp.Model.from_pretrained(path, threads=0)
    m.logits(input_ids)                      # [B, T] ints -> float32 [B, T, vocab]
    m.generate(input_ids, max_new_tokens=N)  # -> the new ids [B, N] (greedy by default)
    m.generate_text("prompt", max_new_tokens=N)
    m.loss(input_ids)                        # transformers' model(ids, labels=ids).loss
    loss, grads = m.loss_and_grads(input_ids)  # and d loss / d every parameter, by name
    loss, grads = m.loss_and_grads(input_ids, out=buf)   # into buf = m.grad_buffer(), no allocation
    opt = m.adamw(lr=1e-3)                   # gdncp train's step: the C AdamW, persistent moments
    loss = opt.step(input_ids)               # forward, backward, clipping, update; no allocation
    m.state_dict()                           # {name: float32 view of the weights}

`loss` and `loss_and_grads` are the training step's forward and backward (gdn_model_forward /
gdn_model_backward), in fp32 or with BF16 products (compute="bf16"); `logits` is the model's
forward (gdn_model_logits); `generate` prefills the prompt through every
layer's cache and then decodes one token at a time (gdn_model_prefill / gdn_model_decode), so no
token is read twice. The next token comes from the library's sampler (gdn_sample_next), the one
`gdncp sample` uses: with the same seed and options both give the same tokens. Row b of a batch
draws from the stream of seed + b, so it equals `gdncp sample --seed (seed + b)` on that row.
"""
import ctypes
import json
import math
import numbers
import os
import threading
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from . import _lib as L
from ._plans import PlanCache, Plan

__all__ = ["Model", "ModelConfig", "AdamW"]


@dataclass
class _TrainStep:
    """One prepared training step (Model._train_prepare)."""
    plan: object
    train: object       # the Plan that owns plan (kept alive through the step)
    ids: np.ndarray
    B: int
    T1: int
    aux: bool
    denom: float


@dataclass(frozen=True)
class ModelConfig:
    """The model's configuration as the C library read it from config.json (Hugging Face names)."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    layer_types: Tuple[str, ...]          # "linear_attention" (GatedDeltaNet) / "full_attention"
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_attention_heads: int              # 0 when no layer is full attention
    num_key_value_heads: int
    head_dim: int
    rotary_dims: int                      # int(head_dim * partial_rotary_factor)
    rope_theta: float
    max_position_embeddings: int          # 0: no limit
    rms_norm_eps: float
    tie_word_embeddings: bool
    num_parameters: int
    mlp_types: Tuple[str, ...] = ()       # per layer: "dense" (SwiGLU) or "moe" (sparse mixture of experts)
    num_experts: int = 0                  # the MoE layers' (0: none)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    output_router_logits: bool = False    # the loss adds router_aux_loss_coef x the aux loss
    router_aux_loss_coef: float = 0.0

    @property
    def vocab(self):
        return self.vocab_size

    @property
    def layers(self):
        return self.num_hidden_layers

    @classmethod
    def _from_c(cls, c):
        return cls(vocab_size=c.vocab, hidden_size=c.E, num_hidden_layers=c.L,
                   intermediate_size=c.I,
                   layer_types=tuple("full_attention" if c.full_attention[i] else "linear_attention"
                                     for i in range(c.L)),
                   linear_num_key_heads=c.Hk, linear_num_value_heads=c.Hv,
                   linear_key_head_dim=c.K, linear_value_head_dim=c.V, linear_conv_kernel_dim=c.Kc,
                   num_attention_heads=c.H, num_key_value_heads=c.Hkv, head_dim=c.d,
                   rotary_dims=c.R, rope_theta=c.rope_theta, max_position_embeddings=c.max_position,
                   rms_norm_eps=float(c.eps), tie_word_embeddings=bool(c.tie_embeddings),
                   num_parameters=int(L.gdn_model_param_count(ctypes.byref(c))),
                   mlp_types=tuple("moe" if c.moe[i] else "dense" for i in range(c.L)),
                   num_experts=c.n_experts, num_experts_per_tok=c.top_k, moe_intermediate_size=c.moe_I,
                   shared_expert_intermediate_size=c.shared_I, norm_topk_prob=bool(c.norm_topk),
                   output_router_logits=bool(c.router_aux), router_aux_loss_coef=float(c.router_aux_coef))


def _int_arg(name, v, lo, hi=None):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(v).__name__}")
    v = int(v)
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} = {v}: expected an integer {rng}")
    return v


def _float_arg(name, v, ok, want):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number, not {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v) or not ok(v):
        raise ValueError(f"{name} = {v}: expected {want}")
    return v


class Model:
    """A Qwen3.5 checkpoint loaded into the C library (weights as fp32 in one flat array).

    Calls from several Python threads take turns (a lock: the kept plan holds workspaces; the
    library runs each call on `threads` OpenMP threads). close() or a `with` block frees the
    weights."""

    _PREFILL_PIECE = 4096       # generate's prompt pieces: tokens a row

    def __init__(self, *a, **k):
        raise TypeError("use gdncp.Model.from_pretrained(path)")

    # ------------------------------------------------------------------------- loading

    @classmethod
    def from_pretrained(cls, path, threads=0, tokenizer=None):
        """path: a checkpoint directory (config.json + model.safetensors, transformers' or gdncp's)
        or a `gdncp train --out` directory (its newest complete checkpoint-N). threads: OpenMP
        threads for every call (0: all). tokenizer (for encode / decode / generate_text): None
        looks for tokenizer.json beside the weights, then in path; or a tokenizer.json file, a
        directory holding one, or a `tokenizers.Tokenizer`."""
        path = os.fspath(path)
        threads = _int_arg("threads", threads, 0, 1 << 16)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"gdncp.Model: {path!r} is not a directory (expected a checkpoint "
                                    "with config.json and model.safetensors, or a training output "
                                    "directory)")

        def kind(p):
            """None for a regular file (a link to one included), else what p is ("missing", "a
            directory", "a FIFO", "a character device", ...)."""
            import stat
            try:
                m = os.stat(p).st_mode
            except FileNotFoundError:
                return "missing" if not os.path.islink(p) else "a broken link"
            except OSError as e:
                return f"unreadable ({e.strerror})"
            if stat.S_ISREG(m):
                return None
            return next((w for t, w in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                                        (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                                        (stat.S_ISSOCK, "a socket")) if t(m)), "not a regular file")

        def missing(d):
            cfg = os.path.join(d, "config.json")
            if kind(cfg):
                raise FileNotFoundError(f"gdncp.Model: {cfg} is {kind(cfg)}" + ("" if kind(cfg) == "missing" else
                                        ", not a regular file"))
            files = [os.path.join(d, f) for f in ("model.safetensors", "model.safetensors.index.json")]
            kinds = [kind(f) for f in files]
            if all(kinds):
                what = next((f"{f} is {k}, not a regular file" for f, k in zip(files, kinds) if k != "missing"),
                            f"{files[0]} is missing (nor is there a sharded checkpoint's "
                            "model.safetensors.index.json)")
                raise FileNotFoundError(f"gdncp.Model: {what}")
        if os.path.isfile(os.path.join(path, "config.json")):
            missing(path)                               # a checkpoint directory missing its weights
        buf = ctypes.create_string_buffer(4096)
        rc = L.gdn_ckpt_resolve(os.fsencode(path), buf, len(buf))
        if rc == L.GDN_ERR_MISSING:                     # no checkpoint in path
            raise FileNotFoundError(str(L.GdncpError(f"gdncp.Model: {path}", rc)))
        L.check(rc, f"gdncp.Model: {path}")
        d = os.fsdecode(buf.value)
        missing(d)
        cfg = L.ModelConfig()
        L.check(L.gdn_ckpt_load_config(os.fsencode(d), ctypes.byref(cfg)), f"gdncp.Model: {d}/config.json")
        note = (L.gdn_ckpt_note() or b"").decode(errors="replace")
        if note:   # a field transformers ignores for this model type (gdncp follows transformers)
            import warnings
            warnings.warn(f"gdncp.Model: {note}", stacklevel=2)
        vmax = np.iinfo(L.TOKEN_DTYPE).max
        if cfg.vocab - 1 > vmax:   # cannot happen while the library refuses such configs
            raise ValueError(f"gdncp.Model: vocab {cfg.vocab} does not fit the token type "
                             f"{np.dtype(L.TOKEN_DTYPE)}")
        n = L.gdn_model_param_floats(ctypes.byref(cfg))
        # as the C trainer's (gdn_alloc_large): 2 MiB-aligned, in transparent huge pages
        w = raw = L.huge_empty(n, np.float32)
        L.check(L.gdn_ckpt_load(os.fsencode(d), ctypes.byref(cfg), L.f32p(w), None, None, None),
                f"gdncp.Model: {d}/model.safetensors")
        m = object.__new__(cls)
        m._cfg, m._raw, m._w, m._threads, m._dir, m._path = cfg, raw, w, threads, d, path
        m._plans, m._tokenizer, m._tensor_table = PlanCache(), None, None   # this model's plans
        if tokenizer is not None:
            m._tokenizer = m._load_tokenizer(tokenizer)
        m._lock = threading.RLock()
        m.config = ModelConfig._from_c(cfg)
        return m

    @property
    def path(self):
        """The checkpoint directory the weights came from (resolved from a training directory)."""
        return self._dir

    def close(self):
        """Free the plans and the weights (idempotent); the model cannot be used afterwards."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return
        with lock:
            self._plans.clear()   # each destroyed with its last reference
            self._w = self._raw = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self):
        c = self.config
        kinds = "".join("A" if t == "full_attention" else "G" for t in c.layer_types)
        return (f"gdncp.Model({self._dir!r}, vocab {c.vocab_size}, hidden {c.hidden_size}, "
                f"layers {kinds} (G GatedDeltaNet, A attention), {c.num_parameters} parameters)")

    def _live(self):
        if self._w is None:
            raise RuntimeError("gdncp.Model: the model was closed")

    # ------------------------------------------------------------------------- inputs

    def _ids(self, input_ids, name="input_ids"):
        """input_ids as a C-contiguous [B, T] array of the token type, every id checked."""
        a = input_ids
        if hasattr(a, "detach") and hasattr(a, "cpu"):      # a torch tensor
            a = a.detach().cpu().numpy()
        try:
            a = np.asarray(a)
        except ValueError as e:                              # ragged lists
            raise ValueError(f"{name} must be a rectangular [B, T] array of token ids: {e}") from None
        if a.dtype == object or not (np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"{name} must hold integer token ids, not {a.dtype}")
        if a.ndim != 2:
            raise ValueError(f"{name} must be [B, T] (2 dimensions), got shape {tuple(a.shape)}")
        B, T = a.shape
        if B < 1 or T < 1:
            raise ValueError(f"{name} has shape {tuple(a.shape)}: needs at least one row and one token")
        V = self._cfg.vocab
        lo, hi = a.min(), a.max()
        if lo < 0 or hi >= V:
            bad = int(lo) if lo < 0 else int(hi)
            b, t = (int(x) for x in np.argwhere(a == bad)[0])
            raise ValueError(f"{name}[{b}, {t}] = {bad} is not a token id of this model "
                             f"(0 .. {V - 1}, vocab {V})")
        return np.ascontiguousarray(a, dtype=L.TOKEN_DTYPE)

    def _check_length(self, total, what):
        """Refuse sequences longer than max_position_embeddings (attention layers only: RoPE
        positions and KV caches; the C side refuses them too)."""
        mp = self._cfg.max_position
        if mp > 0 and L.gdn_model_count_layers(ctypes.byref(self._cfg), L.GDN_MODEL_ATTN_LAYERS) and total > mp:
            raise ValueError(f"{what} = {total} tokens is beyond this model's max_position_embeddings "
                             f"= {mp}")

    # ------------------------------------------------------------------------- forward

    def logits(self, input_ids):
        """The next-token logits of every position: input_ids [B, T] (numpy, torch or nested
        lists of ints) -> float32 numpy [B, T, vocab], position t the logits of the token after
        input_ids[:, t] (transformers' `model(input_ids).logits`)."""
        with self._lock:
            return self._logits(input_ids)

    def _model_plan(self, kind, key, run, what):
        """This model's plan for `kind` ("logits" or "train": one each, the last shape's; a new
        shape frees the old plan before making its own). A model plan keeps state between calls
        (a forward's activations for the backward), so it is the model's alone."""
        cfg = self._cfg
        return self._plans.get((kind,) + tuple(key), lambda: Plan(
            lambda h, r: L.gdn_model_plan_create(h, ctypes.byref(cfg), r, None),
            L.gdn_model_plan_destroy, run, what), 1)

    def _logits(self, input_ids):
        self._live()
        ids = self._ids(input_ids)
        B, T = ids.shape
        self._check_length(T, "input_ids' length")
        plan = self._model_plan("logits", (B, T), L.ModelRun(
            B=B, T=T, threads=self._threads, recompute=1, check_finite=1), "gdncp.Model.logits")
        out = np.empty((B, T, self._cfg.vocab), np.float32)
        L.check(L.gdn_model_logits(plan.h, L.f32p(self._w), ids.ctypes.data_as(L.P_token),
                                   L.f32p(out)), "gdncp.Model.logits")
        return out

    # ------------------------------------------------------------------------- training step

    def state_dict(self):
        """{Hugging Face name: float32 numpy array} of every parameter, views of the model's
        weights (writing into one changes the model; a tied model has no lm_head.weight). The
        names and shapes are those of loss_and_grads' gradients."""
        with self._lock:
            self._live()
            return {n: self._w[o:o + k].reshape(sh) for n, o, k, sh in self._tensors()}

    def _tensors(self):
        if self._tensor_table is None:      # fixed by the config: read once
            c = ctypes.byref(self._cfg)
            out = []
            for i in range(L.gdn_model_tensor_count(c)):
                info = L.ModelTensorInfo()
                L.check(L.gdn_model_tensor(c, i, ctypes.byref(info)), "gdncp.Model: tensor table")
                out.append((info.name.decode(), int(info.offset), int(info.numel),
                            tuple(int(info.shape[d]) for d in range(info.ndim))))
            self._tensor_table = tuple(out)
        return self._tensor_table

    def _views(self, flat):
        """{name: view of flat} in the gradient layout (state_dict()'s names and shapes)."""
        return {n: flat[o:o + k].reshape(sh) for n, o, k, sh in self._tensors()}

    @property
    def grad_size(self):
        """Floats of the flat gradient (= of the flat weights, padding included): the size of
        grad_buffer() and of loss_and_grads' out."""
        return int(L.gdn_model_param_floats(ctypes.byref(self._cfg)))

    def grad_buffer(self):
        """A new flat float32 array of grad_size floats for loss_and_grads(out=...), allocated as
        the C trainer allocates its gradient: 2 MiB-aligned, in transparent huge pages."""
        return L.huge_empty(self.grad_size, np.float32)

    def _check_out(self, out):
        n = self.grad_size
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy float32 array of {n} floats (grad_buffer()), "
                            f"not {type(out).__name__}")
        if out.dtype != np.float32 or out.ndim != 1 or out.size != n:
            raise ValueError(f"out must be a flat float32 array of grad_size = {n} floats "
                             f"(grad_buffer()), got {out.dtype} of shape {tuple(out.shape)}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out must be C-contiguous and writeable (grad_buffer())")
        if np.may_share_memory(out, self._w):
            raise ValueError("out overlaps the model's weights (state_dict()'s arrays): give a "
                             "buffer of its own (grad_buffer())")
        return out

    def _omp_threads(self):
        """The threads count the plans run on (threads=0: OMP_NUM_THREADS, else the CPUs this
        process may run on), for the calls that need a number (AdamW)."""
        if self._threads > 0:
            return self._threads
        try:
            n = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
            if n > 0:
                return n
        except ValueError:
            pass
        try:
            return len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return os.cpu_count() or 1

    def adamw(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, clip=0.0,
              group=None, zero=0):
        """An AdamW optimizer on this model's weights (the C library's, gdn_adamw_update, which
        `gdncp train` runs; torch.optim.AdamW's defaults): opt.step(input_ids) is one training
        step. It owns the gradient buffer and the two moments (3 x the weights' memory, allocated
        here once); see AdamW.

        group: data parallelism over the ranks of an mpi4py communicator or a torch.distributed
        (gloo) process group, each rank stepping on its own batch (gdncp.sharded.ShardedAdamW:
        the step of every rank's batches together), with the training state sharded by `zero`
        (0 replicated, 1 the moments, 2 also the gradient's sums; DESIGN §15). Collective: every
        rank of the group makes it, with the same settings and weights."""
        if group is None:
            if zero != 0:
                raise ValueError(f"zero={zero!r} shards the training state over the ranks of a "
                                 "group: give group= (an mpi4py communicator or a "
                                 "torch.distributed process group)")
            return AdamW(self, lr, betas, eps, weight_decay, clip)
        from .sharded import ShardedAdamW
        return ShardedAdamW(self, group, zero, lr, betas, eps, weight_decay, clip)

    def loss(self, input_ids, compute="fp32"):
        """transformers' `model(input_ids, labels=input_ids).loss`: the mean over the B (T - 1)
        next-token predictions of input_ids [B, T] (T >= 2) of -log p(next token), in double
        from the fp32 model; for a mixture-of-experts model whose config says
        output_router_logits, plus router_aux_loss_coef x the load-balancing loss of every MoE
        layer's router over all B T tokens (as transformers). compute="bf16": the projections, the MLP and lm_head with bfloat16
        operands (fp32 accumulation; gdncp/compute.h)."""
        with self._lock:
            return self._step(input_ids, compute, False, False)[0]

    def loss_and_grads(self, input_ids, compute="fp32", recompute=False, out=None):
        """(loss, grads): loss as `loss` gives it, and grads {name: float32 array} the gradient
        of that loss with respect to every parameter (state_dict()'s names and shapes; a tied
        model's embedding gradient holds the output head's share too), as transformers'
        `loss.backward()` leaves them in `.grad`. recompute=True keeps only each layer's input
        in the forward and recomputes the layer in the backward (less memory, ~1.3x the time).

        out=None: the gradients are views of a new flat array (a parameter-sized allocation a
        call; each call's result is its own). out=buf (grad_buffer(), or any C-contiguous
        writeable float32 array of grad_size floats apart from the weights): the gradient is
        written into buf, overwriting it (not accumulated), and grads are views of buf, so the
        next call with the same buf overwrites them: copy what must outlive it. No
        parameter-sized allocation then; AdamW.step goes further (moments and update in C)."""
        if out is not None:
            self._check_out(out)
        with self._lock:
            loss, dw = self._step(input_ids, compute, True, bool(recompute), out)
            return loss, self._views(dw)

    def _step(self, input_ids, compute, grads, recompute, dw=None):
        """(loss, the flat gradient in the C layout (written into dw when given, else into a new
        array), or None without grads)."""
        st = self._train_prepare(input_ids, compute, recompute)
        loss = self._train_forward(st, st.denom, grads) / st.denom + self._aux_loss(st)
        if not grads:
            return loss, None
        if dw is None:
            dw = L.huge_empty(self._w.size, np.float32)
        self._train_backward(st, dw)
        return loss, dw

    # The three phases of a training step, apart, for a caller that sums over data-parallel ranks
    # between them (gdncp.sharded: the token count before the forward, the loss and the routers'
    # statistics after it, the gradient after the backward), as `gdncp train` does in C.

    def _train_prepare(self, input_ids, compute, recompute):
        """The checked batch and its plan: a namespace with plan, ids, B, T1, aux (an MoE model's
        aux loss on: the routers' statistics matter) and denom (this batch's B (T1 - 1) predicted
        tokens)."""
        self._live()
        if compute not in ("fp32", "bf16"):
            raise ValueError(f"compute must be 'fp32' or 'bf16', got {compute!r}")
        ids = self._ids(input_ids)
        B, T1 = ids.shape
        if T1 < 2:
            raise ValueError(f"input_ids has {T1} token per row: a loss needs at least 2 (each "
                             "token predicts the next)")
        self._check_length(T1, "input_ids' length")
        # an MoE model with the aux loss routes all T1 tokens, as transformers does: the plan runs
        # T1 inputs, the last one's target a document of its own (a dummy, not predicted)
        aux = bool(self._cfg.router_aux) and L.gdn_model_count_layers(ctypes.byref(self._cfg), L.GDN_MODEL_MOE_LAYERS) > 0
        T = T1 if aux else T1 - 1
        train = self._model_plan("train", (B, T, compute, recompute), L.ModelRun(
            B=B, T=T, threads=self._threads, recompute=int(recompute), check_finite=1,
            compute=1 if compute == "bf16" else 0, pack=int(aux)), "gdncp.Model.loss")
        plan = train.h
        if aux:
            ids = np.ascontiguousarray(np.concatenate([ids, np.zeros((B, 1), ids.dtype)], axis=1))
            cu = np.tile(np.array([0, T1, T1 + 1], np.int64), B)
            n_docs, targets = np.full(B, 2, np.int64), ctypes.c_int64()
            L.check(L.gdn_model_set_docs(plan, cu.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                                         n_docs.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), 0,
                                         ctypes.byref(targets)), "gdncp.Model.loss")
        return _TrainStep(plan=plan, train=train, ids=ids, B=B, T1=T1, aux=aux,
                          denom=float(B * (T1 - 1)))

    def _train_forward(self, st, denom, for_backward):
        """The forward of a prepared step: the sum of -log p over its targets (the loss is that
        over denom, the token count of every rank's batch together, which scales the backward's
        gradient)."""
        loss_sum = ctypes.c_double()
        L.check(L.gdn_model_forward(st.plan, L.f32p(self._w), st.ids.ctypes.data_as(L.P_token),
                                    float(denom), ctypes.byref(loss_sum), int(for_backward)),
                "gdncp.Model.loss")
        return loss_sum.value

    def _aux_loss(self, st):
        """router_aux_coef x the aux loss of the routers' statistics the plan holds (0 off)."""
        return self._cfg.router_aux_coef * L.gdn_model_aux_loss(st.plan) if st.aux else 0.0

    def _train_backward(self, st, dw):
        L.check(L.gdn_model_backward(st.plan, L.f32p(self._w), L.f32p(dw),
                                     st.ids.ctypes.data_as(L.P_token)),
                "gdncp.Model.loss_and_grads")

    # ------------------------------------------------------------------------- generation

    @staticmethod
    def _sampling(do_sample, temperature, top_k, top_p):
        temperature = _float_arg("temperature", temperature, lambda v: v > 0,
                                 "a finite value > 0 (do_sample=False is greedy)")
        top_k = _int_arg("top_k", top_k, 0)
        top_p = _float_arg("top_p", top_p, lambda v: 0 < v <= 1, "a probability in (0, 1]")
        if not isinstance(do_sample, (bool, np.bool_)):
            raise TypeError(f"do_sample must be a bool, not {type(do_sample).__name__}")
        if not do_sample:
            return L.Sampling(0.0, 0, 1.0)
        return L.Sampling(temperature, top_k, top_p)

    def _eos(self, eos_token_id):
        """eos_token_id (None, an id or a list of ids) as a list, every id checked."""
        if eos_token_id is None:
            return []
        ids = [eos_token_id] if isinstance(eos_token_id, numbers.Integral) else list(eos_token_id)
        return [_int_arg("eos_token_id", e, 0, self._cfg.vocab - 1) for e in ids]

    def generate(self, input_ids, max_new_tokens=20, do_sample=False, temperature=1.0, top_k=0,
                 top_p=1.0, seed=0, eos_token_id=None, pad_token_id=None, stop=None,
                 cache_dtype="f32", compute="fp32"):
        """New tokens after each prompt row: input_ids [B, T] -> int64 numpy [B, N] with
        N = max_new_tokens (transformers' `generate(...)[:, T:]`).

        do_sample=False: greedy (the first most likely token). do_sample=True: softmax(logits /
        temperature) over the top_k largest logits (0: all), then the smallest set of the largest
        whose probability reaches top_p (1: all); row b draws from the seeded stream of
        seed + b (`gdncp sample --seed (seed + b) --temperature T --top-k K --top-p P` gives the
        same tokens). eos_token_id (an id or a list): a row that produced one is finished and
        continues with pad_token_id (default: the first eos id); once every row is finished the
        result stops early, with fewer than max_new_tokens columns. stop (a sequence of ids, e.g.
        pack_separator()): a row whose newest tokens are it is finished too, after writing it.
        cache_dtype="bf16": the attention layers' KV caches in BF16 (half their memory and of the
        bytes each token reads; keys and values rounded to nearest even, attention in fp32).
        compute="bf16": the prompt's products (projections, MLPs, the head) with bf16 operands and
        fp32 accumulation (`gdncp sample --compute bf16`; a faster prefill where the CPU has BF16
        instructions, logits within ~1e-2); each new token's step stays fp32."""
        self._live()
        ids = self._ids(input_ids)
        B, T = ids.shape
        N = _int_arg("max_new_tokens", max_new_tokens, 0)
        s = self._sampling(do_sample, temperature, top_k, top_p)
        seed = _int_arg("seed", seed, 0, (1 << 64) - 1)
        eos = self._eos(eos_token_id)
        pad = (eos[0] if eos else 0) if pad_token_id is None else \
            _int_arg("pad_token_id", pad_token_id, 0, self._cfg.vocab - 1)
        stop = self._stop(stop)
        cdt = self._cache_dtype(cache_dtype)
        if compute not in ("fp32", "bf16"):
            raise ValueError(f"compute must be 'fp32' or 'bf16', got {compute!r}")
        if N == 0:
            return np.zeros((B, 0), np.int64)
        self._check_length(T + N, "the prompt plus max_new_tokens")
        with self._lock:
            self._live()
            return self._generate(ids, N, s, seed, set(eos), pad, stop=stop, cache_dtype=cdt,
                                  compute=1 if compute == "bf16" else 0)

    @staticmethod
    def _cache_dtype(v):
        if v not in ("f32", "bf16"):
            raise ValueError(f"cache_dtype must be 'f32' or 'bf16', got {v!r}")
        return 2 if v == "bf16" else 0   # gdn_dtype's F32 / BF16

    def _stop(self, stop):
        """stop as a tuple of checked ids (a str through encode), or None."""
        if stop is None:
            return None
        ids = self.encode(stop) if isinstance(stop, str) else list(stop)
        if not ids:
            raise ValueError("stop is empty: give at least one id")
        return tuple(_int_arg("stop", x, 0, self._cfg.vocab - 1) for x in ids)

    def _generate(self, ids, N, s, seed, eos, pad, stop=None, cache_dtype=0, compute=0):
        """stop: a tuple of ids; a row whose newest tokens (prompt included) are it is finished
        (after writing it), like eos."""
        B, T = ids.shape
        V = self._cfg.vocab
        dec = ctypes.c_void_p()
        L.check(L.gdn_model_decoder_create(ctypes.byref(dec), ctypes.byref(self._cfg), B, T + N,
                                                 self._threads, cache_dtype), "gdncp.Model.generate")
        try:
            L.check(L.gdn_model_decoder_set_compute(dec, compute), "gdncp.Model.generate")
            w = L.f32p(self._w)
            # the prompt in pieces of at most _PREFILL_PIECE tokens a row (bounded activations),
            # each forming only its last position's logits (the head over B rows, not B x T)
            last = np.empty((B, V), np.float32)
            for t0 in range(0, T, self._PREFILL_PIECE):
                p = np.ascontiguousarray(ids[:, t0:t0 + self._PREFILL_PIECE])
                L.check(L.gdn_model_prefill_last(dec, w, p.ctypes.data_as(L.P_token), p.shape[1],
                                                 L.f32p(last)), "gdncp.Model.generate (prefill)")
            nw = L.gdn_sample_work_floats(ctypes.byref(s), V)
            work = np.empty(max(nw, 1), np.float32)
            rngs = [ctypes.c_uint64(L.gdn_sample_seed((seed + b) % (1 << 64))) for b in range(B)]
            out = np.empty((B, N), np.int64)
            nxt = np.empty(B, L.TOKEN_DTYPE)
            tok = ctypes.c_int64()
            done = np.zeros(B, bool)
            k = len(stop) if stop else 0
            tails = [list(ids[b, max(0, T - k):]) for b in range(B)] if k else None
            # the call's arguments made once (ctypes conversions cost more than the sampling)
            rows = [ctypes.cast(last.ctypes.data + b * V * 4, L.P_float) for b in range(B)]
            s_ref, tok_ref, work_p = ctypes.byref(s), ctypes.byref(tok), L.f32p(work)
            rng_refs = [ctypes.byref(r) for r in rngs]
            sample_next, decode = L.gdn_sample_next, L.gdn_model_decode
            nxt_p, last_p = nxt.ctypes.data_as(L.P_token), L.f32p(last)
            n = 0
            for i in range(N):
                for b in range(B):
                    rc = sample_next(tok_ref, rows[b], V, s_ref, rng_refs[b], work_p)
                    if rc:
                        L.check(rc, "gdncp.Model.generate (sampling)")
                    t = pad if done[b] else tok.value
                    out[b, i] = t
                    if k and not done[b]:
                        tails[b] = (tails[b] + [t])[-k:]
                        if tuple(int(x) for x in tails[b]) == stop:
                            done[b] = True
                    if t in eos:
                        done[b] = True
                n = i + 1
                if done.all() or i == N - 1:
                    break
                nxt[:] = out[:, i]
                rc = decode(dec, w, nxt_p, last_p)
                if rc:
                    L.check(rc, "gdncp.Model.generate (decode)")
            return out[:, :n]
        finally:
            L.gdn_model_decoder_destroy(dec)

    # ------------------------------------------------------------------------- text

    @staticmethod
    def _load_tokenizer(t):
        """A tokenizers.Tokenizer from a Tokenizer, a tokenizer.json file or a directory with one."""
        if hasattr(t, "encode") and hasattr(t, "decode"):
            return t
        f = os.fspath(t)
        if os.path.isdir(f):
            f = os.path.join(f, "tokenizer.json")
        if not os.path.isfile(f):
            raise FileNotFoundError(f"gdncp.Model: tokenizer {f} is missing")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(f"gdncp.Model: {f} needs the `tokenizers` package "
                              "(pip install tokenizers)") from None
        return Tokenizer.from_file(f)

    def _tok(self):
        """The Hugging Face tokenizer (tokenizer.json beside the weights or in the directory
        given), or None for a byte-level model (vocab 256 without one: UTF-8 bytes)."""
        if self._tokenizer is None:
            for d in (self._dir, self._path):
                f = os.path.join(d, "tokenizer.json")
                if os.path.isfile(f):
                    self._tokenizer = self._load_tokenizer(f)
                    break
            else:
                if self._cfg.vocab != 256:
                    raise FileNotFoundError(
                        f"gdncp.Model.generate_text: no tokenizer.json in {self._dir}, and the "
                        f"vocabulary ({self._cfg.vocab}) is not bytes: use generate() with ids")
                self._tokenizer = False
        return self._tokenizer or None

    def _default_eos(self):
        """generation_config.json's (then config.json's) eos_token_id, or None."""
        for f in ("generation_config.json", "config.json"):
            try:
                with open(os.path.join(self._dir, f)) as fh:
                    e = json.load(fh).get("eos_token_id")
            except (OSError, ValueError):
                continue
            if e is not None:
                return e
        return None

    def encode(self, text):
        """text -> the list of its token ids (the tokenizer's, or UTF-8 bytes)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        tok = self._tok()
        return tok.encode(text, add_special_tokens=False).ids if tok else list(text.encode("utf-8"))

    def decode(self, ids):
        """token ids -> text (special tokens skipped; invalid UTF-8 bytes replaced)."""
        ids = [int(i) for i in ids]
        tok = self._tok()
        return tok.decode(ids, skip_special_tokens=True) if tok else \
            bytes(ids).decode("utf-8", errors="replace")

    def pack_separator(self):
        """The document separator of a checkpoint `gdncp train --pack SEP` wrote (its
        trainer_state.json), as a tuple of ids, or None."""
        buf = (ctypes.c_ubyte * 64)()
        n = ctypes.c_int(0)
        L.check(L.gdn_ckpt_pack_separator(os.fsencode(self._dir), buf, 64, ctypes.byref(n), None),
                f"gdncp.Model: {self._dir}/trainer_state.json")
        return tuple(buf[:n.value]) or None

    def generate_text(self, prompt, max_new_tokens=100, eos_token_id="auto", stop="auto", **kw):
        """The continuation of prompt (a str) as a str; the other arguments are generate()'s.
        eos_token_id "auto": the checkpoint's generation_config.json / config.json eos id (none
        for byte-level models); the text ends before it. stop "auto": a checkpoint trained with
        --pack SEP stops once it writes SEP (included, as `gdncp sample --stop auto` does);
        None: no stop."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a str, not {type(prompt).__name__}")
        ids = self.encode(prompt)
        if not ids:
            raise ValueError("prompt is empty: give the model at least one token to continue")
        if isinstance(eos_token_id, str) and eos_token_id == "auto":
            eos_token_id = self._default_eos()
        stop = self.pack_separator() if isinstance(stop, str) and stop == "auto" else self._stop(stop)
        self._live()
        a = self._ids([ids])
        N = _int_arg("max_new_tokens", max_new_tokens, 0)
        samp = self._sampling(kw.pop("do_sample", False), kw.pop("temperature", 1.0),
                              kw.pop("top_k", 0), kw.pop("top_p", 1.0))
        seed = _int_arg("seed", kw.pop("seed", 0), 0, (1 << 64) - 1)
        cdt = self._cache_dtype(kw.pop("cache_dtype", "f32"))
        if kw:
            raise TypeError(f"generate_text() got unexpected arguments {sorted(kw)}")
        eos = set(self._eos(eos_token_id))
        if N == 0:
            return ""
        self._check_length(a.shape[1] + N, "the prompt plus max_new_tokens")
        with self._lock:
            self._live()
            new = self._generate(a, N, samp, seed, eos, 0, stop=stop, cache_dtype=cdt)[0]
        cut = next((i for i, t in enumerate(new) if int(t) in eos), len(new))
        return self.decode(new[:cut])


class AdamW:
    """One `gdncp train` step on a gdncp.Model from Python: opt = model.adamw(lr=...), then
    loss = opt.step(input_ids) per batch runs the forward and backward (loss_and_grads'), the
    global gradient norm (the square root of gdn_grad_sumsq's two parts), clipping to `clip` (0: none) and the C AdamW
    (gdn_adamw_update: decoupled weight decay on the matrices and conv taps, not on norms,
    A_log, dt_bias; bias-corrected moments), on the model's weights in place. Everything it
    writes lives in buffers made once here (the gradient, exp_avg, exp_avg_sq: flat, in the
    model's layout, 2 MiB-aligned transparent huge pages), so a step allocates nothing
    parameter-sized and copies no weights: the trainer's step, through ctypes.

    Attributes: lr (the next steps' rate; step(lr=) overrides it for one step, e.g. a schedule),
    betas, eps, weight_decay, clip; steps (updates applied so far; the next is 1-based
    steps + 1); grad_norm (the last step's, before clipping); grad (the last step's flat gradient,
    before clipping: overwritten by the next step) and grads (its views by name);
    exp_avg / exp_avg_sq (the flat moments). A step whose loss or gradient norm is not finite
    raises FloatingPointError and leaves the weights and moments unchanged (the trainer's
    "training diverged")."""

    def __init__(self, model, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, clip=0.0,
                 _moments=None):
        # _moments: the flat elements [lo, hi) the moments cover (gdncp.sharded: this rank's
        # slice); None, all of them
        if not isinstance(model, Model):
            raise TypeError(f"AdamW needs a gdncp.Model, not {type(model).__name__}")
        model._live()
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
        self.lr = _float_arg("lr", lr, lambda v: v >= 0, "a finite learning rate >= 0")
        b1 = _float_arg("betas[0]", b1, lambda v: 0 <= v < 1, "a value in [0, 1)")
        b2 = _float_arg("betas[1]", b2, lambda v: 0 <= v < 1, "a value in [0, 1)")
        self.betas = (b1, b2)
        self.eps = _float_arg("eps", eps, lambda v: v > 0, "a finite value > 0")
        self.weight_decay = _float_arg("weight_decay", weight_decay, lambda v: v >= 0, "a value >= 0")
        self.clip = _float_arg("clip", clip, lambda v: v >= 0, "a gradient-norm limit >= 0 (0: none)")
        self._model = model
        n = model.grad_size
        self.grad = L.huge_empty(n, np.float32)
        lo, hi = (0, n) if _moments is None else _moments
        self.exp_avg = L.huge_empty(hi - lo, np.float32)
        self.exp_avg_sq = L.huge_empty(hi - lo, np.float32)
        self.exp_avg[:] = 0      # (a fresh mapping is zero already; a small array is not)
        self.exp_avg_sq[:] = 0
        self.steps = 0
        self.grad_norm = float("nan")

    def _config(self, lr):
        a = L.gdn_adamw_default()
        a.lr = a.min_lr = lr
        a.warmup, a.steps = 0, 1 << 62          # the rate is given to every update
        a.beta1, a.beta2 = self.betas
        a.eps, a.weight_decay, a.clip = self.eps, self.weight_decay, self.clip
        return a

    @property
    def grads(self):
        """{name: view of grad}: the last step's gradient by name (overwritten by the next step)."""
        return self._model._views(self.grad)

    def step(self, input_ids, compute="fp32", recompute=False, lr=None):
        """One training step on input_ids [B, T] (the loss of loss_and_grads, compute and
        recompute as there): the gradient into self.grad, then clipping and the AdamW update of
        the model's weights (at lr, default self.lr). Returns the loss (before the update)."""
        m = self._model
        lr = self.lr if lr is None else _float_arg("lr", lr, lambda v: v >= 0, "a finite learning rate >= 0")
        a = self._config(lr)
        with m._lock:
            loss, _ = m._step(input_ids, compute, True, bool(recompute), self.grad)
            ss = (ctypes.c_double * 2)()
            L.gdn_grad_sumsq(ctypes.byref(m._cfg), L.f32p(self.grad), ss)
            gnorm = math.sqrt(ss[0] + ss[1])
            self.grad_norm = gnorm
            if not (math.isfinite(loss) and math.isfinite(gnorm)):
                raise FloatingPointError(f"gdncp AdamW step {self.steps + 1}: the loss ({loss}) or the "
                                         f"gradient norm ({gnorm}) is not finite; the update was not "
                                         "applied (training diverged: lower lr)")
            scale = self.clip / gnorm if self.clip > 0 and gnorm > self.clip else 1.0
            L.gdn_adamw_update(ctypes.byref(a), ctypes.byref(m._cfg), L.f32p(m._w), L.f32p(self.grad),
                               L.f32p(self.exp_avg), L.f32p(self.exp_avg_sq), self.steps + 1, lr, scale,
                               m._omp_threads())
            self.steps += 1
        return loss
