/* The chunked fp32 forward against the double oracle and against the golden files. */
#include "harness.h"
#include "kernel_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* DESIGN §6: fp32 chunked vs fp64 oracle, max-abs error over max-abs reference, per tensor. */
#define TOL_FWD 1e-5

static const char *gate_name[] = {"zero", "mild", "strong"};
static const char *beta_name[] = {"0", "1", "rand"};

/* Key heads expanded to one per value head under a chosen mapping: the oracle run on these
 * with Hk = Hv is the reference for that mapping. tiled=1 is the wrong (j % Hk) order. */
static float *expand_heads(const gdn_config *c, const float *x, int tiled) {
    float *out = malloc(sizeof(float) * c->B * c->T * c->Hv * c->K);
    const int64_t r = c->Hv / c->Hk;
    for (int64_t bt = 0; bt < c->B * c->T; bt++)
        for (int64_t j = 0; j < c->Hv; j++) {
            int64_t src = tiled ? j % c->Hk : j / r;
            memcpy(out + (bt * c->Hv + j) * c->K, x + (bt * c->Hk + src) * c->K,
                   sizeof(float) * c->K);
        }
    return out;
}

static void sweep(void) {
    const int64_t Ts[] = {1, 2, 63, 64, 65, 127, 200, 1000};
    const int64_t KV[][2] = {{16, 24}, {64, 64}, {128, 128}, {256, 64}};
    const int64_t HkHv[][2] = {{1, 1}, {1, 2}, {2, 4}, {4, 4}};
    const int chunks[] = {16, 32, 64, 128};
    int idx = 0;
    for (size_t ti = 0; ti < 8; ti++)
        for (size_t kv = 0; kv < 4; kv++)
            for (size_t hh = 0; hh < 4; hh++, idx++) {
                const int64_t T = Ts[ti];
                /* Rotate batch, gate, beta and h0 so every combination of the last three
                 * appears across the sweep; long sequences keep B = 1 to bound oracle time. */
                const int64_t B = (idx % 2 && T <= 200) ? 3 : 1;
                const gate_kind gk = (gate_kind)(idx % 3);
                const beta_kind bk = (beta_kind)((idx / 3) % 3);
                const int with_h0 = (idx / 9) % 2;
                gdn_config cfg = gdn_config_default(B, T, HkHv[hh][0], HkHv[hh][1], KV[kv][0], KV[kv][1]);
                problem p;
                problem_make(&p, cfg, gk, bk, with_h0, 1000 + idx);
                double *o_ref = malloc(sizeof(double) * n_v(&cfg));
                double *ht_ref = malloc(sizeof(double) * n_state(&cfg));
                float *o = malloc(sizeof(float) * n_v(&cfg)), *ht = malloc(sizeof(float) * n_state(&cfg));
                int rc = oracle_run(&p, &cfg, NULL, NULL, NULL, o_ref, ht_ref);
                check(rc == GDN_OK, "oracle runs (case %d)", idx);
                for (int ci = 0; ci < 4; ci++) {
                    cfg.chunk = chunks[ci];
                    rc = chunked_run(&p, &cfg, o, ht);
                    double eo = rc ? INFINITY : rel_err_f32(o, o_ref, n_v(&cfg));
                    double eh = rc ? INFINITY : rel_err_f32(ht, ht_ref, n_state(&cfg));
                    expect_close(fmax(eo, eh), TOL_FWD,
                                 "fwd B=%lld T=%lld Hk=%lld Hv=%lld K=%lld V=%lld gate=%s beta=%s h0=%d C=%d (o %.1e ht %.1e)",
                                 (long long)B, (long long)T, (long long)cfg.Hk, (long long)cfg.Hv,
                                 (long long)cfg.K, (long long)cfg.V, gate_name[gk], beta_name[bk],
                                 with_h0, cfg.chunk, eo, eh);
                }
                free(o_ref), free(ht_ref), free(o), free(ht);
                problem_free(&p);
            }
}

