"""The ctypes structs (generated from the headers into gdncp/_abi.py by scripts/gen_bindings.py)
against the library: every public struct's size, field names and field offsets equal the
compiler's (gdn_abi_sizeof / gdn_abi_offsetof / gdn_abi_field_name, include/gdncp/abi.h); the
control runs the same comparison on layouts built from the generated classes with a field
appended or removed and expects it to fail. Every prototype of the headers is bound. Configs make
the round trip through the library field by field; the tensor bundles (gdn_rule_inputs /
gdn_rule_grads and their _f64 twins) go through real calls, with swapped layouts as the
controls."""
import ctypes

import numpy as np

from gdncp import _abi, _lib as L


def _layout_mismatches(cls, name):
    """What differs between the ctypes struct cls and the library's struct `name`: the size, the
    field names in order, each field's offset ([] when nothing does)."""
    out = []
    size = L.gdn_abi_sizeof(name.encode())
    if ctypes.sizeof(cls) != size:
        out.append(f"{name}: sizeof {ctypes.sizeof(cls)} in Python, {size} in C")
    c_fields, i = [], 0
    while (f := L.gdn_abi_field_name(name.encode(), i)) is not None:
        c_fields.append(f.decode())
        i += 1
    py_fields = [f for f, _ in cls._fields_]
    if py_fields != c_fields:
        out.append(f"{name}: fields {py_fields} in Python, {c_fields} in C")
    for f in py_fields:
        off = L.gdn_abi_offsetof(name.encode(), f.encode())
        if getattr(cls, f).offset != off:
            out.append(f"{name}.{f}: offset {getattr(cls, f).offset} in Python, {off} in C")
    return out


def _c_struct_names():
    names, i = [], 0
    while (n := L.gdn_abi_struct_name(i)) is not None:
        names.append(n.decode())
        i += 1
    return names


def test_every_struct_has_the_c_layout():
    """Every struct the library's table lists is generated, and each one's size, field names and
    offsets are the compiler's; unknown names are refused (0 / -1 / NULL)."""
    names = _c_struct_names()
    assert len(names) >= 20 and "gdn_config" in names and "gdn_model_config" in names
    assert sorted(names) == sorted(_abi.STRUCTS)
    bad = [m for n in names for m in _layout_mismatches(_abi.STRUCTS[n], n)]
    assert bad == []
    for n in names:                                   # the classes _lib exports are these
        assert getattr(L, _abi.STRUCTS[n].__name__) is _abi.STRUCTS[n]
    assert L.gdn_abi_sizeof(b"gdn_nothing") == 0 and L.gdn_abi_sizeof(None) == 0
    assert L.gdn_abi_offsetof(b"gdn_config", b"nothing") == -1
    assert L.gdn_abi_struct_name(len(names)) is None and L.gdn_abi_struct_name(-1) is None
    assert L.gdn_abi_field_name(b"gdn_config", 10 ** 6) is None


def test_a_wrong_layout_fails_the_comparison():
    """The control: layouts built from every generated class with a field appended, the first
    field removed or the last field removed, run through the same comparison, all fail."""
    for name, cls in _abi.STRUCTS.items():
        f = list(cls._fields_)
        wrong = {"appended": f + [("extra", ctypes.c_int64)], "first removed": f[1:],
                 "last removed": f[:-1]}
        for what, fields in wrong.items():
            Wrong = type("Wrong" + cls.__name__, (ctypes.Structure,), {"_fields_": fields})
            assert _layout_mismatches(Wrong, name) != [], (name, what)
    # a single field of another width in the middle: the offsets after it differ
    f = list(L.Config._fields_)
    i = [n for n, _ in f].index("chunk")
    f[i] = ("chunk", ctypes.c_int64)
    Wide = type("WideConfig", (ctypes.Structure,), {"_fields_": f})
    assert any(".scale: offset" in m for m in _layout_mismatches(Wide, "gdn_config"))


def test_every_prototype_is_bound():
    """Every GDN_API function of the headers is found in the library and bound with its header's
    prototype (those taking an MPI_Comm by gdncp.core, once the MPI's handle type is known)."""
    assert L.MISSING == []
    assert len(_abi.PROTOTYPES) > 200
    for name, (res, args) in _abi.PROTOTYPES.items():
        if any(isinstance(t, str) for t in args):
            assert args.count("MPI_Comm") == sum(isinstance(t, str) for t in args), name
            continue
        f = getattr(L, name)
        assert f.restype is res and f.argtypes == args, name
    assert _abi.PROTOTYPES["gdn_plan_create"] == (ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p),
                                                                 ctypes.POINTER(L.Config)])


