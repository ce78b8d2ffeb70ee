/* gdncp sample: text (a byte model) or token ids (any vocabulary) from a checkpoint
 * (GatedDeltaNet-only or hybrid), the prompt prefilled in one piece, then one token at a time through every layer's decode path and cache (GatedDeltaNet conv
 * and recurrent states, the attention layers' KV caches; no re-reading of the prompt). */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdncp/sample.h"
#include "gdncp/train.h"

typedef struct {
    const char *ckpt, *prompt, *prompt_ids;
    int print_ids, score, cache_dtype, compute, stop_auto;
    int64_t tokens, top_k, seed, threads, ep;
    double temperature, top_p;
} sample_opts;

static void sample_init(void *p) {
    sample_opts *o = p;
    o->tokens = 200, o->seed = 1, o->temperature = 0.8, o->top_p = 1, o->stop_auto = 1;
    o->compute = GDN_COMPUTE_FP32, o->ep = 1;
}

static const cli_opt sample_table[] = {
    {CLI_STR("--ckpt", sample_opts, ckpt, "DIR", "a checkpoint directory, or a training --out directory (its newest checkpoint)"), .req = 1},
    {CLI_STR("--prompt", sample_opts, prompt, "TEXT", "the prompt (byte models only; exactly one of --prompt, --prompt-ids)")},
    {CLI_STR("--prompt-ids", sample_opts, prompt_ids, "I,J,..", "the prompt as token ids in [0, vocab)")},
    {CLI_I64("--tokens", sample_opts, tokens, 1, 1 << 24, "N", "new tokens")},
    {CLI_F64("--temperature", sample_opts, temperature, 0, 100, "T", "softmax(logits / T) (0: greedy, the most likely token every time)")},
    {CLI_I64("--top-k", sample_opts, top_k, 0, GDN_MODEL_MAX_VOCAB, "K", "sample among the K largest logits (ties at the k-th kept; 0: all)")},
    {CLI_F64("--top-p", sample_opts, top_p, 0, 1, "P", "then among the smallest set of the largest whose probability reaches P, in (0, 1] (1: all)")},
    {CLI_I64("--seed", sample_opts, seed, 0, INT64_MAX, "S", "the sampling stream")},
    {CLI_I64("--threads", sample_opts, threads, 1, 4096, "N", "OpenMP threads"), .dflt = "all"},
    {CLI_ENUM("--stop", sample_opts, stop_auto, "auto|none", CLI_VALUES(1, 0), "auto: a checkpoint trained with --pack SEP or --pack-id N stops once it writes the separator; none: run to --tokens")},
    {CLI_FLAG("--print-ids", sample_opts, print_ids, "print the new token ids (comma-separated, one line) instead of the text (required beyond bytes)")},
    /* the prompt's loss, nothing generated (tests) */
    {CLI_FLAG("--score", sample_opts, score, "print the prompt's mean next-token loss under the checkpoint (at least 2 tokens) and stop")},
    {CLI_ENUM("--cache-dtype", sample_opts, cache_dtype, "f32|bf16", CLI_VALUES(GDN_F32, GDN_BF16), "the attention layers' KV caches (bf16: half their memory and bytes per token)")},
    {CLI_I64("--ep", sample_opts, ep, 1, 1 << 20, "N", "under mpiexec: the MoE layers' experts split over groups of N ranks, each rank loading 1/N of them; every group generates the same text, which rank 0 prints")},
    {CLI_COMPUTE("--compute", sample_opts, compute, "the prompt's products with bf16 operands and fp32 accumulation (a faster prefill); each new token's step stays fp32")},
    /* testing only: the attention caches emptied before every decode step */
};

