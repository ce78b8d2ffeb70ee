/* The context-parallel layer: the context's accessors (made in context.c), agreement between ranks, MPI accounting, the
 * prefix combine of affine pairs, and the entry points, which check, agree and dispatch to the
 * strategy (rule.c: scan, allgather, relay; heads.c). It knows nothing of files; the compute is
 * the kernel's (plans, streams, summaries, adjoints). */
#include "cp_internal.h"

#include <limits.h>
#include <math.h>
#include <string.h>
#include <time.h>

static double now(void) { return MPI_Wtime(); }

const char *gdn_cp_strategy_name(gdn_cp_strategy s) {
    switch (s) {
    case GDN_CP_SCAN: return "scan";
    case GDN_CP_ALLGATHER: return "allgather";
    case GDN_CP_RELAY: return "relay";
    case GDN_CP_HEADS: return "heads";
    }
    return "unknown";
}

int gdn_cp_strategy_parse(const char *name) {
    for (int s = 0; s < 4; s++)
        if (name && !strcmp(name, gdn_cp_strategy_name((gdn_cp_strategy)s))) return s;
    return -1;
}

int gdn_cp_wait_all(const gdn_cp *cp, int n, MPI_Request *rq) {
    if (!cp->sleep_wait) {
        for (int i = 0; i < n; i++) {
            const int mrc = MPI_Wait(&rq[i], MPI_STATUS_IGNORE);
            if (mrc != MPI_SUCCESS) return mrc;
        }
        return MPI_SUCCESS;
    }
    const double start = MPI_Wtime();
    long nap = 20000;
    for (;;) {
        int done = 1;
        for (int i = 0; i < n; i++) { /* a completed request is MPI_REQUEST_NULL, which tests done */
            int flag = 0;
            const int mrc = MPI_Test(&rq[i], &flag, MPI_STATUS_IGNORE);
            if (mrc != MPI_SUCCESS) return mrc;
            done &= flag;
        }
        if (done) return MPI_SUCCESS;
        if (MPI_Wtime() - start < GDN_CP_SPIN_S) continue;
        nanosleep(&(struct timespec){0, nap}, NULL);
        nap = nap < 500000 ? 2 * nap : 1000000;
    }
}

int gdn_cp_allgather(const gdn_cp *cp, const void *send, int count, MPI_Datatype type, void *recv) {
    if (!cp->sleep_wait) return MPI_Allgather(send, count, type, recv, count, type, cp->comm);
    MPI_Request rq;
    const int mrc = MPI_Iallgather(send, count, type, recv, count, type, cp->comm, &rq);
    return mrc == MPI_SUCCESS ? gdn_cp_wait_all(cp, 1, &rq) : mrc;
}

int gdn_cp_allgatherv_in_place(const gdn_cp *cp, void *buf, const int *counts, const int *displs, MPI_Datatype type) {
    if (!cp->sleep_wait)
        return MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts, displs, type, cp->comm);
    MPI_Request rq;
    const int mrc = MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, counts, displs, type, cp->comm, &rq);
    return mrc == MPI_SUCCESS ? gdn_cp_wait_all(cp, 1, &rq) : mrc;
}

