/* The sparse mixture-of-experts MLP (include/gdncp/moe.h, DESIGN §13): the fp32 block and the
 * float64 reference against transformers' Qwen3.5-MoE block (golden), the fp32 block against the
 * reference on random configurations (norm_topk on and off, no shared expert, top_k 1 and all,
 * an expert no row chose, one row), the reference against finite differences, thread-count
 * independence, BF16 compute, bad inputs and the aux loss. Every comparison has its negative
 * control: a wrong variant of the computation (norm_topk off on a renormalising block, the
 * experts' weights shifted by one, the shared expert's gate dropped, the smallest experts
 * chosen, the router's gradient or the aux term dropped) through the same check. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MOE_DIR GDN_GOLDEN_DIR "/qwen35_moe_tiny"

/* ---------------------------------------------------------------- helpers */

static double *to_double(const float *x, size_t n) {
    double *d = dalloc((int64_t)n);
    for (size_t i = 0; i < n; i++) d[i] = (double)x[i];
    return d;
}

static float *copy_f(const float *x, size_t n) {
    float *d = falloc((int64_t)n);
    memcpy(d, x, sizeof(float) * n);
    return d;
}

/* Random weights: the router in +-rs/sqrt(E) (larger rs: clearer top-k margins), the projections
 * in +-1/sqrt(fan-in), the shared expert's gate in +-1/sqrt(E); padding zero. */
static float *moe_random_weights(const gdn_moe_config *c, double rs) {
    const size_t nf = gdn_moe_param_floats(c);
    float *w = falloc((int64_t)nf);
    for (int i = 0; i < GDN_MOE_COUNT; i++) {
        int64_t shape[3];
        const int nd = gdn_moe_param_shape(c, i, shape);
        const size_t o = gdn_moe_param_offset(c, i), ne = gdn_moe_param_numel(c, i);
        if (!nd) continue;
        const double fan = (double)shape[nd - 1];
        const double s = (i == GDN_MOE_ROUTER ? rs : 1.0) / sqrt(fan);
        for (size_t j = 0; j < ne; j++) w[o + j] = (float)rng_uniform(-s, s);
    }
    return w;
}

/* The experts' weights shifted by one (expert e gets e+1's): a wrong expert index. */
static float *moe_shift_experts(const gdn_moe_config *c, const float *w) {
    const size_t nf = gdn_moe_param_floats(c);
    float *v = copy_f(w, nf);
    const int which[2] = {GDN_MOE_GATE_UP, GDN_MOE_DOWN};
    for (int q = 0; q < 2; q++) {
        const size_t o = gdn_moe_param_offset(c, which[q]), per = gdn_moe_param_numel(c, which[q]) / (size_t)c->n_experts;
        for (int64_t e = 0; e < c->n_experts; e++)
            memcpy(v + o + (size_t)e * per, w + o + (size_t)((e + 1) % c->n_experts) * per, sizeof(float) * per);
    }
    return v;
}

/* A copy with one tensor scaled by s (0: dropped, -1: negated). */
static float *moe_scale_tensor(const gdn_moe_config *c, const float *w, int which, float s) {
    float *v = copy_f(w, gdn_moe_param_floats(c));
    const size_t o = gdn_moe_param_offset(c, which), ne = gdn_moe_param_numel(c, which);
    for (size_t j = 0; j < ne; j++) v[o + j] *= s;
    return v;
}

typedef struct {
    float *y, *dx, *dw, *rw;
    int32_t *sel;
    double *stats;
} fast_out;

static void fast_free(fast_out *o) {
    free(o->y), free(o->dx), free(o->dw), free(o->rw), free(o->sel), free(o->stats);
    memset(o, 0, sizeof *o);
}

/* The fp32 block: forward (+ backward when dy) with a fresh plan. */
static int run_fast(const gdn_moe_config *c, const float *w, const float *x, const float *dy, const float *aux_dp,
                    fast_out *o) {
    memset(o, 0, sizeof *o);
    const int64_t N = c->N, E = c->E, NK = c->N * c->top_k;
    o->y = falloc(N * E), o->dx = falloc(N * E), o->dw = falloc((int64_t)gdn_moe_param_floats(c));
    o->rw = falloc(NK), o->sel = calloc((size_t)NK, sizeof(int32_t)), o->stats = dalloc(2 * c->n_experts);
    gdn_moe_plan *p = NULL;
    int rc = gdn_moe_plan_create(&p, c);
    if (rc) return rc;
    float *saved = falloc((int64_t)gdn_moe_saved_floats(p));
    rc = gdn_moe_forward(p, o->y, saved, x, w, o->stats, o->sel, o->rw);
    if (!rc && dy) rc = gdn_moe_backward(p, o->dx, o->dw, x, w, saved, dy, aux_dp);
    free(saved);
    gdn_moe_plan_destroy(p);
    return rc;
}

/* Largest per-tensor relative error of the gradient dw (fp32) against ref (double); *worst names it. */
static double dw_err(const gdn_moe_config *c, const float *dw, const double *ref, int only, const char **worst) {
    double m = 0.0;
    for (int i = 0; i < GDN_MOE_COUNT; i++) {
        if (only >= 0 && i != only) continue;
        const size_t o = gdn_moe_param_offset(c, i), ne = gdn_moe_param_numel(c, i);
        if (!ne) continue;
        const double e = rel_err_f32(dw + o, ref + o, (int64_t)ne);
        if (!(e <= m)) {
            m = e;
            if (worst) *worst = gdn_moe_param_name(i);
        }
    }
    return m;
}

/* ---------------------------------------------------------------- 1. golden */

