/* Shared pieces of the benchmarks: CPU name, measured peaks, medians, the streaming bound, the
 * random inputs, the error against a reference, the FLOP counts and the row printer. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The CPU's model name and the instruction sets that run (gdncp/isa.h): every benchmark says on
 * which paths its rows ran, e.g. "AMD EPYC [isa avx2 (GDNCP_ISA; the CPU has avx512bf16), fp32
 * kernels avx2]". */
const char *cli_cpu(void) {
    static char name[384];
    if (name[0]) return name;
    char model[256] = "unknown CPU";
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "model name", 10)) {
            char *c = strchr(line, ':');
            if (c) {
                c += 2;
                c[strcspn(c, "\n")] = 0;
                snprintf(model, sizeof model, "%s", c);
            }
            break;
        }
    if (f) fclose(f);
    gdn_isa_info isa;
    gdn_isa(&isa); /* (refused caps stop the command line before any benchmark) */
    char capped[96] = "";
    if (isa.cap >= 0 && isa.cap < isa.cpu)
        snprintf(capped, sizeof capped, " (GDNCP_ISA; the CPU has %s)", gdn_isa_name(isa.cpu));
    snprintf(name, sizeof name, "%s [isa %s%s, fp32 kernels %s]", model, gdn_isa_name(isa.dispatched), capped,
             gdn_isa_name(isa.compiled));
    return name;
}

int cli_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
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
    CLI_ROW(json, CLI_S("direction", "%s", NULL, "peak"), CLI_T("measured native-width fp32 FMA peak"),
            cli_at(CLI_I("threads", "%lld", threads > 1 ? " with %lld threads" : " with %lld thread", threads), 3),
            cli_at(CLI_F("peak_gflops", "%.3f", ": %.1f GFLOP/s", peak), 2),
            cli_at(CLI_F("peak_1thread_gflops", "%.3f", threads > 1 ? " (%.1f with 1)" : NULL, one), 4));
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

/* splitmix64's finalizer over a counter: the i-th value of the stream that starts at s0 */
static uint64_t counter_hash(uint64_t s0, size_t i) {
    uint64_t z = s0 + (uint64_t)i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull, z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void cli_fill_normal(float *x, size_t n, float std, uint64_t seed) {
    /* each 16-bit uniform: mean 32767.5, variance (65536^2 - 1) / 12; the sum of four fits a float exactly */
    const float mean4 = 4 * 32767.5f, scale = (float)(std / sqrt(4.0 * (65536.0 * 65536.0 - 1.0) / 12.0));
    const uint64_t s0 = seed * 0xD1B54A32D192ED03ull + 0x9E3779B97F4A7C15ull;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        const uint64_t z = counter_hash(s0, i);
        const float s = (float)(z & 0xFFFF) + (float)((z >> 16) & 0xFFFF) + (float)((z >> 32) & 0xFFFF) +
                        (float)(z >> 48);
        x[i] = (s - mean4) * scale;
    }
}

void cli_fill_uniform_sym(float *x, size_t n, float a, uint64_t seed) {
    const uint64_t s0 = seed * 0x9E3779B97F4A7C15ull + 0xD1B54A32D192ED03ull;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] = a * (2.0f * (float)(counter_hash(s0, i) >> 40) / 16777216.0f - 1.0f);
}

uint64_t cli_rng_next(uint64_t *s) {
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return *s;
}

float cli_uniform(uint64_t *s, float lo, float hi) {
    return lo + (hi - lo) * ((float)(cli_rng_next(s) >> 40) / 16777216.0f);
}

float *cli_random_floats(size_t n, float lo, float hi, uint64_t *s) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; x && i < n; i++) x[i] = cli_uniform(s, lo, hi);
    return x;
}

/* x against a reference of doubles (rd) or floats (rf) */
static double rel_err(const float *x, const double *rd, const float *rf, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        const double r = rd ? rd[i] : (double)rf[i], d = fabs((double)x[i] - r);
        num = d > num || d != d ? d : num, den = fmax(den, fabs(r));
    }
    return den > 0 ? num / den : num;
}
double cli_rel_err(const float *x, const double *ref, int64_t n) { return rel_err(x, ref, NULL, n); }
double cli_rel_err_f32(const float *x, const float *ref, int64_t n) { return rel_err(x, NULL, ref, n); }

double cli_rule_flops(int64_t K, int64_t V, int chunk, double head_tokens, int dirs) {
    return ((dirs & 1 ? gdn_rule_flops_per_head_token(K, V, chunk, 0) : 0.0) +
            (dirs & 2 ? gdn_rule_flops_per_head_token(K, V, chunk, 1) : 0.0)) * head_tokens;
}

