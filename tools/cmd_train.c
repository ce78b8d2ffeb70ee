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

const char cmd_train_usage[] =
    "usage: [mpiexec -n N] gdncp train --data FILE [--model NAME]\n"
    "         [--vocab N] [--hidden E] [--layers L] [--intermediate I] [--key-heads Hk] [--value-heads Hv]\n"
    "         [--key-dim K] [--value-dim V] [--conv Kc] [--attn-heads H] [--kv-heads Hkv] [--head-dim d]\n"
    "         [--layer-types linear,linear,linear,full,... | --attn-interval N] [--attn-cp kv|heads]\n"
    "         [--experts N] [--experts-per-tok K] [--moe-intermediate I] [--shared-intermediate I]\n"
    "         [--router-aux-coef X]\n"
    "         [--compute fp32|bf16] [--log-every N] [--progress auto|line|lines]\n"
    "         [--seq T] [--batch B] [--steps N] [--cp C] [--strategy scan|allgather|relay|heads]\n"
    "         [--lr X] [--min-lr X] [--warmup N] [--weight-decay X] [--clip X] [--beta1 X] [--beta2 X]\n"
    "         [--seed N] [--threads N] [--recompute auto|on|off] [--val-fraction X]\n"
    "         [--eval-every N] [--eval-seqs N] [--out DIR] [--save-every N] [--keep N] [--save-dtype f32|bf16]\n"
    "         [--resume DIR] [--init DIR] [--log FILE.csv] [--pack SEP | --pack-id N]\n"
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
    "  optimizer.safetensors, so --resume is exact).\n";

static int usage(void) {
    fputs(cmd_train_usage, stderr);
    return CLI_USAGE_ERROR;
}

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

