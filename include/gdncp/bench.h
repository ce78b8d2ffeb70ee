/* Probes for benchmarks: the machine's measured peak and the FLOPs the kernel issues. */
#ifndef GDNCP_BENCH_H
#define GDNCP_BENCH_H

#include <stdint.h>
#include "status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* This machine's fp32 FMA peak in GFLOP/s with `threads` threads, at the widest vector width the
 * CPU runs (16 lanes with AVX-512, 8 with AVX2): the denominator of benchmarks' fractions. */
GDN_API double gdn_measure_peak_gflops(int threads);
/* Count the FLOPs the kernel's GEMM micro-kernels issue between start and stop (2 per
 * multiply-add computed; the zero triangles it skips are not issued): DESIGN §3's canonical
 * count overstates the work once triangles are skipped. Not thread-safe against itself. */
GDN_API void gdn_flops_issued_start(void);
GDN_API uint64_t gdn_flops_issued_stop(void);

/* The BF16 GEMM's paths (issue 20) for `gdncp bench matmul`: 1 fallback, 2 AVX512-BF16, 3 AMX,
 * 4 AMX emulated (slow, for tests). What gdn_bench_bf16 says of one. */
typedef struct {
    int path;            /* the path described (1..4) */
    int available;       /* 1 when the CPU and OS run it (the fallback and AMX emulated always) */
    const char *name;    /* its name, for benchmarks and logs (static) */
    double peak_gflops;  /* its register-only instruction peak (VDPBF16PS / TDPBF16PS), GFLOP/s on
                            `threads` threads, measured by this call when threads >= 1 (0 when not
                            asked, and for paths without one or not available) */
} gdn_bf16_path_info;
/* Describe BF16 path `path` (1..4), or with path 0 the one this CPU and OS use (3, else 2, else 1),
 * into *info; threads >= 1 also measures its peak (a fraction of a second), threads <= 0 does not.
 * GDN_ERR_ARG (info zeroed) for a NULL info or a path outside 0..4.
 * gdn_bench_projection: y[m x n] = x[m x kk] W^T (W [n x kk], all fp32, row-major, packed
 * strides) with the BF16 GEMM on `bf16_path`, or the fp32 gdn_matmul when bf16_path < 0. */
GDN_API int gdn_bench_bf16(int path, int threads, gdn_bf16_path_info *info);
GDN_API void gdn_bench_projection(int bf16_path, int64_t m, int64_t n, int64_t kk, const float *x,
                                  const float *W, float *y, int threads);

/* Peak resident set of this process in MiB. */
GDN_API double gdn_peak_rss_mb(void);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_BENCH_H */
