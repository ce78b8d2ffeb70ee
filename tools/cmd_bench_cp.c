/* gdncp bench cp (under mpiexec -n D): one long sequence split over the D ranks, every strategy,
 * forward and backward: per-rank time split, bytes, peak RSS, and the ratio of per-rank compute
 * to the single-rank time of its share (the same plan run alone on the shard). Then packed against
 * dense (issue 11): the same tokens as documents of seeded random lengths in [--doc-min,
 * --doc-max] (crossing the rank cuts), forward + backward under every strategy, dense and packed
 * interleaved repetition by repetition, their medians and the median of the paired ratios, with
 * GFLOP/s, the fraction of the measured peak, the error against the float64 oracle, the path and
 * the CPU. */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"
#include "gdncp/cp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Repetitions per case: their times and stats live in arrays of this size on the stack. */
enum { MAX_REPS = 16 };

/* Document lengths drawn uniformly in [lo, hi] (xorshift, `seed`) until T tokens; when what is
 * left after a draw would be shorter than lo, the document takes it all (so every document has at
 * least lo tokens, the last fewer than hi + lo; one document when T < lo). */
static int64_t *draw_documents(int64_t T, int64_t lo, int64_t hi, uint64_t seed, int64_t *n_docs) {
    int64_t *cu = malloc(sizeof(int64_t) * (size_t)(T / (lo > 0 ? lo : 1) + 2)), n = 0;
    if (!cu) return NULL;
    cu[0] = 0;
    while (cu[n] < T) {
        int64_t len = lo + (int64_t)(cli_rng_next(&seed) % (uint64_t)(hi - lo + 1));
        if (T - cu[n] - len < lo) len = T - cu[n];
        cu[n + 1] = cu[n] + len, n++;
    }
    *n_docs = n;
    return cu;
}

/* The float64 oracle on rows [0, n) of this rank's tensors (the start of the stream, from zero
 * states, a dense problem): o into od [n, Hv, V] and, with dout, dv into rv (the first document
 * ends at n, so dout beyond it does not reach back). Returns 0 on success. */
static int oracle_rows(const gdn_config *shape, int64_t n, const float *q, const float *k, const float *v,
                       const float *g, const float *beta, const float *dout, double *od, double *rv) {
    gdn_config c = *shape;
    c.T = n, c.cu_seqlens = NULL, c.n_docs = 0, c.seq_offset = 0;
    const int64_t nqk = n * c.Hk * c.K, nv = n * c.Hv * c.V, ng = n * c.Hv;
    double *buf = malloc(sizeof(double) * (size_t)(4 * nqk + 2 * nv + 4 * ng));
    if (!buf) return 1;
    double *dq = buf, *dk = dq + nqk, *dvv = dk + nqk, *dg = dvv + nv, *db = dg + ng, *dd = db + ng;
    double *rq = dd + nv, *rk = rq + nqk, *rg = rk + nqk, *rb = rg + ng;
    for (int64_t i = 0; i < nqk; i++) dq[i] = q[i], dk[i] = k[i];
    for (int64_t i = 0; i < nv; i++) dvv[i] = v[i], dd[i] = dout ? dout[i] : 0;
    for (int64_t i = 0; i < ng; i++) dg[i] = g[i], db[i] = beta[i];
    int rc = gdn_reference_forward(&c, od, NULL,
                                   &(gdn_rule_inputs_f64){.q = dq, .k = dk, .v = dvv, .g = dg, .beta = db});
    if (!rc && rv) rc = gdn_reference_backward(&c,
                                               &(gdn_rule_grads_f64){.dq = rq, .dk = rk, .dv = rv, .dg = rg,
                                                                     .dbeta = rb},
                                               &(gdn_rule_inputs_f64){.q = dq, .k = dk, .v = dvv, .g = dg,
                                                                      .beta = db}, dd, NULL);
    free(buf);
    return rc;
}

