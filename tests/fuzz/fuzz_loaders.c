/* libFuzzer harness for the loaders built on the safetensors reader: gdn_problem_load (with and
 * without gradients), gdn_problem_load by rows over a few token ranges (inside, at the edges and
 * outside the file's T), and gdn_layer_weights_load with no prefix and with the Hugging Face
 * prefix "model.layers.0.linear_attn." (then gdn_layer_weights_to_bf16 on success). A returned
 * error is fine; a crash, hang, leak or sanitizer report is a bug. */
#include "fuzz_common.h"

#include "gdncp.h"

static void touch_problem(const gdn_problem *pb, int want_grads) {
    /* Read the last element of every tensor: ASan flags a buffer shorter than its shape says. */
    const gdn_config *c = &pb->cfg;
    const size_t qk = (size_t)(c->B * c->T * c->Hk * c->K), v = (size_t)(c->B * c->T * c->Hv * c->V);
    const size_t g = (size_t)(c->B * c->T * c->Hv), s = (size_t)(c->B * c->Hv * c->K * c->V);
    volatile float sink = 0;
    if (qk) sink += pb->q[qk - 1] + pb->k[qk - 1];
    if (v) sink += pb->v[v - 1];
    if (g) sink += pb->g[g - 1] + pb->beta[g - 1];
    if (pb->h0 && s) sink += pb->h0[s - 1];
    if (want_grads && v) sink += pb->dout[v - 1];
    if (want_grads && pb->dht && s) sink += pb->dht[s - 1];
    (void)sink;
}

static void problem(const char *path, int want_grads, int64_t t0, int64_t tn) {
    gdn_problem pb;
    int rc = tn < 0 ? gdn_problem_load(&pb, path, want_grads, 0, -1, 0)
                    : gdn_problem_load(&pb, path, want_grads, t0, tn, 0);
    if (rc == GDN_OK) {
        if (tn >= 0 && (pb.cfg.T != tn || pb.t_begin != t0)) abort();
        touch_problem(&pb, want_grads);
        gdn_problem_free(&pb);
    } else {
        (void)gdn_errmsg();
    }
}

static void weights(const char *path, const char *prefix) {
    gdn_layer_weights lw;
    if (gdn_layer_weights_load(&lw, path, NULL, prefix, NULL) == GDN_OK) {
        const size_t n = gdn_layer_param_floats(&lw.cfg);
        if (n) {
            volatile float sink = lw.w[n - 1];
            (void)sink;
        }
        (void)gdn_layer_weights_to_bf16(&lw);
        gdn_layer_weights_free(&lw);
    } else {
        (void)gdn_errmsg();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *path = fuzz_file(data, size);
    if (!path) return 0;
    /* T from the file when it is a problem at all (else the row loads only exercise errors). */
    int64_t T = -1;
    gdn_st_file *f = NULL;
    if (gdn_st_open(&f, path) == GDN_OK) {
        const gdn_st_tensor *q = gdn_st_find(f, "q");
        if (q && q->ndim >= 2) T = q->shape[1];
        gdn_st_close(f);
    } else {
        return 0; /* every loader starts with gdn_st_open: nothing more to see */
    }
    for (int want_grads = 0; want_grads <= 1; want_grads++) {
        problem(path, want_grads, 0, -1);
        if (T >= 1) {
            problem(path, want_grads, 0, T);
            problem(path, want_grads, 0, 1);
            problem(path, want_grads, T - 1, 1);
            problem(path, want_grads, T / 2, T - T / 2);
            problem(path, want_grads, T, 1);  /* outside: refused */
            problem(path, want_grads, -1, 1); /* outside: refused */
            problem(path, want_grads, 0, 0);  /* empty: refused */
        }
    }
    weights(path, NULL);
    weights(path, "model.layers.0.linear_attn.");
    return 0;
}
