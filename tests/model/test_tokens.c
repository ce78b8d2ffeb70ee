/* Token files (docs/training.md "Token files"; gdn_data_open in src/model/data.c): uint16 and
 * uint32 ids read back exactly with positioned reads, llm.c's header read too, every malformed
 * header refused with a message naming what is wrong, ids outside the model's vocabulary refused
 * naming the file, the byte offset and the id, packed documents split at a one-id separator.
 * Each equality beside a control that must fail it. */
#include "harness.h"

#include "gdncp.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[256];

static const char *at(char *buf, const char *name) {
    snprintf(buf, 512, "%s/%s", dir, name);
    return buf;
}

/* A token file: header words h[0..5] (the rest 0, except extra_word/extra_value), then n ids of
 * `width` bytes, little-endian; `cut` bytes dropped from the end. */
static void write_tokens(const char *path, const uint32_t h[6], int extra_word, uint32_t extra_value,
                         const uint32_t *ids, int64_t n, int width, int64_t cut) {
    const int64_t bytes = GDN_TOKENS_HEADER_BYTES + n * width;
    uint8_t *buf = calloc((size_t)bytes, 1);
    for (int i = 0; i < 6; i++)
        for (int k = 0; k < 4; k++) buf[4 * i + k] = (uint8_t)(h[i] >> (8 * k));
    if (extra_word > 0)
        for (int k = 0; k < 4; k++) buf[4 * extra_word + k] = (uint8_t)(extra_value >> (8 * k));
    for (int64_t i = 0; i < n; i++)
        for (int k = 0; k < width; k++) buf[GDN_TOKENS_HEADER_BYTES + i * width + k] = (uint8_t)(ids[i] >> (8 * k));
    FILE *f = fopen(path, "wb");
    if (f) fwrite(buf, 1, (size_t)(bytes - cut), f), fclose(f);
    free(buf);
}

static int ids_equal(const gdn_token *a, const uint32_t *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if ((uint32_t)a[i] != b[i]) return 0;
    return 1;
}

/* gdn_data_describe's answer (zeroed when refused). */
static gdn_data_info info_of(const gdn_data *d) {
    gdn_data_info info;
    (void)gdn_data_describe(d, &info);
    return info;
}

