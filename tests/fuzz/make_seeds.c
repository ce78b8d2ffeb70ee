/* Writes the fuzz seed corpus into DIR (tests/fuzz/corpus/ in the repository; regenerate with
 * build-fuzz/gdn_fuzz_seeds tests/fuzz/corpus): small valid problem and layer-weight files written
 * by the library's own writer in every readable dtype, attention seeds (config.json and weights in
 * one input, tests/fuzz/fuzz_attn.c's format), plus hand-made edge cases (empty header,
 * metadata only, other dtypes, zero-sized and 0-d tensors, trailing bytes, truncation), and
 * training data for tests/fuzz/fuzz_tokens.c (token files of uint16 and uint32 ids, llm.c's
 * header, byte text). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdncp.h"

static const char *dir;

static void die(const char *what) {
    fprintf(stderr, "make_seeds: %s: %s\n", what, gdn_errmsg());
    exit(1);
}

static float *ramp(int64_t n, float scale) {
    float *x = malloc(sizeof(float) * (size_t)(n ? n : 1));
    for (int64_t i = 0; i < n; i++) x[i] = scale * (float)((i * 37) % 23 - 11) / 11.0f;
    return x;
}

static void add(gdn_st_writer *w, const char *name, gdn_dtype dt, int nd, const int64_t *shape) {
    int64_t n = 1;
    for (int i = 0; i < nd; i++) n *= shape[i];
    float *x = ramp(n, 0.5f);
    if (gdn_st_writer_add(w, name, dt, nd, shape, x, GDN_F32)) die(name);
    free(x);
}

static void save(gdn_st_writer *w, const char *name) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (gdn_st_writer_save(w, path)) die(name);
    gdn_st_writer_destroy(w);
}

static gdn_st_writer *writer(void) {
    gdn_st_writer *w = NULL;
    if (gdn_st_writer_create(&w)) die("writer");
    return w;
}

/* A problem file: B, T, Hk, Hv, K, V; with h0 / do / dht as asked. */
static void problem(const char *name, gdn_dtype dt, int64_t B, int64_t T, int64_t Hk, int64_t Hv,
                    int64_t K, int64_t V, int h0, int grads) {
    gdn_st_writer *w = writer();
    const int64_t sqk[4] = {B, T, Hk, K}, sv[4] = {B, T, Hv, V}, sg[3] = {B, T, Hv},
                  ss[4] = {B, Hv, K, V};
    add(w, "q", dt, 4, sqk), add(w, "k", dt, 4, sqk), add(w, "v", dt, 4, sv);
    add(w, "g", GDN_F32, 3, sg), add(w, "beta", dt, 3, sg);
    if (h0) add(w, "h0", dt, 4, ss);
    if (grads) add(w, "do", dt, 4, sv), add(w, "dht", GDN_F32, 4, ss);
    gdn_st_writer_metadata(w, "producer", "gdn_fuzz_seeds");
    save(w, name);
}

/* Layer weights, split or fused, bare or under a prefix, dims in __metadata__ or not. */
static void layer(const char *name, gdn_dtype dt, const char *prefix, int fused, int meta) {
    gdn_layer_config c = gdn_layer_config_default(1, 1, 8, 1, 2, 4, 4);
    c.Kc = 2;
    gdn_st_writer *w = writer();
    char full[256];
    int64_t shape[3];
    for (int p = 0; p < GDN_P_COUNT; p++) {
        if (fused && p <= GDN_P_IN_PROJ_A) continue;
        gdn_param_info info;
        if (gdn_layer_param(&c, p, &info)) break;
        memcpy(shape, info.shape, sizeof shape);
        snprintf(full, sizeof full, "%s%s", prefix, info.name);
        add(w, full, dt, info.ndim, shape);
    }
    if (fused) {
        const int64_t qkvz[2] = {2 * c.Hk * c.K + 2 * c.Hv * c.V, c.E}, ba[2] = {2 * c.Hv, c.E};
        snprintf(full, sizeof full, "%sin_proj_qkvz.weight", prefix);
        add(w, full, dt, 2, qkvz);
        snprintf(full, sizeof full, "%sin_proj_ba.weight", prefix);
        add(w, full, dt, 2, ba);
    }
    if (*prefix) { /* another layer's tensor and a non-layer one: ignored */
        const int64_t s[1] = {3};
        add(w, "model.layers.1.linear_attn.A_log", GDN_F32, 1, s);
        add(w, "model.embed_tokens.weight", GDN_BF16, 1, s);
    }
    if (meta) {
        const char *kv[][2] = {{"E", "8"}, {"Hk", "1"}, {"Hv", "2"}, {"K", "4"},
                               {"V", "4"}, {"Kc", "2"}, {"rms_norm_eps", "1e-6"}};
        for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++)
            gdn_st_writer_metadata(w, kv[i][0], kv[i][1]);
    }
    save(w, name);
}

