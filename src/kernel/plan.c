/* Plans (FFTW style: shapes, chunk, threads, workspace fixed once): the forward and backward
 * workspaces, the checkpoint intervals and the plan's streams (stream.c). Executing a plan
 * allocates nothing. */
#include "kernel_internal.h"

#include <math.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static size_t state_floats(const gdn_config *c, int W) {
    const size_t grouped = (size_t)(c->Hv / c->Hk) * c->K * c->V, aug = (size_t)c->K * W;
    return grouped > aug ? grouped : aug;
}

static size_t ws_floats(const gdn_config *cfg, int C, int K, int W) {
    return (size_t)4 * C * K            /* qs kn kt kdt */
           + (size_t)5 * C * C          /* pk qk tm am ew */
           + (size_t)2 * C * K + (size_t)C * K /* xw rk */
           + (size_t)4 * C * W          /* rv u m2(2) */
           + state_floats(cfg, W)       /* states */
           + (size_t)9 * C;             /* g beta eg egd lrow qinv kinv, G (double) */
}

static int alloc_backward(gdn_plan *p);

int gdn_plan_create(gdn_plan **out, const gdn_config *cfg) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "plan output pointer is NULL");
    *out = NULL;
    int rc = gdn_isa_check();
    if (rc || (rc = gdn_config_check(cfg))) return rc;
    gdn_plan *p = gdn_calloc("plan: p", 1, sizeof *p);
    if (!p) return gdn_fail(GDN_ERR_NOMEM, "plan");
    p->cfg = *cfg;
    if (p->cfg.chunk == 0) p->cfg.chunk = 64;
    if (p->cfg.scale == 0.0f) p->cfg.scale = 1.0f / sqrtf((float)cfg->K);
#ifdef _OPENMP
    p->threads = cfg->threads > 0 ? cfg->threads : omp_get_max_threads();
#else
    p->threads = 1;
#endif
    p->cfg.threads = p->threads;
    const int C = p->cfg.chunk, K = (int)cfg->K;
    p->max_width = (int)(cfg->V + cfg->K); /* summaries carry [S | A] */
    const size_t per = ws_floats(&p->cfg, C, K, p->max_width) + 32 * 16;
    if ((rc = gdn_check_fits("the plan's forward workspace", 4.0 * (double)per * p->threads))) {
        gdn_plan_destroy(p);
        return rc;
    }
    p->ws = gdn_calloc("plan: p->ws", (size_t)p->threads, sizeof *p->ws);
    p->arena = gdn_alloc_aligned("plan: p->arena", ((per * p->threads * sizeof(float)) + 63) & ~(size_t)63);
    if (!p->ws || !p->arena) {
        /* the message before the plan goes: it names the plan's thread count */
        rc = gdn_fail(GDN_ERR_NOMEM, "plan workspace (%zu bytes per thread, %d threads)", per * sizeof(float),
                      p->threads);
        gdn_plan_destroy(p);
        return rc;
    }
    const int W = p->max_width;
    for (int t = 0; t < p->threads; t++) {
        float *cur = (float *)p->arena + per * t;
        gdn_chunk_ws *ws = &p->ws[t];
        ws->qs = gdn_carve(&cur, (size_t)C * K), ws->kn = gdn_carve(&cur, (size_t)C * K);
        ws->kt = gdn_carve(&cur, (size_t)K * C), ws->kdt = gdn_carve(&cur, (size_t)K * C);
        ws->pk = gdn_carve(&cur, (size_t)C * C), ws->qk = gdn_carve(&cur, (size_t)C * C);
        ws->tm = gdn_carve(&cur, (size_t)C * C);
        ws->am = gdn_carve(&cur, (size_t)C * C), ws->ew = gdn_carve(&cur, (size_t)C * C);
        ws->xw = gdn_carve(&cur, (size_t)2 * C * K), ws->rk = gdn_carve(&cur, (size_t)C * K);
        ws->rv = gdn_carve(&cur, (size_t)C * W), ws->u = gdn_carve(&cur, (size_t)C * W);
        ws->m2 = gdn_carve(&cur, (size_t)2 * C * W), ws->state = gdn_carve(&cur, state_floats(&p->cfg, W));
        ws->g = gdn_carve(&cur, C), ws->beta = gdn_carve(&cur, C), ws->G = (double *)gdn_carve(&cur, 2 * (size_t)C);
        ws->eg = gdn_carve(&cur, C), ws->egd = gdn_carve(&cur, C), ws->lrow = gdn_carve(&cur, C);
        ws->qinv = gdn_carve(&cur, C), ws->kinv = gdn_carve(&cur, C);
        GDN_ASSERT(cur <= (float *)p->arena + per * (t + 1));
    }
    if (p->cfg.compute == GDN_COMPUTE_BF16) {
        /* the largest product of a sweep: m <= max(2C, K) rows, n <= max(W, K, C), depth <= max(K, C) */
        const int forced = gdn_test_mutate("kernel: the BF16 path a plan uses"); /* a GDN_BF16_* path; 0: automatic */
        p->bf16_path = forced ? forced : gdn_bf16_path_auto();
        const int M = 2 * C > K ? 2 * C : K, KK = K > C ? K : C, N = W > KK ? W : KK;
        const size_t each = (gdn_gemm_bf16_ws_bytes(p->bf16_path, M, N, KK) + 63) / 64 * 64;
        p->bf_arena = gdn_alloc_aligned("plan: p->bf_arena", each * (size_t)p->threads);
        if (!p->bf_arena) {
            gdn_plan_destroy(p);
            return gdn_fail(GDN_ERR_NOMEM, "BF16 packing space (%zu bytes per thread)", each);
        }
        for (int t = 0; t < p->threads; t++) p->ws[t].bfws = (char *)p->bf_arena + each * (size_t)t;
    }
    if ((rc = alloc_backward(p)) || (rc = gdn_streams_init(p))) {
        gdn_plan_destroy(p);
        return rc;
    }
    p->ckpt_rows_cap = p->streams.ckpt_rows;
    *out = p;
    return GDN_OK;
}

