/* gdncp train: the hybrid language model (GatedDeltaNet + gated attention layers) trained on byte
 * text or a token file (any vocabulary), its sequences split over the ranks of mpiexec (a DP x CP grid, --cp
 * ranks per sequence). */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"
#include "gdncp/attention.h"
#include "gdncp/cp.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gdncp/io.h"
#include "gdncp/train.h"

/* --pack's separator with C-style escapes decoded into sep; its length, or -1 (message printed). */
static int parse_separator(const char *v, uint8_t sep[GDN_DATA_MAX_SEP]) {
    int n = 0;
    for (const char *c = v; *c; c++) {
        int byte = (unsigned char)*c;
        if (*c == '\\') {
            const char e = *++c;
            if (e == 'n') byte = '\n';
            else if (e == 't') byte = '\t';
            else if (e == 'r') byte = '\r';
            else if (e == '\\') byte = '\\';
            else if (e == 'x' && isxdigit((unsigned char)c[1]) && isxdigit((unsigned char)c[2])) {
                const char hex[3] = {c[1], c[2], 0};
                byte = (int)strtol(hex, NULL, 16), c += 2;
            } else {
                fprintf(stderr, "gdncp train: --pack '%s': unknown escape (\\n \\t \\r \\\\ or \\xHH)\n", v);
                return -1;
            }
        }
        if (byte == 0) {
            fprintf(stderr, "gdncp train: --pack '%s': a NUL byte (training text holds none)\n", v);
            return -1;
        }
        if (n == GDN_DATA_MAX_SEP) {
            fprintf(stderr, "gdncp train: --pack '%s' is longer than %d bytes\n", v, GDN_DATA_MAX_SEP);
            return -1;
        }
        sep[n++] = (uint8_t)byte;
    }
    if (!n) fprintf(stderr, "gdncp train: --pack needs a non-empty separator\n");
    return n ? n : -1;
}

/* --layer-types: one entry per layer, "linear" / "linear_attention" or "full" / "full_attention". */
static int parse_layer_types(const char *v, gdn_model_config *m) {
    unsigned char full[GDN_MODEL_MAX_LAYERS] = {0};
    int64_t n = 0;
    for (const char *p = v;;) {
        const char *end = strchr(p, ',');
        const size_t len = end ? (size_t)(end - p) : strlen(p);
        char name[32] = "";
        if (len < sizeof name) memcpy(name, p, len), name[len] = 0;
        int f;
        if (!strcmp(name, "linear") || !strcmp(name, "linear_attention")) f = 0;
        else if (!strcmp(name, "full") || !strcmp(name, "full_attention")) f = 1;
        else {
            fprintf(stderr, "gdncp train: --layer-types: entry %lld is '%.*s', an unknown layer type (linear or "
                    "full; also linear_attention, full_attention)\n", (long long)n, (int)(len < 64 ? len : 64), p);
            return -1;
        }
        if (n == GDN_MODEL_MAX_LAYERS) {
            fprintf(stderr, "gdncp train: --layer-types has more than %d entries\n", GDN_MODEL_MAX_LAYERS);
            return -1;
        }
        full[n++] = (unsigned char)f;
        if (!end) break;
        p = end + 1;
    }
    if (n != m->L) {
        fprintf(stderr, "gdncp train: --layer-types has %lld entries but the model has %lld layers (--layers)\n",
                (long long)n, (long long)m->L);
        return -1;
    }
    memcpy(m->full_attention, full, sizeof full);
    return 0;
}

/* The command line's options: the trainer's own, and what becomes them once all are read. */
typedef struct {
    gdn_train_options t;
    int64_t interval, head_dim;                  /* --attn-interval, --head-dim (-1: not given) */
    int64_t experts, top_k, moe_I, shared_I;     /* -1: not given */
    int64_t pack_id;
    int progress;                                /* --progress: -1 auto, 0 lines, 1 line */
    const char *layer_types;
} train_opts;

