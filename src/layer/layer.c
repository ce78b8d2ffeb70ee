/* The Qwen3.5 GatedDeltaNet layer in fp32 (DESIGN §5): plan, forward, backward, decode.
 * The four input projections and out_proj are large GEMMs (gdn_matmul_compute: fp32, or bf16
 * operands for in_proj_qkv, in_proj_z and out_proj under cfg.compute); the conv, the gates
 * and the gated norm are row-local loops; the gated delta rule is the kernel's plan. */
#include "layer_internal.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------- plan */

static size_t saved_floats(const gdn_layer_plan *lp) {
    const gdn_layer_config *c = &lp->cfg;
    size_t n = (size_t)c->B * (c->Kc - 1) * lp->cd + (size_t)c->B * c->Hv * c->K * c->V;
    if (c->keep == GDN_LAYER_KEEP_PROJ)
        n += lp->ckpt_floats + (size_t)lp->N * lp->P + (size_t)lp->N * lp->vd;
    return n;
}

gdn_layer_saved gdn_layer_saved_view(const gdn_layer_plan *lp, float *saved) {
    const gdn_layer_config *c = &lp->cfg;
    gdn_layer_saved s = {0};
    if (!saved) return s;
    s.halo = saved;
    s.h0 = s.halo + (size_t)c->B * (c->Kc - 1) * lp->cd;
    if (c->keep == GDN_LAYER_KEEP_PROJ) {
        s.ckpt = s.h0 + (size_t)c->B * c->Hv * c->K * c->V;
        s.proj = s.ckpt + lp->ckpt_floats;
        s.o = s.proj + (size_t)lp->N * lp->P;
    }
    return s;
}

int gdn_layer_plan_describe(const gdn_layer_plan *lp, gdn_layer_plan_info *info) {
    if (!info) return gdn_fail(GDN_ERR_ARG, "gdn_layer_plan_describe: info is NULL");
    memset(info, 0, sizeof *info);
    if (!lp) return gdn_fail(GDN_ERR_ARG, "gdn_layer_plan_describe: the plan is NULL");
    info->config = &lp->cfg;
    info->path = gdn_compute_path(lp->cfg.compute);
    info->saved_floats = saved_floats(lp);
    return GDN_OK;
}

void gdn_layer_plan_destroy(gdn_layer_plan *lp) {
    if (!lp) return;
    gdn_plan_destroy(lp->kplan);
    free(lp->doc_begin);
    free(lp->arena);
    free(lp);
}

/* The kernel plan holds the checked copy of the offsets; doc_begin[t]: the local index of the
 * first token of token t's document, clamped to the halo (-(Kc-1)): the conv reads no earlier. */
static void set_doc_begin(gdn_layer_plan *lp) {
    gdn_layer_config *c = &lp->cfg;
    const gdn_config *kc = gdn_plan_config(lp->kplan);
    const int64_t *cu = kc->cu_seqlens;
    c->cu_seqlens = cu, c->n_docs = kc->n_docs, c->seq_offset = kc->seq_offset;
    int64_t d = 0;
    for (int64_t t = 0; t < c->T; t++) {
        while (cu[d + 1] <= c->seq_offset + t) d++;
        const int64_t begin = cu[d] - c->seq_offset;
        lp->doc_begin[t] = begin > -(c->Kc - 1) ? begin : -(c->Kc - 1);
    }
}

int gdn_layer_plan_set_docs(gdn_layer_plan *lp, const int64_t *cu_seqlens, int64_t n_docs,
                            int64_t seq_offset) {
    if (!lp) return gdn_fail(GDN_ERR_ARG, "gdn_layer_plan_set_docs: plan is NULL");
    int rc = gdn_plan_set_docs(lp->kplan, cu_seqlens, n_docs, seq_offset);
    if (rc) return rc;
    set_doc_begin(lp);
    return GDN_OK;
}

int gdn_layer_plan_create(gdn_layer_plan **out, const gdn_layer_config *cfg) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "layer plan output pointer is NULL");
    *out = NULL;
    int rc = gdn_isa_check();
    if (rc || (rc = gdn_layer_config_check(cfg))) return rc;
    gdn_layer_plan *lp = gdn_calloc("layer: lp", 1, sizeof *lp);
    if (!lp) return gdn_fail(GDN_ERR_NOMEM, "layer plan");
    lp->cfg = *cfg;
    gdn_layer_config *c = &lp->cfg;
    if (c->chunk == 0) c->chunk = 64;
#ifdef _OPENMP
    lp->threads = c->threads > 0 ? c->threads : omp_get_max_threads();
#else
    lp->threads = 1;
