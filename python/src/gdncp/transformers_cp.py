"""gdncp.transformers.patch(comm=...): transformers' Qwen3.5 / Qwen3.5-MoE / Qwen3-Next causal LMs
with their sequence split over the ranks of an mpi4py communicator (context parallelism), the
user's training loop unchanged. Every rank passes its own contiguous slice of each sequence, in
rank order (rank 0 the first tokens):

    from mpi4py import MPI
    import gdncp.transformers as gt
    comm = MPI.COMM_WORLD
    with gt.patch(comm=comm):
        out = model(input_ids=my_slice, labels=my_slice)   # out.loss: the whole sequence's mean
        out.loss.backward()
        gt.all_reduce_grads(model, comm)                     # the single-process gradient
        optimizer.step()

What runs where, under the patch:
- the text model's forward (Qwen3_5TextModel, Qwen3_5MoeTextModel, Qwen3NextModel) first agrees
  with the other ranks on the shards (one allgather): the batch size, each rank's length and
  place, and the positions. position_ids, when given, are the global ones ([B, T_local], or
  transformers' [3 or 4, B, T_local] with equal rows); absent, the patch supplies offset +
  arange. Positions that restart at 0 (B = 1) mark packed documents, which may cross ranks:
  neither the conv, nor the recurrence, nor attention reaches across a document start.
- GatedDeltaNet layers (linear_attn) run gdncp's C layer over the communicator: the causal conv
  with its Kc-1 halo rows from the previous ranks (and the halo's gradient back), the rule under
  the `strategy` (scan, allgather, relay, heads);
- full-attention layers (self_attn) run gdncp's C attention layer: keys and values passed to the
  later ranks (attention="kv") or an all-to-all to head-parallel ("heads"), RoPE at the global
  positions;
- the loss: a causal LM's `labels` loss (transformers' ForCausalLM loss) becomes the mean
  next-token loss over the whole sequence on every rank: a shard's last token is scored against
  the next shard's first label, -100 is ignored everywhere, and the mean divides by the whole
  sequence's count of targets (num_items_in_batch, when given, is taken as that count). Its
  value is the whole mean; its gradient is this rank's share, so the ranks' parameter gradients
  summed (all_reduce_grads, or a data-parallel all-reduce over the same ranks) are the
  single-process gradient.
Everything else (embeddings, MLPs and experts, norms, lm_head, the optimizer) is the user's
PyTorch on the rank's own tokens. Forward and backward are collective: every rank runs the same
model on its slice. A cache (generation) is refused under the patch; attention_mask must be all
ones (mark padding with labels = -100 instead). A bad input on one rank (slices out of rank
order, batch sizes that differ, a model type the patch does not know) is raised on every rank.
"""
import functools
import importlib
import threading
import zlib

import numpy as np
import torch

from . import cp_layers as CL
from . import core

__all__ = ["CP_MODELS", "all_reduce_grads", "causal_lm_loss"]

# (modeling module, text model, GatedDeltaNet class, attention class, the GDN's projections fused)
CP_MODELS = (
    ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5TextModel", "Qwen3_5GatedDeltaNet",
     "Qwen3_5Attention", False),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeTextModel",
     "Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeAttention", False),
    ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextModel",
     "Qwen3NextGatedDeltaNet", "Qwen3NextAttention", True),
)

_settings = None          # (comm, gdn strategy, attention strategy, compute) while patched
_tls = threading.local()  # .shard: the forward in progress; .last: the last forward's (loss)


def _known():
    return ", ".join(f"{m.rsplit('.', 1)[-1]}.{t}" for m, t, _, _, _ in CP_MODELS)


# ---------------------------------------------------------------- positions and shards

def _text_positions(position_ids, B, T):
    """This rank's text positions [B, T] (int64 numpy) from transformers' forms, or None."""
    if position_ids is None:
        return None
    p = position_ids.detach().to("cpu", torch.int64)
    if p.dim() == 3:
        # [3 or 4, B, T]: rope sections (all equal for text), the 4-row form has the text row first
        if not bool((p == p[:1]).all()):
            raise ValueError("gdncp CP: position_ids with different rows per rope section "
                             "(vision positions) are not supported; pass text positions [B, T]")
        p = p[0]
    if p.dim() == 1:
        p = p[None]
    if p.dim() != 2 or p.shape[1] != T or p.shape[0] not in (1, B):
        raise ValueError(f"gdncp CP: position_ids must be [B, T_local] = [{B}, {T}], got "
                         f"{tuple(position_ids.shape)}")
    return p.expand(B, T).numpy()


