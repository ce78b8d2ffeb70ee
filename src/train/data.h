/*
 * Byte-level training text (DESIGN §5): any text file, its first (1 - val_fraction) of the bytes
 * the training split and the rest the validation split. The file is never read whole: every rank
 * reads only the windows of its own rows and shard with positioned reads, so a corpus larger than
 * memory is fine and ranks share nothing.
 */
#ifndef GDNCP_TRAIN_DATA_H
#define GDNCP_TRAIN_DATA_H

#include <stdint.h>

#include "gdncp.h"

enum { GDN_SPLIT_TRAIN = 0, GDN_SPLIT_VAL = 1 };

typedef struct gdn_data gdn_data;

/* Open a text file: a regular, non-empty file whose first MiB looks like text (no NUL byte, at
 * most 2 % other control bytes), val_fraction in (0, 0.5], both splits non-empty. Errors name the
 * file and the offending offset or value. *d is NULL on failure. */
int gdn_data_open(gdn_data **d, const char *path, double val_fraction);
void gdn_data_close(gdn_data *d);

/* Bytes of a split (GDN_SPLIT_TRAIN or GDN_SPLIT_VAL); -1 (with gdn_fail) for another split. */
int64_t gdn_data_split_len(const gdn_data *d, int split);
/* Bytes [start, start + n) of a split into out: only those bytes are read. */
int gdn_data_read(const gdn_data *d, int split, int64_t start, int64_t n, uint8_t *out);

/* The start of training row `row`'s window of `window` bytes at `step`: a deterministic
 * pseudo-random position in [0, split_len - window] (the same on every rank and run for the same
 * seed, step and row). -1 with gdn_fail when window > split_len ("the text has N bytes, a
 * sequence needs M") or an argument is negative. */
int64_t gdn_data_window(uint64_t seed, int64_t step, int64_t row, int64_t split_len,
                        int64_t window);

/* Packed documents: the longest separator gdn_data_window_docs takes. */
#define GDN_DATA_MAX_SEP 64

/* A window of a split read as packed documents: documents end with `sep` (the next one starts
 * right after each occurrence of it; the window's first byte and the split's first byte start
 * one too). buf (window + sep_len - 1 bytes) receives the window and up to sep_len - 1 bytes
 * before it, *bytes points at the window inside buf, and doc_cu (window + 1 entries) the
 * offsets 0, every document start, window; *n_docs the documents. */
int gdn_data_window_docs(const gdn_data *d, int split, int64_t start, int64_t window, const uint8_t *sep,
                         int sep_len, uint8_t *buf, const uint8_t **bytes, int64_t *doc_cu, int64_t *n_docs);

#endif
