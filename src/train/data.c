/* Byte-level training text: open and vet the file, positioned reads of the two splits, and the
 * deterministic choice of each training row's window. */
#include "gdncp/train.h"

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
    int64_t size, train_len, val_len;
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

static int is_control(uint8_t c) { return c < 0x09 || (c >= 0x0e && c <= 0x1f); }

/* Does the start of the file look like text? Errors name the first offending byte. */
static int check_text(const gdn_data *d) {
    const int64_t n = d->size < SAMPLE_BYTES ? d->size : SAMPLE_BYTES;
    uint8_t *buf = malloc((size_t)n);
    if (!buf) return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate %lld bytes to check the text", d->path, (long long)n);
    int rc = pread_all(d->fd, d->path, 0, n, buf);
    int64_t controls = 0, first_control = -1;
    for (int64_t i = 0; !rc && i < n; i++) {
        if (buf[i] == 0) {
            rc = gdn_fail(GDN_ERR_FORMAT, "%s: not a text file: a NUL byte at offset %lld (the "
                          "training data must be text; it is read as bytes)", d->path, (long long)i);
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

int gdn_data_open(gdn_data **out, const char *path, double val_fraction) {
    if (!out || !path) return gdn_fail(GDN_ERR_ARG, "data open: NULL argument");
    *out = NULL;
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
    gdn_data *d = calloc(1, sizeof *d);
    if (!d || !(d->path = strdup(path))) {
        free(d);
        return gdn_fail(GDN_ERR_NOMEM, "%s: cannot allocate the data handle", path);
    }
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
        d->size = (int64_t)st.st_size;
        d->train_len = (int64_t)floor((double)d->size * (1.0 - val_fraction));
        if (d->train_len > d->size) d->train_len = d->size;
        d->val_len = d->size - d->train_len;
        if (d->train_len < 1 || d->val_len < 1)
            rc = gdn_fail(GDN_ERR_SHAPE, "%s: %lld bytes are too few to split into training and "
                          "validation text (validation fraction %g)", path, (long long)d->size,
                          val_fraction);
    }
    if (!rc) rc = check_text(d);
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

int gdn_data_read(const gdn_data *d, int split, int64_t start, int64_t n, uint8_t *out) {
    if (!d || (n > 0 && !out)) return gdn_fail(GDN_ERR_ARG, "data read: NULL argument");
    const int64_t len = gdn_data_split_len(d, split);
    if (len < 0) return GDN_ERR_ARG;
    const char *name = split == GDN_SPLIT_TRAIN ? "training" : "validation";
    if (start < 0 || n < 0 || start > len || n > len - start)
        return gdn_fail(GDN_ERR_SHAPE, "%s: bytes [%lld, %lld) are outside the %s split of %lld bytes",
                        d->path, (long long)start, (long long)start + (long long)n, name, (long long)len);
    const int64_t base = split == GDN_SPLIT_TRAIN ? 0 : d->train_len;
    return pread_all(d->fd, d->path, base + start, n, out);
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

int gdn_data_window_docs(const gdn_data *d, int split, int64_t start, int64_t window, const uint8_t *sep,
                         int sep_len, uint8_t *buf, const uint8_t **bytes, int64_t *doc_cu, int64_t *n_docs) {
    if (!d || !buf || !bytes || !doc_cu || !n_docs) return gdn_fail(GDN_ERR_ARG, "data documents: NULL argument");
    if (!sep || sep_len < 1 || sep_len > GDN_DATA_MAX_SEP)
        return gdn_fail(GDN_ERR_ARG, "the document separator must have 1 to %d bytes, it has %d", GDN_DATA_MAX_SEP,
                        sep ? sep_len : 0);
    if (start < 0 || window < 1) return gdn_fail(GDN_ERR_ARG, "data documents: start %lld, window %lld",
                                                 (long long)start, (long long)window);
    /* a separator that ends at the window's first byte lies partly before it */
    const int64_t pre = start < sep_len - 1 ? start : sep_len - 1;
    int rc = gdn_data_read(d, split, start - pre, window + pre, buf);
    if (rc) return rc;
    const uint8_t *w = buf + pre;
    int64_t n = 0;
    doc_cu[0] = 0;
    for (int64_t j = 1; j < window; j++)
        if (j + pre >= sep_len && w[j - 1] == sep[sep_len - 1] && !memcmp(w + j - sep_len, sep, (size_t)sep_len))
            doc_cu[++n] = j;
    doc_cu[++n] = window;
    *n_docs = n;
    *bytes = w;
    return GDN_OK;
}
