/* The trainer's set-up (train.h): the options checked and agreed over the ranks, the grid and its
 * communicators, the model from a checkpoint or a seed, the starting weights agreed. */
#include "trainer_internal.h"

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
    if (o->zero < 0 || o->zero > 3) return gdn_fail(GDN_ERR_ARG, "--zero %d: the levels are 0, 1, 2 and 3", o->zero);
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
void gdn_trainer_pack_hex(const gdn_train_options *o, char out[2 * GDN_DATA_MAX_SEP + 1]) {
    out[0] = 0;
    for (int i = 0; o->pack && i < o->pack_len; i++) snprintf(out + 2 * i, 3, "%02x", o->pack[i]);
}

/* Packed by one id: that id; else -1. */
int64_t gdn_trainer_pack_id(const gdn_train_options *o) { return o->pack_by_id ? (int64_t)o->pack_id : -1; }

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
    gdn_trainer_pack_hex(t->o, hex);
    const int pack_differs = strcmp(was_hex, hex) != 0;
    json_t *id_in_json = json_object_get(j, "pack_separator_id");
    const int64_t was_id = json_is_integer(id_in_json) ? (int64_t)json_integer_value(id_in_json) : -1;
    json_decref(j);
    if (bad[0]) return gdn_fail(GDN_ERR_FORMAT, "%s/trainer_state.json %s", dir, bad);
    if (pack_differs)
        return gdn_fail(GDN_ERR_ARG, "cannot resume: the checkpoint was trained with a different --pack separator "
                        "(hex '%s'; this run has '%s')", was_hex, hex);
    if (was_id != gdn_trainer_pack_id(t->o))
        return gdn_fail(GDN_ERR_ARG, "cannot resume: the checkpoint was trained with --pack-id %lld, this run has "
                        "%lld (-1: none)", (long long)was_id, (long long)gdn_trainer_pack_id(t->o));
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
#define N_AGREED 24

static int agree_options(gdn_cp *agree, const gdn_train_options *o, int rc) {
    const int64_t sep_hash = o->pack ? gdn_cp_digest(o->pack, (size_t)(o->pack_len < GDN_DATA_MAX_SEP ? o->pack_len
                                                                                         : GDN_DATA_MAX_SEP)) : 0;
    int64_t aux_bits;
    memcpy(&aux_bits, &o->router_aux_coef, sizeof aux_bits);
    const int64_t vals[N_AGREED] = {o->cp, o->seq, o->batch, o->steps, (int64_t)o->seed, o->strategy,
                            o->recompute, o->save_every, o->eval_every, o->eval_seqs,
                            o->resume != NULL, o->init != NULL, o->out != NULL,
                            o->pack ? o->pack_len : 0, (int64_t)sep_hash, o->attn_cp, o->pack_by_id,
                            o->pack_by_id ? (int64_t)o->pack_id : 0, o->model.vocab, o->compute, aux_bits,
                            o->ep > 1 ? o->ep : 1, o->zero, o->dry_run};
    static const char *const names[] = {"--cp", "--seq", "--batch", "--steps", "--seed", "--strategy",
                                        "--recompute", "--save-every", "--eval-every", "--eval-seqs",
                                        "--resume", "--init", "--out", "--pack (length)",
                                        "--pack (bytes)", "--attn-cp", "--pack-id (given)", "--pack-id", "--vocab",
                                        "--compute (0 fp32, 1 bf16)", "--router-aux-coef (its bits)", "--ep", "--zero", "--dry-run"};
    return gdn_cp_agree_values(agree, vals, N_AGREED, names, rc);
}

