/* gdn_step (the decode fast path) against the double oracle, against the chunked forward at
 * T = 1, negative controls through the same comparison, and its errors. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* DESIGN §6: fp32 vs the fp64 oracle, max-abs error over max-abs reference, per tensor (here per
 * step for o: every token's output separately, and the final state). */
#define TOL_STEP 1e-5

/* A stepping function: one token for all streams, in place (gdn_step or a test variant). */
typedef int (*step_fn)(gdn_plan *plan, float *o, float *state, const gdn_rule_inputs *in);

/* A wrong variant for the negative control: the decay applied after the delta (the delta then
 * uses the undecayed state). Plain loops, in fp32, same layouts and options as gdn_step. */
static int step_decay_after(gdn_plan *plan, float *o, float *state, const gdn_rule_inputs *in) {
    const float *q = in->q, *k = in->k, *v = in->v, *g = in->g, *beta = in->beta;
    const gdn_config *c = gdn_plan_config(plan);
    const int64_t r = c->Hv / c->Hk, K = c->K, V = c->V;
    float kn[GDN_MAX_HEAD_DIM], qs[GDN_MAX_HEAD_DIM], d[GDN_MAX_HEAD_DIM];
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t j = 0; j < c->Hv; j++) {
            const int64_t it = b * c->Hv + j;
            const float *kr = k + (b * c->Hk + j / r) * K, *qr = q + (b * c->Hk + j / r) * K;
            float sk = 0, sq = 0;
            for (int64_t i = 0; i < K; i++) sk += kr[i] * kr[i], sq += qr[i] * qr[i];
            const float ki = c->l2norm ? 1.0f / sqrtf(sk + 1e-6f) : 1.0f;
            const float qi = c->scale * (c->l2norm ? 1.0f / sqrtf(sq + 1e-6f) : 1.0f);
            for (int64_t i = 0; i < K; i++) kn[i] = kr[i] * ki, qs[i] = qr[i] * qi;
            float *S = state + it * K * V;
            const float e = expf(g[it]);
            for (int64_t col = 0; col < V; col++) {
                float u = 0;
                for (int64_t i = 0; i < K; i++) u += kn[i] * S[i * V + col];
                d[col] = beta[it] * (v[it * V + col] - u);
            }
            for (int64_t i = 0; i < K; i++)
                for (int64_t col = 0; col < V; col++)
                    S[i * V + col] = e * (S[i * V + col] + kn[i] * d[col]);
            for (int64_t col = 0; col < V; col++) {
                float s = 0;
                for (int64_t i = 0; i < K; i++) s += qs[i] * S[i * V + col];
                o[it * V + col] = s;
            }
        }
    return GDN_OK;
}

/* Token t's rows of a [B,T,H,D] tensor into [B,H,D]. */
static void slice(float *dst, const float *src, int64_t B, int64_t T, int64_t t, int64_t HD) {
    for (int64_t b = 0; b < B; b++) memcpy(dst + b * HD, src + (b * T + t) * HD, sizeof(float) * HD);
}

/* Run `step` T times from the problem's h0 with config `cfg` (heads Hk may differ from the
 * problem's when keys were expanded) and compare with the oracle results o_ref [B,T,Hv,V] and
 * ht_ref: the worst per-token relative error of o, and the final state's. Returns INFINITY when a
 * call fails. */
