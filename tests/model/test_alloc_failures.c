/* Every allocation of the model's operations failed in turn (SQLite's way): each operation runs
 * once counting its allocations K (the gdn_malloc family asks gdn_test_fault before each), then
 * once per N in 1..K (or a spread covering the first and last 20 and every site) with the N-th
 * failing. Each failed run must return GDN_ERR_NOMEM with a message, leave the caller's outputs
 * as documented, keep the plan / decoder usable (disarmed, the same call again gives the
 * reference bit for bit) and, for a checkpoint save, leave the previous checkpoint whole and no
 * partial one. Leaks and double frees are the sanitizer build's to see (LeakSanitizer at exit).
 * The negative control sweeps a wrapper that swallows the failure (returns OK): the same
 * verdict must flag it. */
#include "harness.h"

#include "base.h"
#include "gdncp.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TINY GDN_GOLDEN_DIR "/qwen35_tiny"
#define MOE_TINY GDN_GOLDEN_DIR "/qwen35_moe_tiny"

enum { MAX_CALLS = 1 << 14, SPREAD_ALL = 400, EDGE = 20 };

/* The site of every call of the counting run, by its number (site names are string literals). */
static const char *site_of[MAX_CALLS + 1];
static void record_site(long n, const char *site) {
    if (n <= MAX_CALLS) site_of[n] = site;
}

/* What one run of an operation produced: a hash of every output byte (the bitwise comparison
 * with the reference run) and the verdicts the operation itself checked after its failure. */
typedef struct {
    uint64_t hash;
    int outputs_touched; /* an output the caller owns changed by a failed call documented to keep it */
    int not_usable;      /* the object that survived the failure failed again, disarmed */
    int partial_ckpt;    /* a reader could take a partial checkpoint, or the previous one changed */
} run_result;

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}

/* The failure the armed run makes is over: later calls of the same run allocate freely. */
static void disarm(void) { test_fault.armed = 0; }
static void arm(void) { test_fault.armed = 1; }

typedef int (*op_fn)(void *ctx, run_result *r);

/* n floats (a model's flat parameters), zeroed: its padding between tensors is never written
 * by a load, and the results are compared bit for bit. */
static float *zeroed_floats(size_t n) {
    const size_t bytes = sizeof(float) * ((n + 15) & ~(size_t)15);
    float *p = aligned_alloc(64, bytes);
    if (p) memset(p, 0, bytes);
    return p;
}

typedef struct {
    long calls, tried, sites;    /* K, the N tried, the distinct sites among the K */
    long fallbacks;              /* failures at a documented fallback site: OK, other arithmetic */
    long silent_ok, wrong_status, no_message, not_reached, touched, not_usable, partial, differs;
} sweep_stats;

static long defects(const sweep_stats *s) {
    return s->silent_ok + s->wrong_status + s->no_message + s->not_reached + s->touched + s->not_usable + s->partial +
           s->differs;
}

/* Sites whose failure is a documented fallback, not an error: the BF16 attention core packs its
 * key tiles into a buffer of its own and, when that cannot be allocated, runs the call's
 * products in fp32 (src/layer/attention_core.c, bf_pack_keys): GDN_OK, fp32 instead of BF16
 * products for that call (not bit-identical to the BF16 run). */
static int is_fallback_site(const char *site) { return site && !strcmp(site, "attention_core: k.p"); }

/* Every N to try: all when K is small, else the first and last EDGE, the first call of every
 * site and an even spread between. */
static long choose(long K, long *ns) {
    long n = 0;
    if (K <= SPREAD_ALL) {
        for (long i = 1; i <= K; i++) ns[n++] = i;
        return n;
    }
    static char pick[MAX_CALLS + 1];
    memset(pick, 0, sizeof pick);
    const long stride = K / (SPREAD_ALL - 2 * EDGE) + 1;
    for (long i = 1; i <= K; i++) {
        int seen = 0; /* an earlier call of the same site */
        for (long j = 1; j < i && !seen; j++) seen = !strcmp(site_of[j], site_of[i]);
        pick[i] = (char)(i <= EDGE || i > K - EDGE || i % stride == 0 || !seen);
    }
    for (long i = 1; i <= K; i++)
        if (pick[i]) ns[n++] = i;
    return n;
}