const cli_command cmd_sample_cli = {
    .name = "sample",
    .usage = "usage: gdncp sample --ckpt DIR (--prompt TEXT | --prompt-ids I,J,...) [options]\n",
    .summary = "generate text (or token ids) from a checkpoint through the decode path and its caches",
    .about =
    "  DIR: a checkpoint directory, or a training --out directory (its newest checkpoint).\n"
    "  --prompt-ids: the prompt as token ids in [0, vocab); --print-ids: the new tokens as ids\n"
    "  (comma-separated, one line) instead of the prompt and the text. --prompt TEXT and text\n"
    "  output are for byte models (vocab_size 256); another vocabulary needs both id options.\n"
    "  --score: print the mean next-token loss of the prompt under the checkpoint (nothing generated)\n"
    "  --temperature 0 picks the most likely token every time; otherwise softmax(logits / T) over the\n"
    "  --top-k largest logits (0: all), then over the smallest set of the largest whose probability\n"
    "  reaches --top-p (1: all); the same sampler as the Python package's Model.generate.\n"
    "  --stop auto (default): a checkpoint trained with --pack SEP or --pack-id N stops once it\n"
    "  writes the separator (its document ended; the token after it was never trained); none:\n"
    "  run to --tokens.\n"
    "  --cache-dtype bf16: the attention layers' KV caches in BF16 (half their memory and of the bytes\n"
    "  a token reads; keys and values rounded to nearest even, the attention itself in fp32).\n"
    "  --compute bf16: the prompt's products (projections, MLPs, the head) with bf16 operands and\n"
    "  fp32 accumulation (a faster prefill where the CPU has BF16 instructions; logits within ~1e-2);\n"
    "  each new token's step stays fp32.\n",
    .size = sizeof(sample_opts), .init = sample_init, CLI_OPTS(sample_table),
};

/* --prompt-ids "1,2,3" into *ids (malloc'ed, *n of them), each in [0, vocab); 0, or CLI_USAGE_ERROR after
 * saying what is wrong (cli_parse_i64_list refuses blanks, signs, empty entries and a trailing comma). */
static int parse_ids(const char *text, gdn_token **ids, size_t *n, int64_t vocab) {
    int64_t *list = NULL, count = 0;
    *ids = NULL, *n = 0;
    if (cli_parse_i64_list("sample", "--prompt-ids", text, &list, &count)) return CLI_USAGE_ERROR;
    for (int64_t i = 0; i < count; i++)
        if (list[i] >= vocab) {
            fprintf(stderr, "gdncp sample: --prompt-ids: id %lld (entry %lld) is outside the checkpoint's vocabulary: "
                    "expected comma-separated token ids in [0, %lld)\n", (long long)list[i], (long long)i,
                    (long long)vocab);
            free(list);
            return CLI_USAGE_ERROR;
        }
    *ids = malloc(sizeof **ids * (size_t)(count + 1));
    if (!*ids) {
        fprintf(stderr, "gdncp sample: out of memory for the prompt's %lld ids\n", (long long)count);
        free(list);
        return 1;
    }
    for (int64_t i = 0; i < count; i++) (*ids)[i] = (gdn_token)list[i];
    *n = (size_t)count;
    free(list);
    return 0;
}

/* Expert parallelism (--ep N under mpiexec): groups of N consecutive ranks, each group one
 * generation; rank 0 of a group draws every token and sends it to the others, so the group feeds
 * the same token to its decoders (and the same random stream is drawn once). */
typedef struct {
    int rank, size, ep;
    MPI_Comm comm;
    gdn_ep *group;
} sample_ep;

/* A local failure before the ranks agree: said here (this rank's own message), then joined to the
 * agreement; usage errors exit 2. */
#define SAMPLE_FAIL(usage_error, ...) \
    do { fprintf(stderr, "gdncp sample: " __VA_ARGS__); st = GDN_ERR_ARG, usage = (usage_error); } while (0)

