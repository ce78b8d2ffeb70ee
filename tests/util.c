#define _GNU_SOURCE /* RTLD_NEXT */
#include "harness.h"
#include "gdncp.h"

#include <dlfcn.h>

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int tests_passed, tests_failed, tests_quiet;

/* The library's test-only hooks (weak there, src/base/status.c), overridden here. */
test_fault_ctl test_fault = {0, 0, 0, NULL, NULL};
void (*test_fault_seen)(long n, const char *site);
int test_threads_seen = -1;
const char *test_threads_site = NULL;
void (*test_point_action)(const char *site) = NULL;
const char *test_mutation = NULL;

/* (the library's parser of GDNCP_MUTATE, src/base/status.c) */
int gdn_test_site_value(const char *list, const char *site);
int gdn_test_mutate(const char *site) {
    /* a site named with ',' or '=' could never be selected from a list: its control would pass
     * vacuously, so it stops the test program the first time the library asks for it */
    if (strpbrk(site, ",=")) {
        fprintf(stderr, "test site \"%s\" holds ',' or '=' (GDNCP_MUTATE's separators): rename it\n", site);
        abort();
    }
    return gdn_test_site_value(test_mutation, site);
}
const char *const cp_site[8] = {
    NULL,
    "cp: scan composed in the reversed order",
    "cp: incoming state dropped",
    "cp: incoming state gradient dropped",
    "cp: conv halo dropped",
    "cp: conv halo gradient dropped",
    "attention cp: keys and values of earlier ranks dropped",
    "attention cp: key and value gradients of later ranks dropped",
};

int gdn_test_fault(const char *site) {
    if (!test_fault.armed) return 0;
    if (test_fault.prefix && strncmp(site, test_fault.prefix, strlen(test_fault.prefix))) return 0;
    const long n = __atomic_add_fetch(&test_fault.count, 1, __ATOMIC_RELAXED);
    if (test_fault_seen) test_fault_seen(n, site);
    if (n != test_fault.at) return 0;
    test_fault.site = site;
    return 1;
}

void gdn_test_threads(const char *site, int threads) {
    if (test_threads_site && strcmp(site, test_threads_site)) return;
    if (threads > test_threads_seen) test_threads_seen = threads;
}

/* The OpenMP regions the library opens, counted at libgomp's entry points: the executable's
 * definitions take the library's calls (it is linked in statically) and pass them on. Only the
 * entry points GCC emits for this code: `parallel` (with static loops) and dynamic loops. */
long test_omp_regions = -1; /* -1: not countable with this compiler */
#if defined(__GNUC__) && !defined(__clang__) && defined(_OPENMP)
typedef void (*omp_body)(void *);
void GOMP_parallel(omp_body fn, void *data, unsigned nt, unsigned flags);
void GOMP_parallel_loop_dynamic(omp_body fn, void *data, unsigned nt, long start, long end, long incr, long chunk,
                                unsigned flags);
void GOMP_parallel(omp_body fn, void *data, unsigned nt, unsigned flags) {
    static void (*real)(omp_body, void *, unsigned, unsigned);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "GOMP_parallel");
    __atomic_add_fetch(&test_omp_regions, 1, __ATOMIC_RELAXED);
    real(fn, data, nt, flags);
}
void GOMP_parallel_loop_dynamic(omp_body fn, void *data, unsigned nt, long start, long end, long incr, long chunk,
                                unsigned flags) {
    static void (*real)(omp_body, void *, unsigned, long, long, long, long, unsigned);
    if (!real) *(void **)&real = dlsym(RTLD_NEXT, "GOMP_parallel_loop_dynamic");
    __atomic_add_fetch(&test_omp_regions, 1, __ATOMIC_RELAXED);
    real(fn, data, nt, start, end, incr, chunk, flags);
}
__attribute__((constructor)) static void omp_regions_countable(void) { test_omp_regions = 0; }
#endif

void gdn_test_point(const char *site) {
    if (test_point_action) test_point_action(site);
}