static int read_golden_weights(const gdn_moe_config *c, float *w) {
    gdn_st_file *f = NULL;
    int rc = gdn_st_open(&f, MOE_DIR "/model.safetensors");
    if (rc) return rc;
    const int64_t E = c->E, I = c->I;
    const char *P = "model.layers.0.mlp.";
    char name[200];
#define RD(nm, which, add, count)                                                     \
    do {                                                                              \
        snprintf(name, sizeof name, "%s%s", P, nm);                                   \
        if (!rc) rc = gdn_st_read_f32(f, name, w + gdn_moe_param_offset(c, which) + (add), (size_t)(count)); \
    } while (0)
    RD("gate.weight", GDN_MOE_ROUTER, 0, c->n_experts * E);
    for (int64_t e = 0; e < c->n_experts; e++) {
        char leaf[100];
        snprintf(leaf, sizeof leaf, "experts.%lld.gate_proj.weight", (long long)e);
        RD(leaf, GDN_MOE_GATE_UP, e * 2 * I * E, I * E);
        snprintf(leaf, sizeof leaf, "experts.%lld.up_proj.weight", (long long)e);
        RD(leaf, GDN_MOE_GATE_UP, e * 2 * I * E + I * E, I * E);
        snprintf(leaf, sizeof leaf, "experts.%lld.down_proj.weight", (long long)e);
        RD(leaf, GDN_MOE_DOWN, e * E * I, E * I);
    }
    RD("shared_expert.gate_proj.weight", GDN_MOE_SHARED_GATE, 0, c->Is * E);
    RD("shared_expert.up_proj.weight", GDN_MOE_SHARED_UP, 0, c->Is * E);
    RD("shared_expert.down_proj.weight", GDN_MOE_SHARED_DOWN, 0, E * c->Is);
    RD("shared_expert_gate.weight", GDN_MOE_SHARED_EXPERT_GATE, 0, E);
#undef RD
    gdn_st_close(f);
    return rc;
}