static double run_steps(step_fn step, const gdn_config *cfg, const float *q, const float *k,
                        const problem *p, const double *o_ref, const double *ht_ref) {
    const int64_t B = cfg->B, T = cfg->T, Hv = cfg->Hv, V = cfg->V, KK = cfg->K, Hk = cfg->Hk;
    gdn_config one = *cfg;
    one.T = 1;
    gdn_plan *plan = NULL;
    if (gdn_plan_create(&plan, &one)) return INFINITY;
    float *st = malloc(sizeof(float) * n_state(cfg)), *o = malloc(sizeof(float) * B * Hv * V);
    float *qt = malloc(sizeof(float) * B * Hk * KK), *kt = malloc(sizeof(float) * B * Hk * KK);
    float *vt = malloc(sizeof(float) * B * Hv * V), *gt = malloc(sizeof(float) * B * Hv);
    float *bt = malloc(sizeof(float) * B * Hv);
    double *oref_t = malloc(sizeof(double) * B * Hv * V);
    memcpy(st, p->h0, sizeof(float) * n_state(cfg));
    double worst = 0;
    for (int64_t t = 0; t < T && worst < INFINITY; t++) {
        slice(qt, q, B, T, t, Hk * KK), slice(kt, k, B, T, t, Hk * KK);
        slice(vt, p->v, B, T, t, Hv * V), slice(gt, p->g, B, T, t, Hv), slice(bt, p->beta, B, T, t, Hv);
        if (step(plan, o, st, &(gdn_rule_inputs){.q = qt, .k = kt, .v = vt, .g = gt, .beta = bt})) {
            worst = INFINITY;
            break;
        }
        for (int64_t b = 0; b < B; b++)
            memcpy(oref_t + b * Hv * V, o_ref + (b * T + t) * Hv * V, sizeof(double) * Hv * V);
        worst = fmax(worst, rel_err_f32(o, oref_t, B * Hv * V));
    }
    if (worst < INFINITY) worst = fmax(worst, rel_err_f32(st, ht_ref, n_state(cfg)));
    free(st), free(o), free(qt), free(kt), free(vt), free(gt), free(bt), free(oref_t);
    gdn_plan_destroy(plan);
    return worst;
}

/* Keys expanded to one head per value head (Hk = Hv) under a mapping; tiled = 1 is the wrong
 * j % Hk order. */
static float *expand_heads(const gdn_config *c, const float *x, int tiled) {
    float *out = malloc(sizeof(float) * c->B * c->T * c->Hv * c->K);
    const int64_t r = c->Hv / c->Hk;
    for (int64_t bt = 0; bt < c->B * c->T; bt++)
        for (int64_t j = 0; j < c->Hv; j++)
            memcpy(out + (bt * c->Hv + j) * c->K,
                   x + (bt * c->Hk + (tiled ? j % c->Hk : j / r)) * c->K, sizeof(float) * c->K);
    return out;
}

typedef struct {
    int64_t B, T, Hk, Hv, K, V;
    int l2norm, threads;
    float scale;
    gate_kind gk;
    beta_kind bk;
} step_case;

static const char *gate_name[] = {"zero", "mild", "strong"};

/* A problem for a case; without the L2 norm, q and k are scaled to norm ~0.6 so the recurrence
 * stays contractive (unnormalised unit-range keys of K = 100 would grow the state 30x a step). */
static void make_case(problem *p, gdn_config *cfg, const step_case *s, uint64_t seed) {
    *cfg = gdn_config_default(s->B, s->T, s->Hk, s->Hv, s->K, s->V);
    cfg->l2norm = s->l2norm, cfg->threads = s->threads, cfg->scale = s->scale;
    problem_make(p, *cfg, s->gk, s->bk, 1, seed);
    if (!s->l2norm)
        for (int64_t i = 0; i < n_qk(cfg); i++)
            p->q[i] /= sqrtf((float)s->K), p->k[i] /= sqrtf((float)s->K);
}

static void vs_oracle(void) {
    const step_case cases[] = {
        {1, 8, 2, 2, 16, 32, 1, 1, 0.0f, GATE_MILD, BETA_RANDOM},
        {3, 6, 2, 8, 17, 5, 1, 2, 0.0f, GATE_MILD, BETA_RANDOM},     /* grouped Hv = 4 Hk, odd */
        {1, 5, 1, 4, 100, 100, 0, 2, 0.3f, GATE_MILD, BETA_RANDOM},  /* no norm, custom scale */
        {3, 4, 4, 4, 128, 128, 1, 2, 0.0f, GATE_MILD, BETA_RANDOM},  /* the Qwen head size */
        {1, 7, 1, 2, 5, 17, 0, 1, 0.0f, GATE_ZERO, BETA_ONE},
        {1, 4, 2, 8, 256, 200, 1, 1, 1.7f, GATE_STRONG, BETA_RANDOM}, /* K != V, tails */
        {3, 5, 1, 4, 64, 48, 1, 1, 0.0f, GATE_MILD, BETA_RANDOM},
        {3, 5, 3, 3, 33, 80, 0, 2, 0.0f, GATE_MILD, BETA_ONE},
        /* V a multiple of the kernel's block width: the pipelined path (1, 2, 4 blocks per
         * stream; stream ranges split unevenly over threads) */
        {3, 4, 1, 4, 5, 64, 1, 2, 0.0f, GATE_MILD, BETA_RANDOM},
        {2, 4, 2, 2, 17, 128, 0, 1, 0.0f, GATE_STRONG, BETA_RANDOM},
        {1, 3, 1, 3, 256, 256, 1, 2, 0.0f, GATE_MILD, BETA_ONE},
        {1, 3, 1, 1, 128, 128, 1, 2, 0.0f, GATE_MILD, BETA_RANDOM},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const step_case *s = &cases[ci];
        gdn_config cfg;
        problem p;
        make_case(&p, &cfg, s, 500 + ci);
        double *o_ref = malloc(sizeof(double) * n_v(&cfg)), *ht_ref = malloc(sizeof(double) * n_state(&cfg));
        int rc = oracle_run(&p, &cfg, NULL, NULL, NULL, o_ref, ht_ref);
        double err = rc ? INFINITY : run_steps(gdn_step, &cfg, p.q, p.k, &p, o_ref, ht_ref);
        expect_close(err, TOL_STEP,
                     "step x%lld vs oracle B=%lld Hk=%lld Hv=%lld K=%lld V=%lld l2norm=%d scale=%g "
                     "gate=%s threads=%d",
                     (long long)s->T, (long long)s->B, (long long)s->Hk, (long long)s->Hv,
                     (long long)s->K, (long long)s->V, s->l2norm, (double)s->scale,
                     gate_name[s->gk], s->threads);
        free(o_ref), free(ht_ref);
        problem_free(&p);
    }
}