int gdn_cp_worst_status(const gdn_cp *cp, MPI_Comm comm, int rank, int local, int *worst, int *who) {
    struct { int v, r; } in = {local, rank}, out = {0, 0};
    MPI_Request rq;
    const int mrc = !cp || !cp->sleep_wait ? MPI_Allreduce(&in, &out, 1, MPI_2INT, MPI_MAXLOC, comm)
                    : MPI_Iallreduce(&in, &out, 1, MPI_2INT, MPI_MAXLOC, comm, &rq) == MPI_SUCCESS ? gdn_cp_wait_all(cp, 1, &rq)
                                                                                                    : MPI_ERR_OTHER;
    if (mrc != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Allreduce failed (status agreement)");
    *worst = out.v, *who = out.r;
    return GDN_OK;
}

int gdn_cp_rank(const gdn_cp *cp) { return cp ? cp->rank : -1; }
int gdn_cp_size(const gdn_cp *cp) { return cp ? cp->size : 0; }
gdn_cp_stats gdn_cp_last_stats(const gdn_cp *cp) {
    gdn_cp_stats z = {0};
    return cp ? cp->stats : z;
}
int gdn_cp_set_wait(gdn_cp *cp, int mode) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "gdn_cp_set_wait: cp is NULL");
    const int ok = mode >= GDN_CP_WAIT_AUTO && mode <= GDN_CP_WAIT_SLEEP;
    int want = !ok ? -1 : mode == GDN_CP_WAIT_AUTO ? cp->auto_sleep : mode == GDN_CP_WAIT_SLEEP;
    int lo[2] = {want, -want}; /* min and -max in one reduction */
    if (MPI_Allreduce(MPI_IN_PLACE, lo, 2, MPI_INT, MPI_MIN, cp->comm) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Allreduce failed (gdn_cp_set_wait)");
    if (!ok) return gdn_fail(GDN_ERR_ARG, "gdn_cp_set_wait: mode %d is not GDN_CP_WAIT_AUTO, _SPIN or _SLEEP", mode);
    if (lo[0] < 0) return gdn_fail(GDN_ERR_ARG, "gdn_cp_set_wait: another rank passed an unknown mode");
    if (lo[0] != -lo[1])
        return gdn_fail(GDN_ERR_ARG, "gdn_cp_set_wait: the ranks asked for different wait modes (spin on some, sleep "
                        "on others); the mode is unchanged");
    cp->sleep_wait = want;
    return GDN_OK;
}

int gdn_cp_get_wait(const gdn_cp *cp) { return cp && cp->sleep_wait ? GDN_CP_WAIT_SLEEP : GDN_CP_WAIT_SPIN; }

float *gdn_cp_scratch(gdn_cp *cp, size_t floats) {
    if (floats > cp->scratch_cap) {
        float *p = gdn_realloc("cp scratch", cp->scratch, floats * sizeof(float));
        if (!p) return NULL;
        cp->scratch = p, cp->scratch_cap = floats;
    }
    return cp->scratch;
}

int gdn_cp_combine_reserve(gdn_cp *cp, gdn_cp_strategy strategy, int64_t nm, int64_t K, int64_t V) {
    const int64_t pair = nm * K * (K + V);
    const int64_t need = strategy == GDN_CP_SCAN ? 2 * pair : strategy == GDN_CP_ALLGATHER ? pair * cp->size : 0;
    if (need && !gdn_cp_scratch(cp, (size_t)need))
        return gdn_fail(GDN_ERR_NOMEM, "cp %s buffers (%lld floats)", gdn_cp_strategy_name(strategy), (long long)need);
    return GDN_OK;
}

int gdn_cp_agree_status(gdn_cp *cp, int local) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp context is NULL");
    int worst = 0, who = 0;
    double t0 = now();
    int rc = gdn_cp_worst_status(cp, cp->comm, cp->rank, local, &worst, &who);
    cp->stats.comm_s += now() - t0;
    if (rc) return rc;
    if (worst && !local) return gdn_fail(worst, "rank %d failed (%s); see its message", who, gdn_strerror(worst));
    return local;
}

/* "rank 1", "ranks 0, 2, 5" (the first 8, then "..."): the ranks r with bad[r * stride] != 0. */
static void rank_list(char *buf, size_t cap, const int64_t *bad, int stride, int D) {
    int n = 0, len = 0;
    for (int r = 0; r < D; r++) n += bad[(size_t)r * stride] != 0;
    len = snprintf(buf, cap, "rank%s", n > 1 ? "s" : "");
    for (int r = 0, k = 0; r < D && len < (int)cap; r++)
        if (bad[(size_t)r * stride]) {
            len += k < 8 ? snprintf(buf + len, cap - len, "%s %d", k ? "," : "", r)
                         : k == 8 ? snprintf(buf + len, cap - len, ", ...") : 0;
            k++;
        }
}

