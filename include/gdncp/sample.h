/* Sampling the next token from a model's logits: greedy, temperature, top-k and top-p (nucleus),
 * with a seeded xorshift64* stream. `gdncp sample` and the Python package's Model.generate both
 * call these, so one seed gives the same tokens from either. */
#ifndef GDNCP_SAMPLE_H
#define GDNCP_SAMPLE_H

#include <stdint.h>

#include "version.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    double temperature; /* <= 0 or exactly 0: greedy (the first largest logit); else softmax(logits / T) */
    int64_t top_k;      /* keep the top_k largest logits (ties at the cut kept); 0: all */
    double top_p;       /* then keep the smallest set of the largest logits whose probability
                           reaches top_p (ties at the cut kept), in (0, 1]; 1: all */
} gdn_sampling;

/* Greedy: temperature 0, top_k 0, top_p 1. */
GDN_API gdn_sampling gdn_sampling_default(void);
/* GDN_ERR_ARG naming the field: temperature negative or not finite, top_k negative, top_p
 * outside (0, 1], vocab < 1. */
GDN_API int gdn_sampling_check(const gdn_sampling *s, int64_t vocab);
/* The stream's state for a seed (any value; the stream never reaches the all-zero state). */
GDN_API uint64_t gdn_sample_seed(uint64_t seed);
/* Floats of the workspace gdn_sample_next needs for vocab (0 for greedy, plain temperature and
 * top_k >= vocab with top_p 1: then work may be NULL). */
GDN_API int64_t gdn_sample_work_floats(const gdn_sampling *s, int64_t vocab);
/* The next token from logits [vocab]: *token in [0, vocab). Greedy draws nothing from *rng;
 * every other setting draws one uniform number. work: gdn_sample_work_floats floats (or NULL when
 * that is 0); nothing is allocated. Logits that are NaN are refused (GDN_ERR_NONFINITE); +-inf
 * logits are fine (-inf: never picked unless all are). */
GDN_API int gdn_sample_next(int64_t *token, const float *logits, int64_t vocab, const gdn_sampling *s,
                            uint64_t *rng, float *work);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_SAMPLE_H */