static long distinct_sites(long K) {
    long d = 0;
    for (long i = 1; i <= K && i <= MAX_CALLS; i++) {
        int seen = 0;
        for (long j = 1; j < i && !seen; j++) seen = !strcmp(site_of[j], site_of[i]);
        d += !seen;
    }
    return d;
}

/* The sweep of one operation; its verdicts in the returned counts (the caller checks them, so
 * the control can expect them non-zero). */
static sweep_stats sweep(op_fn op, void *ctx, const char *what, int verbose) {
    sweep_stats s = {0};
    run_result ref = {0}, r;
    test_fault = (test_fault_ctl){0, 0, 0, NULL, NULL};
    test_fault_seen = record_site;
    const int rc0 = op(ctx, &ref);
    s.calls = test_fault.count;
    test_fault = (test_fault_ctl){0};
    test_fault_seen = NULL;
    if (rc0 || s.calls > MAX_CALLS) {
        check(0, "%s: the counting run: %s (%ld allocations)", what, rc0 ? gdn_errmsg() : "ok", s.calls);
        return s;
    }
    s.sites = distinct_sites(s.calls);
    static long ns[MAX_CALLS];
    const long n_try = choose(s.calls, ns);
    int shown = 0;
    for (long i = 0; i < n_try; i++) {
        const long at = ns[i];
        memset(&r, 0, sizeof r);
        (void)gdn_fail(GDN_OK, "%s", ""); /* no message left from before */
        test_fault = (test_fault_ctl){0, at, 0, NULL, NULL};
        int rc = op(ctx, &r);
        const char *site = test_fault.site;
        test_fault = (test_fault_ctl){0};
        s.tried++;
        const char *msg = gdn_errmsg();
        const int bad_before = (int)defects(&s);
        if (is_fallback_site(site) && rc == GDN_OK && !r.not_usable) {
            s.fallbacks++;
            continue;
        }
        if (!site) s.not_reached++;
        else if (rc == GDN_OK) s.silent_ok++;
        else if (rc != GDN_ERR_NOMEM) s.wrong_status++;
        if (site && rc && (!msg[0] || !strcmp(msg, "no error"))) s.no_message++;
        s.touched += r.outputs_touched != 0, s.not_usable += r.not_usable != 0, s.partial += r.partial_ckpt != 0;
        if (r.hash != ref.hash) s.differs++;
        if (verbose && defects(&s) > bad_before && ++shown <= 3)
            printf("  %s: allocation %ld (%s) failed: status %d (%s)%s%s%s%s\n", what, at, site ? site : "not reached",
                   rc, rc ? msg : "ok", r.outputs_touched ? ", an output changed" : "",
                   r.not_usable ? ", not usable after" : "", r.partial_ckpt & 1 ? ", no checkpoint loads" : r.partial_ckpt & 6 ? ", the previous checkpoint changed" : r.partial_ckpt ? ", a leftover in the directory" : "",
                   r.hash != ref.hash ? ", results differ" : "");
    }
    /* an unarmed run again: the same results as the counting run */
    memset(&r, 0, sizeof r);
    test_fault = (test_fault_ctl){0};
    if (op(ctx, &r) || r.hash != ref.hash) s.differs++;
    return s;
}

/* allow_none: the operation may allocate nothing at all (the backward: the plan holds its room). */
static void report(const char *what, const sweep_stats *s, int allow_none) {
    if (allow_none && s->calls == 0) {
        check(defects(s) == 0, "%s: allocates nothing (the plan holds all its room); the rerun bitwise equal", what);
        return;
    }
    check(s->calls > 0 && s->tried > 0 && defects(s) == 0,
          "%s: %ld allocations (%ld sites), %ld failed in turn (%ld at a documented fp32 fallback): the others each GDN_ERR_NOMEM with a message, outputs and "
          "objects intact, the unarmed rerun bitwise equal (%ld silent OK, %ld other status, %ld no message, "
          "%ld not reached, %ld outputs changed, %ld unusable, %ld partial checkpoints, %ld results differ)",
          what, s->calls, s->sites, s->tried, s->fallbacks, s->silent_ok, s->wrong_status, s->no_message, s->not_reached,
          s->touched, s->not_usable, s->partial, s->differs);
}

