/* The Qwen3.5 GatedDeltaNet layer in double precision with plain loops (DESIGN §5): the oracle
 * the fp32 layer is tested against. Hugging Face Qwen3_5GatedDeltaNet.forward without a cache
 * (zero conv and recurrent states); the gated delta rule itself is the double oracle
 * gdn_reference_forward / gdn_reference_backward. Every other term, forward and backward, is
 * written out here by hand. Deliberately plain: no blocking, no threads.
 * With cfg->compute = GDN_COMPUTE_BF16 it is the oracle of the BF16 mode: the operands of the
 * products that mode runs in bf16 (compute.h: in_proj_qkv, in_proj_z and out_proj, forward,
 * dx and dW) are rounded to bfloat16 (nearest even, from the double value), the rest exact. */
#include "layer_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double sigmoid_d(double x) { return 1.0 / (1.0 + exp(-x)); }
/* torch.nn.functional.softplus (beta 1, threshold 20): x itself above 20. */
static double softplus_d(double x) { return x > 20.0 ? x : log1p(exp(x)); }
/* The config's float eps as the decimal it was written as: the shortest decimal that rounds to
 * it (1e-6f -> 1e-6, not 9.99999997e-7). Hugging Face keeps rms_norm_eps as a Python float, so a
 * float64 run adds exactly 1e-6; with o of small magnitude (mean(o^2) ~ 1e-5) the float's
 * 2.5e-15 difference alone moves y by ~1e-10 relative. */
static double eps_decimal(float e) {
    char buf[32];
    for (int prec = 1; prec <= 9; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, (double)e);
        if (strtof(buf, NULL) == e) return strtod(buf, NULL);
    }
    return (double)e;
}
static double silu_d(double x) { return x * sigmoid_d(x); }
/* d silu / dx = s (1 + x (1 - s)), s = sigmoid(x). */
static double dsilu_d(double x) {
    const double s = sigmoid_d(x);
    return s * (1.0 + x * (1.0 - s));
}

/* Sizes and the forward's intermediates, kept for the backward. N = B*T token rows. */
typedef struct {
    int64_t B, T, E, Hk, Hv, K, V, Kc, N, cd, kd, vd;
    double eps;
    gdn_config kc;       /* the gated delta rule's config */
    double *qkv;         /* N x cd: x W_qkv^T (pre-conv) */
    double *u;           /* N x cd: the conv output (pre-SiLU) */
    double *z, *bp, *ap; /* N x vd, N x Hv, N x Hv: x W_z^T, x W_b^T, x W_a^T */
    double *q, *k, *v;   /* N x kd, N x kd, N x vd: the kernel's inputs */
    double *g, *beta;    /* N x Hv */
    double *o, *n;       /* N x vd: the kernel's output, the gated norm's output */
    double *mem;
} ref_fwd;

static void fwd_free(ref_fwd *f) { free(f->mem); }

static int fwd_alloc(ref_fwd *f, const gdn_layer_config *cfg) {
    memset(f, 0, sizeof *f);
    f->B = cfg->B, f->T = cfg->T, f->E = cfg->E, f->Hk = cfg->Hk, f->Hv = cfg->Hv;
    f->K = cfg->K, f->V = cfg->V, f->Kc = cfg->Kc, f->N = cfg->B * cfg->T;
    f->kd = cfg->Hk * cfg->K, f->vd = cfg->Hv * cfg->V, f->cd = gdn_layer_conv_dim(cfg);
    f->eps = eps_decimal(cfg->eps);
    f->kc = gdn_config_default(cfg->B, cfg->T, cfg->Hk, cfg->Hv, cfg->K, cfg->V);
    f->kc.l2norm = 1;
    f->kc.scale = GDN_SCALE_DEFAULT; /* 1/sqrt(K) */
    f->kc.threads = 1;
    f->kc.check_finite = cfg->check_finite;
    f->kc.chunk = cfg->chunk; f->kc.compute = cfg->compute; /* BF16: the kernel oracle of that mode (its chunk grid) */
    const size_t N = (size_t)f->N;
    const size_t per_row = 2 * (size_t)f->cd + 4 * (size_t)f->vd + 2 * (size_t)f->kd + 4 * (size_t)f->Hv;
    f->mem = gdn_malloc("layer_reference: f->mem", sizeof(double) * N * per_row);
    if (!f->mem)
        return gdn_fail(GDN_ERR_NOMEM, "layer reference intermediates (%zu doubles)", N * per_row);
    double *p = f->mem;
    f->qkv = p, p += N * f->cd;
    f->u = p, p += N * f->cd;
    f->z = p, p += N * f->vd;
    f->bp = p, p += N * f->Hv;
    f->ap = p, p += N * f->Hv;
    f->q = p, p += N * f->kd;
    f->k = p, p += N * f->kd;
    f->v = p, p += N * f->vd;
    f->g = p, p += N * f->Hv;
    f->beta = p, p += N * f->Hv;
    f->o = p, p += N * f->vd;
    f->n = p, p += N * f->vd;
    return GDN_OK;
}