static void moe_suite_golden(void) {
    gdn_moe_config c = gdn_moe_config_default(300, 64, 8, 2, 32, 48);
    const int64_t N = c.N, E = c.E, NK = N * c.top_k;
    const size_t nf = gdn_moe_param_floats(&c);
    float *w = falloc((int64_t)nf);
    int rc = read_golden_weights(&c, w);
    gdn_st_file *f = NULL;
    if (!rc) rc = gdn_st_open(&f, MOE_DIR "/moe.io.safetensors");
    if (rc) {
        check(0, "moe golden: read %s: %s", MOE_DIR, gdn_errmsg());
        free(w);
        return;
    }
    double *xd = dalloc(N * E), *dyd = dalloc(N * E), *yg = dalloc(N * E), *dxg = dalloc(N * E), *rwg = dalloc(NK);
    double *dwg = dalloc((int64_t)nf);
    int64_t *selg = calloc((size_t)NK, sizeof(int64_t)), cnt = 0;
    float *x = falloc(N * E), *dy = falloc(N * E);
    rc = gdn_st_read_f64(f, "x", xd, (size_t)(N * E));
    if (!rc) rc = gdn_st_read_f64(f, "dy", dyd, (size_t)(N * E));
    if (!rc) rc = gdn_st_read_f64(f, "y", yg, (size_t)(N * E));
    if (!rc) rc = gdn_st_read_f64(f, "dx", dxg, (size_t)(N * E));
    if (!rc) rc = gdn_st_read_f64(f, "routing_weights", rwg, (size_t)NK);
    if (!rc) rc = gdn_st_read_i64_all(f, "selected_experts", selg, (size_t)NK, &cnt);
    static const char *const gname[GDN_MOE_COUNT] = {
        "grad.gate.weight", "grad.experts.gate_up_proj", "grad.experts.down_proj",
        "grad.shared_expert.gate_proj.weight", "grad.shared_expert.up_proj.weight",
        "grad.shared_expert.down_proj.weight", "grad.shared_expert_gate.weight"};
    for (int i = 0; i < GDN_MOE_COUNT && !rc; i++)
        rc = gdn_st_read_f64(f, gname[i], dwg + gdn_moe_param_offset(&c, i), gdn_moe_param_numel(&c, i));
    gdn_st_close(f);
    check(!rc && cnt == NK, "moe golden: read moe.io.safetensors (%s)", rc ? gdn_errmsg() : "ok");
    if (rc) goto done;
    for (int64_t i = 0; i < N * E; i++) x[i] = (float)xd[i], dy[i] = (float)dyd[i];

    /* fp32 forward and backward against transformers (float64). Tolerances: y and the routing
     * weights 2e-5 (fp32 GEMMs of depth 64 and 32), gradients 1e-4 (DESIGN §6). */
    fast_out o, bad;
    rc = run_fast(&c, w, x, dy, NULL, &o);
    check(!rc, "moe golden: fp32 forward + backward run (%s)", rc ? gdn_errmsg() : "ok");
    if (rc) goto done;
    int same = 1;
    for (int64_t i = 0; i < NK; i++) same &= o.sel[i] == (int32_t)selg[i];
    check(same, "moe golden: fp32 selected experts == transformers' (torch.topk order), %lld pairs", (long long)NK);
    const double tol_y = 2e-5, tol_g = 1e-4;
    expect_close(rel_err_f32(o.y, yg, N * E), tol_y, "moe golden: fp32 y vs transformers");
    expect_close(rel_err_f32(o.rw, rwg, NK), tol_y, "moe golden: fp32 routing weights vs transformers");
    expect_close(rel_err_f32(o.dx, dxg, N * E), tol_g, "moe golden: fp32 dx vs transformers");
    for (int i = 0; i < GDN_MOE_COUNT; i++)
        expect_close(dw_err(&c, o.dw, dwg, i, NULL), tol_g, "moe golden: fp32 %s vs transformers", gname[i]);

    /* Controls. norm_topk off on this renormalising block: y and the routing weights. */
    gdn_moe_config c0 = c;
    c0.norm_topk = 0;
    rc = run_fast(&c0, w, x, dy, NULL, &bad);
    expect_far(rel_err_f32(bad.y, yg, N * E), tol_y, "moe golden control: norm_topk = 0 y (rc %d)", rc);
    expect_far(rel_err_f32(bad.rw, rwg, NK), tol_y, "moe golden control: norm_topk = 0 routing weights");
    expect_far(rel_err_f32(bad.dw, dwg, c.n_experts * E), tol_g, "moe golden control: norm_topk = 0 grad.gate.weight");
    fast_free(&bad);
    /* The experts' weights shifted by one: y, dx and the routed experts' and router's gradients. */
    float *ws = moe_shift_experts(&c, w);
    rc = run_fast(&c, ws, x, dy, NULL, &bad);
    expect_far(rel_err_f32(bad.y, yg, N * E), tol_y, "moe golden control: expert index off by one y (rc %d)", rc);
    expect_far(rel_err_f32(bad.dx, dxg, N * E), tol_g, "moe golden control: expert index off by one dx");
    for (int i = GDN_MOE_ROUTER; i <= GDN_MOE_DOWN; i++)
        expect_far(dw_err(&c, bad.dw, dwg, i, NULL), tol_g, "moe golden control: expert index off by one %s", gname[i]);
    fast_free(&bad), free(ws);
    /* The shared expert's gate dropped (sigmoid(0) = 1/2 for every row): y and the shared grads. */
    ws = moe_scale_tensor(&c, w, GDN_MOE_SHARED_EXPERT_GATE, 0.0f);
    rc = run_fast(&c, ws, x, dy, NULL, &bad);
    expect_far(rel_err_f32(bad.y, yg, N * E), tol_y, "moe golden control: shared expert gate dropped y (rc %d)", rc);
    for (int i = GDN_MOE_SHARED_GATE; i <= GDN_MOE_SHARED_EXPERT_GATE; i++)
        expect_far(dw_err(&c, bad.dw, dwg, i, NULL), tol_g, "moe golden control: shared expert gate dropped %s", gname[i]);
    fast_free(&bad), free(ws);
    /* Top-k the wrong way round (the smallest p: the router negated). */
    ws = moe_scale_tensor(&c, w, GDN_MOE_ROUTER, -1.0f);
    rc = run_fast(&c, ws, x, dy, NULL, &bad);
    same = 1;
    for (int64_t i = 0; i < NK; i++) same &= bad.sel[i] == (int32_t)selg[i];
    check(!same, "moe golden control: the smallest experts chosen differ from transformers' choice");
    expect_far(rel_err_f32(bad.y, yg, N * E), tol_y, "moe golden control: smallest experts chosen y (rc %d)", rc);
    fast_free(&bad), free(ws);
    /* The router's gradient dropped (a zero gradient), through the gradient check. */
    float *zero = falloc((int64_t)nf);
    expect_far(dw_err(&c, zero, dwg, GDN_MOE_ROUTER, NULL), tol_g, "moe golden control: router gradient dropped");
    free(zero);
    fast_free(&o);

    /* The float64 reference against the same golden: rounding only (1e-10). */
    {
        const double tol_r = 1e-10;
        double *wd = to_double(w, nf), *yr = dalloc(N * E), *dxr = dalloc(N * E), *dwr = dalloc((int64_t)nf);
        int32_t *selr = calloc((size_t)NK, sizeof(int32_t));
        rc = gdn_moe_reference_forward(&c, yr, xd, wd, selr);
        if (!rc) rc = gdn_moe_reference_backward(&c, dxr, dwr, xd, wd, dyd, NULL);
        check(!rc, "moe golden: reference runs (%s)", rc ? gdn_errmsg() : "ok");
        same = 1;
        for (int64_t i = 0; i < NK; i++) same &= selr[i] == (int32_t)selg[i];
        check(same, "moe golden: reference selected experts == transformers'");
        expect_close(rel_err_dd(yr, yg, N * E), tol_r, "moe golden: reference y vs transformers");
        expect_close(rel_err_dd(dxr, dxg, N * E), tol_r, "moe golden: reference dx vs transformers");
        double m = 0.0;
        for (int i = 0; i < GDN_MOE_COUNT; i++) {
            const size_t off = gdn_moe_param_offset(&c, i), ne = gdn_moe_param_numel(&c, i);
            const double e = rel_err_dd(dwr + off, dwg + off, (int64_t)ne);
            m = e > m ? e : m;
        }
        expect_close(m, tol_r, "moe golden: reference every grad.* vs transformers (worst tensor)");
        gdn_moe_config r0 = c;
        r0.norm_topk = 0;
        rc = gdn_moe_reference_forward(&r0, yr, xd, wd, NULL);
        if (!rc) rc = gdn_moe_reference_backward(&r0, dxr, dwr, xd, wd, dyd, NULL);
        expect_far(rel_err_dd(yr, yg, N * E), tol_r, "moe golden control: reference norm_topk = 0 y (rc %d)", rc);
        expect_far(rel_err_dd(dxr, dxg, N * E), tol_r, "moe golden control: reference norm_topk = 0 dx");
        expect_far(rel_err_dd(dwr, dwg, c.n_experts * E), tol_r, "moe golden control: reference norm_topk = 0 grad.gate.weight");
        free(wd), free(yr), free(dxr), free(dwr), free(selr);
    }
done:
    free(w), free(xd), free(dyd), free(yg), free(dxg), free(rwg), free(dwg), free(selg), free(x), free(dy);
}

/* ---------------------------------------------------------------- 2. random configs vs reference */