/* Wrong variants through the same comparison: each must exceed the tolerance. */
static void negative_controls(void) {
    gdn_config cfg = gdn_config_default(2, 150, 2, 4, 32, 24);
    problem p;
    problem_make(&p, cfg, GATE_MILD, BETA_RANDOM, 1, 77);
    double *o_ref = malloc(sizeof(double) * n_v(&cfg)), *ht_ref = malloc(sizeof(double) * n_state(&cfg));
    double *o_bad = malloc(sizeof(double) * n_v(&cfg)), *ht_bad = malloc(sizeof(double) * n_state(&cfg));
    float *o = malloc(sizeof(float) * n_v(&cfg)), *ht = malloc(sizeof(float) * n_state(&cfg));
    oracle_run(&p, &cfg, NULL, NULL, NULL, o_ref, ht_ref);
    chunked_run(&p, &cfg, o, ht);
    expect_close(rel_err_f32(o, o_ref, n_v(&cfg)), TOL_FWD, "grouped heads Hk=2 Hv=4: chunked vs oracle");

    /* Head mapping: the oracle on explicitly expanded heads (j / r) agrees; the tiled
     * order (j % Hk, the common bug) does not. */
    gdn_config ex = cfg;
    ex.Hk = cfg.Hv;
    for (int tiled = 0; tiled < 2; tiled++) {
        float *qe = expand_heads(&cfg, p.q, tiled), *ke = expand_heads(&cfg, p.k, tiled);
        oracle_run(&p, &ex, qe, ke, NULL, o_bad, ht_bad);
        if (tiled) expect_far(rel_err_f32(o, o_bad, n_v(&cfg)), TOL_FWD, "tiled head mapping j %% Hk");
        else expect_close(rel_err_f32(o, o_bad, n_v(&cfg)), TOL_FWD, "repeat_interleave mapping j / r, heads expanded");
        free(qe), free(ke);
    }

    /* The chunk's solve skipped ((I + L)^-1 replaced by I, a mutation inside the kernel): the
     * same comparison must catch it. */
    test_mutation = "chunk: (I + L)^-1 replaced by I";
    chunked_run(&p, &cfg, o, ht);
    test_mutation = NULL;
    expect_far(rel_err_f32(o, o_ref, n_v(&cfg)), TOL_FWD, "mutation: the chunk's (I + L)^-1 replaced by I");

    /* Missing scale: the chunked path told scale = 1. */
    gdn_config noscale = cfg;
    noscale.scale = 1.0f;
    chunked_run(&p, &noscale, o, ht);
    expect_far(rel_err_f32(o, o_ref, n_v(&cfg)), TOL_FWD, "scale missing (scale=1 instead of 1/sqrt(K))");
    /* ...and an explicit scale agrees with the oracle given the same scale. */
    gdn_config sc = cfg;
    sc.scale = 0.3f;
    oracle_run(&p, &sc, NULL, NULL, NULL, o_bad, ht_bad);
    chunked_run(&p, &sc, o, ht);
    expect_close(rel_err_f32(o, o_bad, n_v(&cfg)), TOL_FWD, "explicit scale 0.3");

    /* Shifted chunk: the chunked path run on inputs shifted by one token. */
    problem sh;
    problem_make(&sh, cfg, GATE_MILD, BETA_RANDOM, 1, 77);
    const int64_t rows = cfg.B * cfg.T;
    for (int64_t r = rows - 1; r > 0; r--) {
        memcpy(sh.q + r * cfg.Hk * cfg.K, p.q + (r - 1) * cfg.Hk * cfg.K, sizeof(float) * cfg.Hk * cfg.K);
        memcpy(sh.k + r * cfg.Hk * cfg.K, p.k + (r - 1) * cfg.Hk * cfg.K, sizeof(float) * cfg.Hk * cfg.K);
    }
    chunked_run(&sh, &cfg, o, ht);
    expect_far(rel_err_f32(o, o_ref, n_v(&cfg)), TOL_FWD, "q, k shifted by one token");
    problem_free(&sh);

    /* Dropped initial state. */
    float *h0 = p.h0;
    p.h0 = NULL;
    chunked_run(&p, &cfg, o, ht);
    p.h0 = h0;
    expect_far(rel_err_f32(o, o_ref, n_v(&cfg)), TOL_FWD, "initial state h0 dropped");

    /* No L2 norm: inputs with small keys keep the recurrence contractive. */
    gdn_config nol2 = cfg;
    nol2.l2norm = 0;
    for (int64_t i = 0; i < n_qk(&cfg); i++) p.k[i] *= 0.1f;
    oracle_run(&p, &nol2, NULL, NULL, NULL, o_bad, ht_bad);
    chunked_run(&p, &nol2, o, ht);
    expect_close(fmax(rel_err_f32(o, o_bad, n_v(&cfg)), rel_err_f32(ht, ht_bad, n_state(&cfg))),
                 TOL_FWD, "no in-kernel L2 norm, small keys");
    chunked_run(&p, &cfg, o, ht);
    expect_far(rel_err_f32(o, o_bad, n_v(&cfg)), TOL_FWD, "L2 norm applied where the oracle has none");

    free(o_ref), free(ht_ref), free(o_bad), free(ht_bad), free(o), free(ht);
    problem_free(&p);
}

