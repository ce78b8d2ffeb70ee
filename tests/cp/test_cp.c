/* Context parallelism against the single-rank path and the double oracle, every strategy,
 * forward and backward, with negative controls injected into the real CP code path. */
#include "cp_internal.h"
#include "harness.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#define TOL_CP_FWD 1e-5
#define TOL_CP_BWD 2e-5

static int rank, D;
static void golden_cp(gdn_cp_strategy strategy, const char *name);
static void agree_values(void);

/* Rows [t0, t0+tn) of a [B, T, inner] tensor. */
static float *slice_rows(const float *x, int64_t B, int64_t T, int64_t t0, int64_t tn, int64_t inner) {
    float *out = malloc(sizeof(float) * (B * tn * inner + 1));
    for (int64_t b = 0; b < B; b++)
        memcpy(out + b * tn * inner, x + (b * T + t0) * inner, sizeof(float) * tn * inner);
    return out;
}

/* max|ours - ref| and max|ref| over this rank's rows, reduced over ranks. */
static double global_err(const float *ours, const double *ref_full, int64_t B, int64_t T, int64_t t0,
                         int64_t tn, int64_t inner) {
    double loc[2] = {0, 0}, glob[2];
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < tn * inner; i++) {
            const double r = ref_full[(b * T + t0) * inner + i], d = fabs(ours[b * tn * inner + i] - r);
            if (!(d <= loc[0])) loc[0] = d;
            loc[1] = fmax(loc[1], fabs(r));
        }
    if (isnan(loc[0])) loc[0] = INFINITY;
    MPI_Allreduce(loc, glob, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return glob[0] / fmax(glob[1], REL_ERR_FLOOR);
}

