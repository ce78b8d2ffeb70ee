/* Checkpoints in Hugging Face's layout: config.json, model.safetensors, the optimizer state. */
#ifndef GDNCP_CHECKPOINT_H
#define GDNCP_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"
#include "optim.h"

#ifdef __cplusplus
extern "C" {
#endif

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



/* Write checkpoint `step` (>= 0) of the parameters w and, when adam_m is not NULL, the moments
 * adam_m and adam_v (all gdn_model_param_floats(cfg) floats) with the caller's state_json text
 * (NULL: "{}"). out_dir is created if missing (its parent must exist). Then only the keep_last
 * newest checkpoints of this run are kept (keep_last <= 0: all): the run is state_json's "run_id"
 * ("" when it has none), and a checkpoint of another run in out_dir is never removed (see
 * gdn_ckpt_other_run). model.safetensors' weights are stored in
 * weight_dtype: 0 (GDN_F32) or 2 (GDN_BF16, compute.h: each weight rounded to nearest even,
 * config.json's dtype "bfloat16"; half the bytes, for inference and for transformers). A BF16
 * save with the moments also keeps the fp32 master weights (optimizer.safetensors, "master." +
 * name), so that gdn_ckpt_load resumes from them bit for bit; without the moments the save holds
 * only the rounded weights. */
GDN_API int gdn_ckpt_save(const char *out_dir, int64_t step, const gdn_model_config *cfg, const float *w,
                  const float *adam_m, const float *adam_v, const char *state_json, int keep_last,
                  int weight_dtype);

/* The same save written by several processes at once, each its own part of the flat arrays, so
 * that no process holds (or gathers) the whole model or optimizer state: the trainer's sharded
 * state (--zero) and its expert slices (--ep). One process begins (the temporary directory,
 * config.json and both tensor files at their full size; the layout is transformers', the same
 * files as gdn_ckpt_save's) and shares the struct (plain bytes) with the others; every process
 * writes its parts; once every part is written, one process finishes (trainer_state.json, the
 * rename into place, the pruning) or, when some process failed, aborts (the temporary directory
 * goes; the previous checkpoints are untouched). The writers must see the same file system. */
typedef struct {
    char out_dir[4096], tmp_dir[4096], final_dir[4096];
    char model_tmp[4096 + 64], optim_tmp[4096 + 64]; /* the tensor files being written */
    uint64_t model_base, optim_base;                 /* each file's first tensor's byte offset */
    int64_t step;
    int weight_dtype, moments; /* moments: the optimizer file is written */
} gdn_ckpt_parts;
/* cfg: the model (an expert-parallel slice's config is taken whole: every expert is stored). */
GDN_API int gdn_ckpt_parts_begin(gdn_ckpt_parts *p, const char *out_dir, int64_t step, const gdn_model_config *cfg,
                                 int moments, int weight_dtype);
/* Write the flat elements [lo, hi) of cfg's layout (an expert slice's config puts its experts at
 * their place in the whole tensors): w, and adam_m / adam_v when the save has moments, hold them
 * from [0]. Refuses non-finite values, naming them. */
GDN_API int gdn_ckpt_parts_write(const gdn_ckpt_parts *p, const gdn_model_config *cfg, size_t lo, size_t hi,
                                 const float *w, const float *adam_m, const float *adam_v);
GDN_API int gdn_ckpt_parts_finish(const gdn_ckpt_parts *p, const char *state_json, int keep_last);
GDN_API void gdn_ckpt_parts_abort(const gdn_ckpt_parts *p);
/* Whether out_dir holds a complete checkpoint of a run other than run_id (its trainer_state.json's
 * "run_id"; "" for a checkpoint without one): found receives the first such checkpoint's name and
 * run (capacity n), or "" when every checkpoint there is run_id's (or out_dir does not exist). A
 * trainer refuses to write into a directory of another run's checkpoints, which its saves would
 * replace or its pruning remove. */
GDN_API int gdn_ckpt_other_run(const char *out_dir, const char *run_id, char *found, size_t n);

/* path is a checkpoint directory (it holds config.json and model.safetensors), or a training
 * output directory: then its complete checkpoint-N with the largest N. The directory goes into
 * dir (capacity n). */
GDN_API int gdn_ckpt_resolve(const char *path, char *dir, size_t n);

/* The model configuration from dir/config.json (its fields at the top level or under
 * "text_config"). The layers from layer_types ("linear_attention" / "full_attention"), or when it
 * is absent from full_attention_interval (transformers' default 4); the GatedDeltaNet fields are
 * read when some layer is one, the attention fields (num_attention_heads, num_key_value_heads,
 * head_dim, rope_parameters' rope_theta and partial_rotary_factor (or the older top-level ones),
 * max_position_embeddings) when some layer is full attention; the experts' fields for the MoE
 * model types ("qwen3_5_moe_text", "qwen3_next"), computed as transformers computes each type.
 * Refused: an unknown layer type or model type, layer_types of another length than
 * num_hidden_layers, experts under a dense model type, attention biases, a RoPE scaling other than
 * "default", a vocab_size outside [1, GDN_MODEL_MAX_VOCAB], missing, non-integer or out-of-range
 * fields, then whatever gdn_model_config_check refuses. */
GDN_API int gdn_ckpt_load_config(const char *dir, gdn_model_config *cfg);
/* What the last gdn_ckpt_resolve and gdn_ckpt_load_config on this thread noticed and did not
 * follow, for the caller to show ("" when nothing; each call replaces its own part): a newer
 * checkpoint-N of a training directory that is not complete, passed over for the newest complete
 * one; a field transformers ignores for the model type (norm_topk_prob false under Qwen3.5-MoE,
 * whose router always renormalises). */
GDN_API const char *gdn_ckpt_note(void);

/* Read dir/model.safetensors into w (gdn_model_param_floats(cfg) floats) after checking that
 * dir/config.json describes cfg: every tensor of the table with its exact shape, F32 or BF16 (or
 * F64), finite, and no other tensor. adam_m and
 * adam_v (both or neither; NULL: skip) from dir/optimizer.safetensors under the same rules.
 * state_json (NULL: skip) receives trainer_state.json's text, malloc'd (the caller frees). On
 * failure the arrays may hold part of the checkpoint. */
GDN_API int gdn_ckpt_load(const char *dir, const gdn_model_config *cfg, float *w, float *adam_m,
                  float *adam_v, char **state_json);

/* A part of the optimizer state of dir's checkpoint: the moments of the flat elements [lo, hi) of
 * cfg's layout (an expert slice's config reads its experts' rows) into adam_m / adam_v from [0],
 * only those bytes read; when the file holds fp32 master weights (a BF16 save), w (the elements
 * [lo, hi) from [0], holding model.safetensors' weights) is checked to be their rounding and
 * replaced by them. The file's tensors are checked (names, shapes) and the values read
 * are finite. A sharded trainer's resume onto any number of ranks. */
GDN_API int gdn_ckpt_load_part(const char *dir, const gdn_model_config *cfg, size_t lo, size_t hi, float *w,
                               float *adam_m, float *adam_v);

/* The separator of a checkpoint trained with --pack (trainer_state.json's pack_separator_hex)
 * into sep (at most cap bytes); *len 0 when the run did not pack or the directory has no
 * trainer_state.json (e.g. a transformers checkpoint). id (may be NULL): the one-id separator of
 * a run packed with --pack-id (trainer_state.json's pack_separator_id), -1 when there is none. */
GDN_API int gdn_ckpt_pack_separator(const char *dir, uint8_t *sep, int cap, int *len, int64_t *id);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_CHECKPOINT_H */
