"""gdncp.sharded: Model.adamw(group=, zero=) over the ranks of a group against one process
stepping on every rank's batch stacked. Runs on both transports, never in the plain pytest run
(conftest.py leaves it out unless one of these is set):

  torch.distributed (gloo):  GDNCP_TORCHRUN_TESTS=1 torchrun --nproc-per-node 3 -m pytest test_sharded.py
  mpi4py:                    GDNCP_MPI_TESTS=1 mpiexec.mpich -n 3 python -m pytest test_sharded.py

Every rank loads the same tiny checkpoint, steps on its own rows of one random batch (uneven:
rank r holds r + 1 rows, so the token-weighted loss matters), and compares the losses and every
weight with a plain gdncp.Model AdamW stepping on all the rows at once, relative error
max|a - b| / max|b|. Levels 0, 1 and 2 must equal each other bit for bit. The ranks exchange their
errors before asserting, so every rank passes or fails alike. Each comparison runs deliberate
mistakes (gdncp.sharded.FAULTS, inside the real step) through the same check, which must fail it.
"""
import json
import os
import shutil
import tempfile

import numpy as np
import pytest

import gdncp
import gdncp.sharded as sh
from conftest import GOLDEN, TINY, world_group

GROUP, R, D, _gather = world_group()
assert D >= 2, "test_sharded.py runs with 2 or more ranks (scripts/test_python.sh: 3)"

STEPS = 4
GRAD_TOL = 1e-5      # the first step's summed gradient: fp32 sums in another order
TOL = 1e-4           # the weights after 4 AdamW steps, which amplify that (1.0e-5 measured)
LR = 3e-3


def _rows(vocab, T=24, seed=5):
    """Every rank's rows of one batch: rank r gets r + 1 rows; all = the stack."""
    rng = np.random.default_rng(seed)
    counts = [r + 1 for r in range(D)]
    allrows = rng.integers(0, vocab, size=(sum(counts), T), dtype=np.int64)
    lo = sum(counts[:R])
    return allrows[lo:lo + counts[R]], allrows


def _batches(vocab, steps=STEPS):
    return [_rows(vocab, seed=5 + s) for s in range(steps)]


def _sharded_run(path, zero, batches, fault=None, **kw):
    with gdncp.Model.from_pretrained(path, threads=1) as m:
        opt = m.adamw(lr=LR, clip=1.0, group=GROUP, zero=zero, **kw)
        sh.set_test_fault(opt, fault)
        losses = [opt.step(mine) for mine, _ in batches[:1]]
        grad = np.concatenate([v.ravel() for v in opt.grads.values()])
        losses += [opt.step(mine) for mine, _ in batches[1:]]
        return np.array(losses), _weights(m), grad


def _weights(m):
    """Every tensor's weights, flat (not the padding between them, which nothing writes)."""
    return np.concatenate([v.ravel() for v in m.state_dict().values()])


def _one_process(path, batches):
    with gdncp.Model.from_pretrained(path, threads=1) as m:
        opt = m.adamw(lr=LR, clip=1.0)
        losses = [opt.step(allrows) for _, allrows in batches[:1]]
        grad = np.concatenate([v.ravel() for v in opt.grads.values()])
        losses += [opt.step(allrows) for _, allrows in batches[1:]]
        return np.array(losses), _weights(m), grad


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    s = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / (s if s > 0 else 1.0))


def _worst(x):
    return max(_gather(x))


def _check_levels(path):
    cfg = json.load(open(os.path.join(path, "config.json")))
    vocab = cfg.get("text_config", cfg)["vocab_size"]
    batches = _batches(vocab)
    ref_l, ref_w, ref_g = _one_process(path, batches)
    runs = {z: _sharded_run(path, z, batches) for z in (0, 1, 2)}
    eg = _worst(_rel(runs[1][2], ref_g))     # (zero=1: every rank holds the whole sum)
    assert eg < GRAD_TOL, f"the first step's summed gradient is {eg:.2e} from one process's"
    for z, (l, w, _) in runs.items():
        el, ew = _worst(_rel(l, ref_l)), _worst(_rel(w, ref_w))
        assert el < GRAD_TOL and ew < TOL, f"zero={z}: losses {el:.2e}, weights {ew:.2e} from one process"
    with gdncp.Model.from_pretrained(path, threads=1) as m:
        moved = _worst(_rel(ref_w, _weights(m)))
    assert moved > 10 * TOL, f"the reference's weights moved only {moved:.1e}: the check cannot tell"
    for z in (1, 2):   # the same arithmetic at every level
        same = all(_gather(bool(np.array_equal(runs[z][1], runs[0][1]) and
                                np.array_equal(runs[z][0], runs[0][0]))))
        assert same, f"zero={z} is not bit for bit zero=0"
    assert all(_gather(bool(np.array_equal(runs[1][2], runs[0][2])))), "zero=1's summed gradient"
    # the ranks hold the same weights after the gathers
    w0 = _gather(runs[2][1] if R == 0 else None)[0]
    assert all(_gather(bool(np.array_equal(runs[2][1], w0)))), "the ranks' weights differ"
    return batches, ref_l, ref_w


