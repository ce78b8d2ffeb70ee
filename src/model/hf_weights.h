/* The model's weights as Hugging Face stores them (internal to the train layer): which tensor of
 * a checkpoint directory is which of the model's, for transformers' own checkpoints as well as
 * gdncp's. See hf_weights.c. */
#ifndef GDN_HF_WEIGHTS_H
#define GDN_HF_WEIGHTS_H

#include "gdncp/io.h"
#include "gdncp/model.h"

/* Does dir hold weights: model.safetensors, or model.safetensors.index.json (sharded)? */
int gdn_hf_has_weights(const char *dir);

/* *present = whether the directory's weights hold a tensor called name (after the text model's
 * prefix, model.language_model., is taken into account). */
int gdn_hf_weights_hold(const char *dir, const char *name, int *present);

/* dir's embedding (model.embed_tokens.weight), when its weights hold one, is [vocab, E] as cfg (read
 * from config_path) says: checked from the header before the model's size is trusted (a vocab_size
 * of 2^30 beside 256 rows would otherwise be an allocation of the wrong size). */
int gdn_hf_check_embedding(const char *dir, const gdn_model_config *cfg, const char *config_path);

/* Read every tensor of the table (gdn_model_tensor's) from dir's weights into w at its offset:
 * names as transformers writes them for Qwen3.5 (text-only "model." or the multimodal
 * "model.language_model.", with mtp.* and model.visual.* ignored) or Qwen3-Next (fused
 * in_proj_qkvz / in_proj_ba, scattered into the split parameters); F32, BF16 or F64; exact
 * shapes. A tied model's file may also hold lm_head.weight, which must then equal the embedding.
 * Anything else in the files is an error naming it. */
int gdn_hf_read_model(const char *dir, const gdn_model_config *cfg, const gdn_model_tensor_info *table, int n,
                      float *w);

/* A tensor found under name must have the table entry's dtype class (F32, BF16, F64) and exact
 * shape; path names the file in the message. */
int gdn_hf_check_tensor(const char *path, const gdn_st_tensor *t, const gdn_model_tensor_info *want);
/* Read tensor t of f into dst after that check: the whole of it, or for a routed experts' tensor of
 * a model whose experts are split over ranks, this rank's experts' rows of dimension 0. */
int gdn_hf_read_tensor(gdn_st_file *f, const gdn_st_tensor *t, const gdn_model_tensor_info *want, float *dst);

#endif
