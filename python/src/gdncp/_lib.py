"""ctypes declarations of include/gdncp.h: the shared library, its structs and prototypes.

Only what the Python modules call is declared. The structs mirror the header field by field
(ctypes lays them out as the C compiler does); tests/test_abi.py checks that a config makes the
round trip through the library unchanged, so a header change that is not mirrored here fails
loudly instead of passing garbage.
"""
import ctypes
import os
from ctypes import (POINTER, c_char_p, c_double, c_float, c_int, c_int64, c_size_t, c_ubyte,
                    c_uint64, c_void_p)

import numpy as np

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

GDN_OK = 0
GDN_F32, GDN_F64, GDN_BF16 = 0, 1, 2
GDN_ERR_ARG, GDN_ERR_SHAPE = 1, 2  # (STATUS_NAMES below)
GDN_ERR_MPI = 20  # include/gdncp/status.h; test_abi checks every code's text against the library
STATUS_NAMES = {1: "ARG", 2: "SHAPE", 3: "NONFINITE", 4: "NOMEM", 5: "IO", 6: "FORMAT",
                7: "MISSING", 8: "DTYPE", GDN_ERR_MPI: "MPI"}

P_float = POINTER(c_float)
P_double = POINTER(c_double)
P_int64 = POINTER(c_int64)


class Config(ctypes.Structure):
    """gdn_config."""
    _fields_ = [("B", c_int64), ("T", c_int64), ("Hk", c_int64), ("Hv", c_int64),
                ("K", c_int64), ("V", c_int64), ("chunk", c_int), ("scale", c_float),
                ("l2norm", c_int), ("threads", c_int), ("check_finite", c_int),
                ("checkpoint_chunks", c_int), ("cu_seqlens", P_int64), ("n_docs", c_int64),
                ("seq_offset", c_int64), ("compute", c_int)]


class LayerConfig(ctypes.Structure):
    """gdn_layer_config."""
    _fields_ = [("B", c_int64), ("T", c_int64), ("E", c_int64), ("Hk", c_int64),
                ("Hv", c_int64), ("K", c_int64), ("V", c_int64), ("Kc", c_int64),
                ("eps", c_float), ("chunk", c_int), ("threads", c_int), ("keep", c_int),
                ("check_finite", c_int), ("weight_dtype", c_int), ("compute", c_int), ("cu_seqlens", P_int64),
                ("n_docs", c_int64), ("seq_offset", c_int64)]


class MoeConfig(ctypes.Structure):
    """gdn_moe_config (include/gdncp/moe.h): the sparse mixture-of-experts MLP's."""
    _fields_ = [("N", c_int64), ("E", c_int64), ("n_experts", c_int64), ("top_k", c_int64),
                ("I", c_int64), ("Is", c_int64), ("norm_topk", c_int), ("threads", c_int),
                ("check_finite", c_int), ("compute", c_int)]


class AttnConfig(ctypes.Structure):
    """gdn_attn_config (include/gdncp/attention.h): the gated attention layer's, whose B, T, H,
    Hkv, d, threads, check_finite, cu_seqlens and n_docs the attention core alone (gdn_sdpa_*)
    reads."""
    _fields_ = [("B", c_int64), ("T", c_int64), ("E", c_int64), ("H", c_int64), ("Hkv", c_int64),
                ("d", c_int64), ("R", c_int64), ("rope_theta", c_double), ("eps", c_float),
                ("threads", c_int), ("check_finite", c_int), ("cu_seqlens", P_int64),
                ("n_docs", c_int64), ("pos_offset", c_int64), ("seq_offset", c_int64),
                ("max_position", c_int64), ("cp", c_int), ("keep", c_int), ("compute", c_int)]


class RuleInputs(ctypes.Structure):
    """gdn_rule_inputs: q, k, v, g, beta required; h0 optional (NULL: zeros)."""
    _fields_ = [(n, P_float) for n in ("q", "k", "v", "g", "beta", "h0")]