#endif
    c->threads = lp->threads;
    lp->N = c->B * c->T, lp->kd = c->Hk * c->K, lp->vd = c->Hv * c->V;
    lp->cd = gdn_layer_conv_dim(c), lp->P = lp->cd + lp->vd + 2 * c->Hv;
    for (int i = 0; i <= GDN_P_COUNT; i++) lp->param_off[i] = gdn_layer_param_offset(c, i);
    gdn_config kc = gdn_config_default(c->B, c->T, c->Hk, c->Hv, c->K, c->V);
    kc.chunk = c->chunk, kc.threads = lp->threads, kc.check_finite = c->check_finite;
    kc.cu_seqlens = c->cu_seqlens, kc.n_docs = c->n_docs, kc.seq_offset = c->seq_offset;
    kc.compute = c->compute; /* the chunk products of its forward sweep too */
    kc.cp = c->cp;
    if ((rc = gdn_plan_create(&lp->kplan, &kc))) { /* it also checks the offsets */
        free(lp);
        return rc;
    }
    if (c->cu_seqlens) {
        lp->doc_begin = gdn_malloc("layer: lp->doc_begin", sizeof(int64_t) * (size_t)c->T);
        if (!lp->doc_begin) {
            gdn_layer_plan_destroy(lp);
            return gdn_fail(GDN_ERR_NOMEM, "layer document starts (%lld tokens)", (long long)c->T);
        }
        set_doc_begin(lp);
    }
    lp->ckpt_floats = gdn_plan_checkpoint_floats(lp->kplan);
    const size_t N = (size_t)lp->N, P = (size_t)lp->P, vd = (size_t)lp->vd, kd = (size_t)lp->kd,
                 Hv = (size_t)c->Hv, halo = (size_t)c->B * (c->Kc - 1) * lp->cd;
    const size_t red = (size_t)c->Kc * lp->cd + c->V + 2 * Hv;
    const size_t pieces[] = {
        N * P, N * P,                               /* proj dproj */
        N * kd, N * kd, N * vd, N * Hv, N * Hv,     /* q k v g beta */
        N * kd, N * kd, N * vd, N * Hv, N * Hv,     /* dq dk dv dg dbeta */
        N * vd, N * vd, lp->ckpt_floats,            /* o nrm ckpt */
        halo, halo, (size_t)c->Kc * lp->cd,         /* halo dhalo convw */
        (size_t)lp->threads * red, gdn_matmul_compute_ws_floats(c->compute, lp->threads),
        gdn_layer_param_offset(c, GDN_P_OUT_PROJ) - gdn_layer_param_offset(c, GDN_P_CONV1D), /* wsmall */
    };
    double need = 0;
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) need += (double)pieces[i] + 15;
    char what[160];
    snprintf(what, sizeof what, "the layer's workspace for B*T = %lld tokens (%.1f KB per token)", (long long)N,
             4.0 * need / 1e3 / (double)N);
    if ((rc = gdn_check_fits(what, 4.0 * need))) {
        gdn_layer_plan_destroy(lp);
        return rc;
    }
    size_t total = 0;
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) total += (pieces[i] + 15) & ~(size_t)15;
    lp->arena = gdn_alloc_aligned("layer: lp->arena", total * sizeof(float));
    if (!lp->arena) {
        gdn_layer_plan_destroy(lp);
        return gdn_fail(GDN_ERR_NOMEM, "layer workspace: %.1f MB for B*T = %lld tokens (%.1f KB per token)",
                        total * 4.0 / 1e6, (long long)N, total * 4.0 / 1e3 / (double)N);
    }
    float *cur = lp->arena;
    float **dst[] = {&lp->proj, &lp->dproj, &lp->q, &lp->k, &lp->v, &lp->g, &lp->beta,
                     &lp->dq, &lp->dk, &lp->dv, &lp->dg, &lp->dbeta, &lp->o, &lp->nrm, &lp->ckpt,
                     &lp->halo, &lp->dhalo, &lp->convw, &lp->partial, &lp->mm_ws, &lp->wsmall};
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) *dst[i] = gdn_carve(&cur, pieces[i]);
    *out = lp;
    return GDN_OK;
}

/* ---------------------------------------------------------------- forward phases */

/* out = sigmoid(x), a vector at a time. */
static void sigmoid_rows(float *out, const float *x, int64_t n) {
    int64_t i = 0;
    for (; i + GDN_VL <= n; i += GDN_VL) gdn_vstoreu(out + i, gdn_vsigmoidf(gdn_vloadu(x + i)));
    for (; i < n; i++) out[i] = gdn_sigmoidf(x[i]);
}

/* x = x sigmoid(x) in place (the conv's SiLU, forward and decode) */
static void silu_rows(float *x, int64_t n) {
    float sg[256];
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
        const int64_t m = n - i0 < 256 ? n - i0 : 256;
        sigmoid_rows(sg, x + i0, m);
        for (int64_t i = 0; i < m; i++) x[i0 + i] *= sg[i];
    }
}

/* A parameter tensor of w. With BF16 weights the projections are read as BF16 by the GEMM
 * (pass the flags of wflags()), the small tensors from their fp32 copies in lp->wsmall. */
static int is_small(int which) {
    return which == GDN_P_CONV1D || which == GDN_P_A_LOG || which == GDN_P_DT_BIAS || which == GDN_P_NORM;
}
static const float *param(const gdn_layer_plan *lp, const void *w, int which) {
    const size_t off = lp->param_off[which];
    if (lp->cfg.weight_dtype != GDN_BF16) return (const float *)w + off;
    if (is_small(which)) return lp->wsmall + (off - lp->param_off[GDN_P_CONV1D]);
    return (const float *)((const uint16_t *)w + off); /* read as BF16 under GDN_GEMM_B_BF16 */
}
static int wflags(const gdn_layer_plan *lp) {
    return GDN_GEMM_B_TRANS | (lp->cfg.weight_dtype == GDN_BF16 ? GDN_GEMM_B_BF16 : 0);
}

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* BF16 weights: the small tensors (conv taps, A_log, dt_bias, norm: contiguous in the flat
 * layout) to fp32 once per call, and NaN/Inf anywhere found on the BF16 bits. */
