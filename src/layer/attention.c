/* Qwen3.5's gated full-attention layer in fp32 (DESIGN §10): the plan, the row-local phases
 * around the core, and the single-rank forward and backward (the config and the flat parameter
 * layout: attention_params.c). The projections and o_proj are large GEMMs (gdn_matmul_compute,
 * fp32 or bf16 operands by cfg.compute); the
 * norms, RoPE and the gate are row-local loops; the core is attention_core.c's (flash style over
 * a view of the keys). */
#include "attention_internal.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------- plan */

/* The plan's own buffer (its forward's workspace, and what a backward without saved floats
 * recomputes into) always holds all three; a caller's KEEP_CORE buffer only o and lse, the
 * projections then living in the plan's buffer. */
gdn_attn_saved gdn_attn_saved_view(const gdn_attn_plan *ap, float *s) {
    const size_t NP = (size_t)ap->N * ap->P, NO = (size_t)ap->N * ap->Hd;
    if (s != ap->saved && ap->cfg.keep == GDN_ATTN_KEEP_CORE) return (gdn_attn_saved){ap->saved, s, s + NO};
    return (gdn_attn_saved){s, s + NP, s + NP + NO};
}
static size_t saved_floats(const gdn_attn_plan *ap) { /* the plan's own buffer */
    return (size_t)ap->N * (ap->P + ap->Hd + ap->cfg.H);
}
int gdn_attn_plan_describe(const gdn_attn_plan *ap, gdn_attn_plan_info *info) {
    if (!info) return gdn_fail(GDN_ERR_ARG, "gdn_attn_plan_describe: info is NULL");
    memset(info, 0, sizeof *info);
    if (!ap) return gdn_fail(GDN_ERR_ARG, "gdn_attn_plan_describe: the plan is NULL");
    info->config = &ap->cfg;
    info->saved_floats = ap->cfg.keep == GDN_ATTN_KEEP_CORE ? (size_t)ap->N * (ap->Hd + ap->cfg.H) : saved_floats(ap);
    return GDN_OK;
}

void gdn_attn_plan_destroy(gdn_attn_plan *ap) {
    if (!ap) return;
    free(ap->cu), free(ap->arena);
    free(ap);
}

/* The angles in double (exact), rounded to fp32 once: inv_freq_i = theta^(-2i/R); a token's
 * position counts from its document's start (packed) or from base (dense). */
void gdn_attn_rope_table(const gdn_attn_plan *ap, int64_t base, float *cosv, float *sinv) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t hr = c->R / 2;
    for (int64_t t = 0; t < c->T; t++) {
        const int64_t tg = c->seq_offset + t;
        const double p = (double)(ap->cu ? tg - gdn_attn_doc_begin(ap->cu, c->n_docs, tg) : base + t);
        for (int64_t i = 0; i < hr; i++) {
            const double ang = p * pow(c->rope_theta, -2.0 * (double)i / (double)c->R);
            cosv[t * hr + i] = (float)cos(ang), sinv[t * hr + i] = (float)sin(ang);
        }
    }
}

int gdn_attn_plan_create(gdn_attn_plan **out, const gdn_attn_config *cfg) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "attention plan output pointer is NULL");
    *out = NULL;
    int rc = gdn_isa_check();
    if (rc || (rc = gdn_attn_config_check(cfg))) return rc;
    gdn_attn_plan *ap = gdn_calloc("attention: ap", 1, sizeof *ap);
    if (!ap) return gdn_fail(GDN_ERR_NOMEM, "attention plan");
    ap->cfg = *cfg;
    gdn_attn_config *c = &ap->cfg;
#ifdef _OPENMP
    ap->threads = c->threads > 0 ? c->threads : omp_get_max_threads();
#else
    ap->threads = 1;
