/* Expert parallelism (include/gdncp/ep.h, DESIGN §14): the MoE block with its experts split over
 * groups of ranks equals the one-rank block on all the ranks' rows together, forward (y, the
 * router's statistics) and backward (dx, the router's and shared expert's gradients summed over
 * every rank, each expert's gradient summed over the ranks that hold its slice), with the aux
 * term. Every rank holds a different number of rows; one slice's experts receive no row (their
 * owners compute nothing and return zero gradients), and one token's top-k experts all live on
 * one rank. Negative controls, mutations of the exchange itself: the rows an owner sends back in
 * the wrong order, rank 0's returned rows dropped, the experts' gradients not summed over their
 * replicas. Bad input: a plan of another slice, a non-finite x on one rank, ranks that disagree on
 * the shape, a group size that does not divide the experts, a rank out of memory: an error on
 * every rank, no hang. */
#include "harness.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gdncp/ep.h"

static double max_over(MPI_Comm comm, double v) {
    double m = 0;
    MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, comm);
    return m;
}

/* err of x against ref (floats), as max |x - ref| / max |ref|. */
static double rel_ff(const float *x, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        const double d = fabs((double)x[i] - (double)ref[i]);
        num = d > num || d != d ? d : num;
        den = fabs((double)ref[i]) > den ? fabs((double)ref[i]) : den;
    }
    return den > 0 ? num / den : num;
}

typedef struct {
    int G;       /* ranks per expert group */
    int shared;  /* a shared expert */
    int norm;    /* norm_topk */
    int skew;    /* the last slice's experts never chosen; token 0's experts all in slice 0 */
    int many;    /* ~150 rows a rank: the row copies run on the threads (256 rows and up) */
} ep_case;

typedef struct {
    int D, rank, G, grank, replicas;
    MPI_Comm group, replica; /* the expert group; the ranks holding the same slice */
    gdn_ep *ep;
    gdn_moe_config full, loc;
    int64_t N, row0, Ntot, nl, first;
    float *w, *wl, *x, *dy, *aux;
    float *y_ref, *dx_ref, *dw_ref;
    double *st_ref;
} ep_setup;

