/* gdncp gen: write a random gated-delta-rule problem (q, k, v, g, beta, h0, do, dht) in the
 * layouts `gdncp run` reads, with Qwen-like gates g = -exp(A_log) softplus(a + dt_bias). */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double unif(uint64_t *s) {
    *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
    return (double)(*s >> 11) / 9007199254740992.0;
}

int cmd_gen(int argc, char **argv) {
    long B = 1, T = 4096, Hk = 2, Hv = 4, K = 128, V = 128, seed = 1;
    const char *out = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        long *dst = !strcmp(a, "--B") ? &B : !strcmp(a, "--T") ? &T : !strcmp(a, "--Hk") ? &Hk
                  : !strcmp(a, "--Hv") ? &Hv : !strcmp(a, "--K") ? &K : !strcmp(a, "--V") ? &V
                  : !strcmp(a, "--seed") ? &seed : NULL;
        if (dst) {
            if (cli_int(a, val, a[2] == 's' ? 0 : 1, a[2] == 'T' ? 1L << 28 : a[2] == 's' ? 1L << 40 : 4096, dst)) return 1;
            i++;
        } else if (!strcmp(a, "--out") && val) {
            out = argv[++i];
        } else {
            fprintf(stderr, "gdncp gen: unknown or incomplete option '%s'\n", a);
            return 1;
        }
    }
    if (!out) {
        fprintf(stderr, "gdncp gen: --out is required\n");
        return 1;
    }
    gdn_config c = gdn_config_default(B, T, Hk, Hv, K, V);
    int rc = gdn_config_check(&c);
    if (rc) return cli_error("gen", rc);
    const int64_t nqk = B * T * Hk * K, nv = B * T * Hv * V, ng = B * T * Hv, ns = B * Hv * K * V;
    float *q = malloc(sizeof(float) * nqk), *k = malloc(sizeof(float) * nqk), *v = malloc(sizeof(float) * nv),
          *dout = malloc(sizeof(float) * nv), *g = malloc(sizeof(float) * ng), *beta = malloc(sizeof(float) * ng),
          *h0 = malloc(sizeof(float) * ns), *dht = malloc(sizeof(float) * ns);
    if (!q || !k || !v || !dout || !g || !beta || !h0 || !dht) {
        fprintf(stderr, "gdncp gen: out of memory\n");
        return 1;
    }
    uint64_t s = 0x9E3779B97F4A7C15ull ^ (uint64_t)seed * 0x100000001B3ull;
    for (int64_t i = 0; i < nqk; i++) q[i] = (float)(unif(&s) - 0.5), k[i] = (float)(unif(&s) - 0.5);
    for (int64_t i = 0; i < nv; i++) v[i] = (float)(unif(&s) - 0.5), dout[i] = (float)(unif(&s) - 0.5);
    double *A = malloc(sizeof(double) * Hv);
    for (long h = 0; h < Hv; h++) A[h] = 0.05 + 0.95 * unif(&s); /* A_log = log(A) */
    for (int64_t i = 0; i < ng; i++) {
        const double a = 4.0 * (unif(&s) - 0.5) - 3.0, dt_bias = 1.0;
        g[i] = (float)(-A[i % Hv] * log1p(exp(a + dt_bias)));
        beta[i] = (float)(1.0 / (1.0 + exp(-4.0 * (unif(&s) - 0.5))));
    }
    for (int64_t i = 0; i < ns; i++) h0[i] = (float)(0.1 * (unif(&s) - 0.5)), dht[i] = (float)(unif(&s) - 0.5);
    const gdn_named_tensor t[] = {
        {"q", 4, {B, T, Hk, K}, q}, {"k", 4, {B, T, Hk, K}, k}, {"v", 4, {B, T, Hv, V}, v},
        {"g", 3, {B, T, Hv}, g}, {"beta", 3, {B, T, Hv}, beta}, {"h0", 4, {B, Hv, K, V}, h0},
        {"do", 4, {B, T, Hv, V}, dout}, {"dht", 4, {B, Hv, K, V}, dht}};
    rc = gdn_save_tensors(out, t, 8, "gdncp gen");
    free(q), free(k), free(v), free(dout), free(g), free(beta), free(h0), free(dht), free(A);
    if (rc) return cli_error("gen", rc);
    fprintf(stderr, "gdncp gen: B=%ld T=%ld Hk=%ld Hv=%ld K=%ld V=%ld -> %s\n", B, T, Hk, Hv, K, V, out);
    return 0;
}
