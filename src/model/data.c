/* Training data: byte text or a token file (docs/training.md "Token files"), opened and vetted,
 * positioned reads of the two splits as token ids checked against the model's vocabulary, and the
 * deterministic choice of each training row's window. */
#include "gdncp/data.h"

#include "base.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The text check looks at this many leading bytes only: enough to catch a binary file given by
 * mistake, while opening a multi-gigabyte corpus stays instant. */
#define SAMPLE_BYTES ((int64_t)1 << 20)
/* Old fortune files and terminal captures hold a few backspaces or escapes; a binary file holds
 * far more than this share of control bytes. */
#define MAX_CONTROL_PERCENT 2

struct gdn_data {
    int fd;
    char *path;
    int64_t size;                /* bytes of the file */
    int tokens;                  /* 1: a token file; 0: byte text */
    int width;                   /* bytes per id: 1 (text), 2 or 4 */
    int64_t header;              /* bytes before the first id */
    int64_t count;               /* ids in the file */
    int64_t file_vocab;          /* the token file header's vocabulary (0: not given) */
    int64_t vocab;               /* the model's: every id read must be below it */
    int64_t train_len, val_len;  /* ids */
};

/* n bytes at offset into buf, retrying short and interrupted reads. */
static int pread_all(int fd, const char *path, int64_t offset, int64_t n, uint8_t *buf) {
    for (int64_t done = 0; done < n;) {
        const ssize_t k = pread(fd, buf + done, (size_t)(n - done), (off_t)(offset + done));
        if (k < 0 && errno == EINTR) continue;
        if (k < 0)
            return gdn_fail(GDN_ERR_IO, "%s: read of %lld bytes at offset %lld failed: %s", path,
                            (long long)n, (long long)offset, strerror(errno));
        if (k == 0)
            return gdn_fail(GDN_ERR_IO, "%s: file ends at byte %lld, before the %lld bytes at "
                            "offset %lld (did it shrink since it was opened?)", path,
                            (long long)(offset + done), (long long)n, (long long)offset);
        done += k;
    }
    return GDN_OK;
}

static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* A token file's header (the file starts with one of the magics): its fields, vetted. */
static int parse_header(gdn_data *d, uint32_t first_word) {
    if (d->size < GDN_TOKENS_HEADER_BYTES)
        return gdn_fail(GDN_ERR_FORMAT, "%s: a token file (magic %u) of %lld bytes is shorter than its %d-byte "
                        "header (truncated?)", d->path, (unsigned)first_word, (long long)d->size,
                        GDN_TOKENS_HEADER_BYTES);
    uint8_t h[GDN_TOKENS_HEADER_BYTES];
    int rc = pread_all(d->fd, d->path, 0, GDN_TOKENS_HEADER_BYTES, h);
    if (rc) return rc;
    const uint32_t magic = le32(h), version = le32(h + 4);
    uint64_t said; /* the header's count of ids */
    d->header = GDN_TOKENS_HEADER_BYTES;
    if (magic == GDN_TOKENS_MAGIC) {
        if (version != GDN_TOKENS_VERSION)
            return gdn_fail(GDN_ERR_FORMAT, "%s: token file version %u (this gdncp reads version %d)", d->path,
                            (unsigned)version, GDN_TOKENS_VERSION);
        said = (uint64_t)le32(h + 8) | (uint64_t)le32(h + 12) << 32;
        const uint32_t width = le32(h + 16), vocab = le32(h + 20);
        if (width != 2 && width != 4)
            return gdn_fail(GDN_ERR_FORMAT, "%s: token file header: id width %u bytes (2 for uint16, 4 for uint32)",
                            d->path, (unsigned)width);
        if (vocab > (uint32_t)GDN_MODEL_MAX_VOCAB)
            return gdn_fail(GDN_ERR_FORMAT, "%s: token file header: vocabulary %u is beyond %lld", d->path,
                            (unsigned)vocab, (long long)GDN_MODEL_MAX_VOCAB);
        for (int i = 6; i < GDN_TOKENS_HEADER_BYTES / 4; i++)
            if (le32(h + 4 * i))
                return gdn_fail(GDN_ERR_FORMAT, "%s: token file header: reserved word %d is %u, not 0", d->path, i,
                                (unsigned)le32(h + 4 * i));
        d->width = (int)width, d->file_vocab = vocab;
    } else { /* llm.c's: version 1 uint16 (GPT-2), 2 uint32 (Llama 3); count in word 2 */
        if (version != 1 && version != 2)
            return gdn_fail(GDN_ERR_FORMAT, "%s: llm.c token file (magic %u) version %u (1: uint16, 2: uint32)",
                            d->path, (unsigned)GDN_TOKENS_MAGIC_LLMC, (unsigned)version);
        said = le32(h + 8), d->width = version == 1 ? 2 : 4, d->file_vocab = 0;
    }
    /* the header's count as the unsigned number it is (2^63 and above too), checked before it is one */
    const uint64_t after = (uint64_t)(d->size - d->header);
    if (said < 1 || said > after / (uint64_t)d->width || said * (uint64_t)d->width != after) {
        char need[40];
        if (said > UINT64_MAX / (uint64_t)d->width) snprintf(need, sizeof need, "2^64 or more");
        else snprintf(need, sizeof need, "%llu", (unsigned long long)(said * (uint64_t)d->width));
        return gdn_fail(GDN_ERR_FORMAT, "%s: token file header says %llu ids of %d bytes (%s bytes after the "
                        "%lld-byte header), the file has %lld after it", d->path, (unsigned long long)said, d->width,
                        need, (long long)d->header, (long long)after);
    }
    d->count = (int64_t)said;
    if (d->file_vocab > d->vocab)
        return gdn_fail(GDN_ERR_SHAPE, "%s: the token file's vocabulary has %lld ids (its header), the model's %lld: "
                        "tokenized for another model?", d->path, (long long)d->file_vocab, (long long)d->vocab);
    return GDN_OK;
}