static void report(int ok, const char *fmt, va_list ap) {
    if (!tests_quiet || !ok) { /* a failure on any rank is shown */
        printf("%s  ", ok ? "PASS" : "FAIL");
        vprintf(fmt, ap);
        printf("\n");
    }
    if (ok) tests_passed++;
    else tests_failed++;
}

void check(int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    report(ok, fmt, ap);
    va_end(ap);
}

void expect_close(double err, double tol, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[512];
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    check(err <= tol, "%s  err=%.2e tol=%.0e", buf, err, tol);
}

void expect_far(double err, double tol, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[512];
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    check(err > tol, "negative control: %s  err=%.2e must exceed tol=%.0e", buf, err, tol);
}

void expect_status(int status, int want, const char *needle, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char buf[512];
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    const char *msg = gdn_errmsg();
    int ok = status == want && (!needle || strstr(msg, needle));
    check(ok, "%s  -> %s (want %s) \"%s\"", buf, gdn_strerror(status), gdn_strerror(want),
          status ? msg : "");
}

double rel_err_f32(const float *x, const double *ref, int64_t n) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)x[i] - ref[i]);
        if (!(d <= num)) num = d; /* NaN propagates as a failure */
        den = fmax(den, fabs(ref[i]));
    }
    return num / fmax(den, REL_ERR_FLOOR);
}

double rel_err_ff(const float *x, const float *ref, int64_t n) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)x[i] - (double)ref[i]);
        if (!(d <= num)) num = d;
        den = fmax(den, fabs((double)ref[i]));
    }
    return num / fmax(den, REL_ERR_FLOOR);
}

static uint64_t rng = 88172645463325252ull;
void rng_seed(uint64_t s) { rng = s * 2654435761ull + 0x9E3779B97F4A7C15ull; }
double rng_uniform(double lo, double hi) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return lo + (hi - lo) * ((double)(rng >> 11) / 9007199254740992.0);
}

int64_t n_qk(const gdn_config *c) { return c->B * c->T * c->Hk * c->K; }
int64_t n_v(const gdn_config *c) { return c->B * c->T * c->Hv * c->V; }
int64_t n_g(const gdn_config *c) { return c->B * c->T * c->Hv; }
int64_t n_state(const gdn_config *c) { return c->B * c->Hv * c->K * c->V; }

float *falloc(int64_t n) {
    float *p = calloc((size_t)(n ? n : 1), sizeof(float));
    if (!p) {
        fprintf(stderr, "test: out of memory\n");
        exit(2);
    }
    return p;
}

double *dalloc(int64_t n) {
    double *p = calloc((size_t)(n ? n : 1), sizeof(double));
    if (!p) {
        fprintf(stderr, "test: out of memory\n");
        exit(2);
    }
    return p;
}

double rel_err_dd(const double *x, const double *ref, int64_t n) {
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs(x[i] - ref[i]);
        if (!(d <= num)) num = d; /* (a NaN difference becomes the error) */
        den = fmax(den, fabs(ref[i]));
    }
    return num / fmax(den, REL_ERR_FLOOR);
}

void problem_make(problem *p, gdn_config cfg, gate_kind gk, beta_kind bk, int with_h0,
                  uint64_t seed) {
    rng_seed(seed);
    p->cfg = cfg;
    p->q = falloc(n_qk(&cfg)), p->k = falloc(n_qk(&cfg)), p->v = falloc(n_v(&cfg));
    p->g = falloc(n_g(&cfg)), p->beta = falloc(n_g(&cfg));
    p->h0 = with_h0 ? falloc(n_state(&cfg)) : NULL;
    for (int64_t i = 0; i < n_qk(&cfg); i++)
        p->q[i] = (float)rng_uniform(-1, 1), p->k[i] = (float)rng_uniform(-1, 1);
    for (int64_t i = 0; i < n_v(&cfg); i++) p->v[i] = (float)rng_uniform(-1, 1);
    for (int64_t i = 0; i < n_g(&cfg); i++) {
        p->g[i] = gk == GATE_ZERO ? 0.0f
                  : gk == GATE_MILD ? (float)rng_uniform(-0.3, 0.0)
                                    : (float)rng_uniform(-20.0, 0.0);
        p->beta[i] = bk == BETA_ZERO ? 0.0f : bk == BETA_ONE ? 1.0f : (float)rng_uniform(0, 1);
    }
    if (with_h0)
        for (int64_t i = 0; i < n_state(&cfg); i++) p->h0[i] = (float)rng_uniform(-1, 1);
}