static void train_init(void *p) {
    train_opts *o = p;
    o->t = gdn_train_defaults();
    o->t.opt.min_lr = -1; /* not given: a tenth of --lr */
    o->interval = GDN_MODEL_NAMED_ATTN_INTERVAL, o->head_dim = -1;
    o->experts = o->top_k = o->moe_I = o->shared_I = -1;
    o->progress = -1;
}

/* --model: the named sizes (later size flags override single fields) */
static int set_model(void *p, const char *cmd, const char *flag, const char *v) {
    train_opts *o = p;
    gdn_model_config named;
    if (!gdn_model_config_named(v, &named)) {
        fprintf(stderr, "gdncp train: unknown --model '%s' (tiny, small or long)\n", v);
        return 1;
    }
    o->t.model = named, o->t.model_explicit = GDN_GIVEN_ALL;
    return 0;
}

static int set_pack(void *p, const char *cmd, const char *flag, const char *v) {
    static uint8_t sep[GDN_DATA_MAX_SEP];
    train_opts *o = p;
    if ((o->t.pack_len = parse_separator(v, sep)) < 0) return 1;
    o->t.pack = sep;
    return 0;
}

#define MODELS .dflt = "the model's"
static const cli_opt train_table[] = {
    {CLI_STR("--data", train_opts, t.data, "FILE", "byte text (its bytes are the ids), or a token file (python -m gdncp.tokenize; docs/training.md)"), .req = 1},
    {CLI_FN("--model", set_model, "NAME", "tiny, small, long, tiny-moe, small-moe, or Qwen3.5's shapes with the real vocabulary, qwen3.5-0.8b and qwen3.5-2b; the size flags after it override single fields"), .dflt = "tiny"},
    {CLI_I64("--vocab", train_opts, t.model.vocab, 1, GDN_MODEL_MAX_VOCAB, "N", "the model's vocabulary (a token file's ids must be below it)")},
    {CLI_I64("--hidden", train_opts, t.model.E, 1, 1 << 16, "E", "hidden size"), MODELS},
    {CLI_I64("--layers", train_opts, t.model.L, 1, 1024, "L", "layers"), MODELS},
    {CLI_I64("--intermediate", train_opts, t.model.I, 1, 1 << 18, "I", "the MLP's width"), MODELS},
    {CLI_I64("--key-heads", train_opts, t.model.Hk, 1, 1024, "Hk", "GatedDeltaNet key heads"), MODELS},
    {CLI_I64("--value-heads", train_opts, t.model.Hv, 1, 1024, "Hv", "GatedDeltaNet value heads"), MODELS},
    {CLI_I64("--key-dim", train_opts, t.model.K, 1, GDN_MAX_HEAD_DIM, "K", "GatedDeltaNet key head width"), MODELS},
    {CLI_I64("--value-dim", train_opts, t.model.V, 1, GDN_MAX_HEAD_DIM, "V", "GatedDeltaNet value head width"), MODELS},
    {CLI_I64("--conv", train_opts, t.model.Kc, 1, GDN_MAX_CONV, "Kc", "the causal conv's kernel size"), MODELS},
    {CLI_I64("--attn-heads", train_opts, t.model.H, 1, 1024, "H", "attention heads"), MODELS},
    {CLI_I64("--kv-heads", train_opts, t.model.Hkv, 1, 1024, "Hkv", "attention key/value heads"), MODELS},
    {CLI_I64("--head-dim", train_opts, head_dim, 2, 1024, "d", "attention head width (the rotary part R = d / 4, even)"), MODELS},
    {CLI_STR("--layer-types", train_opts, layer_types, "linear,full,..", "every layer's type, --layers entries: linear (linear_attention) or full (full_attention); excludes --attn-interval"), .dflt = "every 4th full"},
    {CLI_I64("--attn-interval", train_opts, interval, 0, GDN_MODEL_MAX_LAYERS, "N", "layer l is full attention when (l + 1) % N == 0 (0: GatedDeltaNet only)")},
    {CLI_ENUM("--attn-cp", train_opts, t.attn_cp, "kv|heads", CLI_VALUES(GDN_ATTN_CP_KV, GDN_ATTN_CP_HEADS), "the attention layers' CP strategy (heads: the CP ranks must divide the heads)")},
    {CLI_I64("--experts", train_opts, experts, 0, GDN_MOE_MAX_EXPERTS, "N", "every layer's MLP a sparse mixture of N experts (Qwen3.5-MoE; 0: dense)"), MODELS},
    {CLI_I64("--experts-per-tok", train_opts, top_k, 1, GDN_MOE_MAX_EXPERTS, "K", "the experts each token uses"), .dflt = "2"},
    {CLI_I64("--moe-intermediate", train_opts, moe_I, 1, 1 << 18, "I", "each expert's width"), .dflt = "--intermediate"},
    {CLI_I64("--shared-intermediate", train_opts, shared_I, 0, 1 << 18, "I", "the shared expert's width (0: none)"), .dflt = "0"},
    {CLI_F64("--router-aux-coef", train_opts, t.router_aux_coef, 0, 1e3, "X", "the loss adds X times the load-balancing loss over the whole DP x CP batch (0: off)"), .dflt = "the model's (0.001 in the *-moe models)"},
    {CLI_COMPUTE("--compute", train_opts, t.compute, "bf16: every projection, the MLP and lm_head with bfloat16 operands and fp32 accumulation (master weights, moments, loss, norms and state stay fp32)")},
    {CLI_I64("--log-every", train_opts, t.log_every, 1, (int64_t)1 << 40, "N", "a full progress line at step 1, every N-th step, each validation and the last step (the CSV keeps every step)")},
    {CLI_ENUM("--progress", train_opts, progress, "auto|line|lines", CLI_VALUES(-1, 1, 0), "line: one status line rewritten in place between the full lines; lines: none; auto: line when stdout is a terminal")},
    {CLI_I64("--seq", train_opts, t.seq, 1, (int64_t)1 << 36, "T", "tokens per sequence (whole, before the CP split: each of --cp ranks holds about T/C)")},
    {CLI_I64("--batch", train_opts, t.batch, 1, 65536, "B", "sequences per DP group per step (DP = ranks / --cp)")},
    {CLI_I64("--steps", train_opts, t.steps, 1, (int64_t)1 << 40, "N", "train until this step")},
    {CLI_I64("--cp", train_opts, t.cp, 1, 1 << 20, "C", "ranks per sequence (must divide the world size)")},
    {CLI_I64("--ep", train_opts, t.ep, 1, 1 << 20, "N", "expert parallelism: each MoE layer's experts split over groups of N ranks (N divides the world size and the experts, and divides --cp or is a multiple of it); each rank holds, trains and stores in memory 1/N of them"), .dflt = "1"},
    {CLI_I64("--zero", train_opts, t.zero, 0, 3, "LEVEL", "the training state sharded over the ranks that replicate it (DESIGN §15): 1 the AdamW moments (each rank updates its slice of the weights, then they are all-gathered), 2 also the gradients (reduce-scattered to their slices' owners); 0 every rank holds everything"), .dflt = "0"},
    {CLI_FLAG("--dry-run", train_opts, t.dry_run, "check the options, the grid, the model (from --init / --resume too) and each rank's memory (state at its --zero level and activations), print them and stop: nothing large is allocated, nothing trained")},
    {CLI_ENUM("--strategy", train_opts, t.strategy, "scan|allgather|relay|heads", CLI_VALUES(GDN_CP_SCAN, GDN_CP_ALLGATHER, GDN_CP_RELAY, GDN_CP_HEADS), "the GatedDeltaNet layers' CP strategy")},
    {CLI_F64("--lr", train_opts, t.opt.lr, 1e-8, 1, "X", "the peak learning rate")},
    {CLI_F64("--min-lr", train_opts, t.opt.min_lr, 0, 1, "X", "the floor of the cosine decay (at most --lr)"), .dflt = "lr / 10"},
    {CLI_I64("--warmup", train_opts, t.opt.warmup, 0, (int64_t)1 << 40, "N", "linear warmup steps")},
    {CLI_F64("--weight-decay", train_opts, t.opt.weight_decay, 0, 1, "X", "AdamW's decoupled weight decay")},
    {CLI_F64("--clip", train_opts, t.opt.clip, 0, 1e6, "X", "the gradient norm's clip (0: no clipping)")},
    {CLI_F64("--beta1", train_opts, t.opt.beta1, 0, 0.999999, "X", "AdamW's first moment decay")},
    {CLI_F64("--beta2", train_opts, t.opt.beta2, 0, 0.999999, "X", "AdamW's second moment decay")},
    {CLI_I64("--seed", train_opts, t.seed, 0, INT64_MAX, "N", "the data windows and the initialisation")},
    {CLI_I64("--threads", train_opts, t.threads, 1, 4096, "N", "threads per rank"), .dflt = "the node's cores divided among its ranks"},
    {CLI_ENUM("--recompute", train_opts, t.recompute, "auto|on|off", CLI_VALUES(-1, 1, 0), "recompute the forward in the backward (auto: when the kept activations would not fit)")},
    {CLI_F64("--val-fraction", train_opts, t.val_fraction, 1e-6, 0.5, "X", "the last fraction of the data, for validation")},
    {CLI_I64("--eval-every", train_opts, t.eval_every, 0, (int64_t)1 << 40, "N", "validation loss every N steps and at the end (0: never)")},
    {CLI_I64("--eval-seqs", train_opts, t.eval_seqs, 1, 1 << 20, "N", "validation sequences")},
    {CLI_STR("--out", train_opts, t.out, "DIR", "the checkpoint directory (none written without it)")},
    {CLI_I64("--save-every", train_opts, t.save_every, 0, (int64_t)1 << 40, "N", "a checkpoint every N steps (0: only at the end)")},
    {CLI_I64("--keep", train_opts, t.keep_last, 0, 1 << 20, "N", "checkpoints kept (0: all)")},
    {CLI_ENUM("--save-dtype", train_opts, t.save_dtype, "f32|bf16", CLI_VALUES(GDN_F32, GDN_BF16), "model.safetensors' weights (bf16: half the bytes; the fp32 master weights stay in optimizer.safetensors, so --resume is exact)")},
    {CLI_STR("--resume", train_opts, t.resume, "DIR", "continue from a checkpoint, or the newest in a directory")},
    {CLI_STR("--init", train_opts, t.init, "DIR", "start from a checkpoint's weights (gdncp's or transformers') with a fresh optimiser; its config.json decides the model (model flags given must agree)")},
    {CLI_STR("--log", train_opts, t.log_csv, "FILE.csv", "a per-step CSV")},
    {CLI_FN("--pack", set_pack, "SEP", "packed documents each ending with SEP (1 to 64 bytes, no NUL; escapes \\n \\t \\r \\\\ \\xHH; byte text only): the state and the conv restart after each")},
    {CLI_I64("--pack-id", train_opts, pack_id, 0, GDN_MODEL_MAX_VOCAB - 1, "N", "packed documents ending with the one id N (a token file's end-of-text id; for byte text a byte value); excludes --pack"), .dflt = ""},
    /* testing only: a deliberately wrong run (the state between CP ranks dropped; the MoE aux
     * loss per rank; the earlier ranks' keys and values unseen) */
};
#undef MODELS

