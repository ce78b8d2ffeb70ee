/* The gated attention layer over a sequence split across ranks (DESIGN §10): projections, norms,
 * RoPE (at global positions: the plan's seq_offset), the gate and o_proj are token-local; only
 * the core crosses ranks, by one of two strategies (cfg.cp):
 *
 * kv    Rank r's queries need the keys and values of ranks 0..r. They travel down a pipeline:
 *       at step s rank r attends the block of rank r - s, which it received from r - 1 at the
 *       step before while it attended the previous one (two buffers, nonblocking point to
 *       point), and passes it on to r + 1. Partial results merge by their log-sum-exp. In the
 *       backward the blocks travel again with their key/value gradient accumulators: each rank
 *       adds its queries' share and passes both on; the last rank sends each accumulator home,
 *       where its owner adds it to its own share (received into a buffer posted at the start).
 *       Bytes per rank: (D - 1 - r) T_r 2 Hkv d forward, twice that plus the return backward.
 *       Contiguous shards make the last rank do (2D - 1)/D times the mean work.
 *
 * heads An all-to-all to head-parallel: rank p gets the whole sequence of query heads
 *       [p H/D, (p + 1) H/D) and their kv heads (replicated on several ranks when D > Hkv),
 *       runs the single-rank core over it, and an all-to-all brings o and lse back. The
 *       backward sends q, k, v, dO, lse and D out and dq, dk, dv back; the owner of a token sums
 *       the gradients of a replicated kv head over the ranks that used it, in rank order.
 *       Balanced by construction; bytes ~ T_r (2H + 2Hkv) d (D - 1)/D each way.
 *
 * Every call agrees first on everything that decides the messages (shapes, strategy, the call,
 * the documents, each rank's shard and seq_offset), then reserves its buffers and agrees on
 * that, so a failure on one rank is a failure on every rank before any message moves. */
#include "attention_internal.h"
#include "cp_internal.h"

#include <limits.h>
#include <math.h>
#include <string.h>

enum { TAG_KV = 31, TAG_HOME = 32 };

/* ---------------------------------------------------------------- agreement and layout */

typedef struct {
    int D, r;
    int64_t B, T_total, T_max, *t_off; /* t_off[r]: rank r's first token (cp->tab64) */
    int64_t Hp, Hkvp;                 /* heads: query and kv heads per rank */
} cp_layout;

/* The kv heads rank p holds under heads: [kv_lo, kv_lo + Hkvp). */
static int64_t heads_kv_lo(const gdn_attn_config *c, int64_t Hp, int p) { return (int64_t)p * Hp / (c->H / c->Hkv); }

/* heads: one side (send or receive) of the widest exchange: D N rows one way, B T_total the other. */
static size_t heads_side_floats(const gdn_attn_plan *ap, const cp_layout *L, int backward) {
    const size_t Hp = (size_t)L->Hp, Hkvp = (size_t)L->Hkvp, d = (size_t)ap->cfg.d;
    const size_t out_w = backward ? (2 * Hp + 2 * Hkvp) * d + 2 * Hp : (Hp + 2 * Hkvp) * d;
    const size_t back_w = backward ? (Hp + 2 * Hkvp) * d : Hp * (d + 1);
    const size_t rows_out = (size_t)ap->N * (size_t)L->D, rows_in = (size_t)L->B * (size_t)L->T_total;
    return (rows_out > rows_in ? rows_out : rows_in) * (out_w > back_w ? out_w : back_w);
}

static size_t scratch_floats(const gdn_attn_plan *ap, const cp_layout *L, int backward) {
    const gdn_attn_config *c = &ap->cfg;
    const size_t B = (size_t)L->B, Tm = (size_t)L->T_max, N = (size_t)ap->N, Kd = (size_t)ap->Kd, d = (size_t)c->d;
    if (c->cp == GDN_ATTN_CP_KV) /* two blocks in flight (+ gradients), a partial result or the home buffer */
        return backward ? 2 * B * Tm * 4 * Kd + N * 2 * Kd : 2 * B * Tm * 2 * Kd + N * ((size_t)ap->Hd + (size_t)c->H);
    /* heads: send and receive buffers of the widest exchange, and the head-parallel tensors */
    const size_t Hp = (size_t)L->Hp, Hkvp = (size_t)L->Hkvp, Tt = B * (size_t)L->T_total;
    const size_t tensors = Tt * (backward ? (4 * Hp + 4 * Hkvp) * d + 2 * Hp : (2 * Hp + 2 * Hkvp) * d + Hp);
    return 2 * heads_side_floats(ap, L, backward) + tensors;
}

