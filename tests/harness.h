/* A small test harness: one line per case (what, error, tolerance, PASS/FAIL), BLIS style,
 * and the closing "N passed, N failed" line. Numerical checks come in pairs: expect_close for
 * the real comparison, expect_far for its negative control (a deliberately wrong variant run
 * through the same comparison must fail it). */
#ifndef GDNCP_TEST_HARNESS_H
#define GDNCP_TEST_HARNESS_H

#include "gdncp.h"
#include "base.h" /* the library's internal pieces the tests check (the parameter tables' offsets, ...) */

#include <stdint.h>

/* A decoder's layer l as gdn_model_decoder_layer sees it (zeroed when refused). */
static inline gdn_model_decoder_view decoder_layer(gdn_model_decoder *d, int64_t l) {
    gdn_model_decoder_view v;
    (void)gdn_model_decoder_layer(d, l, &v);
    return v;
}

/* A KV cache's view (gdn_attn_cache_view; zeroed for a NULL cache), and its storage as the test
 * expects it: the fp32 keys and values (NULL for a BF16 cache) or the bf16 ones (NULL for F32). */
static inline gdn_attn_cache_info cache_view(gdn_attn_cache *c) {
    gdn_attn_cache_info i;
    (void)gdn_attn_cache_view(c, &i);
    return i;
}
/* One half of a cache's storage (values: 0 keys, 1 values) when the cache holds that dtype. */
static inline void *cache_part(gdn_attn_cache *c, int dtype, int values) {
    const gdn_attn_cache_info i = cache_view(c);
    return i.dtype == dtype ? (values ? i.values : i.keys) : NULL;
}
static inline float *cache_keys(gdn_attn_cache *c) { return (float *)cache_part(c, GDN_F32, 0); }
static inline float *cache_values(gdn_attn_cache *c) { return (float *)cache_part(c, GDN_F32, 1); }
static inline uint16_t *cache_keys_bf16(gdn_attn_cache *c) { return (uint16_t *)cache_part(c, GDN_BF16, 0); }
static inline uint16_t *cache_values_bf16(gdn_attn_cache *c) { return (uint16_t *)cache_part(c, GDN_BF16, 1); }

extern int tests_passed, tests_failed;
extern int tests_quiet; /* set on MPI ranks other than 0: count, but do not print */

void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Test-only hooks of the library (src/base/base.h: gdn_test_fault, gdn_test_threads,
 * gdn_test_point), defined in tests/util.c and steered here. test_fault: when armed, the
 * at-th call (counting from 1) whose site starts with prefix (NULL: every site) fails; count
 * says how many calls were seen, site which one failed (NULL: none). test_threads_seen: the
 * largest team reported since it was reset to -1 (for test_threads_site only, when set).
 * test_point_action: called at the library's named points (NULL: nothing). */
typedef struct {
    int armed;
    long at, count;
    const char *prefix, *site;
} test_fault_ctl;
extern test_fault_ctl test_fault;
/* When set, called with the number and site of every call test_fault counts (the count is atomic:
 * the library allocates on OpenMP threads too). */
extern void (*test_fault_seen)(long n, const char *site);
extern int test_threads_seen;
extern const char *test_threads_site;
extern void (*test_point_action)(const char *site);
/* gdn_test_mutate's steering: the active sites, as GDNCP_MUTATE lists them (src/base/base.h:
 * "site" or "site=value", comma-separated, exact names), NULL for none. */
extern const char *test_mutation;
/* The CP layer's sites (docs/testing.md), numbered for the CP suites' negative controls:
 * test_mutation = cp_site[CP_FAULT_DROP_INCOMING], ...; cp_site[CP_FAULT_NONE] is NULL. */
enum {
    CP_FAULT_NONE, CP_FAULT_REVERSED_ORDER, CP_FAULT_DROP_INCOMING, CP_FAULT_DROP_GRADIENT, CP_FAULT_DROP_HALO,
    CP_FAULT_DROP_HALO_GRAD, CP_FAULT_ATTN_DROP_KV, CP_FAULT_ATTN_DROP_KV_GRAD
};
extern const char *const cp_site[8];
/* The BF16 GEMM's sites (src/blas/blas.h, GDN_BF16_MUT_*) the BF16 suites use. */
#define SITE_BF16_TRUNCATE "bf16 gemm: operands truncated instead of rounded"
#define SITE_BF16_PAIR_SHIFT "bf16 gemm: B k pairs taken one k late"
#define SITE_BF16_SKIP_KBLOCK "bf16 gemm: AMX last k block of a slice skipped"
#define SITE_BF16_AMX_ORDER "bf16 gemm: fallback sums in the AMX order"
/* OpenMP regions the library has opened so far (GCC's libgomp entry points, counted in
 * tests/util.c); -1 when this compiler's cannot be counted. */
extern long test_omp_regions;

