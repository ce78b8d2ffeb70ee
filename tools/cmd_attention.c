/* gdncp attention: Qwen3.5's gated full-attention layer (`self_attn`) from a Hugging Face
 * checkpoint on x [B,T,E] (or [T,E]): y, and with --backward dx and grad.<weight> for
 * loss = sum(y * dy). Positions: 0..T-1 plus --position-offset, or what the input's position_ids
 * say (an offset per row, or restarts at document starts: packed), or packed documents from
 * --cu-seqlens / a cu_seqlens tensor. Under mpiexec with --cp kv|heads every rank reads only its
 * token rows and writes them into the one output file, which equals the single-rank one.
 * --decode N prefills all but the last N tokens into a KV cache, then decodes them one by one. */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"
#include "gdncp/cp.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int reported; /* a failure of the tool itself, already printed */

/* Print a failure of the tool's own checks now and return its status. */
static int fail(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "gdncp attention: %s: ", gdn_strerror(status));
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    reported = 1;
    return status;
}

typedef struct {
    const char *weights, *config, *prefix, *in, *out, *cp, *shards;
    int backward, decode, stats, threads;
    int compute;               /* --compute: GDN_COMPUTE_FP32 or GDN_COMPUTE_BF16 */
    int recompute, keep_flag;  /* --recompute: the backward recomputes the forward; keep_flag: one was given */
    int64_t pos_offset;
    int pos_given;             /* --position-offset was given */
    int64_t *cu_seqlens, n_cu; /* --cu-seqlens as given (n_cu values), NULL when absent */
} attn_opts;

static const cli_opt attn_table[] = {
    {CLI_STR("--weights", attn_opts, weights, "W", "the weights, bare (q_proj.weight, ...) or under --prefix"), .req = 1},
    {CLI_STR("--config", attn_opts, config, "C", "a config.json (fields at the top level or under text_config)")},
    {CLI_STR("--prefix", attn_opts, prefix, "P", "e.g. model.layers.3.self_attn. in a whole-model model.safetensors; other tensors are ignored")},
    {CLI_STR("--in", attn_opts, in, "F", "the input file: x [B,T,E] or [T,E] (and dy with --backward; optionally position_ids, cu_seqlens)"), .req = 1},
    {CLI_STR("--out", attn_opts, out, "F", "the output file"), .req = 1},
    {CLI_FLAG("--backward", attn_opts, backward, "also compute dx and the weight gradients")},
    {CLI_SET("--keep-saved", attn_opts, recompute, 0, "with --backward: the backward uses what the forward kept (the default: the projections, the attention output before the gate and the log-sum-exp)")},
    {CLI_FLAG("--recompute", attn_opts, recompute, "with --backward: the backward recomputes the forward (less memory)")},
    /* (at most T, checked once T is known) */
    {CLI_I64("--decode", attn_opts, decode, 1, INT32_MAX, "N", "prefill all but the last N tokens into a KV cache, then decode those one token at a time (N <= T); not with --backward or packed documents"), .dflt = ""},
    /* the library's bound on pos_offset */
    {CLI_I64("--position-offset", attn_opts, pos_offset, 0, (int64_t)1 << 40, "P", "the position of token 0 of every row"), .dflt = "0, or what position_ids say"},
    {CLI_LIST("--cu-seqlens", attn_opts, cu_seqlens, n_cu, "0,a,..,T", "packed documents (B = 1), or a cu_seqlens tensor beside x")},
    {CLI_I64("--threads", attn_opts, threads, 1, 4096, "N", "OpenMP threads"), .dflt = "all"},
    {CLI_COMPUTE("--compute", attn_opts, compute, "the precision of q/k/v_proj and o_proj, as for gdncp layer (the core, norms and RoPE stay fp32)")},
    {CLI_STR("--cp", attn_opts, cp, "kv|heads", "under mpiexec: the tokens split over the ranks; kv: keys and values travel to the later ranks (any D); heads: an all-to-all to head-parallel for the core (D must divide H)")},
    {CLI_STR("--shards", attn_opts, shards, "a,b,..", "with --cp: each rank's token count (default an even split)")},
    {CLI_FLAG("--stats", attn_opts, stats, "with --cp: every rank's attention compute and time in MPI, forward and backward, on rank 0's stderr")},
};

