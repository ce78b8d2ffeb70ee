/* AdamW (Loshchilov & Hutter): moments with bias correction, weight decay applied to the
 * weights directly (not through the gradient), tensor by tensor. */
#include "gdncp/optim.h"

#include <math.h>
#include <omp.h>

#include "base.h"

gdn_adamw_config gdn_adamw_default(void) {
    gdn_adamw_config a = {.lr = 3e-3, .min_lr = 3e-4, .warmup = 20, .steps = 1000, .beta1 = 0.9,
                          .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .clip = 1.0};
    return a;
}

int gdn_adamw_check(const gdn_adamw_config *a) {
    if (!(a->lr > 0 && a->lr <= 1)) return gdn_fail(GDN_ERR_ARG, "lr = %g is out of range (0, 1]", a->lr);
    if (!(a->min_lr >= 0 && a->min_lr <= a->lr))
        return gdn_fail(GDN_ERR_ARG, "min_lr = %g is out of range [0, lr = %g]", a->min_lr, a->lr);
    if (a->warmup < 0 || a->steps < 1)
        return gdn_fail(GDN_ERR_ARG, "warmup = %lld, steps = %lld (want warmup >= 0, steps >= 1)",
                        (long long)a->warmup, (long long)a->steps);
    if (!(a->beta1 >= 0 && a->beta1 < 1) || !(a->beta2 >= 0 && a->beta2 < 1))
        return gdn_fail(GDN_ERR_ARG, "beta1 = %g, beta2 = %g (want [0, 1))", a->beta1, a->beta2);
    if (!(a->eps > 0 && a->eps < 1)) return gdn_fail(GDN_ERR_ARG, "adam eps = %g is out of range (0, 1)", a->eps);
    if (!(a->weight_decay >= 0 && a->weight_decay < 10))
        return gdn_fail(GDN_ERR_ARG, "weight_decay = %g is out of range [0, 10)", a->weight_decay);
    if (!(a->clip >= 0 && isfinite(a->clip))) return gdn_fail(GDN_ERR_ARG, "clip = %g must be >= 0", a->clip);
    return GDN_OK;
}

double gdn_adamw_lr(const gdn_adamw_config *a, int64_t step) {
    if (a->warmup > 0 && step <= a->warmup) return a->lr * (double)step / (double)a->warmup;
    if (step >= a->steps) return a->min_lr;
    const double span = (double)(a->steps - a->warmup);
    const double t = span > 0 ? (double)(step - a->warmup) / span : 1.0;
    return a->min_lr + 0.5 * (a->lr - a->min_lr) * (1.0 + cos(3.141592653589793 * t));
}

/* The part of tensor t inside [lo, hi): its first and end elements (first >= end: none). */
static void clip_tensor(const gdn_model_tensor_info *t, size_t lo, size_t hi, size_t *first, size_t *end) {
    *first = lo > t->offset ? lo - t->offset : 0;
    *end = hi < t->offset + t->numel ? (hi > t->offset ? hi - t->offset : 0) : t->numel;
}

void gdn_grad_sumsq_range(const gdn_model_config *cfg, const float *dw, size_t lo, size_t hi, double sums[2]) {
    sums[0] = sums[1] = 0.0;
    gdn_model_tensor_info t;
    for (int i = 0; i < gdn_model_tensor_count(cfg); i++) {
        gdn_model_tensor(cfg, i, &t);
        size_t k0, k1;
        clip_tensor(&t, lo, hi, &k0, &k1);
        double ss = 0.0;
        for (size_t k = k0; k < k1; k++) ss += (double)dw[t.offset + k - lo] * dw[t.offset + k - lo];
        sums[t.experts_whole > 0] += ss;
    }
}

void gdn_grad_sumsq(const gdn_model_config *cfg, const float *dw, double sums[2]) {
    gdn_grad_sumsq_range(cfg, dw, 0, gdn_model_param_floats(cfg), sums);
}

void gdn_adamw_update_range(const gdn_adamw_config *a, const gdn_model_config *cfg, float *w, const float *dw,
                            float *m, float *v, size_t lo, size_t hi, int64_t step, double lr, double grad_scale,
                            int threads) {
    const double bc1 = 1.0 - pow(a->beta1, (double)step), bc2 = 1.0 - pow(a->beta2, (double)step);
    const float b1 = (float)a->beta1, b2 = (float)a->beta2, gs = (float)grad_scale;
    const float step_size = (float)(lr / bc1), inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    const float eps = (float)a->eps;
    gdn_model_tensor_info t;
    for (int i = 0; i < gdn_model_tensor_count(cfg); i++) {
        gdn_model_tensor(cfg, i, &t);
        size_t k0, k1;
        clip_tensor(&t, lo, hi, &k0, &k1);
        if (k0 >= k1) continue;
        const float shrink = t.decay ? (float)(1.0 - lr * a->weight_decay) : 1.0f;
        /* every array from lo */
        const size_t at = t.offset + k0 - lo;
        float *wi = w + at, *mi = m + at, *vi = v + at;
        const float *gi = dw + at;
        const int64_t n = (int64_t)(k1 - k0);
        /* the caller's (the trainer's per-rank) thread count, never the OpenMP default: ranks
         * sharing a node would oversubscribe it */
#pragma omp parallel num_threads(threads > 0 ? threads : 1) if (n > 65536)
        {
            if (omp_get_thread_num() == 0) gdn_test_threads("adamw_update", omp_get_num_threads());
#pragma omp for schedule(static)
            for (int64_t k = 0; k < n; k++) {
                const float g = gi[k] * gs;
                mi[k] = b1 * mi[k] + (1.0f - b1) * g;
                vi[k] = b2 * vi[k] + (1.0f - b2) * g * g;
                wi[k] = wi[k] * shrink - step_size * mi[k] / (sqrtf(vi[k]) * inv_sqrt_bc2 + eps);
            }
        }
    }
}

void gdn_adamw_update(const gdn_adamw_config *a, const gdn_model_config *cfg, float *w,
                      const float *dw, float *m, float *v, int64_t step, double lr,
                      double grad_scale, int threads) {
    gdn_adamw_update_range(a, cfg, w, dw, m, v, 0, gdn_model_param_floats(cfg), step, lr, grad_scale, threads);
}