static int attn_cp_agree(gdn_cp *cp, const gdn_attn_plan *ap, int backward, const float *saved, int local,
                         cp_layout *L) {
    enum { NV = 16 };
    static const char *const names[NV] = {
        "the attention call (forward/backward)", "B", "E", "H", "Hkv", "d", "R", "rope_theta", "eps",
        "pos_offset", "the attention CP strategy", "saved given", "packing (n_docs of cu_seqlens, -1: dense)",
        "the cu_seqlens offsets (a hash)", "max_position", "has a plan"};
    int64_t v[NV] = {backward};
    if (ap) {
        const gdn_attn_config *c = &ap->cfg;
        int32_t eps_bits;
        int64_t theta_bits;
        memcpy(&eps_bits, &c->eps, 4), memcpy(&theta_bits, &c->rope_theta, 8);
        const int64_t s[NV] = {backward, c->B, c->E, c->H, c->Hkv, c->d, c->R, theta_bits, eps_bits, c->pos_offset,
                               c->cp, saved != NULL, c->cu_seqlens ? c->n_docs : -1,
                               gdn_cp_docs_hash(c->cu_seqlens, c->n_docs),
                               c->max_position, 1};
        memcpy(v, s, sizeof v);
    } else if (!local) {
        local = gdn_fail(GDN_ERR_ARG, "attention plan is NULL");
    }
    int rc = gdn_cp_agree_values(cp, v, NV, names, local);
    if (rc) return rc;
    /* every rank's shard and seq_offset, checked alike everywhere */
    const gdn_attn_config *c = &ap->cfg;
    const int D = cp->size;
    int64_t mine[2] = {c->T, c->seq_offset}, *all = cp->agree_tab + GDN_CP_AGREE_COLS;
    const double t0 = MPI_Wtime();
    const int mrc = MPI_Allgather(mine, 2, MPI_INT64_T, all, 2, MPI_INT64_T, cp->comm);
    cp->stats.comm_s += MPI_Wtime() - t0;
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Allgather failed (attention shards)");
    L->D = D, L->r = cp->rank, L->B = c->B, L->t_off = cp->tab64, L->T_total = 0, L->T_max = 0;
    for (int p = 0; p < D; p++) {
        cp->shard_T[p] = all[2 * p], L->t_off[p] = L->T_total;
        if (all[2 * p + 1] != L->T_total)
            return gdn_fail(GDN_ERR_SHAPE,
                            "attention: rank %d's plan has seq_offset %lld but the ranks before it hold %lld tokens "
                            "(seq_offset must be the shard's first token in the sequence)",
                            p, (long long)all[2 * p + 1], (long long)L->T_total);
        L->T_total += all[2 * p], L->T_max = all[2 * p] > L->T_max ? all[2 * p] : L->T_max;
    }
    if (c->cu_seqlens && c->cu_seqlens[c->n_docs] != L->T_total)
        return gdn_fail(GDN_ERR_SHAPE, "attention cu_seqlens ends at %lld but the %d ranks hold %lld tokens in all",
                        (long long)c->cu_seqlens[c->n_docs], D, (long long)L->T_total);
    if (c->cp == GDN_ATTN_CP_HEADS) {
        const int64_t grp = c->H / c->Hkv;
        if (c->H % D)
            return gdn_fail(GDN_ERR_SHAPE, "attention strategy 'heads' needs the rank count (%d) to divide H (%lld); "
                            "use 'kv'", D, (long long)c->H);
        L->Hp = c->H / D;
        if (L->Hp % grp == 0) L->Hkvp = L->Hp / grp;
        else if (grp % L->Hp == 0) L->Hkvp = 1;
        else
            return gdn_fail(GDN_ERR_SHAPE,
                            "attention strategy 'heads': %lld query heads per rank and %lld per kv head must divide one "
                            "another (H = %lld, Hkv = %lld, %d ranks); use 'kv'",
                            (long long)L->Hp, (long long)grp, (long long)c->H, (long long)c->Hkv, D);
        if ((double)L->B * (double)(L->T_total > D * L->T_max ? L->T_total : D * L->T_max) > INT_MAX)
            return gdn_fail(GDN_ERR_SHAPE, "attention strategy 'heads': %lld token rows exceed MPI's int count; use 'kv'",
                            (long long)(L->B * L->T_total));
    } else if ((double)L->B * (double)L->T_max > INT_MAX) {
        return gdn_fail(GDN_ERR_SHAPE, "attention strategy 'kv': a block of %lld token rows exceeds MPI's int count",
                        (long long)(L->B * L->T_max));
    }
    /* the buffers, then a second agreement so that no rank is left waiting on one that could not get them */
    const size_t need = scratch_floats(ap, L, backward);
    local = gdn_cp_scratch(cp, need) ? GDN_OK
                                     : gdn_fail(GDN_ERR_NOMEM, "attention CP buffers (%.1f MB)", 4.0 * (double)need / 1e6);
    return gdn_cp_agree_status(cp, local);
}