#endif
    c->threads = ap->threads;
    const int64_t T = c->T, d = c->d, hr = c->R / 2;
    ap->N = c->B * T, ap->Hd = c->H * d, ap->Kd = c->Hkv * d, ap->P = 2 * ap->Hd + 2 * ap->Kd;
    for (int i = 0; i <= GDN_A_COUNT; i++) ap->param_off[i] = gdn_attn_param_offset(c, i);
    if (c->cu_seqlens) {
        if (!(ap->cu = gdn_malloc("attention: ap->cu", sizeof(int64_t) * (size_t)(c->n_docs + 1)))) {
            gdn_attn_plan_destroy(ap);
            return gdn_fail(GDN_ERR_NOMEM, "attention cu_seqlens copy (%lld documents)", (long long)c->n_docs);
        }
        memcpy(ap->cu, c->cu_seqlens, sizeof(int64_t) * (size_t)(c->n_docs + 1));
        c->cu_seqlens = ap->cu, ap->cu_cap = c->n_docs + 1;
    }
    const size_t N = (size_t)ap->N, Hd = (size_t)ap->Hd, Kd = (size_t)ap->Kd, P = (size_t)ap->P, H = (size_t)c->H;
    const size_t pieces[] = {
        (size_t)T * hr, (size_t)T * hr, saved_floats(ap), /* cos sin saved */
        N * Hd, N * Kd, N * H, N * (size_t)c->Hkv,        /* qr kr rq rk */
        N * Hd, N * Hd, N * H,                            /* z dO Dv */
        N * Hd, N * Kd, N * P,                            /* dqr dkr dproj */
        (size_t)ap->threads * gdn_attn_tile_floats(d, c->compute == GDN_COMPUTE_BF16), (size_t)ap->threads * 2 * (size_t)d,
        gdn_matmul_compute_ws_floats(c->compute, ap->threads),
    };
    const size_t np = sizeof pieces / sizeof pieces[0];
    size_t total = 0;
    for (size_t i = 0; i < np; i++) total += (pieces[i] + 15) & ~(size_t)15;
    char what[160];
    snprintf(what, sizeof what, "the attention workspace for B*T = %lld tokens (%.1f KB per token)", (long long)N,
             4.0 * (double)total / 1e3 / (double)N);
    if ((rc = gdn_check_fits(what, 4.0 * (double)total))) {
        gdn_attn_plan_destroy(ap);
        return rc;
    }
    ap->arena = gdn_alloc_aligned("attention: ap->arena", total * sizeof(float));
    if (!ap->arena) {
        gdn_attn_plan_destroy(ap);
        return gdn_fail(GDN_ERR_NOMEM, "attention workspace: %.1f MB for B*T = %lld tokens", total * 4.0 / 1e6,
                        (long long)N);
    }
    float *cur = ap->arena;
    float **dst[] = {&ap->cosv, &ap->sinv, &ap->saved, &ap->qr, &ap->kr, &ap->rq, &ap->rk, &ap->z, &ap->dO,
                     &ap->Dv, &ap->dqr, &ap->dkr, &ap->dproj, &ap->tile, &ap->partial, &ap->mm_ws};
    for (size_t i = 0; i < np; i++) *dst[i] = gdn_carve(&cur, pieces[i]);
    gdn_attn_rope_table(ap, c->pos_offset + c->seq_offset, ap->cosv, ap->sinv);
    *out = ap;
    return GDN_OK;
}

int gdn_attn_plan_set_docs(gdn_attn_plan *ap, const int64_t *cu_seqlens, int64_t n_docs, int64_t seq_offset) {
    if (!ap) return gdn_fail(GDN_ERR_ARG, "attention documents: plan is NULL");
    if (!cu_seqlens != !ap->cu)
        return gdn_fail(GDN_ERR_ARG, "attention documents: the plan was made %s", ap->cu
                        ? "packed: give cu_seqlens (NULL only for a dense plan)" : "dense: cu_seqlens must be NULL");
    gdn_attn_config c = ap->cfg;
    c.cu_seqlens = cu_seqlens, c.n_docs = cu_seqlens ? n_docs : 0, c.seq_offset = seq_offset;
    int rc = gdn_attn_config_check(&c);
    if (rc) return rc;
    if (cu_seqlens && n_docs + 1 > ap->cu_cap) { /* grow-only: later steps reuse it */
        int64_t *grown = gdn_realloc("attention: grown", ap->cu, sizeof(int64_t) * (size_t)(n_docs + 1));
        if (!grown) return gdn_fail(GDN_ERR_NOMEM, "attention cu_seqlens copy (%lld documents)", (long long)n_docs);
        ap->cu = grown, ap->cu_cap = n_docs + 1;
    }
    if (cu_seqlens) {
        memcpy(ap->cu, cu_seqlens, sizeof(int64_t) * (size_t)(n_docs + 1));
        c.cu_seqlens = ap->cu;
    }
    ap->cfg = c;
    gdn_attn_rope_table(ap, ap->cfg.pos_offset + ap->cfg.seq_offset, ap->cosv, ap->sinv);
    return GDN_OK;
}

