/* The one SIMD vocabulary of the library, in GCC/Clang vector extensions: fp32 vectors of the
 * target's native width, chosen at compile time (16 floats with AVX-512, 8 with AVX/AVX2, 4
 * otherwise: SSE2, NEON or generic code), so that one source builds for every target. The
 * micro-kernels (src/blas) tile with them and the element-wise helpers below (exp, sigmoid, the
 * sum of squares, the NaN scan) run on them, 16 lanes wide on AVX-512. Included by base.h. */
#ifndef GDNCP_BASE_SIMD_H
#define GDNCP_BASE_SIMD_H

#include <stdint.h>
#include <string.h>

/* GDN_VL_STR, GDN_2VL_STR: the width and twice it (a two-vector tile), for path names. */
#if defined(__AVX512F__)
#define GDN_VL 16
#define GDN_VL_STR "16"
#define GDN_2VL_STR "32"
#elif defined(__AVX__)
#define GDN_VL 8
#define GDN_VL_STR "8"
#define GDN_2VL_STR "16"
#else
#define GDN_VL 4
#define GDN_VL_STR "4"
#define GDN_2VL_STR "8"
#endif

typedef float gdn_vf __attribute__((vector_size(GDN_VL * 4)));
typedef float gdn_vf_u __attribute__((vector_size(GDN_VL * 4), aligned(4))); /* unaligned */
typedef int32_t gdn_vi __attribute__((vector_size(GDN_VL * 4)));
typedef uint32_t gdn_vu __attribute__((vector_size(GDN_VL * 4)));

static inline gdn_vf gdn_vloadu(const float *p) { return *(const gdn_vf_u *)p; }
static inline void gdn_vstoreu(float *p, gdn_vf x) { *(gdn_vf_u *)p = x; }

/* The lanes' sum as a balanced tree of pairs, ((x0 + x1) + (x2 + x3)) + ... */
static inline float gdn_vhsum(gdn_vf x) {
    float t[GDN_VL];
    memcpy(t, &x, sizeof t);
#pragma GCC unroll 4
    for (int w = GDN_VL; w > 1; w /= 2)
#pragma GCC unroll 8
        for (int i = 0; i < w / 2; i++) t[i] = t[2 * i] + t[2 * i + 1];
    return t[0];
}

/* sum of x[i]^2 with GDN_VL independent partial sums (a serial fp32 sum is latency-bound). */
static inline float gdn_sumsq(const float *x, int64_t n) {
    gdn_vf acc = {0};
    int64_t i = 0;
    for (; i + GDN_VL <= n; i += GDN_VL) {
        const gdn_vf v = gdn_vloadu(x + i);
        acc += v * v;
    }
    float s = gdn_vhsum(acc);
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* exp() that returns exactly 0 below 1e-30 (avoids denormal slow paths; far below fp32 rounding). */
static inline float gdn_expf_ftz(float x) {
    return x < -69.0f ? 0.0f : __builtin_expf(x);
}

/* 2^n * p(r) for lanes in [-69, 88], Cephes-style: |r| <= ln2/2, a degree-6 polynomial, about
 * 1 ulp. The callers below mask the lanes outside the range. */
static inline gdn_vf gdn_vexpf_poly(gdn_vf x) {
    const gdn_vf magic = (gdn_vf){0} + 12582912.0f; /* 1.5 * 2^23: round to nearest */
    const gdn_vf t = x * 1.44269504088896341f + magic;
    const gdn_vf n = t - magic;
    const gdn_vf r = x - n * 0.693359375f - n * -2.12194440e-4f;
    gdn_vf p = (gdn_vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const gdn_vi e = ((gdn_vi)t - (gdn_vi)magic + 127) << 23; /* 2^n */
    return p * (gdn_vf)e;
}

/* exp() of every lane: lanes below -69 give exactly 0 like gdn_expf_ftz, lanes above 88 +Inf. */
static inline gdn_vf gdn_vexpf_ftz(gdn_vf x) {
    const gdn_vi tiny = x < -69.0f, huge = x > 88.0f;
    x = (gdn_vf)(((gdn_vi)x & ~(tiny | huge))); /* those lanes computed from 0 */
    const gdn_vf y = gdn_vexpf_poly(x);
    const gdn_vf inf = (gdn_vf){0} + __builtin_inff();
    return (gdn_vf)(((gdn_vi)y & ~(tiny | huge)) | ((gdn_vi)inf & huge));
}

/* exp() of lanes known to be at most 88 (scores minus their running maximum): below -69 (and
 * -inf) exactly 0; one mask fewer than gdn_vexpf_ftz in the attention's innermost loop. */
static inline gdn_vf gdn_vexpf_ftz_le88(gdn_vf x) {
    const gdn_vi tiny = x < -69.0f;
    return (gdn_vf)((gdn_vi)gdn_vexpf_poly((gdn_vf)((gdn_vi)x & ~tiny)) & ~tiny);
}

/* sigmoid of every lane by the vector exp above (a scalar expf per element costs a tenth of a
 * layer's or a training step's time). */
static inline gdn_vf gdn_vsigmoidf(gdn_vf x) { return 1.0f / (1.0f + gdn_vexpf_ftz(-x)); }

/* 1 when some element of x[0..n) is NaN or Inf (x * 0 is NaN exactly then; for rows inside the
 * hot loops). */
static inline int gdn_row_nonfinite(const float *x, int64_t n) {
    gdn_vf acc = {0};
    float s = 0.0f;
    int64_t i = 0;
    for (; i + GDN_VL <= n; i += GDN_VL) acc += gdn_vloadu(x + i) * 0.0f;
    for (; i < n; i++) s += x[i] * 0.0f;
    for (int l = 0; l < GDN_VL; l++) s += acc[l];
    return s != s;
}

/* Exactly 8 lanes, whatever the target (AVX2 here, two SSE halves or NEON elsewhere): only for
 * code whose arithmetic is laid out for 8 lanes (the chunk backward's fp32 sums finished in
 * double four lanes at a time, the attention core's 8-wide shuffles). */
typedef float gdn_v8f __attribute__((vector_size(32)));
typedef float gdn_v8f_u __attribute__((vector_size(32), aligned(4))); /* unaligned access */

#endif
