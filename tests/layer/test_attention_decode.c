/* The KV cache and decode of the gated attention layer (include/gdncp/attention.h, "decode with a
 * KV cache"), on transformers' layer 3 of tests/data/qwen35_tiny (x [2,150,96] of attn.io):
 *   1. prefill in pieces 37 + 64 + 1 + 1 + 13, then token by token to 150: y == gdn_attn_forward of
 *      the whole sequence and == transformers' y; the plans reused across steps keep their own
 *      RoPE table (a later forward with them is bit-identical to a fresh plan's);
 *   2. the cache then holds [B, Hkv, 150, d]: the keys after k_norm and RoPE and the raw values,
 *      against a double computation of both (DESIGN §10) and against the forward's own keys;
 *   3. pos_offset: x_off at positions 1000..1063 in pieces == transformers' y_off, and the cached
 *      keys are those of positions 1000 + t;
 *   4. the key split (flash-decoding) of a long cache, B Hkv = 1 on 3 threads, pieces of 3 and 2
 *      tokens and single tokens: y == the forward, the number of key ranges as configured;
 *   5. bad input;
 *   6. a BF16 cache: bit for bit the F32 cache holding bf16-rounded keys and values.
 * Negative controls through the same comparisons: positions not continuing from the cache (a plan
 * with a wrong pos_offset, the cache length set back), the cache missing its last appended token,
 * the cached keys replaced by the keys before RoPE; for the cache itself, the keys before RoPE and
 * the token-major layout. */
#include "harness.h"
#include "attention_internal.h"

#include <math.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GOLDEN(name) GDN_GOLDEN_DIR "/" name

/* ---------------------------------------------------------------- helpers */

/* Keys (after k_norm, with RoPE when rope) and values of every token in double, [B, Hkv, T, d],
 * token t at position pos_offset + t: written from DESIGN §10, sharing no code with the layer. */
static void expected_kv(const gdn_attn_config *c, const float *x, const float *w, int rope, double *K, double *V) {
    const int64_t B = c->B, T = c->T, E = c->E, Hkv = c->Hkv, d = c->d, hr = c->R / 2;
    const float *wk = w + gdn_attn_param_offset(c, GDN_A_K_PROJ), *wv = w + gdn_attn_param_offset(c, GDN_A_V_PROJ);
    const float *nw = w + gdn_attn_param_offset(c, GDN_A_K_NORM);
    double *u = dalloc(d);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < Hkv; j++) {
                const float *xr = x + (b * T + t) * E;
                double *k = K + ((b * Hkv + j) * T + t) * d, *v = V + ((b * Hkv + j) * T + t) * d, ss = 0.0;
                for (int64_t i = 0; i < d; i++) {
                    double a = 0.0, s = 0.0;
                    for (int64_t e = 0; e < E; e++)
                        a += (double)xr[e] * wk[(j * d + i) * E + e], s += (double)xr[e] * wv[(j * d + i) * E + e];
                    u[i] = a, v[i] = s, ss += a * a;
                }
                const double r = 1.0 / sqrt(ss / (double)d + (double)c->eps);
                for (int64_t i = 0; i < d; i++) k[i] = u[i] * r * (1.0 + nw[i]);
                if (!rope) continue;
                const double p = (double)(c->pos_offset + t);
                for (int64_t i = 0; i < hr; i++) {
                    const double ang = p * pow(c->rope_theta, -2.0 * (double)i / (double)c->R);
                    const double a = k[i], bb = k[i + hr];
                    k[i] = a * cos(ang) - bb * sin(ang), k[i + hr] = bb * cos(ang) + a * sin(ang);
                }
            }
    free(u);
}

/* [B, Hkv, T, d] -> [B, T, Hkv, d] read as [B, Hkv, T, d]: the layout a cache must not have. */
static void token_major(const gdn_attn_config *c, const double *src, double *dst) {
    const int64_t B = c->B, T = c->T, Hkv = c->Hkv, d = c->d;
    for (int64_t b = 0; b < B; b++)
        for (int64_t j = 0; j < Hkv; j++)
            for (int64_t t = 0; t < T; t++)
                memcpy(dst + ((b * T + t) * Hkv + j) * d, src + ((b * Hkv + j) * T + t) * d, sizeof(double) * d);
}

/* Wrong variants applied before piece `piece` (0-based) of a decode run. */
typedef enum {
    OK = 0,
    WRONG_POS,  /* pieces after the first on plans with pos_offset + 3: positions not continuing */
    SET_BACK,   /* after the first piece, the cache length set back by 7 */
    DROP_LAST,  /* before the fourth piece, set_length(len - 1): the last appended token missing */
    UNROPED,    /* after the first piece, its cached keys replaced by the keys before RoPE */
} tamper_kind;
static const char *const tamper_name[] = {
    "", "decode plans with pos_offset + 3 (positions not continuing)", "cache length set back by 7 after the prefill",
    "set_length(len - 1) before the 4th piece (its last token missing)", "cached keys before RoPE",
};

/* Runs x [B, Ttot, E] (c: the whole sequence's config) through gdn_attn_decode in pieces of the
 * given sizes (summing to Ttot) into y [B, Ttot, E]; one plan per piece size, reused. unroped:
 * the keys before RoPE [B, Hkv, Ttot, d] (for UNROPED). Returns the first failing status. */
