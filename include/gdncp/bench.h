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

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_BENCH_H */