def _summary(pos):
    """What the other ranks need of this rank's positions: (dense, first, last, starts) with
    starts the local indices where a document starts (position 0), for B = 1."""
    if pos is None:
        return None
    steps = np.diff(pos, axis=1)
    if bool((steps == 1).all()) and bool((pos == pos[:1]).all()):
        return (True, int(pos[0, 0]), int(pos[0, -1]), None)
    if pos.shape[0] != 1:
        raise ValueError("gdncp CP: position_ids must be the global positions, the same for every "
                         "row (consecutive: rank r's first is the previous rank's last + 1); "
                         "packed documents (positions restarting at 0) need batch size 1")
    row = pos[0]
    starts = np.flatnonzero(row == 0)
    bad = np.flatnonzero((steps[0] != 1) & (row[1:] != 0))
    if bad.size:
        t = int(bad[0]) + 1
        raise ValueError(f"gdncp CP: position_ids jump from {int(row[t - 1])} to {int(row[t])} at "
                         f"local token {t}: positions either continue by 1 or restart at 0 (a "
                         "document start)")
    return (False, int(row[0]), int(row[-1]), starts.astype(np.int64))


def param_dtypes(model):
    """The model's parameters' dtypes, as one value every rank must share ("float32 x 56", and a
    checksum of which parameter has which): a rank whose weights are of another dtype runs other
    code paths of transformers' own and meets the others in no collective."""
    counts, names = {}, []
    for n, p in model.named_parameters():
        d = str(p.dtype).replace("torch.", "")
        counts[d] = counts.get(d, 0) + 1
        names.append(f"{n}:{d}")
    return (", ".join(f"{d} x {k}" for d, k in sorted(counts.items())) +
            f" (parameters by name: crc {zlib.crc32(chr(10).join(names).encode()):08x})")


def _shard_from(settings, B, T, pos, err, router_logits=False, dtypes=None):
    """The agreement of one forward: the ranks' lengths and positions, then the Shard (both
    collective; a failure on any rank raised on every rank)."""
    comm, gdn, attention, compute = settings
    _, cu, pos_offset, err = _agree_positions(core._comm_state(comm), B, T, pos, err,
                                              router_logits, dtypes)
    return CL.Shard(comm, B, T, cu_seqlens=cu, pos_offset=pos_offset, gdn=gdn, attention=attention,
                    compute=compute, error=err)


def _agree_positions(st, B, T, pos, err, router_logits=False, dtypes=None):
    """One collective over st (core._agree's: a communicator state, or gdncp.torch_cp's
    Transport): every rank's batch size, length and positions. Returns (the ranks' lengths, the
    whole stream's document offsets cu or None, the position of the first token, err): err, a
    failure found in the table, is the same on every rank (raise it everywhere); a local failure
    passed in is raised on every rank by the agreement itself."""
    summ, lengths = None, None
    try:
        if err is None:
            summ = _summary(pos)
    except Exception as e:  # noqa: BLE001
        err = e
    table = core._agree(st, err, sig=(router_logits, dtypes),
                        names=("output_router_logits (the MoE aux loss: every rank's routers or none)",
                               "the model's parameter dtypes"),
                        extra=(B, T, summ))
    cu, pos_offset = None, 0
    if err is None:
        try:
            Bs = [b for b, _, _ in table]
            if any(b != Bs[0] for b in Bs):
                raise ValueError(f"gdncp CP: the ranks' slices have different batch sizes {Bs}: "
                                 "every rank passes the same rows, each its own tokens of them")
            lengths = [t for _, t, _ in table]
            offsets = np.cumsum([0] + lengths)
            summs = [s for _, _, s in table]
            given = [s is not None for s in summs]
            if any(given) and not all(given):
                raise ValueError("gdncp CP: position_ids given on some ranks and not on others "
                                 f"(ranks {[r for r, g in enumerate(given) if g]} gave them)")
            if all(given):
                dense = all(s[0] for s in summs) and all(
                    summs[r][1] == summs[r - 1][2] + 1 for r in range(1, len(summs)))
                if dense:
                    pos_offset = summs[0][1]
                    if pos_offset < 0:
                        raise ValueError(f"gdncp CP: position_ids start at {pos_offset} < 0")
                else:
                    if Bs[0] != 1:
                        r = next(r for r in range(1, len(summs))
                                 if summs[r][1] != summs[r - 1][2] + 1)
                        raise ValueError(
                            f"gdncp CP: rank {r}'s positions start at {summs[r][1]}, rank {r - 1}'s "
                            f"end at {summs[r - 1][2]}: each rank passes the next slice of the "
                            "sequence in rank order, with its global position_ids (packed "
                            "documents, positions restarting at 0, need batch size 1)")
                    starts = []
                    for r, (dense_r, first, last, st_r) in enumerate(summs):
                        loc = st_r
                        if dense_r:   # one piece: a document starts here only at position 0
                            loc = np.array([0] if first == 0 else [], np.int64)
                        if r == 0 and first != 0:
                            raise ValueError(
                                f"gdncp CP: rank 0's positions start at {first}: packed documents "
                                "start at position 0, and the slices must come in rank order "
                                "(rank 0 the sequence's first tokens)")
                        if r > 0 and first != 0 and first != summs[r - 1][2] + 1:
                            raise ValueError(
                                f"gdncp CP: rank {r}'s positions start at {first}, neither 0 (a "
                                f"document start) nor rank {r - 1}'s last + 1 ({summs[r - 1][2] + 1}): "
                                "the slices must come in rank order with global position_ids")
                        starts.extend(int(offsets[r] + i) for i in loc)
                    cu = np.array(sorted(set(starts)) + [int(offsets[-1])], np.int64)
        except Exception as e:  # noqa: BLE001 -- every rank reached the same table: same error
            err = e
    return lengths, cu, pos_offset, err