static int decode_pieces(const gdn_attn_config *c, const int64_t *sizes, int n, const float *x, const float *w,
                         gdn_attn_cache *cache, float *y, tamper_kind tk, const double *unroped) {
    enum { MAXP = 8 };
    gdn_attn_plan *plans[MAXP] = {0};
    int64_t plan_T[MAXP], plan_pos[MAXP];
    int np = 0, rc = GDN_OK;
    const int64_t B = c->B, Ttot = c->T, E = c->E;
    float *xb = falloc(B * Ttot * E), *yb = falloc(B * Ttot * E);
    int64_t t0 = 0;
    for (int i = 0; i < n && !rc; t0 += sizes[i], i++) {
        const int64_t Tp = sizes[i], pos = c->pos_offset + (tk == WRONG_POS && i > 0 ? 3 : 0);
        if (tk == SET_BACK && i == 1) gdn_attn_cache_set_length(cache, cache_view(cache).length - 7);
        if (tk == DROP_LAST && i == 3) gdn_attn_cache_set_length(cache, cache_view(cache).length - 1);
        if (tk == UNROPED && i == 1) {
            const int64_t cap = cache_view(cache).capacity, d = c->d;
            float *k = cache_keys(cache);
            for (int64_t bj = 0; bj < B * c->Hkv; bj++)
                for (int64_t t = 0; t < sizes[0]; t++)
                    for (int64_t e = 0; e < d; e++) k[(bj * cap + t) * d + e] = (float)unroped[(bj * Ttot + t) * d + e];
        }
        int k = 0;
        while (k < np && (plan_T[k] != Tp || plan_pos[k] != pos)) k++;
        if (k == np) {
            if (np == MAXP) {
                rc = GDN_ERR_ARG;
                break;
            }
            gdn_attn_config cp = *c;
            cp.T = Tp, cp.pos_offset = pos;
            if ((rc = gdn_attn_plan_create(&plans[np], &cp))) break;
            plan_T[np] = Tp, plan_pos[np] = pos, np++;
        }
        for (int64_t b = 0; b < B; b++)
            memcpy(xb + b * Tp * E, x + (b * Ttot + t0) * E, sizeof(float) * (size_t)(Tp * E));
        rc = gdn_attn_decode(plans[k], cache, yb, xb, w);
        for (int64_t b = 0; b < B; b++)
            memcpy(y + (b * Ttot + t0) * E, yb + b * Tp * E, sizeof(float) * (size_t)(Tp * E));
    }
    for (int k = 0; k < np; k++) gdn_attn_plan_destroy(plans[k]);
    free(xb), free(yb);
    return rc;
}

static int forward_whole(const gdn_attn_config *c, const float *x, const float *w, float *y, float *saved) {
    gdn_attn_plan *p = NULL;
    int rc = gdn_attn_plan_create(&p, c);
    if (!rc) rc = gdn_attn_forward(p, y, saved, x, w);
    gdn_attn_plan_destroy(p);
    return rc;
}

/* The golden layer: weights (fp32) of model.layers.3.self_attn and attn.io's tensors. */
typedef struct {
    gdn_attn_config c, co;      /* x [2,150,96]; x_off [1,64,96] at positions 1000.. */
    float *w, *x, *xo;
    double *y, *yo;             /* transformers' */
} golden_layer;

static int golden_load(golden_layer *g) {
    memset(g, 0, sizeof *g);
    gdn_st_file *fw = NULL, *io = NULL;
    if (gdn_st_open(&fw, GOLDEN("qwen35_tiny/model.safetensors")) ||
        gdn_st_open(&io, GOLDEN("qwen35_tiny/attn.io.safetensors"))) {
        check(0, "open qwen35_tiny attention golden files: %s", gdn_errmsg());
        gdn_st_close(fw);
        return 1;
    }
    /* config.json: hidden 96, 4 heads, 2 kv heads, head_dim 24, R = 6, rope_theta 1e4 */
    gdn_attn_config c = gdn_attn_config_default(2, 150, 96, 4, 2, 24);
    c.R = 6, c.rope_theta = 10000.0, c.eps = 1e-6f;
    g->c = c;
    const int64_t nx = c.B * c.T * c.E;
    const size_t nw = gdn_attn_param_floats(&c);
    g->w = falloc((int64_t)nw), g->x = falloc(nx), g->xo = falloc(64 * 96), g->y = dalloc(nx), g->yo = dalloc(64 * 96);
    double *tmp = dalloc(nx > (int64_t)nw ? nx : (int64_t)nw);
    int bad = 0;
    for (int p = 0; p < GDN_A_COUNT && !bad; p++) {
        char name[160];
        snprintf(name, sizeof name, "model.layers.3.self_attn.%s", gdn_attn_param_name(p));
        const size_t n = gdn_attn_param_numel(&c, p);
        bad = gdn_st_read_f64(fw, name, tmp, n);
        for (size_t i = 0; i < n; i++) g->w[gdn_attn_param_offset(&c, p) + i] = (float)tmp[i];
    }
    bad = bad || gdn_st_read_f64(io, "x", tmp, (size_t)nx) || gdn_st_read_f64(io, "y", g->y, (size_t)nx);
    for (int64_t i = 0; i < nx; i++) g->x[i] = (float)tmp[i];
    int64_t pos_off[64], np = 0;
    bad = bad || gdn_st_read_f64(io, "x_off", tmp, 64 * 96) || gdn_st_read_f64(io, "y_off", g->yo, 64 * 96) ||
          gdn_st_read_i64(io, "position_ids_off", pos_off, 64, &np) || np != 64 || pos_off[63] != pos_off[0] + 63;
    for (int64_t i = 0; i < 64 * 96; i++) g->xo[i] = (float)tmp[i];
    g->co = c;
    g->co.B = 1, g->co.T = 64, g->co.pos_offset = bad ? 0 : pos_off[0];
    if (bad) check(0, "read the golden layer 3 weights, x, y, x_off, y_off, position_ids_off: %s", gdn_errmsg());
    free(tmp);
    gdn_st_close(fw), gdn_st_close(io);
    return bad;
}

