/* libFuzzer harness for the training data reader (src/model/data.c): the input is the data file,
 * byte text or a token file (include/gdncp/train.h's header), opened for models of 256, 300,
 * 65,536 and 248,320 ids with two validation fractions; on success every id of both splits is
 * read in pieces (the last one short), reads past each split's end and at negative offsets are
 * made (refused), and windows are split into packed documents at a one-id and a two-id separator.
 * A returned error is fine; a crash, hang, leak or sanitizer report is a bug, and so is a read
 * that succeeds with an id outside the vocabulary. */
#include "fuzz_common.h"

#include "gdncp/train.h"

enum { PIECE = 4096 };

static void read_split(gdn_data *d, int split, int64_t vocab, gdn_token *buf) {
    const int64_t len = gdn_data_split_len(d, split);
    if (len < 1) abort(); /* gdn_data_open promised both splits non-empty */
    for (int64_t at = 0; at < len; at += PIECE) {
        const int64_t n = len - at < PIECE ? len - at : PIECE;
        if (gdn_data_read(d, split, at, n, buf) != GDN_OK) {
            (void)gdn_errmsg();
            return; /* an id beyond the vocabulary: refused, the rest is not read */
        }
        for (int64_t i = 0; i < n; i++)
            if (buf[i] < 0 || buf[i] >= vocab) abort();
    }
    if (gdn_data_read(d, split, len, 1, buf) == GDN_OK) abort();      /* past the end */
    if (gdn_data_read(d, split, -1, 1, buf) == GDN_OK) abort();       /* before the start */
    if (gdn_data_read(d, split, len - 1, 2, buf) == GDN_OK) abort();  /* across the end */
    const gdn_token seps[2][2] = {{0, 0}, {10, 37}};
    const int64_t window = len < 200 ? len : 200;
    gdn_token wbuf[200 + 2];
    int64_t cu[201], n_docs = 0;
    const gdn_token *w = NULL;
    for (int s = 0; s < 2; s++)
        for (int64_t start = 0; start + window <= len && start < 3 * window; start += window / 2 + 1) {
            if (gdn_data_window_docs(d, split, start, window, seps[s], s + 1, wbuf, &w, cu, &n_docs) == GDN_OK) {
                if (n_docs < 1 || n_docs > window || cu[0] != 0 || cu[n_docs] != window) abort();
                for (int64_t k = 0; k < n_docs; k++)
                    if (cu[k + 1] <= cu[k]) abort();
            } else {
                (void)gdn_errmsg();
            }
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file(data, size);
    if (!path) return 0;
    static gdn_token buf[PIECE];
    const int64_t vocabs[4] = {256, 300, 65536, 248320};
    const double fractions[2] = {0.1, 0.5};
    for (int v = 0; v < 4; v++)
        for (int f = 0; f < 2; f++) {
            gdn_data *d = NULL;
            if (gdn_data_open(&d, path, fractions[f], vocabs[v]) != GDN_OK) {
                if (d) abort(); /* *d is NULL on failure */
                (void)gdn_errmsg();
                continue;
            }
            read_split(d, GDN_SPLIT_TRAIN, vocabs[v], buf);
            read_split(d, GDN_SPLIT_VAL, vocabs[v], buf);
            gdn_data_close(d);
        }
    return 0;
}