def test_levels_equal_one_process_on_the_stacked_batch():
    batches, ref_l, ref_w = _check_levels(TINY)
    # negative controls: each fault through the same comparison must fail it
    for zero, fault in ((1, sh.FAULTS[0]), (2, sh.FAULTS[1]), (2, sh.FAULTS[2]), (0, sh.FAULTS[1])):
        l, w, _ = _sharded_run(TINY, zero, batches, fault=fault)
        ew = _worst(_rel(w, ref_w))
        print(f"control {fault!r} at zero={zero}: weights {ew:.1e} from one process")
        assert ew > TOL, f"fault {fault!r} at zero={zero} passed the check ({ew:.1e})"


def test_moe_with_the_aux_loss_equals_one_process():
    """Qwen3.5-MoE with output_router_logits: the routers' statistics summed over the ranks before
    the backward make the aux loss (and its gradient) the stacked batch's."""
    d = None
    if R == 0:
        d = tempfile.mkdtemp(prefix="gdncp-sharded-moe-")
        shutil.copytree(os.path.join(GOLDEN, "qwen35_moe_tiny"), d, dirs_exist_ok=True)
        p = os.path.join(d, "config.json")
        c = json.load(open(p))
        (c.get("text_config", c))["output_router_logits"] = True
        json.dump(c, open(p, "w"))
    d = _gather(d)[0]
    try:
        _check_levels(d)
    finally:
        _gather(None)
        if R == 0:
            shutil.rmtree(d, ignore_errors=True)


def _raises_everywhere(fn):
    """fn() raises on every rank: every rank's (exception type name, message), and this rank's."""
    try:
        fn()
        got = None
    except Exception as e:
        got = (type(e).__name__, str(e))
    table = _gather(got)
    assert all(t is not None for t in table), f"some rank did not raise: {table}"
    return table, got


def test_a_bad_batch_on_one_rank_raises_on_every_rank():
    with gdncp.Model.from_pretrained(TINY, threads=1) as m:
        opt = m.adamw(group=GROUP, zero=2)
        mine, _ = _rows(m.config.vocab)
        if R == 1:
            mine = mine.copy()
            mine[0, 3] = m.config.vocab + 7          # a token id out of range
        table, got = _raises_everywhere(lambda: opt.step(mine))
        assert "rank 1" in got[1] or R == 1, got
        assert table[1][0] == "ValueError", table[1]
        w_before = _weights(m)
        # the optimizer goes on: the next good step runs on every rank
        loss = opt.step(_rows(m.config.vocab)[0])
        assert np.isfinite(loss) and not np.array_equal(w_before, _weights(m))


def test_the_ranks_disagreeing_raise_on_every_rank():
    with gdncp.Model.from_pretrained(TINY, threads=1) as m:
        # the settings
        table, got = _raises_everywhere(lambda: m.adamw(lr=1e-3 * (1 + (R == 2)), group=GROUP, zero=1),
                                        )
        assert all("lr" in t[1] for t in table), table
        # the weights
        if R == 1:
            m._w[100] += 1e-3
        table, got = _raises_everywhere(lambda: m.adamw(group=GROUP, zero=1))
        assert all("weights differ" in t[1] for t in table), table
        if R == 1:
            m._w[100] -= 1e-3
        # one step's rate
        opt = m.adamw(group=GROUP, zero=1)
        table, got = _raises_everywhere(lambda: opt.step(_rows(m.config.vocab)[0], lr=1e-3 * (1 + R)),
                                        )
        assert all("disagree" in t[1] for t in table), table


def test_a_diverged_step_raises_on_every_rank_weights_unchanged():
    with gdncp.Model.from_pretrained(TINY, threads=1) as m:
        opt = m.adamw(group=GROUP, zero=2)
        w = _weights(m)
        mine, _ = _rows(m.config.vocab)
        # a weight made inf on one rank after the agreement: its forward fails or its loss is inf
        norm = m.state_dict()["model.norm.weight"]
        old = float(norm[0])
        if R == 2:
            norm[0] = np.inf
        _raises_everywhere(lambda: opt.step(mine))
        norm[0] = old
        assert np.array_equal(_weights(m), w), "a failed step changed the weights"
        assert opt.steps == 0


def test_bad_arguments():
    with gdncp.Model.from_pretrained(TINY, threads=1) as m:
        with pytest.raises(ValueError, match="zero=3"):
            m.adamw(group=GROUP, zero=3)
        with pytest.raises(ValueError, match="group="):
            m.adamw(zero=1)
        with pytest.raises(TypeError, match="group must be"):
            m.adamw(group="world", zero=1)


# the benchmark (python/benchmarks/bench_sharded.py) at a toy size, under mpiexec only (it runs over
# mpi4py's COMM_WORLD): it runs, prints every side, and finds levels 1 and 2 equal to level 0
if os.environ.get("GDNCP_TORCHRUN_TESTS") != "1":
    def test_bench_sharded_runs(capsys, monkeypatch):
        import importlib.util
        import sys
        path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_sharded.py")
        spec = importlib.util.spec_from_file_location("bench_sharded", path)
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        monkeypatch.setattr(sys, "argv", ["bench_sharded.py", TINY, "--T", "16", "--rounds", "1"])
        bench.main()
        out = capsys.readouterr().out
        if R == 0:
            assert all(f"{k} " in out for k in ("plain", "zero=0", "zero=1", "zero=2")), out
            assert out.count("= zero=0's: True") == 2, out
