/* gdncp run --cp STRATEGY: the sequence split over the MPI ranks. Every rank reads only its
 * own token slice; rank 0 writes the gathered outputs in the single-rank layout. */
#include "cli.h"
#include "gdncp/cp.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

int cli_shard_of(const char *spec, int D, int rank, int64_t T, int64_t *t0, int64_t *tn) {
    if (!spec) { /* (decided from T and D alone, so every rank reaches the same verdict) */
        if (T < D) {
            if (!rank)
                fprintf(stderr, "gdncp: %d ranks for T = %lld tokens: more ranks than tokens (each rank needs at "
                                "least one)\n", D, (long long)T);
            return 1;
        }
        *tn = T / D + (rank < T % D);
        *t0 = rank * (T / D) + (rank < T % D ? rank : T % D);
        return 0;
    }
    int64_t acc = 0, n = 0;
    const char *p = spec;
    while (*p) {
        char *end = (char *)p;
        errno = 0;
        /* digits only (strtoll would also take blanks and signs), and no empty last entry */
        long long v = *p >= '0' && *p <= '9' ? strtoll(p, &end, 10) : 0;
        if (v < 1 || errno || (*end && *end != ',') || (*end == ',' && !end[1])) {
            if (!rank) fprintf(stderr, "gdncp: --shards needs positive integers separated by commas, got '%s'\n", spec);
            return 1;
        }
        if (v > T - acc) { /* (also keeps acc + v from overflowing) */
            if (!rank) fprintf(stderr, "gdncp: --shards '%s' sums to more than T = %lld\n", spec, (long long)T);
            return 1;
        }
        if (n == rank) *t0 = acc, *tn = v;
        acc += v, n++;
        p = *end ? end + 1 : end;
    }
    if (n != D || acc != T) {
        if (!rank) fprintf(stderr, "gdncp: --shards lists %lld sizes summing to %lld; need %d sizes (one per rank) summing to T = %lld\n",
                (long long)n, (long long)acc, D, (long long)T);
        return 1;
    }
    return 0;
}

int cli_cp_write_rows(gdn_cp *cp, const char *path, const char *producer, int64_t B, int64_t T_full,
                      int64_t t0, int64_t tn, const cli_out_tensor *t, int n,
                      int (*add_more)(gdn_st_writer *w, int rank, void *ctx), void *ctx) {
    const int rank = gdn_cp_rank(cp);
    /* every rank builds the same writer: the layout (header, offsets) agrees without messages;
     * rank 0 also holds the whole-sequence tensors (states) and writes them with the header */
    gdn_st_writer *w = NULL;
    int rc = gdn_st_writer_create(&w);
    if (!rc) rc = gdn_st_writer_metadata(w, "producer", producer);
    for (int i = 0; i < n && !rc; i++)
        if (t[i].data || t[i].rows) /* a rows tensor absent here is absent on every rank (agreed) */
            rc = gdn_st_writer_add_f32(w, t[i].name, GDN_F32, t[i].ndim, t[i].shape,
                                       t[i].rows || rank ? NULL : t[i].data);
    if (!rc && add_more) rc = add_more(w, rank, ctx);
    char tmp[4096] = {0};
    if (!rank && !rc) rc = gdn_st_writer_begin(w, path, tmp, sizeof tmp);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    if (MPI_Bcast(tmp, sizeof tmp, MPI_CHAR, 0, MPI_COMM_WORLD) != MPI_SUCCESS) {
        rc = gdn_cp_agree_status(cp, GDN_ERR_MPI);
        goto done;
    }
    for (int i = 0; i < n && !rc; i++) {
        if (!t[i].rows || !t[i].data) continue;
        uint64_t off;
        int64_t inner = 1;
        for (int d = 2; d < t[i].ndim; d++) inner *= t[i].shape[d];
        rc = gdn_st_writer_offset(w, t[i].name, &off);
        for (int64_t b = 0; b < B && !rc; b++)
            rc = gdn_st_write_at(tmp, off + 4 * (uint64_t)((b * T_full + t0) * inner), t[i].data + b * tn * inner,
                                 (size_t)(tn * inner));
    }
    /* all rows on disk everywhere before the rename */
    rc = gdn_cp_agree_status(cp, rc);
    if (!rank) {
        if (!rc) rc = gdn_st_commit(tmp, path);
        else unlink(tmp);
    }
    rc = gdn_cp_agree_status(cp, rc);
done:
    gdn_st_writer_destroy(w);
    return rc;
}

