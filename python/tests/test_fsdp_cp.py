"""patch(group=) inside PyTorch's own FSDP2 (fully_shard) on a CPU gloo mesh with a data-parallel
dimension beside the CP one, against transformers on one process. Runs under torchrun with 4
ranks only (conftest.py leaves it out otherwise; scripts/test_python.sh runs it):

    GDNCP_FSDP_TESTS=1 torchrun --standalone --nproc-per-node 4 -m pytest test_fsdp_cp.py

The mesh is (dp, cp) = (2, 2): DP group i trains sequence i, split over its 2 CP ranks (uneven:
17 and 23 tokens). The supported set-up (docs/python.md): fully_shard every decoder layer and the
model over the flattened dp x cp mesh, the gradient divide factor the DP size, and sum reductions
(gloo has neither PREMUL_SUM nor AVG): FSDP's reduce-scatter then sums the CP ranks' shares and
averages the DP groups, so every parameter's gradient (a sharded DTensor) is the one of the mean
of the two sequences' losses on one process, and a torch SGD step on the shards moves the
weights as on one process. Two wrong set-ups run through the same checks must fail them: FSDP
over the DP dimension alone (the CP shares never summed) and FSDP's default divide factor (the
world size: every gradient a CP factor too small).
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

import gdncp.transformers as gtr
from cp_train_common import rel as _rel, tiny as _tiny

if not dist.is_initialized():
    dist.init_process_group("gloo", timeout=datetime.timedelta(
        seconds=int(os.environ.get("GDNCP_TEST_GLOO_TIMEOUT", "60"))))
R, W = dist.get_rank(), dist.get_world_size()
assert W == 4, "test_fsdp_cp.py runs on 4 ranks: a (dp, cp) = (2, 2) mesh"
torch.set_num_threads(1)
MESH = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
DP, CP = MESH["dp"].get_local_rank(), MESH["cp"].get_local_rank()
CUT = 17
GRAD_TOL = 2e-4      # gdncp's fp32 rule against transformers' (8.4e-5 measured)
LOSS_TOL = 2e-6


def _tokens():
    return torch.randint(0, 200, (2, 40), generator=torch.Generator().manual_seed(3))


def _reference():
    """One process: the mean loss of both sequences, its gradients, and what one torch SGD step
    moves each weight by."""
    model, ids = _tiny(), _tokens()
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return out.loss.item(), grads, {n: p.detach() - before[n] for n, p in model.named_parameters()}


def _fsdp_step(setup):
    """This rank's step under FSDP2 + patch(group=the CP group): (the whole loss of this rank's DP
    group's sequence, {name: full gradient}, {name: what a torch SGD step on the shards moved the
    whole weight by})."""
    model = _tiny()
    if setup == "dp only":
        mesh = MESH["dp"]
    else:
        mesh = MESH["dp", "cp"]._flatten("dp_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if setup in ("supported", "dp only"):
        for m in model.modules():
            if isinstance(m, FSDPModule):
                if setup == "supported":
                    m.set_gradient_divide_factor(float(MESH["dp"].size()))
                m.set_force_sum_reduction_for_comms(True)
    else:   # "default divide": FSDP's own factor (the mesh's size), sums for gloo
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    ids = _tokens()[DP:DP + 1]
    a, b = (0, CUT) if CP == 0 else (CUT, ids.shape[1])
    with gtr.patch(group=MESH["cp"].get_group()):
        out = model(input_ids=ids[:, a:b], labels=ids[:, a:b])
        out.loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    before = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    moved = {n: p.detach().full_tensor() - before[n] for n, p in model.named_parameters()}
    return out.loss.item(), grads, moved


def _worst(got, ref):
    (loss, grads, moved), (rloss, rgrads, rmoved) = got, ref
    # the mean over the DP groups of their sequences' losses (every rank of a group has its own)
    losses = [None] * W
    dist.all_gather_object(losses, loss)
    mean = sum(losses) / W
    e = {"loss": abs(mean - rloss) / abs(rloss),
         "gradients": max(_rel(grads[n], rgrads[n]) for n in rgrads),
         "moved": max(_rel(moved[n], rmoved[n]) for n in rmoved)}
    table = [None] * W
    dist.all_gather_object(table, e)
    return {k: max(t[k] for t in table) for k in e}


def _fails(e):
    return e["loss"] > LOSS_TOL or e["gradients"] > GRAD_TOL or e["moved"] > GRAD_TOL


def test_fsdp2_over_dp_and_cp_equals_one_process():
    ref = _reference()
    e = _worst(_fsdp_step("supported"), ref)
    print("supported:", e)
    assert not _fails(e), f"FSDP2 + patch(group=): {e}"
    for wrong in ("dp only", "default divide"):
        bad = _worst(_fsdp_step(wrong), ref)
        print(wrong, bad)
        assert _fails(bad), f"the wrong set-up '{wrong}' passed the check: {bad}"
