/*
 * Training checkpoints in Hugging Face's Qwen3.5 layout, so that transformers'
 * Qwen3_5ForCausalLM.from_pretrained loads what gdncp trains:
 *
 *   OUT/checkpoint-00000120/config.json             transformers' Qwen3.5 text config
 *       model.safetensors       every tensor of gdn_model_tensor() by its name, F32, PyTorch shape
 *       optimizer.safetensors   AdamW moments "exp_avg.<name>", "exp_avg_sq.<name>" (optional)
 *       trainer_state.json      the trainer's own JSON, verbatim
 *
 * A save builds OUT/.checkpoint-<step>.tmp-<pid>/ (every file fsync'ed), renames it into place and
 * fsyncs OUT: a crash or kill -9 at any moment leaves the previous checkpoints whole. Replacing an
 * existing step first moves the old directory aside (OUT/.checkpoint-<step>.old-<pid>) and removes
 * it only once the new one is in place; if a crash falls between the two renames, readers take
 * the moved-aside copy and the next save puts it back. Leftovers of dead processes (dot-names) are
 * ignored by readers and removed by the next save.
 */
#ifndef GDNCP_TRAIN_CHECKPOINT_H
#define GDNCP_TRAIN_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

/* Write checkpoint `step` (>= 0) of the parameters w and, when adam_m is not NULL, the moments
 * adam_m and adam_v (all gdn_model_param_floats(cfg) floats) with the caller's state_json text
 * (NULL: "{}"). out_dir is created if missing (its parent must exist). Then only the keep_last
 * newest checkpoints are kept (keep_last <= 0: all). */
int gdn_ckpt_save(const char *out_dir, int64_t step, const gdn_model_config *cfg, const float *w,
                  const float *adam_m, const float *adam_v, const char *state_json, int keep_last);

/* path is a checkpoint directory (it holds config.json and model.safetensors), or a training
 * output directory: then its complete checkpoint-N with the largest N. The directory goes into
 * dir (capacity n). */
int gdn_ckpt_resolve(const char *path, char *dir, size_t n);

/* The model configuration from dir/config.json (its fields at the top level or under
 * "text_config"). Refused: a layer that is not "linear_attention", a vocabulary other than 256
 * bytes, missing, non-integer or out-of-range fields, then whatever gdn_model_config_check
 * refuses. */
int gdn_ckpt_load_config(const char *dir, gdn_model_config *cfg);

/* Read dir/model.safetensors into w (gdn_model_param_floats(cfg) floats) after checking that
 * dir/config.json describes cfg: every tensor of the table with its exact shape, F32 or BF16 (or
 * F64), finite, and no other tensor. adam_m and
 * adam_v (both or neither; NULL: skip) from dir/optimizer.safetensors under the same rules.
 * state_json (NULL: skip) receives trainer_state.json's text, malloc'd (the caller frees). On
 * failure the arrays may hold part of the checkpoint. */
int gdn_ckpt_load(const char *dir, const gdn_model_config *cfg, float *w, float *adam_m,
                  float *adam_v, char **state_json);

/* The separator of a checkpoint trained with --pack (trainer_state.json's pack_separator_hex)
 * into sep (at most cap bytes); *len 0 when the run did not pack or the directory has no
 * trainer_state.json (e.g. a transformers checkpoint). */
int gdn_ckpt_pack_separator(const char *dir, uint8_t *sep, int cap, int *len);

#endif
