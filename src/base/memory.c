/* The one allocation family (each call a named site a test can fail) and large buffers in
 * transparent huge pages. */
#define _DEFAULT_SOURCE /* madvise: MADV_HUGEPAGE, MADV_DONTNEED */
#include "base.h"

#include <stdint.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

enum { HUGE_PAGE = 2 << 20 };

void *gdn_malloc(const char *site, size_t bytes) {
    return gdn_test_fault(site) ? NULL : malloc(bytes ? bytes : 1);
}

void *gdn_calloc(const char *site, size_t n, size_t size) {
    if (!n || !size) n = 1, size = 1;
    return gdn_test_fault(site) ? NULL : calloc(n, size);
}

void *gdn_realloc(const char *site, void *p, size_t bytes) {
    /* realloc(p, 0) may free p and return NULL: one byte keeps "NULL means p is intact". */
    return gdn_test_fault(site) ? NULL : realloc(p, bytes ? bytes : 1);
}

char *gdn_strdup(const char *site, const char *s) {
    const size_t n = strlen(s) + 1;
    char *d = gdn_malloc(site, n);
    if (d) memcpy(d, s, n);
    return d;
}

void *gdn_alloc_aligned(const char *site, size_t bytes) {
    /* aligned_alloc wants a multiple of the alignment (C11); at least one line. */
    return gdn_test_fault(site) ? NULL : aligned_alloc(64, bytes ? (bytes + 63) & ~(size_t)63 : 64);
}

void *gdn_alloc_large(const char *site, size_t bytes) {
    /* Below a huge page the alignment would only waste memory: 64 bytes as everywhere. */
    if (bytes < HUGE_PAGE) return gdn_alloc_aligned(site, bytes);
    if (gdn_test_fault(site)) return NULL;
    const size_t rounded = (bytes + HUGE_PAGE - 1) & ~(size_t)(HUGE_PAGE - 1);
    void *p = aligned_alloc(HUGE_PAGE, rounded);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    /* Where transparent huge pages are on only by request (the "madvise" setting, Debian's
     * default): a GEMM streaming a 1 GB lm_head row by row, or reading 512 logits rows 1 MB
     * apart, touches a new 4 KiB page every few cache lines and stalls on the TLB. Advice only:
     * its failure changes nothing but the speed. */
    if (p) (void)madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return p;
}

void *gdn_alloc_large_zeroed(const char *site, size_t bytes) {
    void *p = gdn_alloc_large(site, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

void gdn_release_pages(void *p, size_t bytes) {
#if defined(__linux__)
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), a = ((uintptr_t)p + page - 1) & ~(page - 1),
                    b = ((uintptr_t)p + bytes) & ~(page - 1);
    /* only pages wholly inside: their neighbours may hold live data; advice that fails frees nothing */
    if (b > a) (void)madvise((void *)a, b - a, MADV_DONTNEED);
#else
    (void)p, (void)bytes;
#endif
}

double gdn_peak_rss_mb(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0; /* KiB on Linux */
}