/* A number for JSON: null where it is not finite (an oracle that could not run). */

/* This rank's shard and the buffers of one dense or packed run. */
typedef struct {
    int64_t Tr;
    float *q, *k, *v, *g, *beta, *o, *dout, *gq, *gk, *gv, *gg, *gb, *s_in;
} shard_bufs;

/* A plan like p whose CP calls take strategy s (NULL in *out when it cannot be made). */
static int with_strategy(gdn_plan **out, const gdn_plan *p, int s) {
    gdn_config c = *cli_plan(p).config;
    c.cp = s;
    return gdn_plan_create(out, &c);
}

/* One forward + backward through cp (the backward reuses the forward's s_in but under heads,
 * which forms none); times of both halves between barriers. */
static int fwd_bwd(gdn_cp *cp, gdn_plan *plan, const shard_bufs *b, float *ht, float *gs, double *tf, double *tb) {
    const int heads = cli_plan(plan).config->cp == GDN_CP_HEADS;
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    int rc = gdn_cp_forward(cp, plan, b->o, ht, b->s_in,
                            &(gdn_rule_inputs){.q = b->q, .k = b->k, .v = b->v, .g = b->g, .beta = b->beta});
    MPI_Barrier(MPI_COMM_WORLD);
    double t1 = MPI_Wtime();
    if (!rc)
        rc = gdn_cp_backward(cp, plan,
                             &(gdn_rule_grads){.dq = b->gq, .dk = b->gk, .dv = b->gv, .dg = b->gg,
                                               .dbeta = b->gb, .dh0 = gs},
                             &(gdn_rule_inputs){.q = b->q, .k = b->k, .v = b->v, .g = b->g, .beta = b->beta},
                             heads ? NULL : b->s_in, b->dout, NULL);
    MPI_Barrier(MPI_COMM_WORLD);
    *tf = t1 - t0, *tb = MPI_Wtime() - t1;
    return rc;
}