const cli_command cmd_attention_cli = {
    .name = "attention",
    .usage = "usage: gdncp attention --weights W.safetensors [--config config.json] [--prefix P]\n"
             "                       --in IN.safetensors --out OUT.safetensors [options]\n"
             "       mpiexec -n D gdncp attention ... --cp kv|heads [--shards a,b,..] [--stats]\n",
    .summary = "Qwen3.5's gated attention layer from a checkpoint (forward, backward, KV-cache decode, --cp)",
    .about = "  Qwen3.5's gated attention layer (positions also from position_ids in IN)\n",
    .size = sizeof(attn_opts), CLI_OPTS(attn_table),
};

static int parse(int argc, char **argv, attn_opts *o) {
    unsigned char seen[CLI_MAX_OPTS];
    if (cli_parse(&cmd_attention_cli, argc, argv, o, seen)) return CLI_USAGE_ERROR;
    o->pos_given = cli_given(&cmd_attention_cli, seen, "--position-offset");
    o->keep_flag = cli_given(&cmd_attention_cli, seen, "--keep-saved") || cli_given(&cmd_attention_cli, seen, "--recompute");
    if (o->decode && o->backward) {
        fprintf(stderr, "gdncp attention: --decode runs inference; it does not combine with --backward\n");
        return CLI_USAGE_ERROR;
    }
    if (!o->cp && (o->shards || o->stats)) {
        fprintf(stderr, "gdncp attention: --shards and --stats need --cp kv|heads (under mpiexec)\n");
        return CLI_USAGE_ERROR;
    }
    if (o->keep_flag && !o->backward) {
        fprintf(stderr, "gdncp attention: --keep-saved and --recompute choose what the backward uses; they need "
                        "--backward\n");
        return CLI_USAGE_ERROR;
    }
    return 0;
}

/* ------------------------------------------------------------------ positions */

/* The layer's positions from every source that states them: --position-offset (given), the
 * position_ids tensor (pos, may be NULL) and the packed offsets (cu from --cu-seqlens or the
 * file's cu_seqlens, may be NULL). They must agree; *off and *cu, *n_docs get the result (cu
 * taken over or replaced). */
static int settle_positions(const attn_opts *o, const int64_t *pos, int64_t B, int64_t T, int64_t *off, int64_t **cu,
                            int64_t *n_docs) {
    *off = o->pos_offset;
    if (!pos) {
        if (*cu && o->pos_offset)
            return fail(GDN_ERR_ARG, "--position-offset %lld with packed documents: their positions restart at 0",
                        (long long)o->pos_offset);
        return GDN_OK;
    }
    int64_t poff = 0, *pcu = NULL, pdocs = 0;
    int rc = cli_positions_meaning("gdncp attention", pos, B, T, &poff, &pcu, &pdocs);
    if (rc) return reported = 1, rc;
    if (pcu) { /* packed by position_ids */
        if (o->pos_given && o->pos_offset)
            rc = fail(GDN_ERR_ARG, "--position-offset %lld, but position_ids restart at document starts (packed: "
                                   "positions from 0)", (long long)o->pos_offset);
        else if (*cu && (rc = cli_positions_match_documents("gdncp attention", T, 0, pcu, pdocs, *cu, *n_docs)))
            reported = 1;
        if (rc) {
            free(pcu);
            return rc;
        }
        free(*cu);
        *cu = pcu, *n_docs = pdocs, *off = 0;
        return GDN_OK;
    }
    if (o->pos_given && poff != o->pos_offset)
        return fail(GDN_ERR_ARG, "--position-offset %lld, but position_ids start at %lld", (long long)o->pos_offset,
                    (long long)poff);
    if (*cu && (rc = cli_positions_match_documents("gdncp attention", T, poff, NULL, 0, *cu, *n_docs)))
        return reported = 1, rc;
    *off = poff;
    return GDN_OK;
}