# ---------------------------------------------------------------- the patched forwards

def _text_inputs(model, input_ids, inputs_embeds, attention_mask, position_ids, cache, patch):
    """The checks every rank makes of a text model's inputs under a CP patch (`patch` names it in
    the messages: "patch(comm=...)", "patch(group=...)"): (the input, B, T, the positions read
    from position_ids or None), or a ValueError, which the caller shares with the other ranks
    before raising it."""
    x = input_ids if input_ids is not None else inputs_embeds
    if x is None or (input_ids is not None and inputs_embeds is not None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if x.dim() < 2:
        raise ValueError(f"gdncp CP: input_ids must be [B, T_local], got {tuple(x.shape)}")
    B, T = int(x.shape[0]), int(x.shape[1])
    if cache is not None:
        raise ValueError(f"gdncp CP: under {patch} the model runs without a cache "
                         "(training, or a whole-sequence forward); generate outside the "
                         "patch or with gdncp.Model")
    if attention_mask is not None:
        if isinstance(attention_mask, dict) or not bool((attention_mask != 0).all()):
            raise ValueError(f"gdncp CP: attention_mask must be all ones under {patch} (no padding "
                             "tokens inside the sequence; mark padding targets with labels = -100)")
    pos = _text_positions(position_ids, B, T)
    vocab = getattr(getattr(model, "embed_tokens", None), "num_embeddings", None)
    if input_ids is not None and vocab is not None and input_ids.numel():
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"gdncp CP: token id {bad} in this rank's input_ids is outside the "
                             f"vocabulary [0, {vocab})")
    return x, B, T, pos


def _text_forward(orig):
    @functools.wraps(orig)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        settings = _settings
        if settings is None:     # an instance method kept past the patch
            return orig(self, input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                        use_cache=use_cache, **kwargs)
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        err, B, T, pos, x = None, 0, 0, None, None
        try:
            x, B, T, pos = _text_inputs(self, input_ids, inputs_embeds, attention_mask, position_ids, cache,
                                        "patch(comm=...)")
        except Exception as e:  # noqa: BLE001 -- shared with the other ranks first
            err = e
        shard = _shard_from(settings, B, T, pos, err, bool(kwargs.get("output_router_logits")),
                            param_dtypes(self))
        if position_ids is None:
            position_ids = (torch.arange(T, device=x.device) + shard.offset)[None].expand(B, T)
        prev = getattr(_tls, "shard", None)
        _tls.shard, _tls.mixers, _tls.last = shard, 0, None
        try:
            out = orig(self, input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                       cache=None, inputs_embeds=inputs_embeds, use_cache=False, **kwargs)
            _tls.last = (shard, _tls.mixers)   # for this forward's loss (a failed one leaves none)
            _tls.recompute = shard             # for layers re-run by gradient checkpointing
        finally:
            _tls.shard = prev
        return out
    forward._gdncp_cp = True
    return forward