int gdn_cp_agree(gdn_cp *cp, const gdn_plan *plan, int local, int call) {
    const gdn_config *c = gdn_plan_config(plan);
    /* Everything that decides which collectives follow must match on every rank before any of
     * them starts: whether each rank has a plan, its local status, shapes and options, the
     * strategy, and the call (forward or backward, and which optional inputs and outputs change
     * the message pattern). Every verdict is drawn from the gathered table alone, so every rank
     * reaches the same one (and no rank needs a second collective to learn another's failure). */
    enum { HAS_PLAN = 0, STATUS = 1, T_COL = 2, STRATEGY = 11, CALL = 12, SEQ_OFFSET = 15, NSIG = 16 };
    _Static_assert((int)NSIG <= (int)GDN_CP_AGREE_COLS, "the agreement table is preallocated for GDN_CP_AGREE_COLS values");
    int64_t sig[NSIG] = {0};
    if (c) {
        int32_t scale_bits;
        memcpy(&scale_bits, &c->scale, 4);
        /* Packed streams: the same offsets everywhere (their count and digest), and each rank's
         * seq_offset (checked against the shards before it, below). */
        const int64_t s[NSIG] = {1, local, c->T, c->B, c->Hk, c->Hv, c->K, c->V, c->chunk, c->l2norm, scale_bits,
                                 c->cp, call, c->cu_seqlens ? c->n_docs : -1,
                                 gdn_cp_docs_hash(c->cu_seqlens, c->n_docs), c->seq_offset};
        memcpy(sig, s, sizeof sig);
    } else {
        sig[HAS_PLAN] = 0, sig[STATUS] = local, sig[STRATEGY] = -1, sig[CALL] = call;
    }
    int64_t *all = cp->agree_tab + GDN_CP_AGREE_COLS; /* preallocated: [size, NSIG] */
    double t0 = now();
    int mrc = gdn_cp_allgather(cp, sig, NSIG, MPI_INT64_T, all);
    cp->stats.comm_s += now() - t0;
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Allgather failed (cp agreement)");
    static const char *names[NSIG] = {"", "", "T", "B", "Hk", "Hv", "K", "V", "chunk", "l2norm", "scale",
                                      "the CP strategy", "the call (forward/backward and its optional tensors)",
                                      "packing (n_docs of cu_seqlens, -1: dense)", "the cu_seqlens offsets"};
    const int D = cp->size;
    /* 1. a rank without a plan: the same message everywhere, naming them */
    int64_t *no_plan = cp->tab64; /* (preallocated, D values) */
    int missing = 0;
    for (int r = 0; r < D; r++) missing += (no_plan[r] = !all[r * NSIG + HAS_PLAN]) != 0;
    if (missing) {
        char who[160];
        rank_list(who, sizeof who, no_plan, 1, D);
        return gdn_fail(GDN_ERR_ARG, "plan is NULL on %s (of %d)", who, D);
    }
    /* 2. a local failure (bad input, memory): that rank's own message there, its rank elsewhere */
    if (local) return local;
    for (int r = 0; r < D; r++)
        if (all[r * NSIG + STATUS])
            return gdn_fail((int)all[r * NSIG + STATUS], "rank %d failed (%s); see its message", r,
                            gdn_strerror((int)all[r * NSIG + STATUS]));
    /* 3. the shapes, options and call against rank 0's */
    int rc = GDN_OK;
    int64_t before = 0; /* tokens of the ranks before r */
    for (int r = 0; r < D && !rc; r++) {
        cp->shard_T[r] = all[r * NSIG + T_COL];
        for (int i = T_COL + 1; i < SEQ_OFFSET && !rc; i++)
            if (all[r * NSIG + i] != all[i]) {
                if (i == STRATEGY)
                    rc = gdn_fail(GDN_ERR_MPI, "ranks disagree on the CP strategy: rank %d has '%s', rank 0 has '%s'", r,
                                  gdn_cp_strategy_name((gdn_cp_strategy)all[r * NSIG + i]),
                                  gdn_cp_strategy_name((gdn_cp_strategy)all[i]));
                else
                    rc = gdn_fail(GDN_ERR_MPI, "ranks disagree on %s: rank %d has %lld, rank 0 has %lld",
                                  names[i], r, (long long)all[r * NSIG + i], (long long)all[i]);
            }
        if (!rc && c->cu_seqlens && all[r * NSIG + SEQ_OFFSET] != before)
            rc = gdn_fail(GDN_ERR_SHAPE, "cu_seqlens: rank %d's plan has seq_offset %lld but the ranks before it hold "
                          "%lld tokens (seq_offset must be the shard's first token in the packed stream)",
                          r, (long long)all[r * NSIG + SEQ_OFFSET], (long long)before);
        before += all[r * NSIG + T_COL];
    }
    if (!rc && c->cu_seqlens && c->cu_seqlens[c->n_docs] != before)
        rc = gdn_fail(GDN_ERR_SHAPE, "cu_seqlens ends at %lld but the %d ranks hold %lld tokens in all",
                      (long long)c->cu_seqlens[c->n_docs], D, (long long)before);
    return rc; /* every rank saw the same table, so every rank fails alike */
}

