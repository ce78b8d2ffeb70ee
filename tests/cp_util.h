/* Helpers of the CP test suites (MPI): the error of this rank's rows against the reference over
 * every rank, and a copy of rows [t0, t0 + tn) of a [B, T, inner] tensor. */
#ifndef GDNCP_TEST_CP_UTIL_H
#define GDNCP_TEST_CP_UTIL_H

#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* max|ours - ref| over max|ref| across every rank's rows (NaN counts as infinite). */
static inline double err_over_ranks(const float *ours, const float *ref, int64_t n) {
    double loc[2] = {0, 0}, glob[2];
    for (int64_t i = 0; i < n; i++) {
        const double e = fabs((double)ours[i] - ref[i]);
        if (!(e <= loc[0])) loc[0] = e;
        loc[1] = fmax(loc[1], fabs(ref[i]));
    }
    if (isnan(loc[0])) loc[0] = INFINITY;
    MPI_Allreduce(loc, glob, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return glob[0] / fmax(glob[1], 1e-30);
}

/* ||ours - ref||_2 over ||ref||_2, the sums taken over every rank's rows (NaN counts as infinite):
 * the BF16 mode's measure (tests/layer/test_compute_bf16.c says why). */
static inline double l2_err_over_ranks(const float *ours, const float *ref, int64_t n) {
    double loc[2] = {0, 0}, glob[2];
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)ours[i] - ref[i];
        loc[0] += d * d, loc[1] += (double)ref[i] * ref[i];
    }
    MPI_Allreduce(loc, glob, 2, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    const double e = sqrt(glob[0]) / fmax(sqrt(glob[1]), 1e-30);
    return e == e ? e : INFINITY;
}

static inline float *rows_of(const float *x, int64_t B, int64_t T, int64_t t0, int64_t tn, int64_t inner) {
    float *out = malloc(sizeof(float) * (size_t)(B * tn * inner + 1));
    for (int64_t b = 0; b < B; b++) memcpy(out + b * tn * inner, x + (b * T + t0) * inner, sizeof(float) * tn * inner);
    return out;
}

#endif