int gdn_layer_weights_prepare(gdn_layer_plan *lp, const void *w, int check) {
    if (lp->cfg.weight_dtype != GDN_BF16) return GDN_OK;
    const gdn_layer_config *c = &lp->cfg;
    const uint16_t *h = w;
    const size_t lo = gdn_layer_param_offset(c, GDN_P_CONV1D), hi = gdn_layer_param_offset(c, GDN_P_OUT_PROJ);
    for (size_t i = lo; i < hi; i++) lp->wsmall[i - lo] = bf16_to_f32(h[i]);
    for (int i = 0; check && i < GDN_P_COUNT; i++) {
        const uint16_t *p = h + gdn_layer_param_offset(c, i);
        const size_t n = gdn_layer_param_numel(c, i);
        uint16_t all = 0; /* exponent all ones: Inf or NaN */
        for (size_t j = 0; j < n; j++) all |= (uint16_t)((p[j] & 0x7F80) == 0x7F80);
        if (all)
            for (size_t j = 0; j < n; j++)
                if ((p[j] & 0x7F80) == 0x7F80)
                    return gdn_fail_nonfinite("weight", gdn_layer_param_name(i), (double)bf16_to_f32(p[j]), (int64_t)j);
    }
    return GDN_OK;
}

/* The four input projections: their parameter, their columns of a projection row and their
 * compute precision (the gate projections b and a stay fp32: compute.h). */
typedef struct { int which; int64_t col, n; int compute; } proj_part;
static void proj_parts(const gdn_layer_plan *lp, proj_part parts[4]) {
    const int64_t Hv = lp->cfg.Hv;
    const int cm = lp->cfg.compute;
    parts[0] = (proj_part){GDN_P_IN_PROJ_QKV, 0, lp->cd, cm};
    parts[1] = (proj_part){GDN_P_IN_PROJ_Z, lp->cd, lp->vd, cm};
    parts[2] = (proj_part){GDN_P_IN_PROJ_B, lp->cd + lp->vd, Hv, GDN_COMPUTE_FP32};
    parts[3] = (proj_part){GDN_P_IN_PROJ_A, lp->cd + lp->vd + Hv, Hv, GDN_COMPUTE_FP32};
}

void gdn_layer_project(gdn_layer_plan *lp, int64_t rows, float *proj, const float *x, const void *w) {
    const int64_t E = lp->cfg.E, P = lp->P;
    const int t = lp->threads, bt = wflags(lp);
    proj_part parts[4];
    proj_parts(lp, parts);
    for (int i = 0; i < 4; i++)
        gdn_matmul_compute(parts[i].compute, bt, rows, parts[i].n, E, x, E, param(lp, w, parts[i].which), E,
                           proj + parts[i].col, P, lp->mm_ws, t);
}

/* convw[j][c] = conv1d.weight[c][0][j]: taps channel-contiguous for the vector loops. */
static void transpose_conv(gdn_layer_plan *lp, const void *w) {
    const float *cw = param(lp, w, GDN_P_CONV1D);
    const int64_t Kc = lp->cfg.Kc;
    for (int64_t c = 0; c < lp->cd; c++)
        for (int64_t j = 0; j < Kc; j++) lp->convw[j * lp->cd + c] = cw[c * Kc + j];
}

/* Pre-conv row t' of batch row b: the projections for t' >= 0, the halo for -(Kc-1) <= t' < 0. */
static inline const float *pre_row(const gdn_layer_plan *lp, const float *proj, const float *halo,
                                   int64_t b, int64_t t) {
    const int64_t Kc = lp->cfg.Kc;
    return t >= 0 ? proj + (b * lp->cfg.T + t) * lp->P
                  : halo + (b * (Kc - 1) + (Kc - 1) + t) * lp->cd;
}

/* The post-activation destination of channels [0, cd): q, k or v, as (buffer, row width, first channel). */
typedef struct { float *buf; int64_t width, c0; } channel_block;
static void channel_blocks(const gdn_layer_plan *lp, float *q, float *k, float *v, channel_block out[3]) {
    out[0] = (channel_block){q, lp->kd, 0};
    out[1] = (channel_block){k, lp->kd, lp->kd};
    out[2] = (channel_block){v, lp->vd, 2 * lp->kd};
}

/* u[c] = sum_j convw[j][c] * pre(t - (Kc-1) + j)[c] for channels [c0, c0 + n). */
static inline void conv_row(const gdn_layer_plan *lp, const float *proj, const float *halo,
                            int64_t b, int64_t t, int64_t c0, int64_t n, float *u) {
    const int64_t Kc = lp->cfg.Kc;
    for (int64_t i = 0; i < n; i++) u[i] = 0.0f;
    for (int64_t j = 0; j < Kc; j++) {
        if (!gdn_layer_tap_ok(lp, t, t - (Kc - 1) + j)) continue; /* before t's document */
        const float *src = pre_row(lp, proj, halo, b, t - (Kc - 1) + j) + c0;
        const float *wj = lp->convw + j * lp->cd + c0;
        for (int64_t i = 0; i < n; i++) u[i] += wj[i] * src[i];
    }
}

