/* Internals of the GatedDeltaNet layer shared by the single-rank and context-parallel paths. */
#ifndef GDNCP_LAYER_INTERNAL_H
#define GDNCP_LAYER_INTERNAL_H

#include "../core/internal.h"

/* Stable scalar pieces of the layer, shared by the fp32 path (the double reference keeps its own). */
static inline float gdn_sigmoidf(float x) { return 1.0f / (1.0f + __builtin_expf(-x)); }
/* softplus as torch.nn.functional.softplus (beta 1, threshold 20): x itself above 20. */
static inline float gdn_softplusf(float x) { return x > 20.0f ? x : __builtin_log1pf(__builtin_expf(x)); }
static inline float gdn_siluf(float x) { return x * gdn_sigmoidf(x); }

#endif
