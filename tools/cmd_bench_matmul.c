/* gdncp bench matmul: the projection GEMM y = x W^T (x [M x K], W [N x K]) at the shapes of
 * Qwen3.5-35B-A3B's GatedDeltaNet layer (E = 2048, Hk = 16, Hv = 32, K = V = 128: in_proj_qkv
 * N = 8192, in_proj_z N = 4096 from K = 2048, out_proj N = 2048 from K = 4096), M = 4096
 * tokens, 1 and 2 threads, in fp32 (gdn_matmul) and in BF16 compute (gdn_matmul_bf16 on the
 * path the CPU allows: operands rounded to bf16 while packed, fp32 accumulation).
 *
 * Peaks measured in the same run: the native-width fp32 FMA peak (cli_peak_gflops) and the BF16
 * instruction peak of the path (a register-only VDPBF16PS loop; TDPBF16PS where AMX exists).
 * Fractions: the fp32 GEMM of the fp32 peak; the BF16 GEMM of the fp32 peak and of its own
 * path's peak. Timing: fp32 and bf16 alternate, `reps` rounds, medians; both peaks are measured
 * again next to each GEMM in every round and each fraction is the median over rounds of that
 * round's ratio (on a shared machine the speed drifts by 2x between seconds; the peak columns
 * are the medians of those per-round peaks, the header lines the peaks at the start). The error of the BF16
 * result: max|y_bf16 - y_fp32| / max|y_fp32| (inputs uniform in [-0.5, 0.5]). */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* the inputs' generator, continued from shape to shape */
static uint64_t rng_state = 0x853C49E6748FEA9Bull;

typedef struct {
    const char *name;
    int64_t N, K;
} mm_shape;

typedef struct {
    int json, quick;
    int64_t M, reps;
} bench_matmul_opts;

static void bench_matmul_init(void *p) {
    bench_matmul_opts *o = p;
    o->M = 4096, o->reps = 3;
}

static const cli_opt bench_matmul_table[] = {
    {CLI_FLAG("--json", bench_matmul_opts, json, "one JSON object per row instead of text")},
    {CLI_FLAG("--quick", bench_matmul_opts, quick, "in_proj_qkv only, M = 512 (unless --M), 2 rounds")},
    {CLI_I64("--M", bench_matmul_opts, M, 1, 1 << 20, "N", "tokens (the GEMMs' M)")},
    {CLI_I64("--reps", bench_matmul_opts, reps, 1, 100, "R", "rounds")},
};

const cli_command cmd_bench_matmul_cli = {
    .name = "bench matmul",
    .usage = "usage: gdncp bench matmul [--json] [--quick] [--M N] [--reps R]\n",
    .summary = "the projection GEMMs in fp32 and BF16 compute against both peaks",
    .about = "  the layer's projection GEMMs (M tokens), fp32 and BF16 compute, against the measured peaks\n",
    .size = sizeof(bench_matmul_opts), .init = bench_matmul_init, CLI_OPTS(bench_matmul_table),
};