def _lm_forward(orig):
    """A causal LM's forward under the patch: the ranks agree first on whether labels were given
    (the loss is collective: a rank without labels would leave the others waiting in it)."""
    @functools.wraps(orig)
    def forward(self, *args, labels=None, **kwargs):
        settings = _settings
        if settings is not None:
            core._agree(core._comm_state(settings[0]), None, sig=(labels is not None,),
                        names=("labels given (the loss is computed over every rank's slice, or on none)",))
        return orig(self, *args, labels=labels, **kwargs)
    forward._gdncp_cp = True
    return forward


def _in_backward():
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _inside(kind):
    shard = getattr(_tls, "shard", None)
    if shard is None and _in_backward():
        # gradient checkpointing re-runs the decoder layers inside the backward: the shard of
        # the forward they belong to (the last one; every rank recomputes the same layers)
        shard = getattr(_tls, "recompute", None)
        if shard is not None:
            return shard
    if shard is None:
        raise RuntimeError(f"gdncp CP: a {kind} layer ran outside its text model's forward under "
                           "patch(comm=...): the patch splits whole models (" + _known() + ")")
    _tls.mixers += 1
    return shard


def _gdn_tensors(m, fused):
    """The module's weights by gdncp's names (views: gradients reach the parameters)."""
    if getattr(m, "activation", "silu") != "silu":
        raise ValueError(f"gdncp CP: GatedDeltaNet activation {m.activation!r}: gdncp's layer is "
                         "silu's")
    if m.conv1d.bias is not None:
        raise ValueError("gdncp CP: a GatedDeltaNet conv1d with a bias is not supported")
    Hk, Hv, K, V = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    E = m.hidden_size
    t = {"conv1d.weight": m.conv1d.weight, "A_log": m.A_log, "dt_bias": m.dt_bias,
         "norm.weight": m.norm.weight, "out_proj.weight": m.out_proj.weight}
    if not fused:
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            t[name + ".weight"] = getattr(m, name).weight
    else:
        # Qwen3-Next: per key head [q K | k K | v r V | z r V] and [b r | a r] rows, r = Hv / Hk
        r = Hv // Hk
        w = m.in_proj_qkvz.weight.view(Hk, 2 * K + 2 * r * V, E)
        t["in_proj_qkv.weight"] = torch.cat([w[:, :K].reshape(Hk * K, E),
                                             w[:, K:2 * K].reshape(Hk * K, E),
                                             w[:, 2 * K:2 * K + r * V].reshape(Hv * V, E)])
        t["in_proj_z.weight"] = w[:, 2 * K + r * V:].reshape(Hv * V, E)
        ba = m.in_proj_ba.weight.view(Hk, 2 * r, E)
        t["in_proj_b.weight"] = ba[:, :r].reshape(Hv, E)
        t["in_proj_a.weight"] = ba[:, r:].reshape(Hv, E)
    dims = CL.LayerDims(E=E, Hk=Hk, Hv=Hv, K=K, V=V, Kc=int(m.conv_kernel_size),
                        eps=float(m.layer_norm_epsilon))
    return dims, t


def _gdn_forward(fused):
    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        shard = _inside("GatedDeltaNet")
        dims, tensors = _gdn_tensors(self, fused)
        return CL.gdn_layer(hidden_states, CL.flat_params("gdn", dims, tensors), shard, dims)
    forward._gdncp_cp = True
    return forward


def _rope(config):
    rp = getattr(config, "rope_parameters", None) or {}
    kind = rp.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"gdncp CP: rope_type {kind!r} is not supported (gdncp's attention "
                         "rotates with the default RoPE)")
    theta = rp.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    frac = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return float(theta), float(frac)


def _attn_tensors(m):
    c = m.config
    if getattr(c, "attention_bias", False):
        raise ValueError("gdncp CP: attention with biases (attention_bias) is not supported")
    if m.training and getattr(c, "attention_dropout", 0.0):
        raise ValueError("gdncp CP: attention dropout is not supported in training")
    theta, frac = _rope(c)
    d = int(m.head_dim)
    dims = CL.AttnDims(E=int(c.hidden_size), H=int(c.num_attention_heads),
                       Hkv=int(c.num_key_value_heads), d=d, R=int(d * frac), rope_theta=theta,
                       eps=float(m.q_norm.eps if hasattr(m.q_norm, "eps") else c.rms_norm_eps),
                       max_position=int(getattr(c, "max_position_embeddings", 0) or 0))
    t = {"q_proj.weight": m.q_proj.weight, "k_proj.weight": m.k_proj.weight,
         "v_proj.weight": m.v_proj.weight, "o_proj.weight": m.o_proj.weight,
         "q_norm.weight": m.q_norm.weight, "k_norm.weight": m.k_norm.weight}
    return dims, t