/* Every rank builds the whole problem from one seed and the one-rank reference on all rows. */
static void setup(ep_setup *s, const ep_case *c, uint64_t seed) {
    memset(s, 0, sizeof *s);
    MPI_Comm_rank(MPI_COMM_WORLD, &s->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &s->D);
    s->G = c->G, s->replicas = s->D / c->G;
    MPI_Comm_split(MPI_COMM_WORLD, s->rank / c->G, s->rank, &s->group);
    MPI_Comm_split(MPI_COMM_WORLD, s->rank % c->G, s->rank, &s->replica);
    MPI_Comm_rank(s->group, &s->grank);
    /* 3 D experts: every group size dividing D divides them, and a slice holds at least 3 (> top_k) */
    const int64_t E = 16, n = 3 * s->D, k = 2, I = 8, Is = c->shared ? 8 : 0;
    for (int r = 0; r < s->D; r++) {
        const int64_t Nr = c->many ? 150 + 7 * r : 1 + 2 * r;
        if (r == s->rank) s->row0 = s->Ntot, s->N = Nr;
        s->Ntot += Nr;
    }
    s->full = gdn_moe_config_default(s->Ntot, E, n, k, I, Is);
    s->full.norm_topk = c->norm, s->full.threads = c->many ? 2 : 1;
    rng_seed(seed);
    const size_t nf = gdn_moe_param_floats(&s->full);
    s->w = falloc((int64_t)nf);
    for (int i = 0; i < GDN_MOE_COUNT; i++) {
        int64_t shape[3];
        const int nd = gdn_moe_param_shape(&s->full, i, shape);
        if (!nd) continue;
        const size_t o = gdn_moe_param_offset(&s->full, i), ne = gdn_moe_param_numel(&s->full, i);
        const double sc = (i == GDN_MOE_ROUTER ? 3.0 : 1.0) / sqrt((double)shape[nd - 1]);
        for (size_t j = 0; j < ne; j++) s->w[o + j] = (float)rng_uniform(-sc, sc);
    }
    s->x = random_floats((size_t)(s->Ntot * E));
    s->dy = random_floats((size_t)(s->Ntot * E));
    s->aux = falloc(n);
    for (int64_t e = 0; e < n; e++) s->aux[e] = (float)rng_uniform(-0.1, 0.1);
    s->nl = n / c->G;
    if (c->skew) {
        float *Wr = s->w + gdn_moe_param_offset(&s->full, GDN_MOE_ROUTER);
        for (int64_t t = 0; t < s->Ntot; t++) s->x[t * E] = 3.0f;
        s->x[1] = 6.0f; /* token 0 */
        for (int64_t e = 0; e < n; e++) Wr[e * E] = e >= n - s->nl ? -8.0f : 0.0f, Wr[e * E + 1] = e < s->nl ? 4.0f : 0.0f;
    }
    /* the one-rank reference on every row */
    gdn_moe_plan *p = NULL;
    s->y_ref = falloc(s->Ntot * E), s->dx_ref = falloc(s->Ntot * E), s->dw_ref = falloc((int64_t)nf);
    s->st_ref = dalloc(2 * n);
    int rc = gdn_moe_plan_create(&p, &s->full);
    float *saved = falloc((int64_t)gdn_moe_saved_floats(p));
    if (!rc) rc = gdn_moe_forward(p, s->y_ref, saved, s->x, s->w, s->st_ref, NULL, NULL);
    if (!rc) rc = gdn_moe_backward(p, s->dx_ref, s->dw_ref, s->x, s->w, saved, s->dy, s->aux);
    check(rc == GDN_OK, "moe ep reference: %s", rc ? gdn_errmsg() : "ok");
    free(saved);
    gdn_moe_plan_destroy(p);
    /* this rank's slice of the weights */
    rc = gdn_ep_create(&s->ep, s->group);
    s->loc = s->full;
    s->loc.N = s->N;
    if (!rc) rc = gdn_ep_moe_config(s->ep, &s->loc);
    check(rc == GDN_OK, "moe ep setup: %s", rc ? gdn_errmsg() : "ok");
    s->first = s->grank * s->nl;
    s->wl = falloc((int64_t)gdn_moe_param_floats(&s->loc));
    for (int i = 0; i < GDN_MOE_COUNT; i++) {
        const size_t ne = gdn_moe_param_numel(&s->loc, i);
        const size_t skip = i == GDN_MOE_GATE_UP || i == GDN_MOE_DOWN ? (size_t)s->first * (ne / (size_t)s->nl) : 0;
        memcpy(s->wl + gdn_moe_param_offset(&s->loc, i), s->w + gdn_moe_param_offset(&s->full, i) + skip,
               sizeof(float) * ne);
    }
}

static void teardown(ep_setup *s) {
    gdn_ep_destroy(s->ep);
    MPI_Comm_free(&s->group), MPI_Comm_free(&s->replica);
    free(s->w), free(s->wl), free(s->x), free(s->dy), free(s->aux), free(s->y_ref), free(s->dx_ref), free(s->dw_ref);
    free(s->st_ref);
}

typedef struct {
    float *y, *dx, *dw;
    double *st;
    int rc;
} ep_out;