/* ------------------------------------------------------------------ inputs and outputs */

/* x (and dy) of the input file: [B, T, E] or [T, E] with E the layer's; rows [t0, t0 + tn) only. */
static int read_rows(gdn_st_file *f, const char *name, int ndim, int64_t E, int64_t t0, int64_t tn, int64_t B,
                     int64_t T, float **out) {
    const gdn_st_tensor *t = gdn_st_find(f, name);
    if (!t) return fail(GDN_ERR_MISSING, "input file has no tensor '%s'", name);
    const int64_t tb = t->ndim == 3 ? t->shape[0] : 1, tt = t->ndim == 3 ? t->shape[1] : t->ndim == 2 ? t->shape[0] : 0;
    if (t->ndim != ndim || t->shape[ndim - 1] != E || tb != B || tt != T)
        return fail(GDN_ERR_SHAPE, "'%s' must be %s = [%lld, %lld, %lld] like x (E the layer's), got %d dims (last %lld)",
                    name, ndim == 3 ? "[B, T, E]" : "[T, E]", (long long)B, (long long)T, (long long)E, t->ndim,
                    (long long)(t->ndim ? t->shape[t->ndim - 1] : 0));
    const size_t n = (size_t)B * tn * E;
    *out = malloc(sizeof(float) * (n ? n : 1));
    if (!*out) return fail(GDN_ERR_NOMEM, "'%s' rows (%zu floats)", name, n);
    return ndim == 3 ? gdn_st_read(f, name, GDN_F32, *out, n, 1, t0, tn) : gdn_st_read(f, name, GDN_F32, *out, n, 0, t0, tn);
}

/* The weight gradients in the checkpoint's names: data on rank 0, reserved elsewhere. */
typedef struct {
    const gdn_attn_weights *aw;
    const float *dw;
} grads_ctx;
static int add_grads(gdn_st_writer *w, int rank, void *ctx) {
    const grads_ctx *g = ctx;
    return gdn_attn_grads_add(w, g->aw, rank ? NULL : g->dw, "grad.");
}

static int write_outputs(const attn_opts *o, const gdn_attn_weights *aw, int ndim, int64_t B, int64_t T,
                         const float *y, const float *dx, const float *dw) {
    gdn_st_writer *wr = NULL;
    const int64_t s3[3] = {B, T, aw->cfg.E}, s2[2] = {T, aw->cfg.E};
    const int64_t *shape = ndim == 3 ? s3 : s2;
    int rc = gdn_st_writer_create(&wr);
    if (!rc) rc = gdn_st_writer_metadata(wr, "producer", "gdncp attention");
    if (!rc) rc = gdn_st_writer_add(wr, "y", GDN_F32, ndim, shape, y, GDN_F32);
    if (!rc && dx) rc = gdn_st_writer_add(wr, "dx", GDN_F32, ndim, shape, dx, GDN_F32);
    if (!rc && dw) rc = gdn_attn_grads_add(wr, aw, dw, "grad.");
    if (!rc) rc = gdn_st_writer_save(wr, o->out);
    gdn_st_writer_destroy(wr);
    return rc;
}

/* Prefill T - N tokens into a KV cache, then decode the last N one at a time (B sequences): the
 * path a generating model takes, which must give the forward of the whole sequence. */
