/* gdncp layer: the Qwen3.5 GatedDeltaNet layer from a Hugging Face checkpoint on x [B,T,E]:
 * y, and with --backward dx and grad.<weight> for loss = sum(y * dy). Under mpiexec with --cp
 * every rank reads only its token rows; rank 0 writes the gathered file, which equals the
 * single-rank one. --decode N prefills all but the last N tokens, then decodes them one by one.
 * Packed documents (--cu-seqlens, a cu_seqlens tensor or restarting position_ids in the input
 * file, as gdncp attention reads them; B = 1): the conv and the recurrent state restart at every
 * document start, on one rank or over ranks. */
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
    fprintf(stderr, "gdncp layer: %s: ", gdn_strerror(status));
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    reported = 1;
    return status;
}

typedef struct {
    const char *weights, *config, *prefix, *in, *out, *cp, *shards;
    int backward, keep, decode;
    int compute; /* --compute: GDN_COMPUTE_FP32 or GDN_COMPUTE_BF16 */
    int f32; /* --f32: keep BF16 checkpoints as fp32 in memory for inference */
    gdn_layer_config given; /* dims from flags (0: not given), chunk, threads */
    int64_t *cu_seqlens, n_cu; /* --cu-seqlens as given (n_cu values), NULL when absent */
} layer_opts;

static void layer_init(void *p) { ((layer_opts *)p)->given.chunk = 64; }

static const cli_opt layer_table[] = {
    {CLI_STR("--weights", layer_opts, weights, "W", "the weights, bare (in_proj_qkv.weight, ...) or under --prefix"), .req = 1},
    {CLI_STR("--config", layer_opts, config, "C", "a config.json (fields at the top level or under text_config)")},
    {CLI_STR("--prefix", layer_opts, prefix, "P", "e.g. model.layers.0.linear_attn. in a whole-model model.safetensors; other tensors are ignored")},
    {CLI_STR("--in", layer_opts, in, "F", "the input file: x [B,T,E] (and dy with --backward)"), .req = 1},
    {CLI_STR("--out", layer_opts, out, "F", "the output file"), .req = 1},
    {CLI_FLAG("--backward", layer_opts, backward, "also compute dx and the weight gradients")},
    {CLI_ENUM("--keep", layer_opts, keep, "min|proj", CLI_VALUES(GDN_LAYER_KEEP_MIN, GDN_LAYER_KEEP_PROJ), "what the forward keeps for the backward: min recomputes the projections, conv and kernel forward; proj keeps them (faster backward, more memory)")},
    /* (at most T, checked once T is known) */
    {CLI_I64("--decode", layer_opts, decode, 1, INT32_MAX, "N", "prefill all but the last N tokens with the cache, then decode those one token at a time (N <= T); not with --backward, --cp or packed documents"), .dflt = ""},
    {CLI_FLAG("--f32", layer_opts, f32, "keep a BF16 checkpoint as fp32 in memory (inference keeps BF16 as BF16 otherwise; --backward always uses fp32)")},
    {CLI_COMPUTE("--compute", layer_opts, compute, "the precision of in_proj_qkv, in_proj_z and out_proj: bf16 rounds their operands to bfloat16 and accumulates in fp32; everything else stays fp32")},
    {CLI_I64("--chunk", layer_opts, given.chunk, 16, 128, "C", "the kernel's chunk: 16, 32, 64 or 128")},
    {CLI_I64("--threads", layer_opts, given.threads, 1, 4096, "N", "OpenMP threads"), .dflt = "all"},
    {CLI_I64("--E", layer_opts, given.E, 1, 1 << 20, "N", "the hidden size, when neither the config nor the file's metadata states it"), .dflt = ""},
    {CLI_I64("--Hk", layer_opts, given.Hk, 1, 1 << 16, "N", "key heads (likewise)"), .dflt = ""},
    {CLI_I64("--Hv", layer_opts, given.Hv, 1, 1 << 16, "N", "value heads (likewise)"), .dflt = ""},
    {CLI_I64("--K", layer_opts, given.K, 1, GDN_MAX_HEAD_DIM, "N", "key head width (likewise)"), .dflt = ""},
    {CLI_I64("--V", layer_opts, given.V, 1, GDN_MAX_HEAD_DIM, "N", "value head width (likewise)"), .dflt = ""},
    {CLI_I64("--Kc", layer_opts, given.Kc, 1, GDN_MAX_CONV, "N", "the causal conv's kernel size (likewise)"), .dflt = ""},
    /* the RMSNorm's epsilon (Qwen: 1e-6); beyond 1 it would swamp the norm it guards */
    {CLI_F64("--eps", layer_opts, given.eps, 1e-12, 1.0, "X", "the gated RMSNorm's epsilon (likewise)"), .dflt = ""},
    {CLI_LIST("--cu-seqlens", layer_opts, cu_seqlens, n_cu, "0,a,..,T", "packed documents (B = 1), or a cu_seqlens tensor beside x")},
    {CLI_STR("--cp", layer_opts, cp, "scan|allgather|relay|heads", "under mpiexec: the tokens split over the ranks, as for gdncp run")},
    {CLI_STR("--shards", layer_opts, shards, "a,b,..", "with --cp: each rank's token count (default an even split)")},
};