static void golden_free(golden_layer *g) { free(g->w), free(g->x), free(g->xo), free(g->y), free(g->yo); }

/* ---------------------------------------------------------------- 1 and 2: pieces == the forward */

static void pieces_case(const golden_layer *g) {
    const gdn_attn_config *c = &g->c;
    const int64_t B = c->B, T = c->T, E = c->E, Hkv = c->Hkv, d = c->d, nx = B * T * E, nkv = B * Hkv * T * d;
    int64_t sizes[160];
    int n = 0;
    const int64_t head[] = {37, 64, 1, 1, 13};
    int64_t sum = 0;
    for (size_t i = 0; i < sizeof head / sizeof head[0]; i++) sizes[n++] = head[i], sum += head[i];
    while (sum < T) sizes[n++] = 1, sum++;
    const double tol = 1e-5;
    float *yf = falloc(nx), *yd = falloc(nx), *yt = falloc(nx), *kc = falloc(nkv), *vc = falloc(nkv);
    double *Ke = dalloc(nkv), *Ve = dalloc(nkv), *K0 = dalloc(nkv), *tm = dalloc(nkv), *yfd = dalloc(nx);
    gdn_attn_plan *pf = NULL;
    expect_status(gdn_attn_plan_create(&pf, c), GDN_OK, NULL, "forward plan B=2 T=150");
    float *saved = falloc((int64_t)gdn_attn_saved_floats(pf));
    expect_status(gdn_attn_forward(pf, yf, saved, g->x, g->w), GDN_OK, NULL, "forward of the whole sequence");
    for (int64_t i = 0; i < nx; i++) yfd[i] = yf[i];
    gdn_attn_cache *cache = NULL;
    expect_status(gdn_attn_cache_create(&cache, B, Hkv, d, T, GDN_F32), GDN_OK, NULL, "cache [2, 2, 150, 24]");
    expect_status(decode_pieces(c, sizes, n, g->x, g->w, cache, yd, OK, NULL), GDN_OK, NULL,
                  "decode 37 + 64 + 1 + 1 + 13 + 34 x 1 tokens");
    check(cache_view(cache).length == T, "cache length %lld == 150 after the pieces",
          (long long)cache_view(cache).length);
    expect_close(rel_err_ff(yd, yf, nx), tol, "pieces y == forward y [2,150,96]");
    expect_close(rel_err_f32(yd, g->y, nx), tol, "pieces y == transformers' y");
    expect_close(rel_err_f32(yf, g->y, nx), tol, "forward y == transformers' y (the forward itself)");

    /* 2. the cache: [B, Hkv, 150, d] (capacity 150: the whole arrays) */
    expected_kv(c, g->x, g->w, 1, Ke, Ve);
    expected_kv(c, g->x, g->w, 0, K0, tm);
    const float *ck = cache_keys(cache), *cv = cache_values(cache);
    expect_close(rel_err_f32(ck, Ke, nkv), tol, "cached keys == k_norm + RoPE keys (double) [2,2,150,24]");
    expect_close(rel_err_f32(cv, Ve, nkv), tol, "cached values == raw v_proj values (double)");
    expect_far(rel_err_f32(ck, K0, nkv), tol, "cached keys vs the keys before RoPE");
    token_major(c, Ke, tm);
    expect_far(rel_err_f32(ck, tm, nkv), tol, "cached keys vs the keys token-major [B,T,Hkv,d]");
    token_major(c, Ve, tm);
    expect_far(rel_err_f32(cv, tm, nkv), tol, "cached values vs the values token-major");
    /* the forward's own keys (plan kr [N, Hkv d]) and values (saved projections), rearranged */
    const gdn_attn_saved sv = gdn_attn_saved_view(pf, saved);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < Hkv; j++) {
                const int64_t nrow = b * T + t, at = ((b * Hkv + j) * T + t) * d;
                memcpy(kc + at, pf->kr + nrow * pf->Kd + j * d, sizeof(float) * d);
                memcpy(vc + at, sv.proj + nrow * pf->P + 2 * pf->Hd + pf->Kd + j * d, sizeof(float) * d);
            }
    expect_close(rel_err_ff(ck, kc, nkv), tol, "cached keys == the forward's normed + rotated keys");
    expect_close(rel_err_ff(cv, vc, nkv), tol, "cached values == the forward's v projections");
    expect_far(rel_err_ff(ck, pf->kr, nkv), tol, "cached keys vs the forward's keys not rearranged");

    /* controls for 1: each wrong variant through the same two comparisons */
    for (int tk = WRONG_POS; tk <= UNROPED; tk++) {
        gdn_attn_cache_reset(cache);
        const int rc = decode_pieces(c, sizes, n, g->x, g->w, cache, yt, (tamper_kind)tk, K0);
        expect_status(rc, GDN_OK, NULL, "decode with %s runs", tamper_name[tk]);
        expect_far(rel_err_ff(yt, yf, nx), tol, "y vs forward with %s", tamper_name[tk]);
        expect_far(rel_err_f32(yt, g->y, nx), tol, "y vs transformers' with %s", tamper_name[tk]);
    }

    /* A plan used for decode keeps its own RoPE table: its forward is bit-identical to a fresh
     * plan's. Control: a plan whose table is for the positions decode used (pos_offset 1) differs. */
    {
        gdn_attn_config c64 = *c;
        c64.T = 64;
        gdn_attn_plan *used = NULL, *fresh = NULL, *shifted = NULL;
        gdn_attn_config cs = c64;
        cs.pos_offset = 1;
        gdn_attn_plan_create(&used, &c64), gdn_attn_plan_create(&fresh, &c64), gdn_attn_plan_create(&shifted, &cs);
        gdn_attn_cache_reset(cache);
        float *x64 = falloc(B * 64 * E), *ya = falloc(B * 64 * E), *yb = falloc(B * 64 * E), *yc = falloc(B * 64 * E);
        for (int64_t b = 0; b < B; b++) memcpy(x64 + b * 64 * E, g->x + b * T * E, sizeof(float) * 64 * E);
        float *y1 = falloc(B * E), *x1 = falloc(B * E);
        /* the used plan decodes positions 1..64 after one token */
        gdn_attn_plan *p1 = NULL;
        gdn_attn_config c1 = *c;
        c1.T = 1;
        gdn_attn_plan_create(&p1, &c1);
        for (int64_t b = 0; b < B; b++) memcpy(x1 + b * E, g->x + b * T * E, sizeof(float) * E);
        int rc = gdn_attn_decode(p1, cache, y1, x1, g->w);
        if (!rc) rc = gdn_attn_decode(used, cache, ya, x64, g->w);
        expect_status(rc, GDN_OK, NULL, "decode 1 + 64 tokens");
        gdn_attn_forward(used, ya, NULL, x64, g->w);
        gdn_attn_forward(fresh, yb, NULL, x64, g->w);
        gdn_attn_forward(shifted, yc, NULL, x64, g->w);
        check(!memcmp(ya, yb, sizeof(float) * (size_t)(B * 64 * E)),
              "forward on a plan that decoded == a fresh plan's, bit for bit (rel err %.3g)",
              rel_err_ff(ya, yb, B * 64 * E));
        check(memcmp(yc, yb, sizeof(float) * (size_t)(B * 64 * E)) != 0,
              "control: a plan at pos_offset 1 is not bit-identical (rel err %.3g)", rel_err_ff(yc, yb, B * 64 * E));
        check(!memcmp(used->cosv, fresh->cosv, sizeof(float) * 64 * 3) &&
                  memcmp(shifted->cosv, fresh->cosv, sizeof(float) * 64 * 3),
              "the used plan's cos table equals a fresh plan's (and differs from pos_offset 1's)");
        free(x64), free(ya), free(yb), free(yc), free(y1), free(x1);
        gdn_attn_plan_destroy(used), gdn_attn_plan_destroy(fresh), gdn_attn_plan_destroy(shifted);
        gdn_attn_plan_destroy(p1);
    }
    gdn_attn_cache_destroy(cache);
    gdn_attn_plan_destroy(pf);
    free(yf), free(yd), free(yt), free(kc), free(vc), free(Ke), free(Ve), free(K0), free(tm), free(yfd), free(saved);
}