static inline uint64_t rotl64(uint64_t x, int r) { return x << r | x >> (64 - r); }

int64_t gdn_cp_digest(const void *data, size_t bytes) {
    if (!data) return 0;
    const unsigned char *b = data;
    /* every byte, four independent lanes of 8-byte words (memory speed, not a multiply chain a
     * byte): each lane's step (xor, odd multiply, xor-shift) is a bijection of its state, so a
     * change to any one word always changes the digest */
    const uint64_t P = 0x9E3779B97F4A7C15ull;
    uint64_t h[4] = {0x243F6A8885A308D3ull ^ (uint64_t)bytes, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                     0x082EFA98EC4E6C89ull};
    size_t i = 0;
    for (; i + 32 <= bytes; i += 32)
        for (int l = 0; l < 4; l++) {
            uint64_t w;
            memcpy(&w, b + i + 8 * l, 8);
            h[l] = (h[l] ^ w) * P;
            h[l] ^= h[l] >> 29;
        }
    uint64_t x = h[0] ^ rotl64(h[1], 17) ^ rotl64(h[2], 31) ^ rotl64(h[3], 47);
    for (; i < bytes; i++) x = (x ^ b[i]) * 1099511628211ull; /* the tail, FNV-1a */
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    return (int64_t)(x >> 1);
}

int64_t gdn_cp_digest_file(const char *path) {
    FILE *f = path ? fopen(path, "rb") : NULL;
    if (!f) return -1;
    enum { PIECE = 4 << 20 };
    unsigned char *buf = gdn_malloc("gdn_cp_digest_file: buf", PIECE);
    uint64_t h = 1469598103934665603ull;
    size_t n, total = 0;
    while (buf && (n = fread(buf, 1, PIECE, f)) > 0) {
        h = (h ^ (uint64_t)gdn_cp_digest(buf, n)) * 1099511628211ull;
        total += n;
    }
    const int bad = !buf || ferror(f);
    free(buf);
    fclose(f);
    return bad ? -1 : (int64_t)((h ^ (uint64_t)total) >> 1);
}

/* gdn_cp_agree_values: a value whose name ends so holds a double's bits (cp.h). */
#define BITS_SUFFIX " (its bits)"

/* The first value on which a rank differs from rank 0, named: rows of `stride` int64 per rank in
 * all, the n values from column `off`. Every rank finds the same one (same table). */
static int first_disagreement(const gdn_cp *cp, const int64_t *all, int stride, int off, int n,
                              const char *const *names) {
    for (int r = 1; r < cp->size; r++)
        for (int i = 0; i < n; i++) {
            const int64_t theirs = all[r * stride + off + i], first = all[off + i];
            if (theirs == first) continue;
            /* a name ending in BITS_SUFFIX carries a double's bits: shown as that number */
            const char *name = names[i];
            const size_t len = strlen(name), sl = strlen(BITS_SUFFIX);
            if (len > sl && !strcmp(name + len - sl, BITS_SUFFIX)) {
                double a, b;
                memcpy(&a, &theirs, sizeof a), memcpy(&b, &first, sizeof b);
                char sa[32], sb[32]; /* the shortest digits that tell them apart */
                for (int digits = 6; digits <= 17; digits++) {
                    snprintf(sa, sizeof sa, "%.*g", digits, a), snprintf(sb, sizeof sb, "%.*g", digits, b);
                    if (strcmp(sa, sb)) break;
                }
                return gdn_fail(GDN_ERR_MPI, "ranks disagree on %.*s: rank %d has %s, rank 0 has %s", (int)(len - sl),
                                name, r, sa, sb);
            }
            return gdn_fail(GDN_ERR_MPI, "ranks disagree on %s: rank %d has %lld, rank 0 has %lld", name, r,
                            (long long)theirs, (long long)first);
        }
    return GDN_OK;
}

