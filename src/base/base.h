/* The base layer (src/base): errors and messages, test-only hooks, invariants, the FP mode of
 * compute regions, memory checks, the one tensor checker and the one SIMD vocabulary (simd.h)
 * every layer above uses. Includes nothing of the library but the public headers. */
#ifndef GDNCP_BASE_H
#define GDNCP_BASE_H

#include "gdncp.h"
#include "simd.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/types.h>

/* Exported from libgdncp.so for the MPI wing (libgdncp_mpi.so) alone: the internal steps the CP
 * forms of the rule and the layers are built from, which the wing, a separate shared library, can
 * only call when they are exported. Not API: no public header declares them, they may change in
 * any release, and scripts/test_exports.sh checks that libgdncp.so exports exactly the GDN_API
 * functions of its public headers and these. */
#define GDN_WING __attribute__((visibility("default")))

/* Record a failure for gdn_errmsg() and return its code: `return gdn_fail(GDN_ERR_SHAPE, "...")`. */
GDN_WING int gdn_fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Test-only hooks (not API), compiled only into test builds (CMake GDN_TEST_HOOKS, default ON;
 * the Python wheel builds without them): without them each hook is the constant 0, no symbol
 * and no call. With them, the weak definitions in status.c do nothing but gdn_test_mutate's,
 * which reads GDNCP_MUTATE (below); a test program that links the static library overrides
 * them with strong ones. The library holds no mutable test state.
 * gdn_test_fault: called before each allocation of the library (the gdn_malloc family) and each
 * MPI datatype the CP layer creates, naming the site; non-zero makes that allocation / MPI call
 * fail as if the system had refused it (fault injection: "allocation number N fails on rank R").
 * gdn_test_point: called at named points of long operations (e.g. a safetensors write with its
 * temporary file in place), so a test can act there (raise a signal).
 * gdn_test_threads: called once by the first thread of some parallel regions with the size of
 * the team that runs it, so a test can see that a configured thread count is honoured.
 * gdn_test_mutate: the named test sites, asked once per call (never per element): non-zero
 * makes that step deliberately wrong (a chunk's solve, the dg sum, the state a CP rank
 * receives), so a test can show that its comparison catches exactly that mistake (a mutation
 * inside the computation, where changing our outputs afterwards would only exercise the
 * comparison); a few sites take the value itself (a forced BF16 path, a key-range size), 0
 * meaning the library's own choice. The weak definition answers from the environment,
 * GDNCP_MUTATE=site[=value][,site[=value]...] (exact names, value 1 when absent; a name holds
 * neither ',' nor '='), so the command line and the shell tests can break a run on purpose.
 * docs/testing.md lists every site. */
#ifndef GDN_TEST_HOOKS
#define GDN_TEST_HOOKS 1
#endif
#if GDN_TEST_HOOKS
GDN_WING int gdn_test_fault(const char *site);
GDN_WING int gdn_test_mutate(const char *site);
void gdn_test_point(const char *site);
void gdn_test_threads(const char *site, int threads);
/* The value of `site` in a GDNCP_MUTATE-style list (0: not in it); the weak gdn_test_mutate's
 * parser, which a test program's own gdn_test_mutate may share. */
int gdn_test_site_value(const char *list, const char *site);
/* GDN_OK when every name in a GDNCP_MUTATE-style list is a gdn_test_mutate site of the library's
 * sources (a table generated at build time), else GDN_ERR_ARG naming the first that is not and
 * the nearest site. The command line and the Python package check GDNCP_MUTATE with it. */
GDN_WING int gdn_test_sites_check(const char *list);
#else
#define gdn_test_fault(site) ((void)sizeof(site), 0)
#define gdn_test_mutate(site) ((void)sizeof(site), 0)
#define gdn_test_point(site) ((void)sizeof(site))
#define gdn_test_threads(site, threads) ((void)sizeof(site), (void)sizeof(threads))
#endif

