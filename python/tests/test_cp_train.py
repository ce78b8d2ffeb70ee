"""Context-parallel training of transformers' own models (gdncp.transformers.patch(comm=...)) against
transformers itself on one process.

Run under MPI, never in the plain pytest run (conftest.py leaves this file out unless
GDNCP_MPI_TESTS=1):  GDNCP_MPI_TESTS=1 mpiexec.mpich -n 3 python -m pytest python/tests/test_cp_train.py

Every rank builds the same model and tokens, runs transformers unpatched on the whole sequence
(the reference: its own PyTorch rule, conv and SDPA), then the same model under the patch on its
own uneven slice (rank 1 a single token), and compares the whole-sequence loss and every
parameter's gradient (summed over the ranks with all_reduce_grads). Tolerances (fp32, max-abs
error / max-abs reference per tensor): loss 2e-6; gradients 1e-4, except the gates' A_log,
dt_bias (2e-3) and in_proj_a (1e-4), each also at least 10x transformers' own fp32 error on that
tensor against a float64 copy of the model and 2x the difference gdncp's rule makes on one
process without CP (gdncp.transformers.patch()): their gradients are sums over every token and
head of terms of both signs, and gdncp's fp32 rule rounds them less well than transformers' own
(one process, no CP, against float64: qwen35_tiny 4.9e-4 where transformers has 1.1e-4; the
random MoE model of the test 3.0e-3 where transformers has 2e-4). CP adds nothing to that: the
3-rank run's gates equal the one-process gdncp run's to the printed digits. The ranks exchange their
errors before asserting, so every rank passes or fails alike. Each comparison also runs deliberate
mistakes through the same check, which must fail it: the library's fault hooks on rank 1 (the
conv halo from rank 0 dropped, the recurrent state entering it dropped, attention without the
earlier ranks' keys and values) and local instead of global positions.
"""

import numpy as np
import pytest
import torch
from mpi4py import MPI

import gdncp.transformers as gtr
from gdncp import _lib as L
from gdncp import core

from conftest import TINY, mutate as _mutate
from cp_train_common import (exact_errors, grads as _grads, moe_tiny as _moe_tiny, next_tiny as _next_tiny,
                             rel as _rel, tiny as _tiny, worst_gradient)

COMM = MPI.COMM_WORLD
R, D = COMM.Get_rank(), COMM.Get_size()
assert D >= 2, "test_cp_train.py runs under mpiexec with 2 or more ranks (scripts/test_python.sh: 3)"
torch.set_num_threads(1)   # 3 ranks share 2 cores

LOSS_TOL, GRAD_TOL = 2e-6, 1e-4
CANCELLING = {"A_log": 2e-3, "dt_bias": 2e-3, "in_proj_a.weight": GRAD_TOL}   # the docstring
FAULT_DROP_INCOMING, FAULT_DROP_HALO, FAULT_ATTN_DROP_KV = 2, 4, 6


def _cuts(T, size=D):
    """Uneven slices: rank 0 the first 23 tokens, rank 1 one token, the rest share the others."""
    if size == 1:
        return [0, T]
    cuts = [0, 23, 24]
    for i in range(1, size - 1):
        cuts.append(24 + (T - 24) * i // (size - 2))
    return cuts if size > 2 else [0, 23, T]








def _reference(model, ids, labels, positions=None):
    """transformers on one process: (loss, gradients, the gradients' own fp32 error), the last
    measured against a float64 copy of the model (what a cancelling sum's tolerance scales by)."""
    import copy
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, use_cache=False, position_ids=positions)
    out.loss.backward()
    exact = copy.deepcopy(model).double()
    if hasattr(exact, "set_experts_implementation"):
        exact.set_experts_implementation("eager")   # (the grouped matmul takes no float64)
    exact.zero_grad()
    exact(input_ids=ids, labels=labels, use_cache=False, position_ids=positions).loss.backward()
    grads, g64 = _grads(model), _grads(exact)
    # gdncp's own rule on one process, no CP (gdncp.transformers.patch()): its rounding of the
    # gates' sums is what CP must not add to
    model.zero_grad()
    with gtr.patch():
        model(input_ids=ids, labels=labels, use_cache=False, position_ids=positions).loss.backward()
    one = _grads(model)
    model.zero_grad()
    return out.loss.item(), grads, {n: max(10 * _rel(grads[n], g64[n]), 2 * _rel(one[n], grads[n]))
                                    for n in grads}