/* Every rank sends one row of GDN_CP_AGREE_COLS int64 — [n, status, the values when they fit] —
 * whatever n it was called with, so ranks that disagree on n (a rank that failed before it knew
 * its values, one running another command) still make one well-formed MPI_Allgather and learn
 * it. Only when every rank passed and has the same n beyond the row do they exchange the values
 * themselves, a second collective all of them make. */
int gdn_cp_agree_values(gdn_cp *cp, const int64_t *vals, int n, const char *const *names, int local) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp context is NULL");
    if (n < 0 || (n && (!vals || !names))) local = local ? local : gdn_fail(GDN_ERR_ARG, "cp agreement: bad values");
    if (n < 0 || !vals) n = 0;
    enum { W = GDN_CP_AGREE_COLS };
    const int fits = n <= W - 2;
    int64_t *mine = cp->agree_tab, *all = cp->agree_tab + W;
    memset(mine, 0, sizeof(int64_t) * W);
    mine[0] = n, mine[1] = local;
    for (int i = 0; fits && i < n; i++) mine[i + 2] = vals[i];
    const double t0 = now();
    const int mrc = gdn_cp_allgather(cp, mine, W, MPI_INT64_T, all);
    cp->stats.comm_s += now() - t0;
    int rc = mrc == MPI_SUCCESS ? local : gdn_fail(GDN_ERR_MPI, "MPI_Allgather failed (cp agreement)");
    for (int r = 0; r < cp->size && !rc; r++)
        if (all[r * W + 1])
            rc = gdn_fail((int)all[r * W + 1], "rank %d failed (%s); see its message", r, gdn_strerror((int)all[r * W + 1]));
    static const char *const count_name[] = {"the number of values agreed on"};
    if (!rc) rc = first_disagreement(cp, all, W, 0, 1, count_name);
    if (rc || fits) return rc ? rc : first_disagreement(cp, all, W, 2, n, names);
    /* every rank is here, with the same n: the values themselves */
    int64_t *table = gdn_malloc("cp agreement table", sizeof(int64_t) * (size_t)n * (cp->size + 1));
    if ((rc = gdn_cp_agree_status(cp, table ? GDN_OK : gdn_fail(GDN_ERR_NOMEM, "cp agreement (%d values)", n)))) {
        free(table);
        return rc;
    }
    memcpy(table, vals, sizeof(int64_t) * (size_t)n);
    const double t1 = now();
    rc = gdn_cp_allgather(cp, table, n, MPI_INT64_T, table + n) == MPI_SUCCESS
             ? first_disagreement(cp, table + n, n, 0, n, names)
             : gdn_fail(GDN_ERR_MPI, "MPI_Allgather failed (cp agreement of %d values)", n);
    cp->stats.comm_s += now() - t1;
    free(table);
    return rc;
}

static int check_count(int64_t n) {
    return n >= 0 && n <= INT_MAX ? GDN_OK
                                  : gdn_fail(GDN_ERR_SHAPE, "message of %lld floats exceeds MPI's int count", (long long)n);
}

int gdn_cp_sendrecv(gdn_cp *cp, const float *sbuf, int64_t scount, int dest, float *rbuf,
                    int64_t rcount, int src) {
    int rc;
    if ((rc = check_count(scount)) || (rc = check_count(rcount))) return rc;
    double t0 = now();
    const int sn = dest == MPI_PROC_NULL ? 0 : (int)scount, rn = src == MPI_PROC_NULL ? 0 : (int)rcount;
    int mrc;
    if (!cp->sleep_wait) {
        mrc = MPI_Sendrecv(sbuf, sn, MPI_FLOAT, dest, 7, rbuf, rn, MPI_FLOAT, src, 7, cp->comm, MPI_STATUS_IGNORE);
    } else {
        MPI_Request rq[2];
        mrc = MPI_Irecv(rbuf, rn, MPI_FLOAT, src, 7, cp->comm, &rq[0]);
        if (mrc == MPI_SUCCESS) {
            mrc = MPI_Isend(sbuf, sn, MPI_FLOAT, dest, 7, cp->comm, &rq[1]);
            mrc = gdn_cp_wait_all(cp, mrc == MPI_SUCCESS ? 2 : 1, rq) != MPI_SUCCESS ? MPI_ERR_OTHER : mrc;
        }
    }
    cp->stats.comm_s += now() - t0;
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Sendrecv failed");
    if (dest != MPI_PROC_NULL) cp->stats.bytes_sent += 4 * (uint64_t)scount, cp->stats.messages++;
    if (src != MPI_PROC_NULL) cp->stats.bytes_recv += 4 * (uint64_t)rcount;
    return GDN_OK;
}