/* The EP block on this rank's rows: y, dx, dw (this rank's share: its slice). */
static ep_out run_ep(ep_setup *s, int backward) {
    ep_out o = {0};
    const int64_t E = s->full.E;
    o.y = falloc(s->N * E), o.dx = falloc(s->N * E), o.dw = falloc((int64_t)gdn_moe_param_floats(&s->loc));
    o.st = dalloc(2 * s->full.n_experts);
    gdn_moe_plan *p = NULL;
    o.rc = gdn_moe_plan_create(&p, &s->loc);
    float *saved = falloc(p ? (int64_t)gdn_moe_saved_floats(p) : 1);
    if (!o.rc) o.rc = gdn_moe_ep_forward(s->ep, p, o.y, saved, s->x + s->row0 * E, s->wl, o.st);
    if (!o.rc && backward)
        o.rc = gdn_moe_ep_backward(s->ep, p, o.dx, o.dw, s->x + s->row0 * E, s->wl, saved, s->dy + s->row0 * E, s->aux);
    free(saved);
    gdn_moe_plan_destroy(p);
    return o;
}

static void out_free(ep_out *o) { free(o->y), free(o->dx), free(o->dw), free(o->st); }

/* The largest error over every rank: y, dx, stats, the dense gradients summed over every rank and
 * the experts' over their replicas (reduce_replicas 0: not summed, the control). */