typedef struct {
    const char *what;
    int64_t N, E, n, k, I, Is;
    int norm;
} moe_case;

/* Smallest gap p_(k) - p_(k+1) over the rows (double), to see that routing is decided. */
static double topk_margin(const gdn_moe_config *c, const double *w, const double *x) {
    const int64_t n = c->n_experts, E = c->E, k = c->top_k;
    if (k == n) return 1.0;
    const double *Wr = w + gdn_moe_param_offset(c, GDN_MOE_ROUTER);
    double worst = 1.0, *l = dalloc(n);
    for (int64_t t = 0; t < c->N; t++) {
        for (int64_t e = 0; e < n; e++) {
            l[e] = 0;
            for (int64_t i = 0; i < E; i++) l[e] += Wr[e * E + i] * x[t * E + i];
        }
        for (int64_t a = 1; a < n; a++) /* insertion sort, descending */
            for (int64_t b = a; b > 0 && l[b] > l[b - 1]; b--) {
                const double tmp = l[b];
                l[b] = l[b - 1], l[b - 1] = tmp;
            }
        if (l[k - 1] - l[k] < worst) worst = l[k - 1] - l[k];
    }
    free(l);
    return worst;
}

static void moe_suite_random(void) {
    static const moe_case cases[] = {
        {"renormalised, shared", 37, 24, 6, 2, 12, 20, 1},
        {"plain softmax, shared", 37, 24, 6, 2, 12, 20, 0},
        {"renormalised, no shared expert", 29, 16, 5, 2, 9, 0, 1},
        {"plain softmax, no shared expert", 29, 16, 5, 3, 9, 0, 0},
        {"top_k 1", 40, 20, 4, 1, 8, 6, 1},
        {"top_k = n_experts", 21, 20, 4, 4, 8, 6, 1},
        {"top_k = n_experts, plain", 21, 20, 4, 4, 8, 6, 0},
        {"an expert no row chose", 3, 32, 16, 2, 16, 8, 1},
        {"one row (decode)", 1, 40, 8, 3, 24, 16, 1},
        {"many rows, odd sizes", 200, 33, 7, 2, 19, 13, 1},
    };
    const double tol_y = 1e-5, tol_g = 1e-4;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const moe_case *mc = &cases[ci];
        rng_seed(1000 + ci);
        gdn_moe_config c = gdn_moe_config_default(mc->N, mc->E, mc->n, mc->k, mc->I, mc->Is);
        c.norm_topk = mc->norm, c.threads = 2;
        const int64_t N = c.N, E = c.E, n = c.n_experts;
        const size_t nf = gdn_moe_param_floats(&c);
        float *w = moe_random_weights(&c, 4.0), *x = random_floats((size_t)(N * E)), *dy = random_floats((size_t)(N * E));
        float *aux = falloc(n);
        for (int64_t e = 0; e < n; e++) aux[e] = (float)rng_uniform(-0.5, 0.5);
        double *wd = to_double(w, nf), *xd = to_double(x, (size_t)(N * E)), *dyd = to_double(dy, (size_t)(N * E));
        double *auxd = to_double(aux, (size_t)n);
        double *yr = dalloc(N * E), *dxr = dalloc(N * E), *dwr = dalloc((int64_t)nf);
        int32_t *selr = calloc((size_t)(N * c.top_k), sizeof(int32_t));
        int rc = gdn_moe_reference_forward(&c, yr, xd, wd, selr);
        if (!rc) rc = gdn_moe_reference_backward(&c, dxr, dwr, xd, wd, dyd, auxd);
        fast_out o, bad;
        if (!rc) rc = run_fast(&c, w, x, dy, aux, &o);
        check(!rc, "moe random %-32s N=%lld E=%lld n=%lld k=%lld I=%lld Is=%lld: runs (%s), top-k margin %.2e",
              mc->what, (long long)N, (long long)E, (long long)n, (long long)c.top_k, (long long)c.I,
              (long long)c.Is, rc ? gdn_errmsg() : "ok", topk_margin(&c, wd, xd));
        if (rc) continue;
        int same = 1, unused = 0;
        for (int64_t i = 0; i < N * c.top_k; i++) same &= o.sel[i] == selr[i];
        for (int64_t e = 0; e < n; e++) unused += o.stats[e] == 0.0;
        check(same, "moe random %-32s: fp32 routing == reference routing", mc->what);
        if (ci == 7) {
            check(unused > 0, "moe random %-32s: %d experts chosen by no row", mc->what, unused);
            /* their gradients are exactly zero */
            const int64_t I = c.I, off = (int64_t)gdn_moe_param_offset(&c, GDN_MOE_GATE_UP);
            int zero = 1;
            for (int64_t e = 0; e < n; e++)
                if (o.stats[e] == 0.0)
                    for (int64_t i = 0; i < 2 * I * E; i++) zero &= o.dw[off + e * 2 * I * E + i] == 0.0f;
            check(zero, "moe random %-32s: the unchosen experts' gate_up gradients are zero", mc->what);
        }
        const char *worst = "";
        expect_close(rel_err_f32(o.y, yr, N * E), tol_y, "moe random %-32s: fp32 y vs reference", mc->what);
        expect_close(rel_err_f32(o.dx, dxr, N * E), tol_g, "moe random %-32s: fp32 dx vs reference (aux_dp given)", mc->what);
        const double ew = dw_err(&c, o.dw, dwr, -1, &worst);
        expect_close(ew, tol_g, "moe random %-32s: fp32 dw vs reference (worst: %s)", mc->what, worst);
        /* Controls: the experts shifted by one (y, dx, dw); the aux term dropped (the router). */
        float *ws = moe_shift_experts(&c, w);
        rc = run_fast(&c, ws, x, dy, aux, &bad);
        expect_far(rel_err_f32(bad.y, yr, N * E), tol_y, "moe random %-32s control: expert index off by one y", mc->what);
        expect_far(rel_err_f32(bad.dx, dxr, N * E), tol_g, "moe random %-32s control: expert index off by one dx", mc->what);
        expect_far(dw_err(&c, bad.dw, dwr, GDN_MOE_GATE_UP, NULL), tol_g,
                   "moe random %-32s control: expert index off by one gate_up grad", mc->what);
        fast_free(&bad), free(ws);
        rc = run_fast(&c, w, x, dy, NULL, &bad);
        expect_far(dw_err(&c, bad.dw, dwr, GDN_MOE_ROUTER, NULL), tol_g,
                   "moe random %-32s control: aux term dropped router grad", mc->what);
        fast_free(&bad), fast_free(&o);
        free(w), free(x), free(dy), free(aux), free(wd), free(xd), free(dyd), free(auxd), free(yr), free(dxr), free(dwr);
        free(selr);
    }
}

