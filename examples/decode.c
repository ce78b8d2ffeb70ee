/* Greedy generation from a checkpoint with libgdncp alone: no MPI header, no MPI library.
 *
 *   gdncp_decode_example CHECKPOINT N ID [ID ...]
 *
 * reads CHECKPOINT (a directory with config.json and model.safetensors, gdncp's or transformers'),
 * feeds the prompt ids in one prefill, then picks N tokens greedily, one decode step each, and
 * prints them space-separated on one line. Exit status 0, or 1 with the library's message. */
#include <gdncp.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

static int fail(int rc) {
    fprintf(stderr, "gdncp_decode_example: %s: %s\n", gdn_strerror(rc), gdn_errmsg());
    return 1;
}

static int parse_id(const char *s, int64_t vocab, gdn_token *id) {
    char *end;
    errno = 0;
    const long long v = strtoll(s, &end, 10);
    if (errno || *end || end == s || v < 0 || v >= vocab) return 0;
    *id = (gdn_token)v;
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s CHECKPOINT N ID [ID ...]\n", argv[0]);
        return 2;
    }
    gdn_model_config cfg;
    int rc = gdn_ckpt_load_config(argv[1], &cfg);
    if (rc) return fail(rc);
    char *end;
    const long n_new = strtol(argv[2], &end, 10);
    const int64_t T = argc - 3;
    if (*end || n_new < 1 || n_new > 1 << 20) {
        fprintf(stderr, "gdncp_decode_example: N = '%s' is not a count in [1, %d]\n", argv[2], 1 << 20);
        return 2;
    }
    gdn_token *ids = malloc(sizeof *ids * (size_t)T);
    float *w = gdn_model_alloc(sizeof(float) * gdn_model_param_floats(&cfg), 0);
    float *logits = malloc(sizeof(float) * (size_t)cfg.vocab);
    gdn_model_decoder *dec = NULL;
    if (!ids || !w || !logits) {
        fprintf(stderr, "gdncp_decode_example: out of memory\n");
        return 1;
    }
    for (int64_t t = 0; t < T; t++)
        if (!parse_id(argv[3 + t], cfg.vocab, &ids[t])) {
            fprintf(stderr, "gdncp_decode_example: '%s' is not a token id in [0, %lld)\n", argv[3 + t],
                    (long long)cfg.vocab);
            return 2;
        }
    if ((rc = gdn_ckpt_load(argv[1], &cfg, w, NULL, NULL, NULL))) return fail(rc);
    if ((rc = gdn_model_decoder_create(&dec, &cfg, 1, T + n_new, 0, GDN_F32))) return fail(rc);
    const gdn_sampling greedy = gdn_sampling_default();
    uint64_t rng = gdn_sample_seed(0);
    rc = gdn_model_prefill_last(dec, w, ids, T, logits);
    for (long i = 0; !rc && i < n_new; i++) {
        int64_t next = 0;
        rc = gdn_sample_next(&next, logits, cfg.vocab, &greedy, &rng, NULL);
        if (rc) break;
        printf("%s%lld", i ? " " : "", (long long)next);
        const gdn_token tok = (gdn_token)next;
        if (i + 1 < n_new) rc = gdn_model_decode(dec, w, &tok, logits);
    }
    printf("\n");
    gdn_model_decoder_destroy(dec);
    free(logits), free(w), free(ids);
    return rc ? fail(rc) : 0;
}
