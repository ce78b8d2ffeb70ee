/* gdncp bench attention-cp (under mpiexec -n D): the gated attention layer on one sequence split
 * evenly over the D ranks, forward + backward under each CP strategy (heads where the head counts
 * allow), repetitions between barriers. Per rank: the attention core's compute (replay_s), the
 * time in MPI, bytes received, the whole call; then the core's max/mean over ranks (the
 * imbalance), and for kv the last rank's core time over the slowest rank's whole call (the
 * pipeline's fraction of its ideal: the last rank cannot finish before its own compute). GFLOP/s
 * of the core counted as 2 T^2 d H causal forward, x 3.5 forward + backward, over the slowest
 * rank's core time; the error of y against one rank's run of the whole sequence (rank 0, when T
 * allows); the path and the CPU. Ranks beyond the cores share them: then wall times include the
 * sharing and only the ratios of CPU-bound work mean anything. */
#include "cli/cli.h"
#include "cli/parse.h"
#include "commands.h"
#include "gdncp/cp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { MAX_REPS = 16 };

typedef struct {
    double call, core, comm, recv;
} rank_times;

/* One forward + backward of this rank's shard; its times (the core's and MPI's from the stats). */
static int fwd_bwd(gdn_cp *cp, gdn_attn_plan *p, float *y, float *saved, float *dx, float *dw, const float *x,
                   const float *w, const float *dy, rank_times *t) {
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    int rc = gdn_attn_cp_forward(cp, p, y, saved, x, w);
    gdn_cp_stats f = gdn_cp_last_stats(cp);
    if (!rc) rc = gdn_attn_cp_backward(cp, p, dx, dw, x, w, saved, dy);
    gdn_cp_stats b = gdn_cp_last_stats(cp);
    t->call = MPI_Wtime() - t0;
    t->core = f.replay_s + b.replay_s, t->comm = f.comm_s + b.comm_s;
    t->recv = (double)(f.bytes_recv + b.bytes_recv);
    MPI_Barrier(MPI_COMM_WORLD);
    return rc;
}