/* ---------------------------------------------------------------- 3. pos_offset */

static void offset_case(const golden_layer *g) {
    const gdn_attn_config *c = &g->co; /* B = 1, T = 64, pos_offset 1000 */
    const int64_t T = c->T, E = c->E, nx = T * E, nkv = c->Hkv * T * c->d;
    int64_t sizes[64];
    int n = 0;
    sizes[n++] = 20, sizes[n++] = 7;
    for (int64_t s = 27; s < T; s++) sizes[n++] = 1;
    const double tol = 1e-5;
    float *y = falloc(nx), *yf = falloc(nx);
    double *Ke = dalloc(nkv), *Ve = dalloc(nkv), *K0 = dalloc(nkv);
    gdn_attn_cache *cache = NULL;
    gdn_attn_cache_create(&cache, 1, c->Hkv, c->d, T, GDN_F32);
    expect_status(decode_pieces(c, sizes, n, g->xo, g->w, cache, y, OK, NULL), GDN_OK, NULL,
                  "decode x_off 20 + 7 + 37 x 1 at pos_offset %lld", (long long)c->pos_offset);
    expect_status(forward_whole(c, g->xo, g->w, yf, NULL), GDN_OK, NULL, "forward x_off");
    expect_close(rel_err_f32(y, g->yo, nx), tol, "pieces y_off == transformers' y_off (positions %lld..%lld)",
                 (long long)c->pos_offset, (long long)(c->pos_offset + 63));
    expect_close(rel_err_ff(y, yf, nx), tol, "pieces y_off == forward y_off");
    expected_kv(c, g->xo, g->w, 1, Ke, Ve);
    gdn_attn_config c0 = *c;
    c0.pos_offset = 0;
    expected_kv(&c0, g->xo, g->w, 1, K0, Ve);
    expect_close(rel_err_f32(cache_keys(cache), Ke, nkv), tol, "cached keys at positions 1000 + t");
    expect_far(rel_err_f32(cache_keys(cache), K0, nkv), tol, "cached keys vs those at positions t");
    gdn_attn_cache_reset(cache);
    decode_pieces(c, sizes, n, g->xo, g->w, cache, y, WRONG_POS, NULL);
    expect_far(rel_err_f32(y, g->yo, nx), tol, "y_off with %s", tamper_name[WRONG_POS]);
    gdn_attn_cache_destroy(cache);
    free(y), free(yf), free(Ke), free(Ve), free(K0);
}

