/* gdncp bench cp (under mpiexec -n D): one long sequence split over the D ranks, every strategy,
 * forward and backward: per-rank time split, bytes, peak RSS, and the ratio of per-rank compute
 * to the single-rank time of its share (the same plan run alone on the shard). */
#include "cli.h"
#include "cli_parse.h"
#include "gdncp_cp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static float frand(uint64_t *s) {
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return (float)(*s >> 40) / 16777216.0f;
}

/* Repetitions per case: their times and stats live in arrays of this size on the stack. */
enum { MAX_REPS = 16 };

int cmd_bench_cp(int argc, char **argv) {
    int json = 0, rank, D;
    int64_t T = 65536, reps = 3;
    for (int i = 2; i < argc; i++) {
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--json")) json = 1;
        else if (!strcmp(argv[i], "--T")) {
            if (cli_parse_i64("bench cp", "--T", val, 1, (int64_t)1 << 30, &T)) return CLI_USAGE_ERROR;
            i++;
        } else if (!strcmp(argv[i], "--reps")) {
            if (cli_parse_i64("bench cp", "--reps", val, 1, MAX_REPS, &reps)) return CLI_USAGE_ERROR;
            i++;
        } else {
            fprintf(stderr, "gdncp bench cp: unknown option '%s'\n", argv[i]);
            return CLI_USAGE_ERROR;
        }
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
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
    for (int64_t i = 0; i < nqk; i++) q[i] = frand(&seed) - 0.5f, k[i] = frand(&seed) - 0.5f;
    for (int64_t i = 0; i < nv; i++) v[i] = frand(&seed) - 0.5f, dout[i] = frand(&seed) - 0.5f;
    for (int64_t i = 0; i < ng; i++) g[i] = -0.05f * frand(&seed), beta[i] = frand(&seed);
    gdn_plan *plan = NULL;
    int rc = gdn_plan_create(&plan, &cfg);
    /* The single-rank time of this rank's share: the same plan alone on the shard. */
    double alone[2] = {0, 0};
    for (int dir = 0; dir < 2 && !rc; dir++) {
        double t[MAX_REPS];
        for (int r = 0; r < reps && !rc; r++) {
            double t0 = cli_now();
            rc = dir ? gdn_backward(plan, gq, gk, gv, gg, gb, NULL, q, k, v, g, beta, NULL, dout, NULL)
                     : gdn_forward(plan, o, ht, q, k, v, g, beta, NULL);
            t[r] = cli_now() - t0;
        }
        qsort(t, reps, sizeof(double), cmp_d);
        alone[dir] = t[reps / 2];
    }
    if (rc) return cli_error("bench cp", rc);
    if (!rank && !json)
        printf("gdncp bench cp: D=%d T=%lld (B=1 Hk=%lld Hv=%lld K=%lld V=%lld C=%d, %d thread(s) per rank); "
               "summary = Hv K (K+V) 4 = %lld bytes\n",
               D, (long long)T, (long long)Hk, (long long)Hv, (long long)K, (long long)V, gdn_plan_config(plan)->chunk,
               gdn_plan_config(plan)->threads, (long long)(Hv * K * (K + V) * 4));
    for (int s = 0; s < 4; s++) {
        if (s == GDN_CP_HEADS && Hk % D) continue;
        gdn_cp *cp = NULL;
        if ((rc = gdn_cp_create(&cp, MPI_COMM_WORLD, (gdn_cp_strategy)s))) return cli_error("bench cp", rc);
        for (int dir = 0; dir < 2; dir++) {
            double t[MAX_REPS];
            gdn_cp_stats st[MAX_REPS];
            for (int r = 0; r < reps && !rc; r++) {
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                rc = dir ? gdn_cp_backward(cp, plan, gq, gk, gv, gg, gb, gs, q, k, v, g, beta, NULL,
                                           s == GDN_CP_HEADS ? NULL : s_in, dout, NULL)
                         : gdn_cp_forward(cp, plan, o, ht, s_in, q, k, v, g, beta, NULL);
                MPI_Barrier(MPI_COMM_WORLD);
                t[r] = MPI_Wtime() - t0;
                st[r] = gdn_cp_last_stats(cp);
            }
            if (rc) return cli_error("bench cp", rc);
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
                    if (json)
                        printf("{\"bench\":\"cp\",\"strategy\":\"%s\",\"direction\":\"%s\",\"D\":%d,\"rank\":%d,"
                               "\"T\":%lld,\"wall_s\":%.6f,\"fold_s\":%.6f,\"comm_s\":%.6f,\"replay_s\":%.6f,"
                               "\"bytes_sent\":%.0f,\"bytes_recv\":%.0f,\"rounds\":%.0f,\"peak_rss_mib\":%.1f,"
                               "\"compute_over_alone\":%.3f}\n",
                               gdn_cp_strategy_name((gdn_cp_strategy)s), dir ? "backward" : "forward", D, r, (long long)T,
                               y[0], y[1], y[2], y[3], y[4], y[5], y[6], y[7], y[8]);
                    else
                        printf("%-9s %-8s rank %d/%d  wall %8.4f s  fold %7.4f  comm %7.4f  replay %7.4f  sent %9.0f B  "
                               "recv %9.0f B  rounds %2.0f  rss %6.1f MiB  compute/alone %.2f\n",
                               gdn_cp_strategy_name((gdn_cp_strategy)s), dir ? "backward" : "forward", r, D, y[0],
                               y[1], y[2], y[3], y[4], y[5], y[6], y[7], y[8]);
                }
                fflush(stdout);
            }
            free(all);
        }
        gdn_cp_destroy(cp);
    }
    gdn_plan_destroy(plan);
    free(buf);
    return 0;
}