/* ---- the model and its inputs */

typedef struct {
    gdn_model_config cfg;
    float *w;
    size_t nw;
    gdn_token *tok; /* [B, T + 1] */
    int64_t B, T;
    int compute;
    const char *dir;
} model_case;

static int case_load(model_case *m, const char *dir, int compute) {
    memset(m, 0, sizeof *m);
    m->dir = dir, m->compute = compute, m->B = 2, m->T = 9;
    int rc = gdn_ckpt_load_config(dir, &m->cfg);
    if (!rc) {
        m->nw = gdn_model_param_floats(&m->cfg);
        m->w = zeroed_floats(m->nw);
        rc = m->w ? gdn_ckpt_load(dir, &m->cfg, m->w, NULL, NULL, NULL) : GDN_ERR_NOMEM;
    }
    m->tok = malloc(sizeof *m->tok * (size_t)(m->B * (m->T + 1)));
    for (int64_t i = 0; m->tok && i < m->B * (m->T + 1); i++) m->tok[i] = (gdn_token)((i * 37 + 11) % m->cfg.vocab);
    if (rc || !m->tok) check(0, "load %s: %s", dir, gdn_errmsg());
    return rc || !m->tok;
}

static void case_free(model_case *m) { free(m->w), free(m->tok); }

static gdn_model_run case_run(const model_case *m) {
    return (gdn_model_run){.B = m->B, .T = m->T, .threads = 1, .check_finite = 1, .compute = m->compute};
}

/* The plan made (armed), disarmed and made again when that failed. */
static int make_plan(const model_case *m, gdn_model_plan **p, run_result *r, int *first_rc) {
    const gdn_model_run run = case_run(m);
    *p = NULL;
    int rc = gdn_model_plan_create(p, &m->cfg, &run, NULL);
    if (rc) {
        if (*p) r->not_usable = 1, *p = NULL; /* a failed create hands out nothing */
        *first_rc = rc;
        disarm();
        rc = gdn_model_plan_create(p, &m->cfg, &run, NULL);
    }
    return rc;
}

/* forward: plan made and one training forward, armed; after a failed forward the loss is
 * untouched and the same plan's forward, disarmed, gives the reference loss. */
static int op_forward(void *ctx, run_result *r) {
    const model_case *m = ctx;
    gdn_model_plan *p;
    int first = GDN_OK;
    arm();
    int rc = make_plan(m, &p, r, &first);
    const double sentinel = -12345.0;
    double loss = sentinel;
    if (!rc) rc = gdn_model_forward(p, m->w, m->tok, 100.0, &loss, 1);
    if (rc && p && !first) {
        first = rc;
        r->outputs_touched |= loss != sentinel;
        disarm();
        rc = gdn_model_forward(p, m->w, m->tok, 100.0, &loss, 1);
        r->not_usable |= rc != GDN_OK;
    }
    disarm();
    r->hash = hash_bytes(14695981039346656037ull, &loss, sizeof loss);
    gdn_model_plan_destroy(p);
    return first ? first : rc;
}

/* backward: forward disarmed, then the backward armed; dw is overwritten (undefined on failure:
 * model.h); the plan's backward, disarmed, then gives the reference gradient. */
static int op_backward(void *ctx, run_result *r) {
    const model_case *m = ctx;
    gdn_model_plan *p;
    int first = GDN_OK;
    disarm();
    int rc = make_plan(m, &p, r, &first);
    double loss = 0;
    float *dw = zeroed_floats(m->nw);
    if (!dw) rc = GDN_ERR_NOMEM;
    if (!rc) rc = gdn_model_forward(p, m->w, m->tok, 100.0, &loss, 1);
    if (!rc) {
        arm();
        rc = gdn_model_backward(p, m->w, dw, m->tok);
        disarm();
        if (rc) {
            first = rc;
            rc = gdn_model_backward(p, m->w, dw, m->tok);
            if (rc) { /* a backward may need its forward again: that is still a usable plan */
                rc = gdn_model_forward(p, m->w, m->tok, 100.0, &loss, 1);
                if (!rc) rc = gdn_model_backward(p, m->w, dw, m->tok);
            }
            r->not_usable |= rc != GDN_OK;
        }
    }
    if (!rc) r->hash = hash_bytes(14695981039346656037ull, dw, sizeof(float) * m->nw);
    free(dw);
    gdn_model_plan_destroy(p);
    return first ? first : rc;
}