def _cp(model, ids, labels, comm=COMM, strategy="scan", attention="kv", fault=0, positions=None):
    """This rank's slice through the patched model: the loss and the gradients summed over the
    ranks. fault: the library's fault hook on rank 1 (a control)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    cuts = _cuts(ids.shape[1], size)
    a, b = cuts[rank], cuts[rank + 1]
    model.zero_grad()
    with gtr.patch(comm=comm, strategy=strategy, attention=attention):
        _mutate(fault if rank == 1 else 0)
        try:
            out = model(input_ids=ids[:, a:b], labels=labels[:, a:b],
                        position_ids=None if positions is None else positions[:, a:b])
            out.loss.backward()
        finally:
            _mutate(0)
    gtr.all_reduce_grads(model, comm)
    return out.loss.item(), _grads(model)




def _errors(got, ref):
    """{'loss': (rel, tol), parameter name: (rel, tol)}, the worst over the ranks (the same
    everywhere). A gate's tolerance (CANCELLING) is also at least 10x transformers' own fp32
    error on that tensor and 2x gdncp's own on one process (see _reference)."""
    (loss, grads), (rloss, rgrads, own) = got[:2], ref
    e = {"loss": abs(loss - rloss) / abs(rloss)}
    assert grads.keys() == rgrads.keys(), sorted(set(grads) ^ set(rgrads))
    e.update({n: _rel(grads[n], rgrads[n]) for n in rgrads})
    table = COMM.allgather(e)
    return {k: (max(t[k] for t in table), _tol(k, own)) for k in e}


def _tol(name, own):
    if name == "loss":
        return LOSS_TOL
    gate = next((t for key, t in CANCELLING.items() if name.endswith(key)), None)
    return GRAD_TOL if gate is None else max(gate, 10 * own[name])


def _failures(errs):
    return {k: v for k, (v, tol) in errs.items() if not v <= tol}


def _assert_matches(errs):
    bad = _failures(errs)
    assert not bad, {k: f"{errs[k][0]:.2e} > {errs[k][1]:.1e}" for k in bad}


def _assert_broken(errs, what):
    assert _failures(errs), f"the control '{what}' passed the check: {errs}"


def _tokens(seed, B, T, vocab=256):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("strategy", ["scan", "allgather", "relay"])
def test_qwen35_loss_and_every_gradient_match_one_process(strategy):
    model = _tiny()
    ids = _tokens(1, 2, 50)
    ref = _reference(model, ids, ids)
    _assert_matches(_errors(_cp(model, ids, ids, strategy=strategy), ref))
    # controls through the same check
    for fault, what in ((FAULT_DROP_HALO, "conv halo dropped"),
                        (FAULT_DROP_INCOMING, "incoming state dropped"),
                        (FAULT_ATTN_DROP_KV, "earlier ranks' keys and values not attended")):
        _assert_broken(_errors(_cp(model, ids, ids, strategy=strategy, fault=fault), ref), what)


def test_padding_labels_and_the_target_across_each_boundary_count():
    """-100 labels anywhere (one at a slice's first token: the previous rank's last target), and
    the mean over the whole sequence's targets."""
    model = _tiny()
    ids = _tokens(2, 2, 50)
    labels = ids.clone()
    labels[0, 23] = -100          # rank 1's only token: rank 0's last target is ignored
    labels[1, 30:41] = -100
    labels[:, 49] = -100
    ref = _reference(model, ids, labels)
    _assert_matches(_errors(_cp(model, ids, labels), ref))
    # control: the labels as transformers shifts them within each slice (no cross-boundary target)
    from transformers.loss.loss_utils import ForCausalLMLoss
    model.loss_function = ForCausalLMLoss
    try:
        got = _cp(model, ids, labels)
    finally:
        del model._loss_function
    _assert_broken(_errors(got, ref), "per-slice loss")


