/* SwiGLU rows, shared by the dense MLP (src/model/model.c) and the MoE experts (moe.c):
 * m = silu(gate) * up and its backward, a vector at a time (a scalar expf per element costs a
 * tenth of a training step). Header-only: static inline. */
#ifndef GDNCP_SWIGLU_H
#define GDNCP_SWIGLU_H

#include <math.h>
#include <stdint.h>

#include "base.h"

/* m[0..I) = silu(g) * u. */
static inline void gdn_swiglu_row(float *m, const float *g, const float *u, int64_t I) {
    int64_t j = 0;
    for (; j + GDN_VL <= I; j += GDN_VL) {
        const gdn_vf gv = gdn_vloadu(g + j);
        gdn_vstoreu(m + j, gv * gdn_vsigmoidf(gv) * gdn_vloadu(u + j));
    }
    for (; j < I; j++) m[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* The backward of one row for dm = dL/dm: dg = dm u s (1 + g (1 - s)), du = dm g s with
 * s = sigmoid(g). dg may be g and du may be u (in place). */
static inline void gdn_swiglu_grad_row(float *dg, float *du, const float *g, const float *u, const float *dm,
                                       int64_t I) {
    int64_t j = 0;
    for (; j + GDN_VL <= I; j += GDN_VL) {
        const gdn_vf gv = gdn_vloadu(g + j), uv = gdn_vloadu(u + j), dv = gdn_vloadu(dm + j);
        const gdn_vf s = gdn_vsigmoidf(gv);
        gdn_vstoreu(dg + j, dv * uv * s * (1.0f + gv * (1.0f - s)));
        gdn_vstoreu(du + j, dv * gv * s);
    }
    for (; j < I; j++) {
        const float gj = g[j], uj = u[j], s = 1.0f / (1.0f + expf(-gj));
        dg[j] = dm[j] * uj * s * (1.0f + gj * (1.0f - s));
        du[j] = dm[j] * gj * s;
    }
}

#endif
