/* Bad input never crashes: every case returns an error code and names what is wrong. */
#include "harness.h"

#include <omp.h>
#include "kernel_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static void config_errors(void) {
    gdn_plan *plan = NULL;
    gdn_config c;
#define BAD(field, value, want, needle)                                                   \
    c = gdn_config_default(1, 8, 1, 1, 16, 16);                                           \
    c.field = value;                                                                      \
    expect_status(gdn_plan_create(&plan, &c), want, needle, "config %s = %s", #field, #value); \
    check(plan == NULL, "no plan returned for bad %s", #field);
    BAD(B, 0, GDN_ERR_SHAPE, "B (batch)");
    BAD(T, 0, GDN_ERR_SHAPE, "T (tokens)");
    BAD(T, -5, GDN_ERR_SHAPE, "T (tokens)");
    BAD(Hk, 0, GDN_ERR_SHAPE, "Hk");
    BAD(Hv, -1, GDN_ERR_SHAPE, "Hv");
    BAD(K, 0, GDN_ERR_SHAPE, "K (key head dim)");
    BAD(V, -3, GDN_ERR_SHAPE, "V (value head dim)");
    BAD(K, 257, GDN_ERR_SHAPE, "maximum is 256");
    BAD(V, 300, GDN_ERR_SHAPE, "V (value head dim) is 300");
    BAD(chunk, 48, GDN_ERR_ARG, "chunk");
    BAD(threads, -2, GDN_ERR_ARG, "threads");
    BAD(scale, NAN, GDN_ERR_ARG, "scale");
    BAD(T, (int64_t)1 << 62, GDN_ERR_SHAPE, "too large");
    BAD(cp, 4, GDN_ERR_ARG, "cp must be a CP strategy");
    BAD(cp, -1, GDN_ERR_ARG, "cp must be a CP strategy");
#undef BAD
    c = gdn_config_default(1, 8, 1, 1, 16, 16);
    c.cp = GDN_CP_HEADS; /* control: every strategy plans on one rank (it ignores it) */
    expect_status(gdn_plan_create(&plan, &c), GDN_OK, NULL, "config cp = GDN_CP_HEADS plans");
    gdn_plan_destroy(plan), plan = NULL;
    c = gdn_config_default(1, 8, 3, 4, 16, 16);
    expect_status(gdn_plan_create(&plan, &c), GDN_ERR_SHAPE, "multiple of Hk", "Hv %% Hk != 0");
    expect_status(gdn_plan_create(NULL, &c), GDN_ERR_ARG, NULL, "NULL plan pointer");
    expect_status(gdn_plan_create(&plan, NULL), GDN_ERR_ARG, NULL, "NULL config");
}

static void nonfinite_inputs(void) {
    gdn_config cfg = gdn_config_default(1, 20, 1, 2, 16, 8);
    problem p;
    problem_make(&p, cfg, GATE_MILD, BETA_RANDOM, 1, 3);
    gdn_plan *plan = NULL;
    gdn_plan_create(&plan, &cfg);
    float *o = malloc(sizeof(float) * n_v(&cfg)), *ht = malloc(sizeof(float) * n_state(&cfg));
    struct { const char *name; float *x; } t[] = {{"q", p.q}, {"k", p.k}, {"v", p.v}, {"g", p.g}, {"beta", p.beta}, {"h0", p.h0}};
    for (int i = 0; i < 6; i++) {
        for (int kind = 0; kind < 2; kind++) {
            float keep = t[i].x[5];
            t[i].x[5] = kind ? INFINITY : NAN;
            char needle[32];
            snprintf(needle, sizeof needle, "input '%s'", t[i].name);
            expect_status(gdn_forward(plan, o, ht, RULE_INPUTS(&p, p.h0)), GDN_ERR_NONFINITE,
                          needle, "%s in '%s'", kind ? "Inf" : "NaN", t[i].name);
            t[i].x[5] = keep;
        }
    }
    expect_status(gdn_forward(plan, o, ht,
                              &(gdn_rule_inputs){.q = p.q, .v = p.v, .g = p.g, .beta = p.beta, .h0 = p.h0}),
                  GDN_ERR_ARG, "'k'", "NULL k");
    expect_status(gdn_forward(plan, NULL, ht, RULE_INPUTS(&p, p.h0)), GDN_ERR_ARG, "'o'", "NULL o");
    /* A finite but huge key: its squared norm overflows fp32; reported, not normalised to garbage. */
    float keep = p.k[7];
    p.k[7] = 1e30f;
    expect_status(gdn_forward(plan, o, ht, RULE_INPUTS(&p, p.h0)), GDN_ERR_NONFINITE,
                  "squared norm overflows", "k element 1e30");
    p.k[7] = keep;
    expect_status(gdn_forward(plan, o, ht, RULE_INPUTS(&p, p.h0)), GDN_OK, NULL,
                  "the same inputs with the element restored run");
    /* Large positive gates overflow: reported, not returned as garbage. */
    for (int64_t i = 0; i < n_g(&cfg); i++) p.g[i] = 80.0f;
    expect_status(gdn_forward(plan, o, ht, RULE_INPUTS(&p, p.h0)), GDN_ERR_NONFINITE,
                  "output", "positive gates g = 80 overflow");
    gdn_plan_destroy(plan);
    free(o), free(ht);
    problem_free(&p);
}

/* The backward checks NaN/Inf on the rows it touches: every input and the first and the last
 * element of each, with and without the forward's saved states, must be named. */
static void nonfinite_backward(void) {
    gdn_config cfg = gdn_config_default(2, 150, 2, 4, 16, 8);
    cfg.chunk = 32, cfg.checkpoint_chunks = 2;
    problem p;
    problem_make(&p, cfg, GATE_MILD, BETA_RANDOM, 1, 4);
    gdn_plan *plan = NULL;
    gdn_plan_create(&plan, &cfg);
    const int64_t nqk = n_qk(&cfg), nv = n_v(&cfg), ng = n_g(&cfg), ns = n_state(&cfg);
    float *grad = malloc(sizeof(float) * (2 * nqk + nv + 2 * ng + ns));
    float *dq = grad, *dk = dq + nqk, *dv = dk + nqk, *dg = dv + nv, *db = dg + ng, *dh0 = db + ng;
    const gdn_rule_grads gr = {.dq = dq, .dk = dk, .dv = dv, .dg = dg, .dbeta = db, .dh0 = dh0};
    float *dout = malloc(sizeof(float) * nv), *dht = malloc(sizeof(float) * ns);
    float *o = malloc(sizeof(float) * nv), *ckpt = malloc(sizeof(float) * (gdn_plan_checkpoint_floats(plan) + 1));
    for (int64_t i = 0; i < nv; i++) dout[i] = (float)rng_uniform(-1, 1);
    for (int64_t i = 0; i < ns; i++) dht[i] = (float)rng_uniform(-1, 1);
    expect_status(gdn_forward_save(plan, o, NULL, ckpt, RULE_INPUTS(&p, p.h0)), GDN_OK, NULL,
                  "forward keeping states for the backward");
    struct { const char *name; float *x; int64_t n; } t[] = {
        {"q", p.q, nqk}, {"k", p.k, nqk}, {"v", p.v, nv}, {"g", p.g, ng}, {"beta", p.beta, ng},
        {"h0", p.h0, ns}, {"do", dout, nv}, {"dht", dht, ns}};
    for (int i = 0; i < 8; i++)
        for (int kind = 0; kind < 2; kind++)
            for (int saved = 0; saved < 2; saved++) {
                const int64_t at = kind ? t[i].n - 1 : 5;
                const float keep = t[i].x[at];
                t[i].x[at] = kind ? INFINITY : NAN;
                char needle[32];
                snprintf(needle, sizeof needle, "input '%s'", t[i].name);
                expect_status(gdn_backward_saved(plan, &gr, RULE_INPUTS(&p, p.h0), saved ? ckpt : NULL, dout, dht),
                              GDN_ERR_NONFINITE, needle, "backward%s: %s at element %lld of '%s'",
                              saved ? " from saved states" : "", kind ? "Inf" : "NaN", (long long)at, t[i].name);
                t[i].x[at] = keep;
            }
    expect_status(gdn_backward_saved(plan, &gr, RULE_INPUTS(&p, p.h0), ckpt, dout, dht),
                  GDN_OK, NULL, "backward with every element restored runs");
    expect_status(gdn_backward(plan, &gr, RULE_INPUTS(&p, p.h0), NULL, dht),
                  GDN_ERR_ARG, "'do'", "backward with NULL do");
    const float keep = p.k[nqk - 3];
    p.k[nqk - 3] = 1e30f;
    expect_status(gdn_backward(plan, &gr, RULE_INPUTS(&p, p.h0), dout, dht),
                  GDN_ERR_NONFINITE, "squared norm overflows", "backward: k element 1e30");
    p.k[nqk - 3] = keep;
    for (int64_t i = 0; i < ng; i++) p.g[i] = 80.0f;
    expect_status(gdn_backward(plan, &gr, RULE_INPUTS(&p, p.h0), dout, dht),
                  GDN_ERR_NONFINITE, "output", "backward: positive gates g = 80 overflow");
    gdn_plan_destroy(plan);
    free(grad), free(dout), free(dht), free(o), free(ckpt);
    problem_free(&p);
}

/* Write raw bytes: an 8-byte length, the header text, then `data` bytes of zeros. */
static void write_raw(const char *path, const char *header, long long hlen_override, size_t data) {
    FILE *f = fopen(path, "wb");
    if (hlen_override == -2) { /* a truly empty file */
        fclose(f);
        return;
    }
    unsigned long long n = hlen_override >= 0 ? (unsigned long long)hlen_override : strlen(header);
    for (int i = 0; i < 8; i++) fputc((int)((n >> (8 * i)) & 0xff), f);
    fputs(header, f);
    for (size_t i = 0; i < data; i++) fputc(0, f);
    fclose(f);
}

static void file_errors(void) {
    char path[] = "/tmp/gdncp_bad_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    gdn_st_file *f = NULL;
    const char *ok1 = "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
    struct { const char *what, *header; long long hlen; size_t data; int want; const char *needle; } cases[] = {
        {"empty file", "", -2, 0, GDN_ERR_FORMAT, "too short"},
        {"zero-length header", "", 0, 0, GDN_ERR_FORMAT, "JSON is invalid"},
        {"header length past the end", ok1, 1000, 8, GDN_ERR_FORMAT, "header length"},
        {"header length absurd", ok1, 1LL << 40, 8, GDN_ERR_FORMAT, "header length"},
        {"bad JSON", "{\"x\": [1,2", -1, 0, GDN_ERR_FORMAT, "JSON is invalid"},
        {"JSON not an object", "[1,2,3]", -1, 0, GDN_ERR_FORMAT, "not an object"},
        {"duplicate keys", "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", -1, 8, GDN_ERR_FORMAT, "invalid"},
        {"missing dtype", "{\"x\":{\"shape\":[2],\"data_offsets\":[0,8]}}", -1, 8, GDN_ERR_FORMAT, "'x' has no string 'dtype'"},
        {"unknown dtype", "{\"x\":{\"dtype\":\"F99\",\"shape\":[2],\"data_offsets\":[0,8]}}", -1, 8, GDN_ERR_FORMAT, "unknown dtype 'F99'"},
        {"negative dim", "{\"x\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", -1, 8, GDN_ERR_FORMAT, "shape[0]"},
        {"shape/offsets mismatch", "{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", -1, 8, GDN_ERR_FORMAT, "needs 12"},
        {"offsets past the end (truncated)", ok1, -1, 4, GDN_ERR_FORMAT, "truncated"},
        {"offsets reversed", "{\"x\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", -1, 8, GDN_ERR_FORMAT, "invalid data_offsets"},
        {"overlapping tensors", "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", -1, 12, GDN_ERR_FORMAT, "overlap"},
        {"metadata not strings", "{\"__metadata__\":{\"a\":1}}", -1, 0, GDN_ERR_FORMAT, "__metadata__"},
        {"too many dims", "{\"x\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", -1, 4, GDN_ERR_FORMAT, "dims"},
        {"overflowing shape", "{\"x\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", -1, 4, GDN_ERR_FORMAT, "overflow"},
        /* Zero-length tensors take part in the overlap check. x [0,8) and y [4,12) overlap; the
         * empty e at 4 sorts between them and used to hide the overlap. */
        {"overlap hidden behind an empty tensor", "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]},\"y\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", -1, 12, GDN_ERR_FORMAT, "overlap"},
        {"overlap with an earlier, longer tensor", "{\"x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]},\"z\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}", -1, 16, GDN_ERR_FORMAT, "overlap"},
        {"empty tensor inside another", "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"e\":{\"dtype\":\"F32\",\"shape\":[2,0],\"data_offsets\":[4,4]}}", -1, 8, GDN_ERR_FORMAT, "'e' [4, 4) overlap"},
        {"empty tensor past the data", "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[100,100]}}", -1, 8, GDN_ERR_FORMAT, "'e' ends at byte 100"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_raw(path, cases[i].header, cases[i].hlen, cases[i].data);
        int rc = gdn_st_open(&f, path);
        expect_status(rc, cases[i].want, cases[i].needle, "file: %s", cases[i].what);
        check(f == NULL, "file: %s returns no handle", cases[i].what);
        gdn_st_close(f);
        f = NULL;
    }
    expect_status(gdn_st_open(&f, "/nonexistent/file.safetensors"), GDN_ERR_IO, "cannot open", "file: missing");

    /* A valid file is accepted (control for the cases above). */
    write_raw(path, ok1, -1, 8);
    check(gdn_st_open(&f, path) == GDN_OK, "file: well-formed header accepted");
    gdn_st_close(f);
    /* Controls for the empty-tensor cases: empty tensors at the boundaries of others, at the
     * start and at the end of the data, and two at one offset, are all valid. */
    write_raw(path, "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                    "\"b\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,8]},\"c\":{\"dtype\":\"BF16\",\"shape\":[3,0],\"data_offsets\":[8,8]},"
                    "\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},\"d\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[12,12]}}", -1, 12);
    expect_status(gdn_st_open(&f, path), GDN_OK, NULL, "file: empty tensors on tensor boundaries accepted");
    check(f && gdn_st_count(f) == 6, "file: all 6 tensors, 4 of them empty, listed");
    gdn_st_close(f);
    f = NULL;

    /* Only regular files: a FIFO (opening it for reading would block: the test would hang), a
     * directory and a device fail before open() with the path named. */
    char dir[] = "/tmp/gdncp_fifo_XXXXXX", fifo[64];
    if (mkdtemp(dir)) {
        snprintf(fifo, sizeof fifo, "%s/in.safetensors", dir);
        check(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo);
        expect_status(gdn_st_open(&f, fifo), GDN_ERR_IO, "not a regular file (a FIFO)", "file: a FIFO is refused without blocking");
        check(f == NULL, "file: FIFO returns no handle");
        char needle[96];
        snprintf(needle, sizeof needle, "%s: not a regular file", fifo);
        expect_status(gdn_st_open(&f, fifo), GDN_ERR_IO, needle, "file: the FIFO's path is named");
        gdn_problem pb;
        expect_status(gdn_problem_load(&pb, fifo, 0, 0, -1, 0), GDN_ERR_IO, "not a regular file", "problem load: a FIFO is refused");
        unlink(fifo);
        expect_status(gdn_st_open(&f, dir), GDN_ERR_IO, "not a regular file (a directory)", "file: a directory is refused");
        rmdir(dir);
    }
    expect_status(gdn_st_open(&f, "/dev/null"), GDN_ERR_IO, "/dev/null: not a regular file (a character device)", "file: a device is refused");
    check(f == NULL, "file: device returns no handle");

    /* Problem-level checks: missing tensors, wrong shapes, wrong dtype. */
    gdn_config cfg = gdn_config_default(1, 4, 1, 2, 8, 8);
    problem p;
    problem_make(&p, cfg, GATE_MILD, BETA_RANDOM, 1, 9);
    const int64_t sq[4] = {1, 4, 1, 8}, sv[4] = {1, 4, 2, 8}, sg[3] = {1, 4, 2}, ss[4] = {1, 2, 8, 8};
    const int64_t sg_bad[3] = {1, 4, 3}, ss_bad[4] = {1, 2, 8, 7}, sk_bad[4] = {1, 4, 1, 7};
    static const float big[4096]; /* source for tensors written with a wrong (larger) shape */
    for (int variant = 0; variant < 8; variant++) {
        gdn_st_writer *w;
        gdn_st_writer_create(&w);
        if (variant != 0) gdn_st_writer_add_f32(w, "q", GDN_F32, 4, sq, p.q);
        gdn_st_writer_add_f32(w, "k", GDN_F32, 4, variant == 2 ? sk_bad : sq, variant == 2 ? big : p.k);
        if (variant != 1) gdn_st_writer_add_f32(w, "v", GDN_F32, 4, sv, p.v);
        if (variant != 3) gdn_st_writer_add_f32(w, "g", GDN_F32, 3, variant == 4 ? sg_bad : sg, variant == 4 ? big : p.g);
        gdn_st_writer_add_f32(w, "beta", GDN_F32, 3, sg, p.beta);
        gdn_st_writer_add_f32(w, "h0", GDN_F32, 4, variant == 5 ? ss_bad : ss, variant == 5 ? big : p.h0);
        gdn_st_writer_save(w, path);
        gdn_st_writer_destroy(w);
        if (variant == 6) { /* replace q's dtype by I32 by hand: writer only makes floats */
            char hdr[512];
            snprintf(hdr, sizeof hdr,
                     "{\"q\":{\"dtype\":\"I32\",\"shape\":[1,4,1,8],\"data_offsets\":[0,128]},"
                     "\"k\":{\"dtype\":\"F32\",\"shape\":[1,4,1,8],\"data_offsets\":[128,256]},"
                     "\"v\":{\"dtype\":\"F32\",\"shape\":[1,4,2,8],\"data_offsets\":[256,512]},"
                     "\"g\":{\"dtype\":\"F32\",\"shape\":[1,4,2],\"data_offsets\":[512,544]},"
                     "\"beta\":{\"dtype\":\"F32\",\"shape\":[1,4,2],\"data_offsets\":[544,576]}}");
            write_raw(path, hdr, -1, 576);
        }
        gdn_problem pb;
        int rc = gdn_problem_load(&pb, path, variant == 7, 0, -1, 0);
        static const struct { int want; const char *needle; } expect[] = {
            {GDN_ERR_MISSING, "'q' is missing"}, {GDN_ERR_MISSING, "'v' is missing"},
            {GDN_ERR_SHAPE, "'k' has shape [1,4,1,7], expected [1,4,1,8]"}, {GDN_ERR_MISSING, "'g' is missing"},
            {GDN_ERR_SHAPE, "'g' has shape [1,4,3]"}, {GDN_ERR_SHAPE, "'h0' has shape"},
            {GDN_ERR_DTYPE, "'q' is I32"}, {GDN_ERR_MISSING, "'do' is missing"}};
        expect_status(rc, expect[variant].want, expect[variant].needle, "problem file variant %d", variant);
        if (!rc) gdn_problem_free(&pb);
    }
    problem_free(&p);
    unlink(path);
}

/* The scan splits large tensors across threads: it must still report the first bad element. */
static void nonfinite_scan(void) {
    const int64_t n = 3 << 20;
    float *x = calloc(n, sizeof(float));
    check(gdn_find_nonfinite_f32(x, n, 2) == -1, "scan of %lld finite floats finds nothing", (long long)n);
    x[2500000] = NAN;
    x[1500001] = -INFINITY;
    check(gdn_find_nonfinite_f32(x, n, 2) == 1500001, "parallel scan reports the first non-finite element");
    x[n - 1] = INFINITY;
    check(gdn_find_nonfinite_f32(x + 2000000, n - 2000000, 2) == 500000, "scan on an offset view");
    free(x);
}

/* The non-finite scan runs with the plan's threads, not OpenMP's default team (ranks sharing a
 * node would oversubscribe it): with the default raised to 4, a plan of 1 thread checks a NaN
 * input of more than 2^20 floats with a team of 1; the control, a plan of 3 threads, is seen
 * with 3 (so the observation is real). The team is reported by the library's test hook. */
static void nonfinite_threads(void) {
    const int before = omp_get_max_threads();
    omp_set_num_threads(4);
    for (int want = 1; want <= 3; want += 2) {
        gdn_config c = gdn_config_default(1, 8200, 1, 1, 128, 16);
        c.threads = want;
        problem p;
        problem_make(&p, c, GATE_MILD, BETA_RANDOM, 0, 9);
        p.q[5000] = NAN;
        float *o = malloc(sizeof(float) * n_v(&c));
        gdn_plan *plan = NULL;
        int rc = gdn_plan_create(&plan, &c);
        test_threads_site = "find_nonfinite_f32", test_threads_seen = -1;
        if (!rc) rc = gdn_forward(plan, o, NULL, RULE_INPUTS(&p, NULL));
        const int seen = test_threads_seen;
        test_threads_site = NULL;
        check(rc == GDN_ERR_NONFINITE && seen == want,
              "plan threads = %d, OpenMP default 4: the NaN check of 'q' (%lld floats) runs with %d thread(s) "
              "(status %d)", want, (long long)n_qk(&c), seen, rc);
        gdn_plan_destroy(plan);
        free(o);
        problem_free(&p);
    }
    omp_set_num_threads(before);
}

/* gdn_parallel_range: every index of [0, n) in exactly one share; with one thread (or one item)
 * the shares run in no parallel region, with 3 threads and more items in one (which also shows
 * that omp_in_parallel would see a region). */
typedef struct {
    int hits[41];
    int in_parallel;
} range_seen;
static void range_mark(void *p, int64_t lo, int64_t hi) {
    range_seen *r = p;
    if (omp_in_parallel()) __atomic_store_n(&r->in_parallel, 1, __ATOMIC_RELAXED);
    for (int64_t i = lo; i < hi; i++) __atomic_add_fetch(&r->hits[i], 1, __ATOMIC_RELAXED);
}
static void parallel_range_cases(void) {
    const int64_t ns[] = {0, 1, 2, 7, 40};
    for (int threads = 1; threads <= 3; threads += 2)
        for (int c = 0; c < 5; c++) {
            const int64_t n = ns[c];
            range_seen r = {{0}, 0};
            gdn_parallel_range(threads, n, range_mark, &r);
            int once = 1;
            for (int64_t i = 0; i <= 40; i++) once &= r.hits[i] == (i < n);
            const int want_region = threads > 1 && n > 1;
            check(once && r.in_parallel == want_region,
                  "gdn_parallel_range(threads %d, n %lld): each index once (%s), %s a parallel region (want %s)", threads,
                  (long long)n, once ? "yes" : "no", r.in_parallel ? "in" : "outside", want_region ? "in" : "outside");
        }
}

/* Every status the library returns has its own text: none is "unknown status". */
static void status_texts(void) {
    const int codes[] = {GDN_OK, GDN_ERR_ARG, GDN_ERR_SHAPE, GDN_ERR_NONFINITE, GDN_ERR_NOMEM, GDN_ERR_IO,
                         GDN_ERR_FORMAT, GDN_ERR_MISSING, GDN_ERR_DTYPE, GDN_ERR_MPI};
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
        check(strcmp(gdn_strerror(codes[i]), "unknown status") != 0, "gdn_strerror(%d) = \"%s\"", codes[i],
              gdn_strerror(codes[i]));
    check(strstr(gdn_strerror(GDN_ERR_MPI), "MPI") != NULL, "GDN_ERR_MPI names MPI");
    check(GDN_ERR_MPI == 20, "GDN_ERR_MPI keeps its number (20) across versions");
    /* the version the library reports is the one the header was written for */
    check(!strcmp(gdn_version(), GDN_VERSION_STRING), "gdn_version() = \"%s\", header %s", gdn_version(),
          GDN_VERSION_STRING);
    check(GDN_VERSION == GDN_VERSION_MAJOR * 10000 + GDN_VERSION_MINOR * 100 + GDN_VERSION_PATCH, "GDN_VERSION");
    check(!strcmp(gdn_strerror(99), "unknown status"), "an unused code is still \"unknown status\" (control)");
}

/* Sizes that clearly cannot fit are refused before anything is allocated: a (sparse) problem
 * file whose tensors add up to twice this machine's memory, and a layer plan for 2^26 tokens
 * at the Qwen3.5-35B shape. Control: the same file format at a small size loads. */
static void too_large(void) {
    const double phys = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
    char dir[] = "/tmp/gdncp_big_XXXXXX";
    if (phys <= 0 || !mkdtemp(dir)) {
        printf("(not run: physical memory or a temporary directory unknown)\n");
        return;
    }
    for (int big = 0; big < 2; big++) {
        /* q, k [1, T, 1, 128], v [1, T, 1, 128], g, beta [1, T, 1]: 3 x 512 T bytes + 8 T */
        const long long T = big ? (long long)(2 * phys / (3 * 512.0)) + 1 : 16, row = 128 * 4;
        char header[1024], path[64];
        const long long sq = T * row, sg = T * 4;
        int n = snprintf(header, sizeof header,
                         "{\"q\":{\"dtype\":\"F32\",\"shape\":[1,%lld,1,128],\"data_offsets\":[0,%lld]},"
                         "\"k\":{\"dtype\":\"F32\",\"shape\":[1,%lld,1,128],\"data_offsets\":[%lld,%lld]},"
                         "\"v\":{\"dtype\":\"F32\",\"shape\":[1,%lld,1,128],\"data_offsets\":[%lld,%lld]},"
                         "\"g\":{\"dtype\":\"F32\",\"shape\":[1,%lld,1],\"data_offsets\":[%lld,%lld]},"
                         "\"beta\":{\"dtype\":\"F32\",\"shape\":[1,%lld,1],\"data_offsets\":[%lld,%lld]}}",
                         T, sq, T, sq, 2 * sq, T, 2 * sq, 3 * sq, T, 3 * sq, 3 * sq + sg, T, 3 * sq + sg,
                         3 * sq + 2 * sg);
        while (n % 8) header[n++] = ' ';
        snprintf(path, sizeof path, "%s/p.safetensors", dir);
        FILE *f = fopen(path, "wb");
        const unsigned long long hl = (unsigned long long)n;
        int ok = f && fwrite(&hl, 8, 1, f) == 1 && fwrite(header, 1, (size_t)n, f) == (size_t)n;
        if (f) fclose(f);
        ok = ok && truncate(path, (off_t)(8 + n + 3 * sq + 2 * sg)) == 0; /* sparse: no disk used */
        if (!ok) {
            printf("(not run: cannot make a sparse file of %.0f GB here)\n", (3.0 * sq) / 1e9);
            unlink(path);
            break;
        }
        gdn_problem pb;
        const int rc = gdn_problem_load(&pb, path, 0, 0, -1, 0);
        if (big)
            expect_status(rc, GDN_ERR_NOMEM, "needs", "problem file claiming %.0f GB (twice this machine's memory): refused before allocating",
                          3.0 * sq / 1e9);
        else
            expect_status(rc, GDN_OK, NULL, "the same file format at T = 16 loads (control)");
        if (!rc) gdn_problem_free(&pb);
        unlink(path);
    }
    rmdir(dir);
    gdn_layer_config c = gdn_layer_config_default(1, (int64_t)1 << 26, 2048, 16, 32, 128, 128);
    gdn_layer_plan *lp = NULL;
    expect_status(gdn_layer_plan_create(&lp, &c), GDN_ERR_NOMEM, "workspace",
                  "layer plan for 2^26 tokens at the 35B shape (about 13 TB): refused before allocating");
    gdn_layer_plan_destroy(lp);
    /* The kernel plan: its backward keeps segment-start states, about sqrt(T) of them, which at
     * T = 2^50 and K = V = 256 are about 2.5 TB, more than any test machine (at 2^40, 80 GB, a
     * large one would allocate them untouched); the same shape at 2^16 plans. */
    for (int big = 1; big >= 0; big--) {
        gdn_config kc = gdn_config_default(1, big ? (int64_t)1 << 50 : 1 << 16, 1, 1, 256, 256);
        kc.threads = 1;
        gdn_plan *kp = NULL;
        const int rc = gdn_plan_create(&kp, &kc);
        if (big)
            expect_status(rc, GDN_ERR_NOMEM, "backward workspace (1 thread(s), T = 1125899906842624) needs",
                          "kernel plan for 2^50 tokens, K = V = 256: refused before allocating");
        else
            expect_status(rc, GDN_OK, NULL, "the same kernel plan at 2^16 tokens (control)");
        gdn_plan_destroy(kp);
    }
}

/* The tensor bundles (kernel.h): a NULL bundle pointer and each NULL required field are refused
 * with GDN_ERR_ARG naming them, by every call that takes one; the optional fields (h0, dh0) may be
 * NULL. Control: the same calls with complete bundles return GDN_OK. */
static void bundle_errors(void) {
    gdn_config cfg = gdn_config_default(1, 40, 1, 2, 8, 8);
    cfg.chunk = 16;
    problem p;
    problem_make(&p, cfg, GATE_MILD, BETA_RANDOM, 1, 17);
    gdn_plan *plan = NULL;
    expect_status(gdn_plan_create(&plan, &cfg), GDN_OK, NULL, "bundles: plan");
    const int64_t nqk = n_qk(&cfg), nv = n_v(&cfg), ng = n_g(&cfg), ns = n_state(&cfg);
    float *buf = calloc((size_t)(4 * nqk + 4 * nv + 4 * ng + 4 * ns + cfg.Hv * cfg.K * cfg.K), sizeof(float));
    float *dq = buf, *dk = dq + nqk, *dv = dk + nqk, *dg = dv + nv, *db = dg + ng, *dh0 = db + ng;
    float *o = dh0 + ns, *ht = o + nv, *dout = ht + ns, *ckpt = NULL, *sa = dout + nv, *sb = sa + cfg.Hv * cfg.K * cfg.K;
    float *sg = sb + ns;
    ckpt = malloc(sizeof(float) * (gdn_plan_checkpoint_floats(plan) + 1));
    for (int64_t i = 0; i < nv; i++) dout[i] = 0.5f;
    const char *in_names[] = {"q", "k", "v", "g", "beta"}, *gr_names[] = {"dq", "dk", "dv", "dg", "dbeta"};
    char needle[48];
    /* the fp32 calls: NULL bundles */
    const gdn_rule_grads gr = {.dq = dq, .dk = dk, .dv = dv, .dg = dg, .dbeta = db, .dh0 = dh0};
    const char *no_in = "inputs 'in' (gdn_rule_inputs) is NULL", *no_gr = "gradients 'grads' (gdn_rule_grads) is NULL";
    expect_status(gdn_forward(plan, o, ht, NULL), GDN_ERR_ARG, no_in, "gdn_forward, inputs NULL");
    expect_status(gdn_forward_save(plan, o, ht, ckpt, NULL), GDN_ERR_ARG, no_in, "gdn_forward_save, inputs NULL");
    expect_status(gdn_backward(plan, &gr, NULL, dout, NULL), GDN_ERR_ARG, no_in, "gdn_backward, inputs NULL");
    expect_status(gdn_backward(plan, NULL, RULE_INPUTS(&p, p.h0), dout, NULL), GDN_ERR_ARG, no_gr,
                  "gdn_backward, gradients NULL");
    expect_status(gdn_backward_saved(plan, NULL, RULE_INPUTS(&p, p.h0), NULL, dout, NULL), GDN_ERR_ARG, no_gr,
                  "gdn_backward_saved, gradients NULL");
    expect_status(gdn_summary(plan, sa, sb, NULL), GDN_ERR_ARG, no_in, "gdn_summary, inputs NULL");
    expect_status(gdn_summary_adjoint(plan, sg, NULL, dout), GDN_ERR_ARG, no_in, "gdn_summary_adjoint, inputs NULL");
    /* each required input field NULL, one at a time */
    for (int f = 0; f < 5; f++) {
        gdn_rule_inputs in = *RULE_INPUTS(&p, p.h0);
        const float **field[] = {&in.q, &in.k, &in.v, &in.g, &in.beta};
        *field[f] = NULL;
        snprintf(needle, sizeof needle, "input '%s' is NULL", in_names[f]);
        expect_status(gdn_forward(plan, o, ht, &in), GDN_ERR_ARG, needle, "gdn_forward, in.%s NULL", in_names[f]);
        expect_status(gdn_forward_save(plan, o, ht, ckpt, &in), GDN_ERR_ARG, needle, "gdn_forward_save, in.%s NULL",
                      in_names[f]);
        expect_status(gdn_backward(plan, &gr, &in, dout, NULL), GDN_ERR_ARG, needle, "gdn_backward, in.%s NULL",
                      in_names[f]);
        expect_status(gdn_summary(plan, sa, sb, &in), GDN_ERR_ARG, needle, "gdn_summary, in.%s NULL", in_names[f]);
        if (f != 2) /* the adjoint does not read v */
            expect_status(gdn_summary_adjoint(plan, sg, &in, dout), GDN_ERR_ARG, needle,
                          "gdn_summary_adjoint, in.%s NULL", in_names[f]);
    }
    /* each required gradient field NULL */
    for (int f = 0; f < 5; f++) {
        gdn_rule_grads g2 = gr;
        float **field[] = {&g2.dq, &g2.dk, &g2.dv, &g2.dg, &g2.dbeta};
        *field[f] = NULL;
        snprintf(needle, sizeof needle, "gradient output '%s' is NULL", gr_names[f]);
        expect_status(gdn_backward(plan, &g2, RULE_INPUTS(&p, p.h0), dout, NULL), GDN_ERR_ARG, needle,
                      "gdn_backward, grads.%s NULL", gr_names[f]);
    }
    /* the optional fields, and the fields a call does not read, may be NULL (controls) */
    expect_status(gdn_forward(plan, o, ht, RULE_INPUTS(&p, NULL)), GDN_OK, NULL, "gdn_forward, h0 NULL (optional)");
    expect_status(gdn_forward_save(plan, o, ht, ckpt, RULE_INPUTS(&p, p.h0)), GDN_OK, NULL, "gdn_forward_save, complete");
    expect_status(gdn_backward_saved(plan, &(gdn_rule_grads){.dq = dq, .dk = dk, .dv = dv, .dg = dg, .dbeta = db},
                                     RULE_INPUTS(&p, p.h0), ckpt, dout, NULL),
                  GDN_OK, NULL, "gdn_backward_saved, dh0 NULL (optional)");
    expect_status(gdn_backward(plan, &gr, RULE_INPUTS(&p, p.h0), dout, NULL), GDN_OK, NULL, "gdn_backward, complete");
    expect_status(gdn_summary(plan, sa, NULL, &(gdn_rule_inputs){.q = p.q, .k = p.k, .g = p.g, .beta = p.beta}),
                  GDN_OK, NULL, "gdn_summary A alone, v NULL (not read)");
    expect_status(gdn_summary_adjoint(plan, sg, &(gdn_rule_inputs){.q = p.q, .k = p.k, .g = p.g, .beta = p.beta},
                                      dout), GDN_OK, NULL, "gdn_summary_adjoint, v NULL (not read)");
    gdn_plan_destroy(plan);
    /* the decode step: NULL bundle, NULL fields, and a set h0 refused (the state is `state`) */
    gdn_config one = cfg;
    one.T = 1;
    expect_status(gdn_plan_create(&plan, &one), GDN_OK, NULL, "bundles: step plan");
    float *state = calloc((size_t)ns, sizeof(float));
    expect_status(gdn_step(plan, o, state, NULL), GDN_ERR_ARG, no_in, "gdn_step, inputs NULL");
    for (int f = 0; f < 5; f++) {
        gdn_rule_inputs in = *RULE_INPUTS(&p, NULL);
        const float **field[] = {&in.q, &in.k, &in.v, &in.g, &in.beta};
        *field[f] = NULL;
        snprintf(needle, sizeof needle, "input '%s' is NULL", in_names[f]);
        expect_status(gdn_step(plan, o, state, &in), GDN_ERR_ARG, needle, "gdn_step, in.%s NULL", in_names[f]);
    }
    expect_status(gdn_step(plan, o, state, RULE_INPUTS(&p, p.h0)), GDN_ERR_ARG, "'h0' is not read by gdn_step",
                  "gdn_step, h0 set");
    expect_status(gdn_step(plan, o, state, RULE_INPUTS(&p, NULL)), GDN_OK, NULL, "gdn_step, complete");
    gdn_plan_destroy(plan);
    /* the oracle's double bundles */
    double *d = calloc((size_t)(3 * (2 * nqk + nv + 2 * ng + ns) + nv), sizeof(double));
    double *x = d, *gx = d + (2 * nqk + nv + 2 * ng + ns), *od = gx + (2 * nqk + nv + 2 * ng + ns), *hd = od + nv;
    double *ddo = hd + ns;
    for (int64_t i = 0; i < 2 * nqk + nv + 2 * ng; i++) x[i] = 0.25;
    for (int64_t i = 0; i < nv; i++) ddo[i] = 1.0;
    const gdn_rule_inputs_f64 in64 = {.q = x, .k = x + nqk, .v = x + 2 * nqk, .g = x + 2 * nqk + nv,
                                      .beta = x + 2 * nqk + nv + ng};
    const gdn_rule_grads_f64 gr64 = {.dq = gx, .dk = gx + nqk, .dv = gx + 2 * nqk, .dg = gx + 2 * nqk + nv,
                                     .dbeta = gx + 2 * nqk + nv + ng};
    expect_status(gdn_reference_forward(&cfg, od, hd, NULL), GDN_ERR_ARG, "inputs 'in' (gdn_rule_inputs_f64) is NULL",
                  "gdn_reference_forward, inputs NULL");
    expect_status(gdn_reference_backward(&cfg, NULL, &in64, ddo, NULL), GDN_ERR_ARG,
                  "gradients 'grads' (gdn_rule_grads_f64) is NULL", "gdn_reference_backward, gradients NULL");
    expect_status(gdn_reference_backward(&cfg, &gr64, NULL, ddo, NULL), GDN_ERR_ARG,
                  "inputs 'in' (gdn_rule_inputs_f64) is NULL", "gdn_reference_backward, inputs NULL");
    for (int f = 0; f < 5; f++) {
        gdn_rule_inputs_f64 in = in64;
        gdn_rule_grads_f64 g2 = gr64;
        const double **fi[] = {&in.q, &in.k, &in.v, &in.g, &in.beta};
        double **fg[] = {&g2.dq, &g2.dk, &g2.dv, &g2.dg, &g2.dbeta};
        *fi[f] = NULL, *fg[f] = NULL;
        snprintf(needle, sizeof needle, "input '%s' is NULL", in_names[f]);
        expect_status(gdn_reference_forward(&cfg, od, hd, &in), GDN_ERR_ARG, needle, "gdn_reference_forward, in.%s NULL",
                      in_names[f]);
        expect_status(gdn_reference_backward(&cfg, &gr64, &in, ddo, NULL), GDN_ERR_ARG, needle,
                      "gdn_reference_backward, in.%s NULL", in_names[f]);
        snprintf(needle, sizeof needle, "gradient output '%s' is NULL", gr_names[f]);
        expect_status(gdn_reference_backward(&cfg, &g2, &in64, ddo, NULL), GDN_ERR_ARG, needle,
                      "gdn_reference_backward, grads.%s NULL", gr_names[f]);
    }
    expect_status(gdn_reference_forward(&cfg, od, hd, &in64), GDN_OK, NULL, "gdn_reference_forward, h0 NULL (optional)");
    expect_status(gdn_reference_backward(&cfg, &gr64, &in64, ddo, NULL), GDN_OK, NULL,
                  "gdn_reference_backward, dh0 NULL (optional)");
    free(d), free(state), free(buf), free(ckpt);
    problem_free(&p);
}

void test_errors(void) {
    too_large();
    status_texts();
    nonfinite_scan();
    nonfinite_threads();
    parallel_range_cases();
    config_errors();
    nonfinite_inputs();
    nonfinite_backward();
    bundle_errors();
    file_errors();
}