/* ---------------------------------------------------------------- row-local phases */

/* Zero-centred RMSNorm with (1 + w), then RoPE on the first R dims, of one head row u -> out;
 * returns the rstd. */
static inline float norm_rope_row(const gdn_attn_config *c, const float *u, const float *w, const float *cs,
                                  const float *sn, float *out) {
    const int64_t d = c->d, hr = c->R / 2;
    const float r = 1.0f / sqrtf(gdn_sumsq(u, d) / (float)d + c->eps);
    for (int64_t i = 0; i < d; i++) out[i] = u[i] * r * (1.0f + w[i]);
    for (int64_t i = 0; i < hr; i++) {
        const float a = out[i], b = out[i + hr];
        out[i] = a * cs[i] - b * sn[i], out[i + hr] = b * cs[i] + a * sn[i];
    }
    return r;
}

/* Its backward: g (gradient of out) -> du; dw += g_rot * u r. */
static inline void norm_rope_row_bwd(const gdn_attn_config *c, const float *u, float r, const float *w,
                                     const float *cs, const float *sn, const float *g, float *du, float *dw) {
    const int64_t d = c->d, hr = c->R / 2;
    float e[1024];
    for (int64_t i = 0; i < d; i++) e[i] = g[i];
    for (int64_t i = 0; i < hr; i++) { /* the transpose of the rotation */
        const float a = g[i], b = g[i + hr];
        e[i] = a * cs[i] + b * sn[i], e[i + hr] = b * cs[i] - a * sn[i];
    }
    float s = 0.0f;
    for (int64_t i = 0; i < d; i++) {
        dw[i] += e[i] * u[i] * r;
        e[i] *= 1.0f + w[i];
        s += u[i] * e[i];
    }
    const float k = r * r * r / (float)d * s;
    for (int64_t i = 0; i < d; i++) du[i] = r * e[i] - k * u[i];
}

void gdn_attn_project(gdn_attn_plan *ap, float *proj, const float *x, const float *w) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t N = ap->N, E = c->E, P = ap->P, Hd = ap->Hd, Kd = ap->Kd;
    gdn_matmul_compute(c->compute, GDN_GEMM_B_TRANS, N, 2 * Hd, E, x, E, w + ap->param_off[GDN_A_Q_PROJ], E, proj, P,
               ap->mm_ws, ap->threads);
    gdn_matmul_compute(c->compute, GDN_GEMM_B_TRANS, N, Kd, E, x, E, w + ap->param_off[GDN_A_K_PROJ], E, proj + 2 * Hd, P,
               ap->mm_ws, ap->threads);
    gdn_matmul_compute(c->compute, GDN_GEMM_B_TRANS, N, Kd, E, x, E, w + ap->param_off[GDN_A_V_PROJ], E, proj + 2 * Hd + Kd,
               P, ap->mm_ws, ap->threads);
}

typedef struct {
    gdn_attn_plan *ap;
    const float *proj, *wq, *wk;
} norm_rope_job;

static void norm_rope_rows(void *p, int64_t lo, int64_t hi) {
    const norm_rope_job *j = p;
    gdn_attn_plan *ap = j->ap;
    const gdn_attn_config *c = &ap->cfg;
    const int64_t H = c->H, Hkv = c->Hkv, d = c->d, hr = c->R / 2, P = ap->P, Hd = ap->Hd, Kd = ap->Kd;
    for (int64_t n = lo; n < hi; n++) {
        const int64_t t = n % c->T;
        const float *cs = ap->cosv + t * hr, *sn = ap->sinv + t * hr;
        for (int64_t h = 0; h < H; h++)
            ap->rq[n * H + h] = norm_rope_row(c, j->proj + n * P + 2 * h * d, j->wq, cs, sn, ap->qr + n * Hd + h * d);
        for (int64_t i = 0; i < Hkv; i++)
            ap->rk[n * Hkv + i] = norm_rope_row(c, j->proj + n * P + 2 * Hd + i * d, j->wk, cs, sn, ap->kr + n * Kd + i * d);
    }
}