/* ---------------------------------------------------------------- 3. finite differences */

/* loss = sum(y * dy) + sum_rows sum_e aux[e] p_e(row), by the reference. */
static double ref_loss(const gdn_moe_config *c, const double *w, const double *x, const double *dy, const double *aux,
                       int32_t *sel) {
    const int64_t N = c->N, E = c->E, n = c->n_experts;
    double *y = dalloc(N * E);
    gdn_moe_reference_forward(c, y, x, w, sel);
    double L = 0.0;
    for (int64_t i = 0; i < N * E; i++) L += y[i] * dy[i];
    const double *Wr = w + gdn_moe_param_offset(c, GDN_MOE_ROUTER);
    double *l = dalloc(n);
    for (int64_t t = 0; t < N; t++) {
        double mx = -INFINITY, s = 0.0;
        for (int64_t e = 0; e < n; e++) {
            l[e] = 0.0;
            for (int64_t i = 0; i < E; i++) l[e] += Wr[e * E + i] * x[t * E + i];
            mx = l[e] > mx ? l[e] : mx;
        }
        for (int64_t e = 0; e < n; e++) s += l[e] = exp(l[e] - mx);
        for (int64_t e = 0; e < n; e++) L += aux[e] * l[e] / s;
    }
    free(y), free(l);
    return L;
}

static void moe_suite_fd(void) {
    for (int norm = 1; norm >= 0; norm--) {
        rng_seed(77 + norm);
        gdn_moe_config c = gdn_moe_config_default(5, 6, 4, 2, 3, 5);
        c.norm_topk = norm;
        const int64_t N = c.N, E = c.E, n = c.n_experts, NK = N * c.top_k;
        const size_t nf = gdn_moe_param_floats(&c);
        float *wf = moe_random_weights(&c, 6.0), *xf = random_floats((size_t)(N * E)), *dyf = random_floats((size_t)(N * E));
        double *w = to_double(wf, nf), *x = to_double(xf, (size_t)(N * E)), *dy = to_double(dyf, (size_t)(N * E));
        double *aux = dalloc(n), *dx = dalloc(N * E), *dw = dalloc((int64_t)nf), *dx0 = dalloc(N * E),
               *dw0 = dalloc((int64_t)nf), *dxb = dalloc(N * E), *dwb = dalloc((int64_t)nf);
        for (int64_t e = 0; e < n; e++) aux[e] = rng_uniform(-0.5, 0.5);
        int32_t *sel = calloc((size_t)NK, sizeof(int32_t)), *sel2 = calloc((size_t)NK, sizeof(int32_t));
        gdn_moe_reference_backward(&c, dx, dw, x, w, dy, aux);
        /* wrong variants: norm_topk flipped; the aux term dropped; the shared expert's gate dropped */
        gdn_moe_config cf = c;
        cf.norm_topk = !norm;
        gdn_moe_reference_backward(&cf, dx0, dw0, x, w, dy, aux);
        double *wg0 = dalloc((int64_t)nf), *dwa = dalloc((int64_t)nf), *dxa = dalloc(N * E);
        memcpy(wg0, w, sizeof(double) * nf);
        for (size_t i = 0, o = gdn_moe_param_offset(&c, GDN_MOE_SHARED_EXPERT_GATE); i < (size_t)E; i++) wg0[o + i] = 0.0;
        gdn_moe_reference_backward(&c, dxb, dwb, x, wg0, dy, aux);
        gdn_moe_reference_backward(&c, dxa, dwa, x, w, dy, NULL);
        ref_loss(&c, w, x, dy, aux, sel);
        const int64_t e0 = sel[0]; /* an expert row 0 chose */
        struct { const char *what; double *v, *an, *ctl; const char *ctl_what; size_t off, count, step; } g[] = {
            {"router", w, dw, dwa, "aux term dropped", gdn_moe_param_offset(&c, GDN_MOE_ROUTER), (size_t)(n * E), 1},
            {"router (norm)", w, dw, dw0, "norm_topk flipped", gdn_moe_param_offset(&c, GDN_MOE_ROUTER), (size_t)(n * E), 1},
            {"expert gate_up", w, dw, dw0, "norm_topk flipped", gdn_moe_param_offset(&c, GDN_MOE_GATE_UP) + (size_t)(e0 * 2 * c.I * E),
             (size_t)(2 * c.I * E), 1},
            {"expert down", w, dw, dw0, "norm_topk flipped", gdn_moe_param_offset(&c, GDN_MOE_DOWN) + (size_t)(e0 * E * c.I),
             (size_t)(E * c.I), 1},
            {"shared gate/up/down", w, dw, dwb, "shared expert gate dropped", gdn_moe_param_offset(&c, GDN_MOE_SHARED_GATE),
             gdn_moe_param_offset(&c, GDN_MOE_SHARED_EXPERT_GATE) - gdn_moe_param_offset(&c, GDN_MOE_SHARED_GATE), 1},
            {"shared_expert_gate", w, dw, dwb, "shared expert gate dropped", gdn_moe_param_offset(&c, GDN_MOE_SHARED_EXPERT_GATE),
             (size_t)E, 1},
            {"x", x, dx, dx0, "norm_topk flipped", 0, (size_t)(N * E), 1},
        };
        const double h = 1e-6, tol = 1e-7;
        for (size_t gi = 0; gi < sizeof g / sizeof g[0]; gi++) {
            double err = 0.0, cerr = 0.0, scale = 0.0;
            int stable = 1;
            for (size_t i = 0; i < g[gi].count; i++) {
                const size_t at = g[gi].off + i;
                const double v0 = g[gi].v[at];
                g[gi].v[at] = v0 + h;
                const double lp = ref_loss(&c, w, x, dy, aux, sel2);
                for (int64_t q = 0; q < NK; q++) stable &= sel2[q] == sel[q];
                g[gi].v[at] = v0 - h;
                const double lm = ref_loss(&c, w, x, dy, aux, sel2);
                for (int64_t q = 0; q < NK; q++) stable &= sel2[q] == sel[q];
                g[gi].v[at] = v0;
                const double fd = (lp - lm) / (2 * h);
                const double a = g[gi].an[at], b = g[gi].ctl[at];
                err = fmax(err, fabs(fd - a)), cerr = fmax(cerr, fabs(fd - b)), scale = fmax(scale, fabs(fd));
            }
            check(stable, "moe fd norm_topk=%d %s: routing unchanged by the perturbations", norm, g[gi].what);
            expect_close(err / scale, tol, "moe fd norm_topk=%d %-20s: reference backward vs central differences (h %g, "
                         "max |g| %.3g)", norm, g[gi].what, h, scale);
            expect_far(cerr / scale, tol, "moe fd norm_topk=%d %-20s control: %s", norm, g[gi].what, g[gi].ctl_what);
        }
        free(wf), free(xf), free(dyf), free(w), free(x), free(dy), free(aux), free(dx), free(dw), free(dx0), free(dw0);
        free(dxb), free(dwb), free(wg0), free(dwa), free(dxa), free(sel), free(sel2);
    }
}