/* An attention seed (fuzz_attn.c's input): [2-byte length][config.json][safetensors] with a tiny
 * layer (E 8, H 2, Hkv 1, d 4), under prefix, in dtype dt, dims in __metadata__ or not. */
static void attention(const char *name, const char *config, gdn_dtype dt, const char *prefix, int meta) {
    gdn_attn_config c = gdn_attn_config_default(1, 1, 8, 2, 1, 4);
    gdn_st_writer *w = writer();
    char full[256], path[4096], tmp[4096];
    int64_t shape[2];
    for (int p = 0; p < GDN_A_COUNT; p++) {
        gdn_param_info info;
        if (gdn_attn_param(&c, p, &info)) break;
        memcpy(shape, info.shape, sizeof shape);
        snprintf(full, sizeof full, "%s%s", prefix, info.name);
        add(w, full, dt, info.ndim, shape);
    }
    if (*prefix) { /* another layer's tensor: ignored */
        const int64_t s1[1] = {3};
        add(w, "model.layers.0.linear_attn.A_log", GDN_F32, 1, s1);
    }
    if (meta) {
        const char *kv[][2] = {{"E", "8"}, {"H", "2"}, {"Hkv", "1"}, {"d", "4"}, {"R", "2"},
                               {"rope_theta", "1000000"}, {"rms_norm_eps", "1e-6"}, {"max_position", "64"}};
        for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) gdn_st_writer_metadata(w, kv[i][0], kv[i][1]);
    }
    snprintf(tmp, sizeof tmp, "%s.st", name);
    save(w, tmp);
    snprintf(tmp, sizeof tmp, "%s/%s.st", dir, name);
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *in = fopen(tmp, "rb"), *out = fopen(path, "wb");
    if (!in || !out) die(path);
    const size_t L = config ? strlen(config) : 0;
    fputc((int)(L & 255), out), fputc((int)(L >> 8), out);
    if (L) fwrite(config, 1, L, out);
    for (int ch; (ch = fgetc(in)) != EOF;) fputc(ch, out);
    fclose(in), fclose(out);
    remove(tmp);
}

/* A raw file: 8-byte little-endian header length, header text, then `data` bytes of a ramp. */
static void raw(const char *name, const char *header, size_t data) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp) die(path);
    uint64_t n = strlen(header);
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)(n >> (8 * i));
    fwrite(len8, 1, 8, fp);
    fwrite(header, 1, n, fp);
    for (size_t i = 0; i < data; i++) fputc((int)(i * 13 % 251), fp);
    fclose(fp);
}

/* A token file (include/gdncp/data.h): header words magic, version, count (2 words), width,
 * vocab, then n ids of the given width; ids cycle through 0..span-1 with the separators 10, 37. */