void problem_free(problem *p) {
    free(p->q), free(p->k), free(p->v), free(p->g), free(p->beta), free(p->h0);
    memset(p, 0, sizeof *p);
}

static double *to_d(const float *x, int64_t n) {
    if (!x) return NULL;
    double *d = malloc(sizeof(double) * (n ? n : 1));
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

int oracle_run(const problem *p, const gdn_config *cfg, const float *q, const float *k,
               const float *h0, double *o, double *ht) {
    const gdn_config *c = cfg;
    double *dq = to_d(q ? q : p->q, n_qk(c)), *dk = to_d(k ? k : p->k, n_qk(c)),
           *dv = to_d(p->v, n_v(c)), *dg = to_d(p->g, n_g(c)), *db = to_d(p->beta, n_g(c)),
           *dh = to_d(h0 ? h0 : p->h0, n_state(c));
    int rc = gdn_reference_forward(c, o, ht,
                                   &(gdn_rule_inputs_f64){.q = dq, .k = dk, .v = dv, .g = dg, .beta = db,
                                                          .h0 = dh});
    free(dq), free(dk), free(dv), free(dg), free(db), free(dh);
    return rc;
}

int chunked_run(const problem *p, const gdn_config *cfg, float *o, float *ht) {
    gdn_plan *plan = NULL;
    int rc = gdn_plan_create(&plan, cfg);
    if (!rc) rc = gdn_forward(plan, o, ht, RULE_INPUTS(p, p->h0));
    gdn_plan_destroy(plan);
    return rc;
}

float *random_floats(size_t n) {
    float *x = malloc(sizeof(float) * (n + 1));
    for (size_t i = 0; i < n; i++) x[i] = (float)rng_uniform(-1, 1);
    return x;
}

float *attn_random_weights(const gdn_attn_config *c) {
    float *w = falloc((int64_t)gdn_attn_param_floats(c));
    for (int p = 0; p < GDN_A_COUNT; p++) {
        int64_t shape[2];
        const int nd = gdn_attn_param_shape(c, p, shape);
        const double a = nd == 2 ? 1.5 / sqrt((double)shape[1]) : 0.4; /* norms: w near 0, (1 + w) near 1 */
        for (size_t i = 0; i < gdn_attn_param_numel(c, p); i++) w[gdn_attn_param_offset(c, p) + i] = (float)rng_uniform(-a, a);
    }
    return w;
}

float *layer_random_weights(const gdn_layer_config *c, double a_lo, double a_hi) {
    float *w = calloc(gdn_layer_param_floats(c), sizeof(float));
    for (int i = 0; i < GDN_P_COUNT; i++) {
        float *p = w + gdn_layer_param_offset(c, i);
        const int64_t n = (int64_t)gdn_layer_param_numel(c, i);
        const double a = i == GDN_P_OUT_PROJ ? 1.0 / sqrt((double)c->Hv * c->V) : 1.0 / sqrt((double)c->E);
        for (int64_t j = 0; j < n; j++)
            p[j] = (float)(i == GDN_P_CONV1D    ? rng_uniform(-0.6, 0.6)
                           : i == GDN_P_A_LOG   ? log(rng_uniform(a_lo, a_hi))
                           : i == GDN_P_DT_BIAS ? rng_uniform(0.5, 1.5)
                           : i == GDN_P_NORM    ? rng_uniform(0.5, 1.5)
                                                : rng_uniform(-a, a));
    }
    return w;
}

int model_train_step(gdn_model_plan *p, const float *w, float *dw, const gdn_token *tok, double denom,
                     double *loss) {
    int rc = gdn_model_forward(p, w, tok, denom, loss, 1);
    return rc ? rc : gdn_model_backward(p, w, dw, tok);
}