/* ---------------------------------------------------------------- 4. the key split */

static void split_case(void) {
    gdn_attn_config c = gdn_attn_config_default(1, 1300, 32, 4, 1, 16);
    c.R = 8, c.rope_theta = 1e4, c.threads = 3;
    const int64_t T = c.T, E = c.E, nx = T * E, P = 1200;
    rng_seed(4242);
    float *w = attn_random_weights(&c), *x = falloc(nx), *yf = falloc(nx), *y = falloc(nx);
    for (int64_t i = 0; i < nx; i++) x[i] = (float)rng_uniform(-2, 2);
    expect_status(forward_whole(&c, x, w, yf, NULL), GDN_OK, NULL, "forward B=1 T=1300 H=4 Hkv=1 d=16, 3 threads");
    int64_t sizes[200];
    int n = 0;
    sizes[n++] = P, sizes[n++] = 3, sizes[n++] = 2;
    for (int64_t s = P + 5; s < T; s++) sizes[n++] = 1;
    gdn_attn_cache *cache = NULL;
    gdn_attn_cache_create(&cache, 1, 1, 16, T, GDN_F32);
    const struct { int keys; int want; const char *what; } runs[] = {
        {0, 2, "default (>= 512 keys a range)"}, {64, 3, ">= 64 keys a range"}, {INT_MAX, -1, "no split"},
    };
    const double tol = 1e-5;
    test_threads_site = "attn_decode_split";
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        char site[64];
        snprintf(site, sizeof site, "attention decode: keys a range at least=%d", runs[r].keys);
        test_mutation = site;
        gdn_attn_cache_reset(cache);
        test_threads_seen = -1;
        expect_status(decode_pieces(&c, sizes, n, x, w, cache, y, OK, NULL), GDN_OK, NULL,
                      "decode 1200 + 3 + 2 + 95 x 1, split %s", runs[r].what);
        check(test_threads_seen == runs[r].want, "key ranges seen %d == %d, split %s", test_threads_seen, runs[r].want,
              runs[r].what);
        expect_close(rel_err_ff(y + P * E, yf + P * E, nx - P * E), tol, "decoded y == forward y (tokens 1200..1299), split %s",
                     runs[r].what);
        gdn_attn_cache_reset(cache);
        decode_pieces(&c, sizes, n, x, w, cache, y, DROP_LAST, NULL);
        expect_far(rel_err_ff(y + P * E, yf + P * E, nx - P * E), tol, "decoded y with %s, split %s",
                   tamper_name[DROP_LAST], runs[r].what);
    }
    /* a BF16 cache through the split (3 key ranges): the F32 cache rounding what it appends, bit for bit */
    gdn_attn_cache *cb = NULL;
    float *yb = falloc(nx);
    test_mutation = "attention decode: keys a range at least=64";
    gdn_attn_cache_reset(cache);
    test_threads_seen = -1;
    int rc = gdn_attn_cache_create(&cb, 1, 1, 16, T, 2);
    if (!rc) rc = decode_pieces(&c, sizes, n, x, w, cb, yb, OK, NULL);
    const int seen = test_threads_seen;
    test_mutation = "attention decode: keys a range at least=64,attention decode: the F32 cache rounds to bf16";
    if (!rc) rc = decode_pieces(&c, sizes, n, x, w, cache, y, OK, NULL);
    test_mutation = "attention decode: keys a range at least=64";
    long differ = 0;
    for (int64_t i = P * E; i < nx; i++) differ += memcmp(yb + i, y + i, 4) != 0;
    check(!rc && seen == 3 && differ == 0,
          "BF16 cache, split in %d key ranges: y == the F32 cache holding bf16-rounded keys and values, bit for bit (%ld differ)",
          seen, differ);
    expect_far(rel_err_ff(yb + P * E, yf + P * E, nx - P * E), 1e-7, "BF16 cache, split: y is not the F32 forward's (rounded)");
    gdn_attn_cache_destroy(cb);
    free(yb);
    test_threads_site = NULL;
    test_mutation = NULL;
    gdn_attn_cache_destroy(cache);
    free(w), free(x), free(yf), free(y);
}

