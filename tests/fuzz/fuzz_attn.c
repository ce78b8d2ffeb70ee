/* libFuzzer harness for the attention weights loader (gdn_attn_weights_load): config.json and the
 * safetensors file together, since the loader cross-checks one against the other. The input is
 *     [2 bytes: L, little-endian][L bytes: config.json (none when L = 0)][the rest: the weights]
 * (an L past the end takes every remaining byte as the config, leaving empty weights). Each
 * input is loaded with and without its config, bare and under "model.layers.3.self_attn.", and
 * once with `given` values; on success every weight's last float is read and the gradients
 * written to a writer (not saved). A returned error is fine; a crash, hang, leak or sanitizer
 * report is a bug. */
#include "fuzz_common.h"

#include "gdncp.h"

static void attn(const char *path, const char *config, const char *prefix, const gdn_attn_config *given) {
    gdn_attn_weights aw;
    if (gdn_attn_weights_load(&aw, path, config, prefix, given) != GDN_OK) {
        (void)gdn_errmsg();
        return;
    }
    volatile float sink = 0;
    for (int p = 0; p < GDN_A_COUNT; p++) { /* ASan flags an array shorter than the layout says */
        gdn_param_info info;
        if (gdn_attn_param(&aw.cfg, p, &info)) break;
        const size_t off = info.offset, n = info.numel;
        if (n) sink += aw.w[off + n - 1];
    }
    (void)sink;
    gdn_st_writer *w = NULL;
    if (gdn_st_writer_create(&w) == GDN_OK) {
        (void)gdn_attn_grads_add(w, &aw, aw.w, "grad.");
        gdn_st_writer_destroy(w);
    }
    gdn_attn_weights_free(&aw);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    size_t L = (size_t)data[0] | (size_t)data[1] << 8;
    if (L > size - 2) L = size - 2;
    const char *config = L ? fuzz_file_at(1, data + 2, L) : NULL;
    const char *path = fuzz_file(data + 2 + L, size - 2 - L);
    if (!path || (L && !config)) return 0;
    static const char *const prefixes[2] = {NULL, "model.layers.3.self_attn."};
    for (int p = 0; p < 2; p++) {
        attn(path, config, prefixes[p], NULL);
        if (config) attn(path, NULL, prefixes[p], NULL);
    }
    gdn_attn_config given;
    memset(&given, 0, sizeof given);
    given.R = 2, given.rope_theta = 1e6, given.max_position = 64, given.eps = 1e-5f;
    attn(path, config, prefixes[1], &given);
    return 0;
}
