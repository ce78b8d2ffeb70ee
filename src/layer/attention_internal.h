/* Internals of the gated attention layer shared by its files: the plan, the phases of the
 * forward and backward (row-local work around the core), and the flash-style core over a
 * "view" (queries of this call against any block of keys: the call's own, an earlier rank's,
 * a KV cache, the head-parallel layout), so that one core serves every path. */
#ifndef GDNCP_ATTENTION_INTERNAL_H
#define GDNCP_ATTENTION_INTERNAL_H

#include "layer_internal.h"

/* ---------------------------------------------------------------- documents */

/* The document of global token t in cu[0..n] (NULL: one document): its first token, and the
 * token after its last (dense: INT64_MAX). Binary search, so no per-token table is needed for
 * a stream longer than this call. */
static inline int64_t gdn_attn_doc_begin(const int64_t *cu, int64_t n, int64_t t) {
    if (!cu) return 0;
    int64_t lo = 0, hi = n; /* cu[lo] <= t < cu[hi] */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (cu[mid] <= t) lo = mid; else hi = mid;
    }
    return cu[lo];
}
static inline int64_t gdn_attn_doc_end(const int64_t *cu, int64_t n, int64_t t) {
    if (!cu) return INT64_MAX;
    int64_t lo = 0, hi = n;
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (cu[mid] <= t) lo = mid; else hi = mid;
    }
    return cu[hi];
}

/* ---------------------------------------------------------------- the core over a view */

/* Keys or values (or their gradients): kv head j, key u (0-based in the block) of batch row b at
 * p + b bs + j hs + u ld. Token-major [B, T, Hkv, d]: ld = Hkv d, hs = d, bs = T ld; a cache
 * [B, Hkv, cap, d]: ld = d, hs = cap d, bs = Hkv hs. */
typedef struct {
    float *p;
    int64_t ld, hs, bs;
} gdn_attn_kv;

/* The core's key tiles (keys of a tile, aligned to the view's first key) and its lazy running
 * max: a row's max moves only when a tile's scores exceed it by more than GDN_ATTN_LAZY_MAX
 * (natural log), so the probabilities are up to e^8 times their normalised values, the sum up to
 * e^8 T, far inside fp32, and the output, rescaled only then, is rescaled far less often. The
 * BF16 oracle (attention_reference.c) follows both: they fix where the core rounds P. */
#define GDN_ATTN_KEY_TILE 64
#define GDN_ATTN_LAZY_MAX 8.0f

/* Queries (b, t, h) of this view are token-major: Q, O, dO, dQ at (b nq + t) qld + h d; the
 * log-sum-exp and D = <dO, O> at (b nq + t) H + h. Query t has global index q0 + t, key u global
 * index k0 + u; query t sees key u when k0 + u <= q0 + t and both lie in one document of cu
 * (global offsets). Query head h reads kv head h / (H / Hkv). */
typedef struct {
    int64_t B, H, Hkv, d;
    const float *Q;
    int64_t nq, q0, qld;
    int64_t nk, k0;
    gdn_attn_kv K, V;
    const uint16_t *Kb, *Vb; /* instead of K.p, V.p (then NULL), with their strides: bf16 keys and
                                values (a BF16 KV cache; the forward only) */
    const int64_t *cu;
    int64_t n_docs;
    int threads;
    int bf16;    /* nonzero (cfg.compute BF16): the products of blocks of more than a few rows take
                    bf16 operands (attention_core.c, "BF16"); fp32 views only */
    float *tile; /* threads x gdn_attn_tile_floats(d, bf16) */
} gdn_attn_core;

/* One thread's tile (bf16: with the BF16 products' rows and packed operands). */
size_t gdn_attn_tile_floats(int64_t d, int bf16);
/* o, lse of the queries against this view's keys (overwritten): o normalised, lse = -inf and o =
 * 0 for a query that sees none of them. */
GDN_WING void gdn_attn_core_forward(const gdn_attn_core *v, float *o, float *lse);
/* Fold a second partial result (o2, lse2 over other keys) into (o, lse): the exact softmax over
 * the union, rows*H entries of d. */
GDN_WING void gdn_attn_merge(int64_t rows, int64_t H, int64_t d, int64_t qld, float *o, float *lse, const float *o2,
                    const float *lse2, int threads);
/* Backward with the final lse and D of every query: dq += its gradient through these keys;
 * dk, dv (laid out like K, V) += the keys' and values' gradients from these queries. */
GDN_WING void gdn_attn_core_backward_q(const gdn_attn_core *v, const float *dO, const float *lse, const float *D, float *dq);
GDN_WING void gdn_attn_core_backward_kv(const gdn_attn_core *v, const float *dO, const float *lse, const float *D,
                               gdn_attn_kv dk, gdn_attn_kv dv);
/* Both at once (dq += and dk, dv +=, exactly as the two calls above give): one pass when the
 * B Hkv (batch row, kv head) jobs keep the threads busy, else the two calls. */
void gdn_attn_core_backward(const gdn_attn_core *v, const float *dO, const float *lse, const float *D, float *dq,
                            gdn_attn_kv dk, gdn_attn_kv dv);
/* The core's path (tile sizes, the backward's schedule, the micro-kernel) for a view; NULL: the
 * default's. For benchmarks. */
const char *gdn_attn_core_path(const gdn_attn_core *v);

/* ---------------------------------------------------------------- the plan */

