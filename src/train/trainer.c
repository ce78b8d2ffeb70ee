/* The training loop (train.h): grid, data windows, steps, validation, logging, checkpoints. */
#include "gdncp/train.h"
#include "gdncp/io.h"

#include <jansson.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "base.h"
#include "gdncp/attention.h"

/* Validation windows come from their own stream: the same windows at every evaluation. */
#define VAL_SEED_SALT 0x56414c4944415445ull

gdn_train_options gdn_train_defaults(void) {
    gdn_train_options o;
    memset(&o, 0, sizeof o);
    gdn_model_config_named("tiny", &o.model);
    o.val_fraction = 0.05;
    o.seq = 256, o.batch = 8, o.steps = 200;
    o.opt = gdn_adamw_default();
    o.seed = 1234;
    o.cp = 1, o.strategy = GDN_CP_SCAN;
    o.recompute = -1;
    o.keep_last = 2;
    o.eval_every = 50, o.eval_seqs = 16;
    o.log_every = 1;
    o.router_aux_coef = -1;
    return o;
}

/* Everything one rank holds while training. */
typedef struct {
    const gdn_train_options *o;
    MPI_Comm world, cp_comm;
    gdn_cp *agree; /* world-wide agreement of statuses and values */
    gdn_cp *cp;    /* this rank's CP group */
    /* expert parallelism (--ep > 1): the group the experts are split over, the ranks holding the
     * same slice (replicas), and an agreement over those */
    MPI_Comm ep_comm, replica_comm;
    gdn_ep *ep;
    gdn_cp *replica_agree;
    int ep_size, ep_rank;
    int rank, size, dp, dp_index, cp_rank, cp_size;
    int64_t t0, tn; /* this rank's shard of every sequence */
    gdn_model_config cfg;
    size_t nw;
    float *w, *dw, *m, *v;
    double *router; /* MoE: the routers' statistics, 2 n_experts + 1 (grid_router_stats) */
    double *load;   /* MoE: the experts' load, 2 x MoE layers x n_experts (expert_load) */
    gdn_model_plan *plan;
    gdn_data *data;
    gdn_token *tokens; /* batch x (tn + 1) */
    gdn_token *window; /* packing: one row's whole window (and the separator's length before it) */
    gdn_token sep[GDN_DATA_MAX_SEP]; /* packing: the separator's ids (--pack's bytes or --pack-id) */
    int sep_len;                     /*   0: not packing */
    int64_t *doc_cu, *n_docs; /* packing: the rows' document offsets (gdn_model_set_docs) */
    int recompute, threads;
    FILE *progress, *csv;
    int status_shown; /* rank 0: a status line (--progress line) is on the terminal */
    double peak_gflops, flops_per_token;
    int64_t first_step;
} trainer;

static int check_options(const gdn_train_options *o, int size) {
    if (!o->data) return gdn_fail(GDN_ERR_ARG, "no training text (--data FILE)");
    if (o->cp < 1 || size % o->cp)
        return gdn_fail(GDN_ERR_ARG, "the world size %d is not divisible by --cp %d", size, o->cp);
    if (o->ep < 0 || (o->ep > 1 && size % o->ep))
        return gdn_fail(GDN_ERR_ARG, "the world size %d is not divisible by --ep %d", size, o->ep);
    /* a failure agreed over one kind of group must reach every rank of the other's groups it meets:
     * one kind's groups are unions of the other's */
    if (o->ep > 1 && o->ep % o->cp && o->cp % o->ep)
        return gdn_fail(GDN_ERR_ARG, "--ep %d and --cp %d: one must divide the other (expert groups made of whole CP "
                        "groups, or CP groups of whole expert groups)", o->ep, o->cp);
    if (o->seq < 1 || o->seq > ((int64_t)1 << 36))
        return gdn_fail(GDN_ERR_ARG, "--seq %lld is out of range [1, 2^36]", (long long)o->seq);
    if (o->seq < o->cp)
        return gdn_fail(GDN_ERR_SHAPE, "a sequence of %lld tokens is too short for --cp %d (each rank "
                        "needs at least one token)", (long long)o->seq, o->cp);
    if (o->batch < 1 || o->batch > 65536)
        return gdn_fail(GDN_ERR_ARG, "--batch %lld is out of range [1, 65536]", (long long)o->batch);
    if (o->steps < 1) return gdn_fail(GDN_ERR_ARG, "--steps %lld must be at least 1", (long long)o->steps);
    if (o->save_every < 0 || o->eval_every < 0 || o->eval_seqs < 0)
        return gdn_fail(GDN_ERR_ARG, "--save-every, --eval-every and --eval-seqs must not be negative");
    if (o->resume && o->init) return gdn_fail(GDN_ERR_ARG, "--resume and --init exclude each other");
    if (o->attn_cp != GDN_ATTN_CP_KV && o->attn_cp != GDN_ATTN_CP_HEADS)
        return gdn_fail(GDN_ERR_ARG, "unknown attention CP strategy %d (--attn-cp kv or heads)", o->attn_cp);
    if (!gdn_compute_name(o->compute))
        return gdn_fail(GDN_ERR_ARG, "unknown compute precision %d (--compute fp32 or bf16)", o->compute);
    if (o->save_dtype != GDN_F32 && o->save_dtype != GDN_BF16)
        return gdn_fail(GDN_ERR_ARG, "unknown checkpoint weight dtype %d (--save-dtype f32 or bf16)", o->save_dtype);
    if (o->strategy < GDN_CP_SCAN || o->strategy > GDN_CP_HEADS)
        return gdn_fail(GDN_ERR_ARG, "unknown CP strategy %d", o->strategy);
    if (o->pack && (o->pack_len < 1 || o->pack_len > GDN_DATA_MAX_SEP))
        return gdn_fail(GDN_ERR_ARG, "--pack: the separator must have 1 to %d bytes, it has %d", GDN_DATA_MAX_SEP,
                        o->pack_len);
    if (o->pack && o->pack_by_id) return gdn_fail(GDN_ERR_ARG, "--pack and --pack-id exclude each other");
    if (o->pack_by_id && o->pack_id < 0)
        return gdn_fail(GDN_ERR_ARG, "--pack-id %d is negative", (int)o->pack_id);
    return gdn_adamw_check(&o->opt);
}

/* The packing separator as hex ("" when not packing): it goes into trainer_state.json. */
static void pack_hex(const gdn_train_options *o, char out[2 * GDN_DATA_MAX_SEP + 1]) {
    out[0] = 0;
    for (int i = 0; o->pack && i < o->pack_len; i++) snprintf(out + 2 * i, 3, "%02x", o->pack[i]);
}

/* Packed by one id: that id; else -1. */
static int64_t pack_id_of(const gdn_train_options *o) { return o->pack_by_id ? (int64_t)o->pack_id : -1; }

/* The trainer's state for a checkpoint: what a resume must find unchanged, and where it was. */
static char *state_json(const trainer *t, int64_t step, double loss) {
    const gdn_train_options *o = t->o;
    char hex[2 * GDN_DATA_MAX_SEP + 1];
    pack_hex(o, hex);
    json_t *j = json_pack("{s:I, s:I, s:I, s:I, s:f, s:s, s:I, s:f, s:I, s:I, s:f, s:s, s:I, s:s}", "step",
                          (json_int_t)step, "seed", (json_int_t)o->seed, "seq", (json_int_t)o->seq,
                          "global_batch", (json_int_t)(o->batch * t->dp), "val_fraction",
                          o->val_fraction, "data", o->data, "data_bytes",
                          (json_int_t)(gdn_data_split_len(t->data, GDN_SPLIT_TRAIN) +
                                       gdn_data_split_len(t->data, GDN_SPLIT_VAL)),
                          "loss", loss, "dp", (json_int_t)t->dp, "cp", (json_int_t)t->cp_size,
                          "lr_peak", o->opt.lr, "pack_separator_hex", hex, "pack_separator_id",
                          (json_int_t)pack_id_of(o), "data_kind", gdn_data_is_tokens(t->data) ? "tokens" : "text");
    char *s = j ? json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    return s;
}

