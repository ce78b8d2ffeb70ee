/* config.json (internal to the train layer; hf_config.c): the one reader of transformers' model
 * configuration (public: gdn_ckpt_load_config in gdncp/checkpoint.h) and its writer. */
#ifndef GDN_HF_CONFIG_H
#define GDN_HF_CONFIG_H

#include "gdncp/model.h"

#define GDN_HF_CONFIG_FILE "config.json"

/* config.json's text for cfg (transformers' Qwen3.5 or Qwen3.5-MoE text config; weight_dtype
 * GDN_BF16 says "bfloat16"): *out, malloc'd, ending with a newline. */
int gdn_hf_config_text(const gdn_model_config *cfg, int weight_dtype, char **out);
/* dir's config.json describes cfg (every dimension, layer kind, expert field, eps and RoPE): else
 * GDN_ERR_SHAPE naming the first field that differs. */
int gdn_hf_config_same(const char *dir, const gdn_model_config *cfg);
/* gdn_ckpt_resolve's part of gdn_ckpt_note (text, or NULL: none). */
void gdn_ckpt_resolve_note(const char *text);

#endif