/* ---------------------------------------------------------------- 5. sharp scores */

/* Scores that keep growing along the cache: q_norm and k_norm weights of 5 (the norms scale by
 * 1 + w = 6) make scores of std ~36, so a row's running max passes itself by more than the
 * core's lazy slack (8) in later key tiles and the output is rescaled there. Decoded one token
 * a time (after a 100-token prefill) with 8 query heads per kv head (a decode block of 8 rows:
 * the few-row path) and with 16 (16 rows: the tiled path), against the float64 layer.
 * Control: the same decode with the last appended token dropped. */
static void sharp_case(void) {
    for (int hq = 8; hq <= 16; hq += 8) {
        gdn_attn_config c = gdn_attn_config_default(1, 400, 32, hq, 1, 16);
        c.R = 8, c.rope_theta = 1e4, c.threads = 2;
        const int64_t T = c.T, E = c.E, nx = T * E, nw = (int64_t)gdn_attn_param_floats(&c);
        rng_seed(977 + hq);
        float *w = attn_random_weights(&c), *x = falloc(nx), *y = falloc(nx);
        for (int p = GDN_A_Q_NORM; p <= GDN_A_K_NORM; p++)
            for (size_t i = 0; i < gdn_attn_param_numel(&c, p); i++) w[gdn_attn_param_offset(&c, p) + i] = 5.0f;
        for (int64_t i = 0; i < nx; i++) x[i] = (float)rng_uniform(-2, 2);
        double *xd = dalloc(nx), *wd = dalloc(nw), *yd = dalloc(nx);
        for (int64_t i = 0; i < nx; i++) xd[i] = x[i];
        for (int64_t i = 0; i < nw; i++) wd[i] = w[i];
        int64_t sizes[301];
        int n = 0;
        sizes[n++] = 100;
        for (int64_t s = 100; s < T; s++) sizes[n++] = 1;
        gdn_attn_cache *cache = NULL;
        int rc = gdn_attn_cache_create(&cache, 1, 1, 16, T, GDN_F32);
        if (!rc) rc = gdn_attn_reference_forward(&c, yd, xd, wd);
        if (!rc) rc = decode_pieces(&c, sizes, n, x, w, cache, y, OK, NULL);
        expect_status(rc, GDN_OK, NULL, "sharp scores, H = %d, Hkv = 1: reference, decode 100 + 300 x 1", hq);
        const double tol = 2e-5;
        expect_close(rel_err_f32(y + 100 * E, yd + 100 * E, nx - 100 * E), tol,
                     "sharp scores (norm weights 5), %d rows a decode block: decoded y == float64 layer", hq);
        gdn_attn_cache_reset(cache);
        decode_pieces(&c, sizes, n, x, w, cache, y, DROP_LAST, NULL);
        expect_far(rel_err_f32(y + 100 * E, yd + 100 * E, nx - 100 * E), tol, "sharp scores, %d rows: y with %s", hq,
                   tamper_name[DROP_LAST]);
        gdn_attn_cache_destroy(cache);
        free(w), free(x), free(y), free(xd), free(wd), free(yd);
    }
}

/* ---------------------------------------------------------------- 6. a BF16 cache */

/* The golden layer decoded in pieces into a BF16 cache (gdn_attn_cache_create with GDN_BF16), with 3
 * threads and the key split on (64 keys a range), so the widened tiles go through every path:
 * y == the same decode into an F32 cache that rounds what it appends through bf16 (the test site
 * "attention decode: the F32 cache rounds to bf16"), bit for bit; against the F32 cache and transformers' y within BF16's
 * accuracy; its storage is bf16 (keys_bf16 = bf16 of the F32 cache's keys, exactly). Controls:
 * the F32 cache without rounding fails the bitwise check, and the BF16 y is not the F32 one. */