static int row_type(int64_t floats, MPI_Datatype *t) {
    if (GDN_CP_MPI_TYPE("attention cp: MPI datatype", MPI_Type_contiguous((int)floats, MPI_FLOAT, t)) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Type_contiguous of a %lld-float row failed", (long long)floats);
    MPI_Type_commit(t);
    return GDN_OK;
}

/* Wait for a request, counting the time as communication. */
static int wait(gdn_cp *cp, MPI_Request *rq) {
    if (*rq == MPI_REQUEST_NULL) return GDN_OK;
    const double t0 = MPI_Wtime();
    const int mrc = gdn_cp_wait_all(cp, 1, rq);
    cp->stats.comm_s += MPI_Wtime() - t0;
    return mrc == MPI_SUCCESS ? GDN_OK : gdn_fail(GDN_ERR_MPI, "MPI_Wait failed (attention cp)");
}

static int post(gdn_cp *cp, int send, float *buf, int64_t rows, MPI_Datatype t, int peer, int tag, MPI_Request *rq,
                int64_t row_floats) {
    const int mrc = send ? MPI_Isend(buf, (int)rows, t, peer, tag, cp->comm, rq)
                         : MPI_Irecv(buf, (int)rows, t, peer, tag, cp->comm, rq);
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_I%s failed (attention cp)", send ? "send" : "recv");
    if (send) cp->stats.bytes_sent += 4 * (uint64_t)(rows * row_floats), cp->stats.messages++;
    else cp->stats.bytes_recv += 4 * (uint64_t)(rows * row_floats);
    return GDN_OK;
}

/* ---------------------------------------------------------------- kv */

static int64_t shard(const gdn_cp *cp, int p) { return cp->shard_T[p]; }

/* Pack this rank's keys (normed, rotated) and values planar into buf: K [B, T, Kd] then V. */
static void pack_kv(const gdn_attn_plan *ap, const float *proj, float *buf) {
    const int64_t N = ap->N, Kd = ap->Kd, P = ap->P, Hd = ap->Hd;
    memcpy(buf, ap->kr, sizeof(float) * (size_t)(N * Kd));
    for (int64_t n = 0; n < N; n++) memcpy(buf + (N + n) * Kd, proj + n * P + 2 * Hd + Kd, sizeof(float) * (size_t)Kd);
}

/* This rank's queries against rank src's block held planar in buf: K [B, T_src, Kd], V after it
 * (then, in the backward, dK and dV). */
static gdn_attn_core kv_block_view(const gdn_attn_plan *ap, const cp_layout *L, const gdn_cp *cp, int src,
                                   const float *proj, float *buf) {
    const int64_t Ts = shard(cp, src), Kd = ap->Kd, d = ap->cfg.d, nb = L->B * Ts * Kd;
    gdn_attn_core v = gdn_attn_local_view(ap, proj);
    v.nk = Ts, v.k0 = L->t_off[src];
    v.K = (gdn_attn_kv){buf, Kd, d, Ts * Kd};
    v.V = (gdn_attn_kv){buf + nb, Kd, d, Ts * Kd};
    return v;
}

static int kv_forward(gdn_cp *cp, gdn_attn_plan *ap, const cp_layout *L, gdn_attn_saved sv) {
    const int drop_kv = gdn_test_mutate("attention cp: keys and values of earlier ranks dropped");
    const gdn_attn_config *c = &ap->cfg;
    const int r = L->r, D = L->D;
    const int64_t row = 2 * ap->Kd, blk = L->B * L->T_max * row;
    float *buf[2] = {cp->scratch, cp->scratch + blk};
    float *o2 = cp->scratch + 2 * blk, *lse2 = o2 + ap->N * ap->Hd;
    MPI_Datatype t;
    int rc = row_type(ap->Kd, &t); /* counted in rows of Kd floats: K rows then V rows */
    if (rc) return rc;
    MPI_Request rs = MPI_REQUEST_NULL, rr = MPI_REQUEST_NULL;
    const int next = r + 1 < D ? r + 1 : MPI_PROC_NULL, prev = r > 0 ? r - 1 : MPI_PROC_NULL;
    pack_kv(ap, sv.proj, buf[0]);
    /* step 1: send the own block on, receive rank r-1's */
    if (next != MPI_PROC_NULL) rc = post(cp, 1, buf[0], 2 * L->B * shard(cp, r), t, next, TAG_KV, &rs, ap->Kd);
    if (!rc && r >= 1) rc = post(cp, 0, buf[1], 2 * L->B * shard(cp, r - 1), t, prev, TAG_KV, &rr, ap->Kd);
    double t0 = MPI_Wtime();
    const gdn_attn_core own = gdn_attn_local_view(ap, sv.proj);
    gdn_attn_core_forward(&own, sv.o, sv.lse);
    cp->stats.replay_s += MPI_Wtime() - t0;
    for (int s = 1; s <= r && !rc; s++) {
        float *cur = buf[s % 2], *other = buf[(s + 1) % 2];
        if ((rc = wait(cp, &rr)) || (rc = wait(cp, &rs))) break;
        /* step s + 1: pass block r - s on (rank r + 1 needs it next) and receive block r - s - 1 */
        if (next != MPI_PROC_NULL) rc = post(cp, 1, cur, 2 * L->B * shard(cp, r - s), t, next, TAG_KV, &rs, ap->Kd);
        if (!rc && s + 1 <= r) rc = post(cp, 0, other, 2 * L->B * shard(cp, r - s - 1), t, prev, TAG_KV, &rr, ap->Kd);
        if (drop_kv) continue;
        t0 = MPI_Wtime();
        const gdn_attn_core v = kv_block_view(ap, L, cp, r - s, sv.proj, cur);
        gdn_attn_core_forward(&v, o2, lse2);
        gdn_attn_merge(ap->N, c->H, c->d, ap->Hd, sv.o, sv.lse, o2, lse2, ap->threads);
        cp->stats.replay_s += MPI_Wtime() - t0;
        cp->stats.rounds++;
    }
    if (!rc) rc = wait(cp, &rr);
    if (!rc) rc = wait(cp, &rs);
    MPI_Type_free(&t);
    return rc;
}

/* Backward: dqr, dkr and dproj's v columns (zeroed by the caller) receive this rank's gradients. */
static int kv_backward(gdn_cp *cp, gdn_attn_plan *ap, const cp_layout *L, gdn_attn_saved sv) {
    const int drop_kv = gdn_test_mutate("attention cp: keys and values of earlier ranks dropped"), drop_grad = gdn_test_mutate("attention cp: key and value gradients of later ranks dropped");
    const gdn_attn_config *c = &ap->cfg;
    const int r = L->r, D = L->D;
    const int64_t Kd = ap->Kd, blk = L->B * L->T_max * 4 * Kd, N = ap->N;
    float *buf[2] = {cp->scratch, cp->scratch + blk}, *home = cp->scratch + 2 * blk;
    MPI_Datatype t;
    int rc = row_type(Kd, &t);
    if (rc) return rc;
    MPI_Request rs = MPI_REQUEST_NULL, rr = MPI_REQUEST_NULL, rh = MPI_REQUEST_NULL, rsh[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    const int next = r + 1 < D ? r + 1 : MPI_PROC_NULL, prev = r > 0 ? r - 1 : MPI_PROC_NULL, last = D - 1;
    /* a block travels as K, V, dK, dV (each [B, T_src, Kd]); the own one starts with zero gradients */
    pack_kv(ap, sv.proj, buf[0]);
    memset(buf[0] + 2 * N * Kd, 0, sizeof(float) * (size_t)(2 * N * Kd));
    if (next != MPI_PROC_NULL) rc = post(cp, 1, buf[0], 4 * N, t, next, TAG_KV, &rs, Kd);
    if (!rc && r >= 1) rc = post(cp, 0, buf[1], 4 * L->B * shard(cp, r - 1), t, prev, TAG_KV, &rr, Kd);
    if (!rc && r < last) rc = post(cp, 0, home, 2 * N, t, last, TAG_HOME, &rh, Kd);
    const gdn_attn_kv dk = {ap->dkr, Kd, c->d, c->T * Kd}, dv = {ap->dproj + 2 * ap->Hd + Kd, ap->P, c->d, c->T * ap->P};
    double t0 = MPI_Wtime();
    const gdn_attn_core own = gdn_attn_local_view(ap, sv.proj);
    gdn_attn_core_backward_q(&own, ap->dO, sv.lse, ap->Dv, ap->dqr);
    gdn_attn_core_backward_kv(&own, ap->dO, sv.lse, ap->Dv, dk, dv);
    cp->stats.replay_s += MPI_Wtime() - t0;
    for (int s = 1; s <= r && !rc; s++) {
        float *cur = buf[s % 2], *other = buf[(s + 1) % 2];
        const int src = r - s;
        const int64_t Ts = shard(cp, src), nb = L->B * Ts * Kd;
        if ((rc = wait(cp, &rr)) || (rc = wait(cp, &rs)) || (rc = wait(cp, &rsh[(s + 1) % 2]))) break;
        if (s + 1 <= r) rc = post(cp, 0, other, 4 * L->B * shard(cp, src - 1), t, prev, TAG_KV, &rr, Kd);
        if (rc) break;
        t0 = MPI_Wtime();
        if (!drop_kv) {
            gdn_attn_core v = kv_block_view(ap, L, cp, src, sv.proj, cur);
            const gdn_attn_kv bdk = {cur + 2 * nb, Kd, c->d, Ts * Kd}, bdv = {cur + 3 * nb, Kd, c->d, Ts * Kd};
            gdn_attn_core_backward_q(&v, ap->dO, sv.lse, ap->Dv, ap->dqr);
            gdn_attn_core_backward_kv(&v, ap->dO, sv.lse, ap->Dv, bdk, bdv);
        }
        cp->stats.replay_s += MPI_Wtime() - t0;
        cp->stats.rounds++;
        /* on down the pipeline, or (from the last rank) home with the finished gradients */
        if (next != MPI_PROC_NULL) rc = post(cp, 1, cur, 4 * L->B * Ts, t, next, TAG_KV, &rs, Kd);
        else rc = post(cp, 1, cur + 2 * nb, 2 * L->B * Ts, t, src, TAG_HOME, &rsh[s % 2], Kd);
    }
    if (!rc) rc = wait(cp, &rr);
    if (!rc) rc = wait(cp, &rs);
    if (!rc) rc = wait(cp, &rsh[0]);
    if (!rc) rc = wait(cp, &rsh[1]);
    if (!rc) rc = wait(cp, &rh);
    MPI_Type_free(&t);
    if (rc || r == last || drop_grad) return rc;
    /* the later ranks' share of this rank's key and value gradients */
#pragma omp parallel for num_threads(ap->threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t e = 0; e < Kd; e++)
            dk.p[n * Kd + e] += home[n * Kd + e], dv.p[n * ap->P + e] += home[(N + n) * Kd + e];
    return GDN_OK;
}

/* ---------------------------------------------------------------- heads */

/* One all-to-all of rows: this rank's B T_r token rows (row width sw) towards every rank, B T_p
 * rows of width rw from every rank p (towards = 1), or the reverse (towards = 0). */
static int heads_exchange(gdn_cp *cp, const cp_layout *L, int towards, float *sbuf, int64_t sw, float *rbuf,
                          int64_t rw) {
    int *sc = cp->counts, *sd = sc + L->D, *rc_ = sd + L->D, *rd = rc_ + L->D;
    int64_t so = 0, ro = 0;
    for (int p = 0; p < L->D; p++) {
        const int64_t srows = towards ? L->B * shard(cp, L->r) : L->B * shard(cp, p);
        const int64_t rrows = towards ? L->B * shard(cp, p) : L->B * shard(cp, L->r);
        sc[p] = (int)srows, sd[p] = (int)so, rc_[p] = (int)rrows, rd[p] = (int)ro;
        so += srows, ro += rrows;
    }
    MPI_Datatype st, rt;
    int rc = row_type(sw, &st);
    if (rc) return rc;
    if ((rc = row_type(rw, &rt))) {
        MPI_Type_free(&st);
        return rc;
    }
    const double t0 = MPI_Wtime();
    const int mrc = MPI_Alltoallv(sbuf, sc, sd, st, rbuf, rc_, rd, rt, cp->comm);
    cp->stats.comm_s += MPI_Wtime() - t0;
    MPI_Type_free(&st), MPI_Type_free(&rt);
    if (mrc != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Alltoallv failed (attention heads)");
    cp->stats.bytes_sent += 4 * (uint64_t)((so - sc[L->r]) * sw), cp->stats.bytes_recv += 4 * (uint64_t)((ro - rc_[L->r]) * rw);
    cp->stats.messages += (uint64_t)(L->D - 1), cp->stats.rounds++;
    return GDN_OK;
}

/* Head-parallel tensors of this rank, [B, T_total, ...] token-major over its heads. */
typedef struct {
    float *q, *kv, *o, *lse, *dO, *D, *dq, *dkv;
} heads_tensors;

/* The scratch (sized by scratch_floats) as the send and receive buffers of the widest exchange,
 * then the head-parallel tensors. */
static heads_tensors heads_carve(gdn_cp *cp, const gdn_attn_plan *ap, const cp_layout *L, int backward, float **sbuf,
                                 float **rbuf) {
    const int64_t Tt = L->B * L->T_total, hd = L->Hp * ap->cfg.d, kvd = 2 * L->Hkvp * ap->cfg.d;
    const size_t side = heads_side_floats(ap, L, backward);
    *sbuf = cp->scratch, *rbuf = cp->scratch + side;
    heads_tensors h = {0};
    h.q = cp->scratch + 2 * side, h.kv = h.q + Tt * hd, h.o = h.kv + Tt * kvd, h.lse = h.o + Tt * hd;
    if (backward) h.dO = h.lse + Tt * L->Hp, h.D = h.dO + Tt * hd, h.dq = h.D + Tt * L->Hp, h.dkv = h.dq + Tt * hd;
    return h;
}

static gdn_attn_core heads_view(const gdn_attn_plan *ap, const cp_layout *L, const heads_tensors *h) {
    const gdn_attn_config *c = &ap->cfg;
    const int64_t Tt = L->T_total, hk = L->Hkvp * c->d;
    gdn_attn_core v = {
        .B = L->B, .H = L->Hp, .Hkv = L->Hkvp, .d = c->d, .Q = h->q, .nq = Tt, .q0 = 0, .qld = L->Hp * c->d,
        .nk = Tt, .k0 = 0, .K = {h->kv, 2 * hk, c->d, Tt * 2 * hk}, .V = {h->kv + hk, 2 * hk, c->d, Tt * 2 * hk},
        .cu = ap->cu, .n_docs = c->n_docs, .threads = ap->threads, .bf16 = ap->cfg.compute == GDN_COMPUTE_BF16, .tile = ap->tile,
    };
    return v;
}

/* Row b, global token tg of the head-parallel layout, from rank p's block of the receive buffer. */
static int64_t heads_row(const cp_layout *L, int p, int64_t b, int64_t t) { return b * L->T_total + L->t_off[p] + t; }

static int heads_forward(gdn_cp *cp, gdn_attn_plan *ap, const cp_layout *L, gdn_attn_saved sv, int backward_inputs,
                         heads_tensors *hout) {
    const int drop_kv = gdn_test_mutate("attention cp: keys and values of earlier ranks dropped");
    const gdn_attn_config *c = &ap->cfg;
    const int64_t d = c->d, Hp = L->Hp, Hkvp = L->Hkvp, N = ap->N, P = ap->P, Hd = ap->Hd, Kd = ap->Kd;
    const int64_t hd = Hp * d, kvd = Hkvp * d;
    const int64_t sw = backward_inputs ? 2 * hd + 2 * kvd + 2 * Hp : hd + 2 * kvd;
    float *sbuf, *rbuf;
    heads_tensors h = heads_carve(cp, ap, L, backward_inputs, &sbuf, &rbuf);
    /* out: for every rank p, this rank's tokens over p's heads: q | k v | (dO lse D) */
    for (int p = 0; p < L->D; p++) {
        const int64_t kv_lo = heads_kv_lo(c, Hp, p);
#pragma omp parallel for num_threads(ap->threads) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float *row = sbuf + ((int64_t)p * N + n) * sw;
            memcpy(row, ap->qr + n * Hd + p * hd, sizeof(float) * (size_t)hd);
            memcpy(row + hd, ap->kr + n * Kd + kv_lo * d, sizeof(float) * (size_t)kvd);
            memcpy(row + hd + kvd, sv.proj + n * P + 2 * Hd + Kd + kv_lo * d, sizeof(float) * (size_t)kvd);
            if (backward_inputs) {
                memcpy(row + hd + 2 * kvd, ap->dO + n * Hd + p * hd, sizeof(float) * (size_t)hd);
                memcpy(row + 2 * hd + 2 * kvd, sv.lse + n * c->H + p * Hp, sizeof(float) * (size_t)Hp);
                memcpy(row + 2 * hd + 2 * kvd + Hp, ap->Dv + n * c->H + p * Hp, sizeof(float) * (size_t)Hp);
            }
        }
    }
    int rc = heads_exchange(cp, L, 1, sbuf, sw, rbuf, sw);
    if (rc) return rc;
    /* in: rank p's tokens over this rank's heads, into the head-parallel layout */
    int64_t at = 0;
    for (int p = 0; p < L->D; p++) {
        const int64_t Tp = shard(cp, p);
        const int drop = drop_kv && p != L->r;
        for (int64_t b = 0; b < L->B; b++)
            for (int64_t t = 0; t < Tp; t++, at++) {
                const float *row = rbuf + at * sw;
                const int64_t g = heads_row(L, p, b, t);
                memcpy(h.q + g * hd, row, sizeof(float) * (size_t)hd);
                if (drop) memset(h.kv + g * 2 * kvd, 0, sizeof(float) * (size_t)(2 * kvd));
                else memcpy(h.kv + g * 2 * kvd, row + hd, sizeof(float) * (size_t)(2 * kvd));
                if (backward_inputs) {
                    memcpy(h.dO + g * hd, row + hd + 2 * kvd, sizeof(float) * (size_t)hd);
                    memcpy(h.lse + g * Hp, row + 2 * hd + 2 * kvd, sizeof(float) * (size_t)Hp);
                    memcpy(h.D + g * Hp, row + 2 * hd + 2 * kvd + Hp, sizeof(float) * (size_t)Hp);
                }
            }
    }
    *hout = h;
    if (backward_inputs) return GDN_OK;
    const double t0 = MPI_Wtime();
    const gdn_attn_core v = heads_view(ap, L, &h);
    gdn_attn_core_forward(&v, h.o, h.lse);
    cp->stats.replay_s += MPI_Wtime() - t0;
    /* back: o | lse of every rank's tokens over this rank's heads */
    const int64_t bw = hd + Hp;
    at = 0;
    for (int p = 0; p < L->D; p++)
        for (int64_t b = 0; b < L->B; b++)
            for (int64_t t = 0; t < shard(cp, p); t++, at++) {
                const int64_t g = heads_row(L, p, b, t);
                memcpy(sbuf + at * bw, h.o + g * hd, sizeof(float) * (size_t)hd);
                memcpy(sbuf + at * bw + hd, h.lse + g * Hp, sizeof(float) * (size_t)Hp);
            }
    if ((rc = heads_exchange(cp, L, 0, sbuf, bw, rbuf, bw))) return rc;
    for (int p = 0; p < L->D; p++)
#pragma omp parallel for num_threads(ap->threads) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *row = rbuf + ((int64_t)p * N + n) * bw;
            memcpy(sv.o + n * Hd + p * hd, row, sizeof(float) * (size_t)hd);
            memcpy(sv.lse + n * c->H + p * Hp, row + hd, sizeof(float) * (size_t)Hp);
        }
    return GDN_OK;
}

static int heads_backward(gdn_cp *cp, gdn_attn_plan *ap, const cp_layout *L, gdn_attn_saved sv) {
    const int drop_grad = gdn_test_mutate("attention cp: key and value gradients of later ranks dropped");
    const gdn_attn_config *c = &ap->cfg;
    const int64_t d = c->d, Hp = L->Hp, Hkvp = L->Hkvp, N = ap->N, P = ap->P, Hd = ap->Hd, Kd = ap->Kd;
    const int64_t hd = Hp * d, kvd = Hkvp * d, Tt = L->B * L->T_total;
    heads_tensors h;
    int rc = heads_forward(cp, ap, L, sv, 1, &h);
    if (rc) return rc;
    float *sbuf, *rbuf;
    heads_carve(cp, ap, L, 1, &sbuf, &rbuf);
    memset(h.dq, 0, sizeof(float) * (size_t)(Tt * hd));
    memset(h.dkv, 0, sizeof(float) * (size_t)(Tt * 2 * kvd));
    const double t0 = MPI_Wtime();
    const gdn_attn_core v = heads_view(ap, L, &h);
    const gdn_attn_kv dk = {h.dkv, 2 * kvd, d, L->T_total * 2 * kvd}, dv = {h.dkv + kvd, 2 * kvd, d, L->T_total * 2 * kvd};
    gdn_attn_core_backward_q(&v, h.dO, h.lse, h.D, h.dq);
    gdn_attn_core_backward_kv(&v, h.dO, h.lse, h.D, dk, dv);
    cp->stats.replay_s += MPI_Wtime() - t0;
    /* back: dq | dk dv of every rank's tokens over this rank's heads */
    const int64_t bw = hd + 2 * kvd;
    int64_t at = 0;
    for (int p = 0; p < L->D; p++)
        for (int64_t b = 0; b < L->B; b++)
            for (int64_t t = 0; t < shard(cp, p); t++, at++) {
                const int64_t g = heads_row(L, p, b, t);
                memcpy(sbuf + at * bw, h.dq + g * hd, sizeof(float) * (size_t)hd);
                memcpy(sbuf + at * bw + hd, h.dkv + g * 2 * kvd, sizeof(float) * (size_t)(2 * kvd));
            }
    if ((rc = heads_exchange(cp, L, 0, sbuf, bw, rbuf, bw))) return rc;
    /* dq is this rank's to take; a kv head several ranks used sums their shares in rank order */
    for (int p = 0; p < L->D; p++) {
        const int64_t kv_lo = heads_kv_lo(c, Hp, p);
        const int skip = drop_grad && p > 0 && heads_kv_lo(c, Hp, p - 1) == kv_lo;
#pragma omp parallel for num_threads(ap->threads) schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *row = rbuf + ((int64_t)p * N + n) * bw;
            memcpy(ap->dqr + n * Hd + p * hd, row, sizeof(float) * (size_t)hd);
            if (skip) continue;
            float *dkn = ap->dkr + n * Kd + kv_lo * d, *dvn = ap->dproj + n * P + 2 * Hd + Kd + kv_lo * d;
            for (int64_t e = 0; e < kvd; e++) dkn[e] += row[hd + e], dvn[e] += row[hd + kvd + e];
        }
    }
    return GDN_OK;
}

