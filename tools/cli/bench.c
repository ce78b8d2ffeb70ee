/* Shared pieces of the benchmarks: CPU name, measured peak, medians, the streaming bound, random
 * normal weights. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void cli_cpu_name(char *buf, size_t n) {
    snprintf(buf, n, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            char *c = strchr(line, ':');
            if (c) {
                c += 2;
                c[strcspn(c, "\n")] = 0;
                snprintf(buf, n, "%s", c);
            }
            break;
        }
    fclose(f);
}

double cli_peak_gflops(int threads, int json) {
    const double one = gdn_measure_peak_gflops(1);
    double peak = threads > 1 ? gdn_measure_peak_gflops(threads) : one;
    /* A busy neighbour on a shared machine shows up as an all-thread peak far below threads x
     * single: measure again (a low peak would flatter every fraction). */
    for (int retry = 0; threads > 1 && retry < 5 && peak < 0.9 * threads * one; retry++) {
        const double again = gdn_measure_peak_gflops(threads);
        if (again > peak) peak = again;
    }
    if (threads > 1 && peak < 0.9 * threads * one)
        fprintf(stderr, "gdncp bench: warning: %d-thread peak %.1f GFLOP/s is below %d x %.1f; the machine "
                        "looks busy, fractions of peak are overstated\n", threads, peak, threads, one);
    if (json)
        printf("{\"direction\":\"peak\",\"threads\":%d,\"peak_gflops\":%.3f,\"peak_1thread_gflops\":%.3f}\n",
               threads, peak, one);
    else if (threads > 1)
        printf("measured native-width fp32 FMA peak: %.1f GFLOP/s with %d threads (%.1f with 1)\n", peak,
               threads, one);
    else
        printf("measured native-width fp32 FMA peak: %.1f GFLOP/s with 1 thread\n", peak);
    return peak;
}

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

double cli_median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

/* Seconds to stream `bytes` once, read-only or read-modify-write, over a buffer of that size
 * (best of several passes after a warm-up: the cache state a decode step sees). Explicit
 * vectors with independent sums, so the loop is bound by memory, not by an add chain. */
typedef float v16 __attribute__((vector_size(64)));
double cli_stream_seconds(size_t bytes, int rmw, int threads) {
    const size_t n = bytes / sizeof(v16);
    v16 *buf = aligned_alloc(64, sizeof(v16) * (n ? n : 1));
    if (!buf) return NAN;
    for (size_t i = 0; i < n; i++) buf[i] = (v16){0} + 1.0f;
    double best = INFINITY;
    float sink = 0;
    for (int rep = 0; rep < 8; rep++) {
        const double t0 = cli_now();
        float acc = 0;
#pragma omp parallel num_threads(threads) reduction(+ : acc)
        {
            v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
#pragma omp for schedule(static)
            for (size_t i = 0; i < n / 4 * 4; i += 4) {
                if (rmw) {
                    buf[i] = buf[i] * 0.999f + 0.001f, buf[i + 1] = buf[i + 1] * 0.999f + 0.001f;
                    buf[i + 2] = buf[i + 2] * 0.999f + 0.001f, buf[i + 3] = buf[i + 3] * 0.999f + 0.001f;
                } else {
                    s0 += buf[i], s1 += buf[i + 1], s2 += buf[i + 2], s3 += buf[i + 3];
                }
            }
            const v16 s = (s0 + s1) + (s2 + s3);
            for (int l = 0; l < 16; l++) acc += s[l];
        }
        const double dt = cli_now() - t0;
        sink += acc;
        if (rep && dt < best) best = dt;
    }
    if (sink == 12345.0f) fprintf(stderr, " ");
    free(buf);
    return best;
}

void cli_fill_normal(float *x, size_t n, float std, uint64_t seed) {
    /* each 16-bit uniform: mean 32767.5, variance (65536^2 - 1) / 12; the sum of four fits a float exactly */
    const float mean4 = 4 * 32767.5f, scale = (float)(std / sqrt(4.0 * (65536.0 * 65536.0 - 1.0) / 12.0));
    const uint64_t s0 = seed * 0xD1B54A32D192ED03ull + 0x9E3779B97F4A7C15ull;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        uint64_t z = s0 + (uint64_t)i * 0x9E3779B97F4A7C15ull; /* splitmix64 */
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull, z = (z ^ (z >> 27)) * 0x94D049BB133111EBull, z ^= z >> 31;
        const float s = (float)(z & 0xFFFF) + (float)((z >> 16) & 0xFFFF) + (float)((z >> 32) & 0xFFFF) +
                        (float)(z >> 48);
        x[i] = (s - mean4) * scale;
    }
}