/* ------------------------------------------------------------------ affine-pair scans */

/* Pairs live in one buffer: A [nm, X, X] then B [nm, X, V]. mine <- mine o recv (recv first). */
static void compose_into(int reversed, float *mine, const float *recv, float *tmp, int64_t nm, int64_t K, int64_t V) {
    const int64_t na = nm * K * K;
    if (reversed)
        gdn_summary_compose(tmp, tmp + na, recv, recv + na, mine, mine + na, nm, K, V);
    else
        gdn_summary_compose(tmp, tmp + na, mine, mine + na, recv, recv + na, nm, K, V);
    memcpy(mine, tmp, sizeof(float) * nm * K * (K + V));
}

/* The prefix combine over ranks: on entry `mine` holds this rank's pair (rank 0's pair has
 * A = 0, so every prefix that reaches it is a constant map, its B the state). On exit
 * `incoming` holds the B of the exclusive prefix, i.e. the state entering this rank.
 * Direction +1: token order (forward); -1: reverse order (adjoint pairs, backward).
 * The rank at the far end (last in the direction) neither folds nor sends. */
int gdn_cp_combine(gdn_cp *cp, gdn_cp_strategy strategy, float *mine, float *incoming, int64_t nm, int64_t K,
                   int64_t V, int dir) {
    const int D = cp->size, r = dir > 0 ? cp->rank : D - 1 - cp->rank; /* position in the scan */
    const int64_t pair = nm * K * (K + V), ns = nm * K * V;
#define RANK(pos) (dir > 0 ? (pos) : D - 1 - (pos))
    int rc = GDN_OK;
    const int reversed = gdn_test_mutate("cp: scan composed in the reversed order");
    if (strategy == GDN_CP_SCAN) {
        float *buf = gdn_cp_scratch(cp, 2 * (size_t)pair);
        GDN_ASSERT(buf); /* reserved before the agreement step (gdn_cp_combine_reserve) */
        float *recv = buf, *tmp = buf + pair;
        const int64_t na = nm * K * K;
        /* Hillis-Steele: ceil(log2(D-1)) rounds over positions 0..D-2. Before the round at
         * distance d, position s covers positions [s-d+1, s]; it reaches position 0 (so its A is
         * exactly 0 and only its B need travel) iff s < d. Both ends know this. */
        for (int d = 1; d < D - 1 && !rc; d *= 2) {
            const int to = r + d <= D - 2 && r <= D - 2 ? RANK(r + d) : MPI_PROC_NULL;
            const int from = r - d >= 0 && r <= D - 2 ? RANK(r - d) : MPI_PROC_NULL;
            const int mine_const = r < d, theirs_const = r - d < d;
            rc = gdn_cp_sendrecv(cp, mine_const ? mine + na : mine, mine_const ? ns : pair, to,
                                 theirs_const ? recv + na : recv, theirs_const ? ns : pair, from);
            cp->stats.rounds++;
            if (rc || from == MPI_PROC_NULL) continue;
            if (theirs_const && !reversed) {
                /* mine o (0, b): the constant map (0, A_mine b + B_mine). */
                gdn_summary_apply(tmp, mine, mine + na, recv + na, nm, K, V);
                memset(mine, 0, sizeof(float) * na);
                memcpy(mine + na, tmp, sizeof(float) * ns);
            } else {
                if (theirs_const) memset(recv, 0, sizeof(float) * na);
                compose_into(reversed, mine, recv, tmp, nm, K, V);
            }
        }
    } else if (strategy == GDN_CP_ALLGATHER) {
        float *all = gdn_cp_scratch(cp, (size_t)pair * D);
        GDN_ASSERT(all); /* reserved before the agreement step (gdn_cp_combine_reserve) */
        double t0 = now();
        int mrc = gdn_cp_allgather(cp, mine, (int)pair, MPI_FLOAT, all);
        cp->stats.comm_s += now() - t0;
        if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Allgather failed");
        cp->stats.bytes_sent += 4 * (uint64_t)pair * (D - 1), cp->stats.messages += D - 1;
        cp->stats.bytes_recv += 4 * (uint64_t)pair * (D - 1), cp->stats.rounds++;
        /* Fold the positions before this one: S = B_0, then S <- A_j S + B_j. */
        if (r >= 1) {
            const int64_t na = nm * K * K;
            memcpy(incoming, all + (int64_t)RANK(0) * pair + na, sizeof(float) * ns);
            for (int j = 1; j < r; j++) {
                const float *pj = all + (int64_t)RANK(j) * pair;
                float *tmp = mine; /* this rank's own pair is no longer needed */
                if (reversed) /* wrong: fold from the far side */
                    pj = all + (int64_t)RANK(r - j) * pair;
                gdn_summary_apply(tmp, pj, pj + na, incoming, nm, K, V);
                memcpy(incoming, tmp, sizeof(float) * ns);
            }
        }
        return GDN_OK;
    }
    if (rc) return rc;
    /* Shift: position p (<= D-2) now holds its inclusive prefix; its B enters position p+1. */
    const int to = r <= D - 2 ? RANK(r + 1) : MPI_PROC_NULL;
    const int from = r >= 1 ? RANK(r - 1) : MPI_PROC_NULL;
    rc = gdn_cp_sendrecv(cp, mine + nm * K * K, ns, to, incoming, ns, from);
    cp->stats.rounds++;
#undef RANK
    return rc;
}