def test_adamw_steps_match_one_process():
    """A few AdamW steps, the standard loop on every rank: the losses and the parameters. AdamW
    turns the rounding of a near-zero gradient element into a full step of either sign, so the
    parameters compare as the distance between the runs over the distance travelled (observed
    4.4e-3 after 4 steps); the losses per step as above."""
    steps = 4
    ref, model = _tiny(), _tiny()
    start = [p.detach().clone() for p in ref.parameters()]

    def run(fault):
        m = _tiny()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses = []
        for step in range(steps):
            ids = _tokens(10 + step, 2, 50)
            opt.zero_grad()
            loss, _ = _cp(m, ids, ids, fault=fault)
            opt.step()
            losses.append(loss)
        return losses, [p.detach().clone() for p in m.parameters()]

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for step in range(steps):
        ids = _tokens(10 + step, 2, 50)
        opt.zero_grad()
        out = ref(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        opt.step()
        ref_losses.append(out.loss.item())
    ref_params = [p.detach() for p in ref.parameters()]
    travelled = sum(((q - s).double() ** 2).sum() for q, s in zip(ref_params, start)).sqrt().item()

    def errors(got):
        losses, params = got
        e = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
             "params": sum(((p - q).double() ** 2).sum()
                           for p, q in zip(params, ref_params)).sqrt().item() / travelled}
        table = COMM.allgather(e)
        return {k: max(t[k] for t in table) for k in e}

    def passes(e):
        return e["loss"] <= LOSS_TOL and e["params"] <= 1e-2

    good = errors(run(0))
    assert passes(good), good
    bad = errors(run(FAULT_DROP_INCOMING))
    assert not passes(bad), bad


def _packed(T=60, docs=(0, 10, 30, 60)):
    ids = _tokens(3, 1, T)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(docs[:-1], docs[1:])])[None]
    labels = ids.clone()
    labels[0, list(docs[1:-1])] = -100   # no target across a document start
    return ids, labels, positions, docs


def _per_document_reference(model, ids, labels, docs):
    """Each document alone through transformers; the mean over all the targets."""
    model.zero_grad()
    total, count = 0.0, 0
    parts = []
    for a, b in zip(docs[:-1], docs[1:]):
        logits = model(input_ids=ids[:, a:b], use_cache=False).logits[0, :-1]
        tgt = labels[0, a + 1:b]
        parts.append(torch.nn.functional.cross_entropy(logits, tgt, ignore_index=-100,
                                                       reduction="sum"))
        count += int((tgt != -100).sum())
    loss = sum(parts) / count
    loss.backward()
    return loss.item(), _grads(model), {n: 0.0 for n, _ in model.named_parameters()}


def test_gradient_checkpointing_and_bf16_compute():
    """model.gradient_checkpointing_enable(): the decoder layers re-run (collectively) inside
    the backward, the same loss and gradients. compute='bf16': the C layers' projections in
    bfloat16, within BF16's accuracy (loss 2e-2, measured ~1e-3) but not fp32's (the control
    that BF16 ran)."""
    model = _tiny()
    ids = _tokens(8, 2, 50)
    ref = _reference(model, ids, ids)
    model.gradient_checkpointing_enable()
    try:
        _assert_matches(_errors(_cp(model, ids, ids), ref))
    finally:
        model.gradient_checkpointing_disable()
    cuts = _cuts(50)
    a, b = cuts[R], cuts[R + 1]
    with gtr.patch(comm=COMM, compute="bf16"):
        loss = model(input_ids=ids[:, a:b], labels=ids[:, a:b]).loss.item()
    e = abs(loss - ref[0]) / ref[0]
    assert LOSS_TOL < e < 2e-2, e


def test_packed_documents_crossing_ranks_match_each_document_alone():
    model = _tiny()
    ids, labels, positions, docs = _packed()   # the document [10, 30) spans all three ranks
    ref = _per_document_reference(model, ids, labels, docs)
    _assert_matches(_errors(_cp(model, ids, labels, positions=positions), ref))
    # controls: the documents ignored (no positions: one dense sequence), local positions
    # (restarting at every slice: documents at the slice boundaries), the halo dropped
    _assert_broken(_errors(_cp(model, ids, labels), ref), "documents ignored")
    cuts = _cuts(ids.shape[1])
    local = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None]
    _assert_broken(_errors(_cp(model, ids, labels, positions=local), ref), "local positions")
    _assert_broken(_errors(_cp(model, ids, labels, positions=positions, fault=FAULT_DROP_HALO),
                           ref), "conv halo dropped")


def test_global_positions_given_equal_positions_supplied():
    """position_ids given (global, offset by 5: RoPE at 5 + t) equal the one-process run with the
    same positions; local positions for B = 2 are refused on every rank. (No numeric control
    here: a constant offset of every position leaves RoPE's scores unchanged, exactly; the
    packed test's local-positions control is the one that moves positions between ranks.)"""
    model = _tiny()
    ids = _tokens(4, 2, 50)
    pos = (torch.arange(50) + 5)[None].expand(2, 50)
    ref = _reference(model, ids, ids, positions=pos)
    _assert_matches(_errors(_cp(model, ids, ids, positions=pos), ref))
    cuts = _cuts(50)
    local = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None].expand(2, 50)
    with pytest.raises(ValueError, match="positions"):
        _cp(model, ids, ids, positions=local)


