/* The causal conv's halo across ranks (DESIGN §4): each rank needs the `rows` token rows that
 * precede its shard in the global sequence. They may belong to several predecessors when those
 * hold fewer than `rows` tokens, so every rank learns every shard's length and exchanges exactly
 * the overlapping rows point to point. MPI derived datatypes describe the strided rows on both
 * sides: nothing is packed or allocated in the forward. The backward is the adjoint: the halo's
 * gradient goes back to the owners, which add it to their rows. */
#include "cp_internal.h"

#include <limits.h>
#include <string.h>

enum { HALO_TAG = 11 };

/* Agree on B, width and rows; learn every shard's length (cp->shard_T) and this rank's start. */
static int halo_agree(gdn_cp *cp, int64_t B, int64_t T_local, int64_t width, int64_t rows,
                      int local, int64_t *start) {
    enum { NSIG = 5 };
    const int64_t sig[NSIG] = {T_local, B, width, rows, local};
    _Static_assert((int)NSIG <= (int)GDN_CP_AGREE_COLS, "the agreement table is preallocated for GDN_CP_AGREE_COLS values");
    int64_t *all = cp->agree_tab + GDN_CP_AGREE_COLS; /* preallocated (gdn_cp_create) */
    const double t0 = MPI_Wtime();
    const int mrc = MPI_Allgather(sig, NSIG, MPI_INT64_T, all, NSIG, MPI_INT64_T, cp->comm);
    cp->stats.comm_s += MPI_Wtime() - t0;
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Allgather failed (cp halo)");
    static const char *names[NSIG] = {"T", "B", "halo width", "halo rows"};
    int rc = local; /* a failure anywhere first: this rank's keeps its own message */
    if (!rc && rows > GDN_MAX_CONV)
        rc = gdn_fail(GDN_ERR_SHAPE, "cp halo of %lld rows (at most %d)", (long long)rows, GDN_MAX_CONV);
    for (int r = 0; r < cp->size && !rc; r++)
        if (all[r * NSIG + 4])
            rc = gdn_fail((int)all[r * NSIG + 4], "rank %d failed (%s); see its message", r,
                          gdn_strerror((int)all[r * NSIG + 4]));
    *start = 0;
    for (int r = 0; r < cp->size && !rc; r++) {
        cp->shard_T[r] = all[r * NSIG];
        if (r < cp->rank) *start += cp->shard_T[r];
        for (int i = 1; i < 4 && !rc; i++)
            if (all[r * NSIG + i] != all[i])
                rc = gdn_fail(GDN_ERR_MPI, "ranks disagree on %s: rank %d has %lld, rank 0 has %lld",
                              names[i], r, (long long)all[r * NSIG + i], (long long)all[i]);
    }
    return rc;
}

/* Rows [lo, hi) of the global sequence that rank s holds and rank r's halo needs. */
static void overlap(const gdn_cp *cp, int s, int r, int64_t rows, int64_t *lo, int64_t *hi) {
    int64_t ts = 0, tr = 0;
    for (int i = 0; i < s; i++) ts += cp->shard_T[i];
    for (int i = 0; i < r; i++) tr += cp->shard_T[i];
    const int64_t need_lo = tr - rows > 0 ? tr - rows : 0;
    *lo = ts > need_lo ? ts : need_lo;
    *hi = ts + cp->shard_T[s] < tr ? ts + cp->shard_T[s] : tr;
}

/* Rows [lo, hi) (local indices) of x for every batch row: n rows of `width` floats at row stride
 * `stride`, batch rows T_local * stride apart. */