void gdn_layer_conv_gates(gdn_layer_plan *lp, const float *proj, const float *halo, const void *w) {
    const gdn_layer_config *c = &lp->cfg;
    const int64_t T = c->T, Hv = c->Hv;
    const float *A_log = param(lp, w, GDN_P_A_LOG), *dt_bias = param(lp, w, GDN_P_DT_BIAS);
    transpose_conv(lp, w);
    channel_block blk[3];
    channel_blocks(lp, lp->q, lp->k, lp->v, blk);
#pragma omp parallel for schedule(static) num_threads(lp->threads)
    for (int64_t row = 0; row < lp->N; row++) {
        const int64_t b = row / T, t = row % T;
        for (int s = 0; s < 3; s++) {
            float *dst = blk[s].buf + row * blk[s].width;
            conv_row(lp, proj, halo, b, t, blk[s].c0, blk[s].width, dst);
            silu_rows(dst, blk[s].width);
        }
        const float *pb = proj + row * lp->P + lp->cd + lp->vd, *pa = pb + Hv;
        for (int64_t h = 0; h < Hv; h++) {
            /* HF: g = -A_log.float().exp() * softplus(a.float() + dt_bias), beta = sigmoid(b) */
            lp->beta[row * Hv + h] = gdn_sigmoidf(pb[h]);
            lp->g[row * Hv + h] = -__builtin_expf(A_log[h]) * gdn_softplusf(pa[h] + dt_bias[h]);
        }
    }
}

/* Gated RMSNorm per (row, value head): nrm = w * o / sqrt(mean(o^2) + eps) * silu(z). */
typedef struct {
    gdn_layer_plan *lp;
    const float *o, *proj, *nw;
} norm_job;

static void norm_rows(void *p, int64_t lo, int64_t hi) {
    const norm_job *j = p;
    const gdn_layer_plan *lp = j->lp;
    const int64_t V = lp->cfg.V, Hv = lp->cfg.Hv;
    const float eps = lp->cfg.eps;
    for (int64_t row = lo; row < hi; row++)
        for (int64_t h = 0; h < Hv; h++) {
            const float *oh = j->o + row * lp->vd + h * V, *zh = j->proj + row * lp->P + lp->cd + h * V;
            float *nh = lp->nrm + row * lp->vd + h * V;
            const float r = 1.0f / sqrtf(gdn_sumsq(oh, V) / (float)V + eps);
            float sz[GDN_MAX_HEAD_DIM];
            sigmoid_rows(sz, zh, V);
            for (int64_t i = 0; i < V; i++) nh[i] = j->nw[i] * (oh[i] * r) * (zh[i] * sz[i]);
        }
}

void gdn_layer_norm(gdn_layer_plan *lp, int64_t rows, const float *o, const float *proj,
                    const void *w) {
    norm_job j = {lp, o, proj, param(lp, w, GDN_P_NORM)};
    gdn_parallel_range(lp->threads, rows, norm_rows, &j);
}

void gdn_layer_out(gdn_layer_plan *lp, int64_t rows, float *y, const void *w) {
    gdn_matmul_compute(lp->cfg.compute, wflags(lp), rows, lp->cfg.E, lp->vd, lp->nrm, lp->vd,
                       param(lp, w, GDN_P_OUT_PROJ), lp->vd, y, lp->cfg.E, lp->mm_ws, lp->threads);
}

int gdn_layer_check_inputs(gdn_layer_plan *lp, const float *x, const char *xname, const void *w) {
    if (!lp) return gdn_fail(GDN_ERR_ARG, "layer plan is NULL");
    int rc;
    if ((rc = gdn_check_tensor(xname, x, lp->N * lp->cfg.E, lp->cfg.check_finite, lp->threads))) return rc;
    if (!w) return gdn_fail(GDN_ERR_ARG, "layer weights are NULL");
    if (lp->cfg.weight_dtype == GDN_BF16) return gdn_layer_weights_prepare(lp, w, lp->cfg.check_finite);
    if (lp->cfg.check_finite)
        for (int i = 0; i < GDN_P_COUNT; i++) {
            const float *p = param(lp, w, i);
            const int64_t at = gdn_find_nonfinite_f32(p, (int64_t)gdn_layer_param_numel(&lp->cfg, i), lp->threads);
            if (at >= 0)
                return gdn_fail_nonfinite("weight", gdn_layer_param_name(i), (double)p[at], at);
        }
    return GDN_OK;
}

/* Training keeps fp32 weights: the backward refuses BF16 ones. */
int gdn_layer_check_trainable(const gdn_layer_plan *lp) {
    if (lp && lp->cfg.weight_dtype == GDN_BF16)
        return gdn_fail(GDN_ERR_DTYPE, "the layer backward needs F32 weights (cfg.weight_dtype is BF16: "
                                       "BF16 weights are for inference)");
    return GDN_OK;
}

/* halo[b][i][c] = conv_state[b][c][1 + i]: the newest Kc-1 columns are the rows before token 0. */
static void halo_from_conv_state(gdn_layer_plan *lp, const float *conv_state) {
    const int64_t Kc = lp->cfg.Kc, cd = lp->cd;
    for (int64_t b = 0; b < lp->cfg.B; b++)
        for (int64_t i = 0; i < Kc - 1; i++)
            for (int64_t c = 0; c < cd; c++)
                lp->halo[(b * (Kc - 1) + i) * cd + c] =
                    conv_state ? conv_state[(b * cd + c) * Kc + 1 + i] : 0.0f;
}

/* conv_state[b][c][j] = pre-conv row T - Kc + j (the last Kc rows, newest last). */
static void conv_state_from_rows(const gdn_layer_plan *lp, float *conv_state, const float *proj,
                                 const float *halo) {
    const int64_t Kc = lp->cfg.Kc, cd = lp->cd, T = lp->cfg.T;
    for (int64_t b = 0; b < lp->cfg.B; b++)
        for (int64_t j = 0; j < Kc; j++) {
            const int64_t t = T - Kc + j;
            if (t < -(Kc - 1)) { /* older than the halo: the column that was the oldest stays */
                continue;
            }
            const float *src = pre_row(lp, proj, halo, b, t);
            for (int64_t c = 0; c < cd; c++) conv_state[(b * cd + c) * Kc + j] = src[c];
        }
}