/* Rows are N = B*T tokens. A projection row holds [q_proj out (2Hd, interleaved) | k (Kd) | v (Kd)]. */
struct gdn_attn_plan {
    gdn_attn_config cfg;
    int threads;
    int64_t N, Hd, Kd, P;
    size_t param_off[GDN_A_COUNT + 1]; /* gdn_attn_param_offset of each tensor, once */
    int64_t *cu;              /* own copy of cu_seqlens (NULL: dense) */
    int64_t cu_cap;           /* its capacity in offsets (gdn_attn_plan_set_docs grows it) */
    float *cosv, *sinv;       /* T x R/2: cos/sin of each token's angles (gdn_attn_rope_table) */
    float *saved;             /* the forward's kept floats when the caller keeps none */
    float *qr, *kr, *rq, *rk; /* normed and rotated q [N, Hd], k [N, Kd]; rstd [N, H], [N, Hkv] */
    float *z, *dO, *Dv;       /* gated output (then its gradient) [N, Hd]; dO [N, Hd]; <dO, o> [N, H] */
    float *dqr, *dkr, *dproj; /* [N, Hd], [N, Kd], [N, P] */
    float *tile, *partial, *mm_ws;
    void *arena;
};

/* cos/sin [T, R/2] of the plan's tokens into cosv, sinv: dense, token t at position base + t
 * (the plan's own table: base = pos_offset + seq_offset); packed, at its place in its document
 * (base unused). The one place the angles are computed. */
void gdn_attn_rope_table(const gdn_attn_plan *ap, int64_t base, float *cosv, float *sinv);


/* What the forward keeps: the projections [N, P], the core's output o [N, Hd], lse [N, H]. */
typedef struct {
    float *proj, *o, *lse;
} gdn_attn_saved;
GDN_WING gdn_attn_saved gdn_attn_saved_view(const gdn_attn_plan *ap, float *saved);

/* ---------------------------------------------------------------- the KV cache (attention_decode.c) */

struct gdn_attn_cache {
    int64_t B, Hkv, d, cap, len;
    int dtype;          /* GDN_F32 (0) or GDN_BF16 (2) */
    float *k, *v;       /* [B, Hkv, cap, d] each (F32) */
    uint16_t *kb, *vb;  /* likewise (BF16) */
};

/* The phases of a decode call, shared with the CP decode:
 * decode_check: the plan (dense, seq_offset 0), the cache's shape, room for T more when this
 *   call appends, positions below max_position after len_total cached tokens, NULLs, NaN/Inf (x;
 *   the weights too when T > 1: a step leaves them to its y check);
 * decode_project: projections, norms and RoPE of the T new tokens at positions base + t;
 * cache_append: their keys and values at the cache's end (the length is not changed);
 * decode_attend: the new queries (global index q0 + t) against the first nk cached keys (global
 *   index k0 + u), into o and lse (split over idle threads when that helps). */
GDN_WING int gdn_attn_decode_check(const gdn_attn_plan *ap, const gdn_attn_cache *cache, const float *y, const float *x,
                          const float *w, int64_t len_total, int appends);
GDN_WING void gdn_attn_decode_project(gdn_attn_plan *ap, gdn_attn_saved sv, const float *x, const float *w, int64_t base);
GDN_WING void gdn_attn_cache_append(gdn_attn_plan *ap, gdn_attn_cache *cache, const float *proj);
/* Undo an append of T tokens that the call then refused (its y not finite): positions
 * [len, len + T) back to zeros, so the positions past the length stay as they were. */
GDN_WING void gdn_attn_cache_unappend(gdn_attn_cache *cache, int64_t T);
GDN_WING void gdn_attn_decode_attend(gdn_attn_plan *ap, const gdn_attn_cache *cache, int64_t nk, int64_t q0, int64_t k0,
                            float *o, float *lse);

/* The core over this call's own queries and keys (the single-rank attention). */
GDN_WING gdn_attn_core gdn_attn_local_view(const gdn_attn_plan *ap, const float *proj);

/* Phases, shared by the single-rank, CP and cache paths:
 * check_inputs: NULLs and NaN/Inf of x and the weights;
 * project: sv.proj from x; norm_rope: qr, kr (and their rstd) from sv.proj;
 * finish: z = o sigmoid(gate), y = z o_proj^T;
 * backward_restore: the forward's tensors for a backward: from saved (KEEP_CORE: the projections
 *   again), or, saved NULL, the projections into the plan's buffer (the caller then recomputes
 *   the core's o and lse); norms and RoPE in both cases;
 * backward_gate: z, then dw[o_proj], dO, dgate (into dproj), Dv from dy; dqr, dkr and dproj's v
 *   columns zeroed for the core's backward to add into;
 * backward_finish: the norms, RoPE and projections from dqr, dkr and dproj's v and gate columns:
 *   dx, and dw of everything but o_proj. */
GDN_WING int gdn_attn_check_inputs(const gdn_attn_plan *ap, const float *x, const float *w);
GDN_WING void gdn_attn_project(gdn_attn_plan *ap, float *proj, const float *x, const float *w);
GDN_WING void gdn_attn_norm_rope(gdn_attn_plan *ap, const float *proj, const float *w);
GDN_WING void gdn_attn_finish(gdn_attn_plan *ap, float *y, gdn_attn_saved sv, const float *w);
GDN_WING gdn_attn_saved gdn_attn_backward_restore(gdn_attn_plan *ap, const float *saved, const float *x, const float *w);
GDN_WING void gdn_attn_backward_gate(gdn_attn_plan *ap, float *dw, gdn_attn_saved sv, const float *w, const float *dy);
GDN_WING void gdn_attn_backward_finish(gdn_attn_plan *ap, float *dx, float *dw, gdn_attn_saved sv, const float *x,
                              const float *w);

#endif