static int rows_type(MPI_Datatype *type, int64_t B, int64_t n, int64_t width, int64_t stride,
                     int64_t batch_stride) {
    if (n * width > INT_MAX || stride > INT_MAX || B > INT_MAX)
        return gdn_fail(GDN_ERR_SHAPE, "cp halo: %lld rows of %lld floats exceed MPI's int counts",
                        (long long)n, (long long)width);
    MPI_Datatype rowblock;
    if (GDN_CP_MPI_TYPE("cp halo: MPI datatype", MPI_Type_vector((int)n, (int)width, (int)stride, MPI_FLOAT, &rowblock)) !=
        MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Type_vector failed (cp halo)");
    int mrc = MPI_Type_create_hvector((int)B, 1, (MPI_Aint)(batch_stride * sizeof(float)), rowblock, type);
    MPI_Type_free(&rowblock);
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI datatype for the cp halo failed");
    if (MPI_Type_commit(type) != MPI_SUCCESS) {
        MPI_Type_free(type);
        return gdn_fail(GDN_ERR_MPI, "MPI_Type_commit failed (cp halo)");
    }
    return GDN_OK;
}

/* The nonblocking messages of one exchange: at most `rows` peers on each side. Every message's
 * datatype is made first (describe_*), then the ranks agree that all of theirs were (a local
 * MPI failure would otherwise leave a peer waiting for a message never sent), then all are
 * posted (post) and waited for (finish). */
enum { MAX_MSGS = 2 * GDN_MAX_CONV + 2 };
typedef struct {
    MPI_Request req[MAX_MSGS];
    MPI_Datatype type[MAX_MSGS];
    void *buf[MAX_MSGS];
    int peer[MAX_MSGS], send[MAX_MSGS];
    uint64_t bytes[MAX_MSGS];
    int n;
} requests;

static int add_msg(requests *rq, void *buf, int peer, int send, int64_t B, int64_t n, int64_t width, int64_t stride,
                   int64_t batch_stride) {
    GDN_ASSERT(rq->n < MAX_MSGS);
    const int rc = rows_type(&rq->type[rq->n], B, n, width, stride, batch_stride);
    if (rc) return rc;
    rq->buf[rq->n] = buf, rq->peer[rq->n] = peer, rq->send[rq->n] = send;
    rq->bytes[rq->n] = 4 * (uint64_t)(B * n * width);
    rq->req[rq->n] = MPI_REQUEST_NULL;
    rq->n++;
    return GDN_OK;
}

/* The messages between this rank's halo region (halo [B, rows, width], the global rows
 * [start - rows, start)) and the predecessors holding those rows: receives in the forward,
 * sends of the halo's gradient in the backward. */
static int describe_halo_side(gdn_cp *cp, requests *rq, float *halo, int64_t B, int64_t width, int64_t rows,
                              int64_t start, int send) {
    int rc = GDN_OK;
    for (int s = cp->rank - 1; s >= 0 && !rc; s--) {
        int64_t lo, hi;
        overlap(cp, s, cp->rank, rows, &lo, &hi);
        if (hi <= lo) continue;
        rc = add_msg(rq, halo + (lo - (start - rows)) * width, s, send, B, hi - lo, width, width, rows * width);
    }
    return rc;
}

/* Post every described message. A failing post is recorded (its request stays null) and the
 * others still go, so that as few peers as possible wait on this rank. */
static int post(gdn_cp *cp, requests *rq) {
    int rc = GDN_OK;
    for (int i = 0; i < rq->n; i++) {
        const int mrc = rq->send[i] ? MPI_Isend(rq->buf[i], 1, rq->type[i], rq->peer[i], HALO_TAG, cp->comm, &rq->req[i])
                                    : MPI_Irecv(rq->buf[i], 1, rq->type[i], rq->peer[i], HALO_TAG, cp->comm, &rq->req[i]);
        if (mrc != MPI_SUCCESS) {
            rq->req[i] = MPI_REQUEST_NULL;
            if (!rc) rc = gdn_fail(GDN_ERR_MPI, "cp halo: %s rank %d failed", rq->send[i] ? "MPI_Isend to" : "MPI_Irecv from",
                                   rq->peer[i]);
            continue;
        }
        if (rq->send[i]) cp->stats.bytes_sent += rq->bytes[i], cp->stats.messages++;
        else cp->stats.bytes_recv += rq->bytes[i];
    }
    return rc;
}

/* Wait for every posted message and free their datatypes. */
static int finish(gdn_cp *cp, requests *rq, int rc, double t0, const char *what) {
    const int mrc = gdn_cp_wait_all(cp, rq->n, rq->req);
    for (int i = 0; i < rq->n; i++) MPI_Type_free(&rq->type[i]);
    rq->n = 0;
    cp->stats.comm_s += MPI_Wtime() - t0;
    return !rc && mrc != MPI_SUCCESS ? gdn_fail(GDN_ERR_MPI, "%s failed", what) : rc;
}

int gdn_cp_halo_forward(gdn_cp *cp, float *halo, const float *x, int64_t B, int64_t T_local,
                        int64_t width, int64_t row_stride, int64_t rows, int local_status) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp is NULL");
    int64_t start;
    int rc = halo_agree(cp, B, T_local, width, rows, local_status, &start);
    if (rc) return rc;
    if (B * rows * width > 0) memset(halo, 0, sizeof(float) * B * rows * width);
    requests rq = {.n = 0};
    /* receive from the predecessors that hold my halo rows (at most `rows` of them) */
    rc = describe_halo_side(cp, &rq, halo, B, width, rows, start, 0);
    /* send my rows to the successors whose halo they are */
    for (int r = cp->rank + 1; r < cp->size && !rc; r++) {
        int64_t lo, hi;
        overlap(cp, cp->rank, r, rows, &lo, &hi);
        if (hi <= lo) continue;
        rc = add_msg(&rq, (void *)(x + (lo - start) * row_stride), r, 1, B, hi - lo, width, row_stride,
                     T_local * row_stride);
    }
    const double t0 = MPI_Wtime();
    rc = gdn_cp_agree_status(cp, rc); /* every rank's messages described, or none is posted */
    if (!rc) rc = post(cp, &rq);
    rc = finish(cp, &rq, rc, t0, "cp halo exchange");
    if (B * rows * width > 0 && gdn_test_mutate("cp: conv halo dropped"))
        memset(halo, 0, sizeof(float) * B * rows * width);
    return gdn_cp_agree_status(cp, rc);
}