/* The decoder: made, a prefill of T tokens, then 3 decode steps, armed; after a failure the
 * decoder (reset: the caches may be partly advanced, model.h) replays the whole sequence
 * disarmed and gives the reference logits. */
enum { DECODE_STEPS = 3 };
static int decode_all(const model_case *m, gdn_model_decoder *d, float *logits) {
    const int64_t V = m->cfg.vocab, B = m->B, T = m->T;
    gdn_token *prompt = malloc(sizeof *prompt * (size_t)(B * T)), step[8];
    if (!prompt) return GDN_ERR_NOMEM;
    for (int64_t b = 0; b < B; b++) memcpy(prompt + b * T, m->tok + b * (T + 1), sizeof *prompt * (size_t)T);
    int rc = gdn_model_prefill(d, m->w, prompt, T, logits);
    for (int s = 0; s < DECODE_STEPS && !rc; s++) {
        for (int64_t b = 0; b < B; b++) step[b] = (gdn_token)((s * 5 + b * 3 + 1) % V);
        rc = gdn_model_decode(d, m->w, step, logits + (B * T + B * s) * V);
    }
    free(prompt);
    return rc;
}

static int op_decoder(void *ctx, run_result *r) {
    const model_case *m = ctx;
    const int64_t V = m->cfg.vocab, nlog = (m->B * m->T + m->B * DECODE_STEPS) * V;
    float *logits = calloc((size_t)nlog, sizeof *logits);
    if (!logits) return GDN_ERR_NOMEM;
    gdn_model_decoder *d = NULL;
    int first = GDN_OK;
    arm();
    int rc = gdn_model_decoder_create(&d, &m->cfg, m->B, m->T + DECODE_STEPS, 1, GDN_F32);
    if (rc) {
        first = rc;
        r->not_usable |= d != NULL;
        disarm();
        d = NULL;
        rc = gdn_model_decoder_create(&d, &m->cfg, m->B, m->T + DECODE_STEPS, 1, GDN_F32);
    }
    if (!rc) rc = gdn_model_decoder_set_compute(d, m->compute);
    if (!rc) rc = decode_all(m, d, logits);
    disarm();
    if (rc && !first && d) {
        first = rc;
        gdn_model_decoder_reset(d);
        rc = decode_all(m, d, logits);
        r->not_usable |= rc != GDN_OK;
    }
    r->hash = hash_bytes(14695981039346656037ull, logits, sizeof(float) * (size_t)nlog);
    gdn_model_decoder_destroy(d);
    free(logits);
    return first ? first : rc;
}

/* ---- checkpoints */

typedef struct {
    const model_case *m;
    float *w2, *mom_m, *mom_v; /* the new checkpoint's weights and moments */
    int dtype;                 /* model.safetensors' dtype of the armed save */
    char base[64];
} ckpt_case;

static void remove_tree(const char *dir) {
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd)) fprintf(stderr, "could not remove %s\n", dir);
}

/* A directory entry other than checkpoint-00000001 / -00000002 (a leftover of a failed save). */
static int leftovers(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") && strcmp(e->d_name, "checkpoint-00000001") &&
            strcmp(e->d_name, "checkpoint-00000002"))
            n++;
    closedir(d);
    return n;
}

/* The weights a reader finds under dir (resolved: the newest complete checkpoint), hashed;
 * which step into *step. Non-zero when none loads. */
static int read_back(const ckpt_case *k, const char *dir, float *w, int *step) {
    char ck[512];
    int rc = gdn_ckpt_resolve(dir, ck, sizeof ck);
    if (!rc) rc = gdn_ckpt_load(ck, &k->m->cfg, w, NULL, NULL, NULL);
    const size_t n = strlen(ck);
    *step = !rc && n > 1 ? ck[n - 1] - '0' : -1;
    return rc;
}

/* Save step 1 (disarmed), then step 2 armed (keep_last 1: the save then prunes step 1). After
 * a failure a reader finds either step 1 bit for bit or a complete step 2, and nothing partial;
 * the save disarmed then succeeds and step 2 reads back as the reference. */