/* Redraw the rows of x whose gap between the k-th and (k+1)-th router logit is below gap, so
 * that the routing is decided beyond the rounding of the precision under test. */
static void clear_margin_rows(const gdn_moe_config *c, const float *w, float *x, double gap) {
    const int64_t n = c->n_experts, E = c->E, k = c->top_k;
    const float *Wr = w + gdn_moe_param_offset(c, GDN_MOE_ROUTER);
    double *l = dalloc(n);
    for (int64_t t = 0; t < c->N; t++)
        for (int tries = 0; tries < 1000 && k < n; tries++) {
            for (int64_t e = 0; e < n; e++) {
                l[e] = 0;
                for (int64_t i = 0; i < E; i++) l[e] += (double)Wr[e * E + i] * x[t * E + i];
            }
            for (int64_t a = 1; a < n; a++)
                for (int64_t b = a; b > 0 && l[b] > l[b - 1]; b--) {
                    const double tmp = l[b];
                    l[b] = l[b - 1], l[b - 1] = tmp;
                }
            if (l[k - 1] - l[k] >= gap) break;
            for (int64_t i = 0; i < E; i++) x[t * E + i] = (float)rng_uniform(-1, 1);
        }
    free(l);
}

/* ---------------------------------------------------------------- 4. threads, 5. BF16 */