/* A resume must see the same run: same seed, sequence, global batch and text. */
static int check_resume_state(const trainer *t, const char *dir, const char *text, int64_t *step) {
    json_error_t err;
    json_t *j = json_loads(text ? text : "", 0, &err);
    if (!j) return gdn_fail(GDN_ERR_FORMAT, "%s/trainer_state.json: %s (line %d)", dir, err.text, err.line);
    /* each field an integer, the step a count (>= 0): the first that is not named */
    json_int_t st = -1, seed = -1, seq = -1, gb = -1, bytes = -1;
    const struct { const char *key; json_int_t *to; } fields[] = {
        {"step", &st}, {"seed", &seed}, {"seq", &seq}, {"global_batch", &gb}, {"data_bytes", &bytes}};
    char bad[160] = "";
    for (size_t i = 0; i < sizeof fields / sizeof fields[0] && !bad[0]; i++) {
        json_t *v = json_object_get(j, fields[i].key);
        if (!v) snprintf(bad, sizeof bad, "lacks '%s'", fields[i].key);
        else if (!json_is_integer(v)) snprintf(bad, sizeof bad, "has a '%s' that is not an integer", fields[i].key);
        else *fields[i].to = json_integer_value(v);
    }
    if (!bad[0] && st < 0)
        snprintf(bad, sizeof bad, "has 'step' = %lld: a number of steps done is at least 0", (long long)st);
    /* checkpoints from before packing have no separator: they were not packed */
    const char *sep_in_json = json_string_value(json_object_get(j, "pack_separator_hex"));
    char hex[2 * GDN_DATA_MAX_SEP + 1], was_hex[2 * GDN_DATA_MAX_SEP + 1];
    snprintf(was_hex, sizeof was_hex, "%s", sep_in_json ? sep_in_json : "");
    pack_hex(t->o, hex);
    const int pack_differs = strcmp(was_hex, hex) != 0;
    json_t *id_in_json = json_object_get(j, "pack_separator_id");
    const int64_t was_id = json_is_integer(id_in_json) ? (int64_t)json_integer_value(id_in_json) : -1;
    json_decref(j);
    if (bad[0]) return gdn_fail(GDN_ERR_FORMAT, "%s/trainer_state.json %s", dir, bad);
    if (pack_differs)
        return gdn_fail(GDN_ERR_ARG, "cannot resume: the checkpoint was trained with a different --pack separator "
                        "(hex '%s'; this run has '%s')", was_hex, hex);
    if (was_id != pack_id_of(t->o))
        return gdn_fail(GDN_ERR_ARG, "cannot resume: the checkpoint was trained with --pack-id %lld, this run has "
                        "%lld (-1: none)", (long long)was_id, (long long)pack_id_of(t->o));
    const int64_t have_bytes = gdn_data_split_len(t->data, GDN_SPLIT_TRAIN) + gdn_data_split_len(t->data, GDN_SPLIT_VAL);
    const struct { const char *what; int64_t was, now; } same[] = {
        {"--seed", seed, (int64_t)t->o->seed}, {"--seq", seq, t->o->seq},
        {"the global batch (--batch x DP)", gb, t->o->batch * t->dp},
        {"the data's size in tokens (bytes of a text)", bytes, have_bytes},
    };
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++)
        if (same[i].was != same[i].now)
            return gdn_fail(GDN_ERR_ARG, "cannot resume: the checkpoint was trained with %s = %lld, this run has %lld",
                            same[i].what, (long long)same[i].was, (long long)same[i].now);
    *step = st;
    return GDN_OK;
}

/* Read this rank's rows of a batch: row r's window of seq + 1 tokens, this rank's shard of it.
 * Packing: every rank reads the rows' whole windows (ids; cheap next to a step) to find their
 * documents, and gives them to the model. *targets: the targets this rank predicts. */
static int read_batch(trainer *t, int split, int64_t step, int64_t row0, int64_t *targets) {
    const gdn_train_options *o = t->o;
    const int64_t len = gdn_data_split_len(t->data, split);
    const uint64_t seed = split == GDN_SPLIT_VAL ? o->seed ^ VAL_SEED_SALT : o->seed;
    int64_t at = 0;
    for (int64_t b = 0; b < o->batch; b++) {
        const int64_t start = gdn_data_window(seed, step, row0 + b, len, o->seq + 1);
        if (start < 0) return GDN_ERR_SHAPE; /* gdn_data_window named the sizes */
        gdn_token *mine = t->tokens + b * (t->tn + 1);
        int rc;
        if (!t->sep_len) {
            rc = gdn_data_read(t->data, split, start + t->t0, t->tn + 1, mine);
        } else {
            const gdn_token *ids = NULL;
            rc = gdn_data_window_docs(t->data, split, start, o->seq + 1, t->sep, t->sep_len, t->window, &ids,
                                      t->doc_cu + at, &t->n_docs[b]);
            if (!rc) memcpy(mine, ids + t->t0, sizeof *mine * (size_t)(t->tn + 1)), at += t->n_docs[b] + 1;
        }
        if (rc) return rc;
    }
    *targets = o->batch * t->tn;
    return t->sep_len ? gdn_model_set_docs(t->plan, t->doc_cu, t->n_docs, t->t0, targets) : GDN_OK;
}

/* The targets predicted over the whole grid (the loss's denominator): every token's unless
 * packing leaves out the documents' first bytes. */
static int grid_targets(trainer *t, int64_t local, double *denom) {
    if (!t->sep_len) {
        *denom = (double)(t->o->batch * t->dp) * (double)t->o->seq;
        return GDN_OK;
    }
    int64_t all = 0;
    MPI_Allreduce(&local, &all, 1, MPI_INT64_T, MPI_SUM, t->world);
    *denom = (double)all;
    return all > 0 ? GDN_OK
                   : gdn_fail(GDN_ERR_SHAPE, "--pack: no token of this step's windows lies inside a document (the "
                              "data is separators only?)");
}

/* The MoE routers' statistics of this step over the whole grid (every rank's rows: DP x CP), so
 * that the aux loss and its gradient are the global batch's (a split run's equal one rank's):
 * one all-reduce of 2 n_experts + 1 doubles; *aux the aux loss (0 without MoE layers). */