int gdn_cp_forward(gdn_cp *cp, gdn_plan *plan, float *o, float *ht, float *s_in, const gdn_rule_inputs *in) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp context is NULL");
    memset(&cp->stats, 0, sizeof cp->stats);
    const int packed = plan && plan->streams.packed; /* agreed below: every rank alike */
    /* (a NULL bundle is this rank's column of the agreement below: every rank refuses it) */
    int local = gdn_rule_inputs_check(in, 1);
    const gdn_rule_inputs none = {0};
    if (local) in = &none;
    const float *q = in->q, *k = in->k, *v = in->v, *g = in->g, *beta = in->beta, *h0 = in->h0;
    /* a packed stream's h0 holds every document's initial state: each rank reads those of the
     * documents that start on it */
    if (!local && plan) local = gdn_check_inputs(plan, q, k, v, g, beta, cp->rank == 0 || packed ? h0 : NULL);
    if (!local && !o) local = gdn_fail(GDN_ERR_ARG, "output 'o' is NULL");
    int rc = gdn_cp_agree(cp, plan, local, GDN_CP_CALL_FORWARD | (packed && ht ? GDN_CP_CALL_HT : 0));
    if (rc) return rc;
    if (plan->cfg.cp == GDN_CP_HEADS) return gdn_cp_heads_forward(cp, plan, o, ht, s_in, q, k, v, g, beta, h0);
    return gdn_cp_rule_forward(cp, plan, o, ht, s_in, q, k, v, g, beta, h0);
}