/* A broken internal invariant (never a user error): abort with file:line. */
#define GDN_ASSERT(cond)                                                                    \
    do {                                                                                    \
        if (!(cond)) {                                                                      \
            fprintf(stderr, "gdncp: internal error %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            abort();                                                                        \
        }                                                                                   \
    } while (0)

/* Subnormal fp32 values cost ~100 cycles per operation on x86. They arise where exp(G) near the
 * flush threshold meets small states (strong gates, as in trained Qwen layers: a layer forward
 * ran 2.5x slower from them). Compute regions flush them to zero (FTZ, DAZ) and restore the
 * caller's mode on the way out; the values lost are below 1.2e-38. */
#if defined(__SSE__)
#include <xmmintrin.h>
typedef unsigned gdn_fpmode;
static inline gdn_fpmode gdn_fp_fast_begin(void) {
    const unsigned m = _mm_getcsr();
    _mm_setcsr(m | 0x8040); /* FTZ (bit 15) | DAZ (bit 6) */
    return m;
}
static inline void gdn_fp_fast_end(gdn_fpmode m) { _mm_setcsr(m); }
#else
typedef int gdn_fpmode;
static inline gdn_fpmode gdn_fp_fast_begin(void) { return 0; }
static inline void gdn_fp_fast_end(gdn_fpmode m) { (void)m; }
#endif

/* The instruction-set levels (isa.c, gdncp/isa.h): the level every run-time dispatch uses (the
 * CPU's, capped by GDNCP_ISA), and GDN_OK or GDN_ERR_ARG with GDNCP_ISA's refusal (every plan
 * creation asks it first). */
GDN_WING int gdn_isa_dispatched(void);
GDN_WING int gdn_isa_check(void);

/* Refuse, before allocating, what clearly cannot fit: more bytes than the machine's physical
 * memory (Linux overcommits, so such a malloc would succeed and the OOM killer end the run
 * later). GDN_ERR_NOMEM naming `what`, the need and the memory, or GDN_OK. */
int gdn_check_fits(const char *what, double bytes);

/* The parameter tables' pieces, for the library and the tests (the public call is
 * gdn_layer_param / gdn_attn_param / gdn_moe_param, which fills a gdn_param_info from these):
 * the name (NULL outside the table), the shape (returns ndim), the offset and the element count. */
const char *gdn_layer_param_name(int which);
int gdn_layer_param_shape(const gdn_layer_config *cfg, int which, int64_t shape[3]);
size_t gdn_layer_param_offset(const gdn_layer_config *cfg, int which);
size_t gdn_layer_param_numel(const gdn_layer_config *cfg, int which);
const char *gdn_attn_param_name(int which);
int gdn_attn_param_shape(const gdn_attn_config *cfg, int which, int64_t shape[2]);
size_t gdn_attn_param_offset(const gdn_attn_config *cfg, int which);
size_t gdn_attn_param_numel(const gdn_attn_config *cfg, int which);
const char *gdn_moe_param_name(int which);
int gdn_moe_param_shape(const gdn_moe_config *cfg, int which, int64_t shape[3]);
size_t gdn_moe_param_offset(const gdn_moe_config *cfg, int which);
size_t gdn_moe_param_numel(const gdn_moe_config *cfg, int which);

/* The model's layer counts (gdn_model_count_layers, model.h), for the library, the wing and the
 * tests: full-attention layers, and layers with the sparse MoE MLP. */
static inline int64_t gdn_model_attn_layers(const gdn_model_config *c) {
    return gdn_model_count_layers(c, GDN_MODEL_ATTN_LAYERS);
}
static inline int64_t gdn_model_moe_layers(const gdn_model_config *c) {
    return gdn_model_count_layers(c, GDN_MODEL_MOE_LAYERS);
}

/* The plans' shorthands over gdn_plan_describe / gdn_layer_plan_describe / gdn_attn_plan_describe
 * / gdn_moe_plan_describe, for the library, the wing and the tests: one field each; a NULL plan
 * gives NULL or 0 (no error recorded). gdn_plan_ckpt_floats (rule.c): the checkpoint count the
 * description gives. */
size_t gdn_plan_ckpt_floats(const gdn_plan *p);
static inline const gdn_config *gdn_plan_config(const gdn_plan *p) {
    gdn_plan_info i = {0};
    return p && !gdn_plan_describe(p, &i) ? i.config : NULL;
}
static inline const char *gdn_plan_path(const gdn_plan *p) {
    gdn_plan_info i = {0};
    return p && !gdn_plan_describe(p, &i) ? i.path : NULL;
}
static inline size_t gdn_plan_checkpoint_floats(const gdn_plan *p) {
    gdn_plan_info i = {0};
    return p && !gdn_plan_describe(p, &i) ? i.checkpoint_floats : 0;
}
static inline size_t gdn_plan_backward_bytes(const gdn_plan *p) {
    gdn_plan_info i = {0};
    return p && !gdn_plan_describe(p, &i) ? i.backward_bytes : 0;
}
static inline const gdn_layer_config *gdn_layer_plan_config(const gdn_layer_plan *p) {
    gdn_layer_plan_info i = {0};
    return p && !gdn_layer_plan_describe(p, &i) ? i.config : NULL;
}
static inline size_t gdn_layer_saved_floats(const gdn_layer_plan *p) {
    gdn_layer_plan_info i = {0};
    return p && !gdn_layer_plan_describe(p, &i) ? i.saved_floats : 0;
}
static inline const char *gdn_layer_plan_path(const gdn_layer_plan *p) {
    gdn_layer_plan_info i = {0};
    return p && !gdn_layer_plan_describe(p, &i) ? i.path : NULL;
}
static inline const gdn_attn_config *gdn_attn_plan_config(const gdn_attn_plan *p) {
    gdn_attn_plan_info i = {0};
    return p && !gdn_attn_plan_describe(p, &i) ? i.config : NULL;
}
static inline size_t gdn_attn_saved_floats(const gdn_attn_plan *p) {
    gdn_attn_plan_info i = {0};
    return p && !gdn_attn_plan_describe(p, &i) ? i.saved_floats : 0;
}
static inline const gdn_moe_config *gdn_moe_plan_config(const gdn_moe_plan *p) {
    gdn_moe_plan_info i = {0};
    return p && !gdn_moe_plan_describe(p, &i) ? i.config : NULL;
}
static inline size_t gdn_moe_saved_floats(const gdn_moe_plan *p) {
    gdn_moe_plan_info i = {0};
    return p && !gdn_moe_plan_describe(p, &i) ? i.saved_floats : 0;
}
static inline double gdn_moe_plan_bytes(const gdn_moe_plan *p) {
    gdn_moe_plan_info i = {0};
    return p && !gdn_moe_plan_describe(p, &i) ? i.bytes : 0.0;
}

/* A fused projection's name (NULL for another `fused`) and rows (gdn_layer_fused, io.h). */
const char *gdn_layer_fused_name(int fused);
int64_t gdn_layer_fused_rows(const gdn_layer_config *c, int fused);

/* The number of tensors of a safetensors file (0 for NULL): the first i at which gdn_st_at (io.h)
 * gives NULL, kept for the library and the tests. */
int gdn_st_count(const gdn_st_file *f);

/* Safetensors shorthands over gdn_st_read / gdn_st_read_ints / gdn_st_writer_add (io.h), for the
 * library and the tests: a whole tensor as f32 or f64; rows along dimension 1 (count >= 0) or any
 * axis (count < 0 refused); a 1-D integer tensor, or one of any rank; f32 or f64 data added. */
int gdn_st_read_f32(gdn_st_file *f, const char *name, float *dst, size_t n);
int gdn_st_read_f64(gdn_st_file *f, const char *name, double *dst, size_t n);
int gdn_st_read_f32_rows(gdn_st_file *f, const char *name, float *dst, size_t n, int64_t begin, int64_t count);
int gdn_st_read_f32_slice(gdn_st_file *f, const char *name, float *dst, size_t n, int axis, int64_t begin,
                          int64_t count);
int gdn_st_read_i64(gdn_st_file *f, const char *name, int64_t *dst, size_t n, int64_t *count);
int gdn_st_read_i64_all(gdn_st_file *f, const char *name, int64_t *dst, size_t n, int64_t *count);
int gdn_st_writer_add_f32(gdn_st_writer *w, const char *name, gdn_dtype dtype, int ndim, const int64_t *shape,
                          const float *data);
int gdn_st_writer_add_f64(gdn_st_writer *w, const char *name, gdn_dtype dtype, int ndim, const int64_t *shape,
                          const double *data);

/* What a non-regular file is, for messages ("a directory", "a FIFO", ...); from st_mode. */
GDN_WING const char *gdn_file_kind(mode_t mode);
/* dir/name into buf (capacity cap): GDN_OK, or GDN_ERR_ARG naming the path when it does not fit. */
int gdn_path_join(char *buf, size_t cap, const char *dir, const char *name);
/* Whether path is (or links to) a regular file. */
int gdn_is_regular_file(const char *path);

/* First non-finite element of x[0..n), or -1. A large x is scanned by `threads` OpenMP threads
 * (the caller's plan or run setting; <= 0 means 1): a rank never opens more than it was given. */
int64_t gdn_find_nonfinite_f32(const float *x, int64_t n, int threads);
int64_t gdn_find_nonfinite_f64(const double *x, int64_t n);

/* The GEMMs (src/blas): gdn_gemm, gdn_matmul, gdn_transpose and their flags. */

/* Carve n floats from a workspace arena; each piece starts on a 64-byte boundary. */
static inline float *gdn_carve(float **cur, size_t n) {
    float *p = *cur;
    *cur += (n + 15) & ~(size_t)15;
    return p;
}

/* ---- the one tensor checker (check.c): NULLs and non-finite values, one set of messages */
/* (gdn_row_nonfinite, the in-loop scan of a row: simd.h) */
GDN_WING int gdn_check_tensor(const char *name, const float *x, int64_t n, int check_finite, int threads);
/* An output (or a gradient) that came out non-finite: GDN_ERR_NONFINITE naming it and the
 * element, with the usual causes; GDN_OK when finite. */
GDN_WING int gdn_check_output(const char *name, const float *x, int64_t n, int threads);
typedef struct { const char *name; const float *x; int64_t n; } gdn_named_output;
/* The in-loop check found a non-finite row but the exact scans found nothing: a finite q or k
 * row so large that its squared norm overflows. Returns GDN_ERR_NONFINITE. */
int gdn_fail_keys_overflow(void);
/* The message of a non-finite element of a tensor in a role ("input", "weight"): GDN_ERR_NONFINITE. */
int gdn_fail_nonfinite(const char *role, const char *name, double value, int64_t at);

/* The calling OpenMP thread's index (0 outside parallel regions or without OpenMP): each
 * thread works in p->ws[gdn_thread_id()]. */
int gdn_thread_id(void);

/* Every allocation of the library (libgdncp and the MPI wing) goes through this family, so a
 * test can fail any one of them: each asks gdn_test_fault(site) first (a weak call returning 0
 * outside the tests; no lock, no state) and returns NULL when it says so, as when the system
 * refuses. `site` names the allocation ("model: p->arena"); scripts/check_allocs.py keeps raw
 * malloc, calloc, realloc, aligned_alloc and strdup out of src/ but this file's memory.c.
 * malloc / calloc / realloc / strdup semantics, except that a zero size allocates one byte (so
 * NULL always means failure). Everything is released with free(). gdn_realloc leaves p intact
 * when it fails. gdn_alloc_aligned: 64-byte aligned (a cache line, the vector loads'). */
GDN_WING void *gdn_malloc(const char *site, size_t bytes);
GDN_WING void *gdn_calloc(const char *site, size_t n, size_t size);
GDN_WING void *gdn_realloc(const char *site, void *p, size_t bytes);
GDN_WING void *gdn_alloc_aligned(const char *site, size_t bytes);
GDN_WING char *gdn_strdup(const char *site, const char *s);
/* A buffer of bytes for the large arrays (a model's weights, gradients, moments, a plan's
 * arena): 64-byte aligned, and from 2 MiB on aligned to and advised into transparent huge pages
 * (Linux). Released with free(). NULL when out of memory. The _zeroed form clears it. */
GDN_WING void *gdn_alloc_large(const char *site, size_t bytes);
GDN_WING void *gdn_alloc_large_zeroed(const char *site, size_t bytes);
/* Give the pages wholly inside [p, p + bytes) of an anonymous allocation back to the system (they
 * read as zeros when touched again): a sharded trainer's gathered weights once a unit is used. */
GDN_WING void gdn_release_pages(void *p, size_t bytes);

/* fn(ctx, t, nt) on every thread t of a team of nt <= threads; with threads <= 1, one call
 * fn(ctx, 0, 1) on this thread and no OpenMP region at all. A region costs libgomp ~0.3 us and a
 * futex syscall even for a team of one (its end-of-region barrier wakes unconditionally), and a
 * decode step of a small model runs ~40 of them: on the paths a token takes, one thread must
 * not pay for a team. Inside fn, orphaned `omp for` and `omp barrier` bind to the team (to the
 * lone thread when there is none). */
typedef void (*gdn_team_fn)(void *ctx, int t, int nt);
void gdn_team(int threads, gdn_team_fn fn, void *ctx);
/* fn(ctx, lo, hi) over contiguous shares [lo, hi) of [0, n), one per thread of a gdn_team of
 * min(threads, n): for loops whose items are independent rows. */
typedef void (*gdn_range_fn)(void *ctx, int64_t lo, int64_t hi);
void gdn_parallel_range(int threads, int64_t n, gdn_range_fn fn, void *ctx);
/* The threads worth a team for one memory-bound pass over `bytes` (a decode step's GEMV or
 * state update): one per GDN_TEAM_MIN_BYTES, at least 1, at most `threads`. A second thread
 * costs a region and its barrier (a few us); a pass over a few hundred KB of cached data takes
 * about as long. */
#ifndef GDN_TEAM_MIN_BYTES
#define GDN_TEAM_MIN_BYTES (256 << 10)
#endif
static inline int gdn_threads_for_bytes(int threads, double bytes) {
    const double want = bytes / (double)GDN_TEAM_MIN_BYTES;
    return want >= (double)threads ? threads : want < 1.0 ? 1 : (int)want;
}

#endif