int cli_cp_fail_early(int argc, char **argv) {
    int under_cp = 0, inited = 0;
    for (int i = 1; i < argc; i++) under_cp |= !strcmp(argv[i], "--cp");
    MPI_Initialized(&inited);
    if (!under_cp || !inited) return 1;
    /* the other ranks' first collectives: the context's communicator, then the 6-value step */
    gdn_cp *cp = NULL;
    if (gdn_cp_create(&cp, MPI_COMM_WORLD, GDN_CP_SCAN)) return 1;
    static const char *const names[6] = {"", "", "", "", "", ""};
    const int64_t none[6] = {0};
    gdn_cp_agree_values(cp, none, 6, names, GDN_ERR_ARG);
    gdn_cp_destroy(cp);
    return 1;
}

int cli_cp_check_fits(gdn_cp *cp, const char *cmd, const char *what, double bytes) {
    /* ranks on one machine share its memory: each alone could fit while together they cannot */
    MPI_Comm node;
    double together = bytes;
    int on_node = 1, node_rank = 0;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        if (MPI_Allreduce(&bytes, &together, 1, MPI_DOUBLE, MPI_SUM, node) != MPI_SUCCESS) together = bytes;
        MPI_Comm_size(node, &on_node), MPI_Comm_rank(node, &node_rank);
        MPI_Comm_free(&node);
    }
    char whole[512];
    snprintf(whole, sizeof whole, "%s, for the %d rank(s) on this machine together,", what, on_node);
    const int local = gdn_check_fits(whole, together);
    if (local && !node_rank) cli_error(cmd, local);
    return gdn_cp_agree_status(cp, local);
}

/* FNV-1a of a string (0 for NULL): lets ranks agree on a whole option string in one value. */
int64_t cli_hash(const char *s) {
    if (!s) return 0;
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return (int64_t)(h >> 1);
}

/* How much the incoming state changed this rank's outputs: rel = max|o - o0| / max|o| over the
 * shard, o0 the outputs from a zero state; reach = how many leading tokens of the shard show a
 * change above 1e-5 max|o| (the last such token + 1). o [B, T, Hv*V]. */
static void incoming_effect(const float *o, const float *o0, int64_t B, int64_t T, int64_t inner,
                            double *rel, double *reach) {
    double mo = 0, md = 0;
    for (int64_t i = 0; i < B * T * inner; i++) mo = fmax(mo, fabs(o[i])), md = fmax(md, fabs((double)o[i] - o0[i]));
    int64_t last = 0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = T - 1; t >= last; t--) {
            const float *x = o + (b * T + t) * inner, *y = o0 + (b * T + t) * inner;
            double d = 0;
            for (int64_t j = 0; j < inner; j++) d = fmax(d, fabs((double)x[j] - y[j]));
            if (d > 1e-5 * mo) {
                last = t + 1;
                break;
            }
        }
    *rel = mo > 0 ? md / mo : md;
    *reach = (double)last;
}