static void test_round_trips(void) {
    char p[512];
    enum { N = 5000 };
    uint32_t *ids = malloc(sizeof *ids * N);
    gdn_token got[128];
    gdn_data *d = NULL;
    /* uint16, header vocabulary 300, a model of 300 */
    for (int i = 0; i < N; i++) ids[i] = (uint32_t)((i * 7919u) % 300);
    const uint32_t h16[6] = {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N, 0, 2, 300};
    write_tokens(at(p, "u16.tok"), h16, 0, 0, ids, N, 2, 0);
    int rc = gdn_data_open(&d, p, 0.1, 300);
    check(rc == GDN_OK && info_of(d).tokens && info_of(d).width == 2 && info_of(d).file_vocab == 300 &&
              gdn_data_split_len(d, GDN_SPLIT_TRAIN) == 4500 && gdn_data_split_len(d, GDN_SPLIT_VAL) == 500,
          "uint16 token file: %d ids split 4500 / 500 (%s)", N, rc ? gdn_errmsg() : "ok");
    if (!rc) {
        rc = gdn_data_read(d, GDN_SPLIT_VAL, 100, 64, got);
        check(rc == GDN_OK && ids_equal(got, ids + 4600, 64), "uint16: validation ids [100, 164) are the file's [4600, 4664)");
        check(!ids_equal(got, ids + 4601, 64), "uint16: ... and not the file's ids one later (control)");
        rc = gdn_data_read(d, GDN_SPLIT_TRAIN, 4436, 64, got);
        check(rc == GDN_OK && ids_equal(got, ids + 4436, 64), "uint16: the last 64 training ids");
        expect_status(gdn_data_read(d, GDN_SPLIT_TRAIN, 4437, 64, got), GDN_ERR_SHAPE,
                      "tokens [4437, 4501) are outside the training split of 4500 tokens", "uint16: a read past the split");
        gdn_data_close(d), d = NULL;
    }
    /* the header's vocabulary larger than the model's */
    expect_status(gdn_data_open(&d, p, 0.1, 256), GDN_ERR_SHAPE, "vocabulary has 300 ids (its header), the model's 256",
                  "uint16 file of vocabulary 300 for a model of 256");

    /* uint32 with Qwen3.5's vocabulary: ids up to 248,319; one id 248,320 at index 3000 */
    for (int i = 0; i < N; i++) ids[i] = i % 5 == 0 ? 248319u - (uint32_t)i : (uint32_t)((i * 104729u) % 248320u);
    ids[3000] = 248320;
    const uint32_t h32[6] = {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N, 0, 4, 0};
    write_tokens(at(p, "u32.tok"), h32, 0, 0, ids, N, 4, 0);
    rc = gdn_data_open(&d, p, 0.1, 248320);
    check(rc == GDN_OK && info_of(d).width == 4, "uint32 token file opens (%s)", rc ? gdn_errmsg() : "ok");
    if (!rc) {
        rc = gdn_data_read(d, GDN_SPLIT_TRAIN, 2900, 100, got);
        check(rc == GDN_OK && ids_equal(got, ids + 2900, 100), "uint32: ids [2900, 3000) read back (ids up to 248,319)");
        char want[1200];
        snprintf(want, sizeof want, "%s: token id 248320 at byte offset %d (id 3000 of the file) is outside the model's "
                 "vocabulary [0, 248320)", p, GDN_TOKENS_HEADER_BYTES + 4 * 3000);
        expect_status(gdn_data_read(d, GDN_SPLIT_TRAIN, 2990, 20, got), GDN_ERR_SHAPE, want,
                      "uint32: an id >= vocab in the data, named with its file, offset and id");
        gdn_data_close(d), d = NULL;
    }
    /* a uint32 id beyond INT32_MAX is no id */
    ids[3000] = 0x80000000u;
    write_tokens(at(p, "u32big.tok"), h32, 0, 0, ids, N, 4, 0);
    if (!gdn_data_open(&d, p, 0.1, 248320)) {
        expect_status(gdn_data_read(d, GDN_SPLIT_TRAIN, 3000, 1, got), GDN_ERR_SHAPE, "token id 2147483648",
                      "uint32: id 2^31 refused (not read as a negative int32)");
        gdn_data_close(d), d = NULL;
    }

    /* llm.c's header: magic 20240520, version 1 (uint16), the count in word 2 */
    for (int i = 0; i < N; i++) ids[i] = (uint32_t)((i * 31u) % 50257u);
    const uint32_t hl[6] = {GDN_TOKENS_MAGIC_LLMC, 1, N, 0, 0, 0};
    write_tokens(at(p, "llmc.bin"), hl, 0, 0, ids, N, 2, 0);
    rc = gdn_data_open(&d, p, 0.1, 50257);
    if (!rc) rc = gdn_data_read(d, GDN_SPLIT_TRAIN, 1000, 128, got);
    check(rc == GDN_OK && ids_equal(got, ids + 1000, 128) && info_of(d).file_vocab == 0,
          "llm.c token file (version 1, uint16) read back (%s)", rc ? gdn_errmsg() : "ok");
    gdn_data_close(d), d = NULL;

    /* packed documents at a one-id separator (7): documents start after each 7 */
    for (int i = 0; i < N; i++) ids[i] = i % 50 == 49 ? 7u : 100u + (uint32_t)(i % 13);
    write_tokens(at(p, "docs.tok"), h16, 0, 0, ids, N, 2, 0);
    rc = gdn_data_open(&d, p, 0.1, 300);
    if (!rc) {
        gdn_token buf[201], sep = 7, other = 8;
        const gdn_token *win = NULL;
        int64_t cu[202], n = 0, n_other = 0;
        rc = gdn_data_window_docs(d, GDN_SPLIT_TRAIN, 120, 200, &sep, 1, buf, &win, cu, &n);
        /* ids 149, 199, 249, 299 are separators: documents start at window offsets 30, 80, 130, 180 */
        check(rc == GDN_OK && n == 5 && cu[1] == 30 && cu[2] == 80 && cu[3] == 130 && cu[4] == 180 && cu[5] == 200 &&
                  ids_equal(win, ids + 120, 200),
              "token file packed at id 7: documents at 0, 30, 80, 130, 180 of the window (%lld found)", (long long)n);
        rc = gdn_data_window_docs(d, GDN_SPLIT_TRAIN, 120, 200, &other, 1, buf, &win, cu, &n_other);
        check(rc == GDN_OK && n_other == 1, "... and one document at a separator id that never occurs (control)");
        gdn_data_close(d), d = NULL;
    }
    free(ids);
}

