"""gdncp.transformers.patch(group=pg): transformers' Qwen3.5 / Qwen3.5-MoE / Qwen3-Next causal LMs
with their sequence split over a torch.distributed gloo process group (torchrun), the user's
training loop unchanged:

    import torch.distributed as dist
    import gdncp.transformers as gt
    dist.init_process_group("gloo")                          # under torchrun
    with gt.patch(group=dist.group.WORLD):
        out = model(input_ids=my_slice, labels=my_slice)     # out.loss: the whole sequence's mean
        out.loss.backward()
        gt.all_reduce_grads(model, dist.group.WORLD)           # the single-process gradient
        optimizer.step()

The contract is patch(comm=...)'s (gdncp.transformers_cp: each rank its contiguous slice in rank
order, global position_ids or none, packed documents by positions restarting at 0 with B = 1, the
loss the whole sequence's mean with this rank's share of the gradient, no cache, attention_mask all
ones); so are its agreement on the shards and positions (transformers_cp._agree_positions, over the
group) and its errors. What differs is what runs: transformers' own layer code in PyTorch, with
three module-level functions it calls routed to gdncp.torch_cp over the group:
  * causal_conv1d_forward (the GatedDeltaNet's conv): torch_cp.causal_conv1d, the halo from the
    ranks before;
  * torch_chunk_gated_delta_rule (the rule): torch_cp.chunk_gated_delta_rule (the C library's
    local rule, the shards' affine maps all-gathered);
  * the attention interface (ALL_ATTENTION_FUNCTIONS of the modeling module): torch_cp.attention
    (keys and values all-gathered, SDPA over the causal prefix);
RoPE is transformers' own at the global positions the patch supplies. The projections, norms,
MLPs and experts are the user's PyTorch (patch() routes MoE blocks and the non-CP rule as usual).
"""
import functools
import importlib
import threading
import zlib

import numpy as np
import torch

from . import core
from . import torch_cp as tcp
from . import transformers_cp as TC

__all__ = ["causal_lm_loss", "all_reduce_grads", "load_balancing_loss"]

_settings = None          # the Transport while patched
_tls = threading.local()  # .ctx: the forward in progress; .last: (ctx, mixers) for the loss


def _inside(kind):
    ctx = getattr(_tls, "ctx", None)
    if ctx is None and TC._in_backward():
        ctx = getattr(_tls, "recompute", None)   # gradient checkpointing's re-run layers
        if ctx is not None:
            return ctx
    if ctx is None:
        raise RuntimeError(f"gdncp CP: a {kind} layer ran outside its text model's forward under "
                           "patch(group=...): the patch splits whole models (" + TC._known() + ")")
    _tls.mixers += 1
    return ctx


def _text_forward(orig):
    @functools.wraps(orig)
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        tr = _settings
        if tr is None:
            return orig(self, input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=position_ids, cache=cache, inputs_embeds=inputs_embeds,
                        use_cache=use_cache, **kwargs)
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        err, B, T, pos = None, 0, 0, None
        try:
            x = input_ids if input_ids is not None else inputs_embeds
            if x is not None and x.device.type != "cpu":
                raise ValueError(f"gdncp CP: the model's inputs are on {x.device}: gdncp's "
                                 "torch.distributed CP runs on the CPU (gloo)")
            x, B, T, pos = TC._text_inputs(self, input_ids, inputs_embeds, attention_mask, position_ids, cache,
                                           "patch(group=...)")
        except Exception as e:  # noqa: BLE001 -- shared with the other ranks first
            err = e
        lengths, cu, pos_offset, err = TC._agree_positions(
            tr, B, T, pos, err, bool(kwargs.get("output_router_logits")), TC.param_dtypes(self))
        if err is not None:
            raise err
        ctx = tcp.build_cp_context(cu if cu is not None else int(sum(lengths)), group=tr,
                                   shard_lengths=lengths)
        if position_ids is None:
            position_ids = (torch.arange(T) + ctx.offset)[None].expand(B, T)
        prev = getattr(_tls, "ctx", None)
        _tls.ctx, _tls.mixers, _tls.last = ctx, 0, None
        try:
            out = orig(self, input_ids=input_ids, attention_mask=None, position_ids=position_ids,
                       cache=None, inputs_embeds=inputs_embeds, use_cache=False, **kwargs)
            _tls.last = (ctx, _tls.mixers)
            _tls.recompute = ctx
        finally:
            _tls.ctx = prev
        return out
    forward._gdncp_cp = True
    return forward