/* Packed against dense at equal tokens, every strategy (heads where D | Hk). */
static int bench_packed(const shard_bufs *b, gdn_plan *dense, int64_t T, int reps, int64_t doc_min,
                        int64_t doc_max, int json) {
    int rank, D;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    gdn_config cfg = *cli_plan(dense).config;
    const int64_t ns = cfg.Hv * cfg.K * cfg.V;
    const int64_t t_first = rank * (T / D) + (rank < T % D ? rank : T % D); /* this shard's first token */
    int64_t n_docs = 0;
    int64_t *cu = draw_documents(T, doc_min, doc_max, 0x243F6A8885A308D3ull, &n_docs); /* the same on every rank */
    float *htd = malloc(sizeof(float) * ns), *gsd = malloc(sizeof(float) * ns);
    float *htp = cu ? malloc(sizeof(float) * n_docs * ns) : NULL, *gsp = cu ? malloc(sizeof(float) * n_docs * ns) : NULL;
    int rc = cu && htd && gsd && htp && gsp ? GDN_OK : GDN_ERR_NOMEM;
    gdn_plan *packed = NULL;
    if (!rc) {
        cfg.T = b->Tr, cfg.cu_seqlens = cu, cfg.n_docs = n_docs, cfg.seq_offset = t_first;
        rc = gdn_plan_create(&packed, &cfg);
    }
    /* The oracle (rank 0): the first document, when rank 0 holds all of it, forward and backward;
     * the dense stream's first 256 tokens, forward (its gradients depend on the whole stream). */
    const int64_t first_doc = cu ? cu[1] : 0, n_dense = b->Tr < 256 ? b->Tr : 256;
    int check_doc = !rank && cu && first_doc <= b->Tr, check_dense = !rank;
    double *od = NULL, *rv = NULL, *od_dense = NULL;
    if (!rc && !rank) {
        od = malloc(sizeof(double) * (size_t)(2 * first_doc * cfg.Hv * cfg.V + n_dense * cfg.Hv * cfg.V));
        if (!od) rc = GDN_ERR_NOMEM;
        else rv = od + first_doc * cfg.Hv * cfg.V, od_dense = rv + first_doc * cfg.Hv * cfg.V;
        /* (an oracle that fails leaves its errors NaN) */
        if (!rc && check_doc && oracle_rows(&cfg, first_doc, b->q, b->k, b->v, b->g, b->beta, b->dout, od, rv))
            check_doc = 0;
        if (!rc && oracle_rows(&cfg, n_dense, b->q, b->k, b->v, b->g, b->beta, NULL, od_dense, NULL)) check_dense = 0;
    }
    int local = rc;
    MPI_Allreduce(&local, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (rc) {
        if (local) cli_error("bench cp (packed)", local);
        goto done;
    }
    /* Rank cuts that fall inside a document (the state crosses them), and the document lengths. */
    int crossing = 0;
    int64_t shortest = T, longest = 0;
    for (int r = 1; r < D; r++) {
        const int64_t cut = r * (T / D) + (r < T % D ? r : T % D);
        int at_start = 0;
        for (int64_t d = 0; d <= n_docs; d++) at_start |= cu[d] == cut;
        crossing += !at_start;
    }
    for (int64_t d = 0; d < n_docs; d++)
        shortest = cu[d + 1] - cu[d] < shortest ? cu[d + 1] - cu[d] : shortest,
        longest = cu[d + 1] - cu[d] > longest ? cu[d + 1] - cu[d] : longest;
    /* The peak of the machine(s): measured on rank 0 with every core of its node (the ranks share
     * them), times the number of nodes. */
    MPI_Comm node;
    int node_rank = 0, nodes = 1, first_on_node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &node_rank);
    MPI_Comm_free(&node);
    first_on_node = node_rank == 0;
    MPI_Allreduce(&first_on_node, &nodes, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    const char *cpu = "";
    double peak = 0;
    MPI_Barrier(MPI_COMM_WORLD);
    if (!rank) {
        cpu = cli_cpu();
        const long cores = sysconf(_SC_NPROCESSORS_ONLN);
        peak = nodes * cli_peak_gflops(cores > 0 ? (int)cores : 1, json);
        if (!json)
            printf("packed vs dense (issue 11): D=%d T=%lld B=1 Hk=%lld Hv=%lld K=%lld V=%lld C=%d, %d thread(s) per "
                   "rank; %lld documents of %lld..%lld tokens (drawn in [%lld, %lld], seeded), %d of %d rank cuts "
                   "inside a document; fwd+bwd medians of %d interleaved repetitions; peak %.1f GFLOP/s = %d node(s) "
                   "x all cores; CPU %s\n",
                   D, (long long)T, (long long)cfg.Hk, (long long)cfg.Hv, (long long)cfg.K, (long long)cfg.V,
                   cfg.chunk, cli_plan(dense).config->threads, (long long)n_docs, (long long)shortest,
                   (long long)longest, (long long)doc_min, (long long)doc_max, crossing, D - 1, reps, peak, nodes, cpu);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    /* FLOPs as gdncp bench kernel counts them, per token: dense and packed runs of the same tokens
     * count the same work */
    const double flops = cli_rule_flops(cfg.K, cfg.V, cfg.chunk, (double)T * (double)cfg.Hv, 3);
    gdn_cp *cp = NULL;
    if ((rc = gdn_cp_create(&cp, MPI_COMM_WORLD))) cli_error("bench cp (packed)", rc);
    for (int s = 0; s < 4 && !rc; s++) {
        if (s == GDN_CP_HEADS && cfg.Hk % D) continue;
        /* the strategy is the plans' (a plan that fails on one rank: every rank's error at the
         * first call's agreement) */
        gdn_plan *dn = NULL, *pk = NULL;
        with_strategy(&dn, dense, s), with_strategy(&pk, packed, s);
        double tf[2][MAX_REPS], tb[2][MAX_REPS], tt[2][MAX_REPS], ratio[MAX_REPS], x, y;
        /* warm-up (untimed), and the dense run's forward error on its first tokens */
        rc = fwd_bwd(cp, dn, b, htd, gsd, &x, &y);
        double err_dense = NAN, err_fwd = NAN, err_bwd = NAN;
        if (!rc && check_dense) err_dense = cli_rel_err(b->o, od_dense, n_dense * cfg.Hv * cfg.V);
        if (!rc) rc = fwd_bwd(cp, pk, b, htp, gsp, &x, &y);
        /* Repetition r runs packed first when (reps - 1 - r) is odd: the orders alternate and the
         * last run is packed (its outputs are checked below). */
        for (int r = 0; r < reps && !rc; r++)
            for (int i = 0; i < 2 && !rc; i++) {
                const int p = ((reps - 1 - r) % 2) ? i == 0 : i == 1;
                rc = fwd_bwd(cp, p ? pk : dn, b, p ? htp : htd, p ? gsp : gsd, &tf[p][r], &tb[p][r]);
                tt[p][r] = tf[p][r] + tb[p][r];
            }
        if (rc) {
            gdn_plan_destroy(dn), gdn_plan_destroy(pk);
            cli_error("bench cp (packed)", rc);
            break;
        }
        if (check_doc) {
            err_fwd = cli_rel_err(b->o, od, first_doc * cfg.Hv * cfg.V);
            err_bwd = cli_rel_err(b->gv, rv, first_doc * cfg.Hv * cfg.V);
        }
        if (!rank) {
            for (int r = 0; r < reps; r++) ratio[r] = tt[1][r] / tt[0][r];
            const double ratio_med = cli_median(ratio, reps);
            double med[2][3];
            for (int p = 0; p < 2; p++)
                med[p][0] = cli_median(tf[p], reps), med[p][1] = cli_median(tb[p], reps), med[p][2] = cli_median(tt[p], reps);
            const char *name = gdn_cp_strategy_name((gdn_cp_strategy)s), *path = cli_plan(pk).path;
            char drawn[64];
            snprintf(drawn, sizeof drawn, "[%lld,%lld]", (long long)doc_min, (long long)doc_max);
            const double gd = flops / med[0][2] / 1e9, gp = flops / med[1][2] / 1e9;
            CLI_ROW(json, CLI_S("bench", "%s", NULL, "cp_packed"), CLI_S("strategy", "%s", "%-9s fwd+bwd", name),
                    CLI_I("D", "%lld", NULL, D), CLI_I("T", "%lld", NULL, T), CLI_I("n_docs", "%lld", NULL, n_docs),
                    CLI_I("shortest_doc", "%lld", NULL, shortest), CLI_I("longest_doc", "%lld", NULL, longest),
                    CLI_R("drawn_in", NULL, drawn), CLI_I("cuts_inside_documents", "%lld", NULL, crossing),
                    cli_at(CLI_I("reps", "%lld", " (median of %lld pairs)", reps), 7),
                    cli_at(CLI_F("dense_fwd_s", "%.6f", " (%6.4f", med[0][0]), 3),
                    CLI_F("dense_bwd_s", "%.6f", " + %6.4f)", med[0][1]),
                    cli_at(CLI_F("dense_fwd_bwd_s", "%.6f", "  dense %7.4f s", med[0][2]), 2),
                    cli_at(CLI_F("packed_fwd_s", "%.6f", " (%6.4f", med[1][0]), 5),
                    CLI_F("packed_bwd_s", "%.6f", " + %6.4f)", med[1][1]),
                    cli_at(CLI_F("packed_fwd_bwd_s", "%.6f", "  packed %7.4f s", med[1][2]), 4),
                    cli_at(CLI_F("packed_over_dense", "%.4f", "  packed/dense %.3f", ratio_med), 6),
                    cli_at(CLI_F("dense_gflops", "%.3f", "  %6.1f", gd), 8),
                    CLI_F("packed_gflops", "%.3f", " / %6.1f GFLOP/s", gp), CLI_F("peak_gflops", "%.3f", NULL, peak),
                    cli_x(CLI_F("dense_fraction_of_peak", "%.4f", " = %4.1f%%", gd / peak), 100),
                    cli_x(CLI_F("packed_fraction_of_peak", "%.4f", " / %4.1f%% of peak", gp / peak), 100),
                    CLI_N("dense_rel_err_fwd", "%.3e", "  err dense o %.1e", err_dense),
                    CLI_I(NULL, NULL, " (first %lld tokens),", n_dense),
                    CLI_N("packed_rel_err_fwd", "%.3e", " packed o %.1e", err_fwd),
                    CLI_N("packed_rel_err_bwd", "%.3e", " dv %.1e", err_bwd),
                    CLI_I(NULL, NULL, " (first document, %lld tokens)", first_doc),
                    CLI_S("path", "%s", "  path %s", path), CLI_S("cpu", "%s", NULL, cpu));
            fflush(stdout);
        }
        gdn_plan_destroy(dn), gdn_plan_destroy(pk);
    }
    gdn_cp_destroy(cp);
done:
    gdn_plan_destroy(packed);
    free(cu), free(htd), free(gsd), free(htp), free(gsp), free(od);
    return rc ? 1 : 0;
}

typedef struct {
    int json, packed_only;
    int64_t T, reps, doc_min, doc_max;
} bench_cp_opts;

static void bench_cp_init(void *p) {
    bench_cp_opts *o = p;
    o->T = 65536, o->reps = 3, o->doc_min = 512, o->doc_max = 2048;
}

static const cli_opt bench_cp_table[] = {
    {CLI_FLAG("--json", bench_cp_opts, json, "one JSON object per row instead of text")},
    {CLI_I64("--T", bench_cp_opts, T, 1, (int64_t)1 << 30, "N", "tokens of the one sequence")},
    {CLI_I64("--reps", bench_cp_opts, reps, 1, MAX_REPS, "R", "timed repetitions")},
    {CLI_I64("--doc-min", bench_cp_opts, doc_min, 1, (int64_t)1 << 30, "N", "the packed part's shortest document")},
    {CLI_I64("--doc-max", bench_cp_opts, doc_max, 1, (int64_t)1 << 30, "N", "the packed part's longest document (at least --doc-min)")},
    {CLI_FLAG("--packed-only", bench_cp_opts, packed_only, "run only the packed-against-dense part")},
};

const cli_command cmd_bench_cp_cli = {
    .name = "bench cp",
    .usage = "usage: mpiexec -n D gdncp bench cp [--json] [--T N] [--reps R] [--doc-min N] [--doc-max N] [--packed-only]\n",
    .summary = "(under mpiexec) every CP strategy's per-rank time split and bytes, then packed documents against dense",
    .about = "  the context-parallel gated delta rule (every strategy, dense and packed) against one rank\n",
    .size = sizeof(bench_cp_opts), .init = bench_cp_init, CLI_OPTS(bench_cp_table),
};

int cmd_bench_cp(int argc, char **argv) {
    bench_cp_opts opts;
    int rank, D;
    if (cli_parse(&cmd_bench_cp_cli, argc - 1, argv + 1, &opts, NULL)) return CLI_USAGE_ERROR;
    const int json = opts.json, packed_only = opts.packed_only;
    const int64_t T = opts.T, reps = opts.reps, doc_min = opts.doc_min, doc_max = opts.doc_max;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    if (doc_max < doc_min) {
        if (!rank) fprintf(stderr, "gdncp bench cp: --doc-max %lld is below --doc-min %lld\n", (long long)doc_max,
                           (long long)doc_min);
        return CLI_USAGE_ERROR;
    }
    if (T < D) {
        if (!rank) fprintf(stderr, "gdncp bench cp: T = %lld is smaller than the %d ranks\n", (long long)T, D);
        return 1;
    }
    const int64_t Tr = T / D + (rank < T % D), Hk = 2, Hv = 4, K = 128, V = 128;
    gdn_config cfg = gdn_config_default(1, Tr, Hk, Hv, K, V);
    const int64_t nqk = Tr * Hk * K, nv = Tr * Hv * V, ng = Tr * Hv, ns = Hv * K * V;
    float *buf = malloc(sizeof(float) * (4 * nqk + 4 * nv + 4 * ng + 3 * ns));
    if (!buf) {
        fprintf(stderr, "gdncp bench cp: out of memory\n");
        return 1;
    }
    float *q = buf, *k = q + nqk, *gq = k + nqk, *gk = gq + nqk, *v = gk + nqk, *o = v + nv, *dout = o + nv, *gv = dout + nv;
    float *g = gv + nv, *beta = g + ng, *gg = beta + ng, *gb = gg + ng, *ht = gb + ng, *s_in = ht + ns, *gs = s_in + ns;
    uint64_t seed = 0x9E3779B97F4A7C15ull ^ (uint64_t)(rank + 1) * 0x100000001B3ull;
    for (int64_t i = 0; i < nqk; i++) q[i] = cli_uniform(&seed, -0.5f, 0.5f), k[i] = cli_uniform(&seed, -0.5f, 0.5f);
    for (int64_t i = 0; i < nv; i++) v[i] = cli_uniform(&seed, -0.5f, 0.5f), dout[i] = cli_uniform(&seed, -0.5f, 0.5f);
    for (int64_t i = 0; i < ng; i++) g[i] = cli_uniform(&seed, 0, -0.05f), beta[i] = cli_uniform(&seed, 0, 1);
    gdn_plan *plan = NULL;
    int rc = gdn_plan_create(&plan, &cfg);
    /* The single-rank time of this rank's share: the same plan alone on the shard. */
    double alone[2] = {0, 0};
    for (int dir = 0; dir < 2 && !rc; dir++) {
        double t[MAX_REPS];
        for (int r = 0; r < reps && !rc; r++) {
            double t0 = cli_now();
            rc = dir ? gdn_backward(plan,
                                    &(gdn_rule_grads){.dq = gq, .dk = gk, .dv = gv, .dg = gg, .dbeta = gb},
                                    &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta}, dout,
                                    NULL)
                     : gdn_forward(plan, o, ht, &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta});
            t[r] = cli_now() - t0;
        }
        qsort(t, reps, sizeof(double), cmp_d);
        alone[dir] = t[reps / 2];
    }
    if (rc) return cli_error("bench cp", rc);
    if (!rank && !json)
        printf("gdncp bench cp: D=%d T=%lld (B=1 Hk=%lld Hv=%lld K=%lld V=%lld C=%d, %d thread(s) per rank); "
               "summary = Hv K (K+V) 4 = %lld bytes\n",
               D, (long long)T, (long long)Hk, (long long)Hv, (long long)K, (long long)V, cli_plan(plan).config->chunk,
               cli_plan(plan).config->threads, (long long)(Hv * K * (K + V) * 4));
    gdn_cp *cp = NULL;
    if ((rc = gdn_cp_create(&cp, MPI_COMM_WORLD))) return cli_error("bench cp", rc);
    for (int s = 0; s < 4 && !packed_only; s++) {
        if (s == GDN_CP_HEADS && Hk % D) continue;
        gdn_plan *sp = NULL; /* the strategy is the plan's (NULL on a rank: every rank's error below) */
        with_strategy(&sp, plan, s);
        for (int dir = 0; dir < 2; dir++) {
            double t[MAX_REPS];
            gdn_cp_stats st[MAX_REPS];
            for (int r = 0; r < reps && !rc; r++) {
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                rc = dir ? gdn_cp_backward(cp, sp,
                                           &(gdn_rule_grads){.dq = gq, .dk = gk, .dv = gv, .dg = gg,
                                                             .dbeta = gb, .dh0 = gs},
                                           &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta},
                                           s == GDN_CP_HEADS ? NULL : s_in, dout, NULL)
                         : gdn_cp_forward(cp, sp, o, ht, s_in,
                                          &(gdn_rule_inputs){.q = q, .k = k, .v = v, .g = g, .beta = beta});
                MPI_Barrier(MPI_COMM_WORLD);
                t[r] = MPI_Wtime() - t0;
                st[r] = gdn_cp_last_stats(cp);
            }
            if (rc) {
                gdn_plan_destroy(sp), gdn_cp_destroy(cp);
                return cli_error("bench cp", rc);
            }
            /* The median wall time and the accounting of that repetition. */
            int med = 0;
            double sorted[MAX_REPS];
            memcpy(sorted, t, sizeof(double) * reps);
            qsort(sorted, reps, sizeof(double), cmp_d);
            for (int r = 0; r < reps; r++)
                if (t[r] == sorted[reps / 2]) med = r;
            struct rusage ru;
            getrusage(RUSAGE_SELF, &ru);
            const gdn_cp_stats *x = &st[med];
            double row[9] = {t[med], x->fold_s, x->comm_s, x->replay_s, (double)x->bytes_sent, (double)x->bytes_recv,
                             (double)x->rounds, ru.ru_maxrss / 1024.0, (x->fold_s + x->replay_s) / alone[dir]};
            double *all = rank ? NULL : malloc(sizeof(double) * 9 * D);
            MPI_Gather(row, 9, MPI_DOUBLE, all, 9, MPI_DOUBLE, 0, MPI_COMM_WORLD);
            if (!rank) {
                for (int r = 0; r < D; r++) {
                    const double *y = all + 9 * r;
                    CLI_ROW(json, CLI_S("bench", "%s", NULL, "cp"),
                            CLI_S("strategy", "%s", "%-9s", gdn_cp_strategy_name((gdn_cp_strategy)s)),
                            CLI_S("direction", "%s", " %-8s", dir ? "backward" : "forward"),
                            cli_at(CLI_I("D", "%lld", "/%lld", D), 3),
                            cli_at(CLI_I("rank", "%lld", " rank %lld", r), 2), cli_at(CLI_I("T", "%lld", NULL, T), 4),
                            CLI_F("wall_s", "%.6f", "  wall %8.4f s", y[0]),
                            CLI_F("fold_s", "%.6f", "  fold %7.4f", y[1]),
                            CLI_F("comm_s", "%.6f", "  comm %7.4f", y[2]),
                            CLI_F("replay_s", "%.6f", "  replay %7.4f", y[3]),
                            CLI_F("bytes_sent", "%.0f", "  sent %9.0f B", y[4]),
                            CLI_F("bytes_recv", "%.0f", "  recv %9.0f B", y[5]),
                            CLI_F("rounds", "%.0f", "  rounds %2.0f", y[6]),
                            CLI_F("peak_rss_mib", "%.1f", "  rss %6.1f MiB", y[7]),
                            CLI_F("compute_over_alone", "%.3f", "  compute/alone %.2f", y[8]));
                }
                fflush(stdout);
            }
            free(all);
        }
        gdn_plan_destroy(sp);
    }
    gdn_cp_destroy(cp);
    const shard_bufs sb = {Tr, q, k, v, g, beta, o, dout, gq, gk, gv, gg, gb, s_in};
    rc = bench_packed(&sb, plan, T, (int)reps, doc_min, doc_max, json);
    gdn_plan_destroy(plan);
    free(buf);
    return rc;
}