/* One stream (B*Hv = 1) on 2 threads splits the value columns; plans re-execute identically. */
static void threads_and_reuse(void) {
    gdn_config cfg = gdn_config_default(1, 300, 1, 1, 64, 96);
    problem p;
    problem_make(&p, cfg, GATE_MILD, BETA_RANDOM, 1, 5);
    double *o_ref = malloc(sizeof(double) * n_v(&cfg)), *ht_ref = malloc(sizeof(double) * n_state(&cfg));
    float *o = malloc(sizeof(float) * n_v(&cfg)), *ht = malloc(sizeof(float) * n_state(&cfg));
    float *o2 = malloc(sizeof(float) * n_v(&cfg));
    oracle_run(&p, &cfg, NULL, NULL, NULL, o_ref, ht_ref);
    for (int threads = 1; threads <= 3; threads++) {
        cfg.threads = threads;
        gdn_plan *plan;
        gdn_plan_create(&plan, &cfg);
        gdn_forward(plan, o, ht, RULE_INPUTS(&p, p.h0));
        expect_close(fmax(rel_err_f32(o, o_ref, n_v(&cfg)), rel_err_f32(ht, ht_ref, n_state(&cfg))),
                     TOL_FWD, "threads=%d (column blocks) vs oracle", threads);
        gdn_forward(plan, o2, ht, RULE_INPUTS(&p, p.h0));
        check(memcmp(o, o2, sizeof(float) * n_v(&cfg)) == 0, "threads=%d plan re-executed: identical bits", threads);
        gdn_forward(plan, o2, ht, RULE_INPUTS(&p, NULL));
        expect_far(rel_err_f32(o2, o_ref, n_v(&cfg)), TOL_FWD, "threads=%d same plan, h0 dropped", threads);
        gdn_plan_destroy(plan);
    }
    free(o_ref), free(ht_ref), free(o), free(ht), free(o2);
    problem_free(&p);
}

/* The vector exp of the decay matrix: within 4 ulp of exp over the range it is used on, exact 0
 * below -69 and +Inf above 88. */
static double vexp_worst(double shift) {
    double worst = 0.0;
    for (int i = 0; i < 200000; i += GDN_VL) {
        gdn_vf x;
        for (int l = 0; l < GDN_VL; l++) x[l] = (float)(-69.0 + 157.0 * (i + l) / 200000.0);
        const gdn_vf y = gdn_vexpf_ftz(x + (float)shift);
        for (int l = 0; l < GDN_VL; l++) {
            const double ref = exp((double)x[l]);
            worst = fmax(worst, fabs(y[l] - ref) / ref);
        }
    }
    return worst;
}