def _lm_forward(orig):
    @functools.wraps(orig)
    def forward(self, *args, labels=None, **kwargs):
        if _settings is not None:
            core._agree(_settings, None, sig=(labels is not None,),
                        names=("labels given (the loss is computed over every rank's slice, or on none)",))
        return orig(self, *args, labels=labels, **kwargs)
    forward._gdncp_cp = True
    return forward


# ---------------------------------------------------------------- the three routed functions

def causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0,
                          **kwargs):
    """transformers' causal_conv1d_forward ([B, C, T] in and out) on gdncp.torch_cp."""
    ctx = _inside("GatedDeltaNet")
    y, _ = tcp.causal_conv1d(hidden_states.transpose(1, 2), conv1d.weight.squeeze(1), conv1d.bias,
                             activation=activation, cp_context=ctx)
    return y.transpose(1, 2)


def chunk_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
               use_qk_l2norm_in_kernel=False, cu_seqlens=None, **unused):
    """gdncp.transformers.chunk_rule's target under patch(group=...)."""
    ctx = _inside("GatedDeltaNet")
    if cu_seqlens is not None:
        raise ValueError("gdncp CP: cu_seqlens inside the model is not supported under "
                         "patch(group=...): mark documents with position_ids restarting at 0")
    return tcp.chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                      output_final_state=output_final_state,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                      cp_context=ctx)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      **kwargs):
    """An attention interface of transformers (q, k, v [B, H, T, d]; returns [B, T, H, d] and no
    weights) on gdncp.torch_cp.attention."""
    ctx = _inside("full-attention")
    if dropout:
        raise ValueError("gdncp CP: attention dropout is not supported in training")
    o = tcp.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                      scale=scaling, cp_context=ctx)
    return o, None


class _AttentionFunctions:
    """Stands for a modeling module's ALL_ATTENTION_FUNCTIONS while patched: every lookup of an
    interface gives gdncp's; anything else reads the original."""

    def __init__(self, orig):
        self._orig = orig

    def get_interface(self, *args, **kwargs):
        return attention_forward

    def __getitem__(self, key):
        return attention_forward

    def __getattr__(self, name):
        return getattr(self._orig, name)


# ---------------------------------------------------------------- the loss and the gradients

def _transport(group):
    return group if isinstance(group, tcp.Transport) else tcp._transport(group)


def causal_lm_loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100,
                   shift_labels=None, group=None, **unused):
    """transformers' ForCausalLM loss over the whole sequence split on the group's ranks (the
    patch's by default); see transformers_cp.causal_lm_loss. Collective."""
    tr = _transport(group) if group is not None else _settings
    if tr is None:
        raise RuntimeError("gdncp CP: causal_lm_loss needs group= (or patch(group=...))")
    last, _tls.last = getattr(_tls, "last", None), None
    err, lab = None, None
    try:
        if shift_labels is None and labels is None:
            raise ValueError("gdncp CP: the loss needs labels or shift_labels")
        if last is None or last[1] == 0:
            raise ValueError("gdncp CP: the model that computed this loss ran no gdncp layer "
                             "under patch(group=...): its type is not one the patch splits ("
                             + TC._known() + ")")
        ctx = last[0]
        B = logits.shape[0]
        if logits.shape[1] != ctx.T:
            raise ValueError(f"gdncp CP: logits {tuple(logits.shape[:2])} are not the last "
                             f"forward's slice of {ctx.T} tokens")
        if shift_labels is None:
            lab = labels.detach().to("cpu", torch.int64)
            if tuple(lab.shape) != (B, ctx.T):
                raise ValueError(f"gdncp CP: labels must be [B, T_local] = [{B}, {ctx.T}], got "
                                 f"{tuple(lab.shape)}")
    except Exception as e:  # noqa: BLE001
        err = e
    core._agree(tr, err)
    if shift_labels is None:   # this rank's last token predicts the next rank's first label
        firsts = tr.allgather(lab[:, :1].contiguous())             # [D, B, 1]
        nxt = (firsts[tr.rank + 1] if tr.rank + 1 < tr.size
               else torch.full((lab.shape[0], 1), ignore_index, dtype=torch.int64))
        shift_labels = torch.cat([lab[:, 1:], nxt], 1)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, logits.shape[-1])
    local = torch.nn.functional.cross_entropy(flat, shift_labels, ignore_index=ignore_index,
                                              reduction="sum")
    sums = torch.tensor([local.item(), float((shift_labels != ignore_index).sum())],
                        dtype=torch.float64)
    tr.allreduce_(sums)
    count = float(num_items_in_batch) if num_items_in_batch is not None else float(sums[1])
    count = max(count, 1.0) if float(sums[1]) == 0 else count
    whole = torch.tensor(float(sums[0]) / count, dtype=local.dtype)
    return (local - local.detach()) / count + whole