/* Wrong variants through the same comparison: each must exceed the tolerance. */
static void negative_controls(void) {
    const step_case s = {2, 6, 2, 8, 32, 40, 1, 2, 0.0f, GATE_MILD, BETA_RANDOM};
    gdn_config cfg;
    problem p;
    make_case(&p, &cfg, &s, 91);
    double *o_ref = malloc(sizeof(double) * n_v(&cfg)), *ht_ref = malloc(sizeof(double) * n_state(&cfg));
    oracle_run(&p, &cfg, NULL, NULL, NULL, o_ref, ht_ref);
    expect_close(run_steps(gdn_step, &cfg, p.q, p.k, &p, o_ref, ht_ref), TOL_STEP,
                 "grouped Hk=2 Hv=8: step vs oracle");
    /* The expansion itself is right: repeat_interleave-expanded keys with Hk = Hv pass ... */
    gdn_config flat = cfg;
    flat.Hk = cfg.Hv;
    float *qe = expand_heads(&cfg, p.q, 0), *ke = expand_heads(&cfg, p.k, 0);
    expect_close(run_steps(gdn_step, &flat, qe, ke, &p, o_ref, ht_ref), TOL_STEP,
                 "keys expanded j / r, Hk = Hv: step vs oracle");
    free(qe), free(ke);
    /* ... and the j % Hk order fails. */
    qe = expand_heads(&cfg, p.q, 1), ke = expand_heads(&cfg, p.k, 1);
    expect_far(run_steps(gdn_step, &flat, qe, ke, &p, o_ref, ht_ref), TOL_STEP,
               "value heads mapped j %% Hk");
    free(qe), free(ke);
    expect_far(run_steps(step_decay_after, &cfg, p.q, p.k, &p, o_ref, ht_ref), TOL_STEP,
               "decay applied after the delta");
    free(o_ref), free(ht_ref);
    problem_free(&p);
}

/* A 2-thread plan stepped from inside a caller's parallel region (the nested team has one
 * thread): every stream must still be updated, exactly as outside. */