/* Packed: conv_state[d][c][j] = pre-conv row end_d - Kc + j of document d (zeros before its start). */
static void conv_state_from_docs(const gdn_layer_plan *lp, float *conv_state, const float *proj) {
    const gdn_layer_config *c = &lp->cfg;
    const int64_t Kc = c->Kc, cd = lp->cd;
    for (int64_t d = 0; d < c->n_docs; d++)
        for (int64_t j = 0; j < Kc; j++) {
            const int64_t t = c->cu_seqlens[d + 1] - Kc + j;
            const float *src = t >= c->cu_seqlens[d] ? pre_row(lp, proj, NULL, 0, t) : NULL;
            for (int64_t ch = 0; ch < cd; ch++) conv_state[(d * cd + ch) * Kc + j] = src ? src[ch] : 0.0f;
        }
}

/* Packed caches: per document, zeros on entry (documents start from zero states). */
static int packed_caches_check(const gdn_layer_plan *lp, const float *conv_state, const float *rec_state) {
    const gdn_layer_config *c = &lp->cfg;
    const int64_t n[2] = {c->n_docs * lp->cd * c->Kc, c->n_docs * c->Hv * c->K * c->V};
    const float *x[2] = {conv_state, rec_state};
    static const char *const name[2] = {"conv_state", "rec_state"};
    for (int i = 0; i < 2; i++) {
        if (!x[i]) continue;
        int rc = gdn_check_tensor(name[i], x[i], n[i], c->check_finite, lp->threads);
        if (rc) return rc;
        for (int64_t e = 0; e < n[i]; e++)
            if (x[i][e] != 0.0f)
                return gdn_fail(GDN_ERR_ARG, "a packed layer call (cu_seqlens) starts every document from zero "
                                "states, but %s[%lld] = %g: pass zeroed [n_docs, ...] buffers, which receive each "
                                "document's final state", name[i], (long long)e, (double)x[i][e]);
    }
    return GDN_OK;
}

int gdn_layer_forward(gdn_layer_plan *lp, float *y, float *saved, const float *x, const void *w,
                      float *conv_state, float *rec_state) {
    int rc;
    if ((rc = gdn_layer_check_inputs(lp, x, "x", w))) return rc;
    if (!y) return gdn_fail(GDN_ERR_ARG, "layer output 'y' is NULL");
    const gdn_layer_config *c = &lp->cfg;
    const size_t state_n = (size_t)c->B * c->Hv * c->K * c->V;
    const int packed = c->cu_seqlens != NULL;
    if (packed && (rc = packed_caches_check(lp, conv_state, rec_state))) return rc;
    if (!packed && conv_state &&
        (rc = gdn_check_tensor("conv_state", conv_state, c->B * lp->cd * c->Kc, c->check_finite, lp->threads)))
        return rc;
    if (!packed && rec_state && (rc = gdn_check_tensor("rec_state", rec_state, (int64_t)state_n, c->check_finite, lp->threads)))
        return rc;
    gdn_layer_saved sv = gdn_layer_saved_view(lp, saved);
    float *proj = sv.proj ? sv.proj : lp->proj, *o = sv.o ? sv.o : lp->o;
    float *ckpt = sv.ckpt ? sv.ckpt : lp->ckpt;
    halo_from_conv_state(lp, packed ? NULL : conv_state);
    if (sv.halo) {
        memcpy(sv.halo, lp->halo, sizeof(float) * c->B * (c->Kc - 1) * lp->cd);
        if (rec_state && !packed) memcpy(sv.h0, rec_state, sizeof(float) * state_n);
        else memset(sv.h0, 0, sizeof(float) * state_n);
    }
    gdn_layer_project(lp, lp->N, proj, x, w); /* straight into saved with KEEP_PROJ */
    gdn_layer_conv_gates(lp, proj, lp->halo, w);
    /* The recurrent state is updated in place: the kernel reads h0 before writing ht per head
     * (packed: h0 zeros, ht per document). */
    const gdn_rule_inputs in = gdn_layer_rule_inputs(lp, packed ? NULL : rec_state);
    rc = gdn_forward_save(lp->kplan, o, rec_state, ckpt, &in);
    if (rc) return rc;
    if (conv_state && packed) conv_state_from_docs(lp, conv_state, proj);
    else if (conv_state) conv_state_from_rows(lp, conv_state, proj, lp->halo);
    gdn_layer_norm(lp, lp->N, o, proj, w);
    gdn_layer_out(lp, lp->N, y, w);
    return GDN_OK;
}

/* ---------------------------------------------------------------- backward */

/* Sum the threads' partial reductions (rows [0, n) of each thread's block) into dst. */
static void reduce_partials(const gdn_layer_plan *lp, float *dst, size_t off, size_t n) {
    const size_t stride = (size_t)lp->cfg.Kc * lp->cd + lp->cfg.V + 2 * lp->cfg.Hv;
    for (size_t i = 0; i < n; i++) {
        float s = 0.0f;
        for (int t = 0; t < lp->threads; t++) s += lp->partial[t * stride + off + i];
        dst[i] = s;
    }
}