void gdn_attn_norm_rope(gdn_attn_plan *ap, const float *proj, const float *w) {
    norm_rope_job j = {ap, proj, w + ap->param_off[GDN_A_Q_NORM], w + ap->param_off[GDN_A_K_NORM]};
    gdn_parallel_range(ap->threads, ap->N, norm_rope_rows, &j);
}

typedef struct {
    gdn_attn_plan *ap;
    gdn_attn_saved sv;
} gate_job;

/* z = o sigmoid(gate), row by row */
static void gate_rows(void *p, int64_t lo, int64_t hi) {
    const gate_job *j = p;
    gdn_attn_plan *ap = j->ap;
    const int64_t H = ap->cfg.H, d = ap->cfg.d, P = ap->P, Hd = ap->Hd;
    for (int64_t n = lo; n < hi; n++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < d; i++) {
                const float g = j->sv.proj[n * P + 2 * h * d + d + i];
                ap->z[n * Hd + h * d + i] = j->sv.o[n * Hd + h * d + i] / (1.0f + expf(-g));
            }
}

void gdn_attn_finish(gdn_attn_plan *ap, float *y, gdn_attn_saved sv, const float *w) {
    const gdn_attn_config *c = &ap->cfg;
    gate_job j = {ap, sv};
    gdn_parallel_range(ap->threads, ap->N, gate_rows, &j);
    if (y)
        gdn_matmul_compute(c->compute, GDN_GEMM_B_TRANS, ap->N, c->E, ap->Hd, ap->z, ap->Hd, w + ap->param_off[GDN_A_O_PROJ],
                           ap->Hd, y, c->E, ap->mm_ws, ap->threads);
}

gdn_attn_core gdn_attn_local_view(const gdn_attn_plan *ap, const float *proj) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t T = c->T;
    gdn_attn_core v = {
        .B = c->B, .H = c->H, .Hkv = c->Hkv, .d = c->d, .Q = ap->qr, .nq = T, .q0 = c->seq_offset, .qld = ap->Hd,
        .nk = T, .k0 = c->seq_offset, .K = {ap->kr, ap->Kd, c->d, T * ap->Kd},
        .V = {(float *)proj + 2 * ap->Hd + ap->Kd, ap->P, c->d, T * ap->P}, .cu = ap->cu, .n_docs = c->n_docs,
        .threads = ap->threads, .bf16 = ap->cfg.compute == GDN_COMPUTE_BF16, .tile = ap->tile,
    };
    return v;
}

gdn_attn_saved gdn_attn_backward_restore(gdn_attn_plan *ap, const float *saved, const float *x, const float *w) {
    const gdn_attn_saved sv = gdn_attn_saved_view(ap, saved ? (float *)saved : ap->saved); /* saved: read only */
    if (!saved || ap->cfg.keep == GDN_ATTN_KEEP_CORE) gdn_attn_project(ap, sv.proj, x, w);
    gdn_attn_norm_rope(ap, sv.proj, w);
    return sv;
}

void gdn_attn_backward_gate(gdn_attn_plan *ap, float *dw, gdn_attn_saved sv, const float *w, const float *dy) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t N = ap->N, E = c->E, H = c->H, d = c->d, P = ap->P, Hd = ap->Hd;
    gdn_attn_finish(ap, NULL, sv, w); /* z, for o_proj's weight gradient */
    /* the core's backward adds into dq, dk and dv */
    memset(ap->dqr, 0, sizeof(float) * (size_t)N * (size_t)Hd);
    memset(ap->dkr, 0, sizeof(float) * (size_t)N * (size_t)ap->Kd);
    for (int64_t n = 0; n < N; n++) memset(ap->dproj + n * P + 2 * Hd + ap->Kd, 0, sizeof(float) * (size_t)ap->Kd);
    memset(dw, 0, sizeof(float) * gdn_attn_param_floats(c));
    /* o_proj: dWo = dy^T z, dz = dy Wo (into z) */
    gdn_matmul_compute(c->compute, GDN_GEMM_A_TRANS, E, Hd, N, dy, E, ap->z, Hd, dw + ap->param_off[GDN_A_O_PROJ], Hd,
               ap->mm_ws, ap->threads);
    gdn_matmul_compute(c->compute, 0, N, Hd, E, dy, E, w + ap->param_off[GDN_A_O_PROJ], Hd, ap->z, Hd, ap->mm_ws, ap->threads);
    /* the gate: dO = dz sigma, dgate = dz o sigma (1 - sigma); D = <dO, o> */
