/* gdncp run: read q, k, v, g, beta [, h0] from a safetensors file, write o and ht. */
#include "cli.h"
#include "cli_parse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *in, *out;
    int64_t chunk, threads;
    double scale;
    int no_l2norm, reference, backward, stats;
    const char *cp, *shards, *fault;
    int64_t *cu_seqlens, n_cu; /* --cu-seqlens as given (n_cu values), NULL when absent */
} run_opts;


static int parse(int argc, char **argv, run_opts *o) {
    memset(o, 0, sizeof *o);
    o->chunk = 64;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--in") && val) o->in = argv[++i];
        else if (!strcmp(a, "--out") && val) o->out = argv[++i];
        else if (!strcmp(a, "--chunk")) {
            if (cli_parse_i64("run", a, val, 16, 128, &o->chunk)) return 1;
            i++;
        } else if (!strcmp(a, "--threads")) { /* 0: all of OpenMP's threads */
            if (cli_parse_i64("run", a, val, 0, 4096, &o->threads)) return 1;
            i++;
        } else if (!strcmp(a, "--scale")) {
            /* positive: q's scale (1/sqrt(K) by default); far outside [1e-6, 1e6] it only makes
             * the fp32 outputs underflow or overflow */
            if (cli_parse_f64("run", a, val, 1e-6, 1e6, &o->scale)) return 1;
            i++;
        } else if (!strcmp(a, "--no-l2norm")) o->no_l2norm = 1;
        else if (!strcmp(a, "--reference")) o->reference = 1;
        else if (!strcmp(a, "--backward")) o->backward = 1;
        else if (!strcmp(a, "--stats")) o->stats = 1;
        else if (!strcmp(a, "--cu-seqlens")) {
            free(o->cu_seqlens);
            if (cli_parse_i64_list("run", a, val, &o->cu_seqlens, &o->n_cu)) return 1;
            i++;
        } else if (!strcmp(a, "--cp") && val) o->cp = argv[++i];
        else if (!strcmp(a, "--shards") && val) o->shards = argv[++i];
        else if (!strcmp(a, "--fault") && val) {
            /* testing only (negative controls): deliberately wrong results, see cmd_run_cp.c */
            if (strcmp(val, "drop-incoming")) {
                fprintf(stderr, "gdncp run: --fault knows only 'drop-incoming' (a testing hook), got '%s'\n", val);
                return 1;
            }
            o->fault = argv[++i];
        }
        else {
            fprintf(stderr, "gdncp run: unknown or incomplete option '%s'\n", a);
            return 1;
        }
    }
    if (!o->in || !o->out) {
        fprintf(stderr, "gdncp run: --in and --out are required\n");
        return 1;
    }
    return 0;
}

int cli_pack_offsets(const char *who, const char *path, const char *rows, const int64_t *given, int64_t n_given,
                     int64_t **cu, int64_t *n_docs) {
    *cu = NULL, *n_docs = 0;
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, path);
    if (rc) {
        fprintf(stderr, "%s: %s: %s\n", who, gdn_strerror(rc), gdn_errmsg());
        return 1;
    }
    const gdn_st_tensor *t = gdn_st_find(f, "cu_seqlens"), *tq = gdn_st_find(f, rows);
    /* (the caller has checked the rows tensor: run's q, layer's x) */
    const int64_t B = tq && tq->ndim >= 2 ? tq->shape[0] : 0, T = tq && tq->ndim >= 2 ? tq->shape[1] : 0;
    int64_t *from_file = NULL, n_file = 0;
    if (t) {
        /* (a 1-D tensor's length is its shape; anything else is refused by the reader) */
        const size_t cap = t->ndim == 1 ? (size_t)t->shape[0] : 1;
        if (!(from_file = malloc(sizeof(int64_t) * (cap ? cap : 1))))
            rc = GDN_ERR_NOMEM, fprintf(stderr, "%s: out of memory for %s's cu_seqlens (%zu values)\n", who, path, cap);
        else if ((rc = gdn_st_read_i64(f, "cu_seqlens", from_file, cap, &n_file)))
            fprintf(stderr, "%s: %s: %s\n", who, gdn_strerror(rc), gdn_errmsg());
    }
    gdn_st_close(f);
    if (rc) {
        free(from_file);
        return 1;
    }
    if (given && from_file && (n_given != n_file || memcmp(given, from_file, sizeof(int64_t) * n_file))) {
        fprintf(stderr, "%s: --cu-seqlens (%lld values) differs from the cu_seqlens tensor in %s (%lld values)%s\n",
                who, (long long)n_given, path, (long long)n_file,
                n_given == n_file ? ": the same count, different offsets" : "");
        free(from_file);
        return 1;
    }
    const int64_t *c = given ? given : from_file, n = given ? n_given : n_file;
    const char *src = given ? "--cu-seqlens" : "the file's cu_seqlens";
    if (!c) return 0; /* dense */
    /* The library checks these too; here the message can say where the offsets came from. */
    const char *bad = NULL;
    int64_t at = 0;
    if (n < 2) bad = "needs at least two offsets (0 and T: one document)";
    else if (c[0] != 0) bad = "must start at 0";
    else if (B != 1) bad = "needs B = 1 (one packed stream)";
    for (at = 0; !bad && at + 1 < n; at++)
        if (c[at + 1] <= c[at]) bad = "must be strictly increasing (no empty document)";
    if (!bad && c[n - 1] != T) bad = "must end at T";
    if (bad) {
        fprintf(stderr, "%s: %s %s: got", who, src, bad);
        for (int64_t i = 0; i < n && i < 16; i++) fprintf(stderr, "%s%lld", i ? "," : " ", (long long)c[i]);
        fprintf(stderr, "%s", n > 16 ? ",..." : "");
        if (!strcmp(bad, "needs B = 1 (one packed stream)")) fprintf(stderr, " with B = %lld in %s", (long long)B, path);
        else if (!strcmp(bad, "must end at T")) fprintf(stderr, " (T = %lld in %s)", (long long)T, path);
        else if (at > 0) fprintf(stderr, " (entries %lld and %lld)", (long long)(at - 1), (long long)at);
        fprintf(stderr, "\n");
        free(from_file);
        return 1;
    }
    *cu = malloc(sizeof(int64_t) * n);
    if (!*cu) {
        fprintf(stderr, "%s: out of memory for %lld offsets\n", who, (long long)n);
        free(from_file);
        return 1;
    }
    memcpy(*cu, c, sizeof(int64_t) * n);
    *n_docs = n - 1;
    free(from_file);
    return 0;
}