/* The error of the gathered y against one rank's layer on the whole sequence (rank 0). */
static double error_vs_one_rank(gdn_cp *cp, const gdn_attn_config *full, const float *y_local, int64_t tn,
                                const float *x_full, const float *w) {
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const int64_t n = full->B * full->T * full->E;
    float *y_all = rank == 0 ? malloc(sizeof(float) * (size_t)n) : NULL, *y1 = rank == 0 ? malloc(sizeof(float) * (size_t)n) : NULL;
    int rc = gdn_cp_gather_rows(cp, y_local, full->B, tn, full->E, y_all, 0);
    double err = NAN;
    if (!rc && rank == 0 && y_all && y1) {
        gdn_attn_plan *p = NULL;
        if (!gdn_attn_plan_create(&p, full) && !gdn_attn_forward(p, y1, NULL, x_full, w)) {
            err = cli_rel_err_f32(y_all, y1, n);
        }
        gdn_attn_plan_destroy(p);
    }
    free(y_all), free(y1);
    MPI_Bcast(&err, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    return err;
}

typedef struct {
    int64_t T, H, Hkv, d, E, reps, threads, check_max;
    int json;
} bench_attn_cp_opts;

static void bench_attn_cp_init(void *p) {
    bench_attn_cp_opts *o = p;
    o->T = 2048, o->H = 8, o->Hkv = 2, o->d = 256, o->E = 1024, o->reps = 3, o->threads = 1, o->check_max = 8192;
}

static const cli_opt bench_attn_cp_table[] = {
    {CLI_FLAG("--json", bench_attn_cp_opts, json, "one JSON object per row instead of text")},
    {CLI_I64("--T", bench_attn_cp_opts, T, 1, (int64_t)1 << 30, "N", "tokens of the one sequence (at least the ranks)")},
    {CLI_I64("--H", bench_attn_cp_opts, H, 1, 1024, "N", "attention heads")},
    {CLI_I64("--Hkv", bench_attn_cp_opts, Hkv, 1, 1024, "N", "key/value heads")},
    {CLI_I64("--d", bench_attn_cp_opts, d, 1, 1024, "N", "head width")},
    {CLI_I64("--E", bench_attn_cp_opts, E, 1, 1 << 16, "N", "hidden size")},
    {CLI_I64("--reps", bench_attn_cp_opts, reps, 1, MAX_REPS, "R", "timed repetitions")},
    {CLI_I64("--threads", bench_attn_cp_opts, threads, 1, 1024, "N", "threads per rank")},
    {CLI_I64("--check-max-T", bench_attn_cp_opts, check_max, 0, (int64_t)1 << 30, "N", "compare with a single-rank run up to this T")},
};

const cli_command cmd_bench_attention_cp_cli = {
    .name = "bench attention-cp",
    .usage = "usage: mpiexec -n D gdncp bench attention-cp [--json] [--T N] [--H N] [--Hkv N] [--d N] [--E N]\n"
             "                                             [--reps R] [--threads N] [--check-max-T N]\n",
    .summary = "(under mpiexec) the gated attention layer with its sequence over the ranks (kv and heads)",
    .about = "  the gated attention layer with its sequence over D ranks (kv and heads strategies)\n",
    .size = sizeof(bench_attn_cp_opts), .init = bench_attn_cp_init, CLI_OPTS(bench_attn_cp_table),
};

int cmd_bench_attention_cp(int argc, char **argv) {
    bench_attn_cp_opts o;
    if (cli_parse(&cmd_bench_attention_cp_cli, argc - 1, argv + 1, &o, NULL)) return CLI_USAGE_ERROR;
    const int64_t T = o.T, H = o.H, Hkv = o.Hkv, d = o.d, E = o.E, reps = o.reps, threads = o.threads,
                  check_max = o.check_max;
    const int json = o.json;
    int rank, D;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    if (T < D) {
        if (!rank) fprintf(stderr, "gdncp bench attention-cp: --T %lld is fewer tokens than the %d ranks\n", (long long)T, D);
        return CLI_USAGE_ERROR;
    }
    const int64_t t0 = rank * (T / D) + (rank < T % D ? rank : T % D), tn = T / D + (rank < T % D);
    gdn_attn_config full = gdn_attn_config_default(1, T, E, H, Hkv, d);
    full.threads = (int)threads;
    gdn_attn_config loc = full;
    loc.T = tn, loc.seq_offset = t0;
    const size_t nw = gdn_attn_param_floats(&full);
    float *w = malloc(sizeof(float) * nw), *x = malloc(sizeof(float) * (size_t)(T * E));
    float *dy = malloc(sizeof(float) * (size_t)(tn * E)), *y = malloc(sizeof(float) * (size_t)(tn * E));
    float *dx = malloc(sizeof(float) * (size_t)(tn * E)), *dw = malloc(sizeof(float) * nw);
    if (!w || !x || !dy || !y || !dx || !dw) return cli_error("bench attention-cp", GDN_ERR_NOMEM);
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < nw; i++) w[i] = 0.1f * cli_uniform(&s, -0.5f, 0.5f);
    for (int64_t i = 0; i < T * E; i++) x[i] = cli_uniform(&s, -0.5f, 0.5f);
    for (int64_t i = 0; i < tn * E; i++) dy[i] = cli_uniform(&s, -0.5f, 0.5f);
    const char *cpu = cli_cpu();
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    double peak = rank == 0 ? cli_peak_gflops((int)threads, json) : 0.0; /* one rank measures while the rest wait */
    MPI_Bcast(&peak, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    const double core_flops = cli_attn_core_flops(T, d, H, 1);
    if (!rank && !json)
        printf("bench attention-cp: T=%lld over D=%d ranks (%lld..%lld tokens each), H=%lld Hkv=%lld d=%lld E=%lld, "
               "%lld thread(s) per rank, CPU %s%s\n"
               "  core FLOPs = 3.5 x 2 T^2 d H (causal forward + backward); peak %.1f GFLOP/s per rank's threads\n",
               (long long)T, D, (long long)(T / D), (long long)(T / D + (T % D != 0)), (long long)H, (long long)Hkv,
               (long long)d, (long long)E, (long long)threads, cpu,
               D * threads > cores ? " (oversubscribed: ranks share cores, wall times include it)" : "", peak);
    for (int strategy = GDN_ATTN_CP_KV; strategy <= GDN_ATTN_CP_HEADS; strategy++) {
        if (strategy == GDN_ATTN_CP_HEADS &&
            (H % D || ((H / D) % (H / Hkv) && (H / Hkv) % (H / D)))) {
            if (!rank && !json) printf("  heads: not run (D = %d and H = %lld, Hkv = %lld do not divide)\n", D,
                                       (long long)H, (long long)Hkv);
            continue;
        }
        loc.cp = strategy;
        gdn_attn_plan *p = NULL;
        gdn_cp *cp = NULL;
        int rc = gdn_attn_plan_create(&p, &loc);
        float *saved = p ? malloc(sizeof(float) * cli_attn_plan(p).saved_floats) : NULL;
        if (!rc && !saved) rc = GDN_ERR_NOMEM;
        if (!rc) rc = gdn_cp_create(&cp, MPI_COMM_WORLD);
        rank_times t[MAX_REPS];
        for (int r = 0; r < reps && !rc; r++) rc = fwd_bwd(cp, p, y, saved, dx, dw, x + t0 * E, w, dy, &t[r]);
        if (rc) return cli_error("bench attention-cp", rc);
        /* medians of this rank, then max / mean over ranks */
        double call[MAX_REPS], core[MAX_REPS], comm[MAX_REPS];
        for (int r = 0; r < reps; r++) call[r] = t[r].call, core[r] = t[r].core, comm[r] = t[r].comm;
        double mine[3] = {cli_median(call, (int)reps), cli_median(core, (int)reps), cli_median(comm, (int)reps)};
        double all[3 * 64] = {0};
        if (D <= 64) MPI_Gather(mine, 3, MPI_DOUBLE, all, 3, MPI_DOUBLE, 0, MPI_COMM_WORLD);
        const double err = T <= check_max ? error_vs_one_rank(cp, &full, y, tn, x, w) : NAN;
        if (!rank && D <= 64) {
            double core_max = 0, core_sum = 0, call_max = 0;
            for (int q = 0; q < D; q++) {
                core_max = fmax(core_max, all[3 * q + 1]), core_sum += all[3 * q + 1], call_max = fmax(call_max, all[3 * q]);
                if (!json)
                    printf("  %-5s rank %d: call %.3f s, core %.3f s, MPI %.3f s\n", gdn_attn_cp_strategy_name(strategy),
                           q, all[3 * q], all[3 * q + 1], all[3 * q + 2]);
            }
            const double mean = core_sum / D, gflops = core_flops / core_max / 1e9 / D;
            const double ideal = all[3 * (D - 1) + 1] / call_max;
            CLI_ROW(json, CLI_S("bench", "%s", NULL, "attention-cp"),
                    CLI_S("strategy", "%s", "  %-5s", gdn_attn_cp_strategy_name(strategy)),
                    CLI_I("D", "%lld", " D=%lld:", D), CLI_I("T", "%lld", NULL, T), CLI_I("H", "%lld", NULL, H),
                    CLI_I("Hkv", "%lld", NULL, Hkv), CLI_I("d", "%lld", NULL, d), CLI_I("E", "%lld", NULL, E),
                    CLI_I("threads", "%lld", NULL, threads),
                    CLI_F("call_max_s", "%.4f", " slowest call %.3f s;", call_max),
                    CLI_F("core_max_s", "%.4f", " core max/mean %.3f", core_max),
                    CLI_F("core_mean_s", "%.4f", "/%.3f s", mean), CLI_F(NULL, NULL, " = %.2fx;", core_max / mean),
                    CLI_F("core_gflops_per_rank", "%.2f", " core %.1f GFLOP/s per rank", gflops),
                    CLI_F("peak_gflops", "%.2f", NULL, peak),
                    CLI_F(NULL, NULL, " (%.0f%% of peak);", 100.0 * gflops / peak),
                    CLI_F("last_rank_core_over_call", "%.3f", " last rank's core / slowest call %.2f;", ideal),
                    CLI_F("err_vs_one_rank", "%.3e",
                          isfinite(err) ? " y vs one rank %.2e" : " y vs one rank (not run) 0.00e+00",
                          isfinite(err) ? err : -1.0),
                    CLI_S("cpu", "%s", NULL, cpu));
        }
        free(saved);
        gdn_cp_destroy(cp);
        gdn_attn_plan_destroy(p);
    }
    free(w), free(x), free(dy), free(y), free(dx), free(dw);
    return 0;
}
