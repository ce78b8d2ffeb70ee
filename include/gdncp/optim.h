/* AdamW with decoupled weight decay, a linear warmup + cosine learning-rate schedule and
 * clipping by the global gradient norm, over the model's flat parameter array (model.h). */
#ifndef GDNCP_OPTIM_H
#define GDNCP_OPTIM_H

#include <stddef.h>
#include <stdint.h>

#include "model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    double lr;           /* peak learning rate */
    double min_lr;       /* the cosine's floor */
    int64_t warmup;      /* steps of linear warmup from lr / warmup */
    int64_t steps;       /* total steps: the cosine reaches min_lr here */
    double beta1, beta2, eps;
    double weight_decay; /* decoupled, on the tensors gdn_model_tensor marks `decay` */
    double clip;         /* global gradient norm limit (0: none) */
} gdn_adamw_config;

GDN_API gdn_adamw_config gdn_adamw_default(void);
GDN_API int gdn_adamw_check(const gdn_adamw_config *a);
/* Learning rate for step (1-based). */
GDN_API double gdn_adamw_lr(const gdn_adamw_config *a, int64_t step);
/* The squared Euclidean norm of the gradient over the model's tensors (padding excluded), in
 * double, in two parts: sums[0] over every tensor but the routed experts', sums[1] over theirs
 * (under expert parallelism this rank's slice: the whole norm sums sums[1] over the slices). The
 * norm: sqrt(sums[0] + sums[1]). */
GDN_API void gdn_grad_sumsq(const gdn_model_config *cfg, const float *dw, double sums[2]);
/* The same over the flat elements [lo, hi) only, dw holding them from dw[0] (a sharded
 * optimizer's slice; padding excluded). */
GDN_API void gdn_grad_sumsq_range(const gdn_model_config *cfg, const float *dw, size_t lo, size_t hi,
                                  double sums[2]);
/* One update, step 1-based: dw scaled by `grad_scale` (clipping) first; m, v are the moments.
 * threads: the OpenMP threads this rank may use (the trainer's resolved count; <= 0 means 1). */
GDN_API void gdn_adamw_update(const gdn_adamw_config *a, const gdn_model_config *cfg, float *w,
                      const float *dw, float *m, float *v, int64_t step, double lr,
                      double grad_scale, int threads);
/* The same update of the flat elements [lo, hi) only (a sharded optimizer's slice, DESIGN §15):
 * w, dw, m and v hold them from [0]. */
GDN_API void gdn_adamw_update_range(const gdn_adamw_config *a, const gdn_model_config *cfg, float *w,
                                    const float *dw, float *m, float *v, size_t lo, size_t hi, int64_t step,
                                    double lr, double grad_scale, int threads);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_OPTIM_H */
