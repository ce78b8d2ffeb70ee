"""The shared library and its API: the structs, constants and prototypes of include/gdncp/*.h.

The declarations are generated from the headers by scripts/gen_bindings.py into gdncp/_abi.py
(every typedef'd struct as a ctypes Structure, every enum and numeric #define, every GDN_API
prototype); this module loads the library, binds every prototype of that table as a module-level
function of the same name (gdn_plan_create, ...) and adds the hand-written helpers. The CTest
`bindings` fails when _abi.py is stale; tests/test_abi.py compares every struct's size and every
field's offset with the library's own (gdn_abi_sizeof / gdn_abi_offsetof, include/gdncp/abi.h).
"""
import ctypes
import os
from ctypes import POINTER, c_char_p, c_double, c_float, c_int, c_int64

import numpy as np

from . import _abi

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load():
    # GDNCP_LIBRARY overrides the copy installed inside the package (a developer's build). The
    # MPI wing, libgdncp_mpi.so (context parallelism), sits beside it in a build with MPI: loaded
    # through the wing, the symbols of both resolve (the wing depends on libgdncp.so).
    path = os.environ.get("GDNCP_LIBRARY") or os.path.join(_HERE, "libgdncp.so")
    if not os.path.exists(path):
        raise ImportError(
            f"gdncp: the shared library {path} is missing; install the package with "
            "`pip install ./python` from the repository (it builds libgdncp.so with CMake)")
    wing = os.path.join(os.path.dirname(path), "libgdncp_mpi.so")
    has_wing = os.path.exists(wing)
    return ctypes.CDLL(wing if has_wing else path), has_wing


lib, HAS_MPI_WING = _load()

# The libraries the prototypes are looked up in, in this order.
_LIBS = [lib]

# Every constant of the headers (enums and numeric #defines: GDN_OK, GDN_ERR_*, GDN_F32,
# GDN_P_COUNT, GDN_MOE_COUNT, GDN_MODEL_MAX_LAYERS, ...) and every struct class.
globals().update({k: v for k, v in vars(_abi).items() if k.startswith("GDN_")})
globals().update({cls.__name__: cls for cls in _abi.STRUCTS.values()})
CPStats = _abi.CpStats  # (its name before the classes were generated)

# The status codes' short names, from the header's gdn_status enum (the library's texts for them:
# gdn_strerror, which test_abi checks for every code).
STATUS_NAMES = {v: k[len("GDN_ERR_"):] for k, v in _abi.ENUMS["gdn_status"].items()
                if k != "GDN_OK"}

P_float = POINTER(c_float)
P_double = POINTER(c_double)
P_int64 = POINTER(c_int64)
P_in, P_gr = POINTER(RuleInputs), POINTER(RuleGrads)  # noqa: F821 (from _abi)
P_mcfg = POINTER(ModelConfig)  # noqa: F821
P_moecfg = POINTER(MoeConfig)  # noqa: F821

# The C type of a model token (every `tokens` pointer of gdn_model_*: `const gdn_token *`):
# the header's typedef, and everything below derives from it (test_abi checks it against the
# library).
c_token = _abi.TYPEDEFS["gdn_token"]
TOKEN_DTYPE = np.dtype(c_token).type
P_token = POINTER(c_token)


def rule_inputs(q, k, v, g, beta, h0=None, f64=False):
    """The bundle of the arrays' pointers (None: NULL). The arrays must outlive the call."""
    cls, ptr = (RuleInputsF64, f64p) if f64 else (RuleInputs, f32p)  # noqa: F821
    return cls(ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta), ptr(h0))


def rule_grads(dq, dk, dv, dg, dbeta, dh0=None, f64=False):
    cls, ptr = (RuleGradsF64, f64p) if f64 else (RuleGrads, f32p)  # noqa: F821
    return cls(ptr(dq), ptr(dk), ptr(dv), ptr(dg), ptr(dbeta), ptr(dh0))


def _symbol(name):
    for handle in _LIBS:
        try:
            return getattr(handle, name)
        except AttributeError:
            pass
    return None


def _proto(name, restype, *argtypes):
    """A symbol of the libraries with a prototype written here (for what the headers do not
    declare: the MPI library's own functions)."""
    f = _symbol(name)
    if f is None:
        raise AttributeError(f"gdncp: {name} is not in {[h._name for h in _LIBS]}")
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


def bind(name, **types):
    """The library's function `name` with its header's prototype (_abi.PROTOTYPES). types gives
    the ctypes type of each name the table leaves as a string (MPI_Comm=...)."""
    restype, argtypes = _abi.PROTOTYPES[name]
    try:
        argtypes = [types[t] if isinstance(t, str) else t for t in argtypes]
    except KeyError as e:
        raise TypeError(f"gdncp: {name} takes a {e.args[0]}: bind({name!r}, {e.args[0]}=type)") from None
    return _proto(name, restype, *argtypes)


# Every prototype whose types are all known here, as a module-level function of its C name;
# those that take an MPI_Comm are bound by gdncp.core once it knows the MPI's handle type.
# MISSING: declared in the headers but not found in the libraries (test_abi: none).
MISSING = []
for _name, (_res, _args) in _abi.PROTOTYPES.items():
    if any(isinstance(t, str) for t in _args):
        continue
    if _symbol(_name) is None:
        if HAS_MPI_WING:
            MISSING.append(_name)
        else:  # the wing's functions in a build without it (GDN_MPI=OFF): a clear error when called
            def _missing(*args, _name=_name):
                raise RuntimeError(f"gdncp: {_name} is in libgdncp_mpi.so (context parallelism, the trainer), "
                                   "which this build of the library does not have (built with GDN_MPI=OFF)")
            globals()[_name] = _missing
        continue
    globals()[_name] = bind(_name)