int gdn_cp_backward(gdn_cp *cp, gdn_plan *plan, const gdn_rule_grads *grads, const gdn_rule_inputs *in,
                    const float *s_in, const float *dout, const float *dht) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp context is NULL");
    memset(&cp->stats, 0, sizeof cp->stats);
    const gdn_config *c = gdn_plan_config(plan);
    const int packed = plan && plan->streams.packed; /* agreed below: every rank alike */
    /* (a NULL bundle is this rank's column of the agreement below: every rank refuses it) */
    int local = gdn_rule_inputs_check(in, 1);
    if (!local) local = gdn_rule_grads_check(grads);
    const gdn_rule_inputs no_in = {0};
    const gdn_rule_grads no_gr = {0};
    if (!in) in = &no_in;
    if (!grads) grads = &no_gr;
    const float *q = in->q, *k = in->k, *v = in->v, *g = in->g, *beta = in->beta, *h0 = in->h0;
    float *dq = grads->dq, *dk = grads->dk, *dv = grads->dv, *dg = grads->dg, *dbeta = grads->dbeta,
          *ds_in = grads->dh0;
    if (!local && plan) local = gdn_check_inputs(plan, q, k, v, g, beta, cp->rank == 0 || packed ? h0 : NULL);
    /* (a NULL plan is this rank's column of the agreement below: every rank refuses it) */
    if (!local && c) local = gdn_check_tensor("do", dout, c->B * c->T * c->Hv * c->V, c->check_finite, c->threads);
    if (!local && c && (cp->rank == cp->size - 1 || packed) && dht)
        local = gdn_check_tensor("dht", dht, gdn_state_floats(c), c->check_finite, c->threads);
    /* s_in given on some ranks only would send some ranks into the forward's scan alone (and a
     * packed stream's dh0 is gathered from every rank) */
    int rc = gdn_cp_agree(cp, plan, local, GDN_CP_CALL_BACKWARD | (s_in ? GDN_CP_CALL_SIN : 0) |
                                               (packed && ds_in ? GDN_CP_CALL_HT : 0));
    if (rc) return rc;
    if (c->cp == GDN_CP_HEADS)
        return gdn_cp_heads_backward(cp, plan, dq, dk, dv, dg, dbeta, ds_in, q, k, v, g, beta, h0, dout, dht);
    return gdn_cp_rule_backward(cp, plan, dq, dk, dv, dg, dbeta, ds_in, q, k, v, g, beta, h0, s_in, dout, dht);
}

int gdn_cp_gather_rows(gdn_cp *cp, const float *local, int64_t B, int64_t T_local, int64_t inner,
                       float *full, int root) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp context is NULL");
    const int D = cp->size;
    int64_t *T = cp->tab64; /* preallocated (gdn_cp_create): nothing to fail before the first collective */
    int *counts = cp->counts;
    float *all = NULL;
    int rc = GDN_OK;
    if (MPI_Allgather(&T_local, 1, MPI_INT64_T, T, 1, MPI_INT64_T, cp->comm) != MPI_SUCCESS)
        rc = gdn_fail(GDN_ERR_MPI, "MPI_Allgather failed");
    int64_t total = 0;
    for (int r = 0; !rc && r < D; r++) {
        if (B * T[r] * inner > INT_MAX || B * (total + T[r]) * inner > INT_MAX)
            rc = gdn_fail(GDN_ERR_SHAPE, "gather: %lld floats exceed MPI's int counts and displacements "
                          "(write rank by rank instead: gdn_st_writer_begin / gdn_st_write_at)",
                          (long long)(B * (total + T[r]) * inner));
        else counts[r] = (int)(B * T[r] * inner), counts[D + r] = (int)(total * B * inner), total += T[r];
    }
    if (!rc && cp->rank == root && !(all = gdn_malloc("gather rows: the whole tensor", sizeof(float) * (B * total * inner + 1))))
        rc = gdn_fail(GDN_ERR_NOMEM, "gather rows (%lld floats)", (long long)(B * total * inner));
    rc = gdn_cp_agree_status(cp, rc);
    if (!rc && MPI_Gatherv(local, (int)(B * T_local * inner), MPI_FLOAT, all, counts, counts + D,
                           MPI_FLOAT, root, cp->comm) != MPI_SUCCESS)
        rc = gdn_fail(GDN_ERR_MPI, "MPI_Gatherv failed");
    if (!rc && cp->rank == root && full) {
        int64_t t0 = 0;
        for (int r = 0; r < D; r++) { /* rank r's block is [B, T_r, inner]: place row by row */
            for (int64_t b = 0; b < B; b++)
                memcpy(full + (b * total + t0) * inner, all + counts[D + r] + b * T[r] * inner,
                       sizeof(float) * T[r] * inner);
            t0 += T[r];
        }
    }
    free(all);
    return rc;
}