int gdn_train_fail(MPI_Comm world, int status) {
    gdn_cp *agree = NULL;
    if (gdn_cp_create(&agree, world)) return status;
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
        {"num_experts_per_tok", "--experts-per-tok", ck->top_k, want->top_k, 0, GDN_GIVEN_EXPERTS_PER_TOK},
        {"moe_intermediate_size", "--moe-intermediate", ck->moe_I, want->moe_I, 0, GDN_GIVEN_MOE_INTERMEDIATE},
        {"shared_expert_intermediate_size", "--shared-intermediate", ck->shared_I, want->shared_I, 0,
         GDN_GIVEN_SHARED_INTERMEDIATE},
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
    /* a rank that cannot read its --data says so (not a digest of -1 beside the others') */
    errno = 0;
    const int64_t data = gdn_cp_digest_file(t->o->data);
    const int local = data >= 0 ? GDN_OK
                                : gdn_fail(GDN_ERR_IO, "--data %s: cannot read it: %s", t->o->data,
                                           errno ? strerror(errno) : "a read error");
    const int64_t vals[] = {c->vocab, c->E, c->L, c->I, c->Hk, c->Hv, c->K, c->V, c->Kc, c->H, c->Hkv, c->d, c->R,
                            f64_bits(c->rope_theta), c->max_position, f64_bits(c->eps), c->tie_embeddings,
                            c->n_experts, c->top_k, c->moe_I, c->shared_I, c->norm_topk,
                            c->router_aux, f64_bits(c->router_aux_coef), f64_bits(a->lr), f64_bits(a->min_lr),
                            a->warmup, f64_bits(a->beta1), f64_bits(a->beta2), f64_bits(a->eps),
                            f64_bits(a->weight_decay), f64_bits(a->clip), f64_bits(t->o->val_fraction),
                            data};
    static const char *const names[] = {
        "vocab_size (--vocab)", "hidden_size (--hidden)", "num_hidden_layers (--layers)", "intermediate_size (--intermediate)",
        "linear_num_key_heads (--key-heads)", "linear_num_value_heads (--value-heads)", "linear_key_head_dim (--key-dim)",
        "linear_value_head_dim (--value-dim)", "linear_conv_kernel_dim (--conv)", "num_attention_heads (--attn-heads)",
        "num_key_value_heads (--kv-heads)", "head_dim (--head-dim)", "the rotary dims", "rope_theta (its bits)",
        "max_position_embeddings", "rms_norm_eps (its bits)", "tie_word_embeddings", "num_experts (--experts)", "num_experts_per_tok (--experts-per-tok)", "moe_intermediate_size (--moe-intermediate)",
        "shared_expert_intermediate_size (--shared-intermediate)", "norm_topk_prob", "the aux loss on (--router-aux-coef)",
        "router_aux_loss_coef (--router-aux-coef; its bits)", "--lr (its bits)", "--min-lr (its bits)", "--warmup",
        "--beta1 (its bits)", "--beta2 (its bits)", "AdamW's eps (its bits)", "--weight-decay (its bits)",
        "--clip (its bits)", "--val-fraction (its bits)", "the --data file (a digest of every byte)"};
    _Static_assert(sizeof vals / sizeof vals[0] == sizeof names / sizeof names[0], "one name per agreed value");
    int rc = gdn_cp_agree_values(t->agree, vals, local ? 0 : (int)(sizeof vals / sizeof vals[0]), names, local);
    if (rc) return rc;
    /* each layer's kind: its mixer (0 GatedDeltaNet, 1 full attention) + 2 for an MoE MLP (L, the
     * same on every rank now) */
    int64_t kinds[GDN_MODEL_MAX_LAYERS];
    static char label[GDN_MODEL_MAX_LAYERS][96];
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

static int weight_file(const struct dirent *d) {
    return !strcmp(d->d_name, "model.safetensors") || !fnmatch("model-*-of-*.safetensors", d->d_name, 0);
}

int64_t gdn_train_checkpoint_digest(const char *dir) {
    struct dirent **names = NULL;
    const int n = dir ? scandir(dir, &names, weight_file, alphasort) : -1;
    uint64_t h = 1469598103934665603ull;
    int bad = n <= 0;
    char path[4400];
    for (int i = 0; i < (n > 0 ? n : 0); i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]->d_name);
        const int64_t d = bad ? -1 : gdn_cp_digest_file(path);
        bad |= d < 0;
        h = (h ^ (uint64_t)d) * 1099511628211ull;
        free(names[i]);
    }
    free(names);
    return bad ? -1 : (int64_t)(h >> 1);
}

/* This run's id on rank 0 (every rank gets it from there): a resume continues its checkpoint's
 * ("" for one from before run ids), a new run draws 64 random bits. */