/* An error measured on one rank (or the same on all), made the same everywhere. */
static double max_over_ranks(double e) {
    double g;
    if (isnan(e)) e = INFINITY;
    MPI_Allreduce(&e, &g, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return g;
}

static double *to_d(const float *x, int64_t n) {
    double *d = malloc(sizeof(double) * (n + 1));
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

typedef struct {
    int64_t *t0, *tn; /* per rank */
} split;

static split make_split(int64_t T, const int64_t *sizes) {
    split s = {calloc(D, sizeof(int64_t)), calloc(D, sizeof(int64_t))};
    int64_t acc = 0;
    for (int r = 0; r < D; r++) {
        s.tn[r] = sizes ? sizes[r] : T / D + (r < T % D);
        s.t0[r] = acc;
        acc += s.tn[r];
    }
    return s;
}

typedef struct {
    const char *label;
    int64_t B, Hk, Hv, K, V;
    int chunk;
    gate_kind gate;
    int with_h0, with_dht;
    const int64_t *sizes; /* NULL: even split of T */
    int64_t T;
    int fault;            /* a negative control: this fault must make the check fail */
} cp_case;

/* One case through one strategy: CP forward and backward vs the double oracle. */
/* The wait mode run_case's contexts are set to (gdn_cp_set_wait): the default chooses by the
 * node, so both are run explicitly too. */
static int case_wait = GDN_CP_WAIT_AUTO;

static void run_case(const cp_case *cc, gdn_cp_strategy strategy) {
    gdn_config full = gdn_config_default(cc->B, cc->T, cc->Hk, cc->Hv, cc->K, cc->V);
    full.chunk = cc->chunk;
    full.threads = 1;
    problem p;
    problem_make(&p, full, cc->gate, BETA_RANDOM, 1, 4242 + cc->T);
    float *dout = malloc(sizeof(float) * n_v(&full)), *dht = malloc(sizeof(float) * n_state(&full));
    for (int64_t i = 0; i < n_v(&full); i++) dout[i] = (float)rng_uniform(-1, 1);
    for (int64_t i = 0; i < n_state(&full); i++) dht[i] = (float)rng_uniform(-1, 1);
    if (!cc->with_h0) free(p.h0), p.h0 = NULL;
    const int64_t ns = n_state(&full);
    /* The double oracle on the whole sequence (every rank computes it: small shapes). */
    double *o_ref = malloc(sizeof(double) * n_v(&full)), *ht_ref = malloc(sizeof(double) * ns);
    oracle_run(&p, &full, NULL, NULL, NULL, o_ref, ht_ref);
    double *gref[6];
    const int64_t gsz[6] = {n_qk(&full), n_qk(&full), n_v(&full), n_g(&full), n_g(&full), ns};
    for (int i = 0; i < 6; i++) gref[i] = calloc(gsz[i] + 1, sizeof(double));
    double *dq = to_d(p.q, n_qk(&full)), *dk = to_d(p.k, n_qk(&full)), *dv = to_d(p.v, n_v(&full)),
           *dg = to_d(p.g, n_g(&full)), *db = to_d(p.beta, n_g(&full)), *dh = p.h0 ? to_d(p.h0, ns) : NULL,
           *ddo = to_d(dout, n_v(&full)), *ddht = to_d(dht, ns);
    gdn_reference_backward(&full,
                           &(gdn_rule_grads_f64){.dq = gref[0], .dk = gref[1], .dv = gref[2], .dg = gref[3],
                                                 .dbeta = gref[4], .dh0 = gref[5]},
                           &(gdn_rule_inputs_f64){.q = dq, .k = dk, .v = dv, .g = dg, .beta = db, .h0 = dh},
                           ddo, cc->with_dht ? ddht : NULL);
    free(dq), free(dk), free(dv), free(dg), free(db), free(dh), free(ddo), free(ddht);

    /* This rank's shard. */
    split sp = make_split(cc->T, cc->sizes);
    const int64_t t0 = sp.t0[rank], tn = sp.tn[rank], B = cc->B;
    gdn_config loc = full;
    loc.T = tn;
    loc.cp = strategy;
    float *q = slice_rows(p.q, B, cc->T, t0, tn, cc->Hk * cc->K), *k = slice_rows(p.k, B, cc->T, t0, tn, cc->Hk * cc->K);
    float *v = slice_rows(p.v, B, cc->T, t0, tn, cc->Hv * cc->V), *g = slice_rows(p.g, B, cc->T, t0, tn, cc->Hv);
    float *beta = slice_rows(p.beta, B, cc->T, t0, tn, cc->Hv), *ldo = slice_rows(dout, B, cc->T, t0, tn, cc->Hv * cc->V);
    float *o = malloc(sizeof(float) * n_v(&loc)), *ht = malloc(sizeof(float) * ns), *s_in = malloc(sizeof(float) * ns);
    float *gq = malloc(sizeof(float) * n_qk(&loc)), *gk = malloc(sizeof(float) * n_qk(&loc)),
          *gv = malloc(sizeof(float) * n_v(&loc)), *gg = malloc(sizeof(float) * n_g(&loc)),
          *gb = malloc(sizeof(float) * n_g(&loc)), *gs = malloc(sizeof(float) * ns);
    gdn_plan *plan = NULL;
    gdn_cp *cp = NULL;
    int rc = gdn_plan_create(&plan, &loc);
    if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
    if (!rc) rc = gdn_cp_set_wait(cp, case_wait);
    if (!rc) test_mutation = cp_site[cc->fault];
    if (!rc) rc = gdn_cp_forward(cp, plan, o, ht, s_in,
                                 &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta,
                                                    .h0 = p.h0});
    gdn_cp_stats fs = cp ? gdn_cp_last_stats(cp) : (gdn_cp_stats){0};
    const int fwd_rc = rc;
    if (!rc) rc = gdn_cp_backward(cp, plan,
                                  &(gdn_rule_grads){.dq = gq, .dk = gk, .dv = gv, .dg = gg, .dbeta = gb,
                                                    .dh0 = gs},
                                  &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta,
                                                     .h0 = p.h0}, s_in, ldo, cc->with_dht ? dht : NULL);
    int any_rc = rc;
    MPI_Allreduce(&rc, &any_rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);

    char what[256];
    snprintf(what, sizeof what, "%s%s %s D=%d B=%lld T=%lld Hk=%lld Hv=%lld K=%lld V=%lld C=%d h0=%d dht=%d",
             gdn_cp_strategy_name(strategy), case_wait == GDN_CP_WAIT_SLEEP ? " (waits sleep)" : case_wait == GDN_CP_WAIT_SPIN ? " (waits spin)" : "", cc->label, D, (long long)B, (long long)cc->T, (long long)cc->Hk,
             (long long)cc->Hv, (long long)cc->K, (long long)cc->V, cc->chunk, cc->with_h0, cc->with_dht);
    double eo = fwd_rc ? INFINITY : global_err(o, o_ref, B, cc->T, t0, tn, cc->Hv * cc->V);
    /* Also against the single-rank fp32 path on the whole sequence (differences: rounding). */
    double es = INFINITY;
    if (!fwd_rc) {
        float *o_single = malloc(sizeof(float) * n_v(&full));
        double *o_sd = malloc(sizeof(double) * n_v(&full));
        if (chunked_run(&p, &full, o_single, NULL) == GDN_OK) {
            for (int64_t i = 0; i < n_v(&full); i++) o_sd[i] = o_single[i];
            es = global_err(o, o_sd, B, cc->T, t0, tn, cc->Hv * cc->V);
        }
        free(o_single), free(o_sd);
    }
    double eh = fwd_rc ? INFINITY : max_over_ranks(rel_err_f32(ht, ht_ref, ns));
    double eg[6];
    const int64_t inner[5] = {cc->Hk * cc->K, cc->Hk * cc->K, cc->Hv * cc->V, cc->Hv, cc->Hv};
    float *gl[5] = {gq, gk, gv, gg, gb};
    for (int i = 0; i < 5; i++) eg[i] = any_rc ? INFINITY : global_err(gl[i], gref[i], B, cc->T, t0, tn, inner[i]);
    eg[5] = any_rc ? INFINITY : max_over_ranks(rank == 0 && cc->with_h0 ? rel_err_f32(gs, gref[5], ns) : 0.0);
    double ebwd = 0.0;
    for (int i = 0; i < 6; i++) ebwd = fmax(ebwd, eg[i]);
    if (cc->fault == CP_FAULT_NONE) {
        expect_close(fmax(eo, eh), TOL_CP_FWD, "cp forward %s (o %.1e ht %.1e)", what, eo, eh);
        expect_close(es, TOL_CP_FWD, "cp forward vs the single-rank fp32 path %s", what);
        expect_close(ebwd, TOL_CP_BWD, "cp backward %s (dq %.1e dk %.1e dv %.1e dg %.1e db %.1e dh0 %.1e)", what,
                     eg[0], eg[1], eg[2], eg[3], eg[4], eg[5]);
        /* Connectivity: with dht != 0 the gradient reaches every rank's incoming state. */
        if (cc->with_dht && !any_rc && strategy != GDN_CP_HEADS) { /* heads forms no shard states */
            double m = 0.0, mn;
            for (int64_t i = 0; i < ns; i++) m = fmax(m, fabs(gs[i]));
            MPI_Allreduce(&m, &mn, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
            check(mn > 0.0, "every rank's gradient w.r.t. its incoming state is non-zero (min over ranks %.2e) %s", mn, what);
        }
        if (strategy == GDN_CP_SCAN && D > 2 && !fwd_rc) {
            /* Accounting: (ceil(log2(D-1)) + 1) rounds; a middle rank sends at most that many
             * pairs (the last round is a state). */
            int rounds = 0;
            for (int d = 1; d < D - 1; d *= 2) rounds++;
            check(fs.rounds == rounds + 1, "scan forward takes %d rounds (ceil(log2(D-1)) + shift), got %d", rounds + 1, fs.rounds);
        }
    } else {
        static const char *fault_names[] = {"", "reversed composition order", "dropped incoming state", "dropped cross-rank gradient"};
        const double e = cc->fault == CP_FAULT_DROP_GRADIENT ? ebwd : fmax(fmin(eo, es), eh);
        expect_far(e, cc->fault == CP_FAULT_DROP_GRADIENT ? TOL_CP_BWD : TOL_CP_FWD, "%s: %s", fault_names[cc->fault], what);
    }
    test_mutation = NULL;
    gdn_cp_destroy(cp);
    gdn_plan_destroy(plan);
    free(q), free(k), free(v), free(g), free(beta), free(ldo), free(o), free(ht), free(s_in);
    free(gq), free(gk), free(gv), free(gg), free(gb), free(gs), free(sp.t0), free(sp.tn);
    for (int i = 0; i < 6; i++) free(gref[i]);
    free(o_ref), free(ht_ref), free(dout), free(dht);
    problem_free(&p);
}

/* Bad input: every rank gets an error, none hangs, the message names the problem. */
static void bad_input(void) {
    gdn_config c = gdn_config_default(1, 10, 1, 1, rank == D - 1 && D > 1 ? 8 : 16, 16);
    problem p;
    problem_make(&p, c, GATE_MILD, BETA_RANDOM, 0, 5);
    float *o = malloc(sizeof(float) * n_v(&c)), *ht = malloc(sizeof(float) * n_state(&c));
    gdn_plan *plan = NULL;
    gdn_cp *cp = NULL;
    gdn_plan_create(&plan, &c);
    gdn_cp_create(&cp, MPI_COMM_WORLD);
    if (D > 1) {
        int rc = gdn_cp_forward(cp, plan, o, ht, NULL, RULE_INPUTS(&p, NULL));
        int ok = rc == GDN_ERR_MPI && strstr(gdn_errmsg(), "disagree on K"), all;
        MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        check(all, "ranks with different K: every rank returns an error naming K (\"%s\")", gdn_errmsg());
    }
    gdn_plan_destroy(plan);
    problem_free(&p);
    c = gdn_config_default(1, 10, 1, 1, 16, 16);
    problem_make(&p, c, GATE_MILD, BETA_RANDOM, 0, 5);
    gdn_plan_create(&plan, &c);
    if (rank == D - 1) p.v[3] = NAN;
    int rc = gdn_cp_forward(cp, plan, o, ht, NULL, RULE_INPUTS(&p, NULL));
    int ok = rc != GDN_OK, all;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    check(all, "NaN in 'v' on the last rank: every rank returns an error (%s)", gdn_errmsg());
    if (D > 1 && c.Hk % D) {
        gdn_config hc = c;
        hc.cp = GDN_CP_HEADS;
        gdn_plan *hp = NULL;
        gdn_plan_create(&hp, &hc);
        p.v[3] = 0.5f;
        rc = gdn_cp_forward(cp, hp, o, ht, NULL, RULE_INPUTS(&p, NULL));
        ok = rc != GDN_OK && strstr(gdn_errmsg(), "divide");
        MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        check(all, "heads with D=%d not dividing Hk=1: every rank returns an error (%s)", D, gdn_errmsg());
        gdn_plan_destroy(hp);
    }
    /* Ranks that disagree on what happens next stop together, each with the same message,
     * instead of entering different collectives. */
    if (D > 1) {
        float *gq = malloc(sizeof(float) * n_qk(&c)), *gk = malloc(sizeof(float) * n_qk(&c)),
              *gv = malloc(sizeof(float) * n_v(&c)), *gg = malloc(sizeof(float) * n_g(&c)),
              *gb = malloc(sizeof(float) * n_g(&c)), *s_in = calloc(n_state(&c), sizeof(float));
        p.v[3] = 0.5f;
        const struct { const char *what, *needle; } cases[] = {
            {"strategies differ (rank 0 scan, others relay)", "strategy"},
            {"rank 0 calls the forward, the others the backward", "the call"},
            {"s_in given to the backward on rank 0 only", "the call"},
        };
        gdn_config relay = c;
        relay.cp = GDN_CP_RELAY;
        gdn_plan *rp = NULL;
        gdn_plan_create(&rp, &relay);
        for (int i = 0; i < 3; i++) {
            if (i == 0 || (i == 1 && rank == 0))
                rc = gdn_cp_forward(cp, i == 0 && rank ? rp : plan, o, ht, NULL, RULE_INPUTS(&p, NULL));
            else
                rc = gdn_cp_backward(cp, plan,
                                     &(gdn_rule_grads){.dq = gq, .dk = gk, .dv = gv, .dg = gg, .dbeta = gb},
                                     RULE_INPUTS(&p, NULL), i == 2 && rank == 0 ? s_in : NULL, p.v, NULL);
            ok = rc == GDN_ERR_MPI && strstr(gdn_errmsg(), cases[i].needle);
            MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
            check(all, "%s: every rank returns an error naming %s (\"%s\")", cases[i].what, cases[i].needle,
                  gdn_errmsg());
        }
        gdn_plan_destroy(rp);
        free(gq), free(gk), free(gv), free(gg), free(gb), free(s_in);
    }
    gdn_cp_destroy(cp);
    gdn_plan_destroy(plan);
    free(o), free(ht);
    problem_free(&p);
}

/* The `heads` all-to-all sizes, without the memory they describe: counts and displacements in
 * token rows for a small uneven split (exact values; the same comparison against another rank's
 * counts must fail), the 1M tokens per rank at Hv = 32, V = 128 (2^32 floats a rank,
 * beyond int when counted in floats) accepted, and refusals naming the sizes when a count, a
 * displacement or a state share would pass INT_MAX, with controls just inside each limit. */
static void heads_counts(void) {
    const int64_t T3[3] = {1, 64, 65};
    int sc[3], sd[3], rc_[3], rd[3];
    const int want_sc[3] = {128, 128, 128}, want_sd[3] = {0, 128, 256}, want_rc[3] = {2, 128, 130}, want_rd[3] = {0, 2, 130};
    for (int who = 1; who <= 2; who++) { /* rank 1's counts; rank 2's against them: the control */
        gdn_cp_heads_counts(3, T3, who, 2, 1, sc, sd, rc_, rd);
        const int same = !memcmp(sc, want_sc, sizeof sc) && !memcmp(sd, want_sd, sizeof sd) &&
                         !memcmp(rc_, want_rc, sizeof rc_) && !memcmp(rd, want_rd, sizeof rd);
        check(same == (who == 1), "heads counts towards the heads, B=2, shards 1,64,65, rank %d: send %d,%d,%d at %d,%d,%d, "
              "receive %d,%d,%d at %d,%d,%d rows (%s rank 1's expected)", who, sc[0], sc[1], sc[2], sd[0], sd[1], sd[2],
              rc_[0], rc_[1], rc_[2], rd[0], rd[1], rd[2], who == 1 ? "=" : "!=, a control:");
    }
    gdn_cp_heads_counts(3, T3, 1, 2, 0, sc, sd, rc_, rd); /* back: the roles swap */
    check(!memcmp(sc, want_rc, sizeof sc) && !memcmp(sd, want_rd, sizeof sd) && !memcmp(rc_, want_sc, sizeof rc_) &&
          !memcmp(rd, want_sd, sizeof rd), "heads counts back to the sequence: sends and receives swapped");

    const int64_t M = 1 << 20, big4[4] = {M, M, M, M};
    const double floats_per_rank = 4.0 * M * (32 / 4) * 128;
    int st = gdn_cp_heads_check(4, big4, 1, 16, 32, 128, 128);
    int s4[4], d4[4], r4[4], e4[4];
    if (!st) gdn_cp_heads_counts(4, big4, 3, 1, 1, s4, d4, r4, e4);
    check(!st && floats_per_rank > INT32_MAX && d4[3] == 3 * M && e4[3] == 3 * M,
          "heads, 4 ranks x 1M tokens, Hv=32 V=128: %.3g floats a rank (over int) pass as %d-row counts (%s)",
          floats_per_rank, st ? 0 : s4[0], st ? gdn_errmsg() : "ok");

    const int64_t lim = INT32_MAX, at[1] = {lim}, over[1] = {lim + 1}, halves[2] = {lim / 2 + 1, lim / 2 + 1};
    const int64_t lopsided[4] = {1, 1, 1, 600000000}, lopsided_ok[4] = {1, 1, 1, 500000000};
    const int64_t ten[1] = {10}, fifties[2] = {50, 50}, two30[1] = {(int64_t)1 << 30};
    const struct { const char *what; int D; const int64_t *T; int64_t B, Hk, Hv, K, V; int want; const char *needle; } cases[] = {
        {"1 rank, T = INT_MAX rows (the limit)", 1, at, 1, 1, 1, 16, 16, GDN_OK, NULL},
        {"1 rank, T = INT_MAX + 1 rows", 1, over, 1, 1, 1, 16, 16, GDN_ERR_SHAPE, "exceeds MPI's int count"},
        {"2 ranks whose rows sum past INT_MAX", 2, halves, 1, 2, 2, 16, 16, GDN_ERR_SHAPE, "token rows"},
        {"shards 1,1,1,600M: 4 blocks of 600M on the last rank", 4, lopsided, 1, 4, 4, 16, 16, GDN_ERR_SHAPE, "largest shard 600000000"},
        {"shards 1,1,1,500M (2.0e9 rows, inside)", 4, lopsided_ok, 1, 4, 4, 16, 16, GDN_OK, NULL},
        {"B = 2 doubles the rows: 2 x 2^30", 1, two30, 2, 1, 1, 16, 16, GDN_ERR_SHAPE, "(B = 2 x"},
        {"1 rank's state share, B x Hv x K x V = 1024 x 32 x 256 x 256 = 2^31 floats", 1, ten, 1024, 1, 32, 256, 256,
         GDN_ERR_SHAPE, "share of the state"},
        {"the same state over 2 ranks (2^30 floats each, inside)", 2, fifties, 1024, 2, 32, 256, 256, GDN_OK, NULL},
        {"3 ranks, Hk = 2", 3, T3, 1, 2, 2, 16, 16, GDN_ERR_SHAPE, "divide Hk"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        st = gdn_cp_heads_check(cases[i].D, cases[i].T, cases[i].B, cases[i].Hk, cases[i].Hv, cases[i].K, cases[i].V);
        expect_status(st, cases[i].want, cases[i].needle, "heads sizes: %s", cases[i].what);
    }
}

/* ------------------------------------------------------------------ robustness (issue 17) */

/* A CP call that hangs fails the test instead: every rank arms an alarm around each call. */
static void on_alarm(int sig) {
    (void)sig;
    static const char msg[] = "FAIL  a CP call did not return within 30 s (a rank is stuck in a collective)\n";
    if (write(2, msg, sizeof msg - 1) < 0) {}
    _exit(124);
}

/* One small problem and its outputs on this rank: Hk = Hv = D (heads needs D | Hk), 5 tokens a
 * rank; packed: documents {0, 3, T}, h0 / ht / dht / ds_in per document. */
typedef struct {
    gdn_config loc;
    gdn_plan *plan;
    int64_t cu[3];
    float *q, *k, *v, *g, *beta, *h0, *dout, *dht;
    float *o, *ht, *s_in, *gq, *gk, *gv, *gg, *gb, *gs;
} small_case;

static void small_make(small_case *sc, int strategy, int packed, int check_finite, int ckpt) {
    memset(sc, 0, sizeof *sc);
    const int64_t T = 5 * D;
    sc->cu[0] = 0, sc->cu[1] = 3, sc->cu[2] = T;
    gdn_config c = gdn_config_default(1, 5, D, D, 8, 8);
    c.chunk = 16, c.threads = 1, c.check_finite = check_finite, c.checkpoint_chunks = ckpt, c.cp = strategy;
    if (packed) c.cu_seqlens = sc->cu, c.n_docs = 2, c.seq_offset = 5 * rank;
    sc->loc = c;
    problem p;
    problem_make(&p, c, GATE_MILD, BETA_RANDOM, 1, 77 + rank);
    sc->q = p.q, sc->k = p.k, sc->v = p.v, sc->g = p.g, sc->beta = p.beta;
    free(p.h0);
    const int64_t ns = n_state(&c) * (packed ? 2 : 1);
    sc->h0 = random_floats(ns), sc->dht = random_floats(ns), sc->dout = random_floats(n_v(&c));
    sc->o = calloc(n_v(&c), 4), sc->ht = calloc(ns, 4), sc->s_in = calloc(ns, 4), sc->gs = calloc(ns, 4);
    sc->gq = calloc(n_qk(&c), 4), sc->gk = calloc(n_qk(&c), 4), sc->gv = calloc(n_v(&c), 4);
    sc->gg = calloc(n_g(&c), 4), sc->gb = calloc(n_g(&c), 4);
    gdn_plan_create(&sc->plan, &c);
}

static void small_free(small_case *sc) {
    gdn_plan_destroy(sc->plan);
    float *all[] = {sc->q, sc->k, sc->v, sc->g, sc->beta, sc->h0, sc->dout, sc->dht, sc->o, sc->ht, sc->s_in,
                    sc->gq, sc->gk, sc->gv, sc->gg, sc->gb, sc->gs};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

/* One call (forward, or backward recomputing the incoming state), with an alarm. */
static int small_call(gdn_cp *cp, small_case *sc, gdn_plan *plan, int backward) {
    alarm(30);
    int rc = backward ? gdn_cp_backward(cp, plan,
                                        &(gdn_rule_grads){.dq = sc->gq, .dk = sc->gk, .dv = sc->gv,
                                                          .dg = sc->gg, .dbeta = sc->gb, .dh0 = sc->gs},
                                        RULE_INPUTS(sc, sc->h0), NULL, sc->dout, sc->dht)
                      : gdn_cp_forward(cp, plan, sc->o, sc->ht, sc->s_in, RULE_INPUTS(sc, sc->h0));
    alarm(0);
    return rc;
}

/* Every rank's status made visible everywhere: 1 when pred holds on every rank. */
static int all_ranks(int ok) {
    int all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return all;
}

/* A NULL plan on one rank (min(1, D-1)) or on all, forward and backward, every strategy: every
 * rank returns GDN_ERR_ARG naming the rank(s) without a plan; none crashes or hangs. Control: the
 * same calls with every plan return GDN_OK. */
static void null_plans(void) {
    const int bad = D > 1 ? 1 : 0;
    char needle[64];
    for (int s = 0; s < 4; s++) {
        small_case sc;
        small_make(&sc, s, 0, 1, 0);
        gdn_cp *cp = NULL;
        gdn_cp_create(&cp, MPI_COMM_WORLD);
        for (int backward = 0; backward < 2; backward++)
            for (int who = 0; who < 3; who++) { /* 0: rank `bad` only, 1: every rank, 2: none (control) */
                const int mine_null = who == 1 || (who == 0 && rank == bad);
                const int rc = small_call(cp, &sc, mine_null ? NULL : sc.plan, backward);
                if (who == 0) snprintf(needle, sizeof needle, "plan is NULL on rank %d ", bad);
                else snprintf(needle, sizeof needle, "plan is NULL on rank%s 0", D > 1 ? "s" : "");
                const int ok = who == 2 ? rc == GDN_OK : rc == GDN_ERR_ARG && strstr(gdn_errmsg(), needle) != NULL;
                check(all_ranks(ok), "%s %s with %s: every rank returns %s (rank %d: \"%s\")", gdn_cp_strategy_name(s),
                      backward ? "backward" : "forward",
                      who == 0 ? "a NULL plan on one rank" : who == 1 ? "NULL plans on every rank" : "every plan (control)",
                      who == 2 ? "ok" : needle, rank, rc ? gdn_errmsg() : "ok");
            }
        gdn_cp_destroy(cp);
        small_free(&sc);
    }
}

/* The tensor bundles on one rank (min(1, D-1)): a NULL inputs or gradients bundle, or a NULL
 * required field, fails every rank with GDN_ERR_ARG (the rank with it naming the bundle or the
 * field, the others naming that rank), every strategy, forward and backward; none crashes or
 * hangs. Control: the complete bundles return GDN_OK. */
static void null_bundles(void) {
    const int bad = D > 1 ? 1 : 0;
    char other[32];
    snprintf(other, sizeof other, "rank %d", bad);
    for (int s = 0; s < 4; s++) {
        small_case sc;
        small_make(&sc, s, 0, 1, 0);
        gdn_cp *cp = NULL;
        gdn_cp_create(&cp, MPI_COMM_WORLD);
        const gdn_rule_grads gr = {.dq = sc.gq, .dk = sc.gk, .dv = sc.gv, .dg = sc.gg, .dbeta = sc.gb, .dh0 = sc.gs};
        gdn_rule_inputs in_no_k = *RULE_INPUTS(&sc, sc.h0);
        in_no_k.k = NULL;
        gdn_rule_grads gr_no_dbeta = gr;
        gr_no_dbeta.dbeta = NULL;
        /* 0: inputs NULL, 1: grads NULL, 2: in.k NULL, 3: grads.dbeta NULL, 4: none (control) */
        const char *what[] = {"inputs 'in' (gdn_rule_inputs) is NULL", "gradients 'grads' (gdn_rule_grads) is NULL",
                              "input 'k' is NULL", "gradient output 'dbeta' is NULL", "complete bundles"};
        for (int backward = 0; backward < 2; backward++)
            for (int w = 0; w < 5; w++) {
                if (!backward && (w == 1 || w == 3)) continue;
                const int mine = rank == bad && w < 4;
                const gdn_rule_inputs *in = mine && w == 0 ? NULL : mine && w == 2 ? &in_no_k : RULE_INPUTS(&sc, sc.h0);
                const gdn_rule_grads *g = mine && w == 1 ? NULL : mine && w == 3 ? &gr_no_dbeta : &gr;
                alarm(30);
                const int rc = backward ? gdn_cp_backward(cp, sc.plan, g, in, NULL, sc.dout, sc.dht)
                                        : gdn_cp_forward(cp, sc.plan, sc.o, sc.ht, sc.s_in, in);
                alarm(0);
                const int ok = w == 4 ? rc == GDN_OK
                                      : rc == GDN_ERR_ARG && strstr(gdn_errmsg(), rank == bad ? what[w] : other);
                check(all_ranks(ok), "%s %s with %s on rank %d: every rank %s (rank %d: \"%s\")",
                      gdn_cp_strategy_name(s), backward ? "backward" : "forward", what[w], bad,
                      w == 4 ? "returns ok (control)" : "refuses it", rank, rc ? gdn_errmsg() : "ok");
            }
        gdn_cp_destroy(cp);
        small_free(&sc);
    }
}

/* Allocation and MPI datatype failures, one site at a time on rank min(1, D-1): for each strategy,
 * dense and packed, forward and backward, the n-th hooked call fails for n = 1, 2, ... until a
 * call sees fewer than n sites. Every rank must return: GDN_ERR_NOMEM on the failing rank
 * (GDN_ERR_MPI for a datatype), an error naming that rank elsewhere; then the same call with no
 * fault gives the results of a clean run, bit for bit (nothing leaked or left half-made). */
static void fault_sites(void) {
    const int fr = D > 1 ? 1 : 0;
    char needle[32];
    snprintf(needle, sizeof needle, "rank %d", fr);
    for (int s = 0; s < 4; s++)
        for (int packed = 0; packed < 2; packed++)
            for (int backward = 0; backward < 2; backward++) {
                small_case sc;
                small_make(&sc, s, packed, 1, 0);
                gdn_cp *cp = NULL;
                gdn_cp_create(&cp, MPI_COMM_WORLD);
                float *out = backward ? sc.gq : sc.o;
                const int64_t nout = backward ? n_qk(&sc.loc) : n_v(&sc.loc);
                int rc0 = small_call(cp, &sc, sc.plan, backward);
                float *ref = malloc(sizeof(float) * nout);
                memcpy(ref, out, sizeof(float) * nout);
                int sites = 0, bad = 0, after = 1, rc = GDN_OK;
                char failed[256] = "";
                for (long n = 1; n < 100; n++) {
                    /* a fresh context each time: its grow-only scratch is allocated again */
                    gdn_cp *fc = NULL;
                    gdn_cp_create(&fc, MPI_COMM_WORLD);
                    memset(out, 0, sizeof(float) * nout);
                    if (rank == fr) test_fault = (test_fault_ctl){1, n, 0, NULL, NULL};
                    rc = small_call(fc, &sc, sc.plan, backward);
                    const char *site = test_fault.site;
                    test_fault.armed = 0;
                    int hit = site != NULL;
                    MPI_Bcast(&hit, 1, MPI_INT, fr, MPI_COMM_WORLD);
                    if (hit) {
                        sites++;
                        const int want = site && strstr(site, "MPI datatype") ? GDN_ERR_MPI : GDN_ERR_NOMEM;
                        const int ok = rank == fr ? rc == want : rc != GDN_OK && strstr(gdn_errmsg(), needle) != NULL;
                        if (!all_ranks(ok)) {
                            bad++;
                            if (rank == fr && strlen(failed) < 200)
                                snprintf(failed + strlen(failed), sizeof failed - strlen(failed), " [%s]", site);
                        }
                        /* the same context again without a fault: the clean run's results */
                        memset(out, 0, sizeof(float) * nout);
                        rc = small_call(fc, &sc, sc.plan, backward);
                        after &= rc == GDN_OK && !memcmp(out, ref, sizeof(float) * nout);
                    } else { /* no site left: the call ran clean, the control */
                        after &= rc0 == GDN_OK && rc == GDN_OK && !memcmp(out, ref, sizeof(float) * nout);
                    }
                    gdn_cp_destroy(fc);
                    if (!hit) break;
                }
                MPI_Bcast(failed, sizeof failed, MPI_CHAR, fr, MPI_COMM_WORLD);
                check(sites > 0 && bad == 0, "%s %s %s: each of %d allocation/datatype sites failing on rank %d makes every "
                      "rank return an error (its own code there, naming rank %d elsewhere)%s%s",
                      gdn_cp_strategy_name(s), packed ? "packed" : "dense", backward ? "backward" : "forward", sites, fr,
                      fr, bad ? "; wrong at:" : "", failed);
                check(all_ranks(after), "%s %s %s: after each fault the same context runs clean, with the clean run's "
                      "results bit for bit, as does a call that met no fault (the control; status %d)",
                      gdn_cp_strategy_name(s), packed ? "packed" : "dense", backward ? "backward" : "forward", rc);
                free(ref);
                gdn_cp_destroy(cp);
                small_free(&sc);
            }
    /* gdn_cp_create: its allocations, then gdn_cp_gather_rows' */
    for (long n = 1; n < 20; n++) {
        gdn_cp *cp = NULL;
        if (rank == fr) test_fault = (test_fault_ctl){1, n, 0, NULL, NULL};
        alarm(30);
        const int rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
        alarm(0);
        const int hit_here = test_fault.site != NULL;
        test_fault.armed = 0;
        int hit = hit_here;
        MPI_Bcast(&hit, 1, MPI_INT, fr, MPI_COMM_WORLD);
        if (!hit) {
            check(all_ranks(rc == GDN_OK && cp != NULL), "gdn_cp_create after %ld failing allocation sites: ok (control)",
                  n - 1);
            float x[6] = {1, 2, 3, 4, 5, 6}, *full = rank == 0 ? malloc(sizeof(float) * 6 * D) : NULL;
            int sites = 0, bad = 0;
            for (long m = 1; m < 20; m++) {
                if (rank == fr) test_fault = (test_fault_ctl){1, m, 0, NULL, NULL};
                alarm(30);
                const int r2 = gdn_cp_gather_rows(cp, x, 1, 2, 3, full, 0);
                alarm(0);
                int h = test_fault.site != NULL;
                test_fault.armed = 0;
                MPI_Bcast(&h, 1, MPI_INT, fr, MPI_COMM_WORLD);
                if (!h) {
                    check(all_ranks(r2 == GDN_OK), "gdn_cp_gather_rows without faults: ok (control)");
                    break;
                }
                sites++;
                bad += !all_ranks(rank == fr ? r2 == GDN_ERR_NOMEM : r2 != GDN_OK && strstr(gdn_errmsg(), needle));
            }
            if (fr == 0) /* only the root allocates there */
                check(sites == 1 && bad == 0, "gdn_cp_gather_rows: its allocation failing on the root: every rank errs");
            free(full);
            gdn_cp_destroy(cp);
            break;
        }
        check(all_ranks(rank == fr ? rc == GDN_ERR_NOMEM : rc != GDN_OK && strstr(gdn_errmsg(), needle)) &&
                  all_ranks(cp == NULL),
              "gdn_cp_create with allocation %ld failing on rank %d: every rank returns an error, no context (\"%s\")", n,
              fr, gdn_errmsg());
    }
}

/* The conv halo: its message datatypes and its gradient buffer failing on one rank, forward and
 * backward, 2-token shards and 3 halo rows (messages from several predecessors): every rank
 * returns an error (GDN_ERR_MPI / GDN_ERR_NOMEM there, naming the rank elsewhere), no hang; the
 * control without faults exchanges the rows. */
static void halo_faults(void) {
    const int fr = D > 1 ? 1 : 0;
    char needle[32];
    snprintf(needle, sizeof needle, "rank %d", fr);
    gdn_cp *cp = NULL;
    gdn_cp_create(&cp, MPI_COMM_WORLD);
    float x[6], dx[6], halo[9], dhalo[9];
    for (int i = 0; i < 6; i++) x[i] = (float)(100 * rank + i);
    for (int i = 0; i < 9; i++) dhalo[i] = 1.0f;
    for (int backward = 0; backward < 2; backward++) {
        int sites = 0, bad = 0, rc = GDN_OK;
        for (long n = 1; n < 50; n++) {
            if (rank == fr) test_fault = (test_fault_ctl){1, n, 0, NULL, NULL};
            memset(dx, 0, sizeof dx);
            alarm(30);
            rc = backward ? gdn_cp_halo_backward(cp, dx, dhalo, 1, 2, 3, 3, 3, GDN_OK)
                          : gdn_cp_halo_forward(cp, halo, x, 1, 2, 3, 3, 3, GDN_OK);
            alarm(0);
            const char *site = test_fault.site;
            test_fault.armed = 0;
            int hit = site != NULL;
            MPI_Bcast(&hit, 1, MPI_INT, fr, MPI_COMM_WORLD);
            if (!hit) break;
            sites++;
            const int want = site && strstr(site, "MPI datatype") ? GDN_ERR_MPI : GDN_ERR_NOMEM;
            bad += !all_ranks(rank == fr ? rc == want : rc != GDN_OK && strstr(gdn_errmsg(), needle) != NULL);
        }
        /* the control: the predecessor's last row (or zeros on rank 0); the gradient of my rows
         * from the successors whose halo they are */
        const int ok = rc == GDN_OK && (backward ? (rank + 1 < D ? dx[3] > 0.0f : dx[3] == 0.0f)
                                                  : (rank ? halo[6] == (float)(100 * (rank - 1) + 3) : halo[6] == 0.0f));
        check((D == 1 || sites > 0) && bad == 0 && all_ranks(ok),
              "cp halo %s: each of %d datatype/buffer sites failing on rank %d makes every rank return an error; "
              "without faults the rows arrive", backward ? "backward" : "forward", sites, fr);
    }
    gdn_cp_destroy(cp);
}

/* The heads strategy's cached plan is made for the whole config: check_finite and the
 * checkpoint interval too. check_finite off then on: a q row whose squared norm overflows fp32
 * (finite values, caught only inside the kernel) is refused by the second call; on then off
 * (the control direction): accepted. Two backward calls with checkpoints every 1 and every 2
 * chunks: the cached plan follows (64 tokens a rank, 4 chunks of 16). */
static void heads_plan_key(void) {
    gdn_cp *cp = NULL;
    gdn_cp_create(&cp, MPI_COMM_WORLD);
    for (int order = 0; order < 2; order++) {
        int rc[2];
        for (int i = 0; i < 2; i++) {
            const int cf = order == 0 ? i : 1 - i; /* order 0: off, on; order 1: on, off */
            small_case sc;
            small_make(&sc, GDN_CP_HEADS, 0, cf, 0);
            if (i == 1 && rank == D - 1) sc.q[3] = 3e19f;
            rc[i] = small_call(cp, &sc, sc.plan, 0);
            small_free(&sc);
        }
        if (order == 0)
            check(all_ranks(rc[0] == GDN_OK && rc[1] == GDN_ERR_NONFINITE),
                  "heads: check_finite off, then on with an overflowing q row: the second call is refused (%d, %d: %s)",
                  rc[0], rc[1], gdn_errmsg());
        else
            check(all_ranks(rc[0] == GDN_OK && rc[1] == GDN_OK),
                  "heads: check_finite on, then off with an overflowing q row: not checked (%d, %d)", rc[0], rc[1]);
    }
    int ck[2] = {0, 0}, rcs[2] = {0, 0};
    for (int i = 0; i < 2; i++) {
        gdn_config c = gdn_config_default(1, 64, D, D, 8, 8);
        c.chunk = 16, c.threads = 1, c.checkpoint_chunks = i + 1, c.cp = GDN_CP_HEADS;
        problem p;
        problem_make(&p, c, GATE_MILD, BETA_RANDOM, 0, 5);
        float *dout = random_floats(n_v(&c)), *gr = malloc(sizeof(float) * (3 * n_qk(&c) + n_v(&c) + 2 * n_g(&c)));
        gdn_plan *plan = NULL;
        gdn_plan_create(&plan, &c);
        alarm(30);
        rcs[i] = gdn_cp_backward(cp, plan,
                                 &(gdn_rule_grads){.dq = gr, .dk = gr + n_qk(&c), .dv = gr + 2 * n_qk(&c),
                                                   .dg = gr + 3 * n_qk(&c),
                                                   .dbeta = gr + 3 * n_qk(&c) + n_g(&c)},
                                 RULE_INPUTS(&p, NULL), NULL, dout, NULL);
        alarm(0);
        ck[i] = cp->heads_plan ? gdn_plan_config(cp->heads_plan)->checkpoint_chunks : -1;
        gdn_plan_destroy(plan);
        free(dout), free(gr);
        problem_free(&p);
    }
    check(all_ranks(!rcs[0] && !rcs[1] && ck[0] == 1 && ck[1] == 2),
          "heads: checkpoints every 1 then every 2 chunks: the head-parallel plan has %d then %d (want 1, 2)", ck[0], ck[1]);
    gdn_cp_destroy(cp);
}

/* The issue-17 checks: NULL plans, allocation and datatype faults, the heads plan cache. */
static void robustness(void) {
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGALRM, &sa, &old);
    null_plans();
    null_bundles();
    fault_sites();
    halo_faults();
    heads_plan_key();
    sigaction(SIGALRM, &old, NULL);
}

/* gdn_cp_set_wait: collective, one mode on every rank, the rest refused everywhere. */
static void wait_modes(void) {
    gdn_cp *cp = NULL;
    if (gdn_cp_create(&cp, MPI_COMM_WORLD)) {
        check(0, "wait modes: gdn_cp_create: %s", gdn_errmsg());
        return;
    }
    const int dflt = gdn_cp_get_wait(cp);
    check(dflt == GDN_CP_WAIT_SPIN || dflt == GDN_CP_WAIT_SLEEP, "the default wait mode is spin or sleep (%s here)",
          dflt == GDN_CP_WAIT_SLEEP ? "sleep" : "spin");
    int rc = gdn_cp_set_wait(cp, GDN_CP_WAIT_SLEEP);
    check(!rc && gdn_cp_get_wait(cp) == GDN_CP_WAIT_SLEEP, "gdn_cp_set_wait(SLEEP) on every rank: sleep");
    rc = gdn_cp_set_wait(cp, GDN_CP_WAIT_AUTO);
    check(!rc && gdn_cp_get_wait(cp) == dflt, "gdn_cp_set_wait(AUTO): the default again");
    if (D >= 2) {
        rc = gdn_cp_set_wait(cp, rank == D - 1 ? GDN_CP_WAIT_SPIN : GDN_CP_WAIT_SLEEP);
        int worst = rc;
        MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        expect_status(worst == rc ? rc : GDN_OK, GDN_ERR_ARG, "different wait modes",
                      "the last rank asking to spin, the others to sleep: refused on every rank");
        check(gdn_cp_get_wait(cp) == dflt, "... and the mode is unchanged");
    }
    rc = gdn_cp_set_wait(cp, rank == 0 ? 7 : GDN_CP_WAIT_SPIN);
    expect_status(rc, GDN_ERR_ARG, rank == 0 ? "mode 7 is not" : "another rank passed an unknown mode",
                  "an unknown mode on rank 0: refused on every rank");
    gdn_cp_destroy(cp);
}

void test_cp(void) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    int64_t uneven[8], tiny[8], T_uneven = 0;
    for (int r = 0; r < D; r++) {
        uneven[r] = r % 3 == 0 ? 1 : r % 3 == 1 ? 29 : 70; /* 1-token shards among others */
        T_uneven += uneven[r];
        tiny[r] = 3;
    }
    const cp_case cases[] = {
        {"even", 2, 1, 2, 32, 16, 64, GATE_MILD, 1, 1, NULL, 200, 0},
        {"uneven+1-token", 1, 2, 4, 16, 24, 32, GATE_MILD, 0, 1, uneven, T_uneven, 0},
        {"more-ranks-than-chunks", 1, 1, 1, 16, 16, 64, GATE_ZERO, 1, 0, tiny, 3 * D, 0},
        {"no-h0-no-dht", 2, 1, 1, 16, 8, 16, GATE_MILD, 0, 0, NULL, 50 + D, 0},
    };
    const int strategies[] = {GDN_CP_SCAN, GDN_CP_ALLGATHER, GDN_CP_RELAY};
    for (int s = 0; s < 3; s++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], (gdn_cp_strategy)strategies[s]);
    wait_modes();
    /* the uneven case in each explicit wait mode, every strategy (its own collectives) */
    for (case_wait = GDN_CP_WAIT_SPIN; case_wait <= GDN_CP_WAIT_SLEEP; case_wait++)
        for (int s = 0; s < 4; s++)
            run_case(s == 3 ? &(cp_case){"heads-uneven", 1, D, D, 16, 8, 16, GATE_MILD, 1, 1, uneven, T_uneven, 0}
                            : &cases[1],
                     s == 3 ? GDN_CP_HEADS : (gdn_cp_strategy)strategies[s]);
    case_wait = GDN_CP_WAIT_AUTO;
    /* heads: D must divide Hk. */
    const cp_case heads = {"heads-shape", 2, D, 2 * D, 16, 16, 32, GATE_MILD, 1, 1, NULL, 90, 0};
    run_case(&heads, GDN_CP_HEADS);
    const cp_case heads_uneven = {"heads-uneven", 1, D, D, 16, 8, 16, GATE_MILD, 1, 1, uneven, T_uneven, 0};
    run_case(&heads_uneven, GDN_CP_HEADS);
    for (int s = 0; s < 4; s++) {
        golden_cp((gdn_cp_strategy)s, "gdn_qwen_heads");
        golden_cp((gdn_cp_strategy)s, "gdn_strong_gates");
    }
    /* Negative controls through the same checks. */
    if (D >= 2) {
        cp_case c = cases[0];
        c.fault = CP_FAULT_DROP_INCOMING;
        for (int s = 0; s < 3; s++) run_case(&c, (gdn_cp_strategy)strategies[s]);
        c.fault = CP_FAULT_DROP_GRADIENT;
        for (int s = 0; s < 3; s++) run_case(&c, (gdn_cp_strategy)strategies[s]);
    }
    if (D >= 4) {
        cp_case c = cases[0];
        c.fault = CP_FAULT_REVERSED_ORDER;
        run_case(&c, GDN_CP_SCAN);
        run_case(&c, GDN_CP_ALLGATHER);
    }
    bad_input();
    agree_values();
    heads_counts();
    robustness();
}