const cli_command cmd_layer_cli = {
    .name = "layer",
    .usage = "usage: gdncp layer --weights W.safetensors [--config config.json] [--prefix P]\n"
             "                   --in IN.safetensors --out OUT.safetensors [options]\n"
             "       mpiexec -n D gdncp layer ... --cp scan|allgather|relay|heads [--shards a,b,..]\n",
    .summary = "the Qwen3.5 GatedDeltaNet layer from a Hugging Face checkpoint (forward, backward, decode, --cp)",
    .size = sizeof(layer_opts), .init = layer_init, CLI_OPTS(layer_table),
};

static int parse(int argc, char **argv, layer_opts *o) {
    if (cli_parse(&cmd_layer_cli, argc, argv, o, NULL)) return CLI_USAGE_ERROR;
    if (o->given.chunk != 16 && o->given.chunk != 32 && o->given.chunk != 64 && o->given.chunk != 128) {
        fprintf(stderr, "gdncp layer: --chunk must be 16, 32, 64 or 128, got %d\n", o->given.chunk);
        return CLI_USAGE_ERROR;
    }
    if (o->decode && (o->backward || o->cp)) {
        fprintf(stderr, "gdncp layer: --decode runs inference on one rank; it does not combine with %s\n",
                o->backward ? "--backward" : "--cp");
        return CLI_USAGE_ERROR;
    }
    return 0;
}

/* x (and dy) of the input file: [B, T, E] with E the layer's; rows [t0, t0 + tn) only. */
static int read_rows(gdn_st_file *f, const char *name, int64_t E, int64_t t0, int64_t tn,
                     int64_t *B, int64_t *T, float **out) {
    const gdn_st_tensor *t = gdn_st_find(f, name);
    if (!t) return fail(GDN_ERR_MISSING, "input file has no tensor '%s'", name);
    if (t->ndim != 3 || t->shape[2] != E)
        return fail(GDN_ERR_SHAPE, "'%s' must be [B, T, E = %lld], got %d dims (last %lld)", name,
                        (long long)E, t->ndim, (long long)(t->ndim ? t->shape[t->ndim - 1] : 0));
    *B = t->shape[0], *T = t->shape[1];
    if (tn < 0) t0 = 0, tn = *T;
    if (t0 + tn > *T) return fail(GDN_ERR_SHAPE, "'%s' has T = %lld rows, fewer than the shard's end %lld",
                                      name, (long long)*T, (long long)(t0 + tn));
    const size_t n = (size_t)*B * tn * E;
    *out = malloc(sizeof(float) * (n ? n : 1));
    if (!*out) return fail(GDN_ERR_NOMEM, "'%s' rows (%zu floats)", name, n);
    return gdn_st_read(f, name, GDN_F32, *out, n, 1, t0, tn);
}