/* The gated norm's backward: dn (in lp->nrm) -> do (in place), dz into dproj, d norm.weight. */
static void norm_backward(gdn_layer_plan *lp, float *dw, const float *o, const float *proj,
                          const float *w) {
    const int64_t V = lp->cfg.V, Hv = lp->cfg.Hv;
    const float *nw = param(lp, w, GDN_P_NORM), eps = lp->cfg.eps;
    const size_t stride = (size_t)lp->cfg.Kc * lp->cd + V + 2 * Hv, off = (size_t)lp->cfg.Kc * lp->cd;
#pragma omp parallel num_threads(lp->threads)
    {
        float *dnw = lp->partial + gdn_thread_id() * stride + off;
        for (int64_t i = 0; i < V; i++) dnw[i] = 0.0f;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < lp->N; row++)
            for (int64_t h = 0; h < Hv; h++) {
                const float *oh = o + row * lp->vd + h * V, *zh = proj + row * lp->P + lp->cd + h * V;
                float *dn = lp->nrm + row * lp->vd + h * V, *dz = lp->dproj + row * lp->P + lp->cd + h * V;
                const float r = 1.0f / sqrtf(gdn_sumsq(oh, V) / (float)V + eps);
                float ao = 0.0f, sz[GDN_MAX_HEAD_DIM];
                sigmoid_rows(sz, zh, V);
                for (int64_t i = 0; i < V; i++) {
                    const float s = sz[i], silu = zh[i] * s;
                    const float on = oh[i] * r;
                    dnw[i] += dn[i] * on * silu;
                    dz[i] = dn[i] * nw[i] * on * s * (1.0f + zh[i] * (1.0f - s));
                    dn[i] *= nw[i] * silu; /* a_i */
                    ao += dn[i] * oh[i];
                }
                const float k3 = r * r * r * ao / (float)V;
                for (int64_t i = 0; i < V; i++) dn[i] = r * dn[i] - k3 * oh[i];
            }
    }
    reduce_partials(lp, dw + gdn_layer_param_offset(&lp->cfg, GDN_P_NORM), off, (size_t)V);
}

/* Gates: beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias): db, da into dproj, dA_log and
 * ddt_bias reduced over rows. */
static void gates_backward(gdn_layer_plan *lp, float *dw, const float *proj, const float *w) {
    const int64_t Hv = lp->cfg.Hv;
    const float *A_log = param(lp, w, GDN_P_A_LOG), *dt_bias = param(lp, w, GDN_P_DT_BIAS);
    const size_t stride = (size_t)lp->cfg.Kc * lp->cd + lp->cfg.V + 2 * Hv,
                 off = (size_t)lp->cfg.Kc * lp->cd + lp->cfg.V;
#pragma omp parallel num_threads(lp->threads)
    {
        float *red = lp->partial + gdn_thread_id() * stride + off; /* [dA_log | ddt_bias] */
        for (int64_t h = 0; h < 2 * Hv; h++) red[h] = 0.0f;
#pragma omp for schedule(static)
        for (int64_t row = 0; row < lp->N; row++) {
            const float *pb = proj + row * lp->P + lp->cd + lp->vd, *pa = pb + Hv;
            float *db = lp->dproj + row * lp->P + lp->cd + lp->vd, *da = db + Hv;
            for (int64_t h = 0; h < Hv; h++) {
                const float beta = lp->beta[row * Hv + h], dg = lp->dg[row * Hv + h];
                db[h] = lp->dbeta[row * Hv + h] * beta * (1.0f - beta);
                const float A = __builtin_expf(A_log[h]), u = pa[h] + dt_bias[h];
                da[h] = -dg * A * (u > 20.0f ? 1.0f : gdn_sigmoidf(u));
                red[h] += dg * lp->g[row * Hv + h]; /* dg/dA_log = -exp(A_log) softplus(u) = g */
                red[Hv + h] += da[h];
            }
        }
    }
    reduce_partials(lp, dw + gdn_layer_param_offset(&lp->cfg, GDN_P_A_LOG), off, (size_t)Hv);
    reduce_partials(lp, dw + gdn_layer_param_offset(&lp->cfg, GDN_P_DT_BIAS), off + Hv, (size_t)Hv);
}

/* The conv + SiLU backward: dq, dk, dv (gradients of the post-SiLU channels) become du in
 * place; d pre-conv rows t >= 0 go to dproj's qkv columns, rows before 0 to dhalo (may be
 * NULL); the taps' gradient is reduced over rows. */
