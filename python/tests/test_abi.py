"""The ctypes mirrors of gdn_config and gdn_layer_config (gdncp/_lib.py) against the library:
a config made by Python goes through gdn_plan_create and comes back from gdn_plan_config field
by field. A header change not mirrored in _lib.py shifts the fields and fails here; the control
reads the returned struct through a deliberately shifted layout."""
import ctypes

from gdncp import _lib as L


def _roundtrip_plan(cfg):
    h = ctypes.c_void_p()
    L.check(L.gdn_plan_create(ctypes.byref(h), ctypes.byref(cfg)), "gdn_plan_create")
    try:
        return L.Config.from_buffer_copy(L.gdn_plan_config(h).contents)
    finally:
        L.gdn_plan_destroy(h)


def test_kernel_config_roundtrip_and_shifted_layout_fails():
    cfg = L.gdn_config_default(3, 77, 2, 6, 24, 40)
    cfg.chunk, cfg.scale, cfg.l2norm, cfg.threads = 32, 0.25, 0, 1
    back = _roundtrip_plan(cfg)
    want = dict(B=3, T=77, Hk=2, Hv=6, K=24, V=40, chunk=32, scale=0.25, l2norm=0, threads=1,
                check_finite=1)
    assert {n: getattr(back, n) for n in want} == want

    class Shifted(ctypes.Structure):   # control: one int64 field missing at the front
        _fields_ = L.Config._fields_[1:]
    raw = Shifted.from_buffer_copy(bytes(back)[:ctypes.sizeof(Shifted)])
    assert {n: getattr(raw, n) for n in want if hasattr(raw, n)} != \
        {n: want[n] for n in want if hasattr(raw, n)}


def test_layer_config_roundtrip():
    cfg = L.gdn_layer_config_default(2, 50, 96, 2, 6, 16, 24)
    cfg.Kc, cfg.eps, cfg.chunk, cfg.threads, cfg.keep = 3, 1e-5, 16, 1, 1
    h = ctypes.c_void_p()
    L.check(L.gdn_layer_plan_create(ctypes.byref(h), ctypes.byref(cfg)), "gdn_layer_plan_create")
    try:
        back = L.gdn_layer_plan_config(h).contents
        got = {n: getattr(back, n) for n in ("B", "T", "E", "Hk", "Hv", "K", "V", "Kc", "chunk",
                                             "threads", "keep", "check_finite", "weight_dtype")}
        assert got == dict(B=2, T=50, E=96, Hk=2, Hv=6, K=16, V=24, Kc=3, chunk=16, threads=1,
                           keep=1, check_finite=1, weight_dtype=0)
        assert abs(back.eps - 1e-5) < 1e-12
        assert L.gdn_layer_conv_dim(ctypes.byref(cfg)) == 2 * 2 * 16 + 6 * 24
    finally:
        L.gdn_layer_plan_destroy(h)


def test_errors_name_the_problem():
    cfg = L.gdn_config_default(1, 10, 2, 3, 8, 8)   # Hv not a multiple of Hk
    h = ctypes.c_void_p()
    rc = L.gdn_plan_create(ctypes.byref(h), ctypes.byref(cfg))
    assert rc != 0
    try:
        L.check(rc, "gdn_plan_create")
    except ValueError as e:
        assert "gdn_plan_create" in str(e) and "Hv" in str(e), str(e)
    else:
        raise AssertionError("no error raised")


def test_version_and_status_codes_match_the_library():
    """gdncp.__version__ and the package metadata are the library's gdn_version(); every status
    code Python names has the library's own text (an unknown code gets "unknown status": the
    control that the comparison can fail)."""
    import gdncp
    from importlib.metadata import version
    assert gdncp.__version__ == L.gdn_version().decode() == version("gdncp")
    for code in L.STATUS_NAMES:
        assert L.gdn_strerror(code).decode() != "unknown status", code
    assert L.gdn_strerror(99).decode() == "unknown status"
    assert L.STATUS_NAMES[L.GDN_ERR_MPI] == "MPI" and L.GDN_ERR_MPI == 20