/* The weight gradients in the checkpoint's names: data on rank 0, reserved elsewhere. */
typedef struct {
    const gdn_layer_weights *lw;
    const float *dw;
} grads_ctx;
static int add_grads(gdn_st_writer *w, int rank, void *ctx) {
    const grads_ctx *g = ctx;
    return gdn_layer_grads_add(w, g->lw, rank ? NULL : g->dw, "grad.");
}

static int write_outputs(const layer_opts *o, const gdn_layer_weights *lw, int64_t B, int64_t T,
                         const float *y, const float *dx, const float *dw) {
    gdn_st_writer *wr = NULL;
    const int64_t shape[3] = {B, T, lw->cfg.E};
    int rc = gdn_st_writer_create(&wr);
    if (!rc) rc = gdn_st_writer_metadata(wr, "producer", "gdncp layer");
    if (!rc) rc = gdn_st_writer_add(wr, "y", GDN_F32, 3, shape, y, GDN_F32);
    if (!rc && dx) rc = gdn_st_writer_add(wr, "dx", GDN_F32, 3, shape, dx, GDN_F32);
    if (!rc && dw) rc = gdn_layer_grads_add(wr, lw, dw, "grad.");
    if (!rc) rc = gdn_st_writer_save(wr, o->out);
    gdn_st_writer_destroy(wr);
    return rc;
}

/* Prefill T - N tokens with a cache, then decode the last N one at a time (B sequences). */
static int run_decode(const layer_opts *o, gdn_layer_config c, const void *w, const float *x, float *y) {
    const int64_t B = c.B, T = c.T, E = c.E, N = o->decode, T0 = T - N;
    if (N > T) /* (not clamped: a count larger than the sequence is a mistake, not a request) */
        return fail(GDN_ERR_ARG, "--decode %lld asks for more tokens than the input's T = %lld", (long long)N,
                    (long long)T);
    const size_t nconv = (size_t)B * gdn_layer_conv_dim(&c) * c.Kc, ns = (size_t)B * c.Hv * c.K * c.V;
    float *conv = calloc(nconv, sizeof(float)), *rec = calloc(ns, sizeof(float));
    float *xt = malloc(sizeof(float) * (B * (T0 > 1 ? T0 : 1) * E)), *yt = malloc(sizeof(float) * (B * (T0 > 1 ? T0 : 1) * E));
    gdn_layer_plan *lp = NULL;
    int rc = conv && rec && xt && yt ? GDN_OK : fail(GDN_ERR_NOMEM, "decode buffers");
    for (int phase = 0; phase < 2 && !rc; phase++) {
        const int64_t t_begin = phase ? T0 : 0, t_end = phase ? T : T0, step = phase ? 1 : T0;
        if (t_end <= t_begin) continue;
        c.T = step;
        if ((rc = gdn_layer_plan_create(&lp, &c))) break;
        for (int64_t t = t_begin; t < t_end && !rc; t += step) {
            for (int64_t b = 0; b < B; b++) memcpy(xt + b * step * E, x + (b * T + t) * E, sizeof(float) * step * E);
            rc = phase ? gdn_layer_decode(lp, yt, xt, w, conv, rec) : gdn_layer_forward(lp, yt, NULL, xt, w, conv, rec);
            for (int64_t b = 0; b < B; b++) memcpy(y + (b * T + t) * E, yt + b * step * E, sizeof(float) * step * E);
        }
        gdn_layer_plan_destroy(lp), lp = NULL;
    }
    free(conv), free(rec), free(xt), free(yt);
    return rc;
}

/* The input's position_ids, as gdncp attention reads them: restarting ones pack documents (the
 * conv and the state restart there), which must be those of --cu-seqlens or the file's cu_seqlens
 * when given too (*cu, *n_docs: taken over or replaced); counting ones place the tokens, which a
 * GatedDeltaNet layer does not need (no positions), but cannot be one packed stream of several
 * documents. Prints what is wrong; returns its status. */
