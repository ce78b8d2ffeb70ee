/* The `heads` strategy: all-to-all from sequence-parallel to head-parallel (rank j gets whole
 * sequences of key heads [j Hk/D, (j+1) Hk/D) and their value heads), the single-rank kernel,
 * and all-to-all back. Two collectives each way per tensor; needs D | Hk. The state entering
 * each shard is never formed here, so s_in and ds_in (beyond rank 0's dh0) are left zero.
 *
 * Packed documents (cu_seqlens, B = 1): after the exchange a rank holds the whole stream for its
 * heads, so the single-rank packed kernel runs over all of it with the whole offsets (seq_offset
 * 0). The per-document states [n_docs, Hv, K, V] are placed as the other strategies place them:
 * document d's h0 is read on the rank where d starts and its dht on the rank where d ends (each
 * sends every rank that rank's head block of them, one all-to-all); every document's final state
 * and dh0 are gathered on every rank; s_in is zero (ds_in carries every document's dh0). */
#include "cp_internal.h"

#include <limits.h>
#include <math.h>
#include <string.h>

/* The three row widths that travel: q and k (Hk/D * K floats per token), v and the outputs
 * (Hv/D * V), g and beta (Hv/D). */
enum { N_ROWS = 3 };

typedef struct {
    int64_t B, T_total, *t_off; /* t_off[r]: first global token of rank r */
    int *scount, *sdispl, *rcount, *rdispl; /* in rows (see gdn_cp_heads_counts) */
    int64_t row_floats[N_ROWS];
    MPI_Datatype row_type[N_ROWS]; /* one row: row_floats[i] contiguous floats */
    MPI_Datatype block_type;       /* one state row's head block: Hv/D * K * V floats */
    int64_t state_rows;            /* rows of h0/ht/dht/dh0: B, or n_docs when packed */
    float *sbuf, *rbuf;            /* the largest exchange's, so no exchange allocates */
    float *state;                  /* a whole state [state_rows, Hv, K, V], packed by head block */
} layout;

/* The all-to-alls count in rows (one token of one batch row over this rank's heads, an MPI type
 * of its own), not floats: MPI's int counts and displacements then reach 2^31 token rows rather
 * than 2^31 floats (which at Hv = 32, V = 128 was 2M tokens over any number of ranks). The
 * states are scattered and gathered in int counts of floats. Decided from the agreed shard
 * sizes and shapes alone, so every rank refuses alike and no rank skips a collective. */
int gdn_cp_heads_check(int D, const int64_t *shard_T, int64_t B, int64_t Hk, int64_t Hv, int64_t K,
                       int64_t V) {
    if (Hk % D)
        return gdn_fail(GDN_ERR_SHAPE, "strategy 'heads' needs the rank count (%d) to divide Hk (%lld)", D,
                        (long long)Hk);
    int64_t T_total = 0, T_max = 0; /* (each T_r and their sum were checked against overflow) */
    for (int r = 0; r < D; r++) T_total += shard_T[r], T_max = shard_T[r] > T_max ? shard_T[r] : T_max;
    /* a rank's send buffer towards the heads (and its receive buffer back) holds D blocks of
     * B * T_r rows; the other side B * T_total rows */
    const double per_rank = (double)D * (double)T_max > (double)T_total ? (double)D * (double)T_max : (double)T_total;
    if ((double)B * per_rank > INT_MAX)
        return gdn_fail(GDN_ERR_SHAPE,
                        "strategy 'heads': an all-to-all of %.0f token rows (B = %lld x %.0f; T = %lld over %d ranks, "
                        "the largest shard %lld) exceeds MPI's int count %d; use strategy scan (it sends only states)",
                        (double)B * per_rank, (long long)B, per_rank, (long long)T_total, D, (long long)T_max, INT_MAX);
    const double row = fmax((double)(Hk / D) * (double)K, (double)(Hv / D) * (double)V);
    if (row > INT_MAX)
        return gdn_fail(GDN_ERR_SHAPE, "strategy 'heads': one token's row of a rank's heads is %.0f floats, more "
                        "than MPI's int count %d", row, INT_MAX);
    const double state = (double)B * (double)(Hv / D) * (double)K * (double)V;
    if (state > INT_MAX)
        return gdn_fail(GDN_ERR_SHAPE,
                        "strategy 'heads': a rank's share of the state, B x Hv/D x K x V = %lld x %lld x %lld x %lld "
                        "= %.0f floats, exceeds MPI's int count %d; use more ranks or strategy scan",
                        (long long)B, (long long)(Hv / D), (long long)K, (long long)V, state, INT_MAX);
    return GDN_OK;
}