static void conv_backward(gdn_layer_plan *lp, float *dw, float *dhalo, const float *proj,
                          const float *halo) {
    const gdn_layer_config *c = &lp->cfg;
    const int64_t T = c->T, Kc = c->Kc, cd = lp->cd;
    const size_t stride = (size_t)Kc * cd + c->V + 2 * c->Hv;
    channel_block blk[3];
    channel_blocks(lp, lp->dq, lp->dk, lp->dv, blk);
#pragma omp parallel num_threads(lp->threads)
    {
        float *dtap = lp->partial + gdn_thread_id() * stride; /* [Kc][cd] */
        for (int64_t i = 0; i < Kc * cd; i++) dtap[i] = 0.0f;
        /* du = d(silu(u)) silu'(u), u recomputed; the taps' gradient from du and the rows. */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < lp->N; row++) {
            const int64_t b = row / T, t = row % T;
            for (int s = 0; s < 3; s++) {
                float *du = blk[s].buf + row * blk[s].width;
                const int64_t c0 = blk[s].c0, n = blk[s].width;
                float u[256], sg[256];
                for (int64_t i0 = 0; i0 < n; i0 += 256) {
                    const int64_t m = n - i0 < 256 ? n - i0 : 256;
                    conv_row(lp, proj, halo, b, t, c0 + i0, m, u);
                    sigmoid_rows(sg, u, m);
                    for (int64_t i = 0; i < m; i++) du[i0 + i] *= sg[i] * (1.0f + u[i] * (1.0f - sg[i]));
                }
                for (int64_t j = 0; j < Kc; j++) {
                    if (!gdn_layer_tap_ok(lp, t, t - (Kc - 1) + j)) continue;
                    const float *src = pre_row(lp, proj, halo, b, t - (Kc - 1) + j) + c0;
                    float *dj = dtap + j * cd + c0;
                    for (int64_t i = 0; i < n; i++) dj[i] += du[i] * src[i];
                }
            }
        }
        /* d pre(t') = sum_j w[j] du(t' + Kc-1 - j): gathered per row, so no two threads write
         * the same row; rows t' < 0 are the halo's. */
#pragma omp for schedule(static)
        for (int64_t row = -(Kc - 1) * c->B; row < lp->N; row++) {
            int64_t b, t;
            float *dst;
            if (row >= 0) {
                b = row / T, t = row % T, dst = lp->dproj + row * lp->P;
            } else {
                const int64_t hrow = row + (Kc - 1) * c->B; /* 0 .. B(Kc-1)-1 */
                b = hrow / (Kc - 1), t = hrow % (Kc - 1) - (Kc - 1);
                if (!dhalo) continue;
                dst = dhalo + hrow * cd;
            }
            for (int s = 0; s < 3; s++) {
                const int64_t c0 = blk[s].c0, n = blk[s].width;
                for (int64_t i = 0; i < n; i++) dst[c0 + i] = 0.0f;
                for (int64_t j = 0; j < Kc; j++) {
                    const int64_t tt = t + (Kc - 1) - j;
                    if (tt < 0 || tt >= T || !gdn_layer_tap_ok(lp, tt, t)) continue;
                    const float *du = blk[s].buf + (b * T + tt) * n, *wj = lp->convw + j * cd + c0;
                    for (int64_t i = 0; i < n; i++) dst[c0 + i] += wj[i] * du[i];
                }
            }
        }
    }
    float *dconv = dw + gdn_layer_param_offset(c, GDN_P_CONV1D);
    for (int64_t ch = 0; ch < cd; ch++)
        for (int64_t j = 0; j < Kc; j++) {
            float s = 0.0f;
            for (int t = 0; t < lp->threads; t++) s += lp->partial[t * stride + j * cd + ch];
            dconv[ch * Kc + j] = s;
        }
}

/* dx = dproj [W_qkv; W_z; W_b; W_a] and each projection's weight gradient dproj_i^T x. */
void gdn_layer_project_backward(gdn_layer_plan *lp, float *dx, float *dw, const float *x,
                                const float *w) {
    const int64_t N = lp->N, E = lp->cfg.E, P = lp->P;
    const int t = lp->threads;
    proj_part parts[4];
    proj_parts(lp, parts);
    for (int i = 0; i < 4; i++) {
        const size_t off = gdn_layer_param_offset(&lp->cfg, parts[i].which);
        gdn_matmul_compute(parts[i].compute, i ? GDN_GEMM_ACC : 0, N, E, parts[i].n, lp->dproj + parts[i].col,
                           P, w + off, E, dx, E, lp->mm_ws, t);
        gdn_matmul_compute(parts[i].compute, GDN_GEMM_A_TRANS, parts[i].n, E, N, lp->dproj + parts[i].col, P,
                           x, E, dw + off, E, lp->mm_ws, t);
    }
}

int gdn_layer_backward_to_proj(gdn_layer_plan *lp, float *dw, float *dhalo, const float *w,
                               const float *proj, const float *o, const float *halo,
                               const float *dy, gdn_layer_kernel_bwd kbwd, void *ctx) {
    const gdn_layer_config *c = &lp->cfg;
    int rc;
    memset(dw, 0, sizeof(float) * gdn_layer_param_floats(c)); /* the padding between tensors */
    /* out_proj: dW_out = dy^T nrm, then dn = dy W_out (into nrm, which is not needed after). */
    gdn_layer_norm(lp, lp->N, o, proj, w);
    gdn_matmul_compute(c->compute, GDN_GEMM_A_TRANS, c->E, lp->vd, lp->N, dy, c->E, lp->nrm, lp->vd,
                       dw + gdn_layer_param_offset(c, GDN_P_OUT_PROJ), lp->vd, lp->mm_ws, lp->threads);
    gdn_matmul_compute(c->compute, 0, lp->N, lp->vd, c->E, dy, c->E, param(lp, w, GDN_P_OUT_PROJ), lp->vd,
                       lp->nrm, lp->vd, lp->mm_ws, lp->threads);
    norm_backward(lp, dw, o, proj, w);
    if ((rc = kbwd(lp, ctx))) return rc;
    gates_backward(lp, dw, proj, w);
    conv_backward(lp, dw, dhalo, proj, halo);
    return GDN_OK;
}

typedef struct { const float *h0, *ckpt; } single_rank_bwd;

static int kernel_backward_single(gdn_layer_plan *lp, void *ctx) {
    const single_rank_bwd *s = ctx;
    const gdn_rule_grads gr = gdn_layer_rule_grads(lp);
    const gdn_rule_inputs in = gdn_layer_rule_inputs(lp, s->h0);
    return gdn_backward_saved(lp->kplan, &gr, &in, s->ckpt, lp->nrm, NULL);
}

