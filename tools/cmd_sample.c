/* gdncp sample: text from a trained checkpoint, one byte at a time through the layers' decode
 * path (the recurrent state and conv caches, no re-reading of the prompt). */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdncp/train.h"

static int usage(void) {
    fprintf(stderr, "usage: gdncp sample --ckpt DIR --prompt TEXT [--tokens N] [--temperature T]\n"
                    "                    [--top-k K] [--seed S] [--threads N] [--stop auto|none]\n"
                    "  DIR: a checkpoint directory, or a training --out directory (its newest checkpoint).\n"
                    "  --temperature 0 picks the most likely byte every time.\n"
                    "  --stop auto (default): a checkpoint trained with --pack SEP stops once it writes SEP\n"
                    "  (its document ended; the byte after SEP was never trained); none: run to --tokens.\n");
    return CLI_USAGE_ERROR;
}

/* xorshift64*: the sampling stream (deterministic for a --seed). */
static double next_uniform(uint64_t *s) {
    *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
    return (double)((*s * 0x2545f4914f6cdd1dull) >> 11) * 0x1.0p-53;
}

/* The next byte from logits: greedy at temperature 0, else softmax(logits / T) over the top_k. */
static int pick(const float *logits, int n, double temperature, int top_k, uint64_t *rng) {
    int best = 0;
    for (int i = 1; i < n; i++) best = logits[i] > logits[best] ? i : best;
    if (temperature <= 0) return best;
    /* the k-th largest logit is the cut (ties kept) */
    float cut = -INFINITY;
    if (top_k > 0 && top_k < n) {
        float *sorted = malloc(sizeof(float) * (size_t)n);
        memcpy(sorted, logits, sizeof(float) * (size_t)n);
        for (int i = 0; i < top_k; i++) { /* partial selection: n is 256 */
            int m = i;
            for (int j = i + 1; j < n; j++) m = sorted[j] > sorted[m] ? j : m;
            const float t = sorted[i];
            sorted[i] = sorted[m], sorted[m] = t;
        }
        cut = sorted[top_k - 1];
        free(sorted);
    }
    double p[256], sum = 0;
    for (int i = 0; i < n; i++) {
        p[i] = logits[i] >= cut ? exp((logits[i] - logits[best]) / temperature) : 0.0;
        sum += p[i];
    }
    double u = next_uniform(rng) * sum;
    for (int i = 0; i < n; i++)
        if ((u -= p[i]) <= 0 && p[i] > 0) return i;
    return best;
}

int cmd_sample(int argc, char **argv) {
    const char *ckpt = NULL, *prompt = NULL;
    int64_t tokens = 200, top_k = 0, seed = 1, threads = 0;
    double temperature = 0.8;
    int stop_auto = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--ckpt") && v) ckpt = v, i++;
        else if (!strcmp(a, "--prompt") && v) prompt = v, i++;
        else if (!strcmp(a, "--tokens")) {
            if (cli_parse_i64("sample", a, v, 1, 1 << 24, &tokens)) return CLI_USAGE_ERROR;
            i++;
        } else if (!strcmp(a, "--top-k")) {
            if (cli_parse_i64("sample", a, v, 1, 256, &top_k)) return CLI_USAGE_ERROR;
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
    if (!ckpt || !prompt) {
        fprintf(stderr, "gdncp sample: --ckpt and --prompt are required\n");
        return usage();
    }
    if (!*prompt) {
        fprintf(stderr, "gdncp sample: --prompt is empty: give the model at least one byte to continue\n");
        return CLI_USAGE_ERROR;
    }
    char dir[4096];
    gdn_model_config cfg;
    int rc = gdn_ckpt_resolve(ckpt, dir, sizeof dir);
    if (!rc) rc = gdn_ckpt_load_config(dir, &cfg);
    if (rc) return cli_error("sample", rc);
    float *w = aligned_alloc(64, sizeof(float) * ((gdn_model_param_floats(&cfg) + 15) & ~(size_t)15));
    float *logits = malloc(sizeof(float) * (size_t)cfg.vocab);
    gdn_model_decoder *dec = NULL;
    if (!w || !logits) {
        fprintf(stderr, "gdncp sample: out of memory for the model's %zu parameters\n", gdn_model_param_floats(&cfg));
        free(w), free(logits);
        return 1;
    }
    if (!rc) rc = gdn_ckpt_load(dir, &cfg, w, NULL, NULL, NULL);
    uint8_t sep[GDN_DATA_MAX_SEP], tail[GDN_DATA_MAX_SEP] = {0};
    int sep_len = 0;
    if (!rc && stop_auto) rc = gdn_ckpt_pack_separator(dir, sep, GDN_DATA_MAX_SEP, &sep_len);
    if (!rc) rc = gdn_model_decoder_create(&dec, &cfg, 1, (int)threads);
    /* the prompt through the decode path; its last byte's logits give the first new byte */
    const size_t np = strlen(prompt);
    for (size_t i = 0; !rc && i < np; i++) {
        const uint8_t b = (uint8_t)prompt[i];
        rc = gdn_model_decode(dec, w, &b, logits);
        if (sep_len) memmove(tail, tail + 1, (size_t)sep_len - 1), tail[sep_len - 1] = b;
    }
    uint64_t rng = (uint64_t)seed * 0x9e3779b97f4a7c15ull + 1;
    if (!rc) fputs(prompt, stdout);
    const double t0 = cli_now();
    int64_t made = 0;
    int stopped = 0;
    for (; !rc && made < tokens && !stopped; made++) {
        const uint8_t b = (uint8_t)pick(logits, (int)cfg.vocab, temperature, (int)top_k, &rng);
        fputc(b, stdout);
        if (sep_len) { /* the document ends with the separator (a match ending on a new byte) */
            memmove(tail, tail + 1, (size_t)sep_len - 1), tail[sep_len - 1] = b;
            stopped = !memcmp(tail, sep, (size_t)sep_len);
        }
        if (!stopped) rc = gdn_model_decode(dec, w, &b, logits);
    }
    const double dt = cli_now() - t0;
    fputc('\n', stdout);
    fflush(stdout);
    if (!rc)
        fprintf(stderr, "gdncp sample: %s, %zu prompt + %lld new bytes, %.2f ms per byte (decode path)%s\n", dir, np,
                (long long)made, 1e3 * dt / (double)(made ? made : 1),
                stopped ? "; stopped at the end of the document (the checkpoint was trained with --pack; "
                          "--stop none goes on)" : "");
    gdn_model_decoder_destroy(dec);
    free(w), free(logits);
    return rc ? cli_error("sample", rc) : 0;
}