/* ---------------------------------------------------------------- entry points */

static int core_forward(gdn_cp *cp, gdn_attn_plan *ap, const cp_layout *L, gdn_attn_saved sv) {
    if (ap->cfg.cp == GDN_ATTN_CP_KV) return kv_forward(cp, ap, L, sv);
    heads_tensors h;
    return heads_forward(cp, ap, L, sv, 0, &h);
}

/* The forward with a local status from the caller's own checks (a prefill's cache), agreed with
 * everything else before any message. */
static int cp_forward(gdn_cp *cp, gdn_attn_plan *ap, float *y, float *saved, const float *x, const float *w,
                      int local) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp context is NULL");
    int rc = local;
    if (!rc && ap) rc = gdn_attn_check_inputs(ap, x, w);
    if (!rc && !y) rc = gdn_fail(GDN_ERR_ARG, "output 'y' is NULL");
    memset(&cp->stats, 0, sizeof cp->stats);
    cp_layout L;
    if ((rc = attn_cp_agree(cp, ap, 0, saved, rc, &L))) return rc;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    const gdn_attn_saved sv = gdn_attn_saved_view(ap, saved ? saved : ap->saved);
    gdn_attn_project(ap, sv.proj, x, w);
    gdn_attn_norm_rope(ap, sv.proj, w);
    rc = core_forward(cp, ap, &L, sv);
    if (!rc) gdn_attn_finish(ap, y, sv, w);
    gdn_fp_fast_end(fm);
    if (!rc) rc = gdn_check_output("y", y, ap->N * ap->cfg.E, ap->threads);
    return gdn_cp_agree_status(cp, rc);
}