int gdn_cp_halo_backward(gdn_cp *cp, float *dx, const float *dhalo, int64_t B, int64_t T_local,
                         int64_t width, int64_t row_stride, int64_t rows, int local_status) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp is NULL");
    const int drop_grad = gdn_test_mutate("cp: conv halo gradient dropped");
    /* the buffer for the successors' gradients, before the first collective */
    float *buf = local_status || B * rows * width < 0 ? NULL : gdn_cp_scratch(cp, (size_t)(B * rows * width));
    if (!local_status && !buf) local_status = gdn_fail(GDN_ERR_NOMEM, "cp halo gradient buffer");
    int64_t start;
    int rc = halo_agree(cp, B, T_local, width, rows, local_status, &start);
    if (rc) return rc;
    requests rq = {.n = 0};
    /* my halo's gradient back to its owners */
    rc = describe_halo_side(cp, &rq, (float *)dhalo, B, width, rows, start, 1);
    const double t0 = MPI_Wtime();
    rc = gdn_cp_agree_status(cp, rc); /* every rank's messages described, or none is posted */
    if (!rc) rc = post(cp, &rq);
    /* the successors' gradients of my rows, one at a time through the buffer, added (every
     * rank reached this point: the sends they wait for are posted) */
    for (int r = cp->rank + 1; r < cp->size && !rc; r++) {
        int64_t lo, hi;
        overlap(cp, cp->rank, r, rows, &lo, &hi);
        if (hi <= lo) continue;
        const int64_t n = hi - lo;
        if (MPI_Recv(buf, (int)(B * n * width), MPI_FLOAT, r, HALO_TAG, cp->comm, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
            rc = gdn_fail(GDN_ERR_MPI, "cp halo gradient receive from rank %d failed", r);
            break;
        }
        cp->stats.bytes_recv += 4 * (uint64_t)(B * n * width);
        if (drop_grad) continue;
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < n; i++) {
                float *dst = dx + (b * T_local + lo - start + i) * row_stride;
                const float *src = buf + (b * n + i) * width;
                for (int64_t c = 0; c < width; c++) dst[c] += src[c];
            }
    }
    rc = finish(cp, &rq, rc, t0, "cp halo gradient exchange");
    return gdn_cp_agree_status(cp, rc);
}