def _roundtrip_plan(cfg):
    h = ctypes.c_void_p()
    L.check(L.gdn_plan_create(ctypes.byref(h), ctypes.byref(cfg)), "gdn_plan_create")
    try:
        return L.Config.from_buffer_copy(L.describe(L.gdn_plan_describe, L.PlanInfo, h).config.contents)
    finally:
        L.gdn_plan_destroy(h)


def test_plan_describe_refuses_null():
    """Every plan description refuses a NULL plan (ValueError naming it), its info zeroed."""
    for fn, cls in ((L.gdn_plan_describe, L.PlanInfo), (L.gdn_layer_plan_describe, L.LayerPlanInfo),
                    (L.gdn_attn_plan_describe, L.AttnPlanInfo), (L.gdn_moe_plan_describe, L.MoePlanInfo)):
        info = cls()
        assert fn(None, ctypes.byref(info)) == L.GDN_ERR_ARG
        assert "the plan is NULL" in L.gdn_errmsg().decode()
        assert not info.config and getattr(info, "saved_floats", 0) == 0


def test_kernel_config_roundtrip():
    cfg = L.gdn_config_default(3, 77, 2, 6, 24, 40)
    cfg.chunk, cfg.scale, cfg.l2norm, cfg.threads = 32, 0.25, 0, 1
    back = _roundtrip_plan(cfg)
    want = dict(B=3, T=77, Hk=2, Hv=6, K=24, V=40, chunk=32, scale=0.25, l2norm=0, threads=1,
                check_finite=1)
    assert {n: getattr(back, n) for n in want} == want


def test_layer_config_roundtrip():
    cfg = L.gdn_layer_config_default(2, 50, 96, 2, 6, 16, 24)
    cfg.Kc, cfg.eps, cfg.chunk, cfg.threads, cfg.keep, cfg.compute = 3, 1e-5, 16, 1, 1, 1
    h = ctypes.c_void_p()
    L.check(L.gdn_layer_plan_create(ctypes.byref(h), ctypes.byref(cfg)), "gdn_layer_plan_create")
    try:
        back = L.describe(L.gdn_layer_plan_describe, L.LayerPlanInfo, h).config.contents
        got = {n: getattr(back, n) for n in ("B", "T", "E", "Hk", "Hv", "K", "V", "Kc", "chunk",
                                             "threads", "keep", "check_finite", "weight_dtype",
                                             "compute")}
        assert got == dict(B=2, T=50, E=96, Hk=2, Hv=6, K=16, V=24, Kc=3, chunk=16, threads=1,
                           keep=1, check_finite=1, weight_dtype=0, compute=1)
        assert abs(back.eps - 1e-5) < 1e-12
        assert L.gdn_layer_conv_dim(ctypes.byref(cfg)) == 2 * 2 * 16 + 6 * 24
    finally:
        L.gdn_layer_plan_destroy(h)


def test_moe_config_roundtrip():
    """gdn_moe_config through an MoE plan: every field back where the header puts it (the layout
    itself, and its control, are test_every_struct_has_the_c_layout's)."""
    cfg = L.gdn_moe_config_default(5, 32, 6, 2, 8, 4)
    cfg.norm_topk, cfg.threads, cfg.check_finite, cfg.compute = 0, 1, 0, 1
    h = ctypes.c_void_p()
    L.check(L.gdn_moe_plan_create(ctypes.byref(h), ctypes.byref(cfg)), "gdn_moe_plan_create")
    try:
        back = L.describe(L.gdn_moe_plan_describe, L.MoePlanInfo, h).config.contents
        want = dict(N=5, E=32, n_experts=6, top_k=2, I=8, Is=4, norm_topk=0, threads=1, check_finite=0, compute=1)
        assert {n: getattr(back, n) for n in want} == want
        assert L.gdn_moe_param_floats(ctypes.byref(cfg)) >= 6 * 32 + 6 * 16 * 32 + 6 * 32 * 8 + 3 * 4 * 32 + 32
    finally:
        L.gdn_moe_plan_destroy(h)


