/* The fp32 GEMMs of the library (src/blas), internal: the small in-cache GEMM the chunk kernel
 * runs (gemm.c) and the blocked GEMM of the layer's projections (matmul.c), both on the one
 * micro-kernel of microkernel.h. Included by src/kernel/kernel_internal.h. */
#ifndef GDNCP_BLAS_H
#define GDNCP_BLAS_H

#include <stddef.h>
#include <stdint.h>

/* ---- small GEMM: C[m x n] (+)= A[m x kk] B[kk x n], row-major with row strides.
 * flags: GDN_GEMM_ACC adds into C (else overwrites);
 *        GDN_GEMM_A_TRANS: A is stored as its transpose (kk x m, row stride lda);
 *        GDN_GEMM_B_TRANS: B is stored as its transpose (n x kk, row stride ldb);
 *        GDN_GEMM_A_LOWER: A[i][p] == 0 for p > i, so those products are skipped;
 *        GDN_GEMM_A_UPPER: A[i][p] == 0 for p < i (e.g. the transpose of a lower triangle), same;
 *        GDN_GEMM_C_LOWER: only C[i][j] with j <= i is needed (others may hold anything);
 *        GDN_GEMM_B_BF16: gdn_matmul only (B in bfloat16, with GDN_GEMM_B_TRANS), see below. */
enum { GDN_GEMM_ACC = 1, GDN_GEMM_A_LOWER = 2, GDN_GEMM_C_LOWER = 4, GDN_GEMM_A_TRANS = 8,
       GDN_GEMM_B_TRANS = 16, GDN_GEMM_A_UPPER = 32, GDN_GEMM_B_BF16 = 64, GDN_GEMM_A_BF16 = 128,
       /* the BF16 GEMM's FMA path (GDN_BF16_FMA): gdn_matmul rounds both operands to bf16
        * (nearest even) as it packs them; gdn_gemm rounds B as it packs it (A is read in place:
        * the caller passes it rounded). The test controls: _TRUNC truncates instead
        * (GDN_BF16_MUT_TRUNCATE), _SHIFT moves each packed B panel's rows one depth step up
        * (GDN_BF16_MUT_PAIR_SHIFT: B's depth off by one). */
       GDN_GEMM_ROUND_BF16 = 256, GDN_GEMM_TRUNC_BF16 = 512, GDN_GEMM_SHIFT_BF16 = 1024 };
void gdn_gemm(int flags, int m, int n, int kk, const float *A, int lda, const float *B, int ldb,
              float *C, int ldc);
/* ---- large GEMM for the layer's projections (m = tokens, n and kk = thousands):
 * C[m x n] (+)= op(A) op(B) with the flags GDN_GEMM_ACC, GDN_GEMM_A_TRANS, GDN_GEMM_B_TRANS of
 * gdn_gemm; cache-blocked and packed, run by `threads` OpenMP threads (call it from outside a
 * parallel region). ws: gdn_matmul_ws_floats(threads) floats of packing space.
 * B is const float * unless GDN_GEMM_B_BF16 (gdn_matmul only): then B points to bfloat16
 * values stored as uint16_t (the upper 16 bits of an fp32: value = bits (uint32_t)h << 16),
 * same layout and ldb (in elements); converted to fp32 on the fly (A, C and all arithmetic stay
 * fp32). GDN_GEMM_A_BF16 likewise for A (the BF16 GEMM's FMA path). GDN_GEMM_ROUND_BF16: both
 * operands rounded to bf16 while packed (no streaming path, A always packed). */
size_t gdn_matmul_ws_floats(int threads);
void gdn_matmul(int flags, int64_t m, int64_t n, int64_t kk, const void *A, int64_t lda,
                const void *B, int64_t ldb, float *C, int64_t ldc, float *ws, int threads);