static int is_control(uint8_t c) { return c < 0x09 || (c >= 0x0e && c <= 0x1f); }

/* Does the start of the file look like text? Errors name the first offending byte. */
static int check_text(const gdn_data *d) {
    const int64_t n = d->size < SAMPLE_BYTES ? d->size : SAMPLE_BYTES;
    uint8_t *buf = gdn_malloc("data: buf", (size_t)n);
    if (!buf) return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate %lld bytes to check the text", d->path, (long long)n);
    int rc = pread_all(d->fd, d->path, 0, n, buf);
    int64_t controls = 0, first_control = -1;
    for (int64_t i = 0; !rc && i < n; i++) {
        if (buf[i] == 0) {
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: not a text file: a NUL byte at offset %lld (the "
                          "training data must be text, read as bytes, or a token file; it is not a token file "
                          "either: its first 32-bit word is %u, a token file's magic %u)", d->path, (long long)i,
                          (unsigned)(n >= 4 ? le32(buf) : 0), (unsigned)GDN_TOKENS_MAGIC);
        } else if (is_control(buf[i])) {
            if (first_control < 0) first_control = i;
            controls++;
        }
    }
    if (!rc && controls * 100 > n * MAX_CONTROL_PERCENT)
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: not a text file: %lld of its first %lld bytes are control "
                      "characters (more than %d %%), the first 0x%02x at offset %lld", d->path,
                      (long long)controls, (long long)n, MAX_CONTROL_PERCENT, buf[first_control],
                      (long long)first_control);
    free(buf);
    return rc;
}

