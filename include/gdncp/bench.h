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

/* The BF16 GEMM (issue 20) for `gdncp bench matmul`. Paths: 1 fallback, 2 AVX512-BF16,
 * 3 AMX, 4 AMX emulated (slow, for tests). gdn_bench_bf16_path: what the CPU and OS allow
 * (3, else 2, else 1). gdn_bench_bf16_peak_gflops: the path's register-only instruction
 * peak (VDPBF16PS / TDPBF16PS), 0 for paths without one. gdn_bench_projection: y[m x n] =
 * x[m x kk] W^T (W [n x kk], all fp32, row-major, packed strides) with the BF16 GEMM on
 * `bf16_path`, or the fp32 gdn_matmul when bf16_path < 0. */
GDN_API int gdn_bench_bf16_path(void);
GDN_API int gdn_bench_bf16_path_available(int path);
GDN_API const char *gdn_bench_bf16_path_name(int path);
GDN_API double gdn_bench_bf16_peak_gflops(int path, int threads);
GDN_API void gdn_bench_projection(int bf16_path, int64_t m, int64_t n, int64_t kk, const float *x,
                                  const float *W, float *y, int threads);

/* Peak resident set of this process in MiB. */
GDN_API double gdn_peak_rss_mb(void);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_BENCH_H */
