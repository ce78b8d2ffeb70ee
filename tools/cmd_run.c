/* gdncp run: read q, k, v, g, beta [, h0] from a safetensors file, write o and ht; with --cp the
 * sequence is split over the MPI ranks (every rank reads only its own token slice and writes its
 * own rows of the single-rank layout). */
#include "cli/cli.h"
#include "cli/parse.h"
#include "commands.h"
#include "gdncp/cp.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

typedef struct {
    const char *in, *out;
    int64_t chunk, threads;
    double scale;
    int no_l2norm, reference, backward, stats;
    const char *cp, *shards;
    int64_t *cu_seqlens, n_cu; /* --cu-seqlens as given (n_cu values), NULL when absent */
} run_opts;

/* gdncp run --cp: the options that every rank must agree on. */
typedef struct {
    const char *in, *out, *strategy, *shards;
    int backward, stats;
    const int64_t *cu_seqlens; /* --cu-seqlens (n_cu values), NULL when not given */
    int64_t n_cu;
} cli_cp_opts;
static int run_cp(const cli_cp_opts *co, gdn_config opts);


static void run_init(void *p) { ((run_opts *)p)->chunk = 64; }

static const cli_opt run_table[] = {
    {CLI_STR("--in", run_opts, in, "F", "the problem file (q k v g beta [h0], with --backward do [dht])"), .req = 1},
    {CLI_STR("--out", run_opts, out, "F", "the output file"), .req = 1},
    {CLI_I64("--chunk", run_opts, chunk, 16, 128, "C", "the kernel's chunk size: 16, 32, 64 or 128")},
    /* positive: q's scale; far outside [1e-6, 1e6] it only makes the fp32 outputs underflow or overflow */
    {CLI_F64("--scale", run_opts, scale, 1e-6, 1e6, "S", "the scale multiplying q after the norm"), .dflt = "1/sqrt(K)"},
    {CLI_FLAG("--no-l2norm", run_opts, no_l2norm, "use q and k as given (the in-kernel L2 norm is on by default, as in Qwen)")},
    {CLI_FLAG("--reference", run_opts, reference, "run the float64 oracle instead of the fp32 kernel (results rounded to F32); not with --cp")},
    {CLI_I64("--threads", run_opts, threads, 0, 4096, "N", "OpenMP threads (0: all)"), .dflt = "all"},
    {CLI_FLAG("--backward", run_opts, backward, "also read do [dht] and write dq dk dv dg dbeta [dh0]")},
    {CLI_LIST("--cu-seqlens", run_opts, cu_seqlens, n_cu, "0,a,..,T", "packed documents (B = 1; or a cu_seqlens tensor in the input); h0 ht dht dh0 per document")},
    {CLI_STR("--cp", run_opts, cp, "scan|allgather|relay|heads", "under mpiexec: split the sequence over the ranks with this strategy (heads: the rank count must divide Hk)")},
    {CLI_STR("--shards", run_opts, shards, "a,b,..", "with --cp: each rank's token count (D positive sizes summing to T; default an even split)")},
    {CLI_FLAG("--stats", run_opts, stats, "with --cp: print each rank's accounting")},
};

const cli_command cmd_run_cli = {
    .name = "run",
    .usage = "usage: gdncp run --in IN.safetensors --out OUT.safetensors [options]\n"
             "       mpiexec -n D gdncp run ... --cp scan|allgather|relay|heads [--shards a,b,..] [--stats]\n",
    .summary = "the gated delta rule forward (--backward: and its gradients) on a problem file",
    .about = "  the gated delta rule forward (q k v g beta [h0] from IN); --backward also reads do [dht] and\n"
             "  writes dq dk dv dg dbeta [dh0]; --cu-seqlens: packed documents (B = 1)\n",
    .size = sizeof(run_opts), .init = run_init, CLI_OPTS(run_table),
};