/* r = value heads per key head: the backward carries all of a key head's states together. In
 * double: exact at any size that can be allocated, and larger ones cannot wrap around before
 * gdn_check_fits sees them. */
static double bwd_floats(const gdn_config *c, int64_t nseg, int N, int rec_slots) {
    const double C = (double)c->chunk, K = (double)c->K, V = (double)c->V, r = (double)(c->Hv / c->Hk);
    return r * K * V + 3 * C * (V + K) + 4 * C * K + 5 * C * C +
           6 * C /* dG, dbeta_row, colsum (double) */ + r * ((double)nseg + N) * K * V +
           (double)rec_slots * (double)gdn_chunk_record_floats(c) + 32 * 16;
}

static int alloc_backward(gdn_plan *p) {
    const gdn_config *c = &p->cfg;
    const int C = c->chunk, K = (int)c->K, V = (int)c->V, r = (int)(c->Hv / c->Hk);
    const int64_t nchunks = (c->T + C - 1) / C;
    const int asked = c->checkpoint_chunks; /* the caller's choice; p->cfg gets the resolved one */
    int N = asked;
    if (N <= 0) {
        /* Automatic: a checkpoint at every chunk (no segment re-sweep) while all threads'
         * checkpoints stay under a tenth of the input size; otherwise the N that minimises
         * checkpoints (nchunks / N states) + one segment's states and chunk records (N each). */
        const double every_chunk = (double)nchunks * K * V * 4 * r * p->threads;
        const double inputs = 4.0 * (double)c->B * c->T * (2 * c->Hk * c->K + c->Hv * (c->V + 2));
        const double state = (double)r * K * V, per_chunk = state + (double)gdn_chunk_record_floats(c);
        N = every_chunk <= 0.1 * inputs ? 1 : (int)ceil(sqrt((double)nchunks * state / per_chunk));
        if (N < 1) N = 1;
    }
    if (N > nchunks) N = (int)nchunks;
    p->ckpt_chunks = N;
    p->cfg.checkpoint_chunks = N;
    p->nseg = (nchunks + N - 1) / N;
    {   /* Saved states for every (batch row, value head): at most a tenth of the inputs. */
        const double inputs = 4.0 * (double)c->B * c->T * (2 * c->Hk * c->K + c->Hv * (c->V + 2));
        const double per_segment = 4.0 * (double)c->B * c->Hv * K * V;
        /* Segment 0 starts from h0, which is not saved: segs - 1 states are. */
        const int64_t segs = 1 + (int64_t)(0.1 * inputs / per_segment);
        int Ns = (int)((nchunks + segs - 1) / segs);
        if (asked > 0) Ns = asked < nchunks ? asked : (int)nchunks;
        p->save_chunks = Ns;
        p->save_nseg = (nchunks + Ns - 1) / Ns;
    }
    const int Nmax = N > p->save_chunks ? N : p->save_chunks;
    /* Chunk records: a whole segment's while they fit the budget (~0.5 MB a chunk at K = V =
     * 128 with two value heads per key head, so segments of 10-60 chunks all fit), else the
     * segment's last chunks only: bounded per-thread memory for wide heads or long segments. */
    const size_t rec_bytes = gdn_chunk_record_floats(c) * sizeof(float);
    const int64_t fit = (int64_t)(GDN_RECORD_BUDGET / rec_bytes);
    p->rec_slots = (int)(Nmax < fit ? Nmax : fit > 1 ? fit : 1);
    const double per_need = bwd_floats(c, p->nseg, Nmax, p->rec_slots);
    /* (the saved states grow with T / N: a very long T per call can outgrow the machine) */
    char what[96];
    snprintf(what, sizeof what, "the plan's backward workspace (%d thread(s), T = %lld)", p->threads, (long long)c->T);
    int rc = gdn_check_fits(what, 4.0 * per_need * p->threads);
    if (rc) return rc;
    const size_t per = (size_t)per_need;
    p->bws = gdn_calloc("plan: p->bws", (size_t)p->threads, sizeof *p->bws);
    p->bwd_arena = gdn_alloc_aligned("plan: p->bwd_arena", ((per * p->threads * sizeof(float)) + 63) & ~(size_t)63);
    if (!p->bws || !p->bwd_arena)
        return gdn_fail(GDN_ERR_NOMEM, "backward workspace (%zu bytes per thread, %d threads)",
                        per * sizeof(float), p->threads);
    for (int t = 0; t < p->threads; t++) {
        float *cur = (float *)p->bwd_arena + per * t;
        gdn_bwd_ws *b = &p->bws[t];
        const size_t kv = (size_t)K * V, ck = (size_t)C * K, cc = (size_t)C * C;
        b->dS = gdn_carve(&cur, (size_t)r * kv);
        b->dx = gdn_carve(&cur, 2 * (size_t)C * (V + K)), b->dr = gdn_carve(&cur, (size_t)C * (V + K));
        b->dKd = gdn_carve(&cur, ck), b->kd = gdn_carve(&cur, ck), b->dQ = gdn_carve(&cur, ck), b->dKn = gdn_carve(&cur, ck);
        b->dA = gdn_carve(&cur, cc), b->dT = gdn_carve(&cur, cc), b->dLn = gdn_carve(&cur, cc);
        b->tcc = gdn_carve(&cur, cc), b->bsym = gdn_carve(&cur, cc);
        b->dG = (double *)gdn_carve(&cur, 2 * (size_t)C), b->dbeta_row = (double *)gdn_carve(&cur, 2 * (size_t)C);
        b->colsum = (double *)gdn_carve(&cur, 2 * (size_t)C);
        b->ckpt = gdn_carve(&cur, (size_t)r * p->nseg * kv), b->segst = gdn_carve(&cur, (size_t)r * Nmax * kv);
        b->rec = gdn_carve(&cur, (size_t)p->rec_slots * gdn_chunk_record_floats(c));
        GDN_ASSERT(cur <= (float *)p->bwd_arena + per * (t + 1));
    }
    return GDN_OK;
}

