/* libFuzzer harness for the checkpoint readers (src/model/checkpoint.c): gdn_ckpt_load_config,
 * gdn_ckpt_load, gdn_ckpt_pack_separator[_id] and gdn_ckpt_resolve on one checkpoint directory
 * whose three files come from the input:
 *     [2 bytes: L1, little-endian][L1 bytes: config.json]
 *     [2 bytes: L2][L2 bytes: trainer_state.json (none when L2 = 0)][the rest: model.safetensors]
 * (a length past the end takes every remaining byte). A rest that starts with '{' and holds a NUL
 * byte is a sharded checkpoint instead: model.safetensors.index.json up to the NUL, then the one
 * shard "model-00001-of-00001.safetensors". A rest holding the 8 bytes "GDNOPTIM" ends its model
 * part there: the bytes after the last such marker are optimizer.safetensors (the moments, and a
 * BF16 save's master weights), read by a resume load. On a loaded config every weight of the
 * table is read (the model's last float touched); models over 4M floats are skipped before
 * allocating (gdn_ckpt_load reads into the caller's array). A returned error is fine; a crash,
 * hang, leak or sanitizer report is a bug. */
#include "gdncp.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char dir[4096];
#define SHARD "model-00001-of-00001.safetensors"

static int put(const char *name, const uint8_t *data, size_t size, int present) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (!present) return unlink(path) == 0 || errno == ENOENT ? 0 : -1;
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    const int ok = fwrite(data, 1, size, f) == size;
    return fclose(f) == 0 && ok ? 0 : -1;
}

static void cleanup(void) {
    const char *names[] = {"config.json", "trainer_state.json", "model.safetensors", "model.safetensors.index.json",
                           SHARD, "optimizer.safetensors"};
    char path[4200];
    for (int i = 0; i < 6; i++) snprintf(path, sizeof path, "%s/%s", dir, names[i]), unlink(path);
    rmdir(dir);
}

static size_t take(const uint8_t **data, size_t *size) {
    if (*size < 2) return *size = 0, 0;
    size_t L = (size_t)(*data)[0] | (size_t)(*data)[1] << 8;
    *data += 2, *size -= 2;
    return L > *size ? *size : L;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!dir[0]) {
        const char *tmp = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/gdn_fuzz_ckpt_XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(dir)) return dir[0] = 0, 0;
        atexit(cleanup);
    }
    const size_t L1 = take(&data, &size);
    const uint8_t *config = data;
    data += L1, size -= L1;
    const size_t L2 = take(&data, &size);
    const uint8_t *state = data;
    data += L2, size -= L2;
    static const char MARK[8] = "GDNOPTIM";
    const uint8_t *optim = NULL;
    size_t optim_len = 0;
    for (size_t i = size >= 8 ? size - 8 + 1 : 0; i-- > 0;)
        if (!memcmp(data + i, MARK, 8)) {
            optim = data + i + 8, optim_len = size - i - 8, size = i;
            break;
        }
    const uint8_t *nul = size && data[0] == '{' ? memchr(data, 0, size) : NULL;
    const size_t il = nul ? (size_t)(nul - data) : 0;
    if (put("config.json", config, L1, 1) || put("trainer_state.json", state, L2, L2 > 0) ||
        put("model.safetensors", data, size, !nul) || put("model.safetensors.index.json", data, il, nul != NULL) ||
        put(SHARD, nul ? nul + 1 : data, nul ? size - il - 1 : 0, nul != NULL) ||
        put("optimizer.safetensors", optim, optim_len, optim != NULL))
        return 0;
    char resolved[4096];
    (void)gdn_ckpt_resolve(dir, resolved, sizeof resolved);
    uint8_t sep[GDN_DATA_MAX_SEP];
    int len = 0;
    int64_t id = 0;
    (void)gdn_ckpt_pack_separator(dir, sep, GDN_DATA_MAX_SEP, &len, NULL);
    (void)gdn_ckpt_pack_separator(dir, sep, GDN_DATA_MAX_SEP, &len, &id);
    gdn_model_config cfg;
    if (gdn_ckpt_load_config(dir, &cfg) != GDN_OK) {
        (void)gdn_errmsg();
        return 0;
    }
    const size_t n = gdn_model_param_floats(&cfg);
    if (n == 0 || n > ((size_t)1 << 22)) return 0;
    float *w = malloc(sizeof(float) * n);
    char *state_json = NULL;
    if (w && gdn_ckpt_load(dir, &cfg, w, NULL, NULL, &state_json) == GDN_OK) {
        volatile float sink = w[n - 1];
        (void)sink;
    }
    free(state_json);
    float *m = optim && w ? malloc(sizeof(float) * n) : NULL, *v = m ? malloc(sizeof(float) * n) : NULL;
    if (v && gdn_ckpt_load(dir, &cfg, w, m, v, NULL) == GDN_OK) { /* a resume: moments (and masters) */
        volatile float sink = w[0] + m[n - 1] + v[n - 1];
        (void)sink;
    }
    free(m), free(v);
    free(w);
    return 0;
}