def test_qwen3_next_dense_matches_one_process():
    model = _next_tiny()
    ids = _tokens(5, 2, 50, vocab=128)
    ref = _reference(model, ids, ids)
    _assert_matches(_errors(_cp(model, ids, ids), ref))
    _assert_broken(_errors(_cp(model, ids, ids, fault=FAULT_DROP_HALO), ref), "conv halo dropped")
    _assert_broken(_errors(_cp(model, ids, ids, fault=FAULT_ATTN_DROP_KV), ref),
                   "earlier ranks' keys and values not attended")




def test_qwen35_moe_matches_one_process():
    """The MoE model (routing per token; its block runs gdncp's MoE op under the patch)."""
    model = _moe_tiny()
    ids = _tokens(9, 2, 50, vocab=128)
    ref = _reference(model, ids, ids)
    _assert_matches(_errors(_cp(model, ids, ids), ref))
    _assert_broken(_errors(_cp(model, ids, ids, fault=FAULT_DROP_INCOMING), ref),
                   "incoming state dropped")


def test_qwen35_moe_aux_loss_matches_one_process(monkeypatch):
    """The same MoE model with output_router_logits (coefficient 0.1): the loss CE + 0.1 aux and every
    gradient over 3 ranks equal one process (the aux loss over every rank's routers,
    gdncp.transformers_cp.load_balancing_loss). Control: each rank's aux loss from its own tokens."""
    import gdncp.transformers_cp as tcp
    model = _moe_tiny(output_router_logits=True, router_aux_loss_coef=0.1)
    ids = _tokens(9, 2, 50, vocab=128)
    ref = _reference(model, ids, ids)
    _assert_matches(_errors(_cp(model, ids, ids), ref))
    real = tcp.load_balancing_loss
    monkeypatch.setattr(tcp, "load_balancing_loss",
                        lambda *a, **k: real(*a, **{**k, "comm": MPI.COMM_SELF}))
    _assert_broken(_errors(_cp(model, ids, ids), ref), "each rank's aux loss from its own tokens")


def test_heads_strategies_on_two_ranks():
    """strategy='heads' and attention='heads' need the ranks to divide the heads (qwen35_tiny:
    Hk = 2, H = 4): ranks 0 and 1 form a communicator of two, rank 2 one of its own (a CP run on
    one rank is the plain model); on the three ranks both are refused on every rank."""
    model = _tiny()
    ids = _tokens(6, 2, 50)
    ref = _reference(model, ids, ids)
    sub = COMM.Split(0 if R < 2 else 1, R)
    try:
        _assert_matches(_errors(_cp(model, ids, ids, comm=sub, strategy="heads",
                                    attention="heads"), ref))
        e = _errors(_cp(model, ids, ids, comm=sub, strategy="heads", attention="heads",
                        fault=FAULT_ATTN_DROP_KV), ref)
        _assert_broken(e, "heads: the other ranks' keys and values zeroed")   # (max over all)
    finally:
        sub.Free()
    if D % 2:
        with pytest.raises(Exception, match="divide|heads"):
            _cp(model, ids, ids, strategy="heads")


def _fails_everywhere(fn, match):
    """fn raises on every rank (checked by the ranks together), and a good call follows."""
    try:
        fn()
        got = None
    except Exception as e:  # noqa: BLE001
        got = f"{type(e).__name__}: {e}"
    table = COMM.allgather(got)
    assert all(t is not None for t in table), table
    import re
    assert all(re.search(match, t) for t in table), table


