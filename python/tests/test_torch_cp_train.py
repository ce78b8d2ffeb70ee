"""Context-parallel training of transformers' own models over torch.distributed
(gdncp.transformers.patch(group=...)) against transformers itself on one process.

Run under torchrun only (conftest.py leaves it out otherwise):
    GDNCP_TORCHRUN_TESTS=1 torchrun --standalone --nproc-per-node 3 -m pytest test_torch_cp_train.py

Every rank builds the same model and tokens, runs transformers unpatched on the whole sequence
(the reference), then the same model under patch(group=WORLD) on its own uneven slice (rank 1 a
single token), and compares the whole-sequence loss and every parameter's gradient (summed over
the ranks with all_reduce_grads). Tolerances (fp32, max-abs error / max-abs reference per
tensor): loss 2e-6, gradients 1e-4 or, where larger, 3x the difference gdncp's rule makes on one
process without CP (gdncp.transformers.patch(): its fp32 kernel against transformers' own fp32
rule; the gates' gradients A_log, dt_bias are sums of terms of both signs, see test_cp_train.py):
CP must add nothing to that. The ranks exchange their errors before asserting. Each comparison
also runs deliberate mistakes through the same check, which must fail it: gdncp.torch_cp's test
faults in every context the patched forward builds (the conv halo dropped, the recurrent state
entering a rank dropped, attention without the earlier ranks' keys), and local positions.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

import gdncp.torch_cp as tcp
import gdncp.transformers as gtr

from conftest import TINY
from cp_train_common import (exact_errors, grads as _grads, moe_tiny as _moe_tiny, next_tiny as _next_tiny,
                             rel as _rel, tiny as _tiny, worst_gradient)

if not dist.is_initialized():
    dist.init_process_group("gloo", timeout=datetime.timedelta(
        seconds=int(os.environ.get("GDNCP_TEST_GLOO_TIMEOUT", "60"))))
GROUP = dist.group.WORLD
R, D = dist.get_rank(), dist.get_world_size()
assert D >= 2
torch.set_num_threads(1)

LOSS_TOL, GRAD_TOL = 2e-6, 1e-4


def _cuts(T):
    if D == 3:
        return [0, 23, 24, T]
    return [T * r // D for r in range(D + 1)]










def _reference(model, ids, labels, positions=None):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels, use_cache=False, position_ids=positions)
    out.loss.backward()
    grads = _grads(model)
    model.zero_grad()
    with gtr.patch():   # gdncp's rule on one process, no CP: the rounding CP must not add to
        model(input_ids=ids, labels=labels, use_cache=False, position_ids=positions).loss.backward()
    one = _grads(model)
    model.zero_grad()
    return out.loss.item(), grads, {n: max(GRAD_TOL, 3 * _rel(one[n], grads[n])) for n in grads}


def _cp(model, ids, labels, positions=None, fault=None):
    cuts = _cuts(ids.shape[1])
    a, b = cuts[R], cuts[R + 1]
    model.zero_grad()
    tcp.set_test_fault(None, fault)
    try:
        with gtr.patch(group=GROUP):
            out = model(input_ids=ids[:, a:b], labels=labels[:, a:b],
                        position_ids=None if positions is None else positions[:, a:b])
            out.loss.backward()
    finally:
        tcp.set_test_fault(None, None)
    gtr.all_reduce_grads(model, GROUP)
    return out.loss.item(), _grads(model)


def _errors(got, ref):
    (loss, grads), (rloss, rgrads, tols) = got, ref
    e = {"loss": (abs(loss - rloss) / abs(rloss), LOSS_TOL)}
    assert grads.keys() == rgrads.keys(), sorted(set(grads) ^ set(rgrads))
    e.update({n: (_rel(grads[n], rgrads[n]), tols[n]) for n in rgrads})
    table = [None] * D
    dist.all_gather_object(table, e)
    return {k: (max(t[k][0] for t in table), e[k][1]) for k in e}


def _failures(errs):
    return {k: v for k, (v, tol) in errs.items() if not v <= tol}


def _tokens(seed, B, T, vocab=256):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("which", ["qwen35_tiny", "qwen3_next"])
def test_model_loss_and_every_gradient_match_one_process(which):
    model = _tiny() if which == "qwen35_tiny" else _next_tiny()
    ids = _tokens(1, 2, 40, vocab=model.config.vocab_size)
    ref = _reference(model, ids, ids)
    errs = _errors(_cp(model, ids, ids), ref)
    assert not _failures(errs), {k: f"{errs[k][0]:.2e} > {errs[k][1]:.1e}" for k in _failures(errs)}
    for fault in ("drop_halo", "drop_state", "drop_kv"):
        bad = _errors(_cp(model, ids, ids, fault=fault), ref)
        assert _failures(bad), f"the control '{fault}' passed the check: {bad}"
    # local positions (each rank's from 0): with B = 2 they can only be a mistake, refused on
    # every rank (B = 1 would read them as document starts: the packed test)
    T = ids.shape[1]
    cuts = _cuts(T)
    local = torch.cat([torch.arange(b - a) for a, b in zip(cuts[:-1], cuts[1:])])[None].expand(2, T)
    with pytest.raises(ValueError, match="positions start at 0"):
        _cp(model, ids, ids, positions=local)


def _per_document(model, ids, labels, docs, patched):
    """Each document alone on one process (transformers', or gdncp's rule with patched), the
    mean over all the targets: (loss, gradients)."""
    model.zero_grad()
    losses, count = [], 0
    with (gtr.patch() if patched else torch.enable_grad()):
        for a, b in zip(docs[:-1], docs[1:]):
            out = model(input_ids=ids[:, a:b], use_cache=False)
            tg = labels[0, a + 1:b]
            losses.append(torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), tg,
                                                            ignore_index=-100, reduction="sum"))
            count += int((tg != -100).sum())
        loss = sum(losses) / count
        loss.backward()
    grads = _grads(model)
    model.zero_grad()
    return loss.item(), grads


def test_packed_documents_across_ranks_match_one_process():
    """B = 1, documents marked by positions restarting at 0, one crossing every rank, against
    each document alone through transformers."""
    model = _tiny()
    T, docs = 40, (0, 10, 30, 40)
    ids = _tokens(3, 1, T)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(docs[:-1], docs[1:])])[None]
    labels = ids.clone()
    labels[0, list(docs[1:-1])] = -100   # no target across a document start
    loss, grads = _per_document(model, ids, labels, docs, patched=False)
    _, one = _per_document(model, ids, labels, docs, patched=True)
    ref = (loss, grads, {n: max(GRAD_TOL, 3 * _rel(one[n], grads[n])) for n in grads})
    errs = _errors(_cp(model, ids, labels, positions=positions), ref)
    assert not _failures(errs), {k: f"{errs[k][0]:.2e} > {errs[k][1]:.1e}" for k in _failures(errs)}
    bad = _errors(_cp(model, ids, labels, positions=positions, fault="drop_state"), ref)
    assert _failures(bad), bad




def test_qwen35_moe_with_aux_loss_matches_one_process(monkeypatch):
    """The MoE model with output_router_logits (coefficient 0.1): CE + 0.1 aux over every rank's
    routers (transformers_torch_cp.load_balancing_loss) and every gradient equal one process.
    Controls: the state dropped; each rank's aux loss from its own tokens only."""
    import gdncp.transformers_torch_cp as ttcp
    model = _moe_tiny(output_router_logits=True, router_aux_loss_coef=0.1)
    ids = _tokens(9, 2, 40, vocab=128)
    ref = _reference(model, ids, ids)
    errs = _errors(_cp(model, ids, ids), ref)
    assert not _failures(errs), {k: f"{errs[k][0]:.2e} > {errs[k][1]:.1e}" for k in _failures(errs)}
    bad = _errors(_cp(model, ids, ids, fault="drop_state"), ref)
    assert _failures(bad), bad
    real = ttcp.load_balancing_loss

    class _Self(tcp.Transport):   # a one-rank transport: each rank's own tokens only
        size = 1

        def allreduce_(self, t):
            return t

    monkeypatch.setattr(ttcp, "load_balancing_loss",
                        lambda *a, **k: real(*a, **{**k, "group": _Self()}))
    bad = _errors(_cp(model, ids, ids), ref)
    assert _failures(bad), bad


