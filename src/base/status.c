/* Status codes, per-thread error messages, the version, the test-only hooks' weak defaults,
 * the non-finite scans, the memory check and the OpenMP thread index. */
#include "base.h"

#include <unistd.h>

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static _Thread_local char last_message[512];

const char *gdn_version(void) { return GDN_VERSION_STRING; }

const char *gdn_strerror(int status) {
    switch (status) {
    case GDN_OK: return "ok";
    case GDN_ERR_ARG: return "invalid argument";
    case GDN_ERR_SHAPE: return "invalid or inconsistent shape";
    case GDN_ERR_NONFINITE: return "non-finite value";
    case GDN_ERR_NOMEM: return "out of memory";
    case GDN_ERR_IO: return "I/O error";
    case GDN_ERR_FORMAT: return "malformed file";
    case GDN_ERR_MISSING: return "missing tensor";
    case GDN_ERR_DTYPE: return "unsupported dtype";
    case GDN_ERR_MPI: return "MPI failure or ranks disagree";
    default: return "unknown status";
    }
}

const char *gdn_errmsg(void) { return last_message[0] ? last_message : "no error"; }

int gdn_fail(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_message, sizeof last_message, fmt, ap);
    va_end(ap);
    return status;
}

#if GDN_TEST_HOOKS
__attribute__((weak)) int gdn_test_fault(const char *site) {
    (void)site;
    return 0;
}
__attribute__((weak)) void gdn_test_point(const char *site) { (void)site; }
/* Whether the process started with GDNCP_MUTATE in its environment (empty counts): only then is
 * it read, at every call (a Python test sets and clears it between calls). Settled once at load,
 * never changed after: the kernel asks its sites per chunk and the BF16 GEMM per product, and a
 * getenv at each cost up to 40 % of a training step (measured: bench train, small-moe BF16). */
static int mutate_env;
__attribute__((constructor)) static void mutate_env_probe(void) { mutate_env = getenv("GDNCP_MUTATE") != NULL; }
__attribute__((weak)) int gdn_test_mutate(const char *site) {
    return mutate_env ? gdn_test_site_value(getenv("GDNCP_MUTATE"), site) : 0;
}
__attribute__((weak)) void gdn_test_threads(const char *site, int threads) { (void)site, (void)threads; }

#include "gdn_test_sites.h" /* GDN_TEST_SITES: every gdn_test_mutate site of the sources (generated) */

int gdn_test_sites_check(const char *list) {
    static const char *const sites[] = {GDN_TEST_SITES};
    const size_t n_sites = sizeof sites / sizeof sites[0];
    for (const char *p = list; p && *p;) {
        const char *end = strchr(p, ','), *eq;
        if (!end) end = p + strlen(p);
        eq = memchr(p, '=', (size_t)(end - p));
        const size_t len = (size_t)((eq ? eq : end) - p);
        size_t best = 0, best_len = 0;
        int known = len == 0; /* (an empty item: nothing named) */
        for (size_t i = 0; i < n_sites && !known; i++) {
            known = strlen(sites[i]) == len && !strncmp(sites[i], p, len);
            size_t c = 0;
            while (c < len && sites[i][c] == p[c]) c++;
            if (c > best_len) best = i, best_len = c;
        }
        if (!known)
            return gdn_fail(GDN_ERR_ARG, "GDNCP_MUTATE names \"%.*s\", which is no test site of this library (a "
                            "misspelt control would run the clean computation); the nearest is \"%s\" "
                            "(docs/testing.md lists them all)", (int)len, p, sites[best]);
        p = *end ? end + 1 : end;
    }
    return GDN_OK;
}

int gdn_test_site_value(const char *list, const char *site) {
    if (!list || !site) return 0;
    const size_t n = strlen(site);
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        if (!end) end = p + strlen(p);
        if ((size_t)(end - p) >= n && !strncmp(p, site, n) && (p + n == end || p[n] == '=')) {
            if (p + n == end) return 1;
            const long v = strtol(p + n + 1, NULL, 10);
            return v > INT_MAX ? INT_MAX : v < INT_MIN ? INT_MIN : (int)v;
        }
        p = *end ? end + 1 : end;
    }
    return 0;
}
#endif

/* The first non-finite element of the block at b0 (m elements), or INT64_MAX. x * 0 is NaN
 * exactly when x is NaN or Inf: sum those products with vectors, and look at single elements
 * only in a block that turned NaN. */
static int64_t scan_block(const float *x, int64_t b0, int64_t m) {
    gdn_vf acc = {0};
    int64_t i = 0;
    for (; i + GDN_VL <= m; i += GDN_VL) acc += gdn_vloadu(x + b0 + i) * 0.0f;
    float s = 0.0f;
    for (int l = 0; l < GDN_VL; l++) s += acc[l];
    for (; i < m; i++) s += x[b0 + i] * 0.0f;
    if (s != s)
        for (int64_t j = 0; j < m; j++)
            if (!isfinite(x[b0 + j])) return b0 + j;
    return INT64_MAX;
}

int64_t gdn_find_nonfinite_f32(const float *x, int64_t n, int threads) {
    enum { BLOCK = 4096 };
    int64_t first = INT64_MAX;
    /* Large tensors are scanned by the caller's threads (a serial scan costs ~7 % of a 2-thread
     * forward), never more: ranks sharing a node each have their share of the cores. A small
     * one, as every decode step checks, enters no parallel region (see gdn_team). */
    if (threads <= 1 || n <= (1 << 20)) {
        gdn_test_threads("find_nonfinite_f32", 1);
        for (int64_t b0 = 0; b0 < n && first == INT64_MAX; b0 += BLOCK)
            first = scan_block(x, b0, n - b0 < BLOCK ? n - b0 : BLOCK);
        return first == INT64_MAX ? -1 : first;
    }
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP /* (the fuzz targets build this file without OpenMP) */
    if (omp_get_thread_num() == 0) gdn_test_threads("find_nonfinite_f32", omp_get_num_threads());
#endif
#pragma omp for schedule(static) reduction(min : first)
    for (int64_t b0 = 0; b0 < n; b0 += BLOCK) {
        const int64_t at = scan_block(x, b0, n - b0 < BLOCK ? n - b0 : BLOCK);
        if (at < first) first = at;
    }
    }
    return first == INT64_MAX ? -1 : first;
}

int64_t gdn_find_nonfinite_f64(const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return i;
    return -1;
}

int gdn_check_fits(const char *what, double bytes) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return GDN_OK; /* unknown: let the allocation decide */
    const double phys = (double)pages * (double)page;
    if (bytes > phys)
        return gdn_fail(GDN_ERR_NOMEM, "%s needs %.1f GB; this machine has %.1f GB of memory in all "
                        "(split the sequence over more ranks, or use fewer tokens per call)",
                        what, bytes / 1e9, phys / 1e9);
    return GDN_OK;
}

int gdn_thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}
