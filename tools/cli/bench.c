/* Shared pieces of the benchmarks: CPU name, measured peak, medians. */
#include "cli.h"

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
