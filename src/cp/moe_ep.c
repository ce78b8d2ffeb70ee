/* Expert parallelism (ep.h, DESIGN §14): the sparse MoE block with its routed experts split over
 * the ranks of a communicator. The one-rank block's steps (moe_internal.h) run unchanged; between
 * them the grouped rows travel to the ranks that hold their experts and back.
 *
 * Layout of the exchanges. A rank's grouped rows are sorted by expert, and rank d holds experts
 * [d nl, (d + 1) nl) (nl = n_experts / D), so the rows for rank d are one contiguous run: the
 * all-to-all sends them as they lie. A receiver gets, from each source in rank order, that
 * source's rows for its experts, expert by expert; it copies them expert-major (expert j's rows
 * from source 0, then source 1, ...: the token order of a sequence split over the ranks) so that
 * each expert is one GEMM, and copies the results back source-major, which is again the senders'
 * grouped order. */
#include "gdncp/ep.h"

#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cp_internal.h"
#include "moe_internal.h"

/* Each rank's header row to every rank: status, shape, the slice it holds, then its row counts
 * for the receiver's experts. Fixed width from the group size alone (so ranks that disagree on the
 * shape still exchange well-formed messages and can say so). */
enum { HDR_STATUS, HDR_E, HDR_I, HDR_N, HDR_EP_SIZE, HDR_EP_RANK, HDR_COLS };

struct gdn_ep {
    gdn_model_experts table; /* first: the model reaches the group through it (model_group.h) */
    MPI_Comm comm;
    int rank, size;
    int width;                /* HDR_COLS + the most experts a rank can hold */
    int64_t *shdr, *rhdr;     /* [size][width] */
    int *counts;              /* scount sdispl rcount rdispl, [size] each, in rows */
    int64_t *first;           /* [experts held][size]: each (expert, source) run's first row, source-major */
    int64_t *start;           /* [GDN_MOE_MAX_EXPERTS + 1]: expert-major first rows */
    float *ws;                /* grow-only workspace of the rows */
    size_t ws_cap;
    gdn_ep_stats stats;
};

static int exchange_counts(gdn_ep *ep, const gdn_moe_plan *p, int status, const char *what, int64_t *rows);

/* The model's way in for a rank that failed before its peers' next exchange (model_group.h). */
static int join(gdn_ep *ep, gdn_moe_plan *p, int status) {
    int64_t rows = 0;
    const int rc = exchange_counts(ep, p, status, "join", &rows);
    return rc ? rc : status;
}

int gdn_ep_create(gdn_ep **out, MPI_Comm comm) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "ep create: output pointer is NULL");
    *out = NULL;
    gdn_ep *ep = gdn_calloc("moe_ep: ep", 1, sizeof *ep);
    if (!ep) return gdn_fail(GDN_ERR_NOMEM, "ep context");
    if (MPI_Comm_dup(comm, &ep->comm) != MPI_SUCCESS) {
        free(ep);
        return gdn_fail(GDN_ERR_MPI, "ep create: MPI_Comm_dup failed");
    }
    MPI_Comm_rank(ep->comm, &ep->rank);
    MPI_Comm_size(ep->comm, &ep->size);
    ep->table = (gdn_model_experts){ep->size, ep->rank, gdn_moe_ep_forward, gdn_moe_ep_backward, join};
    const size_t D = (size_t)ep->size;
    ep->width = HDR_COLS + GDN_MOE_MAX_EXPERTS / ep->size;
    ep->shdr = gdn_malloc("ep.header", sizeof(int64_t) * 2 * D * (size_t)ep->width);
    ep->counts = gdn_malloc("ep.counts", sizeof(int) * 4 * D);
    ep->first = gdn_malloc("ep.first", sizeof(int64_t) * (GDN_MOE_MAX_EXPERTS + D));
    ep->start = gdn_malloc("ep.start", sizeof(int64_t) * (GDN_MOE_MAX_EXPERTS + 1));
    int local = ep->shdr && ep->counts && ep->first && ep->start ? GDN_OK : GDN_ERR_NOMEM;
    if (!local) ep->rhdr = ep->shdr + D * (size_t)ep->width;
    int worst = local;
    if (MPI_Allreduce(&local, &worst, 1, MPI_INT, MPI_MAX, ep->comm) != MPI_SUCCESS) worst = GDN_ERR_MPI;
    if (worst) {
        gdn_ep_destroy(ep);
        return gdn_fail(worst, "ep create: %s", local ? "out of memory for the headers on this rank"
                                                      : "another rank of the group failed to make its context");
    }
    *out = ep;
    return GDN_OK;
}