static void test_bad_headers(void) {
    char p[512];
    enum { N = 1000 };
    uint32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (uint32_t)(i % 256);
    gdn_data *d = NULL;
    const uint32_t good[6] = {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N, 0, 2, 256};
    write_tokens(at(p, "good.tok"), good, 0, 0, ids, N, 2, 0);
    check(gdn_data_open(&d, p, 0.1, 256) == GDN_OK, "a well-formed token file opens (control for the refusals below)");
    gdn_data_close(d), d = NULL;
    struct { const char *name, *needle, *what; uint32_t h[6]; int word; uint32_t value; int64_t cut; int want; } bad[] = {
        {"magic.tok", "not a token file either", "wrong magic (read as text: refused as binary)",
         {12345, GDN_TOKENS_VERSION, N, 0, 2, 256}, 0, 0, 0, GDN_ERR_FORMAT},
        {"version.tok", "token file version 2", "version 2", {GDN_TOKENS_MAGIC, 2, N, 0, 2, 256}, 0, 0, 0, GDN_ERR_FORMAT},
        {"width.tok", "id width 3 bytes", "width 3", {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N, 0, 3, 256}, 0, 0, 0,
         GDN_ERR_FORMAT},
        {"reserved.tok", "reserved word 9 is 5", "a reserved word not 0", {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N, 0, 2, 256},
         9, 5, 0, GDN_ERR_FORMAT},
        {"short.tok", "says 1000 ids of 2 bytes (2000 bytes after the 1024-byte header), the file has 1999",
         "truncated by one byte", {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N, 0, 2, 256}, 0, 0, 1, GDN_ERR_FORMAT},
        {"count.tok", "says 1001 ids of 2 bytes", "a count one more than the file holds",
         {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N + 1, 0, 2, 256}, 0, 0, 0, GDN_ERR_FORMAT},
        {"count_hi.tok", "says 9223372036854776808 ids of 2 bytes (2^64 or more bytes", "a count of 2^63 + 1000 (high word; unsigned, not negative)",
         {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N, 1u << 31, 2, 256}, 0, 0, 0, GDN_ERR_FORMAT},
        {"zero.tok", "says 0 ids", "no ids", {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, 0, 0, 2, 256}, 0, 0, 2 * N,
         GDN_ERR_FORMAT},
        {"header.tok", "shorter than its 1024-byte header", "a header cut short",
         {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N, 0, 2, 256}, 0, 0, 2 * N + 600, GDN_ERR_FORMAT},
        {"llmc3.bin", "llm.c token file (magic 20240520) version 3", "llm.c version 3",
         {GDN_TOKENS_MAGIC_LLMC, 3, N, 0, 0, 0}, 0, 0, 0, GDN_ERR_FORMAT},
        {"vocab.tok", "vocabulary has 300 ids", "header vocabulary above the model's",
         {GDN_TOKENS_MAGIC, GDN_TOKENS_VERSION, N, 0, 2, 300}, 0, 0, 0, GDN_ERR_SHAPE},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_tokens(at(p, bad[i].name), bad[i].h, bad[i].word, bad[i].value, ids, N, 2, bad[i].cut);
        expect_status(gdn_data_open(&d, p, 0.1, 256), bad[i].want, bad[i].needle, "token file refused: %s", bad[i].what);
        gdn_data_close(d), d = NULL;
    }
    /* byte text for a model of fewer than 256 ids: the bytes are ids, checked like any */
    FILE *f = fopen(at(p, "text.txt"), "wb");
    for (int i = 0; f && i < 4000; i++) fputc(i == 2500 ? 'x' : 'a' + i % 3, f);
    if (f) fclose(f);
    if (!gdn_data_open(&d, p, 0.1, 100)) {
        gdn_token got[64];
        check(gdn_data_read(d, GDN_SPLIT_TRAIN, 2400, 64, got) == GDN_OK && got[0] == 'a' + 2400 % 3,
              "byte text for a model of 100 ids: bytes below 100 read (control)");
        expect_status(gdn_data_read(d, GDN_SPLIT_TRAIN, 2480, 64, got), GDN_ERR_SHAPE,
                      "token id 120 at byte offset 2500 (id 2500 of the file) is outside the model's vocabulary [0, 100)",
                      "byte text for a model of 100 ids: the byte 'x' (120) refused");
        const gdn_data_info ti = info_of(d);
        check(ti.tokens == 0 && ti.width == 1 && ti.file_vocab == 0, "gdn_data_describe of byte text: not tokens, "
              "1 byte an id, no header vocabulary (%d, %d, %lld)", ti.tokens, ti.width, (long long)ti.file_vocab);
        expect_status(gdn_data_describe(d, NULL), GDN_ERR_ARG, "info is NULL", "gdn_data_describe: a NULL info refused");
        gdn_data_close(d), d = NULL;
        gdn_data_info z = {1, 4, 9};
        expect_status(gdn_data_describe(NULL, &z), GDN_ERR_ARG, "data file is NULL", "gdn_data_describe: a NULL file refused");
        check(z.tokens == 0 && z.width == 0 && z.file_vocab == 0, "gdn_data_describe: a refused call leaves info zeroed");
    }
}

void test_tokens(void) {
    snprintf(dir, sizeof dir, "/tmp/gdn_tokens_XXXXXX");
    if (!mkdtemp(dir)) {
        check(0, "make a scratch directory: %s", strerror(errno));
        return;
    }
    test_round_trips();
    test_bad_headers();
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("note: could not remove %s\n", dir);
}
