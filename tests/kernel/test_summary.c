/* Segment summaries (A, B) against the oracle: A S0 + B equals the oracle's final state from S0,
 * and composing two segments' maps equals the whole sequence's. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TOL_SUMMARY 1e-5

static void summary_case(int64_t B, int64_t T, int64_t Hk, int64_t Hv, int64_t K, int64_t V,
                         int chunk, gate_kind gk, uint64_t seed, int control) {
    gdn_config cfg = gdn_config_default(B, T, Hk, Hv, K, V);
    cfg.chunk = chunk;
    problem p;
    problem_make(&p, cfg, gk, BETA_RANDOM, 1, seed); /* h0 plays the random S0 */
    const int64_t nm = B * Hv, ns = n_state(&cfg);
    float *sa = malloc(sizeof(float) * nm * K * K), *sb = malloc(sizeof(float) * ns);
    float *s = malloc(sizeof(float) * ns);
    double *ht_ref = malloc(sizeof(double) * ns), *o_ref = malloc(sizeof(double) * n_v(&cfg));
    gdn_plan *plan = NULL;
    int rc = gdn_plan_create(&plan, &cfg);
    if (!rc) rc = gdn_summary(plan, sa, sb, RULE_INPUTS(&p, NULL));
    gdn_plan_destroy(plan);
    oracle_run(&p, &cfg, NULL, NULL, NULL, o_ref, ht_ref);
    gdn_summary_apply(s, sa, sb, p.h0, nm, K, V);
    expect_close(rc ? INFINITY : rel_err_f32(s, ht_ref, ns), TOL_SUMMARY,
                 "summary A S0 + B vs oracle B=%lld T=%lld Hk=%lld Hv=%lld K=%lld V=%lld C=%d",
                 (long long)B, (long long)T, (long long)Hk, (long long)Hv, (long long)K,
                 (long long)V, chunk);
    /* Negative control: the incoming state dropped (the same apply from S0 = 0, i.e. B alone).
     * Only meaningful where S0 still matters at the end (no or weak decay); the other cases are
     * controlled by the compose test. */
    if (control) {
        float *zero = calloc(ns, sizeof(float));
        gdn_summary_apply(s, sa, sb, zero, nm, K, V);
        expect_far(rc ? INFINITY : rel_err_f32(s, ht_ref, ns), TOL_SUMMARY, "summary applied with the incoming state dropped (S0 = 0)");
        free(zero);
    }
    free(sa), free(sb), free(s), free(ht_ref), free(o_ref);
    problem_free(&p);
}

/* Split one sequence (B = 1) at t1: compose(second, first) must reproduce the whole. */
static void compose_case(int64_t T, int64_t t1, int64_t K, int64_t V, uint64_t seed) {
    gdn_config cfg = gdn_config_default(1, T, 1, 2, K, V);
    problem p;
    problem_make(&p, cfg, GATE_MILD, BETA_RANDOM, 1, seed);
    const int64_t nm = cfg.Hv, ns = n_state(&cfg), kk = nm * K * K;
    float *a[2], *b[2];
    for (int part = 0; part < 2; part++) {
        gdn_config pc = cfg;
        pc.T = part ? T - t1 : t1;
        const int64_t off = part ? t1 : 0;
        a[part] = malloc(sizeof(float) * kk), b[part] = malloc(sizeof(float) * ns);
        gdn_plan *plan = NULL;
        gdn_plan_create(&plan, &pc);
        gdn_summary(plan, a[part], b[part],
                    &(gdn_rule_inputs){.q = p.q + off * cfg.Hk * K, .k = p.k + off * cfg.Hk * K,
                                       .v = p.v + off * cfg.Hv * V, .g = p.g + off * cfg.Hv,
                                       .beta = p.beta + off * cfg.Hv});
        gdn_plan_destroy(plan);
    }
    float *ca = malloc(sizeof(float) * kk), *cb = malloc(sizeof(float) * ns), *s = malloc(sizeof(float) * ns);
    double *ht_ref = malloc(sizeof(double) * ns), *o_ref = malloc(sizeof(double) * n_v(&cfg));
    oracle_run(&p, &cfg, NULL, NULL, NULL, o_ref, ht_ref);
    gdn_summary_compose(ca, cb, a[1], b[1], a[0], b[0], nm, K, V);
    gdn_summary_apply(s, ca, cb, p.h0, nm, K, V);
    expect_close(rel_err_f32(s, ht_ref, ns), TOL_SUMMARY,
                 "compose (second o first) T=%lld split at %lld K=%lld V=%lld", (long long)T,
                 (long long)t1, (long long)K, (long long)V);
    /* Negative control: the reversed composition order. */
    gdn_summary_compose(ca, cb, a[0], b[0], a[1], b[1], nm, K, V);
    gdn_summary_apply(s, ca, cb, p.h0, nm, K, V);
    expect_far(rel_err_f32(s, ht_ref, ns), TOL_SUMMARY, "compose in reversed order (first o second)");
    free(a[0]), free(a[1]), free(b[0]), free(b[1]), free(ca), free(cb), free(s), free(ht_ref), free(o_ref);
    problem_free(&p);
}

void test_summary(void) {
    summary_case(1, 1, 1, 1, 16, 24, 64, GATE_MILD, 1, 1);
    summary_case(2, 100, 2, 4, 32, 16, 64, GATE_ZERO, 2, 1);
    summary_case(1, 130, 1, 2, 128, 128, 32, GATE_MILD, 3, 0);
    summary_case(1, 200, 1, 1, 64, 64, 128, GATE_ZERO, 4, 1);
    summary_case(1, 65, 1, 1, 256, 64, 16, GATE_ZERO, 5, 1);
    summary_case(1, 3, 1, 1, 64, 40, 64, GATE_STRONG, 6, 0); /* strong gates: A nearly 0 */
    compose_case(100, 37, 32, 16, 7);
    compose_case(130, 64, 64, 64, 8);
    compose_case(70, 1, 16, 24, 9);
}