def _attn_forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None,
                  **kwargs):
    shard = _inside("full-attention")
    dims, tensors = _attn_tensors(self)
    return CL.attention_layer(hidden_states, CL.flat_params("attention", dims, tensors), shard,
                              dims), None


_attn_forward._gdncp_cp = True


# ---------------------------------------------------------------- the loss

def causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, comm=None, **unused):
    """transformers' ForCausalLM loss over the whole sequence split on comm's ranks (the
    patch's, by default): every rank's mean over all the targets, its gradient this rank's
    share. Collective."""
    settings = _settings
    comm = comm if comm is not None else (settings[0] if settings else None)
    if comm is None:
        raise RuntimeError("gdncp CP: causal_lm_loss needs comm= (or patch(comm=...))")
    st = core._comm_state(comm)
    # the forward that made these logits (consumed: a later model's loss cannot reuse it)
    last, _tls.last = getattr(_tls, "last", None), None
    err = None
    try:
        if shift_labels is None and labels is None:
            raise ValueError("gdncp CP: the loss needs labels or shift_labels")
        if last is None or last[1] == 0:
            raise ValueError("gdncp CP: the model that computed this loss ran no gdncp layer "
                             "under patch(comm=...): its type is not one the patch splits ("
                             + _known() + "); its logits are this rank's alone")
        shard = last[0]
        if logits.shape[0] != shard.B or logits.shape[1] != shard.T:
            raise ValueError(f"gdncp CP: logits {tuple(logits.shape[:2])} are not the last "
                             f"forward's slice [{shard.B}, {shard.T}] (logits_to_keep is not "
                             "supported with a CP loss)")
        lab = None if shift_labels is not None else labels.detach().to("cpu", torch.int64)
        if lab is not None and tuple(lab.shape) != (shard.B, shard.T):
            raise ValueError(f"gdncp CP: labels must be [B, T_local] = [{shard.B}, {shard.T}], "
                             f"got {tuple(lab.shape)}")
    except Exception as e:  # noqa: BLE001
        err = e
    core._agree(st, err)
    if shift_labels is None:
        # this rank's last token predicts the next rank's first label
        nxt = np.full((shard.B, 1), ignore_index, np.int64)
        first = np.ascontiguousarray(lab[:, :1].numpy())
        right, left = st.rank + 1, st.rank - 1
        reqs = []
        if left >= 0:
            reqs.append(st.py.Isend(first, dest=left, tag=7301))
        if right < st.size:
            reqs.append(st.py.Irecv(nxt, source=right, tag=7301))
        st.MPI.Request.Waitall(reqs)
        shift_labels = torch.cat([lab[:, 1:], torch.from_numpy(nxt)], 1)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    local = torch.nn.functional.cross_entropy(flat, shift_labels, ignore_index=ignore_index,
                                              reduction="sum")
    sums = np.array([local.item(), float((shift_labels != ignore_index).sum())], np.float64)
    st.py.Allreduce(st.MPI.IN_PLACE, sums, op=st.MPI.SUM)
    count = float(num_items_in_batch) if num_items_in_batch is not None else sums[1]
    count = max(count, 1.0) if sums[1] == 0 else count
    # value: the whole sequence's mean (the same bits on every rank); gradient: this rank's
    # share of it (local - local.detach() is an exact zero carrying local's gradient)
    whole = torch.tensor(sums[0] / count, dtype=local.dtype)
    return (local - local.detach()) / count + whole


def all_reduce_grads(model, comm):
    """Sum every parameter's .grad over comm's ranks (one all-reduce of all of them), for the
    gradient of the whole sequence after a CP backward. Collective; the ranks must hold
    gradients for the same parameters."""
    st = core._comm_state(comm)
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    names = [n for n, _ in params]
    table = st.py.allgather(zlib.crc32("\n".join(names).encode()))  # (hash() differs per process)
    if any(h != table[0] for h in table):
        raise ValueError("gdncp CP: the ranks hold gradients for different parameters "
                         f"(rank {next(r for r, h in enumerate(table) if h != table[0])} differs "
                         "from rank 0)")
    if not params:
        return
    buf = torch.cat([p.grad.detach().reshape(-1).to(torch.float32) for _, p in params]).numpy()
    st.py.Allreduce(st.MPI.IN_PLACE, buf, op=st.MPI.SUM)
    at = 0
    for _, p in params:
        n = p.grad.numel()
        p.grad.copy_(torch.from_numpy(buf[at:at + n]).view_as(p.grad))
        at += n