double cli_attn_core_flops(int64_t T, int64_t d, int64_t H, int backward) {
    const double f = 2.0 * (double)T * (double)T * (double)d * (double)H;
    return backward ? 3.5 * f : f;
}

cli_field cli_at(cli_field f, int at) {
    f.at = at;
    return f;
}

cli_field cli_x(cli_field f, double x) {
    f.scale = x;
    return f;
}

cli_field cli_if(int have, cli_field f) { return have ? f : CLI_NONE; }

cli_field cli_or_null(int have, cli_field f) {
    if (!have) f.kind = 'n', f.f = NAN, f.text = NULL;
    return f;
}

/* One field's value with format fmt (text: a double times its scale). */
static void put_value(const cli_field *f, const char *fmt, int text) {
    const double x = text && f->scale != 0 ? f->f * f->scale : f->f;
    switch (f->kind) {
    case 's':
    case 'r': printf(fmt, f->s); break;
    case 'i': printf(fmt, f->i); break;
    case 'f':
    case 'n': printf(fmt, x); break;
    default: printf(fmt, 0); break; /* words only */
    }
}

void cli_row(int json, const cli_field *f, int n) {
    if (n > 128) n = 128; /* (the rows have 30 at most) */
    if (json) {
        int first = 1;
        putchar('{');
        for (int i = 0; i < n; i++) {
            if (!f[i].key || !f[i].json) continue;
            printf("%s\"%s\":", first ? "" : ",", f[i].key);
            first = 0;
            /* JSON has no Inf or NaN: every non-finite double is null (a ratio over a peak of 0) */
            if ((f[i].kind == 'n' || f[i].kind == 'f') && !isfinite(f[i].f)) fputs("null", stdout);
            else if (f[i].kind == 's') putchar('"'), put_value(&f[i], f[i].json, 0), putchar('"');
            else put_value(&f[i], f[i].json, 0);
        }
        puts("}");
    } else {
        int at[128], g = 1 << 30;
        for (int i = 0; i < n; i++) {
            at[i] = f[i].at ? f[i].at : i ? at[i - 1] : 1;
            g = at[i] < g ? at[i] : g;
        }
        /* the groups in ascending order, each in list order */
        for (;;) {
            int up = 1 << 30;
            for (int i = 0; i < n; i++) {
                if (at[i] == g && f[i].text) put_value(&f[i], f[i].text, 1);
                if (at[i] > g && at[i] < up) up = at[i];
            }
            if (up == 1 << 30) break;
            g = up;
        }
        putchar('\n');
    }
    fflush(stdout);
}

gdn_plan_info cli_plan(const gdn_plan *p) {
    gdn_plan_info info = {0};
    if (p) (void)gdn_plan_describe(p, &info);
    return info;
}
gdn_layer_plan_info cli_layer_plan(const gdn_layer_plan *p) {
    gdn_layer_plan_info info = {0};
    if (p) (void)gdn_layer_plan_describe(p, &info);
    return info;
}
gdn_attn_plan_info cli_attn_plan(const gdn_attn_plan *p) {
    gdn_attn_plan_info info = {0};
    if (p) (void)gdn_attn_plan_describe(p, &info);
    return info;
}
gdn_moe_plan_info cli_moe_plan(const gdn_moe_plan *p) {
    gdn_moe_plan_info info = {0};
    if (p) (void)gdn_moe_plan_describe(p, &info);
    return info;
}

gdn_bf16_path_info cli_bf16(int path, int threads) {
    gdn_bf16_path_info info;
    (void)gdn_bench_bf16(path, threads, &info);
    return info;
}

double cli_bf16_peak(int path, int threads, int json, const char *note) {
    const gdn_bf16_path_info info = cli_bf16(path, threads < 1 ? 1 : threads);
    const double peak = info.peak_gflops;
    const char *name = info.name;
    if (json || note)
        CLI_ROW(json, CLI_S("direction", "%s", NULL, "bf16_peak"), CLI_T("measured BF16 instruction peak"),
                cli_at(CLI_I("threads", "%lld", threads > 1 ? " with %lld threads" : " with %lld thread", threads), 3),
                cli_at(CLI_F("peak_gflops", "%.3f", ": %.1f GFLOP/s", peak), 2),
                cli_at(CLI_S("path", "%s", " (%s)", name), 1), cli_at(CLI_T(note), 4));
    return peak;
}

double cli_peaks(int threads, int json, int bf16, const char *note, double *bf16_peak) {
    const double peak = cli_peak_gflops(threads, json);
    *bf16_peak = bf16 ? cli_bf16_peak(0, threads, json, note) : NAN;
    return peak;
}