#pragma omp parallel for num_threads(ap->threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t h = 0; h < H; h++) {
            float D = 0.0f;
            for (int64_t i = 0; i < d; i++) {
                const size_t zi = (size_t)(n * Hd + h * d + i);
                const float g = sv.proj[n * P + 2 * h * d + d + i], sg = 1.0f / (1.0f + expf(-g));
                const float dz = ap->z[zi], o = sv.o[zi];
                ap->dO[zi] = dz * sg;
                ap->dproj[n * P + 2 * h * d + d + i] = dz * o * sg * (1.0f - sg);
                D += dz * sg * o;
            }
            ap->Dv[n * H + h] = D;
        }
}

void gdn_attn_backward_finish(gdn_attn_plan *ap, float *dx, float *dw, gdn_attn_saved sv, const float *x,
                              const float *w) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t N = ap->N, E = c->E, H = c->H, Hkv = c->Hkv, d = c->d, hr = c->R / 2, P = ap->P, Hd = ap->Hd,
                  Kd = ap->Kd;
    /* norms and RoPE: dqr, dkr -> dproj q and k columns; dw of the norms per thread, then summed */
    const float *wq = w + ap->param_off[GDN_A_Q_NORM], *wk = w + ap->param_off[GDN_A_K_NORM];
    memset(ap->partial, 0, sizeof(float) * (size_t)ap->threads * 2 * (size_t)d);
#pragma omp parallel num_threads(ap->threads)
    {
        float *pq = ap->partial + (size_t)gdn_thread_id() * 2 * (size_t)d, *pk = pq + d;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const int64_t t = n % c->T;
            const float *cs = ap->cosv + t * hr, *sn = ap->sinv + t * hr;
            for (int64_t h = 0; h < H; h++)
                norm_rope_row_bwd(c, sv.proj + n * P + 2 * h * d, ap->rq[n * H + h], wq, cs, sn,
                                  ap->dqr + n * Hd + h * d, ap->dproj + n * P + 2 * h * d, pq);
            for (int64_t j = 0; j < Hkv; j++)
                norm_rope_row_bwd(c, sv.proj + n * P + 2 * Hd + j * d, ap->rk[n * Hkv + j], wk, cs, sn,
                                  ap->dkr + n * Kd + j * d, ap->dproj + n * P + 2 * Hd + j * d, pk);
        }
    }
    float *dwq = dw + ap->param_off[GDN_A_Q_NORM], *dwk = dw + ap->param_off[GDN_A_K_NORM];
    for (int th = 0; th < ap->threads; th++)
        for (int64_t i = 0; i < d; i++)
            dwq[i] += ap->partial[(size_t)th * 2 * d + i], dwk[i] += ap->partial[(size_t)th * 2 * d + d + i];
    /* the projections: dx = dproj [Wq; Wk; Wv], dW = dproj^T x */
    const int cols[3] = {GDN_A_Q_PROJ, GDN_A_K_PROJ, GDN_A_V_PROJ};
    const int64_t at[3] = {0, 2 * Hd, 2 * Hd + Kd}, width[3] = {2 * Hd, Kd, Kd};
    for (int m = 0; m < 3; m++) {
        gdn_matmul_compute(c->compute, m ? GDN_GEMM_ACC : 0, N, E, width[m], ap->dproj + at[m], P, w + ap->param_off[cols[m]],
                   E, dx, E, ap->mm_ws, ap->threads);
        gdn_matmul_compute(c->compute, GDN_GEMM_A_TRANS, width[m], E, N, ap->dproj + at[m], P, x, E,
                   dw + ap->param_off[cols[m]], E, ap->mm_ws, ap->threads);
    }
}

/* ---------------------------------------------------------------- entry points */