void gdn_cp_heads_counts(int D, const int64_t *shard_T, int rank, int64_t B, int towards_heads,
                         int *scount, int *sdispl, int *rcount, int *rdispl) {
    int64_t sn = 0, rn = 0;
    for (int j = 0; j < D; j++) {
        const int64_t send = B * (towards_heads ? shard_T[rank] : shard_T[j]);
        const int64_t recv = B * (towards_heads ? shard_T[j] : shard_T[rank]);
        GDN_ASSERT(sn + send <= INT_MAX && rn + recv <= INT_MAX); /* refused by gdn_cp_heads_check */
        scount[j] = (int)send, sdispl[j] = (int)sn, sn += send;
        rcount[j] = (int)recv, rdispl[j] = (int)rn, rn += recv;
    }
}

/* Everything the exchanges need, allocated before the caller's agreement step: a failure here
 * is local (memory), and the agreement turns it into an error on every rank. */
static int layout_init(gdn_cp *cp, layout *L, const gdn_config *c) {
    const int D = cp->size;
    memset(L, 0, sizeof *L);
    for (int i = 0; i < N_ROWS; i++) L->row_type[i] = MPI_DATATYPE_NULL;
    L->block_type = MPI_DATATYPE_NULL;
    L->B = c->B, L->state_rows = c->cu_seqlens ? c->n_docs : c->B;
    L->row_floats[0] = c->Hk / D * c->K, L->row_floats[1] = c->Hv / D * c->V, L->row_floats[2] = c->Hv / D;
    L->t_off = gdn_calloc("cp heads: token offsets", D + 1, sizeof(int64_t));
    L->scount = gdn_calloc("cp heads: counts", 4 * (size_t)D, sizeof(int));
    if (!L->t_off || !L->scount) return gdn_fail(GDN_ERR_NOMEM, "heads layout");
    L->sdispl = L->scount + D, L->rcount = L->sdispl + D, L->rdispl = L->rcount + D;
    int64_t T_max = 0;
    for (int r = 0; r < D; r++)
        L->t_off[r + 1] = L->t_off[r] + cp->shard_T[r], T_max = cp->shard_T[r] > T_max ? cp->shard_T[r] : T_max;
    L->T_total = L->t_off[D];
    /* (a type the fault hook refused was never made: its handle stays MPI_DATATYPE_NULL; one made
     * but not committed is freed by layout_free) */
    for (int i = 0; i < N_ROWS; i++) {
        MPI_Datatype t;
        if (GDN_CP_MPI_TYPE("cp heads: MPI datatype", MPI_Type_contiguous((int)L->row_floats[i], MPI_FLOAT, &t)) !=
            MPI_SUCCESS)
            return gdn_fail(GDN_ERR_MPI, "MPI_Type_contiguous of a %lld-float row failed", (long long)L->row_floats[i]);
        L->row_type[i] = t;
        if (MPI_Type_commit(&L->row_type[i]) != MPI_SUCCESS)
            return gdn_fail(GDN_ERR_MPI, "MPI_Type_commit of a %lld-float row failed", (long long)L->row_floats[i]);
    }
    const int64_t block = c->Hv / D * c->K * c->V; /* (fits an int: gdn_cp_heads_check) */
    MPI_Datatype t;
    if (GDN_CP_MPI_TYPE("cp heads: MPI datatype", MPI_Type_contiguous((int)block, MPI_FLOAT, &t)) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Type_contiguous of a %lld-float state block failed", (long long)block);
    L->block_type = t;
    if (MPI_Type_commit(&L->block_type) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Type_commit of a %lld-float state block failed", (long long)block);
    const int64_t rows = c->B * (D * T_max > L->T_total ? D * T_max : L->T_total);
    const int64_t widest = L->row_floats[0] > L->row_floats[1] ? L->row_floats[0] : L->row_floats[1];
    const size_t n = (size_t)(rows * widest), nstate = (size_t)(L->state_rows * c->Hv * c->K * c->V);
    L->sbuf = gdn_malloc("cp heads: send buffer", sizeof(float) * n);
    L->rbuf = gdn_malloc("cp heads: receive buffer", sizeof(float) * n);
    L->state = gdn_malloc("cp heads: state buffer", sizeof(float) * nstate);
    if (!L->sbuf || !L->rbuf || !L->state)
        return gdn_fail(GDN_ERR_NOMEM, "heads exchange buffers (2 x %zu + %zu floats)", n, nstate);
    return GDN_OK;
}

static void layout_free(layout *L) {
    for (int i = 0; i < N_ROWS; i++)
        if (L->row_type[i] != MPI_DATATYPE_NULL) MPI_Type_free(&L->row_type[i]);
    if (L->block_type != MPI_DATATYPE_NULL) MPI_Type_free(&L->block_type);
    free(L->t_off), free(L->scount), free(L->sbuf), free(L->rbuf), free(L->state);
}

/* One all-to-all of rows of `row` floats (one of the layout's widths), counts set. */
static int alltoallv(gdn_cp *cp, layout *L, int64_t row) {
    const int D = cp->size;
    int w = 0;
    while (w < N_ROWS - 1 && L->row_floats[w] != row) w++;
    GDN_ASSERT(L->row_floats[w] == row);
    double t0 = MPI_Wtime();
    int mrc = MPI_Alltoallv(L->sbuf, L->scount, L->sdispl, L->row_type[w], L->rbuf, L->rcount, L->rdispl,
                            L->row_type[w], cp->comm);
    cp->stats.comm_s += MPI_Wtime() - t0;
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Alltoallv failed");
    for (int j = 0; j < D; j++)
        if (j != cp->rank)
            cp->stats.bytes_sent += 4 * (uint64_t)L->scount[j] * (uint64_t)row,
            cp->stats.bytes_recv += 4 * (uint64_t)L->rcount[j] * (uint64_t)row;
    cp->stats.messages += D - 1, cp->stats.rounds++;
    return GDN_OK;
}

/* Counts and displacements of one all-to-all, in rows. Towards heads every rank sends its T_r
 * rows to each rank and receives T_j from rank j; back towards the sequence it is the other way
 * round. */
static void set_exchange(gdn_cp *cp, layout *L, int towards_heads) {
    gdn_cp_heads_counts(cp->size, cp->shard_T, cp->rank, L->B, towards_heads, L->scount, L->sdispl, L->rcount,
                        L->rdispl);
}

/* src [B, T_r, H, inner] on every rank -> dst [B, T_total, H/D, inner] (this rank's heads). */
static int to_heads(gdn_cp *cp, layout *L, const float *src, int64_t H, int64_t inner, float *dst) {
    const int D = cp->size, me = cp->rank;
    const int64_t Hl = H / D, row = Hl * inner, Tr = cp->shard_T[me], B = L->B;
    int rc;
    set_exchange(cp, L, 1);
    for (int j = 0; j < D; j++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < Tr; t++)
                memcpy(L->sbuf + (L->sdispl[j] + b * Tr + t) * row, src + ((b * Tr + t) * H + j * Hl) * inner,
                       sizeof(float) * row);
    if ((rc = alltoallv(cp, L, row))) return rc;
    for (int i = 0; i < D; i++)
        for (int64_t b = 0; b < B; b++)
            memcpy(dst + (b * L->T_total + L->t_off[i]) * row, L->rbuf + (L->rdispl[i] + b * cp->shard_T[i]) * row,
                   sizeof(float) * cp->shard_T[i] * row);
    return GDN_OK;
}

/* src [B, T_total, H/D, inner] (this rank's heads) -> dst [B, T_r, H, inner]. */
static int to_sequence(gdn_cp *cp, layout *L, const float *src, int64_t H, int64_t inner, float *dst) {
    const int D = cp->size, me = cp->rank;
    const int64_t Hl = H / D, row = Hl * inner, Tr = cp->shard_T[me], B = L->B;
    int rc;
    set_exchange(cp, L, 0);
    for (int j = 0; j < D; j++)
        for (int64_t b = 0; b < B; b++)
            memcpy(L->sbuf + (L->sdispl[j] + b * cp->shard_T[j]) * row, src + (b * L->T_total + L->t_off[j]) * row,
                   sizeof(float) * cp->shard_T[j] * row);
    if ((rc = alltoallv(cp, L, row))) return rc;
    for (int i = 0; i < D; i++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < Tr; t++)
                memcpy(dst + ((b * Tr + t) * H + i * Hl) * inner, L->rbuf + (L->rdispl[i] + b * Tr + t) * row,
                       sizeof(float) * row);
    return GDN_OK;
}

/* A state [B, Hv, K, V] held by `root` -> this rank's head block [B, Hv/D, K, V]; a NULL on the
 * root gives zeros everywhere (*present = 0). */
static int scatter_state(gdn_cp *cp, layout *L, const float *full, int root, int64_t B, int64_t Hv, int64_t KV,
                         float *mine, int *present) {
    const int D = cp->size;
    const int64_t Hl = Hv / D, blk = B * Hl * KV;
    int have = full != NULL;
    if (MPI_Bcast(&have, 1, MPI_INT, root, cp->comm) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Bcast failed (whether rank %d holds the state)", root);
    *present = have;
    if (!have) {
        memset(mine, 0, sizeof(float) * blk);
        return GDN_OK;
    }
    float *pack = cp->rank == root ? L->state : NULL;
    if (pack)
        for (int j = 0; j < D; j++)
            for (int64_t b = 0; b < B; b++)
                memcpy(pack + j * blk + b * Hl * KV, full + (b * Hv + j * Hl) * KV, sizeof(float) * Hl * KV);
    double t0 = MPI_Wtime(); /* (blk fits an int: gdn_cp_heads_check) */
    int mrc = MPI_Scatter(pack, (int)blk, MPI_FLOAT, mine, (int)blk, MPI_FLOAT, root, cp->comm);
    cp->stats.comm_s += MPI_Wtime() - t0;
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Scatter failed");
    if (cp->rank == root) cp->stats.bytes_sent += 4 * (uint64_t)blk * (D - 1);
    else cp->stats.bytes_recv += 4 * (uint64_t)blk;
    return GDN_OK;
}

/* Head blocks [B, Hv/D, K, V] of every rank -> the full state on `root` (root < 0: all ranks).
 * B: rows of states (batch rows, or documents when packed), counted in head blocks. */
static int gather_state(gdn_cp *cp, layout *L, const float *mine, int root, int64_t B, int64_t Hv, int64_t KV,
                        float *full) {
    const int D = cp->size;
    const int64_t Hl = Hv / D, blk = B * Hl * KV;
    float *all = root < 0 || cp->rank == root ? L->state : NULL;
    double t0 = MPI_Wtime(); /* (B fits an int: gdn_cp_heads_check, packed_check) */
    int mrc = root < 0 ? MPI_Allgather(mine, (int)B, L->block_type, all, (int)B, L->block_type, cp->comm)
                       : MPI_Gather(mine, (int)B, L->block_type, all, (int)B, L->block_type, root, cp->comm);
    cp->stats.comm_s += MPI_Wtime() - t0;
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Gather of the state failed");
    if (root < 0 || cp->rank != root) cp->stats.bytes_sent += 4 * (uint64_t)blk * (root < 0 ? D - 1 : 1);
    if (root < 0 || cp->rank == root) cp->stats.bytes_recv += 4 * (uint64_t)blk * (D - 1);
    if (all && full)
        for (int j = 0; j < D; j++)
            for (int64_t b = 0; b < B; b++)
                memcpy(full + (b * Hv + j * Hl) * KV, all + j * blk + b * Hl * KV, sizeof(float) * Hl * KV);
    return GDN_OK;
}

/* Packed: the documents whose h0 (ending = 0: they start on this rank) or dht (ending = 1: they
 * end here) this rank owns go to every rank as that rank's head blocks, so each rank ends with
 * mine [n_docs, Hv/D, K, V] of its heads. full may be NULL on a rank (its documents' states are
 * zeros); *present: whether any rank gave one (agreed; when none did, mine is not touched). */
static int docs_to_heads(gdn_cp *cp, layout *L, const gdn_config *c, const float *full, int ending,
                         float *mine, int *present) {
    const int D = cp->size, me = cp->rank;
    const int64_t Hl = c->Hv / D, KV = c->K * c->V, blk = Hl * KV;
    int have = full != NULL, any = 0;
    double t0 = MPI_Wtime();
    int mrc = MPI_Allreduce(&have, &any, 1, MPI_INT, MPI_MAX, cp->comm);
    cp->stats.comm_s += MPI_Wtime() - t0;
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Allreduce failed (per-document states)");
    *present = any;
    if (!any) return GDN_OK;
    int *count = L->scount, *displ = L->sdispl; /* reused: set again before every row exchange */
    gdn_cp_doc_ranges(cp, c, ending, L->rcount, L->rdispl); /* what every rank owns: received as is */
    const int n_me = L->rcount[me];
    const int64_t d_me = L->rdispl[me];
    for (int j = 0; j < D; j++) {
        count[j] = n_me, displ[j] = j * n_me; /* (D x n_docs fits an int: packed_check) */
        for (int64_t i = 0; i < n_me; i++) {
            float *dst = L->state + (j * (int64_t)n_me + i) * blk;
            if (full) memcpy(dst, full + ((d_me + i) * c->Hv + j * Hl) * KV, sizeof(float) * blk);
            else memset(dst, 0, sizeof(float) * blk);
        }
    }
    t0 = MPI_Wtime();
    mrc = MPI_Alltoallv(L->state, count, displ, L->block_type, mine, L->rcount, L->rdispl, L->block_type, cp->comm);
    cp->stats.comm_s += MPI_Wtime() - t0;
    if (mrc != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Alltoallv failed (per-document %s)", ending ? "dht" : "h0");
    for (int j = 0; j < D; j++)
        if (j != me)
            cp->stats.bytes_sent += 4 * (uint64_t)n_me * (uint64_t)blk,
            cp->stats.bytes_recv += 4 * (uint64_t)L->rcount[j] * (uint64_t)blk;
    cp->stats.messages += D - 1, cp->stats.rounds++;
    return GDN_OK;
}

/* Packed streams: what the per-document exchanges count in ints (agreed values only, so every
 * rank reaches the same verdict). */
static int packed_check(int D, const gdn_config *c) {
    if (!c->cu_seqlens) return GDN_OK;
    if ((double)c->n_docs * (double)D > INT_MAX)
        return gdn_fail(GDN_ERR_SHAPE, "strategy 'heads': %lld documents over %d ranks exceed MPI's int counts "
                        "of the per-document states; use strategy scan", (long long)c->n_docs, D);
    return GDN_OK;
}

/* Whether a cached head-parallel plan made from `key` serves config c: every field that shapes
 * the plan or what it checks (check_finite, the checkpoint interval, threads, ...); the offsets
 * themselves are compared with the plan's own copy. */
static int same_key(const gdn_config *a, const gdn_config *b) {
    return a->B == b->B && a->T == b->T && a->Hk == b->Hk && a->Hv == b->Hv && a->K == b->K && a->V == b->V &&
           a->chunk == b->chunk && !memcmp(&a->scale, &b->scale, sizeof a->scale) && a->l2norm == b->l2norm &&
           a->threads == b->threads && a->check_finite == b->check_finite &&
           a->checkpoint_chunks == b->checkpoint_chunks && (a->cu_seqlens != NULL) == (b->cu_seqlens != NULL) &&
           a->n_docs == b->n_docs && a->seq_offset == b->seq_offset;
}

/* The plan of the head-parallel shape, kept in the context while the config it was made from
 * stays the same. */
static int heads_plan(gdn_cp *cp, const gdn_plan *plan, int64_t T_total, gdn_plan **out) {
    gdn_config c = *gdn_plan_config(plan);
    const int D = cp->size; /* (D divides Hk: gdn_cp_heads_check) */
    c.T = T_total, c.Hk /= D, c.Hv /= D;
    c.seq_offset = 0; /* packed: the whole stream, with the whole offsets */
    const gdn_config *have = cp->heads_plan ? gdn_plan_config(cp->heads_plan) : NULL;
    const int same_docs = have && (have->cu_seqlens != NULL) == (c.cu_seqlens != NULL) && have->n_docs == c.n_docs &&
                          (!c.cu_seqlens || !memcmp(have->cu_seqlens, c.cu_seqlens, sizeof(int64_t) * (c.n_docs + 1)));
    if (!have || !same_docs || !same_key(&cp->heads_key, &c)) {
        gdn_plan_destroy(cp->heads_plan);
        cp->heads_plan = NULL;
        int rc = gdn_plan_create(&cp->heads_plan, &c);
        if (rc) return rc;
        cp->heads_key = c;
        /* (of heads_key.cu_seqlens only whether it is NULL is ever read: it may dangle) */
    }
    *out = cp->heads_plan;
    return GDN_OK;
}

/* The shape checks, drawn from agreed values (the same verdict on every rank, returned before
 * any collective), then every allocation the heads strategy needs before its agreement step: the
 * layout and the cached head-parallel plan (a local failure, into *local for that step to share;
 * the layout is initialised only when the verdict is GDN_OK). */
static int heads_enter(gdn_cp *cp, gdn_plan *plan, layout *L, gdn_plan **hp, int *local) {
    const gdn_config *c = gdn_plan_config(plan);
    int rc = gdn_cp_heads_check(cp->size, cp->shard_T, c->B, c->Hk, c->Hv, c->K, c->V);
    if (!rc) rc = packed_check(cp->size, c);
    if (rc) return rc;
    *local = layout_init(cp, L, c);
    if (!*local) *local = heads_plan(cp, plan, L->T_total, hp);
    return GDN_OK;
}

/* q, k, v, g, beta to this rank's heads over the whole sequence. */
static int inputs_to_heads(gdn_cp *cp, layout *L, const gdn_config *c, const float *q, const float *k,
                           const float *v, const float *g, const float *beta, float *hq, float *hk, float *hv,
                           float *hg, float *hb) {
    int rc = to_heads(cp, L, q, c->Hk, c->K, hq);
    if (!rc) rc = to_heads(cp, L, k, c->Hk, c->K, hk);
    if (!rc) rc = to_heads(cp, L, v, c->Hv, c->V, hv);
    if (!rc) rc = to_heads(cp, L, g, c->Hv, 1, hg);
    if (!rc) rc = to_heads(cp, L, beta, c->Hv, 1, hb);
    return rc;
}

int gdn_cp_heads_forward(gdn_cp *cp, gdn_plan *plan, float *o, float *ht, float *s_in,
                         const float *q, const float *k, const float *v, const float *g,
                         const float *beta, const float *h0) {
    const gdn_config *c = gdn_plan_config(plan);
    const int D = cp->size, packed = c->cu_seqlens != NULL; /* (agreed by gdn_cp_agree) */
    const int64_t B = c->B, K = c->K, V = c->V, Hk = c->Hk, Hv = c->Hv, KV = K * V;
    const int64_t nsr = packed ? c->n_docs : B; /* state rows: per document when packed */
    layout L;
    gdn_plan *hp = NULL;
    float *buf = NULL;
    int rc = GDN_OK;
    const int verdict = heads_enter(cp, plan, &L, &hp, &rc);
    if (verdict) return verdict; /* (refused alike on every rank, before any collective) */
    const int64_t T = L.T_total, Hkl = Hk / D, Hvl = Hv / D;
    if (!rc && !(buf = gdn_malloc("cp heads forward: head-parallel tensors", sizeof(float) * (2 * B * T * Hkl * K + 2 * B * T * Hvl * V + 2 * B * T * Hvl + 2 * nsr * Hvl * KV))))
        rc = gdn_fail(GDN_ERR_NOMEM, "heads buffers");
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    float *hq = buf, *hk = hq + B * T * Hkl * K, *hv = hk + B * T * Hkl * K, *ho = hv + B * T * Hvl * V;
    float *hg = ho + B * T * Hvl * V, *hb = hg + B * T * Hvl, *hh0 = hb + B * T * Hvl, *hht = hh0 + nsr * Hvl * KV;
    int has_h0 = 0;
    if (!rc) rc = inputs_to_heads(cp, &L, c, q, k, v, g, beta, hq, hk, hv, hg, hb);
    if (!rc && packed) rc = docs_to_heads(cp, &L, c, h0, 0, hh0, &has_h0); /* from where each document starts */
    else if (!rc) rc = scatter_state(cp, &L, cp->rank == 0 ? h0 : NULL, 0, B, Hv, KV, hh0, &has_h0);
    double t0 = MPI_Wtime();
    if (!rc) {
        const gdn_rule_inputs hin = {.q = hq, .k = hk, .v = hv, .g = hg, .beta = hb, .h0 = has_h0 ? hh0 : NULL};
        rc = gdn_forward(hp, ho, hht, &hin);
    }
    cp->stats.replay_s += MPI_Wtime() - t0;
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    rc = to_sequence(cp, &L, ho, Hv, V, o);
    /* packed: ht is given on every rank or on none (agreed: GDN_CP_CALL_HT); dense: gathered */
    if (!rc && (!packed || ht)) rc = gather_state(cp, &L, hht, -1, nsr, Hv, KV, ht);
    if (!rc && s_in) memset(s_in, 0, sizeof(float) * B * Hv * KV);
    rc = gdn_cp_agree_status(cp, rc);
done:
    free(buf);
    layout_free(&L);
    return rc;
}

int gdn_cp_heads_backward(gdn_cp *cp, gdn_plan *plan, float *dq, float *dk, float *dv,
                          float *dg, float *dbeta, float *ds_in, const float *q, const float *k,
                          const float *v, const float *g, const float *beta, const float *h0,
                          const float *dout, const float *dht) {
    const gdn_config *c = gdn_plan_config(plan);
    const int D = cp->size, packed = c->cu_seqlens != NULL; /* (agreed by gdn_cp_agree) */
    const int64_t B = c->B, K = c->K, V = c->V, Hk = c->Hk, Hv = c->Hv, KV = K * V;
    const int64_t nsr = packed ? c->n_docs : B; /* state rows: per document when packed */
    layout L;
    gdn_plan *hp = NULL;
    float *buf = NULL;
    int rc = GDN_OK;
    const int verdict = heads_enter(cp, plan, &L, &hp, &rc);
    if (verdict) return verdict; /* (refused alike on every rank, before any collective) */
    const int64_t T = L.T_total, Hkl = Hk / D, Hvl = Hv / D, nqk = B * T * Hkl * K, nv = B * T * Hvl * V, ng = B * T * Hvl;
    if (!rc && !(buf = gdn_malloc("cp heads backward: head-parallel tensors", sizeof(float) * (4 * nqk + 3 * nv + 4 * ng + 3 * nsr * Hvl * KV))))
        rc = gdn_fail(GDN_ERR_NOMEM, "heads buffers");
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    float *hq = buf, *hk = hq + nqk, *gq = hk + nqk, *gk = gq + nqk, *hv = gk + nqk, *hdo = hv + nv, *gv = hdo + nv;
    float *hg = gv + nv, *hb = hg + ng, *gg = hb + ng, *gb = gg + ng;
    float *hh0 = gb + ng, *hdht = hh0 + nsr * Hvl * KV, *gh0 = hdht + nsr * Hvl * KV;
    int has_h0 = 0, has_dht = 0;
    if (!rc) rc = inputs_to_heads(cp, &L, c, q, k, v, g, beta, hq, hk, hv, hg, hb);
    if (!rc) rc = to_heads(cp, &L, dout, Hv, V, hdo);
    if (packed) { /* h0 from where each document starts, dht from where it ends */
        if (!rc) rc = docs_to_heads(cp, &L, c, h0, 0, hh0, &has_h0);
        if (!rc) rc = docs_to_heads(cp, &L, c, dht, 1, hdht, &has_dht);
    } else {
        if (!rc) rc = scatter_state(cp, &L, cp->rank == 0 ? h0 : NULL, 0, B, Hv, KV, hh0, &has_h0);
        if (!rc) rc = scatter_state(cp, &L, cp->rank == D - 1 ? dht : NULL, D - 1, B, Hv, KV, hdht, &has_dht);
    }
    double t0 = MPI_Wtime();
    if (!rc) {
        const gdn_rule_grads hgr = {.dq = gq, .dk = gk, .dv = gv, .dg = gg, .dbeta = gb, .dh0 = gh0};
        const gdn_rule_inputs hin = {.q = hq, .k = hk, .v = hv, .g = hg, .beta = hb, .h0 = has_h0 ? hh0 : NULL};
        rc = gdn_backward(hp, &hgr, &hin, hdo, has_dht ? hdht : NULL);
    }
    cp->stats.replay_s += MPI_Wtime() - t0;
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    rc = to_sequence(cp, &L, gq, Hk, K, dq);
    if (!rc) rc = to_sequence(cp, &L, gk, Hk, K, dk);
    if (!rc) rc = to_sequence(cp, &L, gv, Hv, V, dv);
    if (!rc) rc = to_sequence(cp, &L, gg, Hv, 1, dg);
    if (!rc) rc = to_sequence(cp, &L, gb, Hv, 1, dbeta);
    if (packed) { /* every document's dh0 on every rank (ds_in given on every rank or none: agreed) */
        if (!rc && ds_in) rc = gather_state(cp, &L, gh0, -1, nsr, Hv, KV, ds_in);
    } else {
        if (!rc && ds_in) memset(ds_in, 0, sizeof(float) * B * Hv * KV);
        if (!rc) rc = gather_state(cp, &L, gh0, 0, B, Hv, KV, cp->rank == 0 ? ds_in : NULL);
    }
    rc = gdn_cp_agree_status(cp, rc);
done:
    free(buf);
    layout_free(&L);
    return rc;
}