static void nested(void) {
    const step_case s = {2, 1, 2, 4, 16, 64, 1, 2, 0.0f, GATE_MILD, BETA_RANDOM};
    gdn_config cfg;
    problem p;
    make_case(&p, &cfg, &s, 808);
    gdn_plan *plan = NULL;
    int rc = gdn_plan_create(&plan, &cfg), rc2 = 0;
    const int64_t ns = n_state(&cfg), nv = n_v(&cfg);
    float *s1 = malloc(sizeof(float) * ns), *s2 = malloc(sizeof(float) * ns);
    float *o1 = malloc(sizeof(float) * nv), *o2 = malloc(sizeof(float) * nv);
    memcpy(s1, p.h0, sizeof(float) * ns), memcpy(s2, p.h0, sizeof(float) * ns);
    if (!rc) rc = gdn_step(plan, o1, s1, RULE_INPUTS(&p, NULL));
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        rc2 = gdn_step(plan, o2, s2, RULE_INPUTS(&p, NULL));
    }
    /* Not bit for bit: the team size moves the boundaries of the threads' stream ranges, and at V
     * a multiple of the block width (here) the pipelined kernel sweeps a range's first block in a
     * loop of its own and updates its last block in another, so a stream at a boundary in one run
     * and inside a range in the other goes through different loops, which the compiler may
     * contract into FMAs differently (-ffp-contract=fast): bit equality is not guaranteed.
     * One step's outputs are sums of K = 16 products, each rounded at 2^-24: 1e-6 relative
     * (~16 ulp) holds any such difference; a stream left unstepped is off by O(1). */
    const double tol_nested = 1e-6;
    const double err = rc || rc2 ? INFINITY : fmax(rel_err_ff(o2, o1, nv), rel_err_ff(s2, s1, ns));
    expect_close(err, tol_nested, "step inside a parallel region (nested team) equals the step outside");
    /* Negative control: the streams of the second batch row not stepped (a plan for B = 1, as a
     * team that covered only part of the range would leave them), through the same comparison. */
    gdn_config half = cfg;
    half.B = 1;
    gdn_plan *plan1 = NULL;
    memcpy(s2, p.h0, sizeof(float) * ns), memset(o2, 0, sizeof(float) * nv);
    int rc3 = gdn_plan_create(&plan1, &half);
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        if (!rc3) rc3 = gdn_step(plan1, o2, s2, RULE_INPUTS(&p, NULL));
    }
    gdn_plan_destroy(plan1);
    expect_far(rc || rc3 ? INFINITY : fmax(rel_err_ff(o2, o1, nv), rel_err_ff(s2, s1, ns)), tol_nested,
               "step inside a parallel region with the second batch row's streams not stepped");
    gdn_plan_destroy(plan);
    free(s1), free(s2), free(o1), free(o2);
    problem_free(&p);
}

/* T = 1: the step equals the chunked forward (the old decode path) with h0 -> ht. */
static void vs_forward(void) {
    const step_case cases[] = {
        {3, 1, 2, 4, 128, 128, 1, 2, 0.0f, GATE_MILD, BETA_RANDOM},
        {2, 1, 1, 3, 17, 100, 0, 1, 0.5f, GATE_STRONG, BETA_ONE},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const step_case *s = &cases[ci];
        gdn_config cfg;
        problem p;
        make_case(&p, &cfg, s, 700 + ci);
        float *o1 = malloc(sizeof(float) * n_v(&cfg)), *ht1 = malloc(sizeof(float) * n_state(&cfg));
        float *o2 = malloc(sizeof(float) * n_v(&cfg)), *st = malloc(sizeof(float) * n_state(&cfg));
        int rc = chunked_run(&p, &cfg, o1, ht1);
        gdn_plan *plan = NULL;
        memcpy(st, p.h0, sizeof(float) * n_state(&cfg));
        if (!rc) rc = gdn_plan_create(&plan, &cfg);
        if (!rc) rc = gdn_step(plan, o2, st, RULE_INPUTS(&p, NULL));
        double err = rc ? INFINITY
                        : fmax(rel_err_ff(o2, o1, n_v(&cfg)), rel_err_ff(st, ht1, n_state(&cfg)));
        expect_close(err, TOL_STEP, "step vs gdn_forward T=1 B=%lld Hk=%lld Hv=%lld K=%lld V=%lld l2norm=%d",
                     (long long)s->B, (long long)s->Hk, (long long)s->Hv, (long long)s->K,
                     (long long)s->V, s->l2norm);
        gdn_plan_destroy(plan);
        free(o1), free(ht1), free(o2), free(st);
        problem_free(&p);
    }
}