/* Rejects NULL tensors and, with check_finite, NaN/Inf in x (or dy) and in every weight tensor
 * (padding between tensors is not read). */
static int check_f64(const gdn_layer_config *cfg, const double *t, const char *name, int64_t n) {
    if (!t) return gdn_fail(GDN_ERR_ARG, "layer reference: '%s' is NULL", name);
    if (cfg->check_finite) {
        const int64_t at = gdn_find_nonfinite_f64(t, n);
        if (at >= 0)
            return gdn_fail_nonfinite("layer reference: tensor", name, t[at], at);
    }
    return GDN_OK;
}

static int check_weights(const gdn_layer_config *cfg, const double *w) {
    if (!w) return gdn_fail(GDN_ERR_ARG, "layer reference: weights 'w' are NULL");
    for (int p = 0; p < GDN_P_COUNT; p++) {
        int rc = check_f64(cfg, w + gdn_layer_param_offset(cfg, p), gdn_layer_param_name(p),
                           (int64_t)gdn_layer_param_numel(cfg, p));
        if (rc) return rc;
    }
    return GDN_OK;
}

static inline double opnd(int bf, double v) { return gdn_ref_operand(bf, v); }

/* out[n, c] = sum_e W[c, e] in[n, e]  for c < C (W [C, E]); out has row stride C; bf: the
 * operands rounded to bf16 (rounded copies made once, so a large layer's oracle stays fast). */
static void linear(double *out, const double *in, const double *W, int64_t N, int64_t C, int64_t E, int bf) {
    double *ib = NULL, *wb = NULL;
    if (bf) {
        ib = gdn_malloc("layer_reference: ib", sizeof(double) * (size_t)(N * E)), wb = gdn_malloc("layer_reference: wb", sizeof(double) * (size_t)(C * E));
        GDN_ASSERT(ib && wb);
        for (int64_t i = 0; i < N * E; i++) ib[i] = opnd(1, in[i]);
        for (int64_t i = 0; i < C * E; i++) wb[i] = opnd(1, W[i]);
        in = ib, W = wb;
    }
    for (int64_t n = 0; n < N; n++)
        for (int64_t c = 0; c < C; c++) {
            double s = 0.0;
            for (int64_t e = 0; e < E; e++) s += W[c * E + e] * in[n * E + e];
            out[n * C + c] = s;
        }
    free(ib), free(wb);
}

