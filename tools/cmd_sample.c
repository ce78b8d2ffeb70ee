/* gdncp sample: text from a checkpoint (GatedDeltaNet-only or hybrid), the prompt prefilled in one
 * piece, then one byte at a time through every layer's decode path and cache (GatedDeltaNet conv
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

static int usage(void) {
    fprintf(stderr, "usage: gdncp sample --ckpt DIR (--prompt TEXT | --prompt-ids I,J,...) [--tokens N]\n"
                    "                    [--temperature T] [--top-k K] [--top-p P] [--seed S] [--threads N]\n"
                    "                    [--stop auto|none] [--print-ids] [--score]\n"
                    "  DIR: a checkpoint directory, or a training --out directory (its newest checkpoint).\n"
                    "  --prompt-ids: the prompt as token ids 0..255; --print-ids: the new tokens as ids\n"
                    "  (comma-separated, one line) instead of the prompt and the text.\n"
                    "  --score: print the mean next-byte loss of the prompt under the checkpoint (nothing generated)\n"
                    "  --temperature 0 picks the most likely byte every time; otherwise softmax(logits / T) over the\n"
                    "  --top-k largest logits (0: all), then over the smallest set of the largest whose probability\n"
                    "  reaches --top-p (1: all); the same sampler as the Python package's Model.generate.\n"
                    "  --stop auto (default): a checkpoint trained with --pack SEP stops once it writes SEP\n"
                    "  (its document ended; the byte after SEP was never trained); none: run to --tokens.\n");
    return CLI_USAGE_ERROR;
}

/* "1,2,3" into ids[0..n) (bytes; cap: strlen / 2 + 1 holds any list); 0 or a message. */
static int parse_ids(const char *text, uint8_t *ids, size_t cap, size_t *n) {
    *n = 0;
    for (const char *p = text; *p;) {
        char *end;
        const long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > 255 || (*end && *end != ',') || *n == cap) {
            fprintf(stderr, "gdncp sample: --prompt-ids %s: expected comma-separated token ids 0..255\n", text);
            return CLI_USAGE_ERROR;
        }
        ids[(*n)++] = (uint8_t)v;
        p = *end ? end + 1 : end;
    }
    return 0;
}