int gdn_attn_cp_forward(gdn_cp *cp, gdn_attn_plan *ap, float *y, float *saved, const float *x, const float *w) {
    return cp_forward(cp, ap, y, saved, x, w, GDN_OK);
}

int gdn_attn_cp_backward(gdn_cp *cp, gdn_attn_plan *ap, float *dx, float *dw, const float *x, const float *w,
                         const float *saved, const float *dy) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp context is NULL");
    int rc = ap ? gdn_attn_check_inputs(ap, x, w) : GDN_OK;
    if (!rc && ap) rc = gdn_check_tensor("dy", dy, ap->N * ap->cfg.E, ap->cfg.check_finite, ap->threads);
    if (!rc && (!dx || !dw)) rc = gdn_fail(GDN_ERR_ARG, "output '%s' is NULL", dx ? "dw" : "dx");
    memset(&cp->stats, 0, sizeof cp->stats);
    cp_layout L;
    if ((rc = attn_cp_agree(cp, ap, 1, saved, rc, &L))) return rc;
    const gdn_attn_config *c = &ap->cfg;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    const gdn_attn_saved sv = gdn_attn_backward_restore(ap, saved, x, w);
    if (!saved) rc = core_forward(cp, ap, &L, sv); /* not saved on any rank (agreed): collectively again */
    if (!rc) {
        gdn_attn_backward_gate(ap, dw, sv, w, dy);
        rc = c->cp == GDN_ATTN_CP_KV ? kv_backward(cp, ap, &L, sv) : heads_backward(cp, ap, &L, sv);
    }
    if (!rc) gdn_attn_backward_finish(ap, dx, dw, sv, x, w);
    gdn_fp_fast_end(fm);
    if (!rc) rc = gdn_check_output("dx", dx, ap->N * c->E, ap->threads);
    if (!rc) rc = gdn_check_output("dw", dw, (int64_t)gdn_attn_param_floats(c), ap->threads);
    return gdn_cp_agree_status(cp, rc);
}