int gdn_data_open(gdn_data **out, const char *path, double val_fraction, int64_t vocab) {
    if (!out || !path) return gdn_fail(GDN_ERR_ARG, "data open: NULL argument");
    *out = NULL;
    if (vocab < 1 || vocab > GDN_MODEL_MAX_VOCAB)
        return gdn_fail(GDN_ERR_ARG, "%s: the model's vocabulary %lld is out of range [1, %lld]", path,
                        (long long)vocab, (long long)GDN_MODEL_MAX_VOCAB);
    if (!(val_fraction > 0.0 && val_fraction <= 0.5))
        return gdn_fail(GDN_ERR_ARG, "%s: the validation fraction must be in (0, 0.5], got %g", path,
                        val_fraction);
    /* stat() before open(): opening a FIFO blocks until a writer appears. */
    struct stat st;
    if (stat(path, &st) != 0)
        return gdn_fail(GDN_ERR_IO, "%s: cannot open the data file: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode))
        return gdn_fail(GDN_ERR_IO, "%s: the data file is not a regular file (%s)", path,
                        gdn_file_kind(st.st_mode));
    gdn_data *d = gdn_calloc("data: d", 1, sizeof *d);
    if (!d || !(d->path = gdn_strdup("data: d->path", path))) {
        free(d);
        return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the data handle", path);
    }
    d->vocab = vocab, d->width = 1;
    int rc = GDN_OK;
    /* The path may have been replaced since stat(): open without blocking and check again. */
    d->fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (d->fd < 0)
        rc = gdn_fail(GDN_ERR_IO, "%s: cannot open the data file: %s", path, strerror(errno));
    else if (fstat(d->fd, &st) != 0 || !S_ISREG(st.st_mode))
        rc = gdn_fail(GDN_ERR_IO, "%s: the data file is not a regular file (replaced while opening)", path);
    else if (st.st_size == 0)
        rc = gdn_fail(GDN_ERR_FORMAT, "%s: the data file is empty", path);
    if (!rc) {
        d->size = d->count = (int64_t)st.st_size;
        uint8_t m[4] = {0};
        if (d->size >= 4) rc = pread_all(d->fd, path, 0, 4, m);
        const uint32_t magic = le32(m);
        d->tokens = d->size >= 4 && (magic == GDN_TOKENS_MAGIC || magic == GDN_TOKENS_MAGIC_LLMC);
        if (!rc) rc = d->tokens ? parse_header(d, magic) : check_text(d);
    }
    if (!rc) {
        d->train_len = (int64_t)floor((double)d->count * (1.0 - val_fraction));
        if (d->train_len > d->count) d->train_len = d->count;
        d->val_len = d->count - d->train_len;
        if (d->train_len < 1 || d->val_len < 1)
            rc = gdn_fail(GDN_ERR_SHAPE, "%s: %lld %s are too few to split into training and "
                          "validation data (validation fraction %g)", path, (long long)d->count,
                          d->tokens ? "tokens" : "bytes", val_fraction);
    }
    if (rc) {
        gdn_data_close(d);
        return rc;
    }
    *out = d;
    return GDN_OK;
}

void gdn_data_close(gdn_data *d) {
    if (!d) return;
    if (d->fd >= 0) close(d->fd);
    free(d->path);
    free(d);
}

int64_t gdn_data_split_len(const gdn_data *d, int split) {
    if (!d) return gdn_fail(GDN_ERR_ARG, "data split length: NULL handle"), -1;
    if (split == GDN_SPLIT_TRAIN) return d->train_len;
    if (split == GDN_SPLIT_VAL) return d->val_len;
    return gdn_fail(GDN_ERR_ARG, "%s: split %d is neither 0 (train) nor 1 (validation)", d->path, split), -1;
}

int gdn_data_describe(const gdn_data *d, gdn_data_info *info) {
    if (!info) return gdn_fail(GDN_ERR_ARG, "gdn_data_describe: info is NULL");
    memset(info, 0, sizeof *info);
    if (!d) return gdn_fail(GDN_ERR_ARG, "gdn_data_describe: the data file is NULL");
    info->tokens = d->tokens;
    info->width = d->width;
    info->file_vocab = d->file_vocab;
    return GDN_OK;
}

int gdn_data_read(const gdn_data *d, int split, int64_t start, int64_t n, gdn_token *out) {
    if (!d || (n > 0 && !out)) return gdn_fail(GDN_ERR_ARG, "data read: NULL argument");
    const int64_t len = gdn_data_split_len(d, split);
    if (len < 0) return GDN_ERR_ARG;
    const char *name = split == GDN_SPLIT_TRAIN ? "training" : "validation";
    const char *unit = d->tokens ? "tokens" : "bytes";
    if (start < 0 || n < 0 || start > len || n > len - start)
        return gdn_fail(GDN_ERR_SHAPE, "%s: %s [%lld, %lld) are outside the %s split of %lld %s",
                        d->path, unit, (long long)start, (long long)start + (long long)n, name, (long long)len, unit);
    const int64_t first = (split == GDN_SPLIT_TRAIN ? 0 : d->train_len) + start;
    /* the ids' bytes into the end of out, then widened forward in place (id i's bytes lie at or
     * after out[i]'s, and after every earlier id's) */
    const int w = d->width;
    uint8_t *raw = (uint8_t *)out + (size_t)n * (sizeof *out - (size_t)w);
    int rc = pread_all(d->fd, d->path, d->header + first * w, n * w, raw);
    if (rc) return rc;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *r = raw + i * w;
        const uint32_t v = w == 1 ? r[0] : w == 2 ? (uint32_t)r[0] | (uint32_t)r[1] << 8 : le32(r);
        if ((int64_t)v >= d->vocab)
            return gdn_fail(GDN_ERR_SHAPE, "%s: token id %lld at byte offset %lld (id %lld of the file) is outside "
                            "the model's vocabulary [0, %lld)", d->path, (long long)v,
                            (long long)(d->header + (first + i) * w), (long long)(first + i), (long long)d->vocab);
        out[i] = (gdn_token)v;
    }
    return GDN_OK;
}