static int grid_router_stats(trainer *t, double *aux) {
    *aux = 0;
    if (!gdn_model_moe_layers(&t->cfg)) return GDN_OK;
    const int ns = (int)(2 * t->cfg.n_experts + 1);
    gdn_model_router_stats(t->plan, t->router); /* (plan and array are set: it cannot fail) */
    if (t->o->fault != GDN_TRAIN_FAULT_AUX_PER_RANK &&
        MPI_Allreduce(MPI_IN_PLACE, t->router, ns, MPI_DOUBLE, MPI_SUM, t->world) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Allreduce of the routers' statistics failed");
    const int rc = gdn_model_set_router_stats(t->plan, t->router);
    if (!rc) *aux = gdn_model_aux_loss(t->plan);
    return rc;
}

/* Sum of a double over the world. */
static double world_sum(trainer *t, double x) {
    double s = 0;
    MPI_Allreduce(&x, &s, 1, MPI_DOUBLE, MPI_SUM, t->world);
    return s;
}

static int evaluate(trainer *t, double *val_loss) {
    const gdn_train_options *o = t->o;
    const int64_t per_round = o->batch * t->dp;
    const int64_t rounds = (o->eval_seqs + per_round - 1) / per_round;
    double sum = 0, count = 0;
    for (int64_t r = 0; r < rounds; r++) {
        int64_t targets = 0;
        double denom = 0, ls = 0;
        int rc = read_batch(t, GDN_SPLIT_VAL, 0, r * per_round + t->dp_index * o->batch, &targets);
        if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
        if ((rc = gdn_cp_agree_status(t->agree, grid_targets(t, targets, &denom)))) return rc;
        rc = gdn_model_forward(t->plan, t->w, t->tokens, 1.0, &ls, 0);
        if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc; /* before the next collective */
        sum += ls, count += denom;
    }
    *val_loss = world_sum(t, sum) / count;
    return GDN_OK;
}

/* Rank 0 measures the machine's peak while the other ranks wait without spinning (a spinning
 * MPI barrier would take the cores being measured). */
static double measure_peak(trainer *t, int cores) {
    double peak = 0;
    if (t->rank == 0) peak = gdn_measure_peak_gflops(1) * cores;
    MPI_Request req;
    MPI_Ibcast(&peak, 1, MPI_DOUBLE, 0, t->world, &req);
    int done = 0;
    while (!done) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (!done) nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    return peak;
}

/* The values every rank must share before any collective depends on them: the trainer's first
 * agreement step (gdn_train_fail joins it with a failure). */
#define N_AGREED 23
static int agree_options(gdn_cp *agree, const gdn_train_options *o, int rc) {
    const int64_t sep_hash = o->pack ? gdn_cp_digest(o->pack, (size_t)(o->pack_len < GDN_DATA_MAX_SEP ? o->pack_len
                                                                                         : GDN_DATA_MAX_SEP)) : 0;
    int64_t aux_bits;
    memcpy(&aux_bits, &o->router_aux_coef, sizeof aux_bits);
    const int64_t vals[N_AGREED] = {o->cp, o->seq, o->batch, o->steps, (int64_t)o->seed, o->strategy,
                            o->recompute, o->save_every, o->eval_every, o->eval_seqs, o->fault,
                            o->resume != NULL, o->init != NULL, o->out != NULL,
                            o->pack ? o->pack_len : 0, (int64_t)sep_hash, o->attn_cp, o->pack_by_id,
                            o->pack_by_id ? (int64_t)o->pack_id : 0, o->model.vocab, o->compute, aux_bits,
                            o->ep > 1 ? o->ep : 1};
    static const char *const names[] = {"--cp", "--seq", "--batch", "--steps", "--seed", "--strategy",
                                        "--recompute", "--save-every", "--eval-every", "--eval-seqs",
                                        "--fault", "--resume", "--init", "--out", "--pack (length)",
                                        "--pack (bytes)", "--attn-cp", "--pack-id (given)", "--pack-id", "--vocab",
                                        "--compute (0 fp32, 1 bf16)", "--router-aux-coef (its bits)", "--ep"};
    return gdn_cp_agree_values(agree, vals, N_AGREED, names, rc);
}

int gdn_train_fail(MPI_Comm world, int status) {
    gdn_cp *agree = NULL;
    if (gdn_cp_create(&agree, world, GDN_CP_SCAN)) return status;
    gdn_train_options o;
    memset(&o, 0, sizeof o);
    agree_options(agree, &o, status);
    gdn_cp_agree_status(agree, status); /* gdn_train's closing agreement */
    gdn_cp_destroy(agree);
    return status;
}

/* With --init / --resume the checkpoint decides the model: the model flags given (the bits of
 * `given`, GDN_GIVEN_*; --model sets them all) that say otherwise are refused, naming the first
 * field that differs and its flag; fields whose flags were not given take the checkpoint's. */
static int check_model_flags(const gdn_model_config *ck, const gdn_model_config *want, int given, const char *dir) {
    const int ck_attn = gdn_model_attn_layers(ck) > 0, want_attn = gdn_model_attn_layers(want) > 0;
    const struct { const char *field, *flag; int64_t ck, want; int attn, bit; } f[] = {
        {"vocab_size", "--vocab", ck->vocab, want->vocab, 0, GDN_GIVEN_VOCAB},
        {"hidden_size", "--hidden", ck->E, want->E, 0, GDN_GIVEN_HIDDEN},
        {"num_hidden_layers", "--layers", ck->L, want->L, 0, GDN_GIVEN_LAYERS},
        {"intermediate_size", "--intermediate", ck->I, want->I, 0, GDN_GIVEN_INTERMEDIATE},
        {"linear_num_key_heads", "--key-heads", ck->Hk, want->Hk, 0, GDN_GIVEN_KEY_HEADS},
        {"linear_num_value_heads", "--value-heads", ck->Hv, want->Hv, 0, GDN_GIVEN_VALUE_HEADS},
        {"linear_key_head_dim", "--key-dim", ck->K, want->K, 0, GDN_GIVEN_KEY_DIM},
        {"linear_value_head_dim", "--value-dim", ck->V, want->V, 0, GDN_GIVEN_VALUE_DIM},
        {"linear_conv_kernel_dim", "--conv", ck->Kc, want->Kc, 0, GDN_GIVEN_CONV},
        {"num_attention_heads", "--attn-heads", ck->H, want->H, 1, GDN_GIVEN_ATTN_HEADS},
        {"num_key_value_heads", "--kv-heads", ck->Hkv, want->Hkv, 1, GDN_GIVEN_KV_HEADS},
        {"head_dim", "--head-dim", ck->d, want->d, 1, GDN_GIVEN_HEAD_DIM},
        {"num_experts", "--experts", ck->n_experts, want->n_experts, 0, GDN_GIVEN_EXPERTS},
        {"num_experts_per_tok", "--experts-per-tok", ck->top_k, want->top_k, 0, GDN_GIVEN_EXPERTS},
        {"moe_intermediate_size", "--moe-intermediate", ck->moe_I, want->moe_I, 0, GDN_GIVEN_EXPERTS},
        {"shared_expert_intermediate_size", "--shared-intermediate", ck->shared_I, want->shared_I, 0, GDN_GIVEN_EXPERTS},
    };
    const char *named = given == GDN_GIVEN_ALL ? "--model or " : "";
    if (ck->L == want->L && (given & GDN_GIVEN_LAYER_TYPES))
        for (int64_t l = 0; l < ck->L; l++)
            if (ck->full_attention[l] != want->full_attention[l])
                return gdn_fail(GDN_ERR_ARG, "%s/config.json decides the model: its layer %lld is %s, but %s--layer-types "
                                "or --attn-interval make it %s; leave them out, or make them agree", dir, (long long)l,
                                ck->full_attention[l] ? "full_attention" : "linear_attention", named,
                                want->full_attention[l] ? "full_attention" : "linear_attention");
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if ((given & f[i].bit) && (!f[i].attn || (ck_attn && want_attn)) && f[i].ck != f[i].want)
            return gdn_fail(GDN_ERR_ARG, "%s/config.json decides the model: its %s is %lld, but %s%s says %lld; leave it "
                            "out, or make it agree", dir, f[i].field, (long long)f[i].ck, named, f[i].flag,
                            (long long)f[i].want);
    return GDN_OK;
}

/* --attn-cp heads splits the attention heads over the CP ranks: they must divide (attention_cp.c's rule). */
static int check_attn_cp(const gdn_model_config *c, int attn_cp, int D) {
    if (attn_cp != GDN_ATTN_CP_HEADS || D < 2 || !gdn_model_attn_layers(c)) return GDN_OK;
    const int64_t grp = c->H / c->Hkv, Hp = c->H / D;
    if (c->H % D || !(Hp % grp == 0 || grp % Hp == 0))
        return gdn_fail(GDN_ERR_ARG, "--attn-cp heads: the attention's %lld query heads (%lld key/value heads) do not "
                        "divide over --cp %d ranks (each rank needs whole query heads sharing whole key/value heads); "
                        "use --attn-cp kv", (long long)c->H, (long long)c->Hkv, D);
    return GDN_OK;
}

/* The data file's identity: the digest of its size and first 64 KiB (every rank reads its own
 * windows of it, so ranks given different files would silently train on a mix). */
static int64_t data_digest(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    unsigned char buf[8 + 65536];
    const size_t n = fread(buf + 8, 1, sizeof buf - 8, f);
    int64_t size = -1;
    if (!fseeko(f, 0, SEEK_END)) size = (int64_t)ftello(f);
    memcpy(buf, &size, 8);
    fclose(f);
    return gdn_cp_digest(buf, 8 + n);
}
static int64_t f64_bits(double x) {
    int64_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* Everything every rank's model, optimiser and data must share, agreed once the configuration is
 * known (from flags or a checkpoint) and before any collective depends on it: on a difference
 * every rank stops naming the first value that differs and the ranks' values (gdn_cp_agree_values).
 * The per-rank inputs (the data shard, the rank's tokens) are not in it. */
static int agree_run(trainer *t) {
    const gdn_model_config *c = &t->cfg;
    const gdn_adamw_config *a = &t->o->opt;
    const int64_t vals[] = {c->vocab, c->E, c->L, c->I, c->Hk, c->Hv, c->K, c->V, c->Kc, c->H, c->Hkv, c->d, c->R,
                            f64_bits(c->rope_theta), c->max_position, f64_bits(c->eps), c->tie_embeddings,
                            c->n_experts, c->top_k, c->moe_I, c->shared_I, c->norm_topk,
                            c->router_aux, f64_bits(c->router_aux_coef), f64_bits(a->lr), f64_bits(a->min_lr),
                            a->warmup, f64_bits(a->beta1), f64_bits(a->beta2), f64_bits(a->eps),
                            f64_bits(a->weight_decay), f64_bits(a->clip), f64_bits(t->o->val_fraction),
                            data_digest(t->o->data)};
    static const char *const names[] = {
        "vocab_size (--vocab)", "hidden_size (--hidden)", "num_hidden_layers (--layers)", "intermediate_size (--intermediate)",
        "linear_num_key_heads (--key-heads)", "linear_num_value_heads (--value-heads)", "linear_key_head_dim (--key-dim)",
        "linear_value_head_dim (--value-dim)", "linear_conv_kernel_dim (--conv)", "num_attention_heads (--attn-heads)",
        "num_key_value_heads (--kv-heads)", "head_dim (--head-dim)", "the rotary dims", "rope_theta (its bits)",
        "max_position_embeddings", "rms_norm_eps (its bits)", "tie_word_embeddings", "num_experts (--experts)", "num_experts_per_tok (--experts-per-tok)", "moe_intermediate_size (--moe-intermediate)",
        "shared_expert_intermediate_size (--shared-intermediate)", "norm_topk_prob", "the aux loss on (--router-aux-coef)",
        "router_aux_loss_coef (--router-aux-coef; its bits)", "--lr (its bits)", "--min-lr (its bits)", "--warmup",
        "--beta1 (its bits)", "--beta2 (its bits)", "AdamW's eps (its bits)", "--weight-decay (its bits)",
        "--clip (its bits)", "--val-fraction (its bits)", "the --data file (its size and first 64 KiB; a digest)"};
    _Static_assert(sizeof vals / sizeof vals[0] == sizeof names / sizeof names[0], "one name per agreed value");
    int rc = gdn_cp_agree_values(t->agree, vals, (int)(sizeof vals / sizeof vals[0]), names, GDN_OK);
    if (rc) return rc;
    /* each layer's kind: its mixer (0 GatedDeltaNet, 1 full attention) + 2 for an MoE MLP (L, the
     * same on every rank now) */
    int64_t kinds[GDN_MODEL_MAX_LAYERS];
    static char label[GDN_MODEL_MAX_LAYERS][80];
    const char *knames[GDN_MODEL_MAX_LAYERS];
    for (int64_t l = 0; l < c->L; l++) {
        kinds[l] = c->full_attention[l] + 2 * c->moe[l];
        snprintf(label[l], sizeof label[l], "layer %lld's kind (0 linear_attention, 1 full_attention; +2 an MoE MLP)",
                 (long long)l);
        knames[l] = label[l];
    }
    return gdn_cp_agree_values(t->agree, kinds, (int)c->L, knames, GDN_OK);
}

/* --out can take the checkpoints: a writable directory, or a new one in a writable directory
 * (gdn_ckpt_save makes it). Checked before step 1, so that no run trains and then cannot save. */
static int probe_out(const char *out) {
    struct stat st;
    if (!stat(out, &st)) {
        if (!S_ISDIR(st.st_mode))
            return gdn_fail(GDN_ERR_IO, "--out %s exists and is not a directory (%s): the checkpoints go into a "
                            "directory", out, S_ISREG(st.st_mode) ? "a regular file" : gdn_file_kind(st.st_mode));
        if (access(out, W_OK | X_OK))
            return gdn_fail(GDN_ERR_IO, "--out %s: cannot write into it (%s)", out, strerror(errno));
        return GDN_OK;
    }
    char parent[4096];
    snprintf(parent, sizeof parent, "%s", out);
    char *slash = strrchr(parent, '/');
    while (slash && slash > parent && slash[1] == 0) *slash = 0, slash = strrchr(parent, '/'); /* "dir/" */
    if (!slash) snprintf(parent, sizeof parent, ".");
    else if (slash == parent) parent[1] = 0;
    else *slash = 0;
    if (stat(parent, &st) || !S_ISDIR(st.st_mode))
        return gdn_fail(GDN_ERR_IO, "--out %s: its parent directory %s does not exist", out, parent);
    if (access(parent, W_OK | X_OK))
        return gdn_fail(GDN_ERR_IO, "--out %s: cannot create it in %s (%s)", out, parent, strerror(errno));
    return GDN_OK;
}

/* Digests of the weights every rank must agree on: [0] every tensor but the routed experts' (the
 * whole grid holds them), [1] the experts' this rank holds (its replicas hold the same). */
static void weights_digest(const trainer *t, int64_t wd[2]) {
    wd[0] = wd[1] = 0;
    gdn_model_tensor_info ti;
    for (int i = 0; i < gdn_model_tensor_count(&t->cfg); i++) {
        gdn_model_tensor(&t->cfg, i, &ti);
        const int64_t d = gdn_cp_digest(t->w + ti.offset, sizeof *t->w * ti.numel);
        int64_t *h = &wd[ti.experts_whole > 0];
        *h = (int64_t)((uint64_t)*h * 1099511628211ull ^ (uint64_t)d);
    }
}

/* Reduce on the group's rank 0, then broadcast: every rank of comm gets the same bits (an
 * all-reduce may round differently on different ranks, and the replicas would drift apart). */
static void sum_same_bits(float *x, int n, int rank_in, MPI_Comm comm) {
    if (n <= 0) return;
    MPI_Reduce(rank_in ? x : MPI_IN_PLACE, x, n, MPI_FLOAT, MPI_SUM, 0, comm);
    MPI_Bcast(x, n, MPI_FLOAT, 0, comm);
}

/* The gradients summed where their weights are shared: everything over the grid, and under
 * expert parallelism the routed experts' tensors only over the ranks holding the same slice
 * (each run of the flat array, padding included, goes to one kind of group). */
static void reduce_grads(trainer *t) {
    if (t->ep_size <= 1) {
        sum_same_bits(t->dw, (int)t->nw, t->rank, t->world);
        return;
    }
    int replica_rank;
    MPI_Comm_rank(t->replica_comm, &replica_rank);
    const int replicas_summed = t->o->fault != GDN_TRAIN_FAULT_EP_REPLICAS;
    gdn_model_tensor_info ti;
    size_t run = 0; /* the current run starts here */
    int kind = 0;   /* its kind: 0 shared by the grid, 1 an expert slice */
    const int n = gdn_model_tensor_count(&t->cfg);
    for (int i = 0; i <= n; i++) {
        int k = kind;
        size_t at = t->nw;
        if (i < n) {
            gdn_model_tensor(&t->cfg, i, &ti);
            k = ti.experts_whole > 0, at = ti.offset;
        }
        if (i < n && k == kind) continue;
        if (at > run) {
            if (!kind) sum_same_bits(t->dw + run, (int)(at - run), t->rank, t->world);
            else if (replicas_summed) sum_same_bits(t->dw + run, (int)(at - run), replica_rank, t->replica_comm);
        }
        run = at, kind = k;
    }
}

/* The gradient's norm over the whole model: under expert parallelism the experts' part summed
 * over the slices of the expert group (the same bits on every rank). */
static double grad_norm(trainer *t) {
    if (t->ep_size <= 1) return gdn_grad_norm(&t->cfg, t->dw);
    double s[2], experts = 0;
    gdn_grad_sumsq(&t->cfg, t->dw, s);
    MPI_Reduce(&s[1], &experts, 1, MPI_DOUBLE, MPI_SUM, 0, t->ep_comm);
    MPI_Bcast(&experts, 1, MPI_DOUBLE, 0, t->ep_comm);
    return sqrt(s[0] + experts);
}

static int setup(trainer *t) {
    const gdn_train_options *o = t->o;
    int rc = check_options(o, t->size);
    if ((rc = agree_options(t->agree, o, rc))) return rc;
    t->cp_size = o->cp, t->dp = t->size / o->cp;
    t->dp_index = t->rank / o->cp, t->cp_rank = t->rank % o->cp;
    MPI_Comm_split(t->world, t->dp_index, t->rank, &t->cp_comm);
    rc = gdn_cp_create(&t->cp, t->cp_comm, (gdn_cp_strategy)o->strategy);
    t->ep_size = o->ep > 1 ? o->ep : 1, t->ep_rank = t->rank % t->ep_size;
    if (!rc && t->ep_size > 1) {
        MPI_Comm_split(t->world, t->rank / t->ep_size, t->rank, &t->ep_comm);
        MPI_Comm_split(t->world, t->ep_rank, t->rank, &t->replica_comm);
        rc = gdn_ep_create(&t->ep, t->ep_comm);
        const int rc2 = gdn_cp_create(&t->replica_agree, t->replica_comm, GDN_CP_SCAN);
        if (!rc) rc = rc2;
    }
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    if (o->fault && o->fault != GDN_TRAIN_FAULT_AUX_PER_RANK) gdn_cp_set_fault(t->cp, o->fault);
    /* contiguous shards, the remainder spread over the first ranks */
    const int64_t base = o->seq / o->cp, extra = o->seq % o->cp;
    t->tn = base + (t->cp_rank < extra);
    t->t0 = t->cp_rank * base + (t->cp_rank < extra ? t->cp_rank : extra);

    /* the model: from a checkpoint, or the configuration given */
    char ckdir[4096] = "";
    const char *from = o->resume ? o->resume : o->init;
    t->cfg = o->model;
    if (from) {
        rc = gdn_ckpt_resolve(from, ckdir, sizeof ckdir);
        if (!rc) rc = gdn_ckpt_load_config(ckdir, &t->cfg);
        if (!rc && o->model_explicit) rc = check_model_flags(&t->cfg, &o->model, o->model_explicit, ckdir);
    } else {
        rc = gdn_model_config_check(&t->cfg);
    }
    if (!rc && o->router_aux_coef >= 0) /* the aux loss's coefficient is the run's choice, not the checkpoint's */
        t->cfg.router_aux = o->router_aux_coef > 0, t->cfg.router_aux_coef = o->router_aux_coef;
    if (!rc) rc = check_attn_cp(&t->cfg, o->attn_cp, t->cp_size);
    if (!rc && t->ep_size > 1) {
        if (!gdn_model_moe_layers(&t->cfg))
            rc = gdn_fail(GDN_ERR_ARG, "--ep %d: the model has no mixture-of-experts layers to split", t->ep_size);
        else if (t->cfg.n_experts % t->ep_size)
            rc = gdn_fail(GDN_ERR_ARG, "--ep %d does not divide the model's %lld experts (each rank of an expert "
                          "group holds as many)", t->ep_size, (long long)t->cfg.n_experts);
        t->cfg.ep_size = t->ep_size, t->cfg.ep_rank = t->ep_rank;
    }
    if (!rc && o->out) rc = probe_out(o->out);
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    if ((rc = agree_run(t))) return rc;
    t->nw = gdn_model_param_floats(&t->cfg);
    if (t->nw > (size_t)INT32_MAX) rc = gdn_fail(GDN_ERR_SHAPE, "%zu parameters: more than one MPI message holds", t->nw);
    const size_t bytes = sizeof(float) * ((t->nw + 15) & ~(size_t)15);
    if (!rc && !(t->w = gdn_alloc_large(bytes))) rc = gdn_fail(GDN_ERR_NOMEM, "parameters (%zu floats)", t->nw);
    if (!rc && !(t->dw = gdn_alloc_large(bytes))) rc = gdn_fail(GDN_ERR_NOMEM, "gradients (%zu floats)", t->nw);
    if (!rc && !(t->m = gdn_alloc_large_zeroed(bytes))) rc = gdn_fail(GDN_ERR_NOMEM, "AdamW moments (%zu floats)", t->nw);
    if (!rc && !(t->v = gdn_alloc_large_zeroed(bytes))) rc = gdn_fail(GDN_ERR_NOMEM, "AdamW moments (%zu floats)", t->nw);
    if (!rc && !(t->router = calloc(2 * (size_t)t->cfg.n_experts + 1, sizeof(double))))
        rc = gdn_fail(GDN_ERR_NOMEM, "the routers' statistics");
    if (!rc && !(t->load = calloc(2 * (size_t)(gdn_model_moe_layers(&t->cfg) * t->cfg.n_experts) + 1, sizeof(double))))
        rc = gdn_fail(GDN_ERR_NOMEM, "the experts' load");
    if (!rc) rc = gdn_data_open(&t->data, o->data, o->val_fraction, t->cfg.vocab);
    /* the separator as ids: --pack's bytes (byte text only), or --pack-id's one id */
    if (!rc && o->pack && gdn_data_is_tokens(t->data))
        rc = gdn_fail(GDN_ERR_ARG, "%s is a token file: --pack SEP gives a separator of bytes, for byte text; give "
                      "the token file's end-of-document id with --pack-id N", o->data);
    else if (!rc && o->pack_by_id && o->pack_id >= t->cfg.vocab)
        rc = gdn_fail(GDN_ERR_ARG, "--pack-id %d is outside the model's vocabulary [0, %lld)", (int)o->pack_id,
                      (long long)t->cfg.vocab);
    if (!rc && o->pack)
        for (int i = 0; i < o->pack_len; i++) t->sep[t->sep_len++] = o->pack[i];
    if (!rc && o->pack_by_id) t->sep[0] = o->pack_id, t->sep_len = 1;
    char *state = NULL;
    t->first_step = 1;
    if (!rc && from) {
        rc = gdn_ckpt_load(ckdir, &t->cfg, t->w, o->resume ? t->m : NULL, o->resume ? t->v : NULL,
                           o->resume ? &state : NULL);
        int64_t done = 0;
        if (!rc && o->resume && !(rc = check_resume_state(t, ckdir, state, &done))) t->first_step = done + 1;
        if (!rc && o->resume && done >= o->steps)
            rc = gdn_fail(GDN_ERR_ARG, "--resume %s: its checkpoint is at step %lld, at or past --steps %lld: nothing "
                          "to train (raise --steps to train on)", o->resume, (long long)done, (long long)o->steps);
    } else if (!rc) {
        gdn_model_init(&t->cfg, t->w, o->seed);
    }
    free(state);
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    /* the same starting weights everywhere (an --init or --resume of another checkpoint with the
     * same configuration would otherwise train from different points and sum their gradients) */
    int64_t wd[2];
    weights_digest(t, wd);
    static const char *const wname[] = {"the starting weights (a digest of --init / --resume's model.safetensors)"};
    if ((rc = gdn_cp_agree_values(t->agree, wd, 1, wname, GDN_OK))) return rc;
    static const char *const ename[] = {"the starting weights of this rank's experts (a digest)"};
    if (t->replica_agree) rc = gdn_cp_agree_values(t->replica_agree, wd + 1, 1, ename, GDN_OK);
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;

    /* every window of seq + 1 tokens must fit each split it is drawn from */
    const int64_t need = o->seq + 1, tl = gdn_data_split_len(t->data, GDN_SPLIT_TRAIN),
                  vl = gdn_data_split_len(t->data, GDN_SPLIT_VAL);
    if (tl < need)
        rc = gdn_fail(GDN_ERR_SHAPE, "the training split of %s has %lld %s; a sequence of --seq %lld needs %lld",
                      o->data, (long long)tl, gdn_data_is_tokens(t->data) ? "tokens" : "bytes", (long long)o->seq,
                      (long long)need);
    else if (o->eval_every && vl < need)
        rc = gdn_fail(GDN_ERR_SHAPE, "the validation split of %s has %lld %s; a sequence of --seq %lld needs "
                      "%lld (raise --val-fraction, or --eval-every 0)", o->data, (long long)vl,
                      gdn_data_is_tokens(t->data) ? "tokens" : "bytes", (long long)o->seq, (long long)need);
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;

    /* threads: the node's cores shared among its ranks */
    MPI_Comm node;
    int local = 1;
    MPI_Comm_split_type(t->world, MPI_COMM_TYPE_SHARED, t->rank, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &local);
    MPI_Comm_free(&node);
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    t->threads = o->threads > 0 ? o->threads : (int)(cores / local > 0 ? cores / local : 1);
    /* every rank of the job on this node counts (the CP groups' own count misses the DP ones):
     * more threads than cores, and a waiting rank must not spin (gdn_cp_set_wait) */
    int sleep_wait = (long)local * t->threads > cores;
    MPI_Allreduce(MPI_IN_PLACE, &sleep_wait, 1, MPI_INT, MPI_MAX, t->world); /* one mode everywhere */
    const int mode = sleep_wait ? GDN_CP_WAIT_SLEEP : GDN_CP_WAIT_SPIN;
    if ((rc = gdn_cp_set_wait(t->cp, mode)) || (rc = gdn_cp_set_wait(t->agree, mode))) return rc;
    /* recompute when the kept activations of every rank on this node would take more than
     * half of the memory the node has free */
    gdn_model_run run = {.B = o->batch, .T = t->tn, .threads = t->threads, .recompute = 0, .check_finite = 1,
                         .pack = t->sep_len > 0, .attn_cp = o->attn_cp, .compute = o->compute};
    t->recompute = o->recompute;
    if (t->recompute < 0) {
        const double need_bytes = gdn_model_plan_estimate(&t->cfg, &run) * local;
        const double avail = (double)sysconf(_SC_AVPHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
        int r = need_bytes > 0.5 * avail;
        MPI_Allreduce(MPI_IN_PLACE, &r, 1, MPI_INT, MPI_MAX, t->world);
        t->recompute = r;
    }
    run.recompute = t->recompute;
    rc = gdn_model_plan_create(&t->plan, &t->cfg, &run, t->cp_size > 1 ? t->cp : NULL);
    if (!rc && t->ep) rc = gdn_model_plan_set_experts(t->plan, t->ep);
    if (!rc && !(t->tokens = malloc(sizeof *t->tokens * (size_t)(o->batch * (t->tn + 1)))))
        rc = gdn_fail(GDN_ERR_NOMEM, "token buffer");
    if (!rc && t->sep_len) {
        t->window = malloc(sizeof *t->window * (size_t)(o->seq + t->sep_len));
        t->doc_cu = malloc(sizeof(int64_t) * (size_t)(o->batch * (o->seq + 2)));
        t->n_docs = malloc(sizeof(int64_t) * (size_t)o->batch);
        if (!t->window || !t->doc_cu || !t->n_docs)
            rc = gdn_fail(GDN_ERR_NOMEM, "document tables for --pack (%lld rows of %lld bytes)", (long long)o->batch,
                          (long long)o->seq);
    }
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;

    t->flops_per_token = gdn_model_train_flops_per_token(&t->cfg, o->seq);
    t->peak_gflops = measure_peak(t, (int)(cores < (long)t->threads * local ? cores : (long)t->threads * local));
    if (t->rank == 0 && o->log_csv) {
        /* a resumed run appends to its log; a new run starts it */
        t->csv = fopen(o->log_csv, t->first_step > 1 ? "a" : "w");
        if (!t->csv) rc = gdn_fail(GDN_ERR_IO, "cannot write the log %s", o->log_csv);
        else if (t->first_step == 1 || ftell(t->csv) == 0)
            fprintf(t->csv, "step,loss,val_loss,tokens_per_s,peak_rss_mb,lr,grad_norm,ms_per_step,aux_loss\n");
    }
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    if (t->progress) {
        gdn_model_config whole = t->cfg;
        whole.ep_size = 0, whole.ep_rank = 0;
        char ep_note[128] = "";
        if (t->ep_size > 1)
            snprintf(ep_note, sizeof ep_note, " x EP %d (%zu parameters on each rank)", t->ep_size,
                     gdn_model_param_count(&t->cfg));
        fprintf(t->progress,
                "gdncp train: %zu parameters (E=%lld, %lld layers, %s=%lld, Hk=%lld Hv=%lld K=%lld V=%lld), "
                "grid DP %d x CP %d%s (%s), %lld sequences of %lld tokens per step (%lld per rank), %d thread%s "
                "per rank%s, recompute %s, %s %s (%lld + %lld %s)%s%s\n",
                gdn_model_param_count(&whole), (long long)t->cfg.E, (long long)t->cfg.L,
                /* every MLP a mixture of experts: their width (the dense I is unused) */
                gdn_model_moe_layers(&t->cfg) == t->cfg.L ? "moe I" : "I",
                (long long)(gdn_model_moe_layers(&t->cfg) == t->cfg.L ? t->cfg.moe_I : t->cfg.I),
                (long long)t->cfg.Hk, (long long)t->cfg.Hv, (long long)t->cfg.K, (long long)t->cfg.V, t->dp,
                t->cp_size, ep_note, gdn_cp_strategy_name((gdn_cp_strategy)o->strategy), (long long)(o->batch * t->dp),
                (long long)o->seq, (long long)t->tn, t->threads, t->threads > 1 ? "s" : "",
                gdn_cp_get_wait(t->cp) == GDN_CP_WAIT_SLEEP ? " (more than the cores: waits sleep)" : "", t->recompute ? "on" : "off", gdn_data_is_tokens(t->data) ? "token file" : "text", o->data,
                (long long)tl, (long long)vl, gdn_data_is_tokens(t->data) ? "tokens" : "bytes",
                from ? (o->resume ? ", resumed from " : ", weights from ") : "", from ? ckdir : "");
        const int64_t na = gdn_model_attn_layers(&t->cfg);
        if (na) {
            char kinds[GDN_MODEL_MAX_LAYERS + 1];
            for (int64_t l = 0; l < t->cfg.L; l++) kinds[l] = t->cfg.full_attention[l] ? 'F' : 'L';
            kinds[t->cfg.L] = 0;
            fprintf(t->progress, "gdncp train: hybrid, %lld GatedDeltaNet + %lld full-attention layers (%s: L linear, F "
                    "full), attention H=%lld Hkv=%lld d=%lld R=%lld rope_theta %g, attention CP %s\n",
                    (long long)(t->cfg.L - na), (long long)na, kinds, (long long)t->cfg.H, (long long)t->cfg.Hkv,
                    (long long)t->cfg.d, (long long)t->cfg.R, t->cfg.rope_theta, gdn_attn_cp_strategy_name(o->attn_cp));
        } else {
            fprintf(t->progress, "gdncp train: GatedDeltaNet layers only (no attention)\n");
        }
        const int64_t nm = gdn_model_moe_layers(&t->cfg);
        char aux[96] = "aux loss off";
        if (t->cfg.router_aux) snprintf(aux, sizeof aux, "aux loss x %g over the DP x CP batch", t->cfg.router_aux_coef);
        if (nm)
            fprintf(t->progress, "gdncp train: %lld of %lld MLPs a mixture of %lld experts, %lld per token (I %lld), "
                    "shared expert I %lld, %srenormalised; %s\n", (long long)nm, (long long)t->cfg.L,
                    (long long)t->cfg.n_experts, (long long)t->cfg.top_k, (long long)t->cfg.moe_I,
                    (long long)t->cfg.shared_I, t->cfg.norm_topk ? "" : "not ", aux);
        fprintf(t->progress, "gdncp train: %.3g FLOP per token (6 x active non-embedding parameters + the kernel's + the attention core's), "
                "measured peak %.1f GFLOP/s on the cores in use\n", t->flops_per_token, t->peak_gflops);
        fprintf(t->progress, "gdncp train: compute %s: products on %s%s\n", gdn_compute_name(o->compute),
                gdn_compute_path(o->compute),
                o->compute == GDN_COMPUTE_BF16 ? " (fp32 master weights, moments, loss, norms and recurrent state)" : "");
        if (gdn_data_is_tokens(t->data))
            fprintf(t->progress, "gdncp train: token file of uint%d ids, header vocabulary %lld, model vocabulary "
                    "%lld\n", 8 * gdn_data_width(t->data), (long long)gdn_data_file_vocab(t->data),
                    (long long)t->cfg.vocab);
        if (o->pack_by_id)
            fprintf(t->progress, "gdncp train: packed documents, each ending with the id %d: the state and the conv "
                    "restart after it, and the token after it is not predicted\n", (int)o->pack_id);
        if (o->pack) {
            char hex[2 * GDN_DATA_MAX_SEP + 1];
            pack_hex(o, hex);
            fprintf(t->progress, "gdncp train: packed documents, each ending with the %d byte%s %s (hex): the "
                    "state and the conv restart after it, and the byte after it is not predicted\n", o->pack_len,
                    o->pack_len > 1 ? "s" : "", hex);
        }
        fflush(t->progress);
    }
    return GDN_OK;
}

/* h:mm:ss (or m:ss) of a duration in seconds. */
static void fmt_duration(char *buf, size_t n, double secs) {
    const long s = secs > 0 && secs < 1e9 ? (long)(secs + 0.5) : 0;
    if (s >= 3600) snprintf(buf, n, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
    else snprintf(buf, n, "%ld:%02ld", s / 60, s % 60);
}
/* Rank 0 with --progress line: erase the status line before a full line is printed. */
static void clear_status(trainer *t) {
    if (t->progress && t->o->progress_line && t->status_shown) fputs("\r\033[K", t->progress), t->status_shown = 0;
}

/* Under expert parallelism a checkpoint still holds every expert (transformers' layout): the first
 * expert group (world ranks [0, ep)) gathers its slices of the weights and moments on rank 0, which
 * holds the whole model only while it saves. whole: the config without the split. */
static int gather_whole(trainer *t, gdn_model_config *whole, float **wf, float **mf, float **vf) {
    *whole = t->cfg;
    whole->ep_size = 0, whole->ep_rank = 0;
    const size_t nwf = gdn_model_param_floats(whole);
    int rc = GDN_OK;
    if (t->rank == 0) {
        *wf = calloc(nwf, sizeof(float)), *mf = calloc(nwf, sizeof(float)), *vf = calloc(nwf, sizeof(float));
        if (!*wf || !*mf || !*vf) rc = gdn_fail(GDN_ERR_NOMEM, "checkpoint: the whole model's weights and moments "
                                                "(3 x %zu floats) to gather the experts' slices into", nwf);
    }
    int worst = rc;
    MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, t->ep_comm);
    if (worst) return rc ? rc : gdn_fail(worst, "checkpoint: rank 0 could not gather the experts' slices");
    gdn_model_tensor_info li, wi;
    float *const local[3] = {t->w, t->m, t->v}, *const all[3] = {*wf, *mf, *vf};
    for (int i = 0; i < gdn_model_tensor_count(&t->cfg); i++) {
        gdn_model_tensor(&t->cfg, i, &li);
        gdn_model_tensor(whole, i, &wi);
        for (int a = 0; a < 3; a++)
            if (li.experts_whole) /* slice r holds experts [r n / ep, (r + 1) n / ep): rank order */
                MPI_Gather(local[a] + li.offset, (int)li.numel, MPI_FLOAT, t->rank ? NULL : all[a] + wi.offset,
                           (int)li.numel, MPI_FLOAT, 0, t->ep_comm);
            else if (t->rank == 0)
                memcpy(all[a] + wi.offset, local[a] + li.offset, sizeof(float) * li.numel);
    }
    return GDN_OK;
}

static int save(trainer *t, int64_t step, double loss) {
    int rc = GDN_OK;
    gdn_model_config whole = t->cfg;
    float *wf = NULL, *mf = NULL, *vf = NULL;
    if (t->ep_size > 1 && t->rank < t->ep_size) rc = gather_whole(t, &whole, &wf, &mf, &vf);
    if (t->rank == 0 && !rc) {
        char *st = state_json(t, step, loss);
        rc = st ? gdn_ckpt_save_dtype(t->o->out, step, &whole, wf ? wf : t->w, wf ? mf : t->m, wf ? vf : t->v, st,
                                      t->o->keep_last, t->o->save_dtype)
                : gdn_fail(GDN_ERR_NOMEM, "trainer state");
        free(st);
        if (!rc && t->progress) {
            clear_status(t);
            fprintf(t->progress, "checkpoint: %s/checkpoint-%08lld\n", t->o->out, (long long)step);
            fflush(t->progress);
        }
    }
    free(wf), free(mf), free(vf);
    return gdn_cp_agree_status(t->agree, rc);
}

/* The time per step by layer type, mean over the steps run: each rank's seconds in its
 * GatedDeltaNet and attention mixers (forward + backward, their CP waits included), the mean over
 * ranks with the range; the rest is the step (the slowest rank's) minus the mean of both. */
static void layer_type_times(trainer *t, const double mixer_sum[4], double step_sum, int64_t steps) {
    if (steps < 1) return;
    /* per rank: GatedDeltaNet forward, backward, both; attention forward, backward, both */
    const double v[6] = {mixer_sum[0], mixer_sum[1], mixer_sum[0] + mixer_sum[1],
                         mixer_sum[2], mixer_sum[3], mixer_sum[2] + mixer_sum[3]};
    double mean[6], lo[6], hi[6];
    MPI_Allreduce(v, mean, 6, MPI_DOUBLE, MPI_SUM, t->world);
    MPI_Allreduce(v, lo, 6, MPI_DOUBLE, MPI_MIN, t->world);
    MPI_Allreduce(v, hi, 6, MPI_DOUBLE, MPI_MAX, t->world);
    if (!t->progress) return;
    const double per = 1.0 / (double)steps;
    for (int i = 0; i < 6; i++) mean[i] *= per / (double)t->size, lo[i] *= per, hi[i] *= per;
    clear_status(t);
    fprintf(t->progress, "gdncp train: time per step by layer type (mean of %lld steps; over %d ranks: mean, "
                         "min-max): GatedDeltaNet layers %.3f s (forward %.3f, backward %.3f; %.3f-%.3f), attention "
                         "layers %.3f s (forward %.3f, backward %.3f; %.3f-%.3f), the rest %.3f s of %.3f s\n",
            (long long)steps, t->size, mean[2], mean[0], mean[1], lo[2], hi[2], mean[5], mean[3], mean[4], lo[5], hi[5],
            step_sum * per - mean[2] - mean[5], step_sum * per);
    fflush(t->progress);
}

/* The experts' load over the steps run, summed over every rank: per MoE layer the (token, slot)
 * choices per expert, min / mean / max and the busiest expert's share over the mean (1.00:
 * balanced), the aux loss's target. */
static void expert_load(trainer *t) {
    const int64_t nm = gdn_model_moe_layers(&t->cfg), n = t->cfg.n_experts;
    if (!nm) return;
    double *c = t->load, *all = t->load + nm * n;
    gdn_model_expert_load(t->plan, c, 1);
    MPI_Reduce(c, all, (int)(nm * n), MPI_DOUBLE, MPI_SUM, 0, t->world);
    if (t->progress) {
        clear_status(t);
        fprintf(t->progress, "gdncp train: expert load (tokens x slots per expert over the run, all ranks):");
        for (int64_t m = 0, l = 0; m < nm; m++, l++) {
            while (!t->cfg.moe[l]) l++;
            double lo = INFINITY, hi = 0, sum = 0;
            for (int64_t e = 0; e < n; e++) {
                const double v = all[m * n + e];
                lo = v < lo ? v : lo, hi = v > hi ? v : hi, sum += v;
            }
            const double mean = sum / (double)n;
            fprintf(t->progress, "%s layer %lld min %.0f mean %.1f max %.0f (%.2fx)", m ? ";" : "", (long long)l, lo,
                    mean, hi, mean > 0 ? hi / mean : 0.0);
        }
        fprintf(t->progress, "\n");
        fflush(t->progress);
    }
}

/* Expert parallelism over the run: what each rank holds of the experts, what its all-to-alls
 * moved and waited, and how evenly the rows fell on the ranks (the busiest rank's rows over the
 * mean: the experts' GEMMs wait for it). */
static void expert_parallel_summary(trainer *t, int64_t steps) {
    if (!t->ep || steps < 1) return;
    gdn_ep_stats st;
    gdn_ep_get_stats(t->ep, &st, 1);
    double expert_floats = 0, all_floats = 0;
    gdn_model_tensor_info ti;
    for (int i = 0; i < gdn_model_tensor_count(&t->cfg); i++) {
        gdn_model_tensor(&t->cfg, i, &ti);
        all_floats += (double)ti.numel;
        if (ti.experts_whole) expert_floats += (double)ti.numel;
    }
    const double mine[5] = {st.exchange_s, st.experts_s, st.bytes_sent + st.bytes_recv, st.rows_owned, expert_floats};
    double *all = t->rank == 0 ? malloc(sizeof mine * (size_t)t->size) : NULL;
    MPI_Gather(mine, 5, MPI_DOUBLE, all, 5, MPI_DOUBLE, 0, t->world);
    if (!all) return;
    if (t->progress) {
        double mx[5] = {0}, mean[5] = {0};
        for (int r = 0; r < t->size; r++)
            for (int k = 0; k < 5; k++) {
                const double v = all[5 * r + k];
                mx[k] = v > mx[k] ? v : mx[k], mean[k] += v / (double)t->size;
            }
        const double whole = all_floats + expert_floats * (double)(t->ep_size - 1);
        const double per_step = 1.0 / (double)steps;
        clear_status(t);
        fprintf(t->progress,
                "gdncp train: expert parallelism over %d ranks per group: %lld of %lld experts per MoE layer on each "
                "rank: %.0f expert parameters and %.0f in all, %.3f of the whole model's %.0f (weights, gradients and "
                "moments alike); per step and rank (mean, max): all-to-all wait %.4f s, %.4f s, bytes %.3g, %.3g, "
                "the experts' GEMMs on the rows they own %.4f s, %.4f s; rows imbalance (busiest rank / mean) %.2fx\n",
                t->ep_size, (long long)(t->cfg.n_experts / t->ep_size), (long long)t->cfg.n_experts, mean[4],
                all_floats, all_floats / whole, whole, mean[0] * per_step, mx[0] * per_step, mean[2] * per_step,
                mx[2] * per_step, mean[1] * per_step, mx[1] * per_step, mean[3] > 0 ? mx[3] / mean[3] : 0.0);
        fflush(t->progress);
    }
    free(all);
}

static int train_steps(trainer *t) {
    const gdn_train_options *o = t->o;
    const double t_start = MPI_Wtime();
    const double tokens_per_step = (double)(o->batch * t->dp) * (double)o->seq;
    double loss = NAN;
    int rc = GDN_OK;
    double mixer_sum[4] = {0}, step_sum = 0; /* this rank's seconds in each kind of mixer; steps' */
    for (int64_t step = t->first_step; step <= o->steps; step++) {
        const double t_begin = MPI_Wtime();
        int64_t targets = 0;
        double denom = 0;
        rc = read_batch(t, GDN_SPLIT_TRAIN, step, t->dp_index * o->batch, &targets);
        if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
        if ((rc = gdn_cp_agree_status(t->agree, grid_targets(t, targets, &denom)))) return rc;
        double ls = 0, aux = 0;
        rc = gdn_model_forward(t->plan, t->w, t->tokens, denom, &ls, 1);
        if (gdn_model_moe_layers(&t->cfg)) { /* every DP group's forward done before the world's sum */
            if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
            rc = grid_router_stats(t, &aux);
        }
        if (!rc) rc = gdn_model_backward(t->plan, t->w, t->dw, t->tokens);
        /* a failure inside is its CP group's; make it every DP group's before the reduction */
        if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
        reduce_grads(t);
        loss = world_sum(t, ls) / denom + (t->cfg.router_aux ? t->cfg.router_aux_coef * aux : 0.0);
        const double gnorm = grad_norm(t);
        if (!isfinite(loss) || !isfinite(gnorm))
            return gdn_fail(GDN_ERR_NONFINITE, "step %lld: the loss (%g) or gradient norm (%g) is not finite: "
                            "training diverged (lower --lr)", (long long)step, loss, gnorm);
        const double lr = gdn_adamw_lr(&o->opt, step);
        const double scale = o->opt.clip > 0 && gnorm > o->opt.clip ? o->opt.clip / gnorm : 1.0;
        gdn_adamw_update(&o->opt, &t->cfg, t->w, t->dw, t->m, t->v, step, lr, scale, t->threads);
        double dt = MPI_Wtime() - t_begin;
        MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, t->world);
        double ms[4];
        gdn_model_mixer_seconds(t->plan, ms, 1);
        for (int i = 0; i < 4; i++) mixer_sum[i] += ms[i];
        step_sum += dt;

        double val = NAN;
        if (o->eval_every && (step % o->eval_every == 0 || step == o->steps)) {
            if ((rc = evaluate(t, &val))) return rc;
            gdn_model_mixer_seconds(t->plan, ms, 1); /* (validation's forwards are not a step's) */
        }
        /* peak memory of every rank, for the progress line */
        double rss = gdn_peak_rss_mb();
        double *all = t->rank == 0 ? malloc(sizeof(double) * (size_t)t->size) : NULL;
        MPI_Gather(&rss, 1, MPI_DOUBLE, all, 1, MPI_DOUBLE, 0, t->world);
        if (t->rank == 0) {
            double rmax = 0;
            for (int r = 0; r < t->size; r++) rmax = all[r] > rmax ? all[r] : rmax;
            const double tps = tokens_per_step / dt, frac = tps * t->flops_per_token / (t->peak_gflops * 1e9);
            const int full = o->log_every <= 1 || step % o->log_every == 0 || step == t->first_step ||
                             step == o->steps || !isnan(val);
            if (t->progress && !full && o->progress_line) {
                char el[32], eta[32];
                const double elapsed = MPI_Wtime() - t_start;
                fmt_duration(el, sizeof el, elapsed);
                fmt_duration(eta, sizeof eta, elapsed / (double)(step - t->first_step + 1) * (double)(o->steps - step));
                fprintf(t->progress, "\rstep %5lld/%lld  loss %.4f  %8.0f tok/s  elapsed %s  ETA %s\033[K",
                        (long long)step, (long long)o->steps, loss, tps, el, eta);
                fflush(t->progress);
                t->status_shown = 1;
            }
            if (t->progress && full) {
                clear_status(t);
                fprintf(t->progress, "step %5lld/%lld  loss %.4f", (long long)step, (long long)o->steps, loss);
                if (!isnan(val)) fprintf(t->progress, "  val %.4f", val);
                if (gdn_model_moe_layers(&t->cfg)) fprintf(t->progress, "  aux %.4f", aux);
                fprintf(t->progress, "  %8.0f tok/s  %7.1f ms/step  lr %.2e  gnorm %.3f  %4.1f%% of peak  rss MB",
                        tps, 1e3 * dt, lr, gnorm, 100 * frac);
                if (t->size <= 8)
                    for (int r = 0; r < t->size; r++) fprintf(t->progress, " %.0f", all[r]);
                else
                    fprintf(t->progress, " max %.0f over %d ranks", rmax, t->size);
                fprintf(t->progress, "\n");
                fflush(t->progress);
            }
            if (t->csv) {
                fprintf(t->csv, "%lld,%.6f,", (long long)step, loss);
                if (!isnan(val)) fprintf(t->csv, "%.6f", val);
                fprintf(t->csv, ",%.1f,%.1f,%.6g,%.6g,%.2f,", tps, rmax, lr, gnorm, 1e3 * dt);
                if (gdn_model_moe_layers(&t->cfg)) fprintf(t->csv, "%.6f", aux);
                fprintf(t->csv, "\n");
                fflush(t->csv);
            }
        }
        free(all);
        if (o->out && ((o->save_every && step % o->save_every == 0) || step == o->steps))
            if ((rc = save(t, step, loss))) return rc;
    }
    layer_type_times(t, mixer_sum, step_sum, o->steps - t->first_step + 1);
    expert_load(t);
    expert_parallel_summary(t, o->steps - t->first_step + 1);
    return GDN_OK;
}

int gdn_train(MPI_Comm world, const gdn_train_options *o, FILE *progress) {
    trainer t;
    memset(&t, 0, sizeof t);
    t.o = o, t.world = world, t.cp_comm = t.ep_comm = t.replica_comm = MPI_COMM_NULL;
    MPI_Comm_rank(world, &t.rank);
    MPI_Comm_size(world, &t.size);
    t.progress = t.rank == 0 ? progress : NULL;
    int rc = gdn_cp_create(&t.agree, world, GDN_CP_SCAN);
    if (rc) return rc;
    rc = setup(&t);
    if (!rc) rc = train_steps(&t);
    rc = gdn_cp_agree_status(t.agree, rc);
    if (t.csv) fclose(t.csv);
    gdn_model_plan_destroy(t.plan);
    gdn_data_close(t.data);
    gdn_cp_destroy(t.cp);
    gdn_cp_destroy(t.agree);
    gdn_ep_destroy(t.ep);
    gdn_cp_destroy(t.replica_agree);
    if (t.cp_comm != MPI_COMM_NULL) MPI_Comm_free(&t.cp_comm);
    if (t.ep_comm != MPI_COMM_NULL) MPI_Comm_free(&t.ep_comm);
    if (t.replica_comm != MPI_COMM_NULL) MPI_Comm_free(&t.replica_comm);
    free(t.w), free(t.dw), free(t.m), free(t.v), free(t.router), free(t.load), free(t.tokens), free(t.window), free(t.doc_cu), free(t.n_docs);
    return rc;
}
