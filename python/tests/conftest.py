"""Shared helpers of the Python tests. Paths come from the environment that
scripts/test_python.sh sets (GDN_GOLDEN_DIR, GDNCP_CLI), with the repository's defaults."""
import os

import numpy as np
import pytest

# A library built with test hooks reads GDNCP_MUTATE at every call only when the process had it
# at load (src/base/status.c): present and empty here, before any test loads libgdncp, so that
# mutate() below reaches it. Empty means no site (the gdncp command ignores it too).
os.environ.setdefault("GDNCP_MUTATE", "")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GOLDEN = os.environ.get("GDN_GOLDEN_DIR", os.path.join(REPO, "tests", "data"))
TINY = os.path.join(GOLDEN, "qwen35_tiny")


# The library's CP test sites (docs/testing.md, "Test sites"), by the numbers the CP tests use:
# set through GDNCP_MUTATE, which a library built with its test hooks reads at every call.
CP_SITES = {2: "cp: incoming state dropped", 3: "cp: incoming state gradient dropped",
            4: "cp: conv halo dropped", 5: "cp: conv halo gradient dropped",
            6: "attention cp: keys and values of earlier ranks dropped"}


def world_group():
    """The group a multi-rank test runs on, and its allgather of small objects: torch.distributed's
    default group under torchrun (GDNCP_TORCHRUN_TESTS=1; gloo, initialised here with a timeout of
    GDNCP_TEST_GLOO_TIMEOUT seconds, default 60), else mpi4py's COMM_WORLD (under mpiexec).
    Returns (group, rank, size, gather)."""
    if os.environ.get("GDNCP_TORCHRUN_TESTS") == "1":
        import datetime
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(
                seconds=int(os.environ.get("GDNCP_TEST_GLOO_TIMEOUT", "60"))))
        size = dist.get_world_size()

        def gather(x):
            out = [None] * size
            dist.all_gather_object(out, x)
            return out
        return dist.group.WORLD, dist.get_rank(), size, gather
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    return comm, comm.Get_rank(), comm.Get_size(), comm.allgather


def mutate(code):
    """Make this process's library calls deliberately wrong at CP site `code` (0: none)."""
    if code:
        from gdncp import _lib
        _lib.check_test_sites(CP_SITES[code])
        os.environ["GDNCP_MUTATE"] = CP_SITES[code]
    else:
        os.environ.pop("GDNCP_MUTATE", None)


def rel_err(a, b):
    """max|a - b| / max|b|: the project's per-tensor relative error (DESIGN §6)."""
    a, b = (np.asarray(x.detach().double() if hasattr(x, "detach") else x, np.float64)
            for x in (a, b))
    scale = np.max(np.abs(b))
    return float(np.max(np.abs(a - b)) / (scale if scale > 0 else 1.0))


def problem(rng, B=2, T=100, Hk=2, Hv=4, K=16, V=12, n_states=None, gates="mild"):
    """A well-conditioned random problem (float64 arrays): keys of any norm (the kernel
    normalises them), beta in (0, 1), log-decays in [-0.5, 0) for 'mild'."""
    q = rng.standard_normal((B, T, Hk, K))
    k = rng.standard_normal((B, T, Hk, K))
    v = rng.standard_normal((B, T, Hv, V))
    lo = {"mild": -0.5, "strong": -8.0}[gates]
    g = rng.uniform(lo, -1e-3, (B, T, Hv))
    beta = rng.uniform(0.05, 0.95, (B, T, Hv))
    h0 = rng.standard_normal((n_states or B, Hv, K, V)) * 0.5
    return q, k, v, g, beta, h0


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def read_safetensors(path):
    from safetensors.numpy import load_file
    return load_file(path)


# test_cp.py needs several MPI ranks: scripts/test_python.sh runs it on its own under
# `mpiexec.mpich -n 3` with GDNCP_MPI_TESTS=1; the plain (one-process) run leaves it out rather
# than skipping it, so that it is never counted as passed there.
collect_ignore = [] if os.environ.get("GDNCP_MPI_TESTS") == "1" else ["test_cp.py", "test_cp_train.py"]
# test_torch_cp.py and test_sharded.py likewise, under torchrun (GDNCP_TORCHRUN_TESTS=1) or mpiexec (GDNCP_MPI_TESTS=1)
if os.environ.get("GDNCP_MPI_TESTS") != "1" and os.environ.get("GDNCP_TORCHRUN_TESTS") != "1":
    collect_ignore += ["test_torch_cp.py", "test_sharded.py"]
if os.environ.get("GDNCP_TORCHRUN_TESTS") != "1":   # patch(group=...): torchrun only
    collect_ignore.append("test_torch_cp_train.py")
if os.environ.get("GDNCP_FSDP_TESTS") != "1":   # FSDP2 + patch(group=): torchrun, 4 ranks only
    collect_ignore.append("test_fsdp_cp.py")
if os.environ.get("GDNCP_TORCHRUN_TESTS") == "1":   # torchrun runs only the torch.distributed tests
    collect_ignore += ["test_cp.py", "test_cp_train.py"]


# Under torchrun, each rank leaves with os._exit once pytest has reported: torch's gloo group
# torn down at interpreter exit can abort a rank ("terminate called without an active exception",
# about 1 run in 12 here), which would fail a run whose tests all passed.
if os.environ.get("GDNCP_TORCHRUN_TESTS") == "1":
    _exit_status = {}

    def pytest_sessionfinish(session, exitstatus):
        _exit_status["code"] = int(exitstatus)

    def pytest_unconfigure(config):
        if "code" not in _exit_status:
            return
        import sys
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(_exit_status["code"])
