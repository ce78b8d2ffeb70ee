/* gdncp gen: write a random gated-delta-rule problem (q, k, v, g, beta, h0, do, dht) in the
 * layouts `gdncp run` reads, with gates g = -exp(A_log) softplus(a_t + dt_bias) (DESIGN §5).
 *
 * --gates qwen (default): like a trained Qwen3.5 layer's, per value head an A = exp(A_log) and a
 *   dt_bias spread from fast to very slow decay, a_t small noise per token. The last
 *   round(--slow-fraction * Hv) heads (default 0.25, at least one when the fraction is > 0) are
 *   slow: mean g from -1e-4 down to -1e-5, so they keep memory over 1e5 tokens; the others go
 *   log-evenly from mean g = -1 (forgets within a few tokens) to -1e-3. With such heads the state
 *   carried across the ranks of a split run changes every shard's outputs measurably.
 * --gates mild: the earlier default, A uniform in [0.05, 1], dt_bias = 1, mean g about -0.12
 *   (same random stream as before, so the same files).
 * --gates strong: A uniform in [1, 16] as at Qwen's initialisation, mean g about -2.
 * beta = sigmoid of small noise in every case.
 * --cu-seqlens 0,a,...,T: a packed stream of documents (B = 1): the offsets are written as an I64
 *   tensor 'cu_seqlens', and h0, dht are per document, [N_docs, Hv, K, V]; q, k, v, g, beta and do
 *   are the dense problem's of the same seed. */
#include "cli/cli.h"
#include "commands.h"
#include "cli/parse.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double unif(uint64_t *s) {
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return (double)(*s >> 11) / 9007199254740992.0;
}

typedef struct {
    const char *out;
    int64_t B, T, Hk, Hv, K, V, seed;
    int gates; /* an index into gate_names */
    double slow_fraction;
    int64_t *cu, n_cu;
} gen_opts;

static const char *const gate_names[] = {"qwen", "mild", "strong"};

static void gen_init(void *p) {
    gen_opts *o = p;
    o->B = 1, o->T = 4096, o->Hk = 2, o->Hv = 4, o->K = 128, o->V = 128, o->seed = 1, o->slow_fraction = 0.25;
}

/* the sizes' bounds: the kernel's head dims; a B*T*H*D product that cannot fit in memory is
 * refused afterwards, before anything is allocated */
static const cli_opt gen_table[] = {
    {CLI_STR("--out", gen_opts, out, "F", "the file to write"), .req = 1},
    {CLI_I64("--B", gen_opts, B, 1, 1 << 20, "N", "batch rows")},
    {CLI_I64("--T", gen_opts, T, 1, (int64_t)1 << 40, "N", "tokens")},
    {CLI_I64("--Hk", gen_opts, Hk, 1, 1 << 16, "N", "key heads")},
    {CLI_I64("--Hv", gen_opts, Hv, 1, 1 << 16, "N", "value heads (a multiple of Hk)")},
    {CLI_I64("--K", gen_opts, K, 1, GDN_MAX_HEAD_DIM, "N", "key head width")},
    {CLI_I64("--V", gen_opts, V, 1, GDN_MAX_HEAD_DIM, "N", "value head width")},
    {CLI_I64("--seed", gen_opts, seed, 0, INT64_MAX, "S", "the random stream")},
    {CLI_ENUM("--gates", gen_opts, gates, "qwen|mild|strong", NULL, "the gates' decays: qwen like a trained Qwen3.5 layer's per head, mild (mean g about -0.12), strong (about -2)")},
    {CLI_F64("--slow-fraction", gen_opts, slow_fraction, 0.0, 1.0, "F", "with --gates qwen: the fraction of value heads that are slow (remembering over 1e5 tokens)")},
    {CLI_LIST("--cu-seqlens", gen_opts, cu, n_cu, "0,a,..,T", "packed documents (B = 1): also write them, h0 and dht per document")},
};