static size_t backward_bytes(const gdn_plan *p) {
    const int Nmax = p->ckpt_chunks > p->save_chunks ? p->ckpt_chunks : p->save_chunks;
    return (size_t)bwd_floats(&p->cfg, p->nseg, Nmax, p->rec_slots) * sizeof(float);
}

void gdn_plan_destroy(gdn_plan *p) {
    if (!p) return;
    gdn_streams_free(p);
    free(p->bwd_arena);
    free(p->bws);
    free(p->arena);
    free(p->bf_arena);
    free(p->ws);
    free(p);
}

int gdn_plan_describe(const gdn_plan *p, gdn_plan_info *info) {
    if (!info) return gdn_fail(GDN_ERR_ARG, "gdn_plan_describe: info is NULL");
    memset(info, 0, sizeof *info);
    if (!p) return gdn_fail(GDN_ERR_ARG, "gdn_plan_describe: the plan is NULL");
    info->config = &p->cfg;
    /* the forward sweep's products */
    info->path = p->bf16_path ? gdn_bf16_path_name(p->bf16_path) : gdn_gemm_path();
    info->checkpoint_floats = gdn_plan_ckpt_floats(p);
    info->backward_bytes = backward_bytes(p);
    return GDN_OK;
}

/* Split columns only when there are fewer (batch, head) streams than threads; blocks stay
 * multiples of 16 so the micro-kernel runs full width. */
int gdn_column_block_width(const gdn_plan *p, int64_t streams, int width) {
    if (streams >= p->threads) return width;
    int want = (int)((p->threads + streams - 1) / streams);
    int max_blocks = width / 16 > 0 ? width / 16 : 1;
    int nb = want < max_blocks ? want : max_blocks;
    int bw = ((width + nb - 1) / nb + 15) / 16 * 16;
    return bw < width ? bw : width;
}