/* The micro-kernel GEMM against a plain double product, every flag, odd sizes (edges). */
static double gemm_err(int flags, int m, int n, int kk, int corrupt) {
    const int bt = (flags & GDN_GEMM_B_TRANS) != 0;
    const int lda = (flags & GDN_GEMM_A_TRANS) ? m + 3 : kk + 3, ldb = bt ? kk + 5 : n + 5, ldc = n + 2;
    const int arows = (flags & GDN_GEMM_A_TRANS) ? kk : m, brows = bt ? n : kk;
    float *A = malloc(sizeof(float) * arows * lda), *B = malloc(sizeof(float) * (brows * ldb + 1));
    float *Cm = malloc(sizeof(float) * m * ldc);
    double *ref = malloc(sizeof(double) * m * n), *mag = malloc(sizeof(double) * m * n);
    rng_seed(flags * 1000 + m);
    for (int i = 0; i < arows * lda; i++) A[i] = (float)rng_uniform(-1, 1);
    for (int i = 0; i < brows * ldb + 1; i++) B[i] = (float)rng_uniform(-1, 1);
    for (int i = 0; i < m * ldc; i++) Cm[i] = (float)rng_uniform(-1, 1);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double acc = (flags & GDN_GEMM_ACC) ? Cm[i * ldc + j] : 0.0, sum_abs = fabs(acc);
            for (int p = 0; p < kk; p++) {
                if ((flags & GDN_GEMM_A_LOWER) && p > i) continue; /* the kernel may skip these */
                if ((flags & GDN_GEMM_A_UPPER) && p < i) continue;
                const double a = (flags & GDN_GEMM_A_TRANS) ? A[p * lda + i] : A[i * lda + p];
                acc += a * (bt ? B[j * ldb + p] : B[p * ldb + j]);
                sum_abs += fabs(a * (bt ? B[j * ldb + p] : B[p * ldb + j]));
            }
            ref[i * n + j] = acc, mag[i * n + j] = sum_abs;
        }
    for (int i = 0; i < m; i++) /* the contract: A is zero above (A_LOWER) or below (A_UPPER) its diagonal */
        for (int p = 0; p < kk; p++)
            if (((flags & GDN_GEMM_A_LOWER) && p > i) || ((flags & GDN_GEMM_A_UPPER) && p < i))
                *((flags & GDN_GEMM_A_TRANS) ? &A[p * lda + i] : &A[i * lda + p]) = 0.0f;
    gdn_gemm(flags, m, n, kk, A, lda, B + corrupt, ldb, Cm, ldc);
    double worst = 0.0;
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            if ((flags & GDN_GEMM_C_LOWER) && j > i) continue;
            /* relative to the sum of |terms|: fp32 rounding is bounded by it, cancellation or not */
            worst = fmax(worst, fabs(Cm[i * ldc + j] - ref[i * n + j]) / mag[i * n + j]);
        }
    free(A), free(B), free(Cm), free(ref), free(mag);
    return worst;
}

static void gemm_kernel(void) {
    /* kk past 256 takes more than one packed depth block */
    const int sizes[][3] = {{1, 1, 1}, {7, 13, 5}, {64, 64, 128}, {37, 24, 61}, {128, 136, 64},
                            {13, 40, 300}, {6, 16, 513}, {270, 20, 7}};
    for (int flags = 0; flags < 64; flags++)
        for (int s = 0; s < 8; s++) {
            const int m = sizes[s][0], n = sizes[s][1],
                      kk = (flags & (GDN_GEMM_A_LOWER | GDN_GEMM_A_UPPER)) ? m : sizes[s][2];
            expect_close(gemm_err(flags, m, n, kk, 0), 1e-6, "gemm flags=%d m=%d n=%d k=%d vs double product", flags, m, n, kk);
        }
    expect_far(gemm_err(GDN_GEMM_A_TRANS, 37, 24, 61, 1), 1e-6, "gemm with B shifted by one column");
    expect_far(gemm_err(GDN_GEMM_B_TRANS, 37, 24, 61, 1), 1e-6, "gemm with B^T shifted by one row");
    expect_far(gemm_err(GDN_GEMM_A_UPPER | GDN_GEMM_A_TRANS, 37, 24, 37, 1), 1e-6,
               "gemm with A upper and B shifted by one column");
}