int cmd_sample(int argc, char **argv) {
    const char *ckpt = NULL, *prompt = NULL, *prompt_ids = NULL;
    int print_ids = 0, fault_no_kv = 0, score = 0;
    int64_t tokens = 200, top_k = 0, seed = 1, threads = 0;
    double temperature = 0.8, top_p = 1;
    int stop_auto = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--ckpt") && v) ckpt = v, i++;
        else if (!strcmp(a, "--prompt") && v) prompt = v, i++;
        else if (!strcmp(a, "--prompt-ids") && v) prompt_ids = v, i++;
        else if (!strcmp(a, "--print-ids")) print_ids = 1;
        else if (!strcmp(a, "--score")) score = 1; /* the prompt's loss, nothing generated (tests) */
        else if (!strcmp(a, "--fault") && v && !strcmp(v, "no-kv-cache")) fault_no_kv = 1, i++; /* tests only */
        else if (!strcmp(a, "--tokens")) {
            if (cli_parse_i64("sample", a, v, 1, 1 << 24, &tokens)) return CLI_USAGE_ERROR;
            i++;
        } else if (!strcmp(a, "--top-k")) {
            if (cli_parse_i64("sample", a, v, 1, (int64_t)1 << 40, &top_k)) return CLI_USAGE_ERROR;
            i++;
        } else if (!strcmp(a, "--top-p")) {
            if (cli_parse_f64("sample", a, v, 0, 1, &top_p)) return CLI_USAGE_ERROR;
            if (!(top_p > 0)) {
                fprintf(stderr, "gdncp sample: --top-p %s: expected a probability in (0, 1]\n", v);
                return CLI_USAGE_ERROR;
            }
            i++;
        } else if (!strcmp(a, "--seed")) {
            if (cli_parse_i64("sample", a, v, 0, INT64_MAX, &seed)) return CLI_USAGE_ERROR;
            i++;
        } else if (!strcmp(a, "--threads")) {
            if (cli_parse_i64("sample", a, v, 1, 4096, &threads)) return CLI_USAGE_ERROR;
            i++;
        } else if (!strcmp(a, "--stop") && v && (!strcmp(v, "auto") || !strcmp(v, "none"))) {
            stop_auto = !strcmp(v, "auto"), i++;
        } else if (!strcmp(a, "--temperature")) {
            if (cli_parse_f64("sample", a, v, 0, 100, &temperature)) return CLI_USAGE_ERROR;
            i++;
        } else {
            fprintf(stderr, "gdncp sample: unknown option or missing value: %s\n", a);
            return usage();
        }
    }
    if (!ckpt || !prompt == !prompt_ids) {
        fprintf(stderr, "gdncp sample: --ckpt and one of --prompt, --prompt-ids are required\n");
        return usage();
    }
    size_t np = prompt ? strlen(prompt) : strlen(prompt_ids) / 2 + 1;
    uint8_t *ptok = malloc(np + 1);
    if (!ptok) {
        fprintf(stderr, "gdncp sample: out of memory for the prompt\n");
        return 1;
    }
    if (prompt) memcpy(ptok, prompt, np);
    else if (parse_ids(prompt_ids, ptok, np, &np)) {
        free(ptok);
        return CLI_USAGE_ERROR;
    }
    if (!np) {
        fprintf(stderr, "gdncp sample: the prompt is empty: give the model at least one byte to continue\n");
        free(ptok);
        return CLI_USAGE_ERROR;
    }
    char dir[4096];
    gdn_model_config cfg;
    int rc = gdn_ckpt_resolve(ckpt, dir, sizeof dir);
    if (!rc) rc = gdn_ckpt_load_config(dir, &cfg);
    if (rc) {
        free(ptok);
        return cli_error("sample", rc);
    }
    float *w = aligned_alloc(64, sizeof(float) * ((gdn_model_param_floats(&cfg) + 15) & ~(size_t)15));
    float *logits = malloc(sizeof(float) * np * (size_t)cfg.vocab);
    float *swork = malloc(sizeof(float) * (size_t)cfg.vocab); /* the sampler's (top-k, top-p) */
    gdn_model_decoder *dec = NULL;
    if (!w || !logits || !swork) {
        fprintf(stderr, "gdncp sample: out of memory for the model's %zu parameters\n", gdn_model_param_floats(&cfg));
        free(w), free(logits), free(swork), free(ptok);
        return 1;
    }
    if (!rc) rc = gdn_ckpt_load(dir, &cfg, w, NULL, NULL, NULL);
    uint8_t sep[GDN_DATA_MAX_SEP], tail[GDN_DATA_MAX_SEP] = {0};
    int sep_len = 0;
    if (!rc && stop_auto) rc = gdn_ckpt_pack_separator(dir, sep, GDN_DATA_MAX_SEP, &sep_len);
    /* the KV caches hold the prompt and every new token */
    if (!rc) rc = gdn_model_decoder_create(&dec, &cfg, 1, (int64_t)np + tokens, (int)threads);
    /* the prompt in one piece; its last token's logits give the first new one */
    const double tp = cli_now();
    if (!rc) rc = gdn_model_prefill(dec, w, ptok, (int64_t)np, logits);
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
        printf("score: loss %.7f over %zu targets\n", np > 1 ? sum / (double)(np - 1) : NAN, np - 1);
        gdn_model_decoder_destroy(dec);
        free(w), free(logits), free(swork), free(ptok);
        return 0;
    }
    if (!rc) memmove(logits, logits + (np - 1) * (size_t)cfg.vocab, sizeof(float) * (size_t)cfg.vocab);
    for (size_t i = 0; sep_len && i < np; i++) memmove(tail, tail + 1, (size_t)sep_len - 1), tail[sep_len - 1] = ptok[i];
    const gdn_sampling sampling = {.temperature = temperature, .top_k = top_k, .top_p = top_p};
    uint64_t rng = gdn_sample_seed((uint64_t)seed);

    if (!rc && !print_ids) fwrite(ptok, 1, np, stdout);
    const double t0 = cli_now();
    int64_t made = 0;
    int stopped = 0;
    for (; !rc && made < tokens && !stopped; made++) {
        int64_t next = 0;
        if ((rc = gdn_sample_next(&next, logits, cfg.vocab, &sampling, &rng, swork))) break;
        const uint8_t b = (uint8_t)next;
        if (print_ids) printf(made ? ",%d" : "%d", b);
        else fputc(b, stdout);
        if (sep_len) { /* the document ends with the separator (a match ending on a new byte) */
            memmove(tail, tail + 1, (size_t)sep_len - 1), tail[sep_len - 1] = b;
            stopped = !memcmp(tail, sep, (size_t)sep_len);
        }
        for (int64_t l = 0; fault_no_kv && l < cfg.L; l++) /* the tests' control: every token alone */
            if (gdn_model_decoder_kv_cache(dec, l)) gdn_attn_cache_reset(gdn_model_decoder_kv_cache(dec, l));
        if (!stopped) rc = gdn_model_decode(dec, w, &b, logits);
    }
    const double dt = cli_now() - t0;
    fputc('\n', stdout);
    fflush(stdout);
    if (!rc)
        fprintf(stderr, "gdncp sample: %s, %zu prompt tokens (prefill %.1f ms) + %lld new, %.2f ms per token, "
                        "%.1f tokens/s (decode path, %lld attention layers with a KV cache)%s\n",
                dir, np, 1e3 * prefill_s, (long long)made, 1e3 * dt / (double)(made ? made : 1),
                dt > 0 ? (double)made / dt : 0.0, (long long)gdn_model_attn_layers(&cfg),
                stopped ? "; stopped at the end of the document (the checkpoint was trained with --pack; "
                          "--stop none goes on)" : "");
    gdn_model_decoder_destroy(dec);
    free(w), free(logits), free(swork), free(ptok);
    return rc ? cli_error("sample", rc) : 0;
}