/* splitmix64's finaliser: every input bit affects every output bit. */
static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

int64_t gdn_data_window(uint64_t seed, int64_t step, int64_t row, int64_t split_len, int64_t window) {
    if (step < 0 || row < 0 || split_len < 0 || window < 1)
        return gdn_fail(GDN_ERR_ARG, "data window: step %lld, row %lld, text length %lld and "
                        "window %lld must be >= 0 (window >= 1)", (long long)step, (long long)row,
                        (long long)split_len, (long long)window), -1;
    if (window > split_len)
        return gdn_fail(GDN_ERR_SHAPE, "the text has %lld bytes, a sequence needs %lld (use a "
                        "larger file, a smaller validation fraction or shorter sequences)",
                        (long long)split_len, (long long)window), -1;
    /* Chained mixing, not a sum: (step, row) and (row, step) must not meet. */
    const uint64_t h = mix64(mix64(mix64(seed) ^ (uint64_t)step) ^ (uint64_t)row);
    const uint64_t positions = (uint64_t)(split_len - window) + 1;
    /* The modulo bias is below positions / 2^64: immaterial for any text. */
    return (int64_t)(h % positions);
}

int gdn_data_window_docs(const gdn_data *d, int split, int64_t start, int64_t window, const gdn_token *sep,
                         int sep_len, gdn_token *buf, const gdn_token **tokens, int64_t *doc_cu, int64_t *n_docs) {
    if (!d || !buf || !tokens || !doc_cu || !n_docs) return gdn_fail(GDN_ERR_ARG, "data documents: NULL argument");
    if (!sep || sep_len < 1 || sep_len > GDN_DATA_MAX_SEP)
        return gdn_fail(GDN_ERR_ARG, "the document separator must have 1 to %d tokens, it has %d", GDN_DATA_MAX_SEP,
                        sep ? sep_len : 0);
    if (start < 0 || window < 1) return gdn_fail(GDN_ERR_ARG, "data documents: start %lld, window %lld",
                                                 (long long)start, (long long)window);
    /* a separator that ends at the window's first byte lies partly before it */
    const int64_t pre = start < sep_len - 1 ? start : sep_len - 1;
    int rc = gdn_data_read(d, split, start - pre, window + pre, buf);
    if (rc) return rc;
    const gdn_token *w = buf + pre;
    int64_t n = 0;
    doc_cu[0] = 0;
    for (int64_t j = 1; j < window; j++)
        if (j + pre >= sep_len && w[j - 1] == sep[sep_len - 1] &&
            !memcmp(w + j - sep_len, sep, sizeof *sep * (size_t)sep_len))
            doc_cu[++n] = j;
    doc_cu[++n] = window;
    *n_docs = n;
    *tokens = w;
    return GDN_OK;
}