const cli_command cmd_gen_cli = {
    .name = "gen",
    .usage = "usage: gdncp gen --out FILE [options]\n",
    .summary = "write a random problem (q k v g beta h0 do dht) for gdncp run",
    .about = "  a random gated-delta-rule problem (q k v g beta h0 do dht) for gdncp run\n",
    .size = sizeof(gen_opts), .init = gen_init, CLI_OPTS(gen_table),
};

static int gen_with(const gen_opts *o);

int cmd_gen(int argc, char **argv) {
    gen_opts o;
    int rc = cli_parse(&cmd_gen_cli, argc, argv, &o, NULL);
    if (!rc) rc = gen_with(&o);
    cli_free(&cmd_gen_cli, &o);
    return rc;
}

static int gen_with(const gen_opts *o) {
    const int64_t B = o->B, T = o->T, Hk = o->Hk, Hv = o->Hv, K = o->K, V = o->V, seed = o->seed, n_cu = o->n_cu;
    const char *out = o->out, *gates = gate_names[o->gates];
    const double slow_fraction = o->slow_fraction;
    int64_t *const *cu = &o->cu;
    gdn_config c = gdn_config_default(B, T, Hk, Hv, K, V);
    if (*cu) c.cu_seqlens = *cu, c.n_docs = n_cu - 1; /* the library names bad offsets */
    if (*cu && n_cu < 2) {
        fprintf(stderr, "gdncp gen: --cu-seqlens needs at least two offsets (0 and T: one document), got %lld\n",
                (long long)n_cu);
        return 1;
    }
    int rc = gdn_config_check(&c);
    if (rc) return cli_error("gen", rc);
    if (*cu && (*cu)[n_cu - 1] != T) {
        fprintf(stderr, "gdncp gen: --cu-seqlens must end at T = %lld, it ends at %lld\n", (long long)T,
                (long long)(*cu)[n_cu - 1]);
        return 1;
    }
    const int64_t state_rows = *cu ? n_cu - 1 : B; /* per document when packed */
    const int64_t nqk = B * T * Hk * K, nv = B * T * Hv * V, ng = B * T * Hv, ns = state_rows * Hv * K * V;
    /* every tensor is made in memory before the file is written */
    if ((rc = gdn_check_fits("the problem's tensors", 4.0 * (2.0 * nqk + 2.0 * nv + 2.0 * ng + 2.0 * ns))))
        return cli_error("gen", rc);
    float *q = malloc(sizeof(float) * nqk), *k = malloc(sizeof(float) * nqk), *v = malloc(sizeof(float) * nv),
          *dout = malloc(sizeof(float) * nv), *g = malloc(sizeof(float) * ng), *beta = malloc(sizeof(float) * ng),
          *h0 = malloc(sizeof(float) * ns), *dht = malloc(sizeof(float) * ns);
    if (!q || !k || !v || !dout || !g || !beta || !h0 || !dht) {
        fprintf(stderr, "gdncp gen: out of memory for the problem's tensors (%.2f GB)\n",
                4e-9 * (2.0 * nqk + 2.0 * nv + 2.0 * ng + 2.0 * ns));
        free(q), free(k), free(v), free(dout), free(g), free(beta), free(h0), free(dht);
        return 1;
    }
    uint64_t s = 0x9E3779B97F4A7C15ull ^ (uint64_t)seed * 0x100000001B3ull;
    for (int64_t i = 0; i < nqk; i++) q[i] = (float)(unif(&s) - 0.5), k[i] = (float)(unif(&s) - 0.5);
    for (int64_t i = 0; i < nv; i++) v[i] = (float)(unif(&s) - 0.5), dout[i] = (float)(unif(&s) - 0.5);
    /* Per value head: A = exp(A_log) and dt_bias; per token: the noise a_t. */
    double *A = malloc(sizeof(double) * Hv * 3), *dt_bias = A + Hv, *gsum = A + 2 * Hv;
    if (!A) {
        fprintf(stderr, "gdncp gen: out of memory\n");
        free(q), free(k), free(v), free(dout), free(g), free(beta), free(h0), free(dht);
        return 1;
    }
    const int qwen = !strcmp(gates, "qwen");
    long n_slow = (long)floor(slow_fraction * Hv + 0.5);
    if (slow_fraction > 0 && n_slow == 0) n_slow = 1;
    const long n_fast = Hv - n_slow;
    for (long h = 0; h < Hv; h++) {
        const double u = unif(&s);
        gsum[h] = 0;
        if (!strcmp(gates, "mild")) A[h] = 0.05 + 0.95 * u, dt_bias[h] = 1.0;
        else if (!qwen) A[h] = 1.0 + 15.0 * u, dt_bias[h] = 1.0;
        else { /* the head's mean decay rate, split between A and softplus(dt_bias) */
            const double lo = h < n_fast ? 0.0 : log(1e-4), hi = h < n_fast ? log(1e-3) : log(1e-5);
            const long n = h < n_fast ? n_fast : n_slow, j = h < n_fast ? h : h - n_fast;
            const double rate = exp(n > 1 ? lo + (hi - lo) * j / (n - 1) : h < n_fast ? lo : hi);
            A[h] = 2.0 * pow(rate, 0.4) * exp(0.2 * (u - 0.5)); /* A_log in about [-3.9, 0.8] */
            dt_bias[h] = log(expm1(rate / A[h]));             /* about -7.6 .. -0.5 */
        }
    }
    for (int64_t i = 0; i < ng; i++) {
        const long h = (long)(i % Hv);
        /* a_t: uniform in [-5, -1] for mild and strong (as before), small noise (+-0.5) for qwen */
        const double a = qwen ? unif(&s) - 0.5 : 4.0 * (unif(&s) - 0.5) - 3.0, x = a + dt_bias[h];
        g[i] = (float)(-A[h] * (x > 30 ? x : log1p(exp(x))));
        gsum[h] += g[i];
        beta[i] = (float)(1.0 / (1.0 + exp(-4.0 * (unif(&s) - 0.5))));
    }
    for (int64_t i = 0; i < ns; i++) h0[i] = (float)(0.1 * (unif(&s) - 0.5)), dht[i] = (float)(unif(&s) - 0.5);
    const gdn_named_tensor t[] = {
        {"q", 4, {B, T, Hk, K}, q}, {"k", 4, {B, T, Hk, K}, k}, {"v", 4, {B, T, Hv, V}, v},
        {"g", 3, {B, T, Hv}, g}, {"beta", 3, {B, T, Hv}, beta}, {"h0", 4, {state_rows, Hv, K, V}, h0},
        {"do", 4, {B, T, Hv, V}, dout}, {"dht", 4, {state_rows, Hv, K, V}, dht}};
    gdn_st_writer *w = NULL;
    rc = gdn_st_writer_create(&w);
    if (!rc) rc = gdn_st_writer_metadata(w, "producer", "gdncp gen");
    for (int i = 0; i < 8 && !rc; i++) rc = gdn_st_writer_add(w, t[i].name, GDN_F32, t[i].ndim, t[i].shape, t[i].data, GDN_F32);
    if (!rc && *cu) rc = gdn_st_writer_add_i64(w, "cu_seqlens", 1, &n_cu, *cu);
    if (!rc) rc = gdn_st_writer_save(w, out);
    gdn_st_writer_destroy(w);
    free(q), free(k), free(v), free(dout), free(g), free(beta), free(h0), free(dht);
    if (rc) {
        free(A);
        return cli_error("gen", rc);
    }
    fprintf(stderr, "gdncp gen: B=%lld T=%lld Hk=%lld Hv=%lld K=%lld V=%lld -> %s\n", (long long)B, (long long)T,
            (long long)Hk, (long long)Hv, (long long)K, (long long)V, out);
    fprintf(stderr, "gdncp gen: gates %s: mean g per value head", gates);
    for (long h = 0; h < Hv && h < 16; h++) fprintf(stderr, " %.2g", gsum[h] / (B * T));
    fprintf(stderr, "%s (memory ~1/|g| tokens)\n", Hv > 16 ? " ..." : "");
    free(A);
    return 0;
}
