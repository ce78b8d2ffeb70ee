/* Training data: byte text or token files, read in windows, with packed documents. */
#ifndef GDNCP_DATA_H
#define GDNCP_DATA_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Training data, as token ids (DESIGN §5): either byte text (any text file; its bytes are the ids
 * 0..255) or a token file (docs/training.md "Token files"): a 1024-byte header of 256
 * little-endian 32-bit words, then the ids as flat little-endian uint16 or uint32:
 *
 *   word 0  GDN_TOKENS_MAGIC          word 1  GDN_TOKENS_VERSION (1)
 *   word 2  id count, low 32 bits     word 3  id count, high 32 bits
 *   word 4  bytes per id: 2 or 4      word 5  the tokenizer's vocabulary size (0: not given)
 *   words 6..255  0
 *
 * llm.c's files (magic GDN_TOKENS_MAGIC_LLMC, version 1: uint16, 2: uint32, the count in word 2)
 * are read too. A file is a token file when its first word is one of the magics. The first
 * (1 - val_fraction) of the ids are the training split and the rest the validation split. The
 * file is never read whole: every rank reads only the windows of its own rows and shard with
 * positioned reads, so a corpus larger than memory is fine and ranks share nothing.
 */

#define GDN_TOKENS_MAGIC 20261201u
#define GDN_TOKENS_MAGIC_LLMC 20240520u
#define GDN_TOKENS_VERSION 1
#define GDN_TOKENS_HEADER_BYTES 1024

enum { GDN_SPLIT_TRAIN = 0, GDN_SPLIT_VAL = 1 };

typedef struct gdn_data gdn_data;

/* Open a data file for a model of `vocab` ids. Byte text: a regular, non-empty file whose first
 * MiB looks like text (no NUL byte, at most 2 % other control bytes). A token file: its header
 * vetted (version, width 2 or 4, the file's size exactly the header plus count x width, reserved
 * words 0, a header vocabulary no larger than the model's). val_fraction in (0, 0.5], both splits
 * non-empty. Errors name the file and the offending offset or value. *d is NULL on failure. */
GDN_API int gdn_data_open(gdn_data **d, const char *path, double val_fraction, int64_t vocab);
GDN_API void gdn_data_close(gdn_data *d);
/* What an open data file is (gdn_data_describe). */
typedef struct {
    int tokens;          /* 1 for a token file, 0 for byte text */
    int width;           /* bytes per id (1 for text) */
    int64_t file_vocab;  /* the token file header's vocabulary (0: not given, or text) */
} gdn_data_info;
/* The file's kind, id width and header vocabulary into *info (zeroed, and GDN_ERR_ARG, for a
 * NULL d). */
GDN_API int gdn_data_describe(const gdn_data *d, gdn_data_info *info);

/* Tokens (bytes of a text) of a split (GDN_SPLIT_TRAIN or GDN_SPLIT_VAL); -1 (with gdn_fail) for
 * another split. */
GDN_API int64_t gdn_data_split_len(const gdn_data *d, int split);
/* Ids [start, start + n) of a split into out: only those are read, and each is checked against
 * the model's vocabulary (an id >= vocab: GDN_ERR_SHAPE naming the file, the byte offset and the
 * id). */
GDN_API int gdn_data_read(const gdn_data *d, int split, int64_t start, int64_t n, gdn_token *out);

/* The start of training row `row`'s window of `window` ids at `step`: a deterministic
 * pseudo-random position in [0, split_len - window] (the same on every rank and run for the same
 * seed, step and row). -1 with gdn_fail when window > split_len ("the text has N bytes, a
 * sequence needs M") or an argument is negative. */
GDN_API int64_t gdn_data_window(uint64_t seed, int64_t step, int64_t row, int64_t split_len,
                        int64_t window);

/* Packed documents: the longest separator gdn_data_window_docs takes. */
#define GDN_DATA_MAX_SEP 64

/* A window of a split read as packed documents: documents end with the ids `sep` (the next one
 * starts right after each occurrence of it; the window's first id and the split's first id start
 * one too). buf (window + sep_len - 1 ids) receives the window and up to sep_len - 1 ids before
 * it, *tokens points at the window inside buf, and doc_cu (window + 1 entries) the offsets 0,
 * every document start, window; *n_docs the documents. */
GDN_API int gdn_data_window_docs(const gdn_data *d, int split, int64_t start, int64_t window, const gdn_token *sep,
                         int sep_len, gdn_token *buf, const gdn_token **tokens, int64_t *doc_cu, int64_t *n_docs);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_DATA_H */
