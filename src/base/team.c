/* Teams of threads that cost nothing when there is one thread. */
#include "base.h"

#ifdef _OPENMP
#include <omp.h>
#endif

void gdn_team(int threads, gdn_team_fn fn, void *ctx) {
    if (threads <= 1) {
        fn(ctx, 0, 1);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP /* split by the team actually delivered (nested or dynamic teams may be smaller) */
        fn(ctx, omp_get_thread_num(), omp_get_num_threads());
#else
        fn(ctx, 0, 1);
#endif
    }
}

typedef struct {
    int64_t n;
    gdn_range_fn fn;
    void *ctx;
} range_job;

static void range_share(void *p, int t, int nt) {
    const range_job *j = p;
    const int64_t lo = j->n * t / nt, hi = j->n * (t + 1) / nt;
    if (lo < hi) j->fn(j->ctx, lo, hi);
}

void gdn_parallel_range(int threads, int64_t n, gdn_range_fn fn, void *ctx) {
    if (n <= 0) return;
    if (threads > n) threads = (int)n;
    range_job j = {n, fn, ctx};
    gdn_team(threads, range_share, &j);
}