/* The name of the path gdn_matmul runs (for benchmarks). */
const char *gdn_matmul_path(void);
/* dst[c][r] = src[r][c] for an r x c block. */
GDN_WING void gdn_transpose(int rows, int cols, const float *src, int lds, float *dst, int ldd);
/* ---- BF16-compute GEMM (matmul_bf16.c): C[m x n] (+)= op(A) op(B) with both operands rounded to
 * bfloat16 (nearest even) while packed, products accumulated in fp32. flags: GDN_GEMM_ACC,
 * GDN_GEMM_A_TRANS, GDN_GEMM_B_TRANS, and GDN_GEMM_A_BF16 / GDN_GEMM_B_BF16 (that operand is
 * stored as bfloat16 bits, uint16_t, ld in elements; else fp32). Any combination: a
 * projection's forward (x W^T: B_TRANS), input gradient (dy W) and weight gradient (dy^T x:
 * A_TRANS). path: GDN_BF16_AUTO (the best the CPU and OS allow, up to GDNCP_ISA's cap: AMX, else
 * AVX512-BF16, else the FMA path) or one path (must be available: GDN_ASSERT). Returns the path
 * that ran. Threads: an OpenMP team of `threads` (call from outside a parallel region).
 * The FMA path (CPUs without BF16 instructions) rounds the operands to bf16 as the fp32 GEMMs
 * pack them and runs the fp32 micro-kernel: the products of bf16 values are exact in fp32, so it
 * computes what the BF16 instructions do, in another summation order, at the fp32 speed; the
 * fallback computes it in VDPBF16PS's order, bit for bit, at a fraction of that (a test oracle). */
enum { GDN_BF16_AUTO = 0, GDN_BF16_FALLBACK = 1, GDN_BF16_AVX512 = 2, GDN_BF16_AMX = 3,
       GDN_BF16_AMX_EMU = 4, GDN_BF16_FMA = 5 };
int gdn_matmul_bf16(int path, int flags, int64_t m, int64_t n, int64_t kk, const void *A, int64_t lda,
                    const void *B, int64_t ldb, float *C, int64_t ldc, void *ws, int threads);
/* ws: gdn_matmul_bf16_ws_bytes(path, m, n, kk) bytes of packing space (any alignment), or NULL:
 * then it is allocated per call (at most 4480 x 512 bf16 of A per pass, 9.2 MB for the fallback's
 * fp32 panels, + 1 MB of B). Rows beyond 4480 run in further passes (B packed once per pass).
 * The FMA path allocates gdn_matmul's packing space per call (its size depends on the threads);
 * gdn_matmul_compute, the library's caller, passes its own. */
size_t gdn_matmul_bf16_ws_bytes(int path, int64_t m, int64_t n, int64_t kk);
int gdn_bf16_path_available(int path); /* fallback and AMX_EMU always; AVX512 / AMX per CPUID + OS */
int gdn_bf16_path_auto(void);
const char *gdn_bf16_path_name(int path);
/* The path's register-only instruction peak (VDPBF16PS / TDPBF16PS; the FMA path's: the fp32
 * FMA peak), GFLOP/s; 0 for the fallback and the emulator. */
double gdn_measure_bf16_peak_gflops(int path, int threads);
uint16_t gdn_f32_to_bf16(float x); /* nearest even (NaN kept a NaN) */
/* The BF16 GEMM's test sites (base.h), asked once per GEMM call by gdn_bf16_mutations() and
 * handed down to its packers and micro-kernels as these bits (0: none): three negative controls
 * and one order the tests compare bit for bit (the fallback summing in TDPBF16PS's order: blocks
 * of 16 pairs, even and odd partial sums, = the AMX path, instead of VDPBF16PS's). */
enum { GDN_BF16_MUT_TRUNCATE = 1,    /* "bf16 gemm: operands truncated instead of rounded" */
       GDN_BF16_MUT_PAIR_SHIFT = 2,  /* "bf16 gemm: B k pairs taken one k late" (2p+1, 2p+2) */
       GDN_BF16_MUT_SKIP_KBLOCK = 4, /* "bf16 gemm: AMX last k block of a slice skipped" */
       GDN_BF16_MUT_AMX_ORDER = 8,   /* "bf16 gemm: fallback sums in the AMX order" */
       GDN_BF16_MUT_PACKING = 7 };   /* the controls: the packers take their generic path */
int gdn_bf16_mutations(void);
/* The FMA path's flags for the fp32 GEMMs: GDN_GEMM_ROUND_BF16, or GDN_GEMM_TRUNC_BF16 under the
 * control GDN_BF16_MUT_TRUNCATE, with GDN_GEMM_SHIFT_BF16 under GDN_BF16_MUT_PAIR_SHIFT. */
