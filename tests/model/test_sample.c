/* gdn_sample_next (include/gdncp/sample.h), the sampler of `gdncp sample` and of the Python
 * Model.generate: empirical frequencies against the exact distribution (softmax at the
 * temperature, restricted by top-k and top-p; ties at a cut kept), greedy, the stream, a large
 * vocabulary's top-k, and the refusals. Each frequency comparison has its negative control: the
 * distribution without the restriction (or at another temperature) through the same check. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DRAWS 200000
/* a frequency's standard deviation is at most sqrt(0.25 / DRAWS) = 1.1e-3: 8e-3 is 7 of them */
#define TOL_FREQ 8e-3

/* max over tokens of |frequency - p| for DRAWS draws; p the wanted distribution (renormalised). */
static double freq_err(const float *lg, int64_t n, gdn_sampling s, const double *p, uint64_t seed) {
    double f[64] = {0}, sp = 0, e = 0;
    float work[64];
    uint64_t rng = gdn_sample_seed(seed);
    for (int i = 0; i < DRAWS; i++) {
        int64_t t = -1;
        if (gdn_sample_next(&t, lg, n, &s, &rng, work) || t < 0 || t >= n) return INFINITY;
        f[t] += 1.0 / DRAWS;
    }
    for (int64_t i = 0; i < n; i++) sp += p[i];
    for (int64_t i = 0; i < n; i++) e = fmax(e, fabs(f[i] - p[i] / sp));
    return e;
}

/* softmax(lg / T) over the tokens with keep[i] (NULL: all) */
static void softmax(double *p, const float *lg, int64_t n, double T, const int *keep) {
    for (int64_t i = 0; i < n; i++) p[i] = !keep || keep[i] ? exp(lg[i] / T) : 0;
}