static void draw_run_id(trainer *t, const char *resumed_dir) {
    t->run_id[0] = 0;
    if (resumed_dir) {
        char path[4200];
        snprintf(path, sizeof path, "%s/trainer_state.json", resumed_dir);
        json_t *j = json_load_file(path, 0, NULL);
        const char *v = json_string_value(json_object_get(j, "run_id"));
        if (v) snprintf(t->run_id, sizeof t->run_id, "%s", v);
        json_decref(j);
        return;
    }
    uint64_t r = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(&r, sizeof r, 1, f) != 1) r = (uint64_t)time(NULL) * 6364136223846793005ull ^ (uint64_t)getpid();
    if (f) fclose(f);
    snprintf(t->run_id, sizeof t->run_id, "%016llx", (unsigned long long)r);
}

/* Digests of an array in the weights' layout (the weights, or level 0's whole moments) that
 * replicas must hold alike, every tensor's own (never the padding), mixed into wd: [0] every
 * tensor but the routed experts' (the whole grid holds them), [1] the experts' this rank holds
 * (under --ep its replicas hold the same; without --ep every rank does, so they join [0]). */
static void replicated_digest(const trainer *t, const float *a, int64_t wd[2]) {
    gdn_model_tensor_info ti;
    for (int i = 0; i < gdn_model_tensor_count(&t->cfg); i++) {
        gdn_model_tensor(&t->cfg, i, &ti);
        const int64_t d = gdn_cp_digest(a + ti.offset, sizeof *a * ti.numel);
        int64_t *h = &wd[ti.experts_whole > 0 && t->ep_size > 1];
        *h = (int64_t)((uint64_t)*h * 1099511628211ull ^ (uint64_t)d);
    }
}

/* What the model's plan is asked for (the rows, this rank's shard, the threads, ...). */
static gdn_model_run plan_run(const trainer *t) {
    const gdn_train_options *o = t->o;
    return (gdn_model_run){.B = o->batch, .T = t->tn, .threads = t->threads, .recompute = t->recompute,
                           .check_finite = 1, .pack = t->sep_len > 0 || o->pack || o->pack_by_id,
                           .attn_cp = o->attn_cp, .compute = o->compute, .rule_cp = o->strategy};
}

/* The memory the kernel says a new process may still use (/proc/meminfo's MemAvailable), in
 * bytes; -1 when unknown. */
static double mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    double kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %lf kB", &kb) == 1) break;
    fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

/* Rank 0's line of each rank's memory (plan_memory's numbers). */
static void print_memory(const trainer *t) {
    const gdn_train_options *o = t->o;
    static const char *const level_note[4] = {
        "--zero 0: every rank holds everything", "--zero 1: the moments of this rank's slices",
        "--zero 2: the moments of this rank's slices, their gradients reduce-scattered apart",
        "--zero 3: the weights, moments and summed gradients of this rank's slices, two units gathered at a time"};
    char b[6][24];
    for (int i = 0; i < 6; i++) gdn_trainer_fmt_bytes(b[i], sizeof b[i], t->mem[i]);
    fprintf(t->progress, "gdncp train: memory a rank: weights %s + gradients %s + AdamW moments %s (%s) + "
            "activations %s; this node's %d rank%s %s of %s available\n", b[0], b[1], b[2],
            level_note[o->zero < 0 || o->zero > 3 ? 0 : o->zero],
            b[3], t->local, t->local > 1 ? "s" : "", b[4], t->mem[5] > 0 ? b[5] : "? (unknown)");
}

/* Before anything large is allocated: the threads (the node's cores shared among its ranks), the
 * recompute choice, and each rank's memory (the training state at its --zero level and the plan's
 * activations) against what the node has; a run that would not fit is refused with the numbers. */