void gdn_ep_destroy(gdn_ep *ep) {
    if (!ep) return;
    if (ep->comm != MPI_COMM_NULL) MPI_Comm_free(&ep->comm);
    free(ep->shdr), free(ep->counts), free(ep->first), free(ep->start), free(ep->ws);
    free(ep);
}

int gdn_ep_rank(const gdn_ep *ep) { return ep ? ep->rank : -1; }
int gdn_ep_size(const gdn_ep *ep) { return ep ? ep->size : 0; }

int gdn_ep_moe_config(const gdn_ep *ep, gdn_moe_config *cfg) {
    if (!ep || !cfg) return gdn_fail(GDN_ERR_ARG, "ep moe config: %s is NULL", ep ? "cfg" : "ep");
    if (cfg->n_experts % ep->size)
        return gdn_fail(GDN_ERR_SHAPE, "ep: %d ranks do not divide the %lld experts (each rank must hold as many)",
                        ep->size, (long long)cfg->n_experts);
    cfg->ep_size = ep->size, cfg->ep_rank = ep->rank;
    return GDN_OK;
}

void gdn_ep_get_stats(gdn_ep *ep, gdn_ep_stats *stats, int reset) {
    if (!ep) return;
    if (stats) *stats = ep->stats;
    if (reset) memset(&ep->stats, 0, sizeof ep->stats);
}

/* The plan belongs to this group: its slice is this rank's. Local. */
static int check_plan(const gdn_ep *ep, const gdn_moe_plan *p, const char *what) {
    const int64_t size = p->cfg.ep_size > 1 ? p->cfg.ep_size : 1;
    if (size != ep->size || p->cfg.ep_rank != ep->rank)
        return gdn_fail(GDN_ERR_ARG, "moe ep %s: the plan holds slice %lld of %lld experts' slices but this rank is "
                        "%d of an expert group of %d (make the plan's config with gdn_ep_moe_config)", what,
                        (long long)p->cfg.ep_rank, (long long)size, ep->rank, ep->size);
    return GDN_OK;
}

/* Every rank's status, shape and row counts to every rank (one MPI_Alltoall), then the verdict,
 * the same on every rank: each sees every other's header, so a failure anywhere, or two ranks
 * whose shapes differ (each sees a header unlike its own), stops every rank. On success the
 * counts (in rows) of both all-to-alls are set and *rows is what this rank receives. */
