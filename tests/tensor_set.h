/* For the checkpoint-loader suites (test_layer_io.c, test_attn_io.c): a small in-memory set of
 * named f32 tensors (read from a file under a prefix, edited, written back in any dtype with
 * metadata) and the suite's temporary files. */
#ifndef GDNCP_TEST_TENSOR_SET_H
#define GDNCP_TEST_TENSOR_SET_H

#include "gdncp.h"

typedef struct {
    char name[160];
    int ndim;
    int64_t shape[3];
    float *data;
} tens;

typedef struct {
    tens t[24];
    int n;
} tset;

int64_t tens_numel(const tens *t);
tens *tset_find(tset *s, const char *name);
/* Add a copy of data (zeros when NULL); NULL when the set is full. */
tens *tset_add(tset *s, const char *name, int ndim, const int64_t *shape, const float *data);
void tset_drop(tset *s, const char *name);
void tset_free(tset *s);
/* The tensors of `path` under `prefix` (of at most 3 dims), the prefix stripped. */
int tset_load(tset *s, const char *path, const char *prefix);
/* Write the set under `prefix` (names starting with '=' without it), with metadata pairs
 * meta[0..] = key, value, ..., NULL. */
int tset_save(const tset *s, const char *path, const char *prefix, const char *const *meta, gdn_dtype dtype);

/* A suite's temporary folder: tmp_begin makes /tmp/<tag>_XXXXXX (0 on success), tmp_path names a
 * file in it (the same name: the same path), write_text writes one, tmp_end removes them all and
 * the folder (0 on success). One suite at a time. */
int tmp_begin(const char *tag);
const char *tmp_path(const char *name);
const char *write_text(const char *name, const char *text);
int tmp_end(void);

#endif