static int plan_memory(trainer *t) {
    const gdn_train_options *o = t->o;
    MPI_Comm node;
    MPI_Comm_split_type(t->world, MPI_COMM_TYPE_SHARED, t->rank, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &t->local);
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    t->threads = o->threads > 0 ? o->threads : (int)(cores / t->local > 0 ? cores / t->local : 1);
    /* every rank of the job on this node counts (the CP groups' own count misses the DP ones):
     * more threads than cores, and a waiting rank must not spin (gdn_cp_set_wait) */
    t->sleep_wait = (long)t->local * t->threads > cores;
    MPI_Allreduce(MPI_IN_PLACE, &t->sleep_wait, 1, MPI_INT, MPI_MAX, t->world); /* one mode everywhere */
    const double avail = mem_available();
    /* recompute when the kept activations of every rank on this node would take more than half
     * of the memory the node has */
    t->recompute = o->recompute;
    if (t->recompute < 0) {
        t->recompute = 0;
        gdn_model_run run = plan_run(t);
        int r = avail > 0 && gdn_model_plan_estimate(&t->cfg, &run) * t->local > 0.5 * avail;
        MPI_Allreduce(MPI_IN_PLACE, &r, 1, MPI_INT, MPI_MAX, t->world);
        t->recompute = r;
    }
    gdn_model_run run = plan_run(t);
    /* the two largest units (model_group.h; the embedding and the head at a large vocabulary): level
     * 3 holds one in use and the next being gathered, levels 2 and 3 one unit's gradient being
     * written and one being summed, and with tied embeddings the embedding's gradient (where
     * lm_head's goes) through the whole backward */
    double u1 = 0, u2 = 0;
    for (int64_t u = 0; u <= t->cfg.L + 1; u++) {
        const double f = (double)(gdn_model_unit_offset(&t->cfg, u + 1) - gdn_model_unit_offset(&t->cfg, u));
        if (f > u1) u2 = u1, u1 = f;
        else if (f > u2) u2 = f;
    }
    const double tied = t->cfg.tie_embeddings ? (double)gdn_model_unit_offset(&t->cfg, 1) : 0;
    const double own = (double)t->owned, all = (double)t->nw, moments = 8.0 * (o->zero ? own : all);
    t->mem[0] = 4.0 * (o->zero >= 3 ? own + u1 + u2 : all);
    t->mem[1] = 4.0 * (o->zero >= 3 ? own + u1 + u2 + tied : o->zero == 2 ? all + own : all);
    t->mem[2] = moments;
    t->mem[3] = gdn_model_plan_estimate(&t->cfg, &run);
    double mine = t->mem[0] + t->mem[1] + t->mem[2] + t->mem[3], on_node = 0, most = 0;
    MPI_Allreduce(&mine, &on_node, 1, MPI_DOUBLE, MPI_SUM, node);
    MPI_Allreduce(&moments, &most, 1, MPI_DOUBLE, MPI_MAX, t->world);
    int node_rank = 0;
    MPI_Comm_rank(node, &node_rank);
    MPI_Comm_free(&node);
    t->mem[2] = most, t->mem[4] = on_node, t->mem[5] = avail;
    int rc = GDN_OK;
    if (avail > 0 && on_node > avail && node_rank == 0) { /* said once a node; its other ranks name this one */
        char b[6][24];
        const double v[6] = {on_node, t->mem[0], t->mem[1], moments, t->mem[3], avail};
        for (int i = 0; i < 6; i++) gdn_trainer_fmt_bytes(b[i], sizeof b[i], v[i]);
        rc = gdn_fail(GDN_ERR_NOMEM, "the run needs %s on this node (%d rank%s x [weights %s + gradients %s + AdamW "
                      "moments %s (--zero %d) + activations %s]) and the node has %s available: use --zero 1 or 2 "
                      "with more ranks, --recompute on, a shorter --seq or --batch, or a smaller model", b[0], t->local,
                      t->local > 1 ? "s" : "", b[1], b[2], b[3], o->zero, b[4], b[5]);
    }
    return gdn_cp_agree_status(t->agree, rc);
}