def test_bad_inputs_fail_on_every_rank_and_a_good_call_follows():
    model = _tiny()
    ids = _tokens(4, 2, 40)
    cuts = _cuts(40)
    a, b = cuts[R], cuts[R + 1]

    def call(x, **kw):
        with gtr.patch(group=GROUP):
            return model(input_ids=x, labels=x, **kw).loss

    # one rank with a batch size the others lack
    with pytest.raises(ValueError, match="batch sizes"):
        call(ids[:1 if R == 1 else 2, a:b])
    # padding in attention_mask on one rank: its own error, the others name it
    mask = torch.ones(2, b - a, dtype=torch.long)
    if R == 2:
        mask[0, -1] = 0
    with pytest.raises(ValueError, match="attention_mask|rank 2 failed"):
        call(ids[:, a:b], attention_mask=mask)
    # labels on some ranks only
    with pytest.raises(ValueError, match="labels given"):
        with gtr.patch(group=GROUP):
            model(input_ids=ids[:, a:b], labels=ids[:, a:b] if R else None)
    # a good call follows, and the patch is undone afterwards
    loss = call(ids[:, a:b])
    assert torch.isfinite(loss)
    import gdncp.transformers_torch_cp as ttcp
    assert ttcp._settings is None


def test_gradient_checkpointing_matches_one_process():
    """model.gradient_checkpointing_enable(): the decoder layers re-run inside the backward, their
    exchanges with them (every rank recomputes the same layers in the same order): the same loss
    and gradients. Control: the state dropped in the recomputation too."""
    model = _tiny()
    ids = _tokens(8, 2, 40)
    ref = _reference(model, ids, ids)
    model.gradient_checkpointing_enable()
    try:
        errs = _errors(_cp(model, ids, ids), ref)
        assert not _failures(errs), {k: f"{errs[k][0]:.2e} > {errs[k][1]:.1e}"
                                     for k in _failures(errs)}
        bad = _errors(_cp(model, ids, ids, fault="drop_state"), ref)
        assert _failures(bad), bad
    finally:
        model.gradient_checkpointing_disable()



def _allgather(obj):
    table = [None] * D
    dist.all_gather_object(table, obj)
    return table


def test_exact_float64_references_with_plain_tolerances():
    """test_cp_train.py's test of the same name over the torch group: the golden checkpoint under
    patch(group=) on model_grads.io's two rows of 200 ids against the exact float64 references,
    plain tolerances (cp_train_common.py). Control through the same check: the recurrent state
    not passed between the ranks."""
    errs = exact_errors(lambda model, ids: _cp(model, ids, ids), _allgather)
    bad = _failures(errs)
    assert not bad, {k: f"{errs[k][0]:.2e} > {errs[k][1]:.1e}" for k in bad}
    if R == 0:
        print(f"\n  exact references over {D} ranks (gloo): loss {errs['loss'][0]:.1e}, worst gradient "
              f"{worst_gradient(errs):.1e}")
    assert _failures(exact_errors(lambda model, ids: _cp(model, ids, ids, fault="drop_state"), _allgather)), \
        "the control 'drop_state' passed the check"
