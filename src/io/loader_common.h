/* Shared by the checkpoint loaders (layer_weights.c: GatedDeltaNet, attn_weights.c: gated
 * attention): values that several sources state (config.json, the file's __metadata__, the
 * caller, the tensor shapes) and must agree on, config.json's text model section, shapes in
 * messages, the "no layer under this prefix" hint and gradient names. */
#ifndef GDNCP_IO_LOADER_COMMON_H
#define GDNCP_IO_LOADER_COMMON_H

#include "base.h"

#include <jansson.h>
#include <stdint.h>

#define GDN_IO_SRC_LEN 512

/* A dimension as stated by its first source (src empty: nobody yet). */
typedef struct {
    int64_t v;
    char src[GDN_IO_SRC_LEN];
} gdn_io_dim;

/* `source` states dimension `name` = value: it must lie in [1, max]; the first statement is
 * recorded, a later one must equal it (GDN_ERR_SHAPE naming both sources otherwise). */
int gdn_io_dim_state(gdn_io_dim *d, const char *name, int64_t max, int64_t value, const char *source);

/* rms_norm_eps as stated (positive, finite as a float); later statements must agree to 1e-6
 * relative (a config's "1e-06" and a float's 9.99999997e-07 are the same value). */
typedef struct {
    float v;
    char src[GDN_IO_SRC_LEN];
} gdn_io_eps;
int gdn_io_eps_state(gdn_io_eps *e, double value, const char *source);

/* Parse config.json: *root is a JSON object (json_decref it), or an error naming the file. */
int gdn_io_config_load(const char *path, json_t **root);
/* The object that holds the text model's fields: the top level when any of fields[0..n) is
 * there, else "text_config" when it is an object (a multimodal Qwen3.5 config), else the top
 * level. *where gets "" or "text_config." for messages. */
json_t *gdn_io_config_section(json_t *root, const char *const *fields, int n, const char **where);
/* Field `field` of obj: *present 0 when absent or null; an integer (or, for _number, any JSON
 * number) otherwise, or GDN_ERR_FORMAT naming path, where and field. */
int gdn_io_config_int(json_t *obj, const char *path, const char *where, const char *field, int64_t *v,
                      int *present);
int gdn_io_config_number(json_t *obj, const char *path, const char *where, const char *field, double *v,
                         int *present);
/* __metadata__ key of f as an integer or a number: *present 0 when absent; GDN_ERR_FORMAT naming
 * the key when it does not parse. */
int gdn_io_metadata_int(gdn_st_file *f, const char *path, const char *key, int64_t *v, int *present);
int gdn_io_metadata_number(gdn_st_file *f, const char *path, const char *key, double *v, int *present);

/* "[a, b, c]" */
void gdn_io_shape_str(char *buf, size_t n, int ndim, const int64_t *shape);
/* When f holds a tensor whose name ends in one of suffixes[0..n) (at a '.' boundary), the hint
 * " (it has 'NAME': prefix 'P'?)" for a "nothing under this prefix" error; else "". */
void gdn_io_prefix_hint(const gdn_st_file *f, const char *const *suffixes, int n, char *buf, size_t len);
/* Add an F32 tensor named name_prefix + name (data NULL: reserved, gdn_st_writer_begin). */
int gdn_io_add_named(gdn_st_writer *wr, const char *name_prefix, const char *name, int ndim,
                     const int64_t *shape, const float *data);

#endif