int gdn_trainer_setup(trainer *t) {
    const gdn_train_options *o = t->o;
    int rc = check_options(o, t->size);
    if ((rc = agree_options(t->agree, o, rc))) return rc;
    t->cp_size = o->cp, t->dp = t->size / o->cp;
    t->dp_index = t->rank / o->cp, t->cp_rank = t->rank % o->cp;
    MPI_Comm_split(t->world, t->dp_index, t->rank, &t->cp_comm);
    rc = gdn_cp_create(&t->cp, t->cp_comm);
    t->ep_size = o->ep > 1 ? o->ep : 1, t->ep_rank = t->rank % t->ep_size;
    if (t->ep_size > 1) { /* collective: every rank, whatever its CP context did */
        MPI_Comm_split(t->world, t->rank / t->ep_size, t->rank, &t->ep_comm);
        MPI_Comm_split(t->world, t->ep_rank, t->rank, &t->replica_comm);
        const int rc1 = gdn_ep_create(&t->ep, t->ep_comm);
        const int rc2 = gdn_cp_create(&t->replica_agree, t->replica_comm);
        rc = rc ? rc : rc1 ? rc1 : rc2;
    }
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
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
        if (!rc && *gdn_ckpt_note() && t->progress) fprintf(t->progress, "gdncp train: %s\n", gdn_ckpt_note());
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
    /* the run's id, and no other run's checkpoints in --out: its saves would replace them (the same
     * step) and its pruning remove them (a run deletes or replaces only what it wrote) */
    if (t->rank == 0) draw_run_id(t, o->resume ? ckdir : NULL);
    MPI_Bcast(t->run_id, (int)sizeof t->run_id, MPI_CHAR, 0, t->world);
    if (t->rank == 0 && o->out && !o->dry_run) {
        char other[200];
        rc = gdn_ckpt_other_run(o->out, t->run_id, other, sizeof other);
        if (!rc && other[0])
            rc = gdn_fail(GDN_ERR_ARG, "--out %s holds %s, another run's checkpoint (this run is %s): a run never "
                          "replaces or prunes checkpoints it did not write; give a new --out, or --resume %s to "
                          "continue that run", o->out, other, t->run_id[0] ? t->run_id : "one without a run_id",
                          o->out);
    }
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    if ((rc = agree_run(t))) return rc;
    t->nw = gdn_model_param_floats(&t->cfg);
    if (t->nw > (size_t)INT32_MAX) rc = gdn_fail(GDN_ERR_SHAPE, "%zu parameters: more than one MPI message holds", t->nw);
    if (!rc) rc = gdn_trainer_shard_setup(t);
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    if ((rc = plan_memory(t))) return rc;
    if (o->dry_run) { /* the plan only: nothing large allocated, no data read */
        if (t->progress) {
            fprintf(t->progress, "gdncp train --dry-run: %zu parameters, grid DP %d x CP %d%s, %lld sequences of %lld "
                    "tokens per step, recompute %s\n", gdn_model_param_count(&t->cfg), t->dp, t->cp_size,
                    t->ep_size > 1 ? " (with --ep)" : "", (long long)(o->batch * t->dp), (long long)o->seq,
                    t->recompute ? "on" : "off");
            print_memory(t);
        }
        return GDN_OK;
    }
    const size_t bytes = sizeof(float) * ((t->nw + 15) & ~(size_t)15);
    const size_t nmom = o->zero ? t->owned : t->nw, mbytes = sizeof(float) * ((nmom + 15) & ~(size_t)15);
    if (!rc && !(t->w = gdn_alloc_large("trainer_setup: t->w", bytes))) rc = gdn_fail(GDN_ERR_NOMEM, "parameters (%zu floats)", t->nw);
    if (!rc && !(t->dw = gdn_alloc_large("trainer_setup: t->dw", bytes))) rc = gdn_fail(GDN_ERR_NOMEM, "gradients (%zu floats)", t->nw);
    if (!rc && !(t->m = gdn_alloc_large_zeroed("trainer_setup: t->m", mbytes))) rc = gdn_fail(GDN_ERR_NOMEM, "AdamW moments (%zu floats)", nmom);
    if (!rc && !(t->v = gdn_alloc_large_zeroed("trainer_setup: t->v", mbytes))) rc = gdn_fail(GDN_ERR_NOMEM, "AdamW moments (%zu floats)", nmom);
    if (!rc && o->zero >= 2 && !(t->dw_own = gdn_alloc_large("trainer_setup: t->dw_own", mbytes)))
        rc = gdn_fail(GDN_ERR_NOMEM, "this rank's slices of the gradients (%zu floats)", nmom);
    if (!rc && o->zero >= 3 && !(t->w_own = gdn_alloc_large("trainer_setup: t->w_own", mbytes)))
        rc = gdn_fail(GDN_ERR_NOMEM, "this rank's slices of the weights (%zu floats)", nmom);
    if (!rc && !(t->router = gdn_calloc("trainer_setup: t->router", 2 * (size_t)t->cfg.n_experts + 1, sizeof(double))))
        rc = gdn_fail(GDN_ERR_NOMEM, "the routers' statistics");
    if (!rc && !(t->load = gdn_calloc("trainer_setup: t->load", 2 * (size_t)(gdn_model_moe_layers(&t->cfg) * t->cfg.n_experts) + 1, sizeof(double))))
        rc = gdn_fail(GDN_ERR_NOMEM, "the experts' load");
    if (!rc) rc = gdn_data_open(&t->data, o->data, o->val_fraction, t->cfg.vocab);
    if (!rc) rc = gdn_data_describe(t->data, &t->data_info);
    /* the separator as ids: --pack's bytes (byte text only), or --pack-id's one id */
    if (!rc && o->pack && t->data_info.tokens)
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
        /* sharded: the moments (and fp32 masters) of this rank's slices below, once agreed */
        const int whole = o->resume && !o->zero;
        rc = gdn_ckpt_load(ckdir, &t->cfg, t->w, whole ? t->m : NULL, whole ? t->v : NULL, o->resume ? &state : NULL);
        int64_t done = 0;
        if (!rc && o->resume && !(rc = check_resume_state(t, ckdir, state, &done))) t->first_step = done + 1;
        if (!rc && o->resume && done >= o->steps)
            rc = gdn_fail(GDN_ERR_ARG, "--resume %s: its checkpoint is at step %lld, at or past --steps %lld: nothing "
                          "to train (raise --steps to train on)", o->resume, (long long)done, (long long)o->steps);
    } else if (!rc) {
        gdn_trainer_init_weights(t); /* level 3: this rank's slices only */
    }
    free(state);
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    if (from) gdn_trainer_keep_slices(t); /* level 3: this rank's slices of the loaded weights, apart */
    if (o->resume && o->zero && (rc = gdn_trainer_load_slices(t, ckdir))) return rc;
    /* the same starting weights everywhere (an --init or --resume of another checkpoint with the
     * same configuration would otherwise train from different points and sum their gradients) */
    int64_t wd[2] = {0, 0}; /* (level 3 from a seed: no whole array to digest; the seed is agreed) */
    if (from || o->zero < 3) replicated_digest(t, t->w, wd);
    /* and, resumed unsharded, the AdamW moments every replica holds whole (copies of a checkpoint
     * whose optimizer.safetensors differ would otherwise drift apart; sharded, each slice has one
     * owner) */
    int64_t md[2] = {0, 0};
    if (o->resume && !o->zero) replicated_digest(t, t->m, md), replicated_digest(t, t->v, md);
    /* and the checkpoint's files themselves: under --ep a rank reads only its own experts, so ranks
     * given checkpoints that differ only there would train a mix (each is digested whole) */
    const int64_t dense[3] = {wd[0], md[0], from && t->ep_size > 1 ? gdn_train_checkpoint_digest(ckdir) : 0},
                  experts[2] = {wd[1], md[1]};
    static const char *const wname[] = {"the starting weights (a digest of --init / --resume's model.safetensors)",
                                        "the AdamW moments (a digest of --resume's optimizer.safetensors)",
                                        "the checkpoint (a digest of every byte of its weight files)"};
    if ((rc = gdn_cp_agree_values(t->agree, dense, 3, wname, GDN_OK))) return rc;
    static const char *const ename[] = {"the starting weights of this rank's experts (a digest)",
                                        "the AdamW moments of this rank's experts (a digest of optimizer.safetensors)"};
    if (t->replica_agree) rc = gdn_cp_agree_values(t->replica_agree, experts, 2, ename, GDN_OK);
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    gdn_trainer_release_weights(t); /* level 3: the whole array held only while loading */

    /* every window of seq + 1 tokens must fit each split it is drawn from */
    const int64_t need = o->seq + 1, tl = gdn_data_split_len(t->data, GDN_SPLIT_TRAIN),
                  vl = gdn_data_split_len(t->data, GDN_SPLIT_VAL);
    if (tl < need)
        rc = gdn_fail(GDN_ERR_SHAPE, "the training split of %s has %lld %s; a sequence of --seq %lld needs %lld",
                      o->data, (long long)tl, t->data_info.tokens ? "tokens" : "bytes", (long long)o->seq,
                      (long long)need);
    else if (o->eval_every && vl < need)
        rc = gdn_fail(GDN_ERR_SHAPE, "the validation split of %s has %lld %s; a sequence of --seq %lld needs "
                      "%lld (raise --val-fraction, or --eval-every 0)", o->data, (long long)vl,
                      t->data_info.tokens ? "tokens" : "bytes", (long long)o->seq, (long long)need);
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;

    const int mode = t->sleep_wait ? GDN_CP_WAIT_SLEEP : GDN_CP_WAIT_SPIN;
    if ((rc = gdn_cp_set_wait(t->cp, mode)) || (rc = gdn_cp_set_wait(t->agree, mode))) return rc;
    gdn_model_run run = plan_run(t);
    rc = gdn_model_plan_create(&t->plan, &t->cfg, &run, t->cp_size > 1 ? t->cp : NULL);
    if (!rc && t->ep) rc = gdn_model_plan_set_experts(t->plan, t->ep);
    if (!rc) rc = gdn_trainer_units_setup(t);
    if (!rc && !(t->tokens = gdn_malloc("trainer_setup: t->tokens", sizeof *t->tokens * (size_t)(o->batch * (t->tn + 1)))))
        rc = gdn_fail(GDN_ERR_NOMEM, "token buffer");
    if (!rc && t->sep_len) {
        t->window = gdn_malloc("trainer_setup: t->window", sizeof *t->window * (size_t)(o->seq + t->sep_len));
        t->doc_cu = gdn_malloc("trainer_setup: t->doc_cu", sizeof(int64_t) * (size_t)(o->batch * (o->seq + 2)));
        t->n_docs = gdn_malloc("trainer_setup: t->n_docs", sizeof(int64_t) * (size_t)o->batch);
        if (!t->window || !t->doc_cu || !t->n_docs)
            rc = gdn_fail(GDN_ERR_NOMEM, "document tables for --pack (%lld rows of %lld bytes)", (long long)o->batch,
                          (long long)o->seq);
    }
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;

    t->flops_per_token = gdn_model_train_flops_per_token(&t->cfg, o->seq);
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    t->peak_gflops = measure_peak(t, (int)(cores < (long)t->threads * t->local ? cores : (long)t->threads * t->local));
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
                gdn_cp_get_wait(t->cp) == GDN_CP_WAIT_SLEEP ? " (more than the cores: waits sleep)" : "", t->recompute ? "on" : "off", t->data_info.tokens ? "token file" : "text", o->data,
                (long long)tl, (long long)vl, t->data_info.tokens ? "tokens" : "bytes",
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
        print_memory(t);
        fprintf(t->progress, "gdncp train: compute %s: products on %s%s\n", gdn_compute_name(o->compute),
                gdn_compute_path(o->compute),
                o->compute == GDN_COMPUTE_BF16 ? " (fp32 master weights, moments, loss, norms and recurrent state)" : "");
        if (t->data_info.tokens)
            fprintf(t->progress, "gdncp train: token file of uint%d ids, header vocabulary %lld, model vocabulary "
                    "%lld\n", 8 * t->data_info.width, (long long)t->data_info.file_vocab,
                    (long long)t->cfg.vocab);
        if (o->pack_by_id)
            fprintf(t->progress, "gdncp train: packed documents, each ending with the id %d: the state and the conv "
                    "restart after it, and the token after it is not predicted\n", (int)o->pack_id);
        if (o->pack) {
            char hex[2 * GDN_DATA_MAX_SEP + 1];
            gdn_trainer_pack_hex(o, hex);
            fprintf(t->progress, "gdncp train: packed documents, each ending with the %d byte%s %s (hex): the "
                    "state and the conv restart after it, and the byte after it is not predicted\n", o->pack_len,
                    o->pack_len > 1 ? "s" : "", hex);
        }
        fflush(t->progress);
    }
    return GDN_OK;
}