def load_balancing_loss(gate_logits, num_experts=None, top_k=2, attention_mask=None, group=None):
    """transformers_cp.load_balancing_loss over the group (the patch's by default)."""
    if gate_logits is None or not isinstance(gate_logits, tuple) or not gate_logits:
        return 0
    tr = _transport(group) if group is not None else _settings
    return TC.aux_loss_over(gate_logits, int(num_experts), top_k, tr.allreduce_)


def _aux_loss(*args, **kwargs):
    return load_balancing_loss(*args, **kwargs)


def all_reduce_grads(model, group):
    """Sum every parameter's .grad over the group's ranks (one all-reduce). Collective."""
    tr = _transport(group)
    params = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
    table = tr.allgather_object(zlib.crc32("\n".join(n for n, _ in params).encode()))
    if any(h != table[0] for h in table):
        raise ValueError("gdncp CP: the ranks hold gradients for different parameters "
                         f"(rank {next(r for r, h in enumerate(table) if h != table[0])} differs "
                         "from rank 0)")
    if not params:
        return
    buf = tr.allreduce_(torch.cat([p.grad.detach().reshape(-1).to(torch.float32)
                                   for _, p in params]))
    at = 0
    for _, p in params:
        n = p.grad.numel()
        p.grad.copy_(buf[at:at + n].view_as(p.grad))
        at += n


# ---------------------------------------------------------------- installing it

def install(set_attr, group, rules):
    """Route the three functions and the forwards (set_attr records what it replaces). rules:
    gdncp.transformers' _RULES dict (its chunk_rule looks the rule up there at call time)."""
    global _settings
    from transformers.loss import loss_utils
    tr = _transport(group)   # a NCCL group or an uninitialised torch.distributed raised here
    found = TC.targets()
    if not found:
        raise ImportError("gdncp.transformers.patch(group=...): transformers has none of "
                          + TC._known())
    for text, gdn, attn, fused in found:
        mod = importlib.import_module(text.__module__)
        set_attr(text, "forward", _text_forward(text.forward))
        set_attr(mod, "causal_conv1d_forward", causal_conv1d_forward)
        set_attr(mod, "ALL_ATTENTION_FUNCTIONS", _AttentionFunctions(mod.ALL_ATTENTION_FUNCTIONS))
        if hasattr(mod, "load_balancing_loss_func"):
            set_attr(mod, "load_balancing_loss_func", _aux_loss)
        lm = getattr(mod, text.__name__.replace("TextModel", "").replace("Model", "") + "ForCausalLM",
                     None)
        if lm is not None:
            set_attr(lm, "forward", _lm_forward(lm.forward))
    set_attr(rules, "chunk_gated_delta_rule", chunk_rule, item=True)
    set_attr(loss_utils.LOSS_MAPPING, "ForCausalLM", causal_lm_loss, item=True)
    _settings = tr


def uninstall():
    global _settings
    _settings = None