static double *to_f64(const float *x, int64_t n) {
    if (!x) return NULL;
    double *d = malloc(sizeof(double) * (n ? n : 1));
    if (d)
        for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

/* Rows of h0, ht, dht, dh0: one per document when packed, else one per batch row. */
static int64_t state_rows(const gdn_config *cfg) { return cfg->cu_seqlens ? cfg->n_docs : cfg->B; }

/* Gradient outputs of a run: the library's bundle (dh0 NULL when the problem has no h0). */
typedef gdn_rule_grads run_grads;

/* The problem's tensors as the rule's inputs. */
static gdn_rule_inputs problem_inputs(const gdn_problem *pb) {
    return (gdn_rule_inputs){.q = pb->q, .k = pb->k, .v = pb->v, .g = pb->g, .beta = pb->beta, .h0 = pb->h0};
}

static int reference_backward(const gdn_problem *pb, const gdn_config *cfg, const double *q,
                              const double *k, const double *v, const double *g,
                              const double *beta, const double *h0, run_grads *gr) {
    const int64_t nqk = cfg->B * cfg->T * cfg->Hk * cfg->K, nv = cfg->B * cfg->T * cfg->Hv * cfg->V,
                  ng = cfg->B * cfg->T * cfg->Hv, ns = state_rows(cfg) * cfg->Hv * cfg->K * cfg->V;
    double *dout = to_f64(pb->dout, nv), *dht = to_f64(pb->dht, ns);
    double *d[6];
    const int64_t sizes[6] = {nqk, nqk, nv, ng, ng, ns};
    float *outs[6] = {gr->dq, gr->dk, gr->dv, gr->dg, gr->dbeta, gr->dh0};
    int ok = dout && (!pb->dht || dht);
    for (int i = 0; i < 6; i++) ok &= (d[i] = malloc(sizeof(double) * (sizes[i] ? sizes[i] : 1))) != NULL;
    int rc = 1;
    if (!ok) fprintf(stderr, "gdncp run: out of memory for the double-precision backward\n");
    else if ((rc = gdn_reference_backward(cfg,
                                          &(gdn_rule_grads_f64){.dq = d[0], .dk = d[1], .dv = d[2],
                                                                .dg = d[3], .dbeta = d[4],
                                                                .dh0 = h0 ? d[5] : NULL},
                                          &(gdn_rule_inputs_f64){.q = q, .k = k, .v = v, .g = g,
                                                                 .beta = beta, .h0 = h0}, dout, dht)))
        rc = cli_error("run --reference --backward", rc);
    else
        for (int i = 0; i < 6; i++)
            for (int64_t j = 0; outs[i] && j < sizes[i]; j++) outs[i][j] = (float)d[i][j];
    for (int i = 0; i < 6; i++) free(d[i]);
    free(dout), free(dht);
    return rc;
}

/* The oracle in double, results rounded to f32 for the output file. */
static int run_reference(const gdn_problem *pb, const gdn_config *cfg, float *o, float *ht,
                         run_grads *gr) {
    const int64_t nqk = cfg->B * cfg->T * cfg->Hk * cfg->K, nv = cfg->B * cfg->T * cfg->Hv * cfg->V,
                  ng = cfg->B * cfg->T * cfg->Hv, ns = state_rows(cfg) * cfg->Hv * cfg->K * cfg->V;
    double *q = to_f64(pb->q, nqk), *k = to_f64(pb->k, nqk), *v = to_f64(pb->v, nv),
           *g = to_f64(pb->g, ng), *beta = to_f64(pb->beta, ng), *h0 = to_f64(pb->h0, ns),
           *od = malloc(sizeof(double) * nv), *hd = malloc(sizeof(double) * ns);
    int rc;
    if (!q || !k || !v || !g || !beta || (pb->h0 && !h0) || !od || !hd) {
        fprintf(stderr, "gdncp run: out of memory for the double-precision oracle\n");
        rc = 1;
    } else if ((rc = gdn_reference_forward(cfg, od, hd,
                                           &(gdn_rule_inputs_f64){.q = q, .k = k, .v = v, .g = g,
                                                                  .beta = beta, .h0 = h0}))) {
        rc = cli_error("run --reference", rc);
    } else {
        for (int64_t i = 0; i < nv; i++) o[i] = (float)od[i];
        for (int64_t i = 0; i < ns; i++) ht[i] = (float)hd[i];
        if (gr) rc = reference_backward(pb, cfg, q, k, v, g, beta, h0, gr);
    }
    free(q), free(k), free(v), free(g), free(beta), free(h0), free(od), free(hd);
    return rc;
}

/* Forward (and backward from the states the forward saved) on the fast path. */
static int run_fast(gdn_plan *plan, const gdn_problem *pb, float *o, float *ht, run_grads *gr) {
    const gdn_rule_inputs in = problem_inputs(pb);
    if (!gr) return gdn_forward(plan, o, ht, &in);
    float *ckpt = malloc(sizeof(float) * (cli_plan(plan).checkpoint_floats + 1));
    int rc = ckpt ? GDN_OK : GDN_ERR_NOMEM;
    if (!rc) rc = gdn_forward_save(plan, o, ht, ckpt, &in);
    if (!rc)
        rc = gdn_backward_saved(plan, gr, &in, ckpt, pb->dout, pb->dht);
    free(ckpt);
    return rc;
}

static int run_with(run_opts *opts, int argc, char **argv);

int cmd_run(int argc, char **argv) {
    run_opts opt;
    const int rc = run_with(&opt, argc, argv);
    cli_free(&cmd_run_cli, &opt);
    return rc;
}

static int run_with(run_opts *opts, int argc, char **argv) {
    run_opts opt;
    /* (under --cp, an option error here still joins the other ranks' first agreement; the
     * exit status is the usage error's on every rank: the job's is the largest) */
    int bad_usage = cli_parse(&cmd_run_cli, argc, argv, opts, NULL);
    opt = *opts;
    if (!bad_usage && opt.chunk != 16 && opt.chunk != 32 && opt.chunk != 64 && opt.chunk != 128) {
        fprintf(stderr, "gdncp run: --chunk must be 16, 32, 64 or 128, got %lld\n", (long long)opt.chunk);
        bad_usage = 1;
    }
    if (bad_usage) {
        cli_cp_fail_early(argc, argv);
        return CLI_USAGE_ERROR;
    }
    if (opt.cp) {
        if (opt.reference) {
            fprintf(stderr, "gdncp run: --reference and --cp cannot be combined\n");
            cli_cp_fail_early(argc, argv);
            return CLI_USAGE_ERROR;
        }
        gdn_config o = gdn_config_default(1, 1, 1, 1, 1, 1);
        o.chunk = (int)opt.chunk, o.threads = (int)opt.threads, o.scale = (float)opt.scale;
        o.l2norm = !opt.no_l2norm;
        const cli_cp_opts co = {opt.in, opt.out, opt.cp, opt.shards, opt.backward, opt.stats,
                                opt.cu_seqlens, opt.n_cu};
        return run_cp(&co, o);
    }
    if (opt.shards || opt.stats) {
        fprintf(stderr, "gdncp run: --shards and --stats need --cp STRATEGY\n");
        return CLI_USAGE_ERROR;
    }
    /* Inputs and outputs together, before loading: the loader alone checks only the inputs. A
     * lower bound (states and the plan come on top); the oracle holds all of it again in double. */
    long long T_file;
    double per_token;
    int rc = cli_run_header(opt.in, opt.backward, &T_file, &per_token);
    if (rc) return 1;
    if ((rc = gdn_check_fits(opt.reference ? "the inputs and outputs in float and double (--reference)"
                                           : "the inputs and outputs", per_token * (double)T_file * (opt.reference ? 3 : 1))))
        return cli_error("run", rc);
    int64_t *cu = NULL, n_docs = 0; /* packed documents: --cu-seqlens or the file's tensor */
    if (cli_pack_offsets("gdncp run", opt.in, "q", opt.cu_seqlens, opt.n_cu, &cu, &n_docs)) return 1;
    gdn_problem pb;
    rc = gdn_problem_load(&pb, opt.in, opt.backward, 0, -1, n_docs);
    if (rc) {
        free(cu);
        return cli_error("run", rc);
    }
    gdn_config cfg = pb.cfg;
    cfg.cu_seqlens = cu, cfg.n_docs = n_docs;
    cfg.chunk = (int)opt.chunk;
    cfg.threads = (int)opt.threads;
    cfg.scale = (float)opt.scale;
    cfg.l2norm = !opt.no_l2norm;
    const int64_t nv = cfg.B * cfg.T * cfg.Hv * cfg.V, ns = state_rows(&cfg) * cfg.Hv * cfg.K * cfg.V;
    const int64_t nqk = cfg.B * cfg.T * cfg.Hk * cfg.K, ng = cfg.B * cfg.T * cfg.Hv;
    float *o = malloc(sizeof(float) * nv), *ht = malloc(sizeof(float) * ns);
    run_grads gr = {0};
    if (opt.backward) {
        gr.dq = malloc(sizeof(float) * nqk), gr.dk = malloc(sizeof(float) * nqk);
        gr.dv = malloc(sizeof(float) * nv), gr.dg = malloc(sizeof(float) * ng);
        gr.dbeta = malloc(sizeof(float) * ng);
        gr.dh0 = pb.h0 ? malloc(sizeof(float) * ns) : NULL;
    }
    int exit_code = 0;
    const char *path = "oracle-f64";
    double t0 = cli_now();
    if (!o || !ht || (opt.backward && (!gr.dq || !gr.dk || !gr.dv || !gr.dg || !gr.dbeta ||
                                       (pb.h0 && !gr.dh0)))) {
        fprintf(stderr, "gdncp run: out of memory for outputs\n");
        exit_code = 1;
    } else if (opt.reference) {
        exit_code = run_reference(&pb, &cfg, o, ht, opt.backward ? &gr : NULL);
    } else {
        gdn_plan *plan = NULL;
        if ((rc = gdn_plan_create(&plan, &cfg)) ||
            (rc = run_fast(plan, &pb, o, ht, opt.backward ? &gr : NULL)))
            exit_code = cli_error("run", rc);
        else
            path = cli_plan(plan).path;
        gdn_plan_destroy(plan);
    }
    double secs = cli_now() - t0;
    if (!exit_code) {
        const gdn_named_tensor out[] = {
            {"o", 4, {cfg.B, cfg.T, cfg.Hv, cfg.V}, o},
            {"ht", 4, {state_rows(&cfg), cfg.Hv, cfg.K, cfg.V}, ht},
            {"dq", 4, {cfg.B, cfg.T, cfg.Hk, cfg.K}, gr.dq},
            {"dk", 4, {cfg.B, cfg.T, cfg.Hk, cfg.K}, gr.dk},
            {"dv", 4, {cfg.B, cfg.T, cfg.Hv, cfg.V}, gr.dv},
            {"dg", 3, {cfg.B, cfg.T, cfg.Hv}, gr.dg},
            {"dbeta", 3, {cfg.B, cfg.T, cfg.Hv}, gr.dbeta},
            {"dh0", 4, {state_rows(&cfg), cfg.Hv, cfg.K, cfg.V}, gr.dh0}};
        if ((rc = gdn_save_tensors(opt.out, out, 8, "gdncp run")))
            exit_code = cli_error("run", rc);
        else
            fprintf(stderr,
                    "gdncp run: B=%lld T=%lld Hk=%lld Hv=%lld K=%lld V=%lld chunk=%d%s%.0lld path=%s "
                    "%.3f ms -> %s\n",
                    (long long)cfg.B, (long long)cfg.T, (long long)cfg.Hk, (long long)cfg.Hv,
                    (long long)cfg.K, (long long)cfg.V, cfg.chunk, cu ? " documents=" : "", (long long)n_docs, path,
                    secs * 1e3, opt.out);
    }
    free(o), free(ht), free(gr.dq), free(gr.dk), free(gr.dv), free(gr.dg), free(gr.dbeta), free(gr.dh0);
    gdn_problem_free(&pb);
    free(cu);
    return exit_code;
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

static int run_cp(const cli_cp_opts *co, gdn_config opts) {
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
    gdn_cp *cp = NULL;
    if (gdn_cp_create(&cp, MPI_COMM_WORLD)) return cli_error("run --cp", GDN_ERR_MPI);
    /* Each rank reads the header of its own file: T must agree too. */
    long long T = -1;
    double per_token = 0;
    if (!local) local = cli_run_header(in, backward, &T, &per_token);
    static const char *const names[] = {"--cp (0 scan, 1 allgather, 2 relay, 3 heads)", "--backward", "--stats",
                                        "--shards (the lists differ; values are hashes)",
                                        "T of the input file",
                                        "--out (rank 0 writes every rank's rows there; the paths differ, values are hashes)"};
    const int64_t vals[6] = {s, backward, stats, cli_hash(shards), T, cli_hash(out)};
    int reported = 0;
    int rc = cli_cp_agree_first(cp, "run --cp", vals, 6, names, local, &reported);
    if (rc) {
        gdn_cp_destroy(cp);
        return 1;
    }
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
    rc = gdn_problem_load(&pb, in, backward, t0, tn, n_docs);
    if (rc) cli_error("run --cp", rc);
    rc = gdn_cp_agree_status(cp, rc);
    if (!rc) { /* the problem's shapes and options, and the states every rank holds whole (h0, dht), before
                * any exchange: ranks given different files or options stop here naming the difference */
        static const char *const pnames[] = {"B of the input file", "Hk of the input file", "Hv of the input file",
                                             "K of the input file", "V of the input file", "--scale (0 is 1/sqrt(K)) (its bits)",
                                             "--no-l2norm (0: L2 norm of q and k)", "--chunk",
                                             "dht of the input file (a digest; 0: none)"};
        const gdn_config *pc = &pb.cfg;
        const size_t state_bytes = sizeof(float) * (size_t)((cu ? n_docs : pc->B) * pc->Hv * pc->K * pc->V);
        const int64_t pvals[9] = {pc->B, pc->Hk, pc->Hv, pc->K, pc->V, cli_f64_bits(opts.scale), !opts.l2norm, opts.chunk,
                                  gdn_cp_digest(pb.dht, pb.dht ? state_bytes : 0)};
        rc = cli_cp_agree_weights(cp, "run --cp", pvals, pnames, 9, pb.h0, pb.h0 ? state_bytes : 0,
                                  "h0 of the input file (a digest; 0: none)");
    }
    if (rc) {
        gdn_problem_free(&pb);
        free(cu);
        gdn_cp_destroy(cp);
        return 1;
    }
    gdn_config cfg = pb.cfg;
    cfg.chunk = opts.chunk, cfg.threads = opts.threads, cfg.scale = opts.scale, cfg.l2norm = opts.l2norm;
    cfg.cp = s;
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
    const gdn_rule_inputs rin = problem_inputs(&pb);
    rc = gdn_cp_forward(cp, plan, o, ht, s_in, &rin);
    if (!rc) fs = gdn_cp_last_stats(cp);
    const gdn_rule_grads gr = {.dq = gq, .dk = gk, .dv = gv, .dg = gg, .dbeta = gb, .dh0 = gs}; /* dh0: ds_in */
    if (!rc && backward) rc = gdn_cp_backward(cp, plan, &gr, &rin, s == GDN_CP_HEADS ? NULL : s_in, pb.dout, pb.dht);
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
            const gdn_rule_inputs from_zero = {.q = pb.q, .k = pb.k, .v = pb.v, .g = pb.g, .beta = pb.beta};
            if (o0 && gdn_forward(plan, o0, NULL, &from_zero) == GDN_OK)
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