del _name, _res, _args

# The MPI library libgdncp_mpi.so was linked against (a dependency's symbol, found through its handle)
if HAS_MPI_WING:
    MPI_Get_library_version = _proto("MPI_Get_library_version", c_int, c_char_p, POINTER(c_int))
    MPI_Initialized = _proto("MPI_Initialized", c_int, POINTER(c_int))


class GdncpError(RuntimeError):
    """A failure reported by the C library; the message is gdn_errmsg()'s."""

    def __init__(self, what, status):
        detail = (gdn_errmsg() or b"").decode(errors="replace")
        short = (gdn_strerror(status) or b"").decode(errors="replace")
        super().__init__(f"{what}: {short}: {detail}")
        self.status = status


def check_test_sites(value):
    """Refuse a GDNCP_MUTATE value (test sites, docs/testing.md) that this library cannot honour:
    any site on a library built without test hooks (the wheel), or a name that is no site of its
    sources. Either would run the clean computation and let a negative control pass vacuously."""
    if not value:
        return
    sites_check = getattr(lib, "gdn_test_sites_check", None)
    if sites_check is None:
        raise RuntimeError(f"gdncp: GDNCP_MUTATE={value!r} is set, but {lib._name} has no test hooks "
                           "(built with GDN_TEST_HOOKS=OFF, as the wheel is): it cannot make any step "
                           "wrong on purpose; unset it, or load a build with the hooks (GDNCP_LIBRARY)")
    sites_check.argtypes, sites_check.restype = [c_char_p], c_int
    if sites_check(value.encode()) != GDN_OK:  # noqa: F821
        raise ValueError((gdn_errmsg() or b"").decode(errors="replace"))


check_test_sites(os.environ.get("GDNCP_MUTATE"))


def check(status, what):
    """Raise for a non-zero gdn_status: shape and argument errors as ValueError (the user's
    inputs), everything else as GdncpError."""
    if status == GDN_OK:
        return
    err = GdncpError(what, status)
    if status in (GDN_ERR_ARG, GDN_ERR_SHAPE, GDN_ERR_NONFINITE, GDN_ERR_DTYPE):  # noqa: F821
        raise ValueError(str(err)) from None
    raise err


def isa():
    """The instruction-set levels of this process (gdncp/isa.h) by name: {"cpu", "compiled", "cap",
    "dispatched"} ("cap" None when GDNCP_ISA is unset). ValueError naming GDNCP_ISA's value when
    it is refused (an unknown name, a level this CPU lacks, or below the build's)."""
    info = IsaInfo()  # noqa: F821 (from _abi)
    check(gdn_isa(ctypes.byref(info)), "GDNCP_ISA")  # noqa: F821

    def name(level):
        return gdn_isa_name(level).decode() if level >= 0 else None  # noqa: F821
    return {k: name(getattr(info, k)) for k in ("cpu", "compiled", "cap", "dispatched")}


# GDNCP_ISA is checked on import, as the command line checks it at start-up: a cap the CPU or the
# build cannot honour stops here with its reason, not at the first plan.
try:
    isa()
except ValueError as e:
    raise ImportError(f"gdncp: {e}") from None


def param_info(fn, cfg, i):
    """(name, shape, offset, numel) of parameter i of a layer's flat array: fn is gdn_layer_param,
    gdn_attn_param or gdn_moe_param, cfg its config struct (gdn_param_info, compute.h)."""
    info = ParamInfo()  # noqa: F821
    check(fn(ctypes.byref(cfg), i, ctypes.byref(info)), "parameter table")
    return (info.name.decode(), tuple(info.shape[:info.ndim]), int(info.offset), int(info.numel))


def describe(fn, cls, h):
    """A plan's description: fn is gdn_plan_describe, gdn_layer_plan_describe,
    gdn_attn_plan_describe or gdn_moe_plan_describe, cls its info struct (PlanInfo, LayerPlanInfo,
    AttnPlanInfo, MoePlanInfo), h the plan."""
    info = cls()
    check(fn(h, ctypes.byref(info)), "plan description")
    return info


HUGE_PAGE = 2 << 20


def huge_empty(n, dtype=np.float32):
    """An uninitialised (in fact zero-filled) 1-D array of n elements, as the C side's
    gdn_alloc_large allocates: from one huge page (2 MiB) up, a private anonymous mapping whose
    data starts on a 2 MiB boundary and that is advised MADV_HUGEPAGE (transparent huge pages where
    the kernel offers them only on request, the "madvise" setting); below that a plain array,
    64-byte aligned. Model weights, gradients and moments are GBs: in 4 KiB pages their first
    writes are a second of page faults per GB and every pass over them walks the TLB. The array
    keeps its mapping alive (its base); the advice is only advice: refused, nothing but speed
    changes."""
    import mmap
    dtype = np.dtype(dtype)
    n = int(n)
    nbytes = n * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        raw = np.empty(nbytes + 64, np.uint8)
        off = -raw.ctypes.data % 64
        return raw[off:off + nbytes].view(dtype)
    # private: a shared anonymous mapping is shmem, whose huge pages follow shmem_enabled
    # ("never" by default), not the madvise setting; page-aligned: at most 2 MiB - 4 KiB to skip
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8)
    off = -a.ctypes.data % HUGE_PAGE
    length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, off, min(length, len(m) - off))
    except (OSError, ValueError):
        pass
    del a
    return np.frombuffer(m, dtype, n, off)


def f32p(a):
    """float* of a C-contiguous float32 array, or NULL for None."""
    return None if a is None else a.ctypes.data_as(P_float)


def f64p(a):
    return None if a is None else a.ctypes.data_as(P_double)