static void vector_exp(void) {
    expect_close(vexp_worst(0.0), 4.8e-7, "vector exp vs exp over [-69, 88] (4 ulp)");
    expect_far(vexp_worst(1.0 / 1048576), 4.8e-7, "vector exp of an argument off by 2^-20");
    const float x[8] = {-69.5f, -100.0f, -1e30f, 88.5f, 1e30f, 0.0f, -1.0f, 1.0f};
    float y[8];
    for (int i = 0; i < 8; i += GDN_VL) { /* every lane of a vector (16 wide: 8 of them) */
        gdn_vf xv = {0};
        for (int l = 0; l < GDN_VL && i + l < 8; l++) xv[l] = x[i + l];
        const gdn_vf yv = gdn_vexpf_ftz(xv);
        for (int l = 0; l < GDN_VL && i + l < 8; l++) y[i + l] = yv[l];
    }
    check(y[0] == 0.0f && y[1] == 0.0f && y[2] == 0.0f && isinf(y[3]) && isinf(y[4]) && y[5] == 1.0f &&
              fabs(y[6] - exp(-1.0)) < 1e-7 && fabs(y[7] - exp(1.0)) < 3e-7,
          "vector exp edge lanes: 0 below -69, +Inf above 88, exp(0) = 1");
}

void test_forward(void) {
    gemm_kernel();
    vector_exp();
    sweep();
    negative_controls();
    threads_and_reuse();
}

/* ------------------------------------------------------------------ golden files */

static const char *golden_names[] = {"gdn_no_decay", "gdn_small", "gdn_strong_gates", "gdn_qwen_heads"};

void test_golden(void) {
    for (size_t i = 0; i < sizeof golden_names / sizeof golden_names[0]; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s.safetensors", GDN_GOLDEN_DIR, golden_names[i]);
        gdn_problem pb;
        int rc = gdn_problem_load(&pb, path, 0, 0, -1, 0);
        check(rc == GDN_OK, "golden %s loads (%s)", golden_names[i], rc ? gdn_errmsg() : "ok");
        if (rc) continue;
        gdn_st_file *f = NULL;
        gdn_st_open(&f, path);
        const gdn_config *c = &pb.cfg;
        double *o_ref = malloc(sizeof(double) * n_v(c)), *ht_ref = malloc(sizeof(double) * n_state(c));
        float *o = malloc(sizeof(float) * n_v(c)), *ht = malloc(sizeof(float) * n_state(c));
        check(gdn_st_read_f64(f, "o", o_ref, n_v(c)) == GDN_OK &&
                  gdn_st_read_f64(f, "ht", ht_ref, n_state(c)) == GDN_OK,
              "golden %s references read", golden_names[i]);
        const int chunks[] = {16, 64, 128};
        for (int ci = 0; ci < 3; ci++) {
            gdn_config cfg = *c;
            cfg.chunk = chunks[ci];
            gdn_plan *plan = NULL;
            rc = gdn_plan_create(&plan, &cfg);
            if (!rc) rc = gdn_forward(plan, o, ht,
                                      &(gdn_rule_inputs){.q = pb.q, .k = pb.k, .v = pb.v, .g = pb.g,
                                                         .beta = pb.beta, .h0 = pb.h0});
            gdn_plan_destroy(plan);
            double eo = rc ? INFINITY : rel_err_f32(o, o_ref, n_v(c));
            double eh = rc ? INFINITY : rel_err_f32(ht, ht_ref, n_state(c));
            expect_close(eo, 1e-5, "golden %s C=%d o", golden_names[i], cfg.chunk);
            expect_close(eh, 1e-5, "golden %s C=%d ht", golden_names[i], cfg.chunk);
        }
        /* Negative control: the same comparison without the in-kernel L2 norm must fail. */
        gdn_config bad = *c;
        bad.l2norm = 0;
        gdn_plan *plan = NULL;
        rc = gdn_plan_create(&plan, &bad);
        if (!rc) rc = gdn_forward(plan, o, ht,
                                  &(gdn_rule_inputs){.q = pb.q, .k = pb.k, .v = pb.v, .g = pb.g,
                                                     .beta = pb.beta, .h0 = pb.h0});
        gdn_plan_destroy(plan);
        expect_far(rc ? INFINITY : rel_err_f32(o, o_ref, n_v(c)), 1e-5, "golden %s without L2 norm", golden_names[i]);
        free(o_ref), free(ht_ref), free(o), free(ht);
        gdn_st_close(f);
        gdn_problem_free(&pb);
    }
}