def test_attention_config_roundtrip():
    """gdn_attn_config (the attention layer's, which gdn_sdpa_* reads too) through a layer plan."""
    cfg = L.gdn_attn_config_default(2, 40, 32, 4, 2, 16)
    cfg.R, cfg.rope_theta, cfg.eps, cfg.threads, cfg.pos_offset, cfg.max_position = 8, 1e4, 1e-5, 1, 3, 100
    cfg.compute = 1
    h = ctypes.c_void_p()
    L.check(L.gdn_attn_plan_create(ctypes.byref(h), ctypes.byref(cfg)), "gdn_attn_plan_create")
    try:
        back = L.AttnConfig.from_buffer_copy(L.describe(L.gdn_attn_plan_describe, L.AttnPlanInfo, h).config.contents)
    finally:
        L.gdn_attn_plan_destroy(h)
    want = dict(B=2, T=40, E=32, H=4, Hkv=2, d=16, R=8, rope_theta=1e4, threads=1, check_finite=1,
                n_docs=0, pos_offset=3, seq_offset=0, max_position=100, cp=0, keep=0, compute=1)
    assert {n: getattr(back, n) for n in want} == want and abs(back.eps - 1e-5) < 1e-12


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
    """gdncp.__version__ and the package metadata are the library's gdn_version(), which is the
    headers' GDN_VERSION_STRING; every status code of the header's gdn_status has the library's
    own text (an unknown code gets "unknown status": the control that the comparison can fail)."""
    import gdncp
    from importlib.metadata import version
    assert gdncp.__version__ == L.gdn_version().decode() == version("gdncp") == _abi.GDN_VERSION_STRING
    assert sorted(L.STATUS_NAMES) == sorted(v for v in _abi.ENUMS["gdn_status"].values() if v)
    for code in L.STATUS_NAMES:
        assert L.gdn_strerror(code).decode() != "unknown status", code
    assert L.gdn_strerror(99).decode() == "unknown status"
    assert L.STATUS_NAMES[L.GDN_ERR_MPI] == "MPI" and L.GDN_ERR_MPI == 20


def _rule_problem(rng, B=1, T=37, Hk=1, Hv=2, K=8, V=8):
    f = np.float32
    q, k = (rng.standard_normal((B, T, Hk, K)).astype(f) for _ in range(2))
    v = rng.standard_normal((B, T, Hv, V)).astype(f)
    g = (-0.2 * rng.random((B, T, Hv))).astype(f)
    beta = rng.random((B, T, Hv)).astype(f)
    h0 = (0.3 * rng.standard_normal((B, Hv, K, V))).astype(f)
    return [q, k, v, g, beta, h0]


def _swapped(struct, a, b):
    """A copy of the ctypes bundle struct's layout with fields a and b trading places: filled by
    name, the library then reads a where the header puts b (the deliberately wrong layout)."""
    names = [n for n, _ in struct._fields_]
    i, j = names.index(a), names.index(b)
    fields = list(struct._fields_)
    fields[i], fields[j] = fields[j], fields[i]
    return type("Swapped" + struct.__name__, (ctypes.Structure,), {"_fields_": fields})


def _as(struct_ptr_type, obj):
    return ctypes.cast(ctypes.pointer(obj), ctypes.POINTER(struct_ptr_type))