static int exchange_counts(gdn_ep *ep, const gdn_moe_plan *p, int status, const char *what, int64_t *rows) {
    const int D = ep->size, W = ep->width;
    const int64_t nl = p->n / D;
    for (int d = 0; d < D; d++) {
        int64_t *h = ep->shdr + (size_t)d * W;
        memset(h, 0, sizeof(int64_t) * (size_t)W);
        h[HDR_STATUS] = status, h[HDR_E] = p->E, h[HDR_I] = p->I, h[HDR_N] = p->n;
        h[HDR_EP_SIZE] = p->cfg.ep_size > 1 ? p->cfg.ep_size : 1, h[HDR_EP_RANK] = p->cfg.ep_rank;
        if (!status && nl <= W - HDR_COLS)
            for (int64_t j = 0; j < nl; j++) h[HDR_COLS + j] = p->start[d * nl + j + 1] - p->start[d * nl + j];
    }
    const double t0 = MPI_Wtime();
    const int mpi = MPI_Alltoall(ep->shdr, W, MPI_INT64_T, ep->rhdr, W, MPI_INT64_T, ep->comm);
    ep->stats.exchange_s += MPI_Wtime() - t0;
    if (mpi != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "moe ep %s: MPI_Alltoall of the row counts failed", what);
    for (int s = 0; s < D; s++) {
        const int64_t *h = ep->rhdr + (size_t)s * W;
        if (h[HDR_STATUS]) {
            if (status) return status; /* this rank's own message stands */
            return gdn_fail((int)h[HDR_STATUS], "moe ep %s: rank %d of the expert group failed (%s)", what, s,
                            gdn_strerror((int)h[HDR_STATUS]));
        }
    }
    for (int s = 0; s < D; s++) {
        const int64_t *h = ep->rhdr + (size_t)s * W;
        if (h[HDR_E] != p->E || h[HDR_I] != p->I || h[HDR_N] != p->n || h[HDR_EP_SIZE] != D || h[HDR_EP_RANK] != s)
            return gdn_fail(GDN_ERR_ARG, "moe ep %s: the ranks of the expert group disagree: rank %d has E %lld, I %lld, "
                            "%lld experts, slice %lld of %lld; rank %d has E %lld, I %lld, %lld experts, slice %lld "
                            "of %lld", what, s, (long long)h[HDR_E], (long long)h[HDR_I], (long long)h[HDR_N],
                            (long long)h[HDR_EP_RANK], (long long)h[HDR_EP_SIZE], ep->rank, (long long)p->E,
                            (long long)p->I, (long long)p->n, (long long)p->cfg.ep_rank, (long long)D);
    }
    int *scount = ep->counts, *sdispl = scount + D, *rcount = sdispl + D, *rdispl = rcount + D;
    int64_t total = 0;
    for (int d = 0; d < D; d++) {
        scount[d] = (int)(p->start[(d + 1) * nl] - p->start[d * nl]);
        sdispl[d] = (int)p->start[d * nl];
        int64_t from = 0;
        for (int64_t j = 0; j < nl; j++) from += ep->rhdr[(size_t)d * W + HDR_COLS + j];
        rcount[d] = (int)from, rdispl[d] = (int)total;
        total += from;
    }
    *rows = total;
    return GDN_OK;
}

/* The workspace for `floats` floats (grown here, local), then every rank's verdict: one
 * MPI_Allreduce, so that a rank out of memory stops the group before any row moves. */
static int reserve(gdn_ep *ep, size_t floats, int64_t rows, const char *what) {
    int local = GDN_OK;
    if (rows > INT32_MAX) local = gdn_fail(GDN_ERR_SHAPE, "moe ep %s: this rank would receive %lld rows, more than "
                                           "an MPI count holds (%d)", what, (long long)rows, INT32_MAX);
    if (!local && floats > ep->ws_cap) {
        float *n = gdn_malloc("ep.rows", sizeof(float) * floats);
        if (!n) local = gdn_fail(GDN_ERR_NOMEM, "moe ep %s: %.1f MB for %lld received rows", what,
                                 4.0 * (double)floats / 1e6, (long long)rows);
        else free(ep->ws), ep->ws = n, ep->ws_cap = floats;
    }
    struct { int status, rank; } in = {local, ep->rank}, out = {0, 0};
    const double t0 = MPI_Wtime();
    const int mpi = MPI_Allreduce(&in, &out, 1, MPI_2INT, MPI_MAXLOC, ep->comm);
    ep->stats.exchange_s += MPI_Wtime() - t0;
    if (mpi != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "moe ep %s: MPI_Allreduce of the statuses failed", what);
    if (out.status && !local)
        return gdn_fail(out.status, "moe ep %s: rank %d of the expert group could not take its rows (%s)", what,
                        out.rank, gdn_strerror(out.status));
    return out.status;
}

/* The rows of width `width` floats: towards the experts (sent by scount) or back (the counts swap
 * roles). Nonblocking: the caller computes what does not need them, then finishes. */
typedef struct {
    MPI_Request rq;
    MPI_Datatype row;
    double t0;
} rows_transfer;