int gdn_attn_check_inputs(const gdn_attn_plan *ap, const float *x, const float *w) {
    const gdn_attn_config *c = &ap->cfg;
    int rc = gdn_check_tensor("x", x, ap->N * c->E, c->check_finite, ap->threads);
    if (rc) return rc;
    if (!w) return gdn_fail(GDN_ERR_ARG, "input 'w' (the attention weights) is NULL");
    if (!c->check_finite) return GDN_OK;
    for (int p = 0; p < GDN_A_COUNT; p++) {
        rc = gdn_check_tensor(gdn_attn_param_name(p), w + ap->param_off[p],
                              (int64_t)gdn_attn_param_numel(c, p), 1, ap->threads);
        if (rc) return rc;
    }
    return GDN_OK;
}

/* The single-rank entry points see the whole stream. */
static int check_single(const gdn_attn_plan *ap, const char *fn) {
    if (!ap) return gdn_fail(GDN_ERR_ARG, "%s: plan is NULL", fn);
    const gdn_attn_config *c = &ap->cfg;
    if (c->seq_offset || (c->cu_seqlens && c->cu_seqlens[c->n_docs] != c->T))
        return gdn_fail(GDN_ERR_ARG,
                        "%s: the plan is for a shard (seq_offset = %lld, cu_seqlens ending at %lld, T = %lld): use the "
                        "context-parallel entry points",
                        fn, (long long)c->seq_offset, (long long)(c->cu_seqlens ? c->cu_seqlens[c->n_docs] : c->T),
                        (long long)c->T);
    return GDN_OK;
}

static void local_forward(gdn_attn_plan *ap, gdn_attn_saved sv, const float *x, const float *w) {
    gdn_attn_project(ap, sv.proj, x, w);
    gdn_attn_norm_rope(ap, sv.proj, w);
    const gdn_attn_core v = gdn_attn_local_view(ap, sv.proj);
    gdn_attn_core_forward(&v, sv.o, sv.lse);
}

int gdn_attn_forward(gdn_attn_plan *ap, float *y, float *saved, const float *x, const float *w) {
    int rc = check_single(ap, "gdn_attn_forward");
    if (rc) return rc;
    const gdn_attn_config *c = &ap->cfg;
    if (!y) return gdn_fail(GDN_ERR_ARG, "output 'y' is NULL");
    if ((rc = gdn_attn_check_inputs(ap, x, w))) return rc;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    const gdn_attn_saved sv = gdn_attn_saved_view(ap, saved ? saved : ap->saved);
    local_forward(ap, sv, x, w);
    gdn_attn_finish(ap, y, sv, w);
    gdn_fp_fast_end(fm);
    return gdn_check_output("y", y, ap->N * c->E, ap->threads);
}

int gdn_attn_backward(gdn_attn_plan *ap, float *dx, float *dw, const float *x, const float *w, const float *saved,
                      const float *dy) {
    int rc = check_single(ap, "gdn_attn_backward");
    if (rc) return rc;
    const gdn_attn_config *c = &ap->cfg;
    if (!dx) return gdn_fail(GDN_ERR_ARG, "output 'dx' is NULL");
    if (!dw) return gdn_fail(GDN_ERR_ARG, "output 'dw' is NULL");
    if ((rc = gdn_check_tensor("dy", dy, ap->N * c->E, c->check_finite, ap->threads)) ||
        (rc = gdn_attn_check_inputs(ap, x, w)))
        return rc;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    const gdn_attn_saved sv = gdn_attn_backward_restore(ap, saved, x, w);
    if (!saved) { /* the core's output again */
        const gdn_attn_core vf = gdn_attn_local_view(ap, sv.proj);
        gdn_attn_core_forward(&vf, sv.o, sv.lse);
    }
    gdn_attn_backward_gate(ap, dw, sv, w, dy);
    const gdn_attn_core v = gdn_attn_local_view(ap, sv.proj);
    const gdn_attn_kv dk = {ap->dkr, ap->Kd, c->d, c->T * ap->Kd};
    const gdn_attn_kv dv = {ap->dproj + 2 * ap->Hd + ap->Kd, ap->P, c->d, c->T * ap->P};
    gdn_attn_core_backward(&v, ap->dO, sv.lse, ap->Dv, ap->dqr, dk, dv);
    gdn_attn_backward_finish(ap, dx, dw, sv, x, w);
    gdn_fp_fast_end(fm);
    if ((rc = gdn_check_output("dx", dx, ap->N * c->E, ap->threads))) return rc;
    return gdn_check_output("dw", dw, (int64_t)gdn_attn_param_floats(c), ap->threads);
}