static int run_decode(const attn_opts *o, gdn_attn_config c, const float *w, const float *x, float *y) {
    const int64_t B = c.B, T = c.T, E = c.E, N = o->decode, T0 = T - N;
    if (N > T) /* (not clamped: a count larger than the sequence is a mistake, not a request) */
        return fail(GDN_ERR_ARG, "--decode %lld asks for more tokens than the input's T = %lld", (long long)N,
                    (long long)T);
    const int64_t piece = T0 > 1 ? T0 : 1;
    float *xt = malloc(sizeof(float) * (size_t)(B * piece * E)), *yt = malloc(sizeof(float) * (size_t)(B * piece * E));
    gdn_attn_cache *cache = NULL;
    gdn_attn_plan *plan = NULL;
    int rc = xt && yt ? gdn_attn_cache_create(&cache, B, c.Hkv, c.d, T, GDN_F32) : fail(GDN_ERR_NOMEM, "decode buffers");
    for (int phase = 0; phase < 2 && !rc; phase++) {
        const int64_t t_begin = phase ? T0 : 0, t_end = phase ? T : T0, step = phase ? 1 : T0;
        if (t_end <= t_begin) continue;
        c.T = step;
        if ((rc = gdn_attn_plan_create(&plan, &c))) break;
        for (int64_t t = t_begin; t < t_end && !rc; t += step) {
            for (int64_t b = 0; b < B; b++) memcpy(xt + b * step * E, x + (b * T + t) * E, sizeof(float) * step * E);
            rc = gdn_attn_decode(plan, cache, yt, xt, w);
            for (int64_t b = 0; b < B && !rc; b++) memcpy(y + (b * T + t) * E, yt + b * step * E, sizeof(float) * step * E);
        }
        gdn_attn_plan_destroy(plan), plan = NULL;
    }
    gdn_attn_cache_info ci;
    if (!rc && (rc = gdn_attn_cache_view(cache, &ci)) == GDN_OK && ci.length != T)
        rc = fail(GDN_ERR_ARG, "the KV cache holds %lld positions after %lld tokens", (long long)ci.length, (long long)T);
    gdn_attn_cache_destroy(cache);
    free(xt), free(yt);
    return rc;
}

/* The same over ranks: this rank's shard of the first T - N tokens (the plan's T, seq_offset)
 * prefilled by gdn_attn_cp_prefill into this rank's cache, then the last N tokens (xn: their rows,
 * on every rank) one at a time by gdn_attn_cp_decode, their keys kept on the last rank, whose
 * y rows (the last N of its share) receive them. */
static int run_cp_decode(gdn_cp *cp, const attn_opts *o, gdn_attn_config c, const float *w, const float *x,
                         const float *xn, float *y) {
    const int64_t B = c.B, E = c.E, N = o->decode, Tp = c.T, last = gdn_cp_rank(cp) == gdn_cp_size(cp) - 1;
    const int64_t tn = Tp + (last ? N : 0); /* the rows of y on this rank */
    float *xt = malloc(sizeof(float) * (size_t)(B * (Tp > 1 ? Tp : 1) * E)), *yt = malloc(sizeof(float) * (size_t)(B * (Tp > 1 ? Tp : 1) * E));
    float *xs = malloc(sizeof(float) * (size_t)(B * E));
    gdn_attn_cache *cache = NULL;
    gdn_attn_plan *plan = NULL;
    int rc = xt && yt && xs ? gdn_attn_cache_create(&cache, B, c.Hkv, c.d, tn, GDN_F32) : fail(GDN_ERR_NOMEM, "decode buffers");
    if (!rc) rc = gdn_attn_plan_create(&plan, &c);
    for (int64_t b = 0; b < B && !rc; b++) memcpy(xt + b * Tp * E, x + b * tn * E, sizeof(float) * Tp * E);
    rc = gdn_cp_agree_status(cp, rc);
    if (!rc) rc = gdn_attn_cp_prefill(cp, plan, cache, yt, xt, w);
    for (int64_t b = 0; b < B && !rc; b++) memcpy(y + b * tn * E, yt + b * Tp * E, sizeof(float) * Tp * E);
    gdn_attn_plan_destroy(plan), plan = NULL;
    c.T = 1, c.seq_offset = 0;
    if (!rc) rc = gdn_cp_agree_status(cp, gdn_attn_plan_create(&plan, &c));
    for (int64_t t = 0; t < N && !rc; t++) {
        for (int64_t b = 0; b < B; b++) memcpy(xs + b * E, xn + (b * N + t) * E, sizeof(float) * E);
        rc = gdn_attn_cp_decode(cp, plan, cache, yt, xs, w);
        for (int64_t b = 0; b < B && !rc && last; b++) memcpy(y + (b * tn + Tp + t) * E, yt + b * E, sizeof(float) * E);
    }
    gdn_attn_plan_destroy(plan);
    gdn_attn_cache_destroy(cache);
    free(xt), free(yt), free(xs);
    return rc;
}