static void bf16_cache_case(const golden_layer *g) {
    gdn_attn_config c = g->c;
    c.threads = 3;
    const int64_t B = c.B, T = c.T, E = c.E, nx = B * T * E, d = c.d, Hkv = c.Hkv;
    float *yb = falloc(nx), *yr = falloc(nx), *yf = falloc(nx);
    const int64_t sizes[] = {37, 64, 1, 1, 13, 34};
    gdn_attn_cache *cb = NULL, *cf = NULL;
    const int made = gdn_attn_cache_create(&cb, B, Hkv, d, T, 2) == GDN_OK &&
                     gdn_attn_cache_create(&cf, B, Hkv, d, T, GDN_F32) == GDN_OK;
    check(made && cache_view(cb).dtype == 2 && cache_view(cf).dtype == 0 && !cache_keys(cb) &&
              cache_keys_bf16(cb) && cache_values_bf16(cb) && !cache_keys_bf16(cf),
          "a BF16 cache: dtype 2, bf16 storage only; an F32 cache: dtype 0, float storage only");
    if (!made) goto out;
    test_mutation = "attention decode: keys a range at least=64";
    int rc = decode_pieces(&c, sizes, 6, g->x, g->w, cb, yb, OK, NULL);
    test_mutation = "attention decode: keys a range at least=64,attention decode: the F32 cache rounds to bf16";
    if (!rc) rc = decode_pieces(&c, sizes, 6, g->x, g->w, cf, yr, OK, NULL);
    test_mutation = "attention decode: keys a range at least=64";
    gdn_attn_cache_reset(cf);
    if (!rc) rc = decode_pieces(&c, sizes, 6, g->x, g->w, cf, yf, OK, NULL);
    test_mutation = NULL;
    expect_status(rc, GDN_OK, NULL, "decode 37 + 64 + 1 + 1 + 13 + 34 into a BF16 cache and into F32 caches");
    if (rc) goto out;
    long differ = 0, differ_unrounded = 0, keys_differ = 0;
    for (int64_t i = 0; i < nx; i++)
        differ += memcmp(yb + i, yr + i, 4) != 0, differ_unrounded += memcmp(yb + i, yf + i, 4) != 0;
    const uint16_t *kb = cache_keys_bf16(cb);
    const float *kf = cache_keys(cf);
    for (int64_t i = 0; i < B * Hkv * T * d; i++) {
        const uint32_t u = (uint32_t)kb[i] << 16;
        float r;
        memcpy(&r, &u, 4);
        keys_differ += fabsf(r - kf[i]) > 0x1p-8f * fabsf(kf[i]); /* within half a bf16 ulp */
    }
    expect_close((double)differ, 0.0, "BF16 cache y == F32 cache holding bf16-rounded keys and values, bit for bit (%ld differ)",
                 differ);
    expect_far((double)differ_unrounded, 0.5, "BF16 cache y vs the F32 cache without rounding, bitwise (%ld differ)",
               differ_unrounded);
    expect_close((double)keys_differ, 0.0, "BF16 cache keys = the F32 cache's rounded to bf16 (%ld off)", keys_differ);
    const double e = rel_err_ff(yb, yf, nx);
    expect_close(e, 2e-2, "BF16 cache y vs F32 cache y (BF16's accuracy)");
    expect_far(e, 1e-7, "BF16 cache y is not the F32 cache's (the rounding happened)");
    expect_close(rel_err_f32(yb, g->y, nx), 2e-2, "BF16 cache y vs transformers' y");
    printf("    BF16 KV cache: y vs F32 cache %.2e, vs transformers %.2e\n", e, rel_err_f32(yb, g->y, nx));
    gdn_attn_cache *bad = NULL;
    expect_status(gdn_attn_cache_create(&bad, B, Hkv, d, T, 1), GDN_ERR_ARG, "neither F32", "an F64 cache: refused");
    check(!bad, "no cache returned for the refused dtype");
out:
    gdn_attn_cache_destroy(cb), gdn_attn_cache_destroy(cf);
    free(yb), free(yr), free(yf);
}

/* ---------------------------------------------------------------- 5. bad input */

