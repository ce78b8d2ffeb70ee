/* The next token from logits (include/gdncp/sample.h): greedy, or softmax(logits / T) restricted
 * to the top_k largest logits and then to the top_p nucleus, drawn with xorshift64*.
 *
 * Sampling runs in double: p_i = exp((l_i - l_max) / T) over the kept logits, summed in index
 * order, one uniform u in [0, 1) scaled by the sum, and the first index at which the running
 * subtraction reaches 0 wins. The cuts are logit values (the k-th largest; the smallest logit of
 * the nucleus), so ties at a cut are always kept, whatever order the selection saw them in. */
#include "gdncp/sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base.h"

gdn_sampling gdn_sampling_default(void) { return (gdn_sampling){.temperature = 0, .top_k = 0, .top_p = 1}; }

int gdn_sampling_check(const gdn_sampling *s, int64_t vocab) {
    if (!s) return gdn_fail(GDN_ERR_ARG, "sampling: the settings pointer is NULL");
    if (vocab < 1) return gdn_fail(GDN_ERR_ARG, "sampling: vocab = %lld (>= 1)", (long long)vocab);
    if (!(s->temperature >= 0) || !isfinite(s->temperature))
        return gdn_fail(GDN_ERR_ARG, "sampling: temperature = %g (a finite value >= 0; 0 is greedy)", s->temperature);
    if (s->top_k < 0) return gdn_fail(GDN_ERR_ARG, "sampling: top_k = %lld (>= 0; 0 keeps all)", (long long)s->top_k);
    if (!(s->top_p > 0 && s->top_p <= 1))
        return gdn_fail(GDN_ERR_ARG, "sampling: top_p = %g (in (0, 1]; 1 keeps all)", s->top_p);
    return GDN_OK;
}

uint64_t gdn_sample_seed(uint64_t seed) {
    const uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    return s ? s : 0x9e3779b97f4a7c15ull; /* xorshift never leaves 0 */
}

/* xorshift64*: a uniform double in [0, 1) */
static double next_uniform(uint64_t *s) {
    *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
    return (double)((*s * 0x2545f4914f6cdd1dull) >> 11) * 0x1.0p-53;
}

static int top_k_cuts(const gdn_sampling *s, int64_t vocab) { return s->top_k > 0 && s->top_k < vocab; }

int64_t gdn_sample_work_floats(const gdn_sampling *s, int64_t vocab) {
    if (!s || s->temperature <= 0 || vocab < 1) return 0;
    return top_k_cuts(s, vocab) || s->top_p < 1 ? vocab : 0;
}

/* The k-th largest value (k in 1..n) of a[0..n), a reordered: quickselect with a three-way
 * partition (many equal logits stay linear). */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n; /* the answer is in a[lo..hi), the k-th largest there */
    for (;;) {
        if (hi - lo == 1) return a[lo];
        const float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi - 1];
        const float p = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y)); /* median */
        /* [lo, gt) > p, [gt, i) == p, [lt, hi) < p */
        int64_t gt = lo, i = lo, lt = hi;
        while (i < lt) {
            const float v = a[i];
            if (v > p) a[i] = a[gt], a[gt++] = v, i++;
            else if (v < p) a[i] = a[--lt], a[lt] = v;
            else i++;
        }
        if (k <= gt - lo) hi = gt;
        else if (k <= i - lo) return p;
        else k -= i - lo, lo = i;
    }
}

static int descending(const void *a, const void *b) {
    const float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

int gdn_sample_next(int64_t *token, const float *logits, int64_t vocab, const gdn_sampling *s, uint64_t *rng,
                    float *work) {
    if (!token || !logits || !rng) return gdn_fail(GDN_ERR_ARG, "sampling: token, logits and rng must not be NULL");
    int rc = gdn_sampling_check(s, vocab);
    if (rc) return rc;
    const int64_t nw = gdn_sample_work_floats(s, vocab);
    if (nw && !work)
        return gdn_fail(GDN_ERR_ARG, "sampling: top_k %lld / top_p %g need a workspace of %lld floats (work is NULL)",
                        (long long)s->top_k, s->top_p, (long long)nw);
    int64_t best = 0;
    for (int64_t i = 0; i < vocab; i++) {
        if (isnan(logits[i])) return gdn_fail(GDN_ERR_NONFINITE, "sampling: logit %lld is NaN", (long long)i);
        best = logits[i] > logits[best] ? i : best;
    }
    *token = best;
    if (s->temperature <= 0) return GDN_OK;
    const double u01 = next_uniform(rng), mx = logits[best], T = s->temperature;
    if (!isfinite(mx)) return GDN_OK; /* +inf: the first of them; all -inf: token 0 */
    float cut = -INFINITY;
    if (top_k_cuts(s, vocab)) {
        memcpy(work, logits, sizeof(float) * (size_t)vocab);
        cut = kth_largest(work, vocab, s->top_k);
    }
    if (s->top_p < 1) { /* the nucleus of what top_k kept: its largest logits, in descending order */
        int64_t m = 0;
        for (int64_t i = 0; i < vocab; i++)
            if (logits[i] >= cut) work[m++] = logits[i];
        qsort(work, (size_t)m, sizeof(float), descending);
        double total = 0, acc = 0;
        for (int64_t i = 0; i < m; i++) total += exp(((double)work[i] - mx) / T);
        for (int64_t i = 0; i < m; i++) {
            acc += exp(((double)work[i] - mx) / T);
            if (acc >= s->top_p * total) {
                cut = work[i];
                break;
            }
        }
    }
    double sum = 0;
    for (int64_t i = 0; i < vocab; i++)
        if (logits[i] >= cut) sum += exp(((double)logits[i] - mx) / T);
    double u = u01 * sum;
    for (int64_t i = 0; i < vocab; i++) {
        if (!(logits[i] >= cut)) continue;
        const double p = exp(((double)logits[i] - mx) / T);
        if ((u -= p) <= 0 && p > 0) {
            *token = i;
            return GDN_OK;
        }
    }
    return GDN_OK; /* rounding left u above 0: the most likely token */
}