int cli_run_header(const char *path, int backward, long long *T, double *bytes_per_token) {
    gdn_st_file *f = NULL;
    const gdn_st_tensor *tq, *tv;
    int rc = gdn_st_open(&f, path);
    if (rc) {
        cli_error("run", rc);
        return rc;
    }
    if (!(tq = gdn_st_find(f, "q")) || tq->ndim != 4) {
        fprintf(stderr, "gdncp run: %s has no 4-D tensor 'q'\n", path);
        gdn_st_close(f);
        return GDN_ERR_MISSING;
    }
    /* (a malformed v is left to the loader to name: it only makes the estimate smaller) */
    const double qk = (double)tq->shape[2] * (double)tq->shape[3];
    double v = 0, g = 0;
    if ((tv = gdn_st_find(f, "v")) && tv->ndim == 4) v = (double)tv->shape[2] * (double)tv->shape[3], g = (double)tv->shape[2];
    const double in = 2 * qk + v + 2 * g + (backward ? v : 0), out = v + (backward ? 2 * qk + v + 2 * g : 0);
    *T = tq->shape[1];
    *bytes_per_token = 4.0 * (double)tq->shape[0] * (in + out);
    gdn_st_close(f);
    return GDN_OK;
}

static double *to_f64(const float *x, int64_t n) {
    if (!x) return NULL;
    double *d = malloc(sizeof(double) * (n ? n : 1));
    if (d)
        for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

/* Rows of h0, ht, dht, dh0: one per document when packed, else one per batch row. */
static int64_t state_rows(const gdn_config *cfg) { return cfg->cu_seqlens ? cfg->n_docs : cfg->B; }

/* Gradient outputs of a run (NULL when not asked for). */
typedef struct {
    float *dq, *dk, *dv, *dg, *dbeta, *dh0;
} run_grads;

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
    else if ((rc = gdn_reference_backward(cfg, d[0], d[1], d[2], d[3], d[4], h0 ? d[5] : NULL, q, k,
                                          v, g, beta, h0, dout, dht)))
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
    } else if ((rc = gdn_reference_forward(cfg, od, hd, q, k, v, g, beta, h0))) {
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
    if (!gr) return gdn_forward(plan, o, ht, pb->q, pb->k, pb->v, pb->g, pb->beta, pb->h0);
    float *ckpt = malloc(sizeof(float) * (gdn_plan_checkpoint_floats(plan) + 1));
    int rc = ckpt ? GDN_OK : GDN_ERR_NOMEM;
    if (!rc) rc = gdn_forward_save(plan, o, ht, ckpt, pb->q, pb->k, pb->v, pb->g, pb->beta, pb->h0);
    if (!rc)
        rc = gdn_backward_saved(plan, gr->dq, gr->dk, gr->dv, gr->dg, gr->dbeta, gr->dh0, pb->q, pb->k,
                                pb->v, pb->g, pb->beta, pb->h0, ckpt, pb->dout, pb->dht);
    free(ckpt);
    return rc;
}

static int run_with(run_opts *opts, int argc, char **argv);

int cmd_run(int argc, char **argv) {
    run_opts opt;
    const int rc = run_with(&opt, argc, argv);
    free(opt.cu_seqlens);
    return rc;
}

static int run_with(run_opts *opts, int argc, char **argv) {
    run_opts opt;
    /* (under --cp, an option error here still joins the other ranks' first agreement; the
     * exit status is the usage error's on every rank: the job's is the largest) */
    int bad_usage = parse(argc, argv, opts);
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
        const cli_cp_opts co = {opt.in, opt.out, opt.cp, opt.shards, opt.fault, opt.backward, opt.stats,
                                opt.cu_seqlens, opt.n_cu};
        return cmd_run_cp(&co, o);
    }
    if (opt.shards || opt.stats || opt.fault) {
        fprintf(stderr, "gdncp run: --shards, --stats and --fault need --cp STRATEGY\n");
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
    rc = gdn_problem_load_packed(&pb, opt.in, opt.backward, 0, -1, n_docs);
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
            path = gdn_plan_path(plan);
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