static int transfer_start(gdn_ep *ep, rows_transfer *t, const float *send, float *recv, int64_t width, int towards,
                          const char *what) {
    const int D = ep->size;
    int *scount = ep->counts, *sdispl = scount + D, *rcount = sdispl + D, *rdispl = rcount + D;
    if (!towards) {
        int *u = scount;
        scount = rcount, rcount = u;
        u = sdispl, sdispl = rdispl, rdispl = u;
    }
    t->t0 = MPI_Wtime();
    if (MPI_Type_contiguous((int)width, MPI_FLOAT, &t->row) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "moe ep %s: MPI_Type_contiguous of a %lld-float row failed", what, (long long)width);
    MPI_Type_commit(&t->row);
    const int mpi = MPI_Ialltoallv(send, scount, sdispl, t->row, recv, rcount, rdispl, t->row, ep->comm, &t->rq);
    double sent = 0, got = 0;
    for (int d = 0; d < D; d++) sent += scount[d], got += rcount[d];
    ep->stats.bytes_sent += 4.0 * (double)width * sent, ep->stats.bytes_recv += 4.0 * (double)width * got;
    ep->stats.exchange_s += MPI_Wtime() - t->t0;
    if (mpi != MPI_SUCCESS) {
        MPI_Type_free(&t->row);
        return gdn_fail(GDN_ERR_MPI, "moe ep %s: MPI_Ialltoallv of the rows failed", what);
    }
    return GDN_OK;
}

static int transfer_finish(gdn_ep *ep, rows_transfer *t, const char *what) {
    const double t0 = MPI_Wtime();
    const int mpi = MPI_Wait(&t->rq, MPI_STATUS_IGNORE);
    ep->stats.exchange_s += MPI_Wtime() - t0;
    MPI_Type_free(&t->row);
    return mpi == MPI_SUCCESS ? GDN_OK : gdn_fail(GDN_ERR_MPI, "moe ep %s: waiting for the rows failed", what);
}

static int transfer_rows(gdn_ep *ep, const float *send, float *recv, int64_t width, int towards, const char *what) {
    rows_transfer t;
    const int rc = transfer_start(ep, &t, send, recv, width, towards, what);
    return rc ? rc : transfer_finish(ep, &t, what);
}

/* Received rows (source-major, rdispl) to expert-major (ep->start) or back. Rows of `width`
 * floats; `to_expert` picks the direction. dst_width may be narrower (the first floats of each
 * row). The test mutations break the way back on purpose: each source's rows returned in reverse
 * order, or rank 0's returned rows zero. */
static void permute(gdn_ep *ep, const gdn_moe_plan *p, float *dst, int64_t dst_width, const float *src,
                    int64_t src_width, int to_expert) {
    const int D = ep->size, W = ep->width;
    const int64_t nl = p->n / D;
    const int *rcount = ep->counts + 2 * D, *rdispl = ep->counts + 3 * D;
    const int reverse = !to_expert && gdn_test_mutate("moe_ep.return_order");
    const int drop = !to_expert && ep->rank == 0 && gdn_test_mutate("moe_ep.drop_rows");
    for (int s = 0; s < D; s++) {
        int64_t at = rdispl[s];
        for (int64_t j = 0; j < nl; j++) ep->first[j * D + s] = at, at += ep->rhdr[(size_t)s * W + HDR_COLS + j];
    }
    /* each expert's rows are disjoint runs on both sides: the experts in parallel */
#pragma omp parallel for num_threads(p->threads) schedule(dynamic) if (ep->start[nl] >= 256)
    for (int64_t j = 0; j < nl; j++) {
        int64_t e = ep->start[j];
        for (int s = 0; s < D; s++) {
            const int64_t cnt = ep->rhdr[(size_t)s * W + HDR_COLS + j], a0 = ep->first[j * D + s];
            for (int64_t i = 0; i < cnt; i++) {
                int64_t a = a0 + i;      /* source-major */
                const int64_t b = e + i; /* expert-major */
                if (reverse) a = 2 * (int64_t)rdispl[s] + rcount[s] - 1 - a;
                const float *from = src + (to_expert ? a : b) * src_width;
                float *to = dst + (to_expert ? b : a) * dst_width;
                if (drop) memset(to, 0, sizeof(float) * (size_t)dst_width);
                else memcpy(to, from, sizeof(float) * (size_t)dst_width);
            }
            e += cnt;
        }
    }
}

