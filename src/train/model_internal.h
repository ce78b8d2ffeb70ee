/* Internal to src/train: the model's parameter layout shared by model_params.c (configurations,
 * the tensor table, initialisation) and model.c (the compute). */
#ifndef GDNCP_MODEL_INTERNAL_H
#define GDNCP_MODEL_INTERNAL_H

#include "gdncp/train.h"

#include <stddef.h>
#include <stdint.h>

/* Per block, after the mixer's block: */
enum { BLK_IN_NORM = 0, BLK_POST_NORM, BLK_GATE, BLK_UP, BLK_DOWN, BLK_COUNT };

static inline size_t pad16(size_t n) { return (n + 15) & ~(size_t)15; }
static inline int is_attn(const gdn_model_config *c, int64_t l) { return c->full_attention[l] != 0; }

/* Attention layers among the first n (n clamped to the array). */
int64_t gdn_model_attn_before(const gdn_model_config *c, int64_t n);
/* Offsets in the flat array: layer l's block tensor `which` (BLK_*), the final norm, lm_head (a
 * tied head: the embedding, offset 0). */
size_t gdn_model_blk_offset(const gdn_model_config *c, int64_t l, int which);
size_t gdn_model_final_norm_offset(const gdn_model_config *c);
size_t gdn_model_lm_head_offset(const gdn_model_config *c);

#endif