int cmd_run_cp(const cli_cp_opts *co, gdn_config opts) {
    const char *in = co->in, *out = co->out, *strategy = co->strategy, *shards = co->shards;
    const int backward = co->backward, stats = co->stats;
    int rank, D;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    /* Everything a rank decides alone is checked here, and then agreed on in one step before any
     * collective depends on it: ranks launched with different arguments (an MPMD launch or a
     * script bug) stop together with one message instead of entering different collectives. */
    int local = GDN_OK;
    const int s = gdn_cp_strategy_parse(strategy);
    if (s < 0) fprintf(stderr, "gdncp run: rank %d: unknown --cp strategy '%s' (scan, allgather, relay, heads)\n", rank, strategy), local = GDN_ERR_ARG;
    const int fault = co->fault && !strcmp(co->fault, "drop-incoming") ? GDN_CP_FAULT_DROP_INCOMING : GDN_CP_FAULT_NONE;
    if (!local && co->fault && !fault)
        fprintf(stderr, "gdncp run: unknown --fault '%s' (drop-incoming)\n", co->fault), local = GDN_ERR_ARG;
    if (!local && fault && s == GDN_CP_HEADS)
        fprintf(stderr, "gdncp run: --fault drop-incoming needs --cp scan, allgather or relay ('heads' has no incoming state)\n"),
            local = GDN_ERR_ARG;
    gdn_cp *cp = NULL;
    if (gdn_cp_create(&cp, MPI_COMM_WORLD, s < 0 ? GDN_CP_SCAN : (gdn_cp_strategy)s)) return cli_error("run --cp", GDN_ERR_MPI);
    /* Each rank reads the header of its own file: T must agree too. */
    long long T = -1;
    double per_token = 0;
    if (!local) local = cli_run_header(in, backward, &T, &per_token);
    static const char *const names[] = {"--cp (0 scan, 1 allgather, 2 relay, 3 heads)", "--backward", "--stats",
                                        "--fault", "--shards (the lists differ; values are hashes)",
                                        "T of the input file"};
    const int64_t vals[6] = {s, backward, stats, fault, cli_hash(shards), T};
    int rc = gdn_cp_agree_values(cp, vals, 6, names, local);
    if (rc) {
        if (!local) cli_error("run --cp", rc);
        gdn_cp_destroy(cp);
        return 1;
    }
    if (fault && !rank)
        fprintf(stderr, "gdncp run --cp %s: TESTING FAULT drop-incoming: every rank but 0 replays from a zero state; "
                "the results are deliberately WRONG (for negative controls only)\n", strategy);
    /* Packed documents: every rank holds the whole stream's offsets (the library agrees on them
     * again, by count and hash, when the plans meet). Each rank checks its own file's. */
    int64_t *cu = NULL, n_docs = 0;
    char who[64];
    snprintf(who, sizeof who, rank ? "gdncp run --cp: rank %d" : "gdncp run --cp", rank);
    local = cli_pack_offsets(who, in, "q", co->cu_seqlens, co->n_cu, &cu, &n_docs) ? GDN_ERR_ARG : GDN_OK;
    int64_t t0 = 0, tn = 0;
    /* same spec, T and D everywhere (agreed): every rank reaches the same verdict */
    if (gdn_cp_agree_status(cp, local) || cli_shard_of(shards, D, rank, T, &t0, &tn)) {
        free(cu);
        gdn_cp_destroy(cp);
        return 1;
    }
    /* this rank's rows of the inputs and outputs: a lower bound (states, plans and strategy
     * buffers come on top), so a refusal is certain */
    char what[160];
    snprintf(what, sizeof what, "holding the input and output rows of their shards (T = %lld, %s)", T,
             backward ? "forward and backward" : "forward");
    if (cli_cp_check_fits(cp, "run --cp", what, per_token * (double)tn)) {
        free(cu);
        gdn_cp_destroy(cp);
        return 1;
    }
    gdn_problem pb;
    memset(&pb, 0, sizeof pb);
    rc = gdn_problem_load_packed(&pb, in, backward, t0, tn, n_docs);
    if (rc) cli_error("run --cp", rc);
    if ((rc = gdn_cp_agree_status(cp, rc))) {
        gdn_problem_free(&pb);
        free(cu);
        gdn_cp_destroy(cp);
        return 1;
    }
    gdn_config cfg = pb.cfg;
    cfg.chunk = opts.chunk, cfg.threads = opts.threads, cfg.scale = opts.scale, cfg.l2norm = opts.l2norm;
    cfg.cu_seqlens = cu, cfg.n_docs = n_docs, cfg.seq_offset = cu ? t0 : 0;
    /* h0, ht, dht and the gradient of the states are per document when packed; s_in (the state
     * entering this shard) is one stream's */
    const int64_t state_rows = cu ? n_docs : cfg.B;
    const int64_t nqk = cfg.B * cfg.T * cfg.Hk * cfg.K, nv = cfg.B * cfg.T * cfg.Hv * cfg.V,
                  ng = cfg.B * cfg.T * cfg.Hv, ns = cfg.B * cfg.Hv * cfg.K * cfg.V,
                  nst = state_rows * cfg.Hv * cfg.K * cfg.V;
    float *o = malloc(sizeof(float) * nv), *ht = malloc(sizeof(float) * nst), *s_in = malloc(sizeof(float) * ns);
    float *gq = NULL, *gk = NULL, *gv = NULL, *gg = NULL, *gb = NULL, *gs = NULL;
    if (backward) {
        gq = malloc(sizeof(float) * nqk), gk = malloc(sizeof(float) * nqk), gv = malloc(sizeof(float) * nv);
        gg = malloc(sizeof(float) * ng), gb = malloc(sizeof(float) * ng), gs = malloc(sizeof(float) * nst);
    }
    gdn_plan *plan = NULL;
    gdn_cp_stats fs = {0}, bs = {0};
    double t_start = MPI_Wtime();
    /* a failure is named where it happens; the other ranks stop with it in the agreement */
    if (!o || !ht || !s_in || (backward && (!gq || !gk || !gv || !gg || !gb || !gs))) {
        fprintf(stderr, "gdncp run --cp: out of memory: rank %d: the outputs%s of its %lld-token shard (%.2f GB)\n",
                rank, backward ? " and gradients" : "", (long long)cfg.T,
                4e-9 * (double)(nv + ns + 2 * nst + (backward ? 2 * nqk + nv + 2 * ng : 0)));
        rc = GDN_ERR_NOMEM;
    } else if ((rc = gdn_plan_create(&plan, &cfg))) {
        cli_error("run --cp", rc);
    }
    int exit_code = 0;
    if (gdn_cp_agree_status(cp, rc)) {
        exit_code = 1;
        goto done;
    }
    gdn_cp_set_fault(cp, fault);
    rc = gdn_cp_forward(cp, plan, o, ht, s_in, pb.q, pb.k, pb.v, pb.g, pb.beta, pb.h0);
    if (!rc) fs = gdn_cp_last_stats(cp);
    if (!rc && backward)
        rc = gdn_cp_backward(cp, plan, gq, gk, gv, gg, gb, gs, pb.q, pb.k, pb.v, pb.g, pb.beta, pb.h0,
                             s == GDN_CP_HEADS ? NULL : s_in, pb.dout, pb.dht);
    if (!rc && backward) bs = gdn_cp_last_stats(cp);
    const double wall = MPI_Wtime() - t_start;
    /* the peak so far: this rank's inputs, outputs and workspace (before --stats' own forward) */
    struct rusage ru;
    const double rss_mib = getrusage(RUSAGE_SELF, &ru) ? -1 : ru.ru_maxrss / 1024.0;
    exit_code = rc ? cli_error("run --cp", rc) : 0;
    if (!exit_code && stats) { /* rank 0 prints every rank's accounting */
        /* The incoming state's effect: this shard's outputs again from a zero state (rank 0's
         * incoming state comes from no other rank: 0 by definition; -1: could not compute). */
        double in_rel = 0, in_reach = 0;
        if (rank) {
            float *o0 = malloc(sizeof(float) * nv);
            if (o0 && gdn_forward(plan, o0, NULL, pb.q, pb.k, pb.v, pb.g, pb.beta, NULL) == GDN_OK)
                incoming_effect(o, o0, cfg.B, cfg.T, cfg.Hv * cfg.V, &in_rel, &in_reach);
            else
                in_rel = in_reach = -1;
            free(o0);
        }
        enum { NV = 15 };
        double mine[NV] = {fs.fold_s, fs.comm_s, fs.replay_s, (double)fs.bytes_sent, (double)fs.bytes_recv, fs.rounds,
                           bs.fold_s, bs.comm_s, bs.replay_s, (double)bs.bytes_sent, (double)bs.bytes_recv, bs.rounds,
                           in_rel, in_reach, rss_mib};
        double *all = rank ? NULL : malloc(sizeof(double) * NV * D);
        MPI_Gather(mine, NV, MPI_DOUBLE, all, NV, MPI_DOUBLE, 0, MPI_COMM_WORLD);
        if (!rank && all) {
            fprintf(stderr, "gdncp run --cp %s: D=%d T=%lld wall %.3f s\n", strategy, D, T, wall);
            fprintf(stderr, "rank dir      fold_s   comm_s  replay_s   sent_B     recv_B   rounds    in_rel  in_reach  rss_MiB\n");
            for (int r = 0; r < D; r++)
                for (int d = 0; d < 1 + backward; d++) {
                    const double *x = all + NV * r + 6 * d;
                    fprintf(stderr, "%4d %-8s %7.4f %8.4f %9.4f %10.0f %10.0f %6.0f", r, d ? "backward" : "forward",
                            x[0], x[1], x[2], x[3], x[4], x[5]);
                    if (d) fprintf(stderr, "\n");
                    else if (all[NV * r + 12] < 0) fprintf(stderr, "       n/a       n/a %8.0f\n", all[NV * r + 14]);
                    else fprintf(stderr, " %9.2e %9.0f %8.0f\n", all[NV * r + 12], all[NV * r + 13], all[NV * r + 14]);
                }
            fprintf(stderr, "in_rel: max|o - o_from_zero_state| / max|o| over the rank's shard (how much the state coming "
                            "from the earlier ranks changes its outputs); in_reach: its first tokens where that change "
                            "exceeds 1e-5 max|o|; rss_MiB: the rank's peak resident memory after the run (getrusage), "
                            "before --stats' own extra forward\n");
        }
        free(all);
    }
    /* Each rank writes its own rows of the one output file at their offsets (no rank holds the
     * whole output, no 32-bit count), in the single-rank layout and metadata, so the file equals
     * a single-rank run's byte for byte where the numbers do. */
    if (!exit_code) {
        rc = cli_cp_write_rows(cp, out, "gdncp run", cfg.B, pb.T_full, t0, cfg.T, (const cli_out_tensor[]){
            {"o", 4, {cfg.B, pb.T_full, cfg.Hv, cfg.V}, 1, o},
            {"ht", 4, {state_rows, cfg.Hv, cfg.K, cfg.V}, 0, ht},
            {"dq", 4, {cfg.B, pb.T_full, cfg.Hk, cfg.K}, 1, gq},
            {"dk", 4, {cfg.B, pb.T_full, cfg.Hk, cfg.K}, 1, gk},
            {"dv", 4, {cfg.B, pb.T_full, cfg.Hv, cfg.V}, 1, gv},
            {"dg", 3, {cfg.B, pb.T_full, cfg.Hv}, 1, gg},
            {"dbeta", 3, {cfg.B, pb.T_full, cfg.Hv}, 1, gb},
            {"dh0", 4, {state_rows, cfg.Hv, cfg.K, cfg.V}, 0, backward && pb.h0 ? gs : NULL}}, backward ? 8 : 2, NULL, NULL);
        if (!rc && !rank)
            fprintf(stderr, "gdncp run --cp %s: D=%d B=%lld T=%lld Hk=%lld Hv=%lld K=%lld V=%lld %s%.3f s -> %s\n",
                    strategy, D, (long long)cfg.B, (long long)pb.T_full, (long long)cfg.Hk, (long long)cfg.Hv,
                    (long long)cfg.K, (long long)cfg.V, backward ? "forward+backward " : "", wall, out);
        if (rc && !strstr(gdn_errmsg(), "see its message")) exit_code = cli_error("run --cp", rc);
        else if (rc) exit_code = 1;
    }
done:
    gdn_cp_destroy(cp);
    gdn_plan_destroy(plan);
    free(o), free(ht), free(s_in), free(gq), free(gk), free(gv), free(gg), free(gb), free(gs);
    gdn_problem_free(&pb);
    free(cu);
    return exit_code;
}