/* ep->start: expert-major first rows of this rank's nl experts, from the received counts. */
static void expert_starts(gdn_ep *ep, int64_t nl) {
    ep->start[0] = 0;
    for (int64_t j = 0; j < nl; j++) {
        int64_t r = 0;
        for (int s = 0; s < ep->size; s++) r += ep->rhdr[(size_t)s * ep->width + HDR_COLS + j];
        ep->start[j + 1] = ep->start[j] + r;
    }
}

static size_t pad16(size_t n) { return (n + 15) & ~(size_t)15; }

int gdn_moe_ep_forward(gdn_ep *ep, gdn_moe_plan *p, float *y, float *saved, const float *x, const float *w,
                       double *stats) {
    if (!ep || !p) return gdn_fail(GDN_ERR_ARG, "moe ep forward: %s is NULL", ep ? "plan" : "ep");
    int rc = !y ? gdn_fail(GDN_ERR_ARG, "moe ep forward: output 'y' is NULL")
           : !w ? gdn_fail(GDN_ERR_ARG, "moe ep forward: weights 'w' are NULL")
                : check_plan(ep, p, "forward");
    const int64_t E = p->E, I = p->I, nl = p->n / ep->size;
    gdn_moe_saved s = gdn_moe_saved_view(p, saved ? saved : p->scratch_saved);
    if (!rc) rc = gdn_moe_route(p, &s, x, w, stats, NULL, NULL);
    int64_t R = 0;
    if ((rc = exchange_counts(ep, p, rc, "forward", &R))) return rc;
    const size_t nr = (size_t)R;
    if ((rc = reserve(ep, 2 * pad16(nr * E) + pad16(nr * 2 * I) + pad16(nr * I), R, "forward"))) return rc;
    float *cur = ep->ws, *rows = gdn_carve(&cur, nr * E), *xe = gdn_carve(&cur, nr * E),
          *gu = gdn_carve(&cur, nr * 2 * I), *m = gdn_carve(&cur, nr * I);
    rows_transfer t; /* the shared expert runs while the rows travel */
    if ((rc = transfer_start(ep, &t, p->xg, rows, E, 1, "forward"))) return rc;
    gdn_moe_shared_forward(p, y, &s, x, w);
    if ((rc = transfer_finish(ep, &t, "forward"))) return rc;
    const double t0 = MPI_Wtime();
    expert_starts(ep, nl);
    permute(ep, p, xe, E, rows, E, 1);
    gdn_moe_experts_forward(p, nl, ep->start, w + p->off[GDN_MOE_GATE_UP], w + p->off[GDN_MOE_DOWN], xe, E, gu, m, xe);
    permute(ep, p, rows, E, xe, E, 0);
    ep->stats.experts_s += MPI_Wtime() - t0;
    if ((rc = transfer_rows(ep, rows, p->dyg, E, 0, "forward"))) return rc;
    gdn_moe_combine(p, y, &s, p->dyg);
    ep->stats.rows_owned += (double)R, ep->stats.rows_routed += (double)p->NK, ep->stats.calls++;
    return GDN_OK;
}