const cli_command cmd_train_cli = {
    .name = "train",
    .usage = "usage: [mpiexec -n N] gdncp train --data FILE [--model NAME] [options]\n",
    .summary = "train the hybrid language model (GatedDeltaNet + gated attention) on byte text or a token file; under mpiexec a DP x CP grid",
    .about =
    "  --data FILE: byte text, or a token file (python -m gdncp.tokenize; docs/training.md).\n"
    "  --model NAME: tiny (default), small, long, tiny-moe, small-moe, or Qwen3.5's shapes with the\n"
    "  real vocabulary, qwen3.5-0.8b and qwen3.5-2b (docs/training.md lists their dimensions).\n"
    "  --vocab N: the model's vocabulary (default 256, bytes; a token file's tokenizer's size).\n"
    "  --seq is the whole sequence; with --cp C each of its C ranks holds about T/C tokens.\n"
    "  DP = ranks / C groups each train --batch sequences per step.\n"
    "  --pack SEP: the text is documents each ending with SEP (escapes \\n \\t \\r \\\\ \\xHH, e.g.\n"
    "  '\\n%\\n' for fortunes): the state and the conv restart after every SEP and the byte after\n"
    "  it is not predicted (byte text). --pack-id N: the documents end with the one token id N (a token\n"
    "  file's end-of-text id; for byte text, a byte value).\n"
    "  The named models are hybrid: layer l is full attention when (l + 1) % 4 == 0; --attn-interval N\n"
    "  makes it every N-th layer (0: GatedDeltaNet only), --layer-types lists every layer.\n"
    "  --init DIR: the checkpoint's config.json decides the model (model flags given must agree with it;\n"
    "  the fields not given take its values).\n"
    "  --experts N: every layer's MLP a sparse mixture of N experts (Qwen3.5-MoE), K of them per token\n"
    "  (default 2), each --moe-intermediate wide (default: --intermediate), beside a shared expert of\n"
    "  --shared-intermediate (default 0: none); the *-moe models have them. --router-aux-coef X: the\n"
    "  loss adds X times the load-balancing loss over the whole DP x CP batch (0: off; default: the\n"
    "  model's, 0.001 in the *-moe models, a checkpoint's router_aux_loss_coef if output_router_logits).\n"
    "  --save-dtype bf16: model.safetensors in BF16 (half the bytes; the fp32 master weights stay in\n"
    "  optimizer.safetensors, so --resume is exact).\n",
    .size = sizeof(train_opts), .init = train_init, CLI_OPTS(train_table),
};