static void moe_suite_threads_bf16(void) {
    rng_seed(4242);
    gdn_moe_config c = gdn_moe_config_default(257, 48, 8, 2, 40, 24);
    const int64_t N = c.N, E = c.E;
    const size_t nf = gdn_moe_param_floats(&c);
    float *w = moe_random_weights(&c, 4.0), *x = random_floats((size_t)(N * E)), *dy = random_floats((size_t)(N * E));
    /* bf16 operands move a logit by ~1e-2 here: keep the routing decided beyond that */
    clear_margin_rows(&c, w, x, 0.1);
    fast_out o1, o2, ob, bad;
    c.threads = 1;
    int rc = run_fast(&c, w, x, dy, NULL, &o1);
    c.threads = 2;
    rc |= run_fast(&c, w, x, dy, NULL, &o2);
    check(!rc, "moe threads: runs");
    /* The combine's order is fixed and gdn_matmul splits the output, not the depth, over threads:
     * threads 1 and 2 agree bit for bit. */
    expect_close(rel_err_ff(o2.y, o1.y, N * E), 0.0, "moe threads 2 vs 1: y bit-identical");
    expect_close(rel_err_ff(o2.dx, o1.dx, N * E), 0.0, "moe threads 2 vs 1: dx bit-identical");
    expect_close(rel_err_ff(o2.dw, o1.dw, (int64_t)nf), 0.0, "moe threads 2 vs 1: dw bit-identical");
    /* control: a combine whose order depends on the thread (a mutation inside the block) */
    test_mutation = "moe: the combine's terms added in another order off the first thread";
    rc = run_fast(&c, w, x, dy, NULL, &bad);
    test_mutation = NULL;
    check(!rc, "moe threads control: runs");
    expect_far(rel_err_ff(bad.y, o1.y, N * E), 0.0,
               "moe threads control: 2 threads whose combine order differs off thread 0: y not bit-identical");
    fast_free(&bad);

    /* BF16 compute vs fp32: operands rounded to bf16 (8 bits of mantissa, 2^-9 relative each),
     * depth <= 48: within 1e-2 of the largest value (y), 2e-2 (gradients). */
    gdn_moe_config cb = c;
    cb.compute = GDN_COMPUTE_BF16;
    rc = run_fast(&cb, w, x, dy, NULL, &ob);
    check(!rc, "moe bf16: runs (%s)", rc ? gdn_errmsg() : "ok");
    double *yd = to_double(o1.y, (size_t)(N * E)), *dxd = to_double(o1.dx, (size_t)(N * E)), *dwd = to_double(o1.dw, nf);
    const char *worst = "";
    const double ey = rel_err_f32(ob.y, yd, N * E), edx = rel_err_f32(ob.dx, dxd, N * E), edw = dw_err(&c, ob.dw, dwd, -1, &worst);
    /* the same set per row (the order of two close leaders may swap: y does not change) */
    int64_t flips = 0;
    for (int64_t i = 0; i < N * c.top_k; i++) {
        int found = 0;
        for (int64_t j = i / c.top_k * c.top_k; j < (i / c.top_k + 1) * c.top_k; j++) found |= ob.sel[i] == o1.sel[j];
        flips += !found;
    }
    check(flips == 0, "moe bf16: the same experts as fp32 (%lld of %lld pairs differ)", (long long)flips,
          (long long)(N * c.top_k));
    expect_close(ey, 1e-2, "moe bf16 vs fp32: y");
    check(ey > 1e-7, "moe bf16 vs fp32: y differs from fp32 (%.2e: the products did run in bf16)", ey);
    expect_close(edx, 2e-2, "moe bf16 vs fp32: dx");
    expect_close(edw, 2e-2, "moe bf16 vs fp32: dw (worst %s)", worst);
    float *ws = moe_shift_experts(&c, w);
    rc = run_fast(&cb, ws, x, dy, NULL, &bad);
    expect_far(rel_err_f32(bad.y, yd, N * E), 1e-2, "moe bf16 control: expert index off by one y");
    expect_far(rel_err_f32(bad.dx, dxd, N * E), 2e-2, "moe bf16 control: expert index off by one dx");
    expect_far(dw_err(&c, bad.dw, dwd, GDN_MOE_GATE_UP, NULL), 2e-2, "moe bf16 control: expert index off by one gate_up grad");
    fast_free(&bad), free(ws);
    fast_free(&o1), fast_free(&o2), fast_free(&ob);
    free(w), free(x), free(dy), free(yd), free(dxd), free(dwd);
}

/* ---------------------------------------------------------------- 6. bad input */

static void moe_suite_errors(void) {
    gdn_moe_config c = gdn_moe_config_default(4, 8, 4, 2, 6, 5), b;
    b = c, b.top_k = 0;
    expect_status(gdn_moe_config_check(&b), GDN_ERR_SHAPE, "top_k", "moe error: top_k = 0");
    b = c, b.top_k = 5;
    expect_status(gdn_moe_config_check(&b), GDN_ERR_SHAPE, "top_k", "moe error: top_k > n_experts");
    b = c, b.n_experts = GDN_MOE_MAX_EXPERTS + 1;
    expect_status(gdn_moe_config_check(&b), GDN_ERR_SHAPE, "n_experts", "moe error: n_experts > max");
    b = c, b.I = 0;
    expect_status(gdn_moe_config_check(&b), GDN_ERR_SHAPE, "moe I =", "moe error: I = 0");
    b = c, b.Is = -1;
    expect_status(gdn_moe_config_check(&b), GDN_ERR_SHAPE, "Is", "moe error: Is < 0");
    b = c, b.threads = -1;
    expect_status(gdn_moe_config_check(&b), GDN_ERR_ARG, "threads", "moe error: threads < 0");
    b = c, b.compute = 9;
    expect_status(gdn_moe_config_check(&b), GDN_ERR_ARG, "compute", "moe error: compute unknown");
    b = c, b.N = (int64_t)1 << 30, b.top_k = 4;
    expect_status(gdn_moe_config_check(&b), GDN_ERR_SHAPE, "N * top_k", "moe error: N * top_k overflows int32");
    gdn_moe_plan *p = NULL;
    b = c, b.top_k = 0;
    expect_status(gdn_moe_plan_create(&p, &b), GDN_ERR_SHAPE, "top_k", "moe error: plan with top_k = 0");
    check(p == NULL, "moe error: no plan made");
    expect_status(gdn_moe_config_check(&c), GDN_OK, NULL, "moe error control: the valid config passes");

    rng_seed(9);
    float *w = moe_random_weights(&c, 4.0), *x = random_floats((size_t)(c.N * c.E)), *y = falloc(c.N * c.E);
    int rc = gdn_moe_plan_create(&p, &c);
    check(!rc, "moe error: plan");
    if (rc) return;
    float *saved = falloc((int64_t)gdn_moe_saved_floats(p));
    expect_status(gdn_moe_forward(p, y, saved, x, w, NULL, NULL, NULL), GDN_OK, NULL, "moe error control: clean forward");
    x[5] = NAN;
    expect_status(gdn_moe_forward(p, y, saved, x, w, NULL, NULL, NULL), GDN_ERR_NONFINITE, "'x'", "moe error: NaN in x");
    x[5] = 0.25f;
    float *dy = random_floats((size_t)(c.N * c.E)), *dx = falloc(c.N * c.E), *dw = falloc((int64_t)gdn_moe_param_floats(&c));
    dy[3] = INFINITY;
    expect_status(gdn_moe_backward(p, dx, dw, x, w, saved, dy, NULL), GDN_ERR_NONFINITE, "'dy'", "moe error: Inf in dy");
    dy[3] = 0.5f;
    expect_status(gdn_moe_backward(p, dx, dw, x, w, saved, dy, NULL), GDN_OK, NULL, "moe error control: clean backward");
    w[gdn_moe_param_offset(&c, GDN_MOE_ROUTER) + 2 * c.E + 3] = NAN; /* expert 2's router row */
    expect_status(gdn_moe_forward(p, y, saved, x, w, NULL, NULL, NULL), GDN_ERR_NONFINITE, "NaN in the router's logits at row 0",
                  "moe error: NaN in the router's weights");
    expect_status(gdn_moe_backward(p, dx, dw, x, w, NULL, dy, NULL), GDN_ERR_ARG, "saved", "moe error: backward without saved");
    free(saved), free(w), free(x), free(y), free(dy), free(dx), free(dw);
    gdn_moe_plan_destroy(p);
}