/* Every rank's accounting on rank 0's stderr: the attention compute (replay_s) and the time in
 * MPI (comm_s) of the forward and the backward. Collective. */
static void print_stats(gdn_cp *cp, const attn_opts *o, const gdn_cp_stats *fs, const gdn_cp_stats *bs, int64_t t0,
                        int64_t tn, double wall) {
    enum { NV = 8 };
    const int rank = gdn_cp_rank(cp), D = gdn_cp_size(cp);
    const double mine[NV] = {(double)t0, (double)tn, fs->replay_s, fs->comm_s, (double)fs->bytes_sent,
                             bs->replay_s, bs->comm_s, (double)bs->bytes_sent};
    double *all = rank ? NULL : malloc(sizeof(double) * NV * D);
    MPI_Gather(mine, NV, MPI_DOUBLE, all, NV, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank || !all) return;
    fprintf(stderr, "gdncp attention --cp %s: D=%d wall %.3f s\n", o->cp, D, wall);
    fprintf(stderr, "rank   tokens        dir       replay_s   comm_s     sent_B\n");
    for (int r = 0; r < D; r++)
        for (int d = 0; d < 1 + o->backward; d++) {
            const double *x = all + NV * r;
            fprintf(stderr, "%4d %8.0f+%-6.0f %-9s %9.4f %8.4f %10.0f\n", r, x[0], x[1], d ? "backward" : "forward",
                    x[2 + 3 * d], x[3 + 3 * d], x[4 + 3 * d]);
        }
    fprintf(stderr, "replay_s: the attention core's compute on the rank; comm_s: its time inside MPI calls\n");
    free(all);
}

static int attention_with(attn_opts *o, int argc, char **argv);

int cmd_attention(int argc, char **argv) {
    attn_opts o;
    const int rc = attention_with(&o, argc, argv);
    cli_free(&cmd_attention_cli, &o);
    return rc;
}