/* ---------------------------------------------------------------- generation */

int gdn_attn_cp_prefill(gdn_cp *cp, gdn_attn_plan *ap, gdn_attn_cache *cache, float *y, const float *x,
                        const float *w) {
    int local = GDN_OK;
    if (!cache) local = gdn_fail(GDN_ERR_ARG, "gdn_attn_cp_prefill: cache is NULL");
    else if (ap && (cache->B != ap->cfg.B || cache->Hkv != ap->cfg.Hkv || cache->d != ap->cfg.d))
        local = gdn_fail(GDN_ERR_SHAPE, "gdn_attn_cp_prefill: the cache is for B = %lld, Hkv = %lld, d = %lld; the plan "
                         "has B = %lld, Hkv = %lld, d = %lld", (long long)cache->B, (long long)cache->Hkv,
                         (long long)cache->d, (long long)ap->cfg.B, (long long)ap->cfg.Hkv, (long long)ap->cfg.d);
    else if (ap && ap->cfg.cu_seqlens)
        local = gdn_fail(GDN_ERR_ARG, "gdn_attn_cp_prefill: the plan is packed; a cache holds dense rows");
    else if (cache->len)
        local = gdn_fail(GDN_ERR_ARG, "gdn_attn_cp_prefill: the cache must be empty (it holds %lld positions)",
                         (long long)cache->len);
    else if (ap && cache->cap < ap->cfg.T)
        local = gdn_fail(GDN_ERR_SHAPE, "gdn_attn_cp_prefill: the cache's capacity %lld is below this shard's %lld tokens",
                         (long long)cache->cap, (long long)ap->cfg.T);
    const int rc = cp_forward(cp, ap, y, NULL, x, w, local);
    if (rc) return rc;
    gdn_attn_cache_append(ap, cache, gdn_attn_saved_view(ap, ap->saved).proj); /* the forward's keys and values */
    cache->len = ap->cfg.T;
    return GDN_OK;
}