static int positions_documents(const char *who, gdn_st_file *f, int64_t B, int64_t T, int64_t **cu, int64_t *n_docs) {
    int64_t *pos = NULL, off = 0, *pcu = NULL, pdocs = 0;
    int rc = cli_read_positions(who, f, B, T, &pos);
    if (rc || !pos) return rc;
    rc = cli_positions_meaning(who, pos, B, T, &off, &pcu, &pdocs);
    free(pos);
    if (!rc && *cu) rc = cli_positions_match_documents(who, T, off, pcu, pdocs, *cu, *n_docs);
    if (!rc && pcu) free(*cu), *cu = pcu, *n_docs = pdocs, pcu = NULL;
    free(pcu);
    return rc;
}

static int layer_with(layer_opts *o, int argc, char **argv);

int cmd_layer(int argc, char **argv) {
    layer_opts o;
    const int rc = layer_with(&o, argc, argv);
    cli_free(&cmd_layer_cli, &o);
    return rc;
}

static int layer_with(layer_opts *opts, int argc, char **argv) {
    const int prc = parse(argc, argv, opts);
    layer_opts o = *opts;
    if (prc) { /* (under --cp, an option error still joins the other ranks' first agreement) */
        cli_cp_fail_early(argc, argv);
        return prc;
    }
    int rank = 0, D = 1;
    gdn_cp *cp = NULL;
    const int strategy = o.cp ? gdn_cp_strategy_parse(o.cp) : GDN_CP_SCAN;
    if (o.cp) {
        const int begun = cli_cp_begin("layer", o.cp, strategy, "scan, allgather, relay, heads", argc, argv, &cp,
                                       &rank, &D);
        if (begun) return begun;
    }
    gdn_layer_weights lw;
    memset(&lw, 0, sizeof lw);
    gdn_st_file *f = NULL;
    float *x = NULL, *dy = NULL, *y = NULL, *dx = NULL, *dw = NULL, *saved = NULL;
    float *dw_all = NULL;
    gdn_layer_plan *lp = NULL;
    int64_t B = 0, T = 0, t0 = 0, tn = -1, B2, T2;
    int64_t *cu = NULL, n_docs = 0; /* packed documents: --cu-seqlens or the file's tensor */
    int rc = gdn_layer_weights_load(&lw, o.weights, o.config, o.prefix, &o.given);
    /* Inference keeps a BF16 checkpoint BF16 in memory; training (--backward) needs fp32. */
    if (!rc && lw.dtype == GDN_BF16 && !o.backward && !o.f32) rc = gdn_layer_weights_to_bf16(&lw);
    const void *wd = gdn_layer_weights_data(&lw);
    if (!rc) rc = gdn_st_open(&f, o.in);
    if (!rc) { /* the file's B and T first, for the shard */
        const gdn_st_tensor *t = gdn_st_find(f, "x");
        if (!t) rc = fail(GDN_ERR_MISSING, "%s has no tensor 'x'", o.in);
        else if (t->ndim != 3) rc = fail(GDN_ERR_SHAPE, "'x' must be [B, T, E], got %d dims", t->ndim);
        else B = t->shape[0], T = t->shape[1];
    }
    if (!rc) { /* every rank checks its own file's offsets; a failure stops all in the agreement */
        char who[64];
        snprintf(who, sizeof who, rank ? "gdncp layer: rank %d" : "gdncp layer", rank);
        if (cli_pack_offsets(who, o.in, "x", o.cu_seqlens, o.n_cu, &cu, &n_docs)) rc = GDN_ERR_ARG, reported = 1;
        if (!rc && (rc = positions_documents(who, f, B, T, &cu, &n_docs))) reported = 1;
    }
    if (!rc && cu && o.decode) /* the decode cache carries one stream's states */
        rc = fail(GDN_ERR_ARG, "--decode runs one sequence with a cache; it does not combine with packed documents "
                  "(--cu-seqlens, a cu_seqlens tensor or restarting position_ids in %s)", o.in);
    if (cp) { /* one agreement step on everything that decides the collectives that follow */
        static const char *const names[] = {"--cp (0 scan, 1 allgather, 2 relay, 3 heads)", "--backward", "--keep",
                                            "--f32", "--shards (the lists differ; values are hashes)",
                                            "T of the input file", "--compute (0 fp32, 1 bf16)",
                                            "--out (rank 0 writes every rank's rows there; the paths differ, values are hashes)"};
        const int64_t vals[8] = {strategy, o.backward, o.keep, o.f32, cli_hash(o.shards), T, o.compute, cli_hash(o.out)};
        rc = cli_cp_agree_first(cp, "layer", vals, 8, names, rc, &reported);
        if (!rc) { /* the weights and their configuration, before any exchange (every rank loaded its own) */
            static const char *const wnames[] = {"hidden_size E (--weights / --config)", "linear_num_key_heads Hk",
                                                 "linear_num_value_heads Hv", "linear_key_head_dim K",
                                                 "linear_value_head_dim V", "linear_conv_kernel_dim Kc",
                                                 "rms_norm_eps (its bits)", "the weights' dtype in memory"};
            const gdn_layer_config *wc = &lw.cfg;
            const int64_t wvals[8] = {wc->E, wc->Hk, wc->Hv, wc->K, wc->V, wc->Kc, cli_f64_bits(wc->eps), wc->weight_dtype};
            const size_t bytes = gdn_layer_param_floats(wc) * (wc->weight_dtype == GDN_BF16 ? 2 : 4);
            if ((rc = cli_cp_agree_weights(cp, "layer", wvals, wnames, 8, wd, bytes,
                                           "the weights (a digest of the layer's tensors in --weights)")))
                reported = 1;
        }
        /* same spec, T and D everywhere (agreed): every rank reaches the same verdict */
        if (!rc && cli_shard_of(o.shards, D, rank, T, &t0, &tn)) rc = GDN_ERR_SHAPE, reported = 1;
        if (rc) goto done; /* every rank fails here alike: no collective after it */
    }
    if (!rc) { /* before reading: the rows of x (and dy), y (and dx) and the weight gradients
                * (twice on rank 0 of a split run: its share and the sum); a lower bound, the
                * plan's workspace is checked when it is made */
        const double rows = (double)B * (double)(cp ? tn : T) * (double)lw.cfg.E,
                     weights = o.backward ? (double)gdn_layer_param_floats(&lw.cfg) * (cp && !rank ? 2 : 1) : 0;
        const double need = 4.0 * (rows * (o.backward ? 4 : 2) + weights);
        static const char what[] = "the layer's input and output rows";
        if (cp) { /* (every rank is here: the agreement above passed) */
            if ((rc = cli_cp_check_fits(cp, "layer", what, need))) reported = 1;
        } else {
            rc = gdn_check_fits(what, need);
        }
    }
    if (!rc) rc = read_rows(f, "x", lw.cfg.E, t0, tn, &B, &T2, &x);
    if (!rc && o.backward) rc = read_rows(f, "dy", lw.cfg.E, t0, tn, &B2, &T2, &dy);
    if (!rc && o.backward && (B2 != B || T2 != T))
        rc = fail(GDN_ERR_SHAPE, "'dy' is [%lld, %lld, E], 'x' is [%lld, %lld, E]", (long long)B2,
                      (long long)T2, (long long)B, (long long)T);
    const int64_t Tl = cp ? tn : T, E = lw.cfg.E;
    gdn_layer_config c = lw.cfg;
    c.B = B, c.T = Tl, c.chunk = o.given.chunk, c.threads = o.given.threads, c.keep = o.keep;
    c.compute = o.compute;
    c.cp = strategy;
    c.cu_seqlens = cu, c.n_docs = n_docs, c.seq_offset = cu ? t0 : 0;
    if (!rc) rc = gdn_layer_plan_create(&lp, &c);
    const size_t nx = (size_t)B * Tl * E, nw = gdn_layer_param_floats(&c);
    if (!rc) {
        y = malloc(sizeof(float) * nx), saved = malloc(sizeof(float) * (cli_layer_plan(lp).saved_floats + 1));
        if (o.backward) dx = malloc(sizeof(float) * nx), dw = malloc(sizeof(float) * nw);
        if (!y || !saved || (o.backward && (!dx || !dw)))
            rc = fail(GDN_ERR_NOMEM, "rank %d: the layer's outputs%s for %lld tokens (%.2f GB)", rank,
                      o.backward ? " and gradients" : "", (long long)(B * Tl),
                      4e-9 * ((double)nx * (o.backward ? 2 : 1) + (o.backward ? (double)nw : 0) +
                              (double)cli_layer_plan(lp).saved_floats));
    }
    double t_start = cli_now();
    if (cp) {
        rc = gdn_cp_agree_status(cp, rc);
        if (!rc) rc = gdn_layer_cp_forward(cp, lp, y, saved, x, wd);
        if (!rc && o.backward) rc = gdn_layer_cp_backward(cp, lp, dx, dw, x, wd, saved, dy);
        /* the weight gradients summed on rank 0 (the size of the weights); y and dx written
         * by each rank at their rows of the file: no rank holds the whole sequence's */
        rc = gdn_cp_agree_status(cp, rc);
        if (!rc && o.backward) rc = cli_cp_sum_to_root(cp, "layer", dw, nw, &dw_all, &reported);
        if (!rc) {
            const grads_ctx gc = {&lw, o.backward ? dw_all : NULL};
            rc = cli_cp_write_rows(cp, o.out, "gdncp layer", B, T, t0, Tl, (const cli_out_tensor[]){
                {"y", 3, {B, T, E}, 1, y}, {"dx", 3, {B, T, E}, 1, dx}}, o.backward ? 2 : 1,
                o.backward ? add_grads : NULL, (void *)&gc);
            if (rc) reported = strstr(gdn_errmsg(), "see its message") != NULL;
        }
    } else if (!rc) {
        if (o.decode) {
            rc = run_decode(&o, c, wd, x, y);
        } else {
            rc = gdn_layer_forward(lp, y, saved, x, wd, NULL, NULL);
            if (!rc && o.backward) rc = gdn_layer_backward(lp, dx, dw, x, wd, saved, dy);
        }
    }
    const double secs = cli_now() - t_start;
    if (!rc && !rank) {
        if (!cp) rc = write_outputs(&o, &lw, B, T, y, o.backward ? dx : NULL, o.backward ? dw : NULL);
        if (!rc)
            printf("gdncp layer: B=%lld T=%lld%s%.0lld E=%lld Hk=%lld Hv=%lld K=%lld V=%lld Kc=%lld (%s layout, %s): "
                   "%s%s in %.3f s%s%s (products: %s) -> %s\n",
                   (long long)B, (long long)T, cu ? " documents=" : "", (long long)n_docs, (long long)E,
                   (long long)c.Hk, (long long)c.Hv,
                   (long long)c.K, (long long)c.V, (long long)c.Kc, lw.fused ? "fused" : "split",
                   lw.cfg.weight_dtype == GDN_BF16 ? "BF16 in memory" : lw.dtype == GDN_BF16 ? "BF16 on disk, F32 in memory" : "F32",
                   o.decode ? "prefill + decode" : "forward", o.backward ? " + backward" : "", secs,
                   cp ? " over ranks, strategy " : "", cp ? o.cp : "", gdn_compute_path(c.compute), o.out);
    }
    if (cp) rc = gdn_cp_agree_status(cp, rc);
done:
    if (rc && !reported && !strstr(gdn_errmsg(), "see its message")) cli_error("layer", rc);
    free(x), free(dy), free(y), free(dx), free(dw), free(saved), free(dw_all);
    gdn_layer_plan_destroy(lp);
    gdn_layer_weights_free(&lw);
    gdn_st_close(f);
    gdn_cp_destroy(cp);
    free(cu);
    return rc ? 1 : 0;
}