/* ---------------------------------------------------------------- 7. the aux loss */

static void moe_suite_aux(void) {
    rng_seed(31);
    gdn_moe_config c = gdn_moe_config_default(50, 16, 6, 2, 8, 0);
    const int64_t n = c.n_experts;
    float *w = moe_random_weights(&c, 4.0), *x = random_floats((size_t)(c.N * c.E));
    fast_out o, mutated;
    float *y = falloc(c.N * c.E);
    int rc = 0;
    /* the block's statistics, then the same with a token's choices counted for the wrong expert
     * (the control: a mutation of the count inside the block) */
    for (int m = 0; m < 2; m++) {
        fast_out *r = m ? &mutated : &o;
        test_mutation = m ? "moe: a token's choices counted for the next expert" : NULL;
        rc |= run_fast(&c, w, x, NULL, NULL, r);
        /* stats: two forwards of the same rows add up (as two layers' rows do) */
        gdn_moe_plan *p = NULL;
        rc |= gdn_moe_plan_create(&p, &c);
        rc |= gdn_moe_forward(p, y, NULL, x, w, r->stats, NULL, NULL);
        gdn_moe_plan_destroy(p);
        test_mutation = NULL;
    }
    check(!rc, "moe aux: forwards run");
    /* direct: counts from the routing, probabilities by a double softmax */
    double *st = dalloc(2 * n);
    for (int64_t i = 0; i < c.N * c.top_k; i++) st[o.sel[i]] += 2.0;
    const float *Wr = w + gdn_moe_param_offset(&c, GDN_MOE_ROUTER);
    for (int64_t t = 0; t < c.N; t++) {
        double l[64], mx = -INFINITY, s = 0.0;
        for (int64_t e = 0; e < n; e++) {
            l[e] = 0;
            for (int64_t i = 0; i < c.E; i++) l[e] += (double)Wr[e * c.E + i] * x[t * c.E + i];
            mx = fmax(mx, l[e]);
        }
        for (int64_t e = 0; e < n; e++) s += l[e] = exp(l[e] - mx);
        for (int64_t e = 0; e < n; e++) st[n + e] += 2.0 * l[e] / s;
    }
    expect_close(rel_err_dd(o.stats, st, n), 0.0, "moe aux: choice counts == direct counts");
    expect_close(rel_err_dd(o.stats + n, st + n, n), 1e-6, "moe aux: probability sums vs double softmax");
    expect_far(rel_err_dd(mutated.stats, st, n), 0.0,
               "moe aux control: a block counting each choice for the next expert: counts differ");
    fast_free(&mutated);

    const double R = 2.0 * (double)c.N, coef = 0.01;
    float *dp = falloc(n);
    const double aux = gdn_moe_aux(n, o.stats, R, coef, dp);
    double direct = 0.0;
    for (int64_t e = 0; e < n; e++) direct += (o.stats[e] / R) * (o.stats[n + e] / R);
    direct *= (double)n;
    expect_close(fabs(aux - direct) / direct, 1e-14, "moe aux: value vs n sum f_e P_e (%.6f)", aux);
    expect_far(fabs(aux - direct / (double)n) / direct, 1e-14, "moe aux control: without the factor n");
    /* d(coef aux)/d p_e(row) = coef d aux / d prob[e] (prob[e] sums p_e over the rows) */
    double err = 0.0, cerr = 0.0, sc = 0.0;
    for (int64_t e = 0; e < n; e++) {
        double s2[128];
        const double h = 1e-4;
        memcpy(s2, o.stats, sizeof(double) * 2 * (size_t)n);
        s2[n + e] += h;
        const double ap = gdn_moe_aux(n, s2, R, coef, NULL);
        s2[n + e] -= 2 * h;
        const double am = gdn_moe_aux(n, s2, R, coef, NULL);
        const double fd = coef * (ap - am) / (2 * h);
        memcpy(s2, o.stats, sizeof(double) * 2 * (size_t)n);
        s2[e] += h; /* the wrong variable: the count */
        const double cp = gdn_moe_aux(n, s2, R, coef, NULL);
        s2[e] -= 2 * h;
        const double cm = gdn_moe_aux(n, s2, R, coef, NULL);
        err = fmax(err, fabs(fd - dp[e])), cerr = fmax(cerr, fabs(coef * (cp - cm) / (2 * h) - dp[e]));
        sc = fmax(sc, fabs(fd));
    }
    expect_close(err / sc, 1e-6, "moe aux: aux_dp vs central differences in the probability sums");
    expect_far(cerr / sc, 1e-6, "moe aux control: differences in the counts instead");
    check(isnan(gdn_moe_aux(n, o.stats, 0.0, coef, NULL)) && strstr(gdn_errmsg(), "R"), "moe aux: R = 0 refused (%s)",
          gdn_errmsg());
    fast_free(&o);
    free(w), free(x), free(y), free(st), free(dp);
}

void test_moe(void) {
    moe_suite_errors();
    moe_suite_aux();
    moe_suite_fd();
    moe_suite_random();
    moe_suite_threads_bf16();
    moe_suite_golden();
}