# ---------------------------------------------------------------- installing it

def load_balancing_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None, comm=None):
    """transformers' load_balancing_loss_func over the whole sequence split on comm's ranks (the
    patch's): `num_experts x sum_e f_e P_e` with the choice counts f and the mean probabilities P
    of every MoE layer's router over every rank's tokens (one all-reduce of 2 n + 1 numbers), the
    same value on every rank; its gradient this rank's share (the other ranks' sums are constants
    here: all_reduce_grads adds their shares). attention_mask is all ones under the patch."""
    if gate_logits is None or not isinstance(gate_logits, tuple) or not gate_logits:
        return 0
    settings = _settings
    comm = comm if comm is not None else (settings[0] if settings else None)
    if comm is None:
        raise RuntimeError("gdncp CP: load_balancing_loss needs comm= (or patch(comm=...))")
    st = core._comm_state(comm)

    def sum_over_ranks(t):
        out = np.empty(t.numel())
        st.py.Allreduce(t.numpy(), out)
        return torch.from_numpy(out)
    return aux_loss_over(gate_logits, int(num_experts), top_k, sum_over_ranks)


def aux_loss_over(gate_logits, n, top_k, sum_over_ranks):
    """The load-balancing loss of every MoE layer's router over the ranks' tokens, for either
    transport: sum_over_ranks(t) returns t (float64, 2 n + 1 numbers: the choice counts, the
    probability sums, the rows) summed over the ranks. The other ranks' probability sums enter
    as constants (all_reduce_grads adds their shares of the gradient)."""
    counts = torch.zeros(n, dtype=torch.float64)
    probs = torch.zeros(n, dtype=torch.float64)
    rows = 0
    for layer in gate_logits:
        p = torch.nn.functional.softmax(layer.float(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts += torch.bincount(chosen.reshape(-1), minlength=n).double()
        probs = probs + p.double().sum(dim=0)
        rows += p.shape[0]
    grid = sum_over_ranks(torch.cat([counts, probs.detach(), torch.tensor([float(rows)], dtype=torch.float64)]))
    R = grid[-1]
    others = grid[n:2 * n] - probs.detach()
    f = grid[:n] / R
    P = (probs + others) / R
    return (n * (f * P).sum()).float()


def _aux_loss(*args, **kwargs):
    # looked up at call time (a test swaps in a deliberately wrong one)
    return load_balancing_loss(*args, **kwargs)


def targets():
    """[(text model class, GDN class, attention class, fused)] of the installed transformers."""
    found = []
    for mod_name, text, gdn, attn, fused in CP_MODELS:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        classes = [getattr(mod, n, None) for n in (text, gdn, attn)]
        if all(c is not None for c in classes):
            found.append((*classes, fused))
    return found


def install(set_attr, comm, strategy, attention, compute):
    """Put the CP forwards on the classes (set_attr records what it replaces, for the undo)."""
    global _settings
    from transformers.loss import loss_utils
    core._comm_state(comm)   # a bad comm raised here, before anything is patched
    CL.check_options(strategy, attention, compute)
    found = targets()
    if not found:
        raise ImportError("gdncp.transformers.patch(comm=...): transformers has none of " + _known())
    for text, gdn, attn, fused in found:
        set_attr(text, "forward", _text_forward(text.forward))
        set_attr(gdn, "forward", _gdn_forward(fused))
        set_attr(attn, "forward", _attn_forward)
        mod = importlib.import_module(text.__module__)
        if hasattr(mod, "load_balancing_loss_func"):   # the MoE models' aux loss, over every rank
            set_attr(mod, "load_balancing_loss_func", _aux_loss)
        lm = getattr(mod, text.__name__.replace("TextModel", "").replace("Model", "") + "ForCausalLM", None)
        if lm is not None:   # labels agreed before the (collective) loss
            set_attr(lm, "forward", _lm_forward(lm.forward))
    set_attr(loss_utils.LOSS_MAPPING, "ForCausalLM", causal_lm_loss, item=True)
    _settings = (comm, strategy, attention, compute)


def uninstall():
    global _settings
    _settings = None