static void tokens(const char *name, uint32_t magic, uint32_t version, int width, uint32_t vocab, int64_t n,
                   uint32_t span) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *fp = fopen(path, "wb");
    if (!fp) die(path);
    const uint32_t h[6] = {magic, version, (uint32_t)n, (uint32_t)((uint64_t)n >> 32), (uint32_t)width, vocab};
    unsigned char head[1024] = {0};
    for (int i = 0; i < 6; i++)
        for (int k = 0; k < 4; k++) head[4 * i + k] = (unsigned char)(h[i] >> (8 * k));
    fwrite(head, 1, sizeof head, fp);
    for (int64_t i = 0; i < n; i++) {
        const uint32_t id = i % 29 == 28 ? 10u : i % 41 == 40 ? 37u : (uint32_t)((i * 7919) % span);
        for (int k = 0; k < width; k++) fputc((int)((id >> (8 * k)) & 0xff), fp);
    }
    fclose(fp);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    dir = argv[1];
    problem("problem_f32_grads.safetensors", GDN_F32, 1, 5, 1, 2, 4, 4, 1, 1);
    problem("problem_bf16.safetensors", GDN_BF16, 2, 3, 2, 2, 3, 2, 0, 0);
    problem("problem_f64_h0.safetensors", GDN_F64, 1, 4, 1, 1, 2, 3, 1, 1);
    problem("problem_t1.safetensors", GDN_F32, 1, 1, 1, 1, 1, 1, 0, 1);
    layer("layer_split_meta.safetensors", GDN_F32, "", 0, 1);
    layer("layer_prefix_bf16.safetensors", GDN_BF16, "model.layers.0.linear_attn.", 0, 1);
    layer("layer_fused_f64.safetensors", GDN_F64, "", 1, 1);
    layer("layer_fused_prefix_nometa.safetensors", GDN_F32, "model.layers.0.linear_attn.", 1, 0);
    attention("attn_text_config_mrope.fuzz",
              "{\"text_config\": {\"hidden_size\": 8, \"num_attention_heads\": 2, \"num_key_value_heads\": 1,"
              " \"head_dim\": 4, \"rms_norm_eps\": 1e-6, \"max_position_embeddings\": 64, \"rope_parameters\":"
              " {\"mrope_section\": [1], \"rope_type\": \"default\", \"rope_theta\": 1000000,"
              " \"partial_rotary_factor\": 0.5}}}",
              GDN_F32, "model.layers.3.self_attn.", 0);
    attention("attn_bare_meta_bf16.fuzz", NULL, GDN_BF16, "", 1);
    attention("attn_v4_f64.fuzz",
              "{\"hidden_size\": 8, \"num_attention_heads\": 2, \"rope_theta\": 10000.0,"
              " \"partial_rotary_factor\": 0.5, \"rope_scaling\": null}",
              GDN_F64, "model.layers.3.self_attn.", 0);
    raw("empty_header.safetensors", "{}", 0);
    raw("metadata_only.safetensors", "{\"__metadata__\":{\"producer\":\"x\",\"Hk\":\"2\"}}", 0);
    raw("other_dtypes.safetensors",
        "{\"a\":{\"dtype\":\"I32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
        "\"b\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[16,22]},"
        "\"c\":{\"dtype\":\"BOOL\",\"shape\":[2],\"data_offsets\":[22,24]},"
        "\"d\":{\"dtype\":\"F8_E4M3\",\"shape\":[1,1],\"data_offsets\":[24,25]}}", 25);
    raw("zero_and_scalar.safetensors",
        "{\"z\":{\"dtype\":\"F32\",\"shape\":[0,4],\"data_offsets\":[0,0]},"
        "\"s\":{\"dtype\":\"F64\",\"shape\":[],\"data_offsets\":[0,8]},"
        "\"r\":{\"dtype\":\"BF16\",\"shape\":[2,3,1],\"data_offsets\":[8,20]},"
        "\"__metadata__\":{\"format\":\"pt\"}}", 24);
    raw("trailing_bytes.safetensors",
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}   ", 40);
    raw("truncated.safetensors",
        "{\"x\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,64]}}", 10);
    raw("overlap.safetensors",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
        "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12);
    tokens("tokens_u16.fuzz", GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, 2, 300, 600, 300);
    tokens("tokens_u32.fuzz", GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, 4, 0, 400, 248320);
    tokens("tokens_llmc.fuzz", GDN_TOKENS_MAGIC_LLMC, 1, 2, 0, 500, 256);
    FILE *fp;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, "text.fuzz");
    if (!(fp = fopen(path, "wb"))) die(path);
    for (int i = 0; i < 700; i++) fputc(i % 53 == 52 ? '\n' : i % 97 == 3 ? '%' : 'a' + (i * 7) % 26, fp);
    fclose(fp);
    return 0;
}