static int attention_with(attn_opts *opts, int argc, char **argv) {
    const int prc = parse(argc, argv, opts);
    const attn_opts o = *opts;
    if (prc) { /* (under --cp, an option error still joins the other ranks' first agreement) */
        cli_cp_fail_early(argc, argv);
        return prc;
    }
    int rank = 0, D = 1, strategy = GDN_ATTN_CP_KV;
    gdn_cp *cp = NULL;
    if (o.cp) { /* (the strategy travels in the plan's config) */
        strategy = gdn_attn_cp_strategy_parse(o.cp);
        const int begun = cli_cp_begin("attention", o.cp, strategy, "kv, heads", argc, argv, &cp, &rank, &D);
        if (begun) return begun;
    }
    gdn_attn_weights aw;
    memset(&aw, 0, sizeof aw);
    gdn_st_file *f = NULL;
    float *x = NULL, *xdec = NULL, *dy = NULL, *y = NULL, *dx = NULL, *dw = NULL, *saved = NULL, *dw_all = NULL;
    int64_t *pos = NULL, *cu = NULL, n_docs = 0, pos_offset = 0;
    gdn_attn_plan *plan = NULL;
    gdn_cp_stats fs = {0}, bs = {0};
    int64_t B = 0, T = 0, t0 = 0, tn = 0;
    int ndim = 3;
    int rc = gdn_attn_weights_load(&aw, o.weights, o.config, o.prefix, NULL);
    if (!rc) rc = gdn_st_open(&f, o.in);
    if (!rc) { /* the file's B and T first, for the shard */
        const gdn_st_tensor *t = gdn_st_find(f, "x");
        if (!t) rc = fail(GDN_ERR_MISSING, "%s has no tensor 'x'", o.in);
        else if (t->ndim != 3 && t->ndim != 2) rc = fail(GDN_ERR_SHAPE, "'x' must be [B, T, E] or [T, E], got %d dims", t->ndim);
        else if (t->shape[t->ndim - 1] != aw.cfg.E)
            rc = fail(GDN_ERR_SHAPE, "'x' has width %lld, but the layer's hidden size E is %lld (%s)",
                      (long long)t->shape[t->ndim - 1], (long long)aw.cfg.E, o.weights);
        else ndim = t->ndim, B = ndim == 3 ? t->shape[0] : 1, T = ndim == 3 ? t->shape[1] : t->shape[0];
        if (!rc && (B < 1 || T < 1)) rc = fail(GDN_ERR_SHAPE, "'x' holds no tokens (B = %lld, T = %lld)", (long long)B, (long long)T);
    }
    if (!rc) { /* every rank checks its own file's offsets; a failure stops all in the agreement */
        char who[64];
        snprintf(who, sizeof who, rank ? "gdncp attention: rank %d" : "gdncp attention", rank);
        if (cli_pack_offsets(who, o.in, "x", o.cu_seqlens, o.n_cu, &cu, &n_docs)) rc = GDN_ERR_ARG, reported = 1;
    }
    if (!rc && (rc = cli_read_positions("gdncp attention", f, B, T, &pos))) reported = 1;
    if (!rc) rc = settle_positions(&o, pos, B, T, &pos_offset, &cu, &n_docs);
    if (!rc && cu && o.decode) /* the cache holds one stream per row */
        rc = fail(GDN_ERR_ARG, "--decode runs one sequence per row with a KV cache; it does not combine with packed "
                               "documents (--cu-seqlens, a cu_seqlens tensor or restarting position_ids in %s)", o.in);
    if (cp) { /* the agreement steps on everything that decides the collectives that follow */
        static const char *const names[] = {"--cp (0 kv, 1 heads)", "--backward", "--recompute", "--stats",
                                            "--shards (the lists differ; values are hashes)", "T of the input file",
                                            "--compute (0 fp32, 1 bf16)",
                                            "--out (rank 0 writes every rank's rows there; the paths differ, values are hashes)"};
        const int64_t vals[8] = {strategy, o.backward, o.recompute, o.stats, cli_hash(o.shards), T, o.compute, cli_hash(o.out)};
        rc = cli_cp_agree_first(cp, "attention", vals, 8, names, rc, &reported);
        if (!rc) {
            static const char *const more[] = {"B of the input file", "the position offset", "the packed documents",
                                               "their offsets (hashes)"};
            const int64_t vals2[4] = {B, pos_offset, n_docs, gdn_cp_digest(cu, cu ? sizeof *cu * (size_t)(n_docs + 1) : 0)};
            if ((rc = gdn_cp_agree_values(cp, vals2, 4, more, GDN_OK))) cli_error("attention", rc), reported = 1;
        }
        if (!rc) { /* the weights and their configuration, before any exchange (every rank loaded its own) */
            static const char *const wnames[] = {"hidden_size E (--weights / --config)", "num_attention_heads H",
                                                 "num_key_value_heads Hkv", "head_dim d", "the rotary dims R",
                                                 "rope_theta (its bits)", "rms_norm_eps (its bits)",
                                                 "max_position_embeddings"};
            const gdn_attn_config *wc = &aw.cfg;
            const int64_t wvals[8] = {wc->E, wc->H, wc->Hkv, wc->d, wc->R, cli_f64_bits(wc->rope_theta),
                                      cli_f64_bits(wc->eps), wc->max_position};
            if ((rc = cli_cp_agree_weights(cp, "attention", wvals, wnames, 8, aw.w, sizeof(float) * gdn_attn_param_floats(wc),
                                           "the weights (a digest of the layer's tensors in --weights)")))
                reported = 1;
        }
        /* same spec, T, D and H everywhere (agreed): every rank reaches the same verdict */
        if (!rc && o.decode >= T) {
            if (!rank) fprintf(stderr, "gdncp attention: --decode %d under --cp leaves no prompt tokens of T = %lld to "
                               "split over the ranks\n", o.decode, (long long)T);
            rc = GDN_ERR_ARG, reported = 1;
        }
        /* --decode: the prompt (T - N tokens) split over the ranks; the last rank's rows also
         * hold the decoded tokens */
        if (!rc && cli_shard_of(o.shards, D, rank, T - o.decode, &t0, &tn)) rc = GDN_ERR_SHAPE, reported = 1;
        if (!rc && rank == D - 1) tn += o.decode;
        if (!rc && strategy == GDN_ATTN_CP_HEADS && aw.cfg.H % D) {
            if (!rank)
                fprintf(stderr, "gdncp attention: --cp heads needs the number of ranks D = %d to divide H = %lld query "
                                "heads (use --cp kv, or D among the divisors of H)\n", D, (long long)aw.cfg.H);
            rc = GDN_ERR_ARG, reported = 1;
        }
        if (rc) goto done; /* every rank fails here alike: no collective after it */
    } else {
        tn = T;
    }
    if (!rc) { /* before reading: the rows of x (and dy), y (and dx), saved, the weight gradients
                * (twice on rank 0 of a split run: its share and the sum); a lower bound */
        const double rows = (double)B * (double)tn * (double)aw.cfg.E,
                     nw = (double)gdn_attn_param_floats(&aw.cfg) * (o.backward ? (cp && !rank ? 3 : 2) : 1);
        const double need = 4.0 * (rows * (o.backward ? 4 : 2) + nw);
        static const char what[] = "the attention layer's input and output rows";
        if (cp) { /* (every rank is here: the agreement above passed) */
            if ((rc = cli_cp_check_fits(cp, "attention", what, need))) reported = 1;
        } else {
            rc = gdn_check_fits(what, need);
        }
    }
    if (!rc) rc = read_rows(f, "x", ndim, aw.cfg.E, t0, tn, B, T, &x);
    if (!rc && cp && o.decode) rc = read_rows(f, "x", ndim, aw.cfg.E, T - o.decode, o.decode, B, T, &xdec);
    if (!rc && o.backward) rc = read_rows(f, "dy", ndim, aw.cfg.E, t0, tn, B, T, &dy);
    gdn_attn_config c = aw.cfg;
    c.B = B, c.T = tn, c.threads = o.threads, c.pos_offset = pos_offset, c.cp = strategy, c.compute = o.compute;
    c.cu_seqlens = cu, c.n_docs = n_docs, c.seq_offset = cp ? t0 : 0;
    if (cp && o.decode && rank == D - 1) c.T = tn - o.decode; /* the prefill's share */
    if (!rc && !o.decode) rc = gdn_attn_plan_create(&plan, &c);
    const size_t nx = (size_t)B * tn * aw.cfg.E, nw = gdn_attn_param_floats(&c);
    const size_t ns = plan && o.backward && !o.recompute ? cli_attn_plan(plan).saved_floats : 0;
    if (!rc) {
        y = malloc(sizeof(float) * nx);
        if (ns) saved = malloc(sizeof(float) * ns);
        if (o.backward) dx = malloc(sizeof(float) * nx), dw = malloc(sizeof(float) * nw);
        if (!y || (ns && !saved) || (o.backward && (!dx || !dw)))
            rc = fail(GDN_ERR_NOMEM, "rank %d: the layer's outputs%s for %lld tokens (%.2f GB)", rank,
                      o.backward ? " and gradients" : "", (long long)(B * tn),
                      4e-9 * ((double)nx * (o.backward ? 2 : 1) + (o.backward ? (double)nw : 0) + (double)ns));
    }
    const double t_start = cli_now();
    if (cp) {
        rc = gdn_cp_agree_status(cp, rc);
        if (!rc && o.decode) rc = run_cp_decode(cp, &o, c, aw.w, x, xdec, y);
        else if (!rc) rc = gdn_attn_cp_forward(cp, plan, y, saved, x, aw.w);
        if (!rc) fs = gdn_cp_last_stats(cp);
        if (!rc && o.backward) rc = gdn_attn_cp_backward(cp, plan, dx, dw, x, aw.w, saved, dy);
        if (!rc && o.backward) bs = gdn_cp_last_stats(cp);
        /* the weight gradients summed on rank 0 (the size of the weights); y and dx written by
         * each rank at their rows of the file: no rank holds the whole sequence's */
        rc = gdn_cp_agree_status(cp, rc);
        if (!rc && o.stats) print_stats(cp, &o, &fs, &bs, t0, tn, cli_now() - t_start);
        if (!rc && o.backward) rc = cli_cp_sum_to_root(cp, "attention", dw, nw, &dw_all, &reported);
        if (!rc) {
            const grads_ctx gc = {&aw, o.backward ? dw_all : NULL};
            const int64_t E = aw.cfg.E;
            const cli_out_tensor outs[2] = {{"y", ndim, {B, T, E}, 1, y}, {"dx", ndim, {B, T, E}, 1, dx}};
            const cli_out_tensor outs2[2] = {{"y", 2, {T, E}, 1, y}, {"dx", 2, {T, E}, 1, dx}};
            rc = cli_cp_write_rows(cp, o.out, "gdncp attention", B, T, t0, tn, ndim == 3 ? outs : outs2,
                                   o.backward ? 2 : 1, o.backward ? add_grads : NULL, (void *)&gc);
            if (rc) reported = strstr(gdn_errmsg(), "see its message") != NULL;
        }
    } else if (!rc) {
        if (o.decode) {
            rc = run_decode(&o, c, aw.w, x, y);
        } else {
            rc = gdn_attn_forward(plan, y, saved, x, aw.w);
            if (!rc && o.backward) rc = gdn_attn_backward(plan, dx, dw, x, aw.w, saved, dy);
        }
    }
    const double secs = cli_now() - t_start;
    if (!rc && !rank) {
        if (!cp) rc = write_outputs(&o, &aw, ndim, B, T, y, o.backward ? dx : NULL, o.backward ? dw : NULL);
        if (!rc)
            printf("gdncp attention: B=%lld T=%lld E=%lld H=%lld Hkv=%lld d=%lld R=%lld theta=%g positions %s%lld "
                   "(%s): %s%s%s in %.3f s%s%s (products: %s) -> %s\n",
                   (long long)B, (long long)T, (long long)c.E, (long long)c.H, (long long)c.Hkv, (long long)c.d,
                   (long long)c.R, c.rope_theta, cu ? "per document from 0, documents=" : "from ",
                   (long long)(cu ? n_docs : pos_offset), aw.dtype == GDN_BF16 ? "BF16 on disk, F32 in memory"
                   : aw.dtype == GDN_F64 ? "F64 on disk, F32 in memory" : "F32",
                   o.decode ? "prefill + decode" : "forward", o.backward ? " + backward" : "",
                   o.backward ? (o.recompute ? " (recomputed)" : " (saved)") : "", secs,
                   cp ? " over ranks, strategy " : "", cp ? o.cp : "", gdn_compute_path(c.compute), o.out);
    }
    if (cp) rc = gdn_cp_agree_status(cp, rc);
done:
    if (rc && !reported && !strstr(gdn_errmsg(), "see its message")) cli_error("attention", rc);
    free(x), free(xdec), free(dy), free(y), free(dx), free(dw), free(saved), free(dw_all), free(pos), free(cu);
    gdn_attn_plan_destroy(plan);
    gdn_attn_weights_free(&aw);
    gdn_st_close(f);
    gdn_cp_destroy(cp);
    return rc ? 1 : 0;
}
