/* Large buffers (weights, gradients, moments, a model plan's arena) in transparent huge pages. */
#include "base.h"

#include <stdint.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

enum { HUGE_PAGE = 2 << 20 };

void *gdn_alloc_large(size_t bytes) {
    /* Below a huge page the alignment would only waste memory: 64 bytes (a cache line, the
     * vector loads' alignment) as everywhere. */
    if (bytes < HUGE_PAGE) return aligned_alloc(64, (bytes + 63) & ~(size_t)63);
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

void *gdn_alloc_large_zeroed(size_t bytes) {
    void *p = gdn_alloc_large(bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

double gdn_peak_rss_mb(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss / 1024.0; /* KiB on Linux */
}