int gdn_layer_backward(gdn_layer_plan *lp, float *dx, float *dw, const float *x, const float *w,
                       const float *saved, const float *dy) {
    int rc;
    if ((rc = gdn_layer_check_trainable(lp)) || (rc = gdn_layer_check_inputs(lp, x, "x", w))) return rc;
    if ((rc = gdn_check_tensor("dy", dy, lp->N * lp->cfg.E, lp->cfg.check_finite, lp->threads))) return rc;
    if (!dx) return gdn_fail(GDN_ERR_ARG, "layer output 'dx' is NULL");
    if (!dw) return gdn_fail(GDN_ERR_ARG, "layer output 'dw' is NULL");
    gdn_layer_saved sv = gdn_layer_saved_view(lp, (float *)saved);
    const float *halo = sv.halo, *proj = sv.proj, *o = sv.o;
    /* (packed: every document started from zeros; the kernel's h0 would be per document) */
    single_rank_bwd kb = {lp->cfg.cu_seqlens ? NULL : sv.h0, sv.ckpt};
    if (!halo) { /* no saved states: the forward started from zeros */
        memset(lp->halo, 0, sizeof(float) * lp->cfg.B * (lp->cfg.Kc - 1) * lp->cd);
        halo = lp->halo;
    }
    if (!proj) {
        gdn_layer_project(lp, lp->N, lp->proj, x, w);
        proj = lp->proj;
    }
    gdn_layer_conv_gates(lp, proj, halo, w);
    if (!o) { /* recompute the kernel's output (and its saved states, for its backward) */
        const gdn_rule_inputs in = gdn_layer_rule_inputs(lp, kb.h0);
        rc = gdn_forward_save(lp->kplan, lp->o, NULL, lp->ckpt, &in);
        if (rc) return rc;
        o = lp->o, kb.ckpt = lp->ckpt;
    }
    if ((rc = gdn_layer_backward_to_proj(lp, dw, NULL, w, proj, o, halo, dy, kernel_backward_single, &kb)))
        return rc;
    gdn_layer_project_backward(lp, dx, dw, x, w);
    return GDN_OK;
}

/* ---------------------------------------------------------------- decode */

int gdn_layer_decode(gdn_layer_plan *lp, float *y, const float *x, const void *w,
                     float *conv_state, float *rec_state) {
    if (!lp) return gdn_fail(GDN_ERR_ARG, "layer plan is NULL");
    const gdn_layer_config *c = &lp->cfg;
    if (!x || !y || !w || !conv_state || !rec_state)
        return gdn_fail(GDN_ERR_ARG, "layer decode: %s is NULL",
                        !x ? "x" : !y ? "y" : !w ? "w" : !conv_state ? "conv_state" : "rec_state");
    const int64_t B = c->B, E = c->E, P = lp->P, cd = lp->cd, Kc = c->Kc, Hv = c->Hv;
    /* x is B rows: cheap to check; the weights were checked when they were loaded or planned. */
    int rc;
    if ((rc = gdn_check_tensor("x", x, B * E, c->check_finite, lp->threads))) return rc;
    rc = gdn_layer_weights_prepare(lp, w, 0); /* BF16: the small tensors to fp32 */
    if (rc) return rc;
    gdn_layer_project(lp, B, lp->proj, x, w); /* B rows of the plan's N: the streaming GEMM path */
    const float *cw = param(lp, w, GDN_P_CONV1D), *A_log = param(lp, w, GDN_P_A_LOG),
                *dt_bias = param(lp, w, GDN_P_DT_BIAS);
    for (int64_t b = 0; b < B; b++) {
        const float *pre = lp->proj + b * P;
        for (int64_t ch = 0; ch < cd; ch++) { /* the conv into q, k, v; SiLU below, vectorised */
            float *st = conv_state + (b * cd + ch) * Kc, u = 0.0f;
            for (int64_t j = 0; j + 1 < Kc; j++) st[j] = st[j + 1];
            st[Kc - 1] = pre[ch];
            for (int64_t j = 0; j < Kc; j++) u += cw[ch * Kc + j] * st[j];
            if (ch < lp->kd) lp->q[b * lp->kd + ch] = u;
            else if (ch < 2 * lp->kd) lp->k[b * lp->kd + ch - lp->kd] = u;
            else lp->v[b * lp->vd + ch - 2 * lp->kd] = u;
        }
        silu_rows(lp->q + b * lp->kd, lp->kd), silu_rows(lp->k + b * lp->kd, lp->kd);
        silu_rows(lp->v + b * lp->vd, lp->vd);
        for (int64_t h = 0; h < Hv; h++) {
            lp->beta[b * Hv + h] = gdn_sigmoidf(pre[cd + lp->vd + h]);
            lp->g[b * Hv + h] = -__builtin_expf(A_log[h]) * gdn_softplusf(pre[cd + lp->vd + Hv + h] + dt_bias[h]);
        }
    }
    const gdn_rule_inputs in = gdn_layer_rule_inputs(lp, NULL); /* the state: rec_state, in place */
    rc = gdn_step(lp->kplan, lp->o, rec_state, &in);
    if (rc) return rc;
    gdn_layer_norm(lp, B, lp->o, lp->proj, w); /* B rows of the plan's N */
    gdn_layer_out(lp, B, y, w);
    return GDN_OK;
}