int cmd_sample(int argc, char **argv) {
    sample_opts o;
    if (cli_parse(&cmd_sample_cli, argc, argv, &o, NULL)) {
        cli_cp_fail_early(argc, argv); /* under mpiexec: the other ranks stop at their first agreement */
        return CLI_USAGE_ERROR;
    }
    sample_ep e = {0, 1, (int)o.ep, MPI_COMM_NULL, NULL};
    int inited = 0;
    MPI_Initialized(&inited); /* main starts MPI for --ep (any value): every rank of the launch */
    gdn_cp *agree = NULL;     /* then every step where a rank can fail is agreed, as gdncp train does */
    if (inited) {
        MPI_Comm_rank(MPI_COMM_WORLD, &e.rank);
        MPI_Comm_size(MPI_COMM_WORLD, &e.size);
        if (gdn_cp_create(&agree, MPI_COMM_WORLD)) return cli_error("sample", GDN_ERR_MPI);
    }
    const int quiet = e.rank != 0; /* one rank prints */
    const char *ckpt = o.ckpt, *prompt = o.prompt, *prompt_ids = o.prompt_ids;
    const int print_ids = o.print_ids, score = o.score, cache_dtype = o.cache_dtype,
              compute = o.compute, stop_auto = o.stop_auto;
    const int64_t tokens = o.tokens, top_k = o.top_k, seed = o.seed, threads = o.threads;
    const double temperature = o.temperature, top_p = o.top_p;
    int st = GDN_OK, usage = 0, known = 0; /* known: this rank got as far as its values */
    char dir[4096] = "";
    gdn_model_config cfg;
    size_t np = 0;
    gdn_token *ptok = NULL;
    float *w = NULL, *logits = NULL, *swork = NULL;
    gdn_model_decoder *dec = NULL;
    int64_t positions = 0, wd = -1;
    if (!(top_p > 0))
        SAMPLE_FAIL(1, "--top-p %g: expected a probability in (0, 1]\n", top_p);
    else if (!prompt == !prompt_ids)
        SAMPLE_FAIL(1, "--ckpt and exactly one of --prompt, --prompt-ids are required (%s)\n",
                    prompt ? "both were given" : "neither was given");
    /* Under mpiexec, the first agreement (which a rank that failed to parse its options joins too,
     * cli_cp_fail_early): every rank's status and the options that decide the collectives and the
     * tokens; a disagreement is an option error (exit 2) */
    if (agree) {
        const int64_t vals[] = {e.ep, tokens, score, print_ids, seed, top_k, cli_f64_bits(temperature),
                                cli_f64_bits(top_p), cache_dtype, compute, stop_auto};
        static const char *const names[] = {"--ep", "--tokens", "--score", "--print-ids", "--seed", "--top-k",
                                            "--temperature (its bits)", "--top-p (its bits)", "--cache-dtype",
                                            "--compute", "--stop"};
        const int rc = gdn_cp_agree_values(agree, vals, (int)(sizeof vals / sizeof vals[0]), names, st);
        if (rc && !st) cli_error("sample", rc), usage = 1;
        st = rc;
        if (rc) gdn_cp_destroy(agree), agree = NULL; /* every rank stops here: no further agreement */
    }
    if (!st && e.size % e.ep) /* (every rank alike: --ep agreed) */
        SAMPLE_FAIL(1, "--ep %d does not divide the %d ranks of mpiexec\n", e.ep, e.size);
    if (!st && (st = gdn_ckpt_resolve(ckpt, dir, sizeof dir)) == GDN_OK) st = gdn_ckpt_load_config(dir, &cfg);
    if (!st && !quiet && *gdn_ckpt_note()) fprintf(stderr, "gdncp sample: %s\n", gdn_ckpt_note());
    if (!st && e.ep > 1) {
        cfg.ep_size = e.ep, cfg.ep_rank = e.rank % e.ep;
        st = gdn_model_config_check(&cfg); /* MoE layers whose experts N divides */
    }
    if (st && !usage) cli_error("sample", st), usage = -1; /* (said) */
    const int bytes_model = !st && cfg.vocab == 256;
    if (!st && !bytes_model && (prompt || (!print_ids && !score)))
        SAMPLE_FAIL(1, "%s has a vocabulary of %lld ids, not bytes: give the prompt with --prompt-ids and print the "
                    "new tokens with --print-ids (text is for byte models, vocab_size 256)\n", dir, (long long)cfg.vocab);
    if (!st && prompt) {
        np = strlen(prompt);
        if (!(ptok = malloc(sizeof *ptok * (np + 1)))) SAMPLE_FAIL(0, "out of memory for the prompt\n");
        for (size_t i = 0; ptok && i < np; i++) ptok[i] = (unsigned char)prompt[i];
    } else if (!st) {
        const int prc = parse_ids(prompt_ids, &ptok, &np, cfg.vocab); /* (says what is wrong) */
        if (prc) st = GDN_ERR_ARG, usage = prc == CLI_USAGE_ERROR;
    }
    if (!st && !np) SAMPLE_FAIL(1, "the prompt is empty: give the model at least one token to continue\n");
    if (!st && score && np < 2) /* as Python's Model.loss: no target to score */
        SAMPLE_FAIL(1, "--score needs a prompt of at least 2 tokens (each token predicts the next), got %zu\n", np);
    /* the attention layers' positions: the prompt, and the new tokens unless scoring (which generates none) */
    positions = (int64_t)np + (score ? 0 : tokens);
    if (!st && gdn_model_count_layers(&cfg, GDN_MODEL_ATTN_LAYERS) && cfg.max_position > 0 && positions > cfg.max_position) {
        if (score)
            SAMPLE_FAIL(0, "the prompt's %zu tokens are beyond the checkpoint's max_position_embeddings = %lld\n", np,
                        (long long)cfg.max_position);
        else
            SAMPLE_FAIL(0, "the prompt's %zu tokens + --tokens %lld = %lld positions are beyond the checkpoint's "
                        "max_position_embeddings = %lld (ask for fewer --tokens, or a shorter prompt)\n", np,
                        (long long)tokens, (long long)positions, (long long)cfg.max_position);
    }
    if (!st) {
        w = aligned_alloc(64, sizeof(float) * ((gdn_model_param_floats(&cfg) + 15) & ~(size_t)15));
        /* --score reads every prompt position's logits; generating, only the last one's */
        logits = malloc(sizeof(float) * (score ? np : 1) * (size_t)cfg.vocab);
        swork = malloc(sizeof(float) * (size_t)cfg.vocab); /* the sampler's (top-k, top-p) */
        if (!w || !logits || !swork)
            SAMPLE_FAIL(0, "out of memory for the model's %zu parameters\n", gdn_model_param_floats(&cfg));
    }
    if (!st && (st = gdn_ckpt_load(dir, &cfg, w, NULL, NULL, NULL))) cli_error("sample", st), usage = -1;
    if (!st && agree) wd = gdn_train_checkpoint_digest(dir);
    known = !st;
    /* the second: every rank's status, its prompt and its weights (the same checkpoint everywhere) */
    if (agree) {
        const int64_t vals[] = {(int64_t)np, gdn_cp_digest(ptok, sizeof *ptok * np), wd};
        static const char *const names[] = {"the prompt's length", "the prompt (a digest of its tokens)",
                                            "the checkpoint (a digest of every byte of --ckpt's weight files)"};
        const int rc = gdn_cp_agree_values(agree, vals, known ? (int)(sizeof vals / sizeof vals[0]) : 0, names, st);
        if (rc && !st) cli_error("sample", rc), usage = -1; /* (another rank's failure, or a disagreement) */
        st = rc;
    }
    int rc = st;
    if (!rc && e.ep > 1) { /* (every rank is here: the agreement passed) */
        MPI_Comm_split(MPI_COMM_WORLD, e.rank / e.ep, e.rank, &e.comm);
        rc = gdn_ep_create(&e.group, e.comm);
    }
    uint8_t sep_bytes[GDN_DATA_MAX_SEP];
    gdn_token sep[GDN_DATA_MAX_SEP], tail[GDN_DATA_MAX_SEP] = {0};
    int sep_len = 0;
    int64_t sep_id = -1;
    if (!rc && stop_auto) rc = gdn_ckpt_pack_separator(dir, sep_bytes, GDN_DATA_MAX_SEP, &sep_len, &sep_id);
    for (int i = 0; i < sep_len; i++) sep[i] = sep_bytes[i];
    if (!rc && sep_id >= 0) sep[0] = (gdn_token)sep_id, sep_len = 1;
    /* the KV caches hold the prompt and every new token */
    if (!rc) rc = gdn_model_decoder_create(&dec, &cfg, 1, positions, (int)threads, cache_dtype);
    if (!rc) rc = gdn_model_decoder_set_compute(dec, compute);
    if (!rc && e.group) rc = gdn_model_decoder_set_experts(dec, e.group);
    if (agree && !st) rc = gdn_cp_agree_status(agree, rc); /* (a failure before: every rank knows it) */
    /* the prompt (scoring: in one piece, every position's logits; generating: in pieces of at most
     * PREFILL_PIECE tokens, so its activations stay bounded, and only the last position's logits,
     * which give the first new token) */
    const double tp = cli_now();
    enum { PREFILL_PIECE = 4096 };
    if (!rc && score) rc = gdn_model_prefill(dec, w, ptok, (int64_t)np, logits);
    for (size_t t0 = 0; !rc && !score && t0 < np; t0 += PREFILL_PIECE)
        rc = gdn_model_prefill_last(dec, w, ptok + t0, (int64_t)(np - t0 < PREFILL_PIECE ? np - t0 : PREFILL_PIECE),
                                    logits);
    const double prefill_s = cli_now() - tp;
    if (!rc && score) { /* mean cross-entropy of the prompt's bytes 1..np-1, in double */
        double sum = 0;
        for (size_t t = 0; t + 1 < np; t++) {
            const float *z = logits + t * (size_t)cfg.vocab;
            double mx = z[0], se = 0;
            for (int64_t k = 1; k < cfg.vocab; k++) mx = z[k] > mx ? z[k] : mx;
            for (int64_t k = 0; k < cfg.vocab; k++) se += exp((double)z[k] - mx);
            sum += mx + log(se) - (double)z[ptok[t + 1]];
        }
        if (!quiet) printf("score: loss %.7f over %zu targets\n", sum / (double)(np - 1), np - 1);
        gdn_model_decoder_destroy(dec);
        gdn_ep_destroy(e.group);
        if (e.comm != MPI_COMM_NULL) MPI_Comm_free(&e.comm);
        gdn_cp_destroy(agree);
        free(w), free(logits), free(ptok), free(swork);
        return 0;
    }
    for (size_t i = 0; sep_len && i < np; i++)
        memmove(tail, tail + 1, sizeof *tail * ((size_t)sep_len - 1)), tail[sep_len - 1] = ptok[i];
    const gdn_sampling sampling = {.temperature = temperature, .top_k = top_k, .top_p = top_p};
    uint64_t rng = gdn_sample_seed((uint64_t)seed);
    for (size_t i = 0; !rc && !quiet && !print_ids && i < np; i++) fputc(ptok[i], stdout);
    const double t0 = cli_now();
    int64_t made = 0;
    int stopped = 0;
    for (; !rc && made < tokens && !stopped; made++) {
        int64_t next = 0;
        int group_rank = 0;
        if (e.group) MPI_Comm_rank(e.comm, &group_rank);
        if (!group_rank) rc = gdn_sample_next(&next, logits, cfg.vocab, &sampling, &rng, swork);
        if (e.group) { /* the group's token (or its first rank's failure) */
            int64_t msg[2] = {rc, next};
            MPI_Bcast(msg, 2, MPI_INT64_T, 0, e.comm);
            if (msg[0] && !rc) {
                fprintf(stderr, "gdncp sample: the expert group's first rank failed to sample\n");
                rc = -(int)msg[0];
            }
            next = msg[1];
        }
        if (rc) break;
        const gdn_token b = (gdn_token)next;
        if (quiet) {
        } else if (print_ids) printf(made ? ",%d" : "%d", (int)b);
        else fputc(b, stdout);
        if (sep_len) { /* the document ends with the separator (a match ending on a new token) */
            memmove(tail, tail + 1, sizeof *tail * ((size_t)sep_len - 1)), tail[sep_len - 1] = b;
            stopped = !memcmp(tail, sep, sizeof *sep * (size_t)sep_len);
        }
        if (!stopped) rc = gdn_model_decode(dec, w, &b, logits);
    }
    const double dt = cli_now() - t0;
    if (!quiet) fputc('\n', stdout);
    fflush(stdout);
    if (!rc && !quiet)
        fprintf(stderr, "gdncp sample: %s, %zu prompt tokens (prefill %.1f ms) + %lld new, %.2f ms per token, "
                        "%.1f tokens/s (decode path, %lld attention layers with a%s KV cache)%s\n",
                dir, np, 1e3 * prefill_s, (long long)made, 1e3 * dt / (double)(made ? made : 1),
                dt > 0 ? (double)made / dt : 0.0, (long long)gdn_model_count_layers(&cfg, GDN_MODEL_ATTN_LAYERS), cache_dtype ? " BF16" : "n F32",
                stopped ? "; stopped at the end of the document (the checkpoint was trained with --pack; "
                          "--stop none goes on)" : "");
    gdn_model_decoder_destroy(dec);
    gdn_ep_destroy(e.group);
    if (e.comm != MPI_COMM_NULL) MPI_Comm_free(&e.comm);
    gdn_cp_destroy(agree);
    free(w), free(logits), free(ptok), free(swork);
    if (st) return usage == 1 ? CLI_USAGE_ERROR : 1; /* (said before or at the agreement) */
    return rc < 0 ? 1 : rc ? cli_error("sample", rc) : 0;
}