/* The whole forward, keeping every intermediate in f; y may be NULL. */
static int forward_all(ref_fwd *f, double *y, const double *x, const double *w,
                       const gdn_layer_config *cfg) {
    const int64_t B = f->B, T = f->T, E = f->E, Hv = f->Hv, V = f->V, Kc = f->Kc, N = f->N;
    const int64_t cd = f->cd, kd = f->kd, vd = f->vd;
    const double *Wqkv = w + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_QKV);
    const double *Wz = w + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_Z);
    const double *Wb = w + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_B);
    const double *Wa = w + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_A);
    const double *Wc = w + gdn_layer_param_offset(cfg, GDN_P_CONV1D); /* [cd, 1, Kc] */
    const double *A_log = w + gdn_layer_param_offset(cfg, GDN_P_A_LOG);
    const double *dt_bias = w + gdn_layer_param_offset(cfg, GDN_P_DT_BIAS);
    const double *nw = w + gdn_layer_param_offset(cfg, GDN_P_NORM);
    const double *Wout = w + gdn_layer_param_offset(cfg, GDN_P_OUT_PROJ); /* [E, vd] */

    /* Projections. */
    const int bf = cfg->compute == GDN_COMPUTE_BF16; /* the gate projections b, a stay exact */
    linear(f->qkv, x, Wqkv, N, cd, E, bf);
    linear(f->z, x, Wz, N, vd, E, bf);
    linear(f->bp, x, Wb, N, Hv, E, 0);
    linear(f->ap, x, Wa, N, Hv, E, 0);

    /* Causal depthwise conv (rows before token 0 are zero), SiLU, split into q | k | v. */
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t row = b * T + t;
            for (int64_t c = 0; c < cd; c++) {
                double s = 0.0;
                for (int64_t j = 0; j < Kc; j++) {
                    const int64_t src = t - (Kc - 1) + j;
                    if (src >= 0) s += Wc[c * Kc + j] * f->qkv[(b * T + src) * cd + c];
                }
                f->u[row * cd + c] = s;
                const double act = silu_d(s);
                if (c < kd) f->q[row * kd + c] = act;
                else if (c < 2 * kd) f->k[row * kd + (c - kd)] = act;
                else f->v[row * vd + (c - 2 * kd)] = act;
            }
        }

    /* Gates. */
    for (int64_t row = 0; row < N; row++)
        for (int64_t h = 0; h < Hv; h++) {
            f->beta[row * Hv + h] = sigmoid_d(f->bp[row * Hv + h]);
            f->g[row * Hv + h] = -exp(A_log[h]) * softplus_d(f->ap[row * Hv + h] + dt_bias[h]);
        }

    /* The gated delta rule (L2 norm of q and k in the kernel, scale 1/sqrt(K), zero state). */
    const gdn_rule_inputs_f64 in = {.q = f->q, .k = f->k, .v = f->v, .g = f->g, .beta = f->beta};
    int rc = gdn_reference_forward(&f->kc, f->o, NULL, &in);
    if (rc) return rc;

    /* Gated RMSNorm per (token, value head) over V. */
    for (int64_t row = 0; row < N; row++)
        for (int64_t h = 0; h < Hv; h++) {
            const double *o = f->o + row * vd + h * V, *z = f->z + row * vd + h * V;
            double *n = f->n + row * vd + h * V;
            double ss = 0.0;
            for (int64_t i = 0; i < V; i++) ss += o[i] * o[i];
            const double r = 1.0 / sqrt(ss / (double)V + f->eps);
            for (int64_t i = 0; i < V; i++) n[i] = nw[i] * o[i] * r * silu_d(z[i]);
        }

    /* Output projection. */
    if (y) linear(y, f->n, Wout, N, E, vd, bf);
    return GDN_OK;
}

int gdn_layer_reference_forward(const gdn_layer_config *cfg, double *y, const double *x,
                                const double *w) {
    int rc = gdn_layer_config_check(cfg);
    if (rc) return rc;
    if (cfg->cu_seqlens) /* a packed layer equals its documents run one by one: compare with those */
        return gdn_fail(GDN_ERR_ARG, "layer reference: dense sequences only (cu_seqlens must be NULL)");
    if (!y) return gdn_fail(GDN_ERR_ARG, "layer reference: output 'y' is NULL");
    if ((rc = check_f64(cfg, x, "x", cfg->B * cfg->T * cfg->E))) return rc;
    if ((rc = check_weights(cfg, w))) return rc;
    ref_fwd f;
    if ((rc = fwd_alloc(&f, cfg))) return rc;
    rc = forward_all(&f, y, x, w, cfg);
    fwd_free(&f);
    return rc;
}