static int parse(int argc, char **argv, gdn_train_options *o) {
    static uint8_t sep[GDN_DATA_MAX_SEP];
    *o = gdn_train_defaults();
    o->opt.min_lr = -1; /* not given: a tenth of --lr */
    /* the int-typed options, read as int64 and range-checked like the others */
    int64_t cp = o->cp, keep = o->keep_last, threads = o->threads;
    int64_t interval = GDN_MODEL_NAMED_ATTN_INTERVAL, head_dim = -1;
    int64_t experts = -1, top_k = -1, moe_I = -1, shared_I = -1; /* -1: not given */
    int interval_given = 0, progress = -1; /* --progress: -1 auto, 0 lines, 1 line */
    const char *layer_types = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        /* integer options with their ranges */
        const struct { const char *flag; int64_t *dst, min, max; } ints[] = {
            {"--hidden", &o->model.E, 1, 1 << 16},       {"--layers", &o->model.L, 1, 1024},
            {"--intermediate", &o->model.I, 1, 1 << 18}, {"--key-heads", &o->model.Hk, 1, 1024},
            {"--value-heads", &o->model.Hv, 1, 1024},    {"--key-dim", &o->model.K, 1, GDN_MAX_HEAD_DIM},
            {"--value-dim", &o->model.V, 1, GDN_MAX_HEAD_DIM}, {"--conv", &o->model.Kc, 1, GDN_MAX_CONV},
            {"--seq", &o->seq, 1, (int64_t)1 << 36},     {"--batch", &o->batch, 1, 65536},
            {"--steps", &o->steps, 1, (int64_t)1 << 40}, {"--warmup", &o->opt.warmup, 0, (int64_t)1 << 40},
            {"--seed", (int64_t *)&o->seed, 0, INT64_MAX}, {"--cp", &cp, 1, 1 << 20},
            {"--threads", &threads, 1, 4096},            {"--save-every", &o->save_every, 0, (int64_t)1 << 40},
            {"--keep", &keep, 0, 1 << 20},               {"--eval-every", &o->eval_every, 0, (int64_t)1 << 40},
            {"--log-every", &o->log_every, 1, (int64_t)1 << 40},
            {"--eval-seqs", &o->eval_seqs, 1, 1 << 20},  {"--attn-heads", &o->model.H, 1, 1024},
            {"--kv-heads", &o->model.Hkv, 1, 1024},      {"--head-dim", &head_dim, 2, 1024},
            {"--attn-interval", &interval, 0, GDN_MODEL_MAX_LAYERS}, {"--vocab", &o->model.vocab, 1, GDN_MODEL_MAX_VOCAB},
            {"--experts", &experts, 0, GDN_MOE_MAX_EXPERTS}, {"--experts-per-tok", &top_k, 1, GDN_MOE_MAX_EXPERTS},
            {"--moe-intermediate", &moe_I, 1, 1 << 18},  {"--shared-intermediate", &shared_I, 0, 1 << 18},
        };
        /* the flags that set the model's fields (with --init / --resume, refused where they differ
         * from the checkpoint's config; the fields not given take the checkpoint's) */
        static const struct { const char *flag; int bit; } model_flags[] = {
            {"--hidden", GDN_GIVEN_HIDDEN}, {"--layers", GDN_GIVEN_LAYERS}, {"--intermediate", GDN_GIVEN_INTERMEDIATE},
            {"--key-heads", GDN_GIVEN_KEY_HEADS}, {"--value-heads", GDN_GIVEN_VALUE_HEADS},
            {"--key-dim", GDN_GIVEN_KEY_DIM}, {"--value-dim", GDN_GIVEN_VALUE_DIM}, {"--conv", GDN_GIVEN_CONV},
            {"--attn-heads", GDN_GIVEN_ATTN_HEADS}, {"--kv-heads", GDN_GIVEN_KV_HEADS},
            {"--head-dim", GDN_GIVEN_HEAD_DIM}, {"--attn-interval", GDN_GIVEN_LAYER_TYPES},
            {"--vocab", GDN_GIVEN_VOCAB}, {"--experts", GDN_GIVEN_EXPERTS}, {"--experts-per-tok", GDN_GIVEN_EXPERTS},
            {"--moe-intermediate", GDN_GIVEN_EXPERTS}, {"--shared-intermediate", GDN_GIVEN_EXPERTS}};
        for (size_t k = 0; k < sizeof model_flags / sizeof model_flags[0]; k++)
            if (!strcmp(a, model_flags[k].flag)) o->model_explicit |= model_flags[k].bit;
        if (!strcmp(a, "--attn-interval")) interval_given = 1;
        const struct { const char *flag; double *dst, min, max; } reals[] = {
            {"--lr", &o->opt.lr, 1e-8, 1},           {"--min-lr", &o->opt.min_lr, 0, 1}, /* <= --lr */
            {"--weight-decay", &o->opt.weight_decay, 0, 1}, {"--clip", &o->opt.clip, 0, 1e6},
            {"--beta1", &o->opt.beta1, 0, 0.999999}, {"--beta2", &o->opt.beta2, 0, 0.999999},
            {"--val-fraction", &o->val_fraction, 1e-6, 0.5}, {"--router-aux-coef", &o->router_aux_coef, 0, 1e3},
        };
        int matched = 0;
        for (size_t k = 0; !matched && k < sizeof ints / sizeof ints[0]; k++)
            if (!strcmp(a, ints[k].flag)) {
                if (cli_parse_i64("train", a, v, ints[k].min, ints[k].max, ints[k].dst)) return CLI_USAGE_ERROR;
                matched = 1, i++;
            }
        for (size_t k = 0; !matched && k < sizeof reals / sizeof reals[0]; k++)
            if (!strcmp(a, reals[k].flag)) {
                if (cli_parse_f64("train", a, v, reals[k].min, reals[k].max, reals[k].dst)) return CLI_USAGE_ERROR;
                matched = 1, i++;
            }
        if (matched) continue;
        if (!strcmp(a, "--data") && v) o->data = v, i++;
        else if (!strcmp(a, "--out") && v) o->out = v, i++;
        else if (!strcmp(a, "--resume") && v) o->resume = v, i++;
        else if (!strcmp(a, "--init") && v) o->init = v, i++;
        else if (!strcmp(a, "--log") && v) o->log_csv = v, i++;
        else if (!strcmp(a, "--model") && v) {
            /* the named sizes; later size flags override single fields */
            gdn_model_config named;
            if (!gdn_model_config_named(v, &named)) {
                fprintf(stderr, "gdncp train: unknown --model '%s' (tiny, small or long)\n", v);
                return CLI_USAGE_ERROR;
            }
            o->model = named, o->model_explicit = GDN_GIVEN_ALL, i++;
        } else if (!strcmp(a, "--layer-types") && v) {
            layer_types = v, o->model_explicit |= GDN_GIVEN_LAYER_TYPES, i++;
        } else if (!strcmp(a, "--progress") && v && (!strcmp(v, "auto") || !strcmp(v, "line") || !strcmp(v, "lines"))) {
            progress = !strcmp(v, "line") ? 1 : !strcmp(v, "lines") ? 0 : -1, i++;
        } else if (!strcmp(a, "--save-dtype") && v && (!strcmp(v, "f32") || !strcmp(v, "bf16"))) {
            o->save_dtype = !strcmp(v, "bf16") ? GDN_BF16 : GDN_F32, i++;
        } else if (!strcmp(a, "--compute")) {
            if (cli_parse_compute("train", a, v, &o->compute)) return CLI_USAGE_ERROR;
            i++;
        } else if (!strcmp(a, "--attn-cp") && v) {
            const int s = gdn_attn_cp_strategy_parse(v);
            if (s < 0) {
                fprintf(stderr, "gdncp train: unknown --attn-cp '%s' (kv or heads)\n", v);
                return CLI_USAGE_ERROR;
            }
            o->attn_cp = s, i++;
        } else if (!strcmp(a, "--strategy") && v) {
            const int s = gdn_cp_strategy_parse(v);
            if (s < 0) {
                fprintf(stderr, "gdncp train: unknown --strategy '%s' (scan, allgather, relay or heads)\n", v);
                return CLI_USAGE_ERROR;
            }
            o->strategy = s, i++;
        } else if (!strcmp(a, "--recompute") && v && (!strcmp(v, "auto") || !strcmp(v, "on") || !strcmp(v, "off"))) {
            o->recompute = !strcmp(v, "auto") ? -1 : !strcmp(v, "on");
            i++;
        } else if (!strcmp(a, "--pack-id")) {
            int64_t id;
            if (cli_parse_i64("train", a, v, 0, GDN_MODEL_MAX_VOCAB - 1, &id)) return CLI_USAGE_ERROR;
            o->pack_by_id = 1, o->pack_id = (gdn_token)id, i++;
        } else if (!strcmp(a, "--pack") && v) {
            if ((o->pack_len = parse_separator(v, sep)) < 0) return CLI_USAGE_ERROR;
            o->pack = sep, i++;
        } else if (!strcmp(a, "--fault") && v && !strcmp(v, "drop-incoming")) {
            o->fault = GDN_CP_FAULT_DROP_INCOMING, i++; /* testing only: a deliberately wrong run */
        } else if (!strcmp(a, "--fault") && v && !strcmp(v, "aux-per-rank")) {
            o->fault = GDN_TRAIN_FAULT_AUX_PER_RANK, i++; /* testing only: the MoE aux loss per rank */
        } else if (!strcmp(a, "--fault") && v && !strcmp(v, "drop-kv")) {
            o->fault = GDN_CP_FAULT_ATTN_DROP_KV, i++; /* testing only: earlier ranks' keys and values unseen */
        } else {
            fprintf(stderr, "gdncp train: unknown option or missing value: %s\n", a);
            return usage();
        }
    }
    o->cp = (int)cp, o->keep_last = (int)keep, o->threads = (int)threads;
    /* auto: the status line when stdout is a terminal (under mpiexec the launcher's pipes are not:
     * say --progress line there) */
    o->progress_line = progress >= 0 ? progress : isatty(STDOUT_FILENO);
    if (head_dim > 0) o->model.d = head_dim, o->model.R = (head_dim / 4) & ~(int64_t)1;
    if (layer_types && interval_given) {
        fprintf(stderr, "gdncp train: --layer-types and --attn-interval exclude each other\n");
        return CLI_USAGE_ERROR;
    }
    if (layer_types) {
        if (parse_layer_types(layer_types, &o->model)) return CLI_USAGE_ERROR;
    } else {
        gdn_model_set_attention_interval(&o->model, interval); /* over the final --layers */
    }
    /* the experts: --experts makes (0: unmakes) every layer's MLP a mixture; the other MoE flags
     * change a model that has them */
    if (experts >= 0) {
        o->model.n_experts = experts;
        for (int64_t l = 0; l < GDN_MODEL_MAX_LAYERS; l++) o->model.moe[l] = experts > 0 && l < o->model.L;
        if (experts && !o->model.top_k) o->model.top_k = 2;
        if (experts && !o->model.moe_I) o->model.moe_I = o->model.I;
        if (experts && !o->model.norm_topk) o->model.norm_topk = 1;
    }
    if ((top_k >= 0 || moe_I >= 0 || shared_I >= 0) && !o->model.n_experts) {
        fprintf(stderr, "gdncp train: --experts-per-tok, --moe-intermediate and --shared-intermediate set a mixture "
                        "of experts: give --experts N (or a *-moe --model)\n");
        return CLI_USAGE_ERROR;
    }
    if (top_k >= 0) o->model.top_k = top_k;
    if (moe_I >= 0) o->model.moe_I = moe_I;
    if (shared_I >= 0) o->model.shared_I = shared_I;
    if (!o->data) {
        fprintf(stderr, "gdncp train: --data FILE is required\n");
        return usage();
    }
    if (o->opt.min_lr < 0) o->opt.min_lr = 0.1 * o->opt.lr;
    o->opt.steps = o->steps;
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
    if (rc) return rank == 0 ? cli_error("train", rc) : 1;
    return 0;
}