int cmd_bench_matmul(int argc, char **argv) {
    bench_matmul_opts o;
    unsigned char seen[CLI_MAX_OPTS];
    if (cli_parse(&cmd_bench_matmul_cli, argc - 1, argv + 1, &o, seen)) return CLI_USAGE_ERROR;
    const int json = o.json, quick = o.quick, m_set = cli_given(&cmd_bench_matmul_cli, seen, "--M");
    long M = (long)o.M, reps = (long)o.reps;
    const int path = cli_bf16(0, 0).path;
    const char *cpu = cli_cpu();
    if (!json) {
        printf("gdncp bench matmul — CPU: %s\n", cpu);
        printf("y = x W^T, x [M x K], W [N x K] fp32 in memory; bf16: %s\n", cli_bf16(path, 0).name);
    }
    const mm_shape all[] = {{"in_proj_qkv", 8192, 2048}, {"in_proj_z", 4096, 2048}, {"out_proj", 2048, 4096}};
    const int nshapes = quick ? 1 : 3;
    if (quick && reps > 2) reps = 2;
    if (quick && !m_set) M = 512;
    for (int th = 1; th <= 2; th++) { /* the fractions use the per-round peaks below */
        (void)cli_peak_gflops(th, json);
        (void)cli_bf16_peak(path, th, json, "");
    }
    if (path == 3) { /* AMX: the VDPBF16PS peak too, for comparison */
        for (int th = 1; th <= 2 && cli_bf16(2, 0).available; th++)
            CLI_ROW(json, CLI_S("direction", "%s", "  %s peak", "bf16_peak_vdpbf16ps"),
                    cli_at(CLI_I("threads", "%lld", " with %lld thread(s)", th), 2),
                    cli_at(CLI_F("peak_gflops", "%.3f", ": %.1f GFLOP/s", cli_bf16(2, th).peak_gflops), 1));
    }
    if (!json)
        printf("%-12s %-18s %-3s %8s %8s %8s %8s %8s %8s %8s %7s %7s %9s\n", "projection", "M x N x K", "thr", "fp32 ms",
               "fp32 GF", "%fp32pk", "bf16 ms", "bf16 GF", "%fp32pk", "%bf16pk", "pk fp32", "pk bf16", "err/fp32");
    for (int s = 0; s < nshapes; s++) {
        const int64_t N = all[s].N, K = all[s].K;
        float *x = malloc(sizeof(float) * (size_t)(M * K)), *W = malloc(sizeof(float) * (size_t)(N * K));
        float *y32 = malloc(sizeof(float) * (size_t)(M * N)), *ybf = malloc(sizeof(float) * (size_t)(M * N));
        if (!x || !W || !y32 || !ybf) {
            fprintf(stderr, "gdncp bench matmul: out of memory\n");
            free(x), free(W), free(y32), free(ybf);
            return 1;
        }
        for (int64_t i = 0; i < M * K; i++) x[i] = cli_uniform(&rng_state, -0.5f, 0.5f);
        for (int64_t i = 0; i < N * K; i++) W[i] = cli_uniform(&rng_state, -0.5f, 0.5f);
        const double flops = 2.0 * (double)M * (double)N * (double)K;
        for (int th = 1; th <= 2; th++) {
            /* per round: fp32 peak, fp32 GEMM, bf16 peak, bf16 GEMM; each fraction the median
             * over rounds of that round's ratio (a shared machine's speed drifts between rounds) */
            double t32[100], tbf[100], f32[100], fb32[100], fbb[100], p32r[100], pbfr[100];
            gdn_bench_projection(-1, M, N, K, x, W, y32, th); /* warm-up (pages, caches) */
            gdn_bench_projection(path, M, N, K, x, W, ybf, th);
            for (int r = 0; r < reps; r++) {
                p32r[r] = gdn_measure_peak_gflops(th);
                double t0 = cli_now();
                gdn_bench_projection(-1, M, N, K, x, W, y32, th);
                t32[r] = cli_now() - t0;
                pbfr[r] = cli_bf16(path, th).peak_gflops;
                t0 = cli_now();
                gdn_bench_projection(path, M, N, K, x, W, ybf, th);
                tbf[r] = cli_now() - t0;
                f32[r] = flops / t32[r] * 1e-9 / p32r[r];
                fb32[r] = flops / tbf[r] * 1e-9 / p32r[r];
                fbb[r] = pbfr[r] > 0 ? flops / tbf[r] * 1e-9 / pbfr[r] : NAN;
            }
            const double err = cli_rel_err_f32(ybf, y32, M * N);
            const double m32 = cli_median(t32, (int)reps), mbf = cli_median(tbf, (int)reps);
            const double g32 = flops / m32 * 1e-9, gbf = flops / mbf * 1e-9;
            const double fr32 = cli_median(f32, (int)reps), frb32 = cli_median(fb32, (int)reps);
            const double fbf = pbfr[0] > 0 ? cli_median(fbb, (int)reps) : NAN;
            const double pk32 = cli_median(p32r, (int)reps), pkbf = cli_median(pbfr, (int)reps);
            char shape[64];
            snprintf(shape, sizeof shape, "%ldx%lldx%lld", M, (long long)N, (long long)K);
            CLI_ROW(json, CLI_S("direction", "%s", NULL, "matmul"), CLI_S("projection", "%s", "%-12s", all[s].name),
                    CLI_I("M", "%lld", NULL, M), CLI_S(NULL, NULL, " %-18s", shape), CLI_I("N", "%lld", NULL, N),
                    CLI_I("K", "%lld", NULL, K), CLI_I("threads", "%lld", " %-3lld", th),
                    cli_x(CLI_F("fp32_s", "%.5f", " %8.1f", m32), 1e3), CLI_F("fp32_gflops", "%.3f", " %8.1f", g32),
                    cli_x(CLI_F("fp32_fraction_of_fp32_peak", "%.4f", " %7.1f%%", fr32), 100),
                    cli_x(CLI_F("bf16_s", "%.5f", " %8.1f", mbf), 1e3), CLI_F("bf16_gflops", "%.3f", " %8.1f", gbf),
                    cli_x(CLI_F("bf16_fraction_of_fp32_peak", "%.4f", " %7.1f%%", frb32), 100),
                    cli_x(CLI_F("bf16_fraction_of_bf16_peak", "%.4f", " %7.1f%%", fbf), 100),
                    CLI_F("fp32_peak_gflops", "%.3f", " %7.1f", pk32),
                    CLI_F("bf16_peak_gflops", "%.3f", " %7.1f", pkbf),
                    CLI_F("bf16_rel_err_vs_fp32", "%.3e", " %9.2e", err),
                    CLI_S("path", "%s", NULL, cli_bf16(path, 0).name), CLI_S("cpu", "%s", NULL, cpu));
            fflush(stdout);
        }
        free(x), free(W), free(y32), free(ybf);
    }
    return 0;
}