/* gdn_cp_agree_values: one well-formed collective whatever n each rank passes (K1: a rank that
 * failed early passes no values while the others pass theirs), and the values beyond one row
 * compared in a second exchange. Each case's expectation is checked on every rank. */
static void agree_values(void) {
    gdn_cp *cp = NULL;
    gdn_cp_create(&cp, MPI_COMM_WORLD);
    enum { N = 45 }; /* beyond one row of GDN_CP_AGREE_COLS */
    int64_t v[N];
    const char *names[N];
    char buf[N][8];
    for (int i = 0; i < N; i++) v[i] = 1000 + i, snprintf(buf[i], sizeof buf[i], "v%d", i), names[i] = buf[i];
    const int last = rank == D - 1 && D > 1;
    struct { const char *what; int n, fail, bad_at; const char *needle; } cases[] = {
        {"equal 7 values", 7, 0, -1, NULL},
        {"equal 45 values (two exchanges)", N, 0, -1, NULL},
        {"the last rank failed early and passes no values, the others 7", 7, GDN_ERR_ARG, -1, "rank"},
        {"the last rank passes 6 values, the others 7", 7, 0, -1, "number of values"},
        {"45 values, the last rank's v40 differs", N, 0, 40, "v40"},
        {"7 values, the last rank's v3 differs", 7, 0, 3, "v3"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        if (D < 2 && cases[k].needle) continue; /* disagreements need two ranks */
        int n = cases[k].n, local = GDN_OK;
        if (last && cases[k].fail) n = 0, local = cases[k].fail;
        if (last && k == 3) n = 6;
        if (last && cases[k].bad_at >= 0) v[cases[k].bad_at] = -7;
        const int rc = gdn_cp_agree_values(cp, n ? v : NULL, n, names, local);
        if (last && cases[k].bad_at >= 0) v[cases[k].bad_at] = 1000 + cases[k].bad_at;
        int ok = cases[k].needle ? rc != GDN_OK && strstr(gdn_errmsg(), cases[k].needle) != NULL : rc == GDN_OK, all;
        MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        check(all, "agree_values: %s -> %s on every rank (\"%s\")", cases[k].what,
              cases[k].needle ? cases[k].needle : "agreed", rc ? gdn_errmsg() : "ok");
    }
    gdn_cp_destroy(cp);
}

/* A golden file split over the ranks: every rank reads the whole file and keeps its slice. */
static void golden_cp(gdn_cp_strategy strategy, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s.safetensors", GDN_GOLDEN_DIR, name);
    gdn_problem pb;
    int rc = gdn_problem_load(&pb, path, 1, 0, -1, 0);
    if (rc) {
        check(0, "golden %s loads (%s)", name, gdn_errmsg());
        return;
    }
    const gdn_config *c = &pb.cfg;
    if (strategy == GDN_CP_HEADS && c->Hk % D) { /* not applicable: covered by the bad-input test */
        gdn_problem_free(&pb);
        return;
    }
    gdn_st_file *f = NULL;
    gdn_st_open(&f, path);
    const int64_t T = c->T, B = c->B, ns = n_state(c);
    split sp = make_split(T, NULL);
    const int64_t t0 = sp.t0[rank], tn = sp.tn[rank];
    gdn_config loc = *c;
    loc.T = tn;
    loc.threads = 1;
    loc.cp = strategy;
    float *q = slice_rows(pb.q, B, T, t0, tn, c->Hk * c->K), *k = slice_rows(pb.k, B, T, t0, tn, c->Hk * c->K);
    float *v = slice_rows(pb.v, B, T, t0, tn, c->Hv * c->V), *g = slice_rows(pb.g, B, T, t0, tn, c->Hv);
    float *beta = slice_rows(pb.beta, B, T, t0, tn, c->Hv), *ldo = slice_rows(pb.dout, B, T, t0, tn, c->Hv * c->V);
    float *o = malloc(sizeof(float) * n_v(&loc)), *ht = malloc(sizeof(float) * ns), *gs = malloc(sizeof(float) * ns);
    float *gr[5] = {malloc(sizeof(float) * n_qk(&loc)), malloc(sizeof(float) * n_qk(&loc)), malloc(sizeof(float) * n_v(&loc)),
                    malloc(sizeof(float) * n_g(&loc)), malloc(sizeof(float) * n_g(&loc))};
    gdn_plan *plan = NULL;
    gdn_cp *cp = NULL;
    rc = gdn_plan_create(&plan, &loc);
    if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
    if (!rc) rc = gdn_cp_forward(cp, plan, o, ht, NULL,
                                 &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta,
                                                    .h0 = pb.h0});
    if (!rc) rc = gdn_cp_backward(cp, plan,
                                  &(gdn_rule_grads){.dq = gr[0], .dk = gr[1], .dv = gr[2], .dg = gr[3],
                                                    .dbeta = gr[4], .dh0 = gs},
                                  &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta,
                                                     .h0 = pb.h0}, NULL, ldo, pb.dht);
    int any;
    MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    static const char *names[] = {"o", "dq", "dk", "dv", "dg", "dbeta"};
    const int64_t inner[6] = {c->Hv * c->V, c->Hk * c->K, c->Hk * c->K, c->Hv * c->V, c->Hv, c->Hv};
    const int64_t full[6] = {n_v(c), n_qk(c), n_qk(c), n_v(c), n_g(c), n_g(c)};
    float *mine[6] = {o, gr[0], gr[1], gr[2], gr[3], gr[4]};
    double worst_f = 0, worst_b = 0;
    for (int i = 0; i < 6; i++) {
        double *ref = malloc(sizeof(double) * full[i]);
        gdn_st_read_f64(f, names[i], ref, full[i]);
        const double e = any ? INFINITY : global_err(mine[i], ref, B, T, t0, tn, inner[i]);
        if (i == 0) worst_f = e;
        else worst_b = fmax(worst_b, e);
        free(ref);
    }
    double *ref = malloc(sizeof(double) * ns);
    gdn_st_read_f64(f, "ht", ref, ns);
    worst_f = fmax(worst_f, any ? INFINITY : max_over_ranks(rel_err_f32(ht, ref, ns)));
    if (pb.h0) {
        gdn_st_read_f64(f, "dh0", ref, ns);
        worst_b = fmax(worst_b, any ? INFINITY : max_over_ranks(rank == 0 ? rel_err_f32(gs, ref, ns) : 0.0));
    }
    free(ref);
    expect_close(worst_f, TOL_CP_FWD, "golden %s over D=%d with %s: o, ht", name, D, gdn_cp_strategy_name(strategy));
    expect_close(worst_b, TOL_CP_BWD, "golden %s over D=%d with %s: dq, dk, dv, dg, dbeta, dh0", name, D,
                 gdn_cp_strategy_name(strategy));
    gdn_cp_destroy(cp);
    gdn_plan_destroy(plan);
    gdn_st_close(f);
    free(q), free(k), free(v), free(g), free(beta), free(ldo), free(o), free(ht), free(gs), free(sp.t0), free(sp.tn);
    for (int i = 0; i < 5; i++) free(gr[i]);
    gdn_problem_free(&pb);
}