static int op_ckpt_save(void *ctx, run_result *r) {
    ckpt_case *k = ctx;
    const model_case *m = k->m;
    char dir[128];
    snprintf(dir, sizeof dir, "%s/out", k->base);
    remove_tree(dir);
    disarm();
    float *back = zeroed_floats(m->nw);
    int rc = back ? gdn_ckpt_save(dir, 1, &m->cfg, m->w, NULL, NULL, "{\"step\": 1}", 0, GDN_F32) : GDN_ERR_NOMEM, first = GDN_OK;
    if (rc) {
        free(back);
        return rc;
    }
    arm();
    rc = gdn_ckpt_save(dir, 2, &m->cfg, k->w2, k->mom_m, k->mom_v, "{\"step\": 2}", 1, k->dtype);
    disarm();
    if (rc) {
        first = rc;
        int step;
        if (read_back(k, dir, back, &step)) r->partial_ckpt |= 1;
        else if (step == 1) r->partial_ckpt |= (memcmp(back, m->w, sizeof(float) * m->nw) != 0) << 1;
        else if (step != 2) r->partial_ckpt |= 4;
        if (leftovers(dir)) r->partial_ckpt |= 8;
        rc = gdn_ckpt_save(dir, 2, &m->cfg, k->w2, k->mom_m, k->mom_v, "{\"step\": 2}", 1, k->dtype);
        r->not_usable |= rc != GDN_OK;
    }
    int step = 0;
    if (!rc) rc = read_back(k, dir, back, &step);
    if (!rc) r->hash = hash_bytes((uint64_t)step, back, sizeof(float) * m->nw);
    free(back);
    return first ? first : rc;
}

/* Load the case's checkpoint with its moments and trainer state, armed; on failure *state_json
 * stays NULL (nothing handed out to leak), and the load disarmed gives the reference. */
static int op_ckpt_load(void *ctx, run_result *r) {
    ckpt_case *k = ctx;
    const model_case *m = k->m;
    char dir[128];
    snprintf(dir, sizeof dir, "%s/load/checkpoint-00000002", k->base);
    float *w = zeroed_floats(m->nw), *mm = zeroed_floats(m->nw), *vv = zeroed_floats(m->nw);
    char *json = NULL;
    int rc = w && mm && vv ? GDN_OK : GDN_ERR_NOMEM, first = GDN_OK;
    if (!rc) {
        arm();
        rc = gdn_ckpt_load(dir, &m->cfg, w, mm, vv, &json);
        disarm();
        if (rc) {
            first = rc;
            r->outputs_touched |= json != NULL;
            free(json), json = NULL;
            rc = gdn_ckpt_load(dir, &m->cfg, w, mm, vv, &json);
            r->not_usable |= rc != GDN_OK;
        }
    }
    if (!rc) {
        uint64_t h = hash_bytes(14695981039346656037ull, w, sizeof(float) * m->nw);
        h = hash_bytes(h, mm, sizeof(float) * m->nw), h = hash_bytes(h, vv, sizeof(float) * m->nw);
        r->hash = hash_bytes(h, json, strlen(json));
    }
    free(json), free(w), free(mm), free(vv);
    return first ? first : rc;
}

/* Reading the transformers checkpoint of the test data itself (the loader's allocations). */
static int op_hf_load(void *ctx, run_result *r) {
    const model_case *m = ctx;
    gdn_model_config cfg;
    float *w = zeroed_floats(m->nw);
    int first = GDN_OK;
    arm();
    int rc = w ? gdn_ckpt_load_config(m->dir, &cfg) : GDN_ERR_NOMEM;
    if (!rc) rc = gdn_ckpt_load(m->dir, &cfg, w, NULL, NULL, NULL);
    disarm();
    if (rc && w) {
        first = rc;
        rc = gdn_ckpt_load_config(m->dir, &cfg);
        if (!rc) rc = gdn_ckpt_load(m->dir, &cfg, w, NULL, NULL, NULL);
        r->not_usable |= rc != GDN_OK;
    }
    if (!rc) r->hash = hash_bytes(14695981039346656037ull, w, sizeof(float) * m->nw);
    free(w);
    return first ? first : rc;
}

/* The negative control's planted defect: the forward with its failure swallowed (OK returned). */
static int op_forward_swallowed(void *ctx, run_result *r) {
    (void)op_forward(ctx, r);
    return GDN_OK;
}