int gdn_attn_cp_decode(gdn_cp *cp, gdn_attn_plan *ap, gdn_attn_cache *cache, float *y, const float *x,
                       const float *w) {
    if (!cp) return gdn_fail(GDN_ERR_ARG, "cp context is NULL");
    int local = !ap ? gdn_fail(GDN_ERR_ARG, "gdn_attn_cp_decode: plan is NULL")
              : !cache ? gdn_fail(GDN_ERR_ARG, "gdn_attn_cp_decode: cache is NULL") : GDN_OK;
    memset(&cp->stats, 0, sizeof cp->stats);
    const int D = cp->size, r = cp->rank, last = r == D - 1;
    /* every rank's cached length: the new tokens' positions follow all of them */
    int64_t mine = cache ? cache->len : 0, *len = cp->tab64, total = 0, k0 = 0;
    double t0 = MPI_Wtime();
    if (MPI_Allgather(&mine, 1, MPI_INT64_T, len, 1, MPI_INT64_T, cp->comm) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Allgather failed (attention cp decode)");
    cp->stats.comm_s += MPI_Wtime() - t0;
    for (int p = 0; p < D; p++) k0 += p < r ? len[p] : 0, total += len[p];
    if (!local) local = gdn_attn_decode_check(ap, cache, y, x, w, total, last);
    /* the same call everywhere, x included (a hash of its bits) */
    enum { NV = 12 };
    static const char *const names[NV] = {"B", "T", "E", "H", "Hkv", "d", "R", "rope_theta", "eps", "pos_offset",
                                          "max_position", "the new tokens' x (a hash)"};
    int64_t v[NV] = {0};
    if (!local) {
        const gdn_attn_config *c = &ap->cfg;
        int32_t eps_bits;
        int64_t theta_bits;
        memcpy(&eps_bits, &c->eps, 4), memcpy(&theta_bits, &c->rope_theta, 8);
        const int64_t s[NV] = {c->B, c->T, c->E, c->H, c->Hkv, c->d, c->R, theta_bits, eps_bits, c->pos_offset,
                               c->max_position, gdn_cp_digest(x, sizeof *x * (size_t)(ap->N * c->E))};
        memcpy(v, s, sizeof v);
    }
    int rc = gdn_cp_agree_values(cp, v, NV, names, local);
    if (rc) return rc;
    const gdn_attn_config *c = &ap->cfg;
    const int64_t N = ap->N, H = c->H, Hd = ap->Hd, d = c->d, row = Hd + H;
    float *m = gdn_cp_scratch(cp, (size_t)(N * H + N * row));
    if ((rc = gdn_cp_agree_status(cp, m ? GDN_OK : gdn_fail(GDN_ERR_NOMEM, "attention cp decode buffers")))) return rc;
    float *acc = m + N * H;
    const gdn_fpmode fm = gdn_fp_fast_begin();
    const gdn_attn_saved sv = gdn_attn_saved_view(ap, ap->saved);
    gdn_attn_decode_project(ap, sv, x, w, c->pos_offset + total);
    if (last) gdn_attn_cache_append(ap, cache, sv.proj);
    t0 = MPI_Wtime();
    gdn_attn_decode_attend(ap, cache, cache->len + (last ? c->T : 0), total, k0, sv.o, sv.lse);
    if (!last && gdn_test_mutate("attention cp: keys and values of earlier ranks dropped"))
        for (int64_t i = 0; i < N * H; i++) sv.lse[i] = -INFINITY;
    cp->stats.replay_s += MPI_Wtime() - t0;
    /* merge over ranks: m = max lse; sum of o e^(lse - m) and of e^(lse - m) */
    t0 = MPI_Wtime();
    rc = MPI_Allreduce(sv.lse, m, (int)(N * H), MPI_FLOAT, MPI_MAX, cp->comm) == MPI_SUCCESS
             ? GDN_OK : gdn_fail(GDN_ERR_MPI, "MPI_Allreduce failed (attention cp decode)");
    for (int64_t n = 0; n < N && !rc; n++)
        for (int64_t h = 0; h < H; h++) {
            const float l = sv.lse[n * H + h], wt = l == -INFINITY ? 0.0f : expf(l - m[n * H + h]);
            for (int64_t e = 0; e < d; e++) acc[n * row + h * d + e] = wt * sv.o[n * Hd + h * d + e];
            acc[n * row + Hd + h] = wt;
        }
    if (!rc && MPI_Allreduce(MPI_IN_PLACE, acc, (int)(N * row), MPI_FLOAT, MPI_SUM, cp->comm) != MPI_SUCCESS)
        rc = gdn_fail(GDN_ERR_MPI, "MPI_Allreduce failed (attention cp decode)");
    cp->stats.comm_s += MPI_Wtime() - t0, cp->stats.rounds += 2;
    for (int64_t n = 0; n < N && !rc; n++)
        for (int64_t h = 0; h < H; h++) {
            const float ws = acc[n * row + Hd + h], inv = ws > 0.0f ? 1.0f / ws : 0.0f;
            for (int64_t e = 0; e < d; e++) sv.o[n * Hd + h * d + e] = acc[n * row + h * d + e] * inv;
            sv.lse[n * H + h] = ws > 0.0f ? m[n * H + h] + logf(ws) : -INFINITY;
        }
    if (!rc) gdn_attn_finish(ap, y, sv, w);
    gdn_fp_fast_end(fm);
    if (!rc) rc = gdn_check_output("y", y, N * c->E, ap->threads);
    if ((rc = gdn_cp_agree_status(cp, rc))) {
        if (last) gdn_attn_cache_unappend(cache, c->T);
        return rc;
    }
    if (last) cache->len += c->T;
    return GDN_OK;
}