/* V = 40: the general path; V = 64: the pipelined one (its own overflow check). */
static void errors(int64_t V) {
    const step_case s = {2, 1, 2, 4, 24, V, 1, 2, 0.0f, GATE_MILD, BETA_RANDOM};
    gdn_config cfg;
    problem p;
    make_case(&p, &cfg, &s, 33);
    gdn_plan *plan = NULL;
    gdn_plan_create(&plan, &cfg);
    const int64_t ns = n_state(&cfg);
    float *o = malloc(sizeof(float) * n_v(&cfg)), *st = malloc(sizeof(float) * ns);
    memcpy(st, p.h0, sizeof(float) * ns);
    struct { const char *name; float *x; int64_t n; } in[] = {
        {"'q'", p.q, n_qk(&cfg)}, {"'k'", p.k, n_qk(&cfg)}, {"'v'", p.v, n_v(&cfg)},
        {"'g'", p.g, n_g(&cfg)},  {"'beta'", p.beta, n_g(&cfg)}};
    const float bad[2] = {NAN, INFINITY};
    for (int t = 0; t < 5; t++)
        for (int bi = 0; bi < 2; bi++) {
            const int64_t at = in[t].n - 3;
            const float keep = in[t].x[at];
            in[t].x[at] = bad[bi];
            int rc = gdn_step(plan, o, st, RULE_INPUTS(&p, NULL));
            in[t].x[at] = keep;
            expect_status(rc, GDN_ERR_NONFINITE, in[t].name, "%s in %s", bi ? "Inf" : "NaN", in[t].name);
            check(!memcmp(st, p.h0, sizeof(float) * ns), "state unchanged after %s in %s",
                  bi ? "Inf" : "NaN", in[t].name);
        }
    /* A finite key row whose squared norm overflows fp32 would normalise to zero silently. */
    const float keep = p.k[5];
    p.k[5] = 3e19f;
    expect_status(gdn_step(plan, o, st, RULE_INPUTS(&p, NULL)), GDN_ERR_NONFINITE, "'k'",
                  "key row with |x| > 1e19 (squared norm overflows)");
    p.k[5] = keep;
    check(!memcmp(st, p.h0, sizeof(float) * ns), "state unchanged after the overflowing key row");
    /* An overflowing state (a gate of +100) is reported after the update, naming the state. */
    const float gk = p.g[1];
    p.g[1] = 100.0f;
    expect_status(gdn_step(plan, o, st, RULE_INPUTS(&p, NULL)), GDN_ERR_NONFINITE, "'state'",
                  "gate g = +100 overflows the state (V=%lld)", (long long)V);
    p.g[1] = gk;
    /* With checks off a NaN is not looked for (no error, it propagates). */
    gdn_config off = cfg;
    off.check_finite = 0;
    gdn_plan *plan_off = NULL;
    gdn_plan_create(&plan_off, &off);
    memcpy(st, p.h0, sizeof(float) * ns);
    p.v[0] = NAN;
    expect_status(gdn_step(plan_off, o, st, RULE_INPUTS(&p, NULL)), GDN_OK, NULL,
                  "NaN in v with check_finite = 0 is not checked");
    p.v[0] = 0.5f;
    gdn_plan_destroy(plan_off);
    /* NULL arguments, each named. */
    expect_status(gdn_step(NULL, o, st, RULE_INPUTS(&p, NULL)), GDN_ERR_ARG, "plan", "NULL plan");
    expect_status(gdn_step(plan, NULL, st, RULE_INPUTS(&p, NULL)), GDN_ERR_ARG, "'o'", "NULL o");
    expect_status(gdn_step(plan, o, NULL, RULE_INPUTS(&p, NULL)), GDN_ERR_ARG, "'state'", "NULL state");
    expect_status(gdn_step(plan, o, st, &(gdn_rule_inputs){.k = p.k, .v = p.v, .g = p.g, .beta = p.beta}),
                  GDN_ERR_ARG, "'q'", "NULL q");
    expect_status(gdn_step(plan, o, st, &(gdn_rule_inputs){.q = p.q, .v = p.v, .g = p.g, .beta = p.beta}),
                  GDN_ERR_ARG, "'k'", "NULL k");
    expect_status(gdn_step(plan, o, st, &(gdn_rule_inputs){.q = p.q, .k = p.k, .g = p.g, .beta = p.beta}),
                  GDN_ERR_ARG, "'v'", "NULL v");
    expect_status(gdn_step(plan, o, st, &(gdn_rule_inputs){.q = p.q, .k = p.k, .v = p.v, .beta = p.beta}),
                  GDN_ERR_ARG, "'g'", "NULL g");
    expect_status(gdn_step(plan, o, st, &(gdn_rule_inputs){.q = p.q, .k = p.k, .v = p.v, .g = p.g}),
                  GDN_ERR_ARG, "'beta'", "NULL beta");
    gdn_plan_destroy(plan);
    free(o), free(st);
    problem_free(&p);
}

void test_step(void) {
    vs_oracle();
    vs_forward();
    nested();
    negative_controls();
    errors(40);
    errors(64);
}