static void sweep_checkpoints(const model_case *m, int dtype, const char *what) {
    ckpt_case k = {.m = m, .dtype = dtype};
    snprintf(k.base, sizeof k.base, "/tmp/gdn_alloc_XXXXXX");
    if (!mkdtemp(k.base)) {
        check(0, "make a scratch directory: %s", strerror(errno));
        return;
    }
    k.w2 = zeroed_floats(m->nw), k.mom_m = zeroed_floats(m->nw), k.mom_v = zeroed_floats(m->nw);
    for (size_t i = 0; i < m->nw; i++)
        k.w2[i] = m->w[i] * 0.5f + 0.25f, k.mom_m[i] = 0.001f * (float)(i % 97), k.mom_v[i] = 1e-4f * (float)(i % 31);
    char name[160];
    snprintf(name, sizeof name, "%s: gdn_ckpt_save (%s, with moments) over a previous checkpoint", what,
             dtype == GDN_BF16 ? "BF16" : "F32");
    sweep_stats s = sweep(op_ckpt_save, &k, name, 1);
    report(name, &s, 0);
    /* the load's sweep, from a checkpoint saved here */
    char dir[128];
    snprintf(dir, sizeof dir, "%s/load", k.base);
    if (gdn_ckpt_save(dir, 2, &m->cfg, k.w2, k.mom_m, k.mom_v, "{\"step\": 2}", 0, dtype))
        check(0, "save the checkpoint to load: %s", gdn_errmsg());
    else {
        snprintf(name, sizeof name, "%s: gdn_ckpt_load (%s weights, moments, trainer state)", what,
                 dtype == GDN_BF16 ? "BF16" : "F32");
        s = sweep(op_ckpt_load, &k, name, 1);
        report(name, &s, 0);
    }
    free(k.w2), free(k.mom_m), free(k.mom_v);
    remove_tree(k.base);
}

static void sweep_model(const char *dir, const char *what, int compute, int with_ckpt) {
    model_case m;
    if (case_load(&m, dir, compute)) {
        case_free(&m);
        return;
    }
    const char *mode = compute == GDN_COMPUTE_BF16 ? " (BF16 compute)" : "";
    char name[160];
    sweep_stats s;
    snprintf(name, sizeof name, "%s%s: plan + gdn_model_forward", what, mode);
    s = sweep(op_forward, &m, name, 1), report(name, &s, 0);
    snprintf(name, sizeof name, "%s%s: gdn_model_backward", what, mode);
    s = sweep(op_backward, &m, name, 1), report(name, &s, 1);
    snprintf(name, sizeof name, "%s%s: decoder create, prefill of %lld, %d decode steps", what, mode, (long long)m.T,
             DECODE_STEPS);
    s = sweep(op_decoder, &m, name, 1), report(name, &s, 0);
    if (with_ckpt) {
        snprintf(name, sizeof name, "%s: reading the transformers checkpoint", what);
        s = sweep(op_hf_load, &m, name, 1), report(name, &s, 0);
        sweep_checkpoints(&m, with_ckpt == 2 ? GDN_BF16 : GDN_F32, what);
    }
    case_free(&m);
}

/* The control: the sweep counts sites and flags a forward whose failure is swallowed. */
static void control_swallowed(void) {
    model_case m;
    if (case_load(&m, TINY, GDN_COMPUTE_FP32)) {
        case_free(&m);
        return;
    }
    sweep_stats s = sweep(op_forward_swallowed, &m, "control", 0);
    check(s.calls > 0 && s.tried == s.calls && s.silent_ok == s.tried,
          "control: the sweep of a forward that swallows the failure (returns OK) flags every one of its %ld "
          "failed allocations as a silent OK (%ld)", s.tried, s.silent_ok);
    case_free(&m);
}

void test_alloc_failures(void) {
    sweep_model(TINY, "qwen35_tiny", GDN_COMPUTE_FP32, 1);
    sweep_model(TINY, "qwen35_tiny", GDN_COMPUTE_BF16, 0);
    sweep_model(MOE_TINY, "qwen35_moe_tiny", GDN_COMPUTE_FP32, 2);
    control_swallowed();
}