def test_bad_inputs_fail_on_every_rank_and_a_good_call_follows():
    model = _tiny()
    ids = _tokens(7, 2, 50)
    cuts = _cuts(50)
    a, b = cuts[R], cuts[R + 1]
    pos = torch.arange(50)[None].expand(2, 50)

    def call(x, labels=None, **kw):
        with gtr.patch(comm=COMM):
            out = model(input_ids=x, labels=labels, **kw)
            if labels is not None:
                out.loss.backward()

    # the slices out of rank order: rank 0 holds the last piece (its global positions say so)
    p = D - 1 - R
    ra, rb = cuts[p], cuts[p + 1]
    _fails_everywhere(lambda: call(ids[:, ra:rb], ids[:, ra:rb], position_ids=pos[:, ra:rb]),
                      "rank order|positions start")
    # batch sizes that differ
    _fails_everywhere(lambda: call(ids[:1 if R == 1 else 2, a:b]), "batch sizes")
    # padding inside the sequence (on one rank)
    mask = torch.ones(2, b - a, dtype=torch.long)
    if R == 2 % D:
        mask[0, -1] = 0
    _fails_everywhere(lambda: call(ids[:, a:b], attention_mask=mask), "attention_mask")
    # labels on rank 0 only (the loss is collective: rank 0 would wait in it for ever)
    _fails_everywhere(lambda: call(ids[:, a:b], ids[:, a:b] if R == 0 else None), "labels given")
    # a token id outside the vocabulary on one rank (torch's embedding would raise there alone)
    bad = ids[:, a:b].clone()
    if R == 1:
        bad[0, 0] = 256
    _fails_everywhere(lambda: call(bad, bad.clamp(max=255)), "outside the vocabulary")
    # output_router_logits on one rank only (the MoE aux loss is collective)
    _fails_everywhere(lambda: call(ids[:, a:b], output_router_logits=R == 0), "output_router_logits")
    # a model type the patch does not split
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2)).train()

    def call_llama():
        with gtr.patch(comm=COMM):
            llama(input_ids=ids[:, a:b], labels=ids[:, a:b]).loss.backward()
    _fails_everywhere(call_llama, "not one the patch splits")
    # one rank's weights in another dtype (its MoE experts float64: transformers' own code would take
    # another path there and the ranks meet in no collective): agreed before the first exchange
    moe = _moe_tiny()
    if R == 1:
        for n, prm in moe.named_parameters():
            if ".experts." in n:
                prm.data = prm.data.double()

    def call_moe():
        with gtr.patch(comm=COMM):
            moe(input_ids=ids[:, a:b] % 128, labels=ids[:, a:b] % 128).loss.backward()
    _fails_everywhere(call_moe, "parameter dtypes")
    # a cache (generation) is refused
    from transformers import DynamicCache
    _fails_everywhere(lambda: call(ids[:, a:b], past_key_values=DynamicCache(config=model.config)),
                      "cache")
    # and a good call still works
    ref = _reference(model, ids, ids)
    _assert_matches(_errors(_cp(model, ids, ids), ref))


def test_patch_is_undone_and_nests_only_with_the_same_settings():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    from transformers.loss.loss_utils import LOSS_MAPPING
    from gdncp import transformers_cp as tcp
    before = (m.Qwen3_5TextModel.forward, m.Qwen3_5Attention.forward,
              m.Qwen3_5GatedDeltaNet.forward, LOSS_MAPPING["ForCausalLM"])
    with gtr.patch(comm=COMM):
        assert m.Qwen3_5Attention.forward is not before[1]
        with gtr.patch(comm=COMM):
            pass
        assert LOSS_MAPPING["ForCausalLM"] is tcp.causal_lm_loss
        with pytest.raises(RuntimeError, match="other settings"):
            gtr.patch(comm=COMM, strategy="relay")
        assert gtr.is_patched()
    after = (m.Qwen3_5TextModel.forward, m.Qwen3_5Attention.forward,
             m.Qwen3_5GatedDeltaNet.forward, LOSS_MAPPING["ForCausalLM"])
    assert after == before
    assert not gtr.is_patched()
    with pytest.raises(ValueError, match="strategy"):
        gtr.patch(comm=COMM, strategy="nope")
    assert not gtr.is_patched() and m.Qwen3_5Attention.forward is before[1]



def test_exact_float64_references_with_plain_tolerances():
    """The golden checkpoint under the patch over the ranks, on model_grads.io's two rows of 200
    ids, against the exact float64 references transformers' own code made
    (tests/data/qwen35_tiny/README.md: its modules with their fp32 casts turned into fp64): the
    loss within 1e-6 relative, every parameter's gradient within 2e-5 (max-abs error / max-abs
    reference), the gates' A_log, dt_bias and in_proj_a included: plain tolerances, none scaled
    by a measured error (cp_train_common.py). Control through the same check: the recurrent
    state entering rank 1 dropped."""
    errs = exact_errors(lambda model, ids: _cp(model, ids, ids), COMM.allgather)
    _assert_matches(errs)
    if R == 0:
        print(f"\n  exact references over {D} ranks: loss {errs['loss'][0]:.1e}, worst gradient "
              f"{worst_gradient(errs):.1e}")
    _assert_broken(exact_errors(lambda model, ids: _cp(model, ids, ids, fault=FAULT_DROP_INCOMING), COMM.allgather),
                   "the state entering rank 1 dropped")