typedef struct { double y, dx, st, dense, experts; } ep_errs;
static ep_errs compare(ep_setup *s, ep_out *o, int reduce_replicas) {
    ep_errs e;
    const int64_t E = s->full.E, n = s->full.n_experts;
    e.y = max_over(MPI_COMM_WORLD, rel_ff(o->y, s->y_ref + s->row0 * E, (size_t)(s->N * E)));
    e.dx = max_over(MPI_COMM_WORLD, rel_ff(o->dx, s->dx_ref + s->row0 * E, (size_t)(s->N * E)));
    /* the statistics: each group's rows are the same whole set summed over every rank */
    double *st = dalloc(2 * n);
    MPI_Allreduce(o->st, st, (int)(2 * n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    e.st = rel_err_dd(st, s->st_ref, 2 * n);
    free(st);
    const size_t nf = gdn_moe_param_floats(&s->loc);
    float *sum = falloc((int64_t)nf);
    MPI_Allreduce(o->dw, sum, (int)nf, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    float *rep = falloc((int64_t)nf);
    if (reduce_replicas) MPI_Allreduce(o->dw, rep, (int)nf, MPI_FLOAT, MPI_SUM, s->replica);
    else memcpy(rep, o->dw, sizeof(float) * nf);
    e.dense = 0, e.experts = 0;
    for (int i = 0; i < GDN_MOE_COUNT; i++) {
        const size_t ne = gdn_moe_param_numel(&s->loc, i);
        if (!ne) continue;
        const int expert = i == GDN_MOE_GATE_UP || i == GDN_MOE_DOWN;
        const size_t skip = expert ? (size_t)s->first * (ne / (size_t)s->nl) : 0;
        const float *ref = s->dw_ref + gdn_moe_param_offset(&s->full, i) + skip;
        const double err = rel_ff((expert ? rep : sum) + gdn_moe_param_offset(&s->loc, i), ref, ne);
        double *slot = expert ? &e.experts : &e.dense;
        *slot = err > *slot || err != err ? err : *slot;
    }
    e.dense = max_over(MPI_COMM_WORLD, e.dense), e.experts = max_over(MPI_COMM_WORLD, e.experts);
    free(sum), free(rep);
    return e;
}

static void run_case(const ep_case *c, uint64_t seed) {
    ep_setup s;
    setup(&s, c, seed);
    char tag[128];
    snprintf(tag, sizeof tag, "moe ep D=%d G=%d%s%s%s%s", s.D, c->G, c->shared ? " shared" : "", c->norm ? " norm" : "",
             c->skew ? " skewed" : "", c->many ? " many rows" : "");
    const double tol = 2e-5;
    ep_out o = run_ep(&s, 1);
    int bad = o.rc != GDN_OK, any = 0;
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    check(!any, "%s: runs on every rank (%s)", tag, o.rc ? gdn_errmsg() : "ok");
    if (any) goto done;
    ep_errs e = compare(&s, &o, 1);
    expect_close(e.y, tol, "%s: y", tag);
    expect_close(e.dx, tol, "%s: dx", tag);
    expect_close(e.st, tol, "%s: router statistics (the router's GEMM rounds by its row count)", tag);
    expect_close(e.dense, tol, "%s: router + shared gradients summed over the ranks", tag);
    expect_close(e.experts, tol, "%s: expert gradients summed over the %d replicas", tag, s.replicas);
    if (c->skew) {
        gdn_ep_stats st;
        gdn_ep_get_stats(s.ep, &st, 0);
        double owned_last = s.grank == c->G - 1 ? st.rows_owned : 0, routed = st.rows_routed;
        owned_last = max_over(MPI_COMM_WORLD, owned_last);
        check(owned_last == 0 && routed > 0, "%s: the last slice's experts received no row (%g)", tag, owned_last);
        /* token 0 lives on world rank 0: both its experts in slice 0 */
        check(s.nl >= s.full.top_k, "%s: token 0's %lld experts fit one slice", tag, (long long)s.full.top_k);
        /* its stats: the reference's choices of slice 0 */
        double in0 = 0;
        for (int64_t j = 0; j < s.nl; j++) in0 += s.st_ref[j];
        check(in0 >= (double)s.full.top_k, "%s: slice 0's experts chosen %g times", tag, in0);
        if (c->G > 1 && s.grank == c->G - 1) {
            double z = 0;
            for (int i = GDN_MOE_GATE_UP; i <= GDN_MOE_DOWN; i++)
                for (size_t j = 0; j < gdn_moe_param_numel(&s.loc, i); j++)
                    z = fmax(z, fabs(o.dw[gdn_moe_param_offset(&s.loc, i) + j]));
            check(z == 0, "%s: the unused slice's gradients are zero (max %g)", tag, z);
        }
    }
    /* negative controls: mutations of the exchange, the same comparison */
    const char *mut[2] = {"moe_ep.return_order", "moe_ep.drop_rows"};
    for (int m = 0; m < 2; m++) {
        test_mutation = mut[m];
        ep_out w = run_ep(&s, 1);
        test_mutation = NULL;
        const ep_errs f = compare(&s, &w, 1);
        expect_far(fmax(f.y, f.dx), tol, "%s control: %s (y, dx)", tag, mut[m]);
        out_free(&w);
    }
    if (s.replicas > 1) {
        ep_out w = run_ep(&s, 1);
        const ep_errs f = compare(&s, &w, 0);
        expect_far(f.experts, tol, "%s control: expert gradients not summed over their replicas", tag);
        out_free(&w);
    }
done:
    out_free(&o);
    teardown(&s);
}

/* Bad input: every rank gets an error, none waits forever. */
static void bad_input(void) {
    int D, rank;
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    const ep_case c = {D, 1, 1, 0, 0};
    ep_setup s;
    setup(&s, &c, 77);
    const int64_t E = s.full.E;
    float *y = falloc(s.N * E);
    gdn_moe_plan *p = NULL;
    /* a plan of another slice (D > 1), or not sliced through gdn_ep_moe_config (D = 1 is whole) */
    if (D > 1) {
        gdn_moe_config other = s.loc;
        other.ep_rank = (other.ep_rank + 1) % D;
        int rc = gdn_moe_plan_create(&p, &other);
        if (!rc) rc = gdn_moe_ep_forward(s.ep, p, y, NULL, s.x + s.row0 * E, s.wl, NULL);
        expect_status(rc, GDN_ERR_ARG, "slice", "moe ep: a plan of another slice fails on rank %d", rank);
        gdn_moe_plan_destroy(p), p = NULL;
        /* the sliced block cannot run alone */
        rc = gdn_moe_plan_create(&p, &s.loc);
        if (!rc) rc = gdn_moe_forward(p, y, NULL, s.x + s.row0 * E, s.wl, NULL, NULL, NULL);
        expect_status(rc, GDN_ERR_ARG, "gdn_moe_ep_forward", "moe ep: a sliced block through gdn_moe_forward");
        gdn_moe_plan_destroy(p), p = NULL;
    }
    /* NaN in the last rank's x */
    {
        float *x = falloc(s.N * E);
        memcpy(x, s.x + s.row0 * E, sizeof(float) * (size_t)(s.N * E));
        if (rank == D - 1) x[0] = NAN;
        int rc = gdn_moe_plan_create(&p, &s.loc);
        if (!rc) rc = gdn_moe_ep_forward(s.ep, p, y, NULL, x, s.wl, NULL);
        expect_status(rc, GDN_ERR_NONFINITE, rank == D - 1 ? "non-finite" : "failed", "moe ep: NaN on rank %d of %d, seen on rank %d",
                      D - 1, D, rank);
        gdn_moe_plan_destroy(p), p = NULL;
        free(x);
    }
    /* rank 0 has another intermediate size */
    if (D > 1) {
        gdn_moe_config other = s.loc;
        if (rank == 0) other.I = 4;
        float *w = falloc((int64_t)gdn_moe_param_floats(&other));
        int rc = gdn_moe_plan_create(&p, &other);
        if (!rc) rc = gdn_moe_ep_forward(s.ep, p, y, NULL, s.x + s.row0 * E, w, NULL);
        expect_status(rc, GDN_ERR_ARG, "disagree", "moe ep: ranks disagreeing on I fail on rank %d", rank);
        gdn_moe_plan_destroy(p), p = NULL;
        free(w);
    }
    /* a group size that does not divide the experts */
    if (D > 1) {
        gdn_moe_config seven = s.full;
        seven.n_experts = 7 * D + 1, seven.top_k = 2;
        expect_status(gdn_ep_moe_config(s.ep, &seven), GDN_ERR_SHAPE, "do not divide", "moe ep: %d ranks, %lld experts",
                      D, (long long)seven.n_experts);
    }
    /* the last rank cannot take its rows */
    {
        ep_setup t;
        const ep_case c2 = {D, 1, 1, 0, 0};
        setup(&t, &c2, 78); /* a fresh context: its row buffer not yet grown */
        if (rank == D - 1) test_fault = (test_fault_ctl){.armed = 1, .at = 1, .prefix = "ep.rows"};
        int rc = gdn_moe_plan_create(&p, &t.loc);
        if (!rc) rc = gdn_moe_ep_forward(t.ep, p, y, NULL, t.x + t.row0 * E, t.wl, NULL);
        test_fault.armed = 0;
        expect_status(rc, GDN_ERR_NOMEM, rank == D - 1 ? "MB" : "could not take", "moe ep: out of memory on rank %d, seen "
                      "on rank %d", D - 1, rank);
        gdn_moe_plan_destroy(p), p = NULL;
        teardown(&t);
    }
    free(y);
    teardown(&s);
}

void test_moe_ep(void) {
    int D;
    MPI_Comm_size(MPI_COMM_WORLD, &D);
    uint64_t seed = 100;
    for (int G = 1; G <= D; G++) {
        if (D % G) continue;
        /* Above 4 ranks (oversubscribed 2-core CI machines) only the group sizes 1 and D: the
         * sizes between, with replicas, are run at 4 ranks, and each case costs D processes. */
        if (D > 4 && G != 1 && G != D) continue;
        /* skewed routing needs two slices: one never chosen, one holding token 0's experts */
        const ep_case cases[] = {{G, 1, 1, 0, 0}, {G, 0, 0, G > 1, 0}, {G, 1, 1, G > 1, 0}, {G, 1, 1, 0, G == D && D <= 4}};
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
            if (i < 3 || cases[i].many) run_case(&cases[i], seed++);
    }
    bad_input();
}