static int parse(int argc, char **argv, gdn_train_options *out) {
    train_opts opts;
    unsigned char seen[CLI_MAX_OPTS];
    if (cli_parse(&cmd_train_cli, argc, argv, &opts, seen)) return CLI_USAGE_ERROR;
    gdn_train_options *o = &opts.t;
    /* the flags that set the model's fields (with --init / --resume, refused where they differ
     * from the checkpoint's config; the fields not given take the checkpoint's) */
    static const struct { const char *flag; int bit; } model_flags[] = {
        {"--hidden", GDN_GIVEN_HIDDEN}, {"--layers", GDN_GIVEN_LAYERS}, {"--intermediate", GDN_GIVEN_INTERMEDIATE},
        {"--key-heads", GDN_GIVEN_KEY_HEADS}, {"--value-heads", GDN_GIVEN_VALUE_HEADS},
        {"--key-dim", GDN_GIVEN_KEY_DIM}, {"--value-dim", GDN_GIVEN_VALUE_DIM}, {"--conv", GDN_GIVEN_CONV},
        {"--attn-heads", GDN_GIVEN_ATTN_HEADS}, {"--kv-heads", GDN_GIVEN_KV_HEADS},
        {"--head-dim", GDN_GIVEN_HEAD_DIM}, {"--attn-interval", GDN_GIVEN_LAYER_TYPES},
        {"--layer-types", GDN_GIVEN_LAYER_TYPES},
        {"--vocab", GDN_GIVEN_VOCAB}, {"--experts", GDN_GIVEN_EXPERTS}, {"--experts-per-tok", GDN_GIVEN_EXPERTS_PER_TOK},
        {"--moe-intermediate", GDN_GIVEN_MOE_INTERMEDIATE}, {"--shared-intermediate", GDN_GIVEN_SHARED_INTERMEDIATE}};
    for (size_t k = 0; k < sizeof model_flags / sizeof model_flags[0]; k++)
        if (cli_given(&cmd_train_cli, seen, model_flags[k].flag)) o->model_explicit |= model_flags[k].bit;
    if (cli_given(&cmd_train_cli, seen, "--pack-id")) o->pack_by_id = 1, o->pack_id = (gdn_token)opts.pack_id;
    /* auto: the status line when stdout is a terminal (under mpiexec the launcher's pipes are not:
     * say --progress line there) */
    o->progress_line = opts.progress >= 0 ? opts.progress : isatty(STDOUT_FILENO);
    const int64_t head_dim = opts.head_dim, experts = opts.experts, top_k = opts.top_k, moe_I = opts.moe_I,
                  shared_I = opts.shared_I;
    if (head_dim > 0) o->model.d = head_dim, o->model.R = (head_dim / 4) & ~(int64_t)1;
    if (opts.layer_types && cli_given(&cmd_train_cli, seen, "--attn-interval")) {
        fprintf(stderr, "gdncp train: --layer-types and --attn-interval exclude each other\n");
        return CLI_USAGE_ERROR;
    }
    if (opts.layer_types) {
        if (parse_layer_types(opts.layer_types, &o->model)) return CLI_USAGE_ERROR;
    } else {
        gdn_model_set_attention_interval(&o->model, opts.interval); /* over the final --layers */
    }
    /* the experts: --experts makes (0: unmakes) every layer's MLP a mixture; the other MoE flags
     * change a model that has them */
    const int from_ckpt = o->init || o->resume; /* (the model is the checkpoint's: the flags are checked there) */
    if (experts == 0 && o->model.n_experts > 0 && !o->model.I && !cli_given(&cmd_train_cli, seen, "--intermediate"))
        o->model.I = o->model.top_k * o->model.moe_I + o->model.shared_I; /* a named MoE made dense: its active width */
    if (experts >= 0) {
        o->model.n_experts = experts;
        if (experts && !o->model.top_k) o->model.top_k = 2;
        if (experts && !o->model.moe_I) o->model.moe_I = o->model.I;
        if (experts && !o->model.norm_topk) o->model.norm_topk = 1;
        if (!experts) o->model.top_k = o->model.moe_I = o->model.shared_I = 0, o->model.router_aux = 0;
    }
    /* every layer of the final --layers a mixture when the model has experts (a named MoE model resized
     * keeps its kind on the layers it gains, none beyond the last) */
    for (int64_t l = 0; l < GDN_MODEL_MAX_LAYERS; l++) o->model.moe[l] = o->model.n_experts > 0 && l < o->model.L;
    if ((top_k >= 0 || moe_I >= 0 || shared_I >= 0) && !o->model.n_experts && !from_ckpt) {
        fprintf(stderr, "gdncp train: --experts-per-tok, --moe-intermediate and --shared-intermediate shape a mixture "
                        "of experts: give --experts N (or a *-moe --model, or --init / --resume an MoE checkpoint)\n");
        return CLI_USAGE_ERROR;
    }
    if (top_k >= 0) o->model.top_k = top_k;
    if (moe_I >= 0) o->model.moe_I = moe_I;
    if (shared_I >= 0) o->model.shared_I = shared_I;
    if (o->opt.min_lr < 0) o->opt.min_lr = 0.1 * o->opt.lr;
    o->opt.steps = o->steps;
    *out = *o;
    return 0;
}

int cmd_train(int argc, char **argv) {
    gdn_train_options o;
    int rc = parse(argc, argv, &o);
    if (rc) {
        gdn_train_fail(MPI_COMM_WORLD, GDN_ERR_ARG); /* the other ranks stop too */
        return rc;
    }
    rc = gdn_train(MPI_COMM_WORLD, &o, stdout);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (!rc) return 0;
    /* rank 0 says what stopped the run; a rank whose own failure it was says its own message too
     * (the others only know "rank N failed"), so that the cause is on the terminal */
    const char *msg = gdn_errmsg();
    if (rank == 0) return cli_error("train", rc);
    if (!strstr(msg, "see its message") && !strstr(msg, "ranks disagree"))
        fprintf(stderr, "gdncp train (rank %d): %s: %s\n", rank, gdn_strerror(rc), msg);
    return 1;
}