def _rel(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def test_rule_bundles_have_the_c_layout():
    """The ctypes mirrors of gdn_rule_inputs / gdn_rule_grads and their _f64 twins go through
    gdn_forward, gdn_backward and the oracle field by field: fp32 and fp64 results agree, the
    forward from h0 differs from the one without it (h0 is read), and every gradient lands in
    its own array. Controls: the same calls through layouts with two fields swapped (q/k,
    h0/beta's neighbour order, dq/dk, dv/dh0 shapes kept) give results that no longer agree."""
    rng = np.random.default_rng(7)
    x = _rule_problem(rng)
    q, k, v, g, beta, h0 = x
    B, T, Hk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    x64 = [a.astype(np.float64) for a in x]
    assert ctypes.sizeof(L.RuleInputs) == ctypes.sizeof(L.RuleGrads) == 6 * ctypes.sizeof(ctypes.c_void_p)
    assert [n for n, _ in L.RuleInputs._fields_] == ["q", "k", "v", "g", "beta", "h0"]
    assert [n for n, _ in L.RuleGrads._fields_] == ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
    cfg = L.gdn_config_default(B, T, Hk, Hv, K, V)
    cfg.chunk, cfg.threads = 16, 1
    h = ctypes.c_void_p()
    L.check(L.gdn_plan_create(ctypes.byref(h), ctypes.byref(cfg)), "gdn_plan_create")
    try:
        def fwd32(bundle):
            o, ht = np.empty_like(v), np.empty_like(h0)
            L.check(L.gdn_forward(h, L.f32p(o), L.f32p(ht), bundle), "gdn_forward")
            return o, ht
        o64, ht64 = np.empty(v.shape), np.empty(h0.shape)
        L.check(L.gdn_reference_forward(ctypes.byref(cfg), L.f64p(o64), L.f64p(ht64),
                                        ctypes.byref(L.rule_inputs(*x64, f64=True))),
                "gdn_reference_forward")
        o, ht = fwd32(ctypes.byref(L.rule_inputs(*x)))
        assert _rel(o, o64) < 1e-4 and _rel(ht, ht64) < 1e-4
        o_zero, _ = fwd32(ctypes.byref(L.rule_inputs(*x[:5])))   # h0 NULL: zeros
        assert _rel(o_zero, o64) > 1e-3                           # h0 was read from its field
        # controls: q and k trade places (same shapes); the oracle's twin with q/k swapped too
        Sw = _swapped(L.RuleInputs, "q", "k")
        o_sw, _ = fwd32(_as(L.RuleInputs, Sw(**{n: L.f32p(a) for n, a in zip("q k v g beta h0".split(), x)})))
        assert _rel(o_sw, o64) > 1e-2
        Sw64 = _swapped(L.RuleInputsF64, "q", "k")
        o64_sw = np.empty(v.shape)
        L.check(L.gdn_reference_forward(ctypes.byref(cfg), L.f64p(o64_sw), None, _as(
            L.RuleInputsF64, Sw64(**{n: L.f64p(a) for n, a in zip("q k v g beta h0".split(), x64)}))),
            "gdn_reference_forward")
        assert _rel(o, o64_sw) > 1e-2

        # the backward: every gradient into its own field's array
        do = rng.standard_normal(v.shape).astype(np.float32)
        dht = rng.standard_normal(h0.shape).astype(np.float32)
        want = [np.empty(a.shape) for a in x]
        L.check(L.gdn_reference_backward(ctypes.byref(cfg), ctypes.byref(L.rule_grads(*want, f64=True)),
                                         ctypes.byref(L.rule_inputs(*x64, f64=True)),
                                         L.f64p(do.astype(np.float64)), L.f64p(dht.astype(np.float64))),
                "gdn_reference_backward")

        def bwd32(grads_struct, fill):
            got = [np.full(a.shape, np.nan, np.float32) for a in x]
            bundle = grads_struct(**{n: L.f32p(a) for n, a in zip(fill, got)})
            L.check(L.gdn_backward(h, _as(L.RuleGrads, bundle), ctypes.byref(L.rule_inputs(*x)),
                                   L.f32p(do), L.f32p(dht)), "gdn_backward")
            return got
        names = ["dq", "dk", "dv", "dg", "dbeta", "dh0"]
        got = bwd32(L.RuleGrads, names)
        errs = [_rel(a, b) for a, b in zip(got, want)]
        assert max(errs) < 1e-4, dict(zip(names, errs))
        got_sw = bwd32(_swapped(L.RuleGrads, "dq", "dk"), names)      # control: dq and dk trade
        assert _rel(got_sw[0], want[0]) > 1e-2 and _rel(got_sw[1], want[1]) > 1e-2
        # the f64 grads twin: its swapped layout puts dk's values into dq's array
        Sg64 = _swapped(L.RuleGradsF64, "dq", "dk")
        w_sw = [np.empty(a.shape) for a in x]
        L.check(L.gdn_reference_backward(ctypes.byref(cfg), _as(L.RuleGradsF64, Sg64(
            **{n: L.f64p(a) for n, a in zip(names, w_sw)})), ctypes.byref(L.rule_inputs(*x64, f64=True)),
            L.f64p(do.astype(np.float64)), L.f64p(dht.astype(np.float64))), "gdn_reference_backward")
        assert _rel(got[0], w_sw[0]) > 1e-2 and _rel(got[0], w_sw[1]) < 1e-4
    finally:
        L.gdn_plan_destroy(h)


def test_rule_bundle_null_fields_are_named():
    """A NULL bundle and a NULL required field are refused naming them (GDN_ERR_ARG, a
    ValueError through check); an optional field (dh0) may be NULL."""
    rng = np.random.default_rng(8)
    x = _rule_problem(rng, T=20)
    q, k, v, g, beta, h0 = x
    cfg = L.gdn_config_default(*q.shape[:3], v.shape[2], q.shape[3], v.shape[3])
    cfg.threads = 1
    h = ctypes.c_void_p()
    L.check(L.gdn_plan_create(ctypes.byref(h), ctypes.byref(cfg)), "gdn_plan_create")
    try:
        o = np.empty_like(v)
        assert L.gdn_forward(h, L.f32p(o), None, None) == 1
        assert "inputs 'in' (gdn_rule_inputs) is NULL" in L.gdn_errmsg().decode()
        no_v = L.rule_inputs(q, k, None, g, beta)
        assert L.gdn_forward(h, L.f32p(o), None, ctypes.byref(no_v)) == 1
        assert "input 'v' is NULL" in L.gdn_errmsg().decode()
        grads = [np.empty_like(a) for a in x]
        do = np.ones_like(v)
        no_dg = L.rule_grads(grads[0], grads[1], grads[2], None, grads[4])
        assert L.gdn_backward(h, ctypes.byref(no_dg), ctypes.byref(L.rule_inputs(*x)), L.f32p(do),
                              None) == 1
        assert "gradient output 'dg' is NULL" in L.gdn_errmsg().decode()
        assert L.gdn_backward(h, ctypes.byref(L.rule_grads(*grads[:5])),   # dh0 NULL: optional
                              ctypes.byref(L.rule_inputs(*x)), L.f32p(do), None) == 0
    finally:
        L.gdn_plan_destroy(h)


def test_model_config_mirror_reads_the_tiny_checkpoint():
    """gdn_model_config (the whole model's) filled by gdn_ckpt_load_config from the transformers
    checkpoint tests/data/qwen35_tiny reads back every config.json field in its place, and
    gdn_model_param_floats takes it (more floats than real parameters, gdn_model_param_count)."""
    import json
    from conftest import TINY
    cfg = L.ModelConfig()
    L.check(L.gdn_ckpt_load_config(TINY.encode(), ctypes.byref(cfg)), "gdn_ckpt_load_config")
    j = json.load(open(f"{TINY}/config.json"))
    want = dict(vocab=j["vocab_size"], E=j["hidden_size"], L=j["num_hidden_layers"],
                I=j["intermediate_size"], Hk=j["linear_num_key_heads"],
                Hv=j["linear_num_value_heads"], K=j["linear_key_head_dim"],
                V=j["linear_value_head_dim"], Kc=j["linear_conv_kernel_dim"],
                tie_embeddings=int(j["tie_word_embeddings"]), H=j["num_attention_heads"],
                Hkv=j["num_key_value_heads"], d=j["head_dim"],
                R=int(j["head_dim"] * j["rope_parameters"]["partial_rotary_factor"]),
                rope_theta=j["rope_parameters"]["rope_theta"],
                max_position=j["max_position_embeddings"])
    assert {n: getattr(cfg, n) for n in want} == want
    assert abs(cfg.eps - j["rms_norm_eps"]) < 1e-12
    assert list(cfg.full_attention[:cfg.L + 1]) == [int(t == "full_attention") for t in j["layer_types"]] + [0]
    assert L.gdn_model_config_check(ctypes.byref(cfg)) == 0
    assert L.gdn_model_count_layers(ctypes.byref(cfg), L.GDN_MODEL_ATTN_LAYERS) == 1
    n = L.gdn_model_param_floats(ctypes.byref(cfg))
    assert n >= L.gdn_model_param_count(ctypes.byref(cfg)) > 0


def test_sampling_mirror_and_token_type():
    """gdn_sampling: the library's default comes back as (0, 0, 1); a setting the library accepts
    is refused when sent through a layout with temperature and top_p swapped (the control: the
    library reads the fields where the header puts them); the token dtype and its ctypes
    pointer agree in size."""
    d = L.gdn_sampling_default()
    assert (d.temperature, d.top_k, d.top_p) == (0.0, 0, 1.0)
    s = L.Sampling(2.0, 5, 1.0)
    assert L.gdn_sampling_check(ctypes.byref(s), 256) == 0
    Sw = _swapped(L.Sampling, "temperature", "top_p")
    assert L.gdn_sampling_check(_as(L.Sampling, Sw(temperature=2.0, top_k=5, top_p=1.0)), 256) == 1
    assert "top_p = 2" in L.gdn_errmsg().decode()
    assert ctypes.sizeof(L.c_token) == np.dtype(L.TOKEN_DTYPE).itemsize


def test_token_type_is_the_librarys():
    """TOKEN_DTYPE is the C token type of gdn_model_logits: logits.io's ids passed as that dtype
    give transformers' logits (1e-5). Control: the same ids as the other width (uint8 <-> int32,
    the buffer padded so that nothing reads past it) fail the check or are refused."""
    from conftest import TINY, read_safetensors, rel_err
    ref = read_safetensors(f"{TINY}/logits.io.safetensors")
    ids, want = ref["input_ids"], ref["logits"]
    cfg = L.ModelConfig()
    L.check(L.gdn_ckpt_load_config(TINY.encode(), ctypes.byref(cfg)), "gdn_ckpt_load_config")
    w = np.zeros(L.gdn_model_param_floats(ctypes.byref(cfg)), np.float32)
    L.check(L.gdn_ckpt_load(TINY.encode(), ctypes.byref(cfg), L.f32p(w), None, None, None), "load")
    B, T = ids.shape
    plan = ctypes.c_void_p()
    run = L.ModelRun(B=B, T=T, threads=1, recompute=1, check_finite=1)
    L.check(L.gdn_model_plan_create(ctypes.byref(plan), ctypes.byref(cfg), ctypes.byref(run), None), "plan")
    try:
        def logits(tok):
            out = np.zeros((B, T, cfg.vocab), np.float32)
            rc = L.gdn_model_logits(plan, L.f32p(w), ctypes.cast(tok.ctypes.data, L.P_token), L.f32p(out))
            return out if rc == 0 else None
        got = logits(np.ascontiguousarray(ids, dtype=L.TOKEN_DTYPE))
        assert got is not None and rel_err(got, want) < 1e-5
        other = np.uint8 if np.dtype(L.TOKEN_DTYPE).itemsize == 4 else np.int32
        wrong = np.zeros(4 * ids.size, other)            # 4x: room for the wider reading
        wrong[:ids.size] = ids.ravel()
        bad = logits(wrong)
        assert bad is None or rel_err(bad, want) > 1e-3
    finally:
        L.gdn_model_plan_destroy(plan)


def test_isa_levels_and_refusal_on_import():
    """gdncp._lib.isa() names the levels as the C library has them (gdn_isa), and a GDNCP_ISA the
    CPU or the build cannot honour stops `import gdncp` with an ImportError that names it, in a
    fresh process (the cap is read once per process). Control: the same import under the
    dispatched level as the cap succeeds."""
    import os
    import subprocess
    import sys
    lv = L.isa()
    names = {"generic", "avx2", "avx512", "avx512bf16", "amx"}
    assert lv["cpu"] in names and lv["compiled"] in names and lv["dispatched"] in names, lv
    order = ["generic", "avx2", "avx512", "avx512bf16", "amx"]
    assert order.index(lv["compiled"]) <= order.index(lv["dispatched"]) <= order.index(lv["cpu"]), lv

    def import_with(cap):
        env = dict(os.environ, GDNCP_ISA=cap)
        return subprocess.run([sys.executable, "-c", "import gdncp"], env=env, capture_output=True, text=True,
                              timeout=120)
    bad = import_with("bogus")
    assert bad.returncode != 0 and "ImportError" in bad.stderr and "GDNCP_ISA='bogus'" in bad.stderr, bad.stderr
    assert lv["dispatched"] != "generic", "an x86 CPU with AVX2 is needed for the control"
    good = import_with(lv["dispatched"])
    assert good.returncode == 0, good.stderr