class RuleGrads(ctypes.Structure):
    """gdn_rule_grads: dq, dk, dv, dg, dbeta required; dh0 optional (NULL: not wanted)."""
    _fields_ = [(n, P_float) for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0")]


class RuleInputsF64(ctypes.Structure):
    """gdn_rule_inputs_f64 (the oracle's)."""
    _fields_ = [(n, P_double) for n in ("q", "k", "v", "g", "beta", "h0")]


class RuleGradsF64(ctypes.Structure):
    """gdn_rule_grads_f64 (the oracle's)."""
    _fields_ = [(n, P_double) for n in ("dq", "dk", "dv", "dg", "dbeta", "dh0")]


def rule_inputs(q, k, v, g, beta, h0=None, f64=False):
    """The bundle of the arrays' pointers (None: NULL). The arrays must outlive the call."""
    cls, ptr = (RuleInputsF64, f64p) if f64 else (RuleInputs, f32p)
    return cls(ptr(q), ptr(k), ptr(v), ptr(g), ptr(beta), ptr(h0))


def rule_grads(dq, dk, dv, dg, dbeta, dh0=None, f64=False):
    cls, ptr = (RuleGradsF64, f64p) if f64 else (RuleGrads, f32p)
    return cls(ptr(dq), ptr(dk), ptr(dv), ptr(dg), ptr(dbeta), ptr(dh0))


def _proto(name, restype, *argtypes):
    if not HAS_MPI_WING and not hasattr(lib, name):  # a CP function in a build without the wing
        def missing(*args):
            raise RuntimeError(f"gdncp: {name} is context parallelism, in libgdncp_mpi.so, which this "
                               "build of the library does not have (built with GDN_MPI=OFF)")
        return missing
    f = getattr(lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


gdn_strerror = _proto("gdn_strerror", c_char_p, c_int)
gdn_compute_path = _proto("gdn_compute_path", c_char_p, c_int)  # the path a compute precision runs on
gdn_version = _proto("gdn_version", c_char_p)
gdn_errmsg = _proto("gdn_errmsg", c_char_p)

gdn_config_default = _proto("gdn_config_default", Config, c_int64, c_int64, c_int64, c_int64,
                            c_int64, c_int64)
gdn_config_check = _proto("gdn_config_check", c_int, POINTER(Config))
gdn_plan_create = _proto("gdn_plan_create", c_int, POINTER(c_void_p), POINTER(Config))
gdn_plan_destroy = _proto("gdn_plan_destroy", None, c_void_p)
gdn_plan_config = _proto("gdn_plan_config", POINTER(Config), c_void_p)
gdn_plan_path = _proto("gdn_plan_path", c_char_p, c_void_p)
gdn_plan_checkpoint_floats = _proto("gdn_plan_checkpoint_floats", c_size_t, c_void_p)
P_in, P_gr = POINTER(RuleInputs), POINTER(RuleGrads)
# (plan, o, ht, in); (plan, grads, in, dout, dht); ... as in include/gdncp/kernel.h
gdn_forward = _proto("gdn_forward", c_int, c_void_p, P_float, P_float, P_in)
gdn_backward = _proto("gdn_backward", c_int, c_void_p, P_gr, P_in, P_float, P_float)
gdn_forward_save = _proto("gdn_forward_save", c_int, c_void_p, P_float, P_float, P_float, P_in)
gdn_backward_saved = _proto("gdn_backward_saved", c_int, c_void_p, P_gr, P_in, P_float, P_float,
                            P_float)
gdn_summary = _proto("gdn_summary", c_int, c_void_p, P_float, P_float, P_in)
gdn_summary_adjoint = _proto("gdn_summary_adjoint", c_int, c_void_p, P_float, P_in, P_float)
gdn_reference_forward = _proto("gdn_reference_forward", c_int, POINTER(Config), P_double,
                               P_double, POINTER(RuleInputsF64))
gdn_reference_backward = _proto("gdn_reference_backward", c_int, POINTER(Config),
                                POINTER(RuleGradsF64), POINTER(RuleInputsF64), P_double, P_double)
gdn_step = _proto("gdn_step", c_int, c_void_p, P_float, P_float, P_in)

gdn_layer_config_default = _proto("gdn_layer_config_default", LayerConfig, *([c_int64] * 7))
gdn_layer_config_check = _proto("gdn_layer_config_check", c_int, POINTER(LayerConfig))
gdn_layer_conv_dim = _proto("gdn_layer_conv_dim", c_int64, POINTER(LayerConfig))
gdn_layer_param_name = _proto("gdn_layer_param_name", c_char_p, c_int)
gdn_layer_param_shape = _proto("gdn_layer_param_shape", c_int, POINTER(LayerConfig), c_int,
                               P_int64)
gdn_layer_param_offset = _proto("gdn_layer_param_offset", c_size_t, POINTER(LayerConfig), c_int)
gdn_layer_param_numel = _proto("gdn_layer_param_numel", c_size_t, POINTER(LayerConfig), c_int)
gdn_layer_param_floats = _proto("gdn_layer_param_floats", c_size_t, POINTER(LayerConfig))
gdn_layer_plan_create = _proto("gdn_layer_plan_create", c_int, POINTER(c_void_p),
                               POINTER(LayerConfig))
gdn_layer_plan_destroy = _proto("gdn_layer_plan_destroy", None, c_void_p)
gdn_layer_plan_config = _proto("gdn_layer_plan_config", POINTER(LayerConfig), c_void_p)
gdn_layer_saved_floats = _proto("gdn_layer_saved_floats", c_size_t, c_void_p)
gdn_layer_forward = _proto("gdn_layer_forward", c_int, c_void_p, P_float, P_float, P_float,
                           c_void_p, P_float, P_float)
gdn_layer_backward = _proto("gdn_layer_backward", c_int, c_void_p, P_float, P_float, P_float,
                            P_float, P_float, P_float)
gdn_layer_decode = _proto("gdn_layer_decode", c_int, c_void_p, P_float, P_float, c_void_p,
                          P_float, P_float)
gdn_layer_reference_forward = _proto("gdn_layer_reference_forward", c_int, POINTER(LayerConfig),
                                     P_double, P_double, P_double)
gdn_layer_reference_backward = _proto("gdn_layer_reference_backward", c_int,
                                      POINTER(LayerConfig), P_double, P_double, P_double,
                                      P_double, P_double)
# The attention core alone: causal SDPA over token-major q [B,T,H,d], k, v [B,T,Hkv,d]
gdn_attn_config_default = _proto("gdn_attn_config_default", AttnConfig, *([c_int64] * 6))
gdn_attn_plan_create = _proto("gdn_attn_plan_create", c_int, POINTER(c_void_p), POINTER(AttnConfig))
gdn_attn_plan_destroy = _proto("gdn_attn_plan_destroy", None, c_void_p)
gdn_attn_plan_config = _proto("gdn_attn_plan_config", POINTER(AttnConfig), c_void_p)
gdn_attn_config_check = _proto("gdn_attn_config_check", c_int, POINTER(AttnConfig))
gdn_attn_param_name = _proto("gdn_attn_param_name", c_char_p, c_int)
gdn_attn_param_shape = _proto("gdn_attn_param_shape", c_int, POINTER(AttnConfig), c_int, P_int64)
gdn_attn_param_offset = _proto("gdn_attn_param_offset", c_size_t, POINTER(AttnConfig), c_int)
gdn_attn_param_floats = _proto("gdn_attn_param_floats", c_size_t, POINTER(AttnConfig))
gdn_attn_saved_floats = _proto("gdn_attn_saved_floats", c_size_t, c_void_p)
gdn_attn_cp_strategy_parse = _proto("gdn_attn_cp_strategy_parse", c_int, c_char_p)
gdn_sdpa_plan_create = _proto("gdn_sdpa_plan_create", c_int, POINTER(c_void_p), POINTER(AttnConfig))
gdn_sdpa_plan_destroy = _proto("gdn_sdpa_plan_destroy", None, c_void_p)
gdn_sdpa_plan_path = _proto("gdn_sdpa_plan_path", c_char_p, c_void_p)
# (plan, o, lse, q, k, v); (plan, dq, dk, dv, q, k, v, o, lse, dout)
gdn_sdpa_forward = _proto("gdn_sdpa_forward", c_int, c_void_p, P_float, P_float, P_float, P_float,
                          P_float)
gdn_sdpa_backward = _proto("gdn_sdpa_backward", c_int, c_void_p, *([P_float] * 9))
gdn_measure_peak_gflops = _proto("gdn_measure_peak_gflops", c_double, c_int)
gdn_flops_issued_start = _proto("gdn_flops_issued_start", None)
gdn_flops_issued_stop = _proto("gdn_flops_issued_stop", c_uint64)

GDN_P_COUNT = 9

# Context parallelism (include/gdncp/cp.h). gdn_cp_create takes an MPI_Comm, whose C type is the
# MPI implementation's (an int in MPICH): core._mpi() declares it once it knows the type.


class CPStats(ctypes.Structure):
    """gdn_cp_stats."""
    _fields_ = [("fold_s", c_double), ("comm_s", c_double), ("replay_s", c_double),
                ("bytes_sent", c_uint64), ("bytes_recv", c_uint64), ("messages", c_uint64),
                ("rounds", c_int)]


gdn_cp_destroy = _proto("gdn_cp_destroy", None, c_void_p)
gdn_cp_rank = _proto("gdn_cp_rank", c_int, c_void_p)
gdn_cp_size = _proto("gdn_cp_size", c_int, c_void_p)
gdn_cp_strategy_parse = _proto("gdn_cp_strategy_parse", c_int, c_char_p)
# (cp, plan, o, ht, s_in, in); (cp, plan, grads (dh0: ds_in), in, s_in, dout, dht)
gdn_cp_forward = _proto("gdn_cp_forward", c_int, c_void_p, c_void_p, P_float, P_float, P_float,
                        P_in)
gdn_cp_backward = _proto("gdn_cp_backward", c_int, c_void_p, c_void_p, P_gr, P_in, P_float,
                         P_float, P_float)
gdn_cp_agree_status = _proto("gdn_cp_agree_status", c_int, c_void_p, c_int)
# The layers over a communicator (cp.h): (cp, plan, y, saved, x, w); (cp, plan, dx, dw, x, w, saved, dy)
gdn_layer_cp_forward = _proto("gdn_layer_cp_forward", c_int, c_void_p, c_void_p, P_float, P_float,
                              P_float, c_void_p)
gdn_layer_cp_backward = _proto("gdn_layer_cp_backward", c_int, c_void_p, c_void_p, P_float, P_float,
                               P_float, P_float, P_float, P_float)
gdn_attn_cp_forward = _proto("gdn_attn_cp_forward", c_int, c_void_p, c_void_p, P_float, P_float,
                             P_float, P_float)
gdn_attn_cp_backward = _proto("gdn_attn_cp_backward", c_int, c_void_p, c_void_p, P_float, P_float,
                              P_float, P_float, P_float, P_float)
# The token-axis halo (the conv's): (cp, halo, x, B, T_local, width, row_stride, rows, local_status)
gdn_cp_halo_forward = _proto("gdn_cp_halo_forward", c_int, c_void_p, P_float, P_float, c_int64,
                             c_int64, c_int64, c_int64, c_int64, c_int)
gdn_cp_halo_backward = _proto("gdn_cp_halo_backward", c_int, c_void_p, P_float, P_float, c_int64,
                              c_int64, c_int64, c_int64, c_int64, c_int)
gdn_cp_last_stats = _proto("gdn_cp_last_stats", CPStats, c_void_p)
gdn_cp_set_fault = _proto("gdn_cp_set_fault", None, c_void_p, c_int)
# The MPI library libgdncp.so was linked against (a dependency's symbol, found through its handle)
MPI_Get_library_version = _proto("MPI_Get_library_version", c_int, c_char_p, POINTER(c_int))
MPI_Initialized = _proto("MPI_Initialized", c_int, POINTER(c_int))


# The whole model (include/gdncp/train.h) and the sampler (include/gdncp/sample.h).

# The C type of a model token (every `tokens` pointer of gdn_model_*: `const gdn_token *`,
# typedef int32_t gdn_token): the one place Python names it; everything below derives from it
# (test_abi checks it against the library).
TOKEN_DTYPE = np.int32
c_token = np.ctypeslib.as_ctypes_type(np.dtype(TOKEN_DTYPE))
P_token = POINTER(c_token)
GDN_MODEL_MAX_LAYERS = 1024


class ModelConfig(ctypes.Structure):
    """gdn_model_config."""
    _fields_ = [("vocab", c_int64), ("E", c_int64), ("L", c_int64), ("I", c_int64),
                ("Hk", c_int64), ("Hv", c_int64), ("K", c_int64), ("V", c_int64), ("Kc", c_int64),
                ("eps", c_float), ("tie_embeddings", c_int),
                ("H", c_int64), ("Hkv", c_int64), ("d", c_int64), ("R", c_int64),
                ("rope_theta", c_double), ("max_position", c_int64),
                ("full_attention", c_ubyte * GDN_MODEL_MAX_LAYERS),
                ("n_experts", c_int64), ("top_k", c_int64), ("moe_I", c_int64), ("shared_I", c_int64),
                ("norm_topk", c_int), ("router_aux", c_int), ("router_aux_coef", c_double),
                ("moe", c_ubyte * GDN_MODEL_MAX_LAYERS)]


class ModelRun(ctypes.Structure):
    """gdn_model_run."""
    _fields_ = [("B", c_int64), ("T", c_int64), ("threads", c_int), ("recompute", c_int),
                ("check_finite", c_int), ("pack", c_int), ("attn_cp", c_int), ("compute", c_int)]


class Sampling(ctypes.Structure):
    """gdn_sampling."""
    _fields_ = [("temperature", c_double), ("top_k", c_int64), ("top_p", c_double)]


P_mcfg = POINTER(ModelConfig)
gdn_model_config_named = _proto("gdn_model_config_named", c_int, c_char_p, P_mcfg)
gdn_model_config_check = _proto("gdn_model_config_check", c_int, P_mcfg)
gdn_model_attn_layers = _proto("gdn_model_attn_layers", c_int64, P_mcfg)
gdn_model_moe_layers = _proto("gdn_model_moe_layers", c_int64, P_mcfg)
# the sparse MoE block: (N, E, n_experts, top_k, I, Is) -> config; its flat layout; plan; forward
# (plan, y, saved, x, w, stats, routing, routing_w); backward (plan, dx, dw, x, w, saved, dy, aux_dp)
P_moecfg = POINTER(MoeConfig)
GDN_MOE_COUNT = 7
gdn_moe_config_default = _proto("gdn_moe_config_default", MoeConfig, c_int64, c_int64, c_int64, c_int64,
                                c_int64, c_int64)
gdn_moe_param_offset = _proto("gdn_moe_param_offset", c_size_t, P_moecfg, c_int)
gdn_moe_param_numel = _proto("gdn_moe_param_numel", c_size_t, P_moecfg, c_int)
gdn_moe_param_floats = _proto("gdn_moe_param_floats", c_size_t, P_moecfg)
gdn_moe_plan_create = _proto("gdn_moe_plan_create", c_int, POINTER(c_void_p), P_moecfg)
gdn_moe_plan_destroy = _proto("gdn_moe_plan_destroy", None, c_void_p)
gdn_moe_plan_config = _proto("gdn_moe_plan_config", P_moecfg, c_void_p)
gdn_moe_saved_floats = _proto("gdn_moe_saved_floats", c_size_t, c_void_p)
gdn_moe_forward = _proto("gdn_moe_forward", c_int, c_void_p, P_float, P_float, P_float, P_float, P_double,
                         POINTER(ctypes.c_int32), P_float)
gdn_moe_backward = _proto("gdn_moe_backward", c_int, c_void_p, P_float, P_float, P_float, P_float, P_float,
                          P_float, P_float)
gdn_model_param_floats = _proto("gdn_model_param_floats", c_size_t, P_mcfg)
gdn_model_param_count = _proto("gdn_model_param_count", c_size_t, P_mcfg)
gdn_ckpt_resolve = _proto("gdn_ckpt_resolve", c_int, c_char_p, c_char_p, c_size_t)
gdn_ckpt_load_config = _proto("gdn_ckpt_load_config", c_int, c_char_p, P_mcfg)
# (dir, cfg, w, adam_m, adam_v, state_json)
gdn_ckpt_load = _proto("gdn_ckpt_load", c_int, c_char_p, P_mcfg, P_float, P_float, P_float,
                       POINTER(c_char_p))
gdn_ckpt_pack_separator = _proto("gdn_ckpt_pack_separator", c_int, c_char_p, POINTER(c_ubyte),
                                 c_int, POINTER(c_int))
# (plan, cfg, run, cp: NULL for one rank); (plan, w, tokens [B,T], logits [B,T,vocab])
gdn_model_plan_create = _proto("gdn_model_plan_create", c_int, POINTER(c_void_p), P_mcfg,
                               POINTER(ModelRun), c_void_p)
gdn_model_plan_destroy = _proto("gdn_model_plan_destroy", None, c_void_p)
gdn_model_logits = _proto("gdn_model_logits", c_int, c_void_p, P_float, P_token, P_float)
# (plan, w, tokens [B,T+1], denom, loss_sum out, for_backward); (plan, w, dw out, tokens)
gdn_model_forward = _proto("gdn_model_forward", c_int, c_void_p, P_float, P_token, c_double,
                           POINTER(c_double), c_int)
gdn_model_backward = _proto("gdn_model_backward", c_int, c_void_p, P_float, P_float, P_token)
# (plan, doc_cu, n_docs [B], seq_offset, targets out): packed documents before a forward
gdn_model_set_docs = _proto("gdn_model_set_docs", c_int, c_void_p, POINTER(c_int64), POINTER(c_int64),
                            c_int64, POINTER(c_int64))
# the MoE aux loss: (plan, stats out / in: 2 n_experts + 1 doubles); the aux of the plan's statistics
gdn_model_router_stats = _proto("gdn_model_router_stats", c_int, c_void_p, POINTER(c_double))
gdn_model_set_router_stats = _proto("gdn_model_set_router_stats", c_int, c_void_p, POINTER(c_double))
gdn_model_aux_loss = _proto("gdn_model_aux_loss", c_double, c_void_p)


class ModelTensorInfo(ctypes.Structure):
    """gdn_model_tensor_info."""
    _fields_ = [("name", ctypes.c_char * 96), ("ndim", c_int), ("shape", c_int64 * 3),
                ("offset", c_size_t), ("numel", c_size_t), ("decay", c_int)]


class AdamwConfig(ctypes.Structure):
    """gdn_adamw_config."""
    _fields_ = [("lr", c_double), ("min_lr", c_double), ("warmup", c_int64), ("steps", c_int64),
                ("beta1", c_double), ("beta2", c_double), ("eps", c_double),
                ("weight_decay", c_double), ("clip", c_double)]


gdn_adamw_default = _proto("gdn_adamw_default", AdamwConfig)
gdn_adamw_check = _proto("gdn_adamw_check", c_int, POINTER(AdamwConfig))
gdn_adamw_lr = _proto("gdn_adamw_lr", c_double, POINTER(AdamwConfig), c_int64)
# (cfg, model cfg, w, dw, m, v, step (1-based), lr, grad_scale, threads)
gdn_adamw_update = _proto("gdn_adamw_update", None, POINTER(AdamwConfig), P_mcfg, P_float, P_float,
                          P_float, P_float, c_int64, c_double, c_double, c_int)
# the Euclidean norm of a flat gradient over the model's tensors (padding excluded), in double
gdn_grad_norm = _proto("gdn_grad_norm", c_double, P_mcfg, P_float)
# FLOPs of a training step per token at T (6 x parameters + the mixers', the trainer's count)
gdn_model_train_flops_per_token = _proto("gdn_model_train_flops_per_token", c_double, P_mcfg, c_int64)
gdn_model_tensor_count = _proto("gdn_model_tensor_count", c_int, P_mcfg)
gdn_model_tensor = _proto("gdn_model_tensor", c_int, P_mcfg, c_int, POINTER(ModelTensorInfo))
# (dec, cfg, B, max_len, threads); prefill (dec, w, tokens [B,T], T, logits [B,T,vocab]);
# decode (dec, w, tokens [B], logits [B,vocab])
gdn_model_decoder_create = _proto("gdn_model_decoder_create", c_int, POINTER(c_void_p), P_mcfg,
                                  c_int64, c_int64, c_int)
gdn_model_decoder_create_dtype = _proto("gdn_model_decoder_create_dtype", c_int, POINTER(c_void_p),
                                        P_mcfg, c_int64, c_int64, c_int, c_int)
# (dec, compute): the prefill pieces' products in GDN_COMPUTE_FP32 (0) or GDN_COMPUTE_BF16 (1)
gdn_model_decoder_set_compute = _proto("gdn_model_decoder_set_compute", c_int, c_void_p, c_int)
gdn_model_decoder_destroy = _proto("gdn_model_decoder_destroy", None, c_void_p)
gdn_model_decoder_reset = _proto("gdn_model_decoder_reset", None, c_void_p)
gdn_model_decoder_length = _proto("gdn_model_decoder_length", c_int64, c_void_p)
gdn_model_prefill = _proto("gdn_model_prefill", c_int, c_void_p, P_float, P_token, c_int64, P_float)
# (dec, w, tokens [B, T], T, logits [B, vocab]: each sequence's last position only)
gdn_model_prefill_last = _proto("gdn_model_prefill_last", c_int, c_void_p, P_float, P_token, c_int64, P_float)
gdn_model_decode = _proto("gdn_model_decode", c_int, c_void_p, P_float, P_token, P_float)

gdn_sampling_default = _proto("gdn_sampling_default", Sampling)
gdn_sampling_check = _proto("gdn_sampling_check", c_int, POINTER(Sampling), c_int64)
gdn_sample_seed = _proto("gdn_sample_seed", c_uint64, c_uint64)
gdn_sample_work_floats = _proto("gdn_sample_work_floats", c_int64, POINTER(Sampling), c_int64)
# (token out, logits [vocab], vocab, settings, rng state in/out, work)
gdn_sample_next = _proto("gdn_sample_next", c_int, P_int64, P_float, c_int64, POINTER(Sampling),
                         POINTER(c_uint64), P_float)


class GdncpError(RuntimeError):
    """A failure reported by the C library; the message is gdn_errmsg()'s."""

    def __init__(self, what, status):
        detail = (gdn_errmsg() or b"").decode(errors="replace")
        short = (gdn_strerror(status) or b"").decode(errors="replace")
        super().__init__(f"{what}: {short}: {detail}")
        self.status = status


def check(status, what):
    """Raise for a non-zero gdn_status: shape and argument errors as ValueError (the user's
    inputs), everything else as GdncpError."""
    if status == GDN_OK:
        return
    err = GdncpError(what, status)
    if status in (1, 2, 3, 8):  # ARG, SHAPE, NONFINITE, DTYPE: the caller's values
        raise ValueError(str(err)) from None
    raise err


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
