/* Internal to src/train: the model's parameter layout shared by model_params.c (configurations,
 * the tensor table, initialisation) and model.c (the compute). */
#ifndef GDNCP_MODEL_INTERNAL_H
#define GDNCP_MODEL_INTERNAL_H

#include "gdncp/model.h"

#include <stddef.h>
#include <stdint.h>

/* Per layer, after the mixer's block: the two norms (E floats each, padded to 16), then the MLP's
 * block in its kind's layout (gdn_mlp_layout). */
enum { BLK_IN_NORM = 0, BLK_POST_NORM, BLK_MLP };
/* The dense SwiGLU MLP's tensors in its block (each I x E, padded to 16). */
enum { DENSE_GATE = 0, DENSE_UP, DENSE_DOWN, DENSE_COUNT };

static inline size_t pad16(size_t n) { return (n + 15) & ~(size_t)15; }
static inline int is_attn(const gdn_model_config *c, int64_t l) { return c->full_attention[l] != 0; }
static inline int is_moe(const gdn_model_config *c, int64_t l) { return c->moe[l] != 0; }

/* An MLP kind's parameter layout (one entry per kind, model_params.c): its block's floats, its
 * tensors, and tensor j's name under "mlp.", shape, offset within the block and size. */
typedef struct {
    const char *kind;
    size_t (*floats)(const gdn_model_config *c);
    int (*count)(const gdn_model_config *c);
    void (*tensor)(const gdn_model_config *c, int j, gdn_model_tensor_info *t);
} gdn_mlp_layout;
const gdn_mlp_layout *gdn_model_mlp_layout(const gdn_model_config *c, int64_t l);

/* MoE layers among the first n (n clamped to the array). */
int64_t gdn_model_moe_before(const gdn_model_config *c, int64_t n);
/* Attention layers among the first n (n clamped to the array). */
int64_t gdn_model_attn_before(const gdn_model_config *c, int64_t n);
/* Offsets in the flat array: layer l's norm `which` (BLK_IN_NORM, BLK_POST_NORM) or its MLP
 * block (BLK_MLP), the final norm, lm_head (a tied head: the embedding, offset 0). */
size_t gdn_model_blk_offset(const gdn_model_config *c, int64_t l, int which);
size_t gdn_model_final_norm_offset(const gdn_model_config *c);
size_t gdn_model_lm_head_offset(const gdn_model_config *c);

#endif