int gdn_moe_ep_backward(gdn_ep *ep, gdn_moe_plan *p, float *dx, float *dw, const float *x, const float *w,
                        const float *saved, const float *dy, const float *aux_dp) {
    if (!ep || !p) return gdn_fail(GDN_ERR_ARG, "moe ep backward: %s is NULL", ep ? "plan" : "ep");
    int rc = !dx ? gdn_fail(GDN_ERR_ARG, "moe ep backward: output 'dx' is NULL")
           : !dw ? gdn_fail(GDN_ERR_ARG, "moe ep backward: output 'dw' is NULL")
           : !w ? gdn_fail(GDN_ERR_ARG, "moe ep backward: weights 'w' are NULL")
           : !saved ? gdn_fail(GDN_ERR_ARG, "moe ep backward: 'saved' is NULL (run the forward with saved)")
                    : check_plan(ep, p, "backward");
    const int64_t E = p->E, I = p->I, k = p->k, NK = p->NK, nl = p->n / ep->size, wide = 2 * E + 1;
    gdn_moe_saved s;
    memset(&s, 0, sizeof s);
    if (!rc) s = gdn_moe_saved_view(p, (float *)saved);
    if (!rc) rc = gdn_moe_backward_begin(p, &s, x, dy);
    int64_t R = 0;
    if ((rc = exchange_counts(ep, p, rc, "backward", &R))) return rc;
    const size_t nr = (size_t)R, nk = (size_t)NK;
    const size_t need = pad16(nk * wide) + 2 * pad16(nr * wide) + 2 * pad16(nr * 2 * I) + 2 * pad16(nr * I) +
                        2 * pad16(nr) + pad16(nr * (E + 1)) + pad16(nk * (E + 1));
    if ((rc = reserve(ep, need, R, "backward"))) return rc;
    float *cur = ep->ws, *out = gdn_carve(&cur, nk * wide), *rows = gdn_carve(&cur, nr * wide),
          *xe = gdn_carve(&cur, nr * wide), *gu = gdn_carve(&cur, nr * 2 * I), *dgu = gdn_carve(&cur, nr * 2 * I),
          *m = gdn_carve(&cur, nr * I), *dm = gdn_carve(&cur, nr * I), *wt = gdn_carve(&cur, nr),
          *c = gdn_carve(&cur, nr), *back = gdn_carve(&cur, nr * (E + 1)), *got = gdn_carve(&cur, nk * (E + 1));
    /* each grouped row's [x | dy | weight] to its expert's owner */
#pragma omp parallel for num_threads(p->threads) schedule(static) if (NK >= 256)
    for (int64_t r = 0; r < NK; r++) {
        const int64_t t = p->tok[r] / k;
        float *o = out + r * wide;
        memcpy(o, x + t * E, sizeof(float) * (size_t)E);
        memcpy(o + E, dy + t * E, sizeof(float) * (size_t)E);
        o[2 * E] = p->wr[r];
    }
    if ((rc = transfer_rows(ep, out, rows, wide, 1, "backward"))) return rc;
    const double t0 = MPI_Wtime();
    expert_starts(ep, nl);
    permute(ep, p, xe, wide, rows, wide, 1);
    for (int64_t r = 0; r < R; r++) wt[r] = xe[r * wide + 2 * E];
    const float *GU = w + p->off[GDN_MOE_GATE_UP], *D = w + p->off[GDN_MOE_DOWN];
    gdn_moe_experts_forward(p, nl, ep->start, GU, D, xe, wide, gu, m, NULL); /* recompute gate/up */
    gdn_moe_experts_backward(p, nl, ep->start, GU, D, dw + p->off[GDN_MOE_GATE_UP], dw + p->off[GDN_MOE_DOWN], xe,
                             wide, gu, xe + E, wide, wt, m, dm, dgu, c, xe + E);
    /* [dx | c] per row, back in the senders' order */
    for (int64_t r = 0; r < R; r++) { /* in place, in order: row r's target ends before row r + 1's source */
        memmove(xe + r * (E + 1), xe + r * wide + E, sizeof(float) * (size_t)E);
        xe[r * (E + 1) + E] = c[r];
    }
    permute(ep, p, back, E + 1, xe, E + 1, 0);
    ep->stats.experts_s += MPI_Wtime() - t0;
    if ((rc = transfer_rows(ep, back, got, E + 1, 0, "backward"))) return rc;
    gdn_moe_router_shared_backward(p, dx, dw, x, w, &s, dy, aux_dp, got, E + 1, got + E, E + 1);
    ep->stats.rows_owned += (double)R, ep->stats.rows_routed += (double)NK, ep->stats.calls++;
    return GDN_OK;
}