int gdn_bf16_fma_rounding(void);
/* ---- small BF16-compute GEMM (matmul_bf16.c) for the chunk kernel: gdn_gemm's contract (flags
 * GDN_GEMM_ACC, _A_LOWER, _A_UPPER, _C_LOWER, _A_TRANS, _B_TRANS; fp32 operands, int strides) with
 * both operands rounded to bf16 (nearest even) while packed and the products summed in fp32, on
 * one path of gdn_matmul_bf16 (its micro-kernels, so the same per-element arithmetic) run by the
 * calling thread alone (inside the kernel's parallel region). The whole depth is one slice. The
 * skipped triangles are skipped in whole granules (32 deep with AMX, a pair otherwise): those
 * entries of A must be zero, as for gdn_gemm. ws: gdn_gemm_bf16_ws_bytes(path, m, n, kk) bytes,
 * any alignment. Returns the path that ran. */
size_t gdn_gemm_bf16_ws_bytes(int path, int m, int n, int kk);
int gdn_gemm_bf16(int path, int flags, int m, int n, int kk, const float *A, int lda, const float *B, int ldb,
                  float *C, int ldc, void *ws);
/* ---- pre-packed BF16 operands (matmul_bf16.c), for a caller that multiplies one operand many
 * times (the attention core: a key tile against every query block, a block against every key
 * tile): op(A) [m x kk] (trans: A is stored as A^T, kk x m) or op(B) [kk x n] (trans: n x kk),
 * fp32, rounded to bf16 and laid out for one concrete path (not AUTO) into dst (64-byte aligned,
 * the _bytes of its shape); then gdn_bf16_packed_gemm computes C[m x n] (+)= op(A) op(B) over
 * the first kk of their depths (packed as a_kk, b_kk >= kk; the product runs kk rounded up to the
 * path's granule, 32 with AMX, a pair otherwise, so B must be zero there: a B packed with depth
 * kk is) on the calling thread, with the micro-kernels (so the per-element arithmetic) of
 * gdn_matmul_bf16 over one slice. A row panel of A is read whole, so A may have more rows than m. A thread brackets its products with gdn_bf16_thread_begin
 * (AMX: the tile configuration; FTZ/DAZ) and _end (the tiles released, the mode restored). */
size_t gdn_bf16_packed_a_bytes(int path, int64_t m, int64_t kk);
size_t gdn_bf16_packed_b_bytes(int path, int64_t n, int64_t kk);
void gdn_bf16_pack_a(int path, int trans, int64_t m, int64_t kk, const float *A, int64_t lda, void *dst);
void gdn_bf16_pack_b(int path, int trans, int64_t n, int64_t kk, const float *B, int64_t ldb, void *dst);
unsigned gdn_bf16_thread_begin(int path);
void gdn_bf16_thread_end(int path, unsigned mode);
void gdn_bf16_packed_gemm(int path, int acc, int64_t m, int64_t n, int64_t kk, const void *a, int64_t a_kk,
                          const void *b, int64_t b_kk, float *C, int64_t ldc);
/* Benchmarks: add FLOPs issued by a micro-kernel to the counter of bench.h (when counting). */
void gdn_flops_issued_add(uint64_t flops);
/* ---- the projections' GEMM in a compute precision (gdncp/compute.h): gdn_matmul for
 * GDN_COMPUTE_FP32, gdn_matmul_bf16 on the automatic path for GDN_COMPUTE_BF16 (same flags; A
 * fp32, or bf16 with GDN_GEMM_A_BF16; B fp32 or bf16 with GDN_GEMM_B_BF16), except that
 * products of at most 16 rows with an fp32 A (decode) take gdn_matmul's streaming path. ws:
 * gdn_matmul_compute_ws_floats(compute, threads) floats, enough for any shape. */
size_t gdn_matmul_compute_ws_floats(int compute, int threads);
void gdn_matmul_compute(int compute, int flags, int64_t m, int64_t n, int64_t kk, const void *A, int64_t lda,
                        const void *B, int64_t ldb, float *C, int64_t ldc, float *ws, int threads);
/* The name of the GEMM micro-kernel compiled in. */
const char *gdn_gemm_path(void);


#endif