void test_sample(void) {
    const float lg[6] = {1.0f, 2.5f, -0.5f, 0.3f, 2.0f, -3.0f};
    double p[6], q[6];
    gdn_sampling s = {.temperature = 1.0, .top_k = 0, .top_p = 1.0};
    softmax(p, lg, 6, 1.0, NULL);
    expect_close(freq_err(lg, 6, s, p, 1), TOL_FREQ, "temperature 1: frequencies = softmax(logits)");
    softmax(q, lg, 6, 2.0, NULL);
    expect_far(freq_err(lg, 6, s, q, 1), TOL_FREQ, "the same draws against softmax(logits / 2)");
    s.temperature = 0.5;
    softmax(p, lg, 6, 0.5, NULL);
    expect_close(freq_err(lg, 6, s, p, 2), TOL_FREQ, "temperature 0.5: frequencies = softmax(logits / 0.5)");

    s.temperature = 1.0, s.top_k = 3; /* the three largest: 2.5, 2.0, 1.0 */
    const int top3[6] = {1, 1, 0, 0, 1, 0};
    softmax(p, lg, 6, 1.0, top3);
    expect_close(freq_err(lg, 6, s, p, 3), TOL_FREQ, "top_k 3: frequencies = softmax over the 3 largest");
    softmax(q, lg, 6, 1.0, NULL);
    expect_far(freq_err(lg, 6, s, q, 3), TOL_FREQ, "top_k 3's draws against the unrestricted softmax");

    /* top_p over probabilities 0.5, 0.3, 0.15, 0.05: 0.75 keeps the first two */
    const float lp[4] = {logf(0.15f), logf(0.5f), logf(0.05f), logf(0.3f)};
    const int nuc[4] = {0, 1, 0, 1};
    s.top_k = 0, s.top_p = 0.75;
    softmax(p, lp, 4, 1.0, nuc);
    expect_close(freq_err(lp, 4, s, p, 4), TOL_FREQ, "top_p 0.75 over (0.15, 0.5, 0.05, 0.3): tokens 1 and 3 as 0.625, 0.375");
    softmax(q, lp, 4, 1.0, NULL);
    expect_far(freq_err(lp, 4, s, q, 4), TOL_FREQ, "top_p 0.75's draws against the whole distribution");
    s.top_k = 2, s.top_p = 0.5; /* top-k first (tokens 1, 3), then the nucleus of those: 0.625 >= 0.5 */
    const int one[4] = {0, 1, 0, 0};
    softmax(p, lp, 4, 1.0, one);
    expect_close(freq_err(lp, 4, s, p, 5), TOL_FREQ, "top_k 2 then top_p 0.5: token 1 alone");

    /* ties at the top-k cut are kept: three equal largest logits, top_k 2 keeps all three */
    const float tie[4] = {1.0f, 0.0f, 1.0f, 1.0f};
    const int ties[4] = {1, 0, 1, 1};
    s.top_k = 2, s.top_p = 1;
    softmax(p, tie, 4, 1.0, ties);
    expect_close(freq_err(tie, 4, s, p, 6), TOL_FREQ, "top_k 2 with three tied largest logits: each of the three a third");
    const int first2[4] = {1, 0, 1, 0};
    softmax(q, tie, 4, 1.0, first2);
    expect_far(freq_err(tie, 4, s, q, 6), TOL_FREQ, "against the first two of the tie alone");

    /* greedy: the first largest, no draw from the stream */
    gdn_sampling g = gdn_sampling_default();
    uint64_t rng = gdn_sample_seed(9), before = rng;
    int64_t t = -1;
    const int grc = gdn_sample_next(&t, tie, 4, &g, &rng, NULL);
    check(!grc && t == 0 && rng == before,
          "greedy: the first of the tied largest logits (token %lld), the stream untouched", (long long)t);
    check(g.temperature == 0 && g.top_k == 0 && g.top_p == 1, "gdn_sampling_default: greedy (0, 0, 1)");

    /* the stream: one seed repeats, another differs; no seed gives the stuck all-zero state */
    int64_t a[64], b[64], c[64];
    uint64_t r1 = gdn_sample_seed(5), r2 = gdn_sample_seed(5), r3 = gdn_sample_seed(6);
    s = (gdn_sampling){1.0, 0, 1.0};
    for (int i = 0; i < 64; i++)
        gdn_sample_next(&a[i], lg, 6, &s, &r1, NULL), gdn_sample_next(&b[i], lg, 6, &s, &r2, NULL),
            gdn_sample_next(&c[i], lg, 6, &s, &r3, NULL);
    check(!memcmp(a, b, sizeof a) && memcmp(a, c, sizeof a), "seed 5 twice: the same 64 tokens; seed 6: others");
    uint64_t inv = 0x9e3779b97f4a7c15ull; /* the multiplier's inverse mod 2^64 (Newton) */
    for (int i = 0; i < 6; i++) inv *= 2 - 0x9e3779b97f4a7c15ull * inv;
    check(gdn_sample_seed(0 - inv) != 0 && (0 - inv) * 0x9e3779b97f4a7c15ull + 1 == 0,
          "the seed whose plain state would be 0 gets another");

    /* a large vocabulary: top_k 50 of 100,000 draws only among the 50 largest (quickselect) */
    const int64_t nv = 100000;
    float *big = malloc(sizeof(float) * (size_t)nv), *work = malloc(sizeof(float) * (size_t)nv);
    float *sorted = malloc(sizeof(float) * (size_t)nv);
    uint64_t gen = 77;
    for (int64_t i = 0; i < nv; i++) {
        gen ^= gen << 13, gen ^= gen >> 7, gen ^= gen << 17;
        big[i] = (float)((double)(gen >> 11) * 0x1.0p-53 * 4.0) + (i % 1000 == 0 ? 2.0f : 0.0f);
    }
    memcpy(sorted, big, sizeof(float) * (size_t)nv);
    for (int i = 0; i < 50; i++) { /* the 50th largest, the slow way */
        int64_t m = i;
        for (int64_t j = i + 1; j < nv; j++) m = sorted[j] > sorted[m] ? j : m;
        const float x = sorted[i];
        sorted[i] = sorted[m], sorted[m] = x;
    }
    s = (gdn_sampling){1.0, 50, 1.0};
    check(gdn_sample_work_floats(&s, nv) == nv, "top_k 50 of 100,000 needs a workspace of the vocab");
    int inside = 1, distinct = 0;
    char *seen = calloc((size_t)nv, 1);
    rng = gdn_sample_seed(3);
    for (int i = 0; i < 2000; i++) {
        gdn_sample_next(&t, big, nv, &s, &rng, work);
        inside &= big[t] >= sorted[49];
        distinct += !seen[t], seen[t] = 1;
    }
    check(inside && distinct > 20 && distinct <= 50,
          "vocab 100,000, top_k 50: 2000 draws all among the 50 largest (%d distinct)", distinct);
    free(big), free(work), free(sorted), free(seen);

    /* refusals */
    float nan_lg[3] = {0.0f, NAN, 1.0f};
    rng = gdn_sample_seed(1);
    expect_status(gdn_sample_next(&t, nan_lg, 3, &s, &rng, NULL), GDN_ERR_NONFINITE, "NaN", "a NaN logit");
    s = (gdn_sampling){1.0, 2, 1.0};
    expect_status(gdn_sample_next(&t, lg, 6, &s, &rng, NULL), GDN_ERR_ARG, "workspace", "top_k without a workspace");
    s = (gdn_sampling){-1.0, 0, 1.0};
    expect_status(gdn_sampling_check(&s, 6), GDN_ERR_ARG, "temperature", "a negative temperature");
    s = (gdn_sampling){NAN, 0, 1.0};
    expect_status(gdn_sampling_check(&s, 6), GDN_ERR_ARG, "temperature", "a NaN temperature");
    s = (gdn_sampling){1.0, -1, 1.0};
    expect_status(gdn_sampling_check(&s, 6), GDN_ERR_ARG, "top_k", "top_k -1");
    s = (gdn_sampling){1.0, 0, 0.0};
    expect_status(gdn_sampling_check(&s, 6), GDN_ERR_ARG, "top_p", "top_p 0");
    s = (gdn_sampling){1.0, 0, 1.5};
    expect_status(gdn_sampling_check(&s, 6), GDN_ERR_ARG, "top_p", "top_p 1.5");
    s = (gdn_sampling){1.0, 0, 1.0};
    expect_status(gdn_sampling_check(&s, 0), GDN_ERR_ARG, "vocab", "vocab 0");
    expect_status(gdn_sample_next(NULL, lg, 6, &s, &rng, NULL), GDN_ERR_ARG, "NULL", "a NULL token pointer");
}