int gdn_layer_reference_backward(const gdn_layer_config *cfg, double *dx, double *dw,
                                 const double *x, const double *w, const double *dy) {
    int rc = gdn_layer_config_check(cfg);
    if (rc) return rc;
    if (cfg->cu_seqlens) /* a packed layer equals its documents run one by one: compare with those */
        return gdn_fail(GDN_ERR_ARG, "layer reference: dense sequences only (cu_seqlens must be NULL)");
    if (!dx) return gdn_fail(GDN_ERR_ARG, "layer reference: output 'dx' is NULL");
    if (!dw) return gdn_fail(GDN_ERR_ARG, "layer reference: output 'dw' is NULL");
    if ((rc = check_f64(cfg, x, "x", cfg->B * cfg->T * cfg->E))) return rc;
    if ((rc = check_f64(cfg, dy, "dy", cfg->B * cfg->T * cfg->E))) return rc;
    if ((rc = check_weights(cfg, w))) return rc;
    ref_fwd f;
    if ((rc = fwd_alloc(&f, cfg))) return rc;
    const int64_t B = f.B, T = f.T, E = f.E, Hv = f.Hv, V = f.V, Kc = f.Kc, N = f.N;
    const int64_t cd = f.cd, kd = f.kd, vd = f.vd;
    /* Gradient buffers: dproj = [dqkv (cd) | dz (vd) | db (Hv) | da (Hv)] per row, the gated
     * norm's input gradient do and output gradient dn, and the kernel's input gradients. */
    const int64_t P = cd + vd + 2 * Hv;
    const size_t nbuf = (size_t)N * (size_t)(P + 2 * vd + 2 * kd + vd + 2 * Hv);
    double *buf = gdn_malloc("layer_reference: buf", sizeof(double) * nbuf);
    if (!buf) {
        fwd_free(&f);
        return gdn_fail(GDN_ERR_NOMEM, "layer reference gradients (%zu doubles)", nbuf);
    }
    double *dproj = buf, *dn = dproj + N * P, *dout = dn + N * vd, *dq = dout + N * vd;
    double *dk = dq + N * kd, *dv = dk + N * kd, *dg = dv + N * vd, *dbeta = dg + N * Hv;
    if ((rc = forward_all(&f, NULL, x, w, cfg))) goto done;

    const double *Wqkv = w + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_QKV);
    const double *Wz = w + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_Z);
    const double *Wb = w + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_B);
    const double *Wa = w + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_A);
    const double *Wc = w + gdn_layer_param_offset(cfg, GDN_P_CONV1D);
    const double *A_log = w + gdn_layer_param_offset(cfg, GDN_P_A_LOG);
    const double *dt_bias = w + gdn_layer_param_offset(cfg, GDN_P_DT_BIAS);
    const double *nw = w + gdn_layer_param_offset(cfg, GDN_P_NORM);
    const double *Wout = w + gdn_layer_param_offset(cfg, GDN_P_OUT_PROJ);
    memset(dw, 0, sizeof(double) * gdn_layer_param_floats(cfg)); /* padding stays zero */
    double *dWqkv = dw + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_QKV);
    double *dWz = dw + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_Z);
    double *dWb = dw + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_B);
    double *dWa = dw + gdn_layer_param_offset(cfg, GDN_P_IN_PROJ_A);
    double *dWc = dw + gdn_layer_param_offset(cfg, GDN_P_CONV1D);
    double *dA_log = dw + gdn_layer_param_offset(cfg, GDN_P_A_LOG);
    double *ddt_bias = dw + gdn_layer_param_offset(cfg, GDN_P_DT_BIAS);
    double *dnw = dw + gdn_layer_param_offset(cfg, GDN_P_NORM);
    double *dWout = dw + gdn_layer_param_offset(cfg, GDN_P_OUT_PROJ);

    /* y = n W_out^T: dn = dy W_out, dW_out[e, c] = sum_rows dy[e] n[c]. */
    const int bf = cfg->compute == GDN_COMPUTE_BF16;
    for (int64_t row = 0; row < N; row++) {
        const double *dyr = dy + row * E, *nr = f.n + row * vd;
        for (int64_t c = 0; c < vd; c++) {
            double s = 0.0;
            for (int64_t e = 0; e < E; e++) s += opnd(bf, dyr[e]) * opnd(bf, Wout[e * vd + c]);
            dn[row * vd + c] = s;
        }
        for (int64_t e = 0; e < E; e++)
            for (int64_t c = 0; c < vd; c++) dWout[e * vd + c] += opnd(bf, dyr[e]) * opnd(bf, nr[c]);
    }

    /* Gated RMSNorm: n_i = w_i o_i r silu(z_i), r = (mean(o^2) + eps)^-1/2. With
     * a_i = dn_i w_i silu(z_i): do_j = r a_j - (r^3 / V) o_j sum_i a_i o_i;
     * dw_i += dn_i o_i r silu(z_i); dz_i = dn_i w_i o_i r silu'(z_i). */
    for (int64_t row = 0; row < N; row++)
        for (int64_t h = 0; h < Hv; h++) {
            const int64_t at = row * vd + h * V;
            const double *o = f.o + at, *z = f.z + at, *dnv = dn + at;
            double *dov = dout + at, *dz = dproj + row * P + cd + h * V;
            double ss = 0.0;
            for (int64_t i = 0; i < V; i++) ss += o[i] * o[i];
            const double r = 1.0 / sqrt(ss / (double)V + f.eps);
            double ao = 0.0;
            for (int64_t i = 0; i < V; i++) ao += dnv[i] * nw[i] * silu_d(z[i]) * o[i];
            for (int64_t i = 0; i < V; i++) {
                const double sz = silu_d(z[i]);
                dov[i] = r * dnv[i] * nw[i] * sz - r * r * r / (double)V * o[i] * ao;
                dnw[i] += dnv[i] * o[i] * r * sz;
                dz[i] = dnv[i] * nw[i] * o[i] * r * dsilu_d(z[i]);
            }
        }

    /* The gated delta rule's backward (gradients w.r.t. the un-normalised q, k). */
    const gdn_rule_grads_f64 gr = {.dq = dq, .dk = dk, .dv = dv, .dg = dg, .dbeta = dbeta};
    const gdn_rule_inputs_f64 in = {.q = f.q, .k = f.k, .v = f.v, .g = f.g, .beta = f.beta};
    rc = gdn_reference_backward(&f.kc, &gr, &in, dout, NULL);
    if (rc) goto done;

    /* Gates: beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias). */
    for (int64_t row = 0; row < N; row++)
        for (int64_t h = 0; h < Hv; h++) {
            const double bt = f.beta[row * Hv + h], dgv = dg[row * Hv + h];
            dproj[row * P + cd + vd + h] = dbeta[row * Hv + h] * bt * (1.0 - bt);
            dA_log[h] += dgv * f.g[row * Hv + h];
            const double pre = f.ap[row * Hv + h] + dt_bias[h];
            /* torch's softplus backward: 1 above the threshold, sigmoid below. */
            const double dsp = pre > 20.0 ? 1.0 : sigmoid_d(pre);
            const double dpre = dgv * -exp(A_log[h]) * dsp;
            dproj[row * P + cd + vd + Hv + h] = dpre;
            ddt_bias[h] += dpre;
        }

    /* SiLU and the causal conv: du = dact silu'(u); dW_c[c, j] += du_t[c] qkv_{t-(Kc-1)+j}[c];
     * dqkv_{t-(Kc-1)+j}[c] += du_t[c] W_c[c, j] for source rows >= 0 (the zero halo before
     * token 0 takes no gradient). dqkv accumulates in dproj's first cd columns. */
    for (int64_t row = 0; row < N; row++)
        for (int64_t c = 0; c < cd; c++) dproj[row * P + c] = 0.0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t row = b * T + t;
            for (int64_t c = 0; c < cd; c++) {
                const double dact = c < kd       ? dq[row * kd + c]
                                    : c < 2 * kd ? dk[row * kd + (c - kd)]
                                                 : dv[row * vd + (c - 2 * kd)];
                const double du = dact * dsilu_d(f.u[row * cd + c]);
                for (int64_t j = 0; j < Kc; j++) {
                    const int64_t src = t - (Kc - 1) + j;
                    if (src < 0) continue;
                    dWc[c * Kc + j] += du * f.qkv[(b * T + src) * cd + c];
                    dproj[(b * T + src) * P + c] += du * Wc[c * Kc + j];
                }
            }
        }

    /* Projections: dW[c, e] = sum_rows dproj[c] x[e]; dx = sum_c dproj[c] W[c, :]. */
    {
        const double *Ws[4] = {Wqkv, Wz, Wb, Wa};
        double *dWs[4] = {dWqkv, dWz, dWb, dWa};
        const int64_t cols[4] = {cd, vd, Hv, Hv};
        memset(dx, 0, sizeof(double) * (size_t)N * (size_t)E);
        for (int64_t row = 0; row < N; row++) {
            const double *xr = x + row * E;
            double *dxr = dx + row * E;
            int64_t off = 0;
            for (int m = 0; m < 4; m++) {
                const int bm = bf && m < 2; /* qkv and z in bf16; the gate projections exact */
                for (int64_t c = 0; c < cols[m]; c++) {
                    const double d = opnd(bm, dproj[row * P + off + c]);
                    for (int64_t e = 0; e < E; e++) {
                        dWs[m][c * E + e] += d * opnd(bm, xr[e]);
                        dxr[e] += d * opnd(bm, Ws[m][c * E + e]);
                    }
                }
                off += cols[m];
            }
        }
    }
    rc = GDN_OK;
done:
    free(buf);
    fwd_free(&f);
    return rc;
}