/* PASS when err <= tol. */
void expect_close(double err, double tol, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Negative control: PASS when err > tol (the wrong variant is detected). */
void expect_far(double err, double tol, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* PASS when status == want and the error message contains `needle` (if not NULL). */
void expect_status(int status, int want, const char *needle, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* max|x - ref| / max(max|ref|, REL_ERR_FLOOR). The floor: a tensor whose every reference value
 * is below 1e-30 (e.g. a state decayed by exp(-600)) is not representable in fp32 past the
 * kernel's flush of exp() below 1e-30; such tensors are compared in absolute terms. */
#define REL_ERR_FLOOR 1e-30
double rel_err_f32(const float *x, const double *ref, int64_t n);
/* max|x - ref| / max|ref| in double (NaN counts as a failure). */
double rel_err_dd(const double *x, const double *ref, int64_t n);
/* Zeroed buffers of n elements (at least one); the test exits on exhaustion. */
float *falloc(int64_t n);
double *dalloc(int64_t n);
double rel_err_ff(const float *x, const float *ref, int64_t n);

/* Deterministic random numbers. */
void rng_seed(uint64_t s);
double rng_uniform(double lo, double hi);

/* A random gated-delta-rule problem with fp32 inputs. */
typedef enum { GATE_ZERO = 0, GATE_MILD = 1, GATE_STRONG = 2 } gate_kind;
typedef enum { BETA_ZERO = 0, BETA_ONE = 1, BETA_RANDOM = 2 } beta_kind;
typedef struct {
    gdn_config cfg;
    float *q, *k, *v, *g, *beta, *h0; /* h0 may be NULL */
} problem;

void problem_make(problem *p, gdn_config cfg, gate_kind gk, beta_kind bk, int with_h0,
                  uint64_t seed);
void problem_free(problem *p);
/* The q, k, v, g, beta of p (a problem, or any struct with those fields) as the rule's inputs
 * (kernel.h), starting from h0 (NULL: zeros): a pointer to a compound literal, alive to the end
 * of the enclosing block. */
#define RULE_INPUTS(p, h0_) \
    (&(gdn_rule_inputs){.q = (p)->q, .k = (p)->k, .v = (p)->v, .g = (p)->g, .beta = (p)->beta, .h0 = (h0_)})
int64_t n_qk(const gdn_config *c);
int64_t n_v(const gdn_config *c);
int64_t n_g(const gdn_config *c);
int64_t n_state(const gdn_config *c);

/* Run the double oracle on fp32 inputs (converted exactly). Arrays may override the problem's:
 * pass NULL to use the problem's own. o, ht are caller-allocated doubles. */
int oracle_run(const problem *p, const gdn_config *cfg, const float *q, const float *k,
               const float *h0, double *o, double *ht);
/* Run the fast path with a fresh plan. */
int chunked_run(const problem *p, const gdn_config *cfg, float *o, float *ht);

/* n uniform values in [-1, 1); a layer's flat parameters: projections ~ 1/sqrt(fan-in), conv
 * taps in +-0.6, A = exp(A_log) uniform in [a_lo, a_hi] (the gate strength), dt_bias and
 * norm.weight in [0.5, 1.5]. Both from the rng_seed stream. */
float *random_floats(size_t n);
float *layer_random_weights(const gdn_layer_config *c, double a_lo, double a_hi);
/* An attention layer's flat parameters: projections uniform in +-1.5/sqrt(fan-in), norms in
 * +-0.4 (the weight is 1 + w), from the rng_seed stream. */
float *attn_random_weights(const gdn_attn_config *c);

/* Packed documents (tests/pack_ref.c): the outputs and gradients of one run, states per
 * document; pack_run_plan runs one plan (forward, then backward; with saved: gdn_forward_save +
 * gdn_backward_saved); pack_run_separately is the reference: every document of full's
 * cu_seqlens alone through the dense single-rank path, from h0[d] with dht[d] (either NULL). */
typedef struct {
    float *o, *ht, *dq, *dk, *dv, *dg, *dbeta, *dh0;
} pack_results;
pack_results pack_results_alloc(const gdn_config *c, int64_t states);
void pack_results_free(pack_results *r);
int pack_run_plan(const gdn_config *cfg, const problem *p, const float *h0, const float *dout,
                  const float *dht, int saved, pack_results *r);
int pack_run_separately(const gdn_config *full, const problem *p, const float *h0, const float *dout,
                        const float *dht, pack_results *r);
/* The packed layer's reference: every document of full's cu_seqlens alone through a dense
 * single-rank layer (zero states): y, dx at the document's rows, dw summed over documents. */
int pack_layer_separately(const gdn_layer_config *full, const float *w, const float *x, const float *dy,
                          float *y, float *dx, float *dw);

/* The language model's forward + backward (include/gdncp/train.h): the first failing status. */
typedef struct gdn_model_plan gdn_model_plan;
typedef int32_t gdn_token; /* train.h's (C11 allows the repeat) */
int model_train_step(gdn_model_plan *p, const float *w, float *dw, const gdn_token *tok, double denom,
                     double *loss);

/* Test suites: tests/suites.h. */

#endif