static void errors(void) {
    gdn_attn_config c = gdn_attn_config_default(1, 1, 16, 4, 2, 8);
    const size_t nw = gdn_attn_param_floats(&c);
    float *x = falloc(16 * 2), *y = falloc(16 * 2), *w = falloc((int64_t)nw);
    gdn_attn_cache *cache = NULL, *bad = NULL;
    gdn_attn_plan *p = NULL, *q = NULL;
    expect_status(gdn_attn_cache_create(NULL, 1, 2, 8, 4, GDN_F32), GDN_ERR_ARG, "NULL", "cache_create(NULL) refused");
    expect_status(gdn_attn_cache_create(&bad, 0, 2, 8, 4, GDN_F32), GDN_ERR_SHAPE, "B = 0", "cache B = 0 refused");
    expect_status(gdn_attn_cache_create(&bad, 1, 2, 2000, 4, GDN_F32), GDN_ERR_SHAPE, "d = 2000", "cache d = 2000 refused");
    expect_status(gdn_attn_cache_create(&bad, 1, 2, 8, 0, GDN_F32), GDN_ERR_SHAPE, "capacity = 0", "cache capacity 0 refused");
    check(!bad, "no cache returned on an error");
    check(cache_view(NULL).length == 0 && cache_keys(NULL) == NULL && cache_values(NULL) == NULL,
          "accessors of a NULL cache: 0, NULL");
    expect_status(gdn_attn_cache_create(&cache, 1, 2, 8, 4, GDN_F32), GDN_OK, NULL, "cache [1, 2, 4, 8] (control)");
    expect_status(gdn_attn_cache_set_length(cache, 5), GDN_ERR_ARG, "capacity = 4", "set_length(5) of 4 refused");
    expect_status(gdn_attn_cache_set_length(cache, -1), GDN_ERR_ARG, "out of range", "set_length(-1) refused");
    expect_status(gdn_attn_cache_set_length(NULL, 0), GDN_ERR_ARG, "NULL", "set_length of NULL refused");
    gdn_attn_plan_create(&p, &c);
    expect_status(gdn_attn_decode(p, cache, y, x, w), GDN_OK, NULL, "a decode step of zeros (control)");
    check(cache_view(cache).length == 1, "length 1 after it");
    expect_status(gdn_attn_decode(NULL, cache, y, x, w), GDN_ERR_ARG, "plan is NULL", "NULL plan refused");
    expect_status(gdn_attn_decode(p, NULL, y, x, w), GDN_ERR_ARG, "cache is NULL", "NULL cache refused");
    expect_status(gdn_attn_decode(p, cache, NULL, x, w), GDN_ERR_ARG, "'y'", "NULL y refused");
    expect_status(gdn_attn_decode(p, cache, y, NULL, w), GDN_ERR_ARG, "'x'", "NULL x refused");
    expect_status(gdn_attn_decode(p, cache, y, x, NULL), GDN_ERR_ARG, "'w'", "NULL w refused");
    x[5] = NAN;
    expect_status(gdn_attn_decode(p, cache, y, x, w), GDN_ERR_NONFINITE, "'x'", "NaN in x refused");
    x[5] = 0.0f;
    w[gdn_attn_param_offset(&c, GDN_A_V_PROJ) + 2] = INFINITY;
    /* a step checks x and its y (not every weight per token); a prefill piece names the weight */
    expect_status(gdn_attn_decode(p, cache, y, x, w), GDN_ERR_NONFINITE, "'y'", "Inf in v_proj: a decode step's y refused");
    {
        gdn_attn_config c2 = c;
        c2.T = 2;
        gdn_attn_plan *p2 = NULL;
        float *x2 = falloc(2 * c.E), *y2 = falloc(2 * c.E);
        gdn_attn_plan_create(&p2, &c2);
        expect_status(gdn_attn_decode(p2, cache, y2, x2, w), GDN_ERR_NONFINITE, "v_proj.weight",
                      "Inf in v_proj: a prefill piece of 2 refused, naming it");
        gdn_attn_plan_destroy(p2);
        free(x2), free(y2);
    }
    w[gdn_attn_param_offset(&c, GDN_A_V_PROJ) + 2] = 0.0f;
    check(cache_view(cache).length == 1, "length still 1 after the refused calls");
    const struct { int64_t B, Hkv, d; const char *needle, *what; } shapes[] = {
        {2, 2, 8, "B = 2", "a cache of B = 2 for a B = 1 plan"},
        {1, 1, 8, "Hkv = 1", "a cache of Hkv = 1 for Hkv = 2"},
        {1, 2, 16, "d = 16", "a cache of d = 16 for d = 8"},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        gdn_attn_cache_create(&bad, shapes[i].B, shapes[i].Hkv, shapes[i].d, 4, GDN_F32);
        expect_status(gdn_attn_decode(p, bad, y, x, w), GDN_ERR_SHAPE, shapes[i].needle, "%s refused", shapes[i].what);
        gdn_attn_cache_destroy(bad), bad = NULL;
    }
    gdn_attn_cache_set_length(cache, 4);
    expect_status(gdn_attn_decode(p, cache, y, x, w), GDN_ERR_SHAPE, "capacity 4", "a full cache (4 of 4) refused");
    check(cache_view(cache).length == 4, "a full cache keeps its length");
    gdn_attn_cache_set_length(cache, 3);
    expect_status(gdn_attn_decode(p, cache, y, x, w), GDN_OK, NULL, "the last free position decodes (control)");
    /* a piece of T = 2 into one free position */
    gdn_attn_config c2 = c;
    c2.T = 2;
    gdn_attn_plan_create(&q, &c2);
    gdn_attn_cache_set_length(cache, 3);
    expect_status(gdn_attn_decode(q, cache, y, x, w), GDN_ERR_SHAPE, "T = 2 more", "T = 2 into 1 free position refused");
    gdn_attn_plan_destroy(q), q = NULL;
    /* max_position: positions pos_offset + len .. must stay below it */
    gdn_attn_config cm = c;
    cm.max_position = 6, cm.pos_offset = 3;
    gdn_attn_plan_create(&q, &cm);
    gdn_attn_cache_set_length(cache, 2);
    expect_status(gdn_attn_decode(q, cache, y, x, w), GDN_OK, NULL, "position 5 with max_position 6 (control)");
    expect_status(gdn_attn_decode(q, cache, y, x, w), GDN_ERR_ARG, "max_position = 6", "position 6 with max_position 6 refused");
    gdn_attn_plan_destroy(q), q = NULL;
    /* packed and shard plans */
    const int64_t cu[3] = {0, 1, 2};
    gdn_attn_config cp = c2;
    cp.cu_seqlens = cu, cp.n_docs = 2;
    gdn_attn_plan_create(&q, &cp);
    gdn_attn_cache_reset(cache);
    expect_status(gdn_attn_decode(q, cache, y, x, w), GDN_ERR_ARG, "packed", "a packed plan refused");
    gdn_attn_plan_destroy(q), q = NULL;
    gdn_attn_config cs = c;
    cs.seq_offset = 4;
    gdn_attn_plan_create(&q, &cs);
    expect_status(gdn_attn_decode(q, cache, y, x, w), GDN_ERR_ARG, "seq_offset = 4", "a CP shard plan refused");
    gdn_attn_plan_destroy(q);
    gdn_attn_plan_destroy(p);
    gdn_attn_cache_destroy(cache);
    free(x), free(y), free(w);
}

void test_attn_decode(void) {
    golden_layer g;
    if (!golden_load(&g)) {
        pieces_case(&g);
        offset_case(&g);
        bf16_cache_case(&g);
    }
    golden_free(&g);
    split_case();
    sharp_case();
    errors();
}
