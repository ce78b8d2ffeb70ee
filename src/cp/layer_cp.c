/* The GatedDeltaNet layer over a sequence split across ranks (DESIGN §4): the projections, the
 * gates and the norm are token-local; the conv's halo crosses ranks point to point
 * (gdn_cp_halo_*); the recurrence is the kernel's context parallelism. Packed documents work
 * under every strategy (heads included: the kernel's packed heads path). */
#include "layer_internal.h"

#include "cp_internal.h"

#include <string.h>

/* Every rank runs the same layer call (direction, shapes beyond T, options, what was saved, the
 * packed documents): checked in one step before the first collective that depends on them (the
 * halo's; the kernel checks each rank's seq_offset against the shards again). */
static int layer_agree(gdn_cp *cp, const gdn_layer_plan *lp, int backward, const float *saved, int local) {
    enum { NV = 15 };
    static const char *const names[NV] = {"the layer call (forward/backward)", "B", "E", "Hk", "Hv", "K", "V",
                                          "Kc", "keep", "weight dtype", "eps", "chunk", "saved given",
                                          "packing (n_docs of cu_seqlens, -1: dense)",
                                          "the cu_seqlens offsets (a hash)"};
    int64_t v[NV] = {backward};
    if (lp) {
        const gdn_layer_config *c = &lp->cfg;
        int32_t eps_bits;
        memcpy(&eps_bits, &c->eps, 4);
        const int64_t s[NV] = {backward, c->B, c->E, c->Hk, c->Hv, c->K, c->V, c->Kc, c->keep,
                               c->weight_dtype, eps_bits, c->chunk, saved != NULL,
                               c->cu_seqlens ? c->n_docs : -1, gdn_cp_docs_hash(c->cu_seqlens, c->n_docs)};
        memcpy(v, s, sizeof v);
    } else if (!local) {
        local = gdn_fail(GDN_ERR_ARG, "layer plan is NULL");
    }
    return gdn_cp_agree_values(cp, v, NV, names, local);
}

int gdn_layer_cp_forward(gdn_cp *cp, gdn_layer_plan *lp, float *y, float *saved, const float *x,
                         const void *w) {
    int rc = gdn_layer_check_inputs(lp, x, "x", w);
    if (!rc && !y) rc = gdn_fail(GDN_ERR_ARG, "layer output 'y' is NULL");
    if ((rc = layer_agree(cp, lp, 0, saved, rc))) return rc;
    const gdn_layer_config *c = &lp->cfg;
    gdn_layer_saved sv = gdn_layer_saved_view(lp, saved);
    float *proj = sv.proj ? sv.proj : lp->proj, *o = sv.o ? sv.o : lp->o;
    gdn_layer_project(lp, lp->N, proj, x, w); /* straight into saved with KEEP_PROJ */
    rc = gdn_cp_halo_forward(cp, lp->halo, proj, c->B, c->T, lp->cd, lp->P, c->Kc - 1, GDN_OK);
    if (rc) return rc;
    gdn_layer_conv_gates(lp, proj, lp->halo, w);
    /* s_in (this shard's incoming state) goes to saved for the backward, else to scratch. */
    float *s_in = sv.h0;
    const gdn_rule_inputs in = gdn_layer_rule_inputs(lp, NULL);
    if ((rc = gdn_cp_forward(cp, lp->kplan, o, NULL, s_in, &in)))
        return rc;
    if (sv.halo) memcpy(sv.halo, lp->halo, sizeof(float) * c->B * (c->Kc - 1) * lp->cd);
    gdn_layer_norm(lp, lp->N, o, proj, w);
    gdn_layer_out(lp, lp->N, y, w);
    return GDN_OK;
}

typedef struct {
    gdn_cp *cp;
    const float *s_in;
} cp_bwd;

static int kernel_backward_cp(gdn_layer_plan *lp, void *ctx) {
    const cp_bwd *s = ctx;
    const gdn_rule_grads gr = gdn_layer_rule_grads(lp);
    const gdn_rule_inputs in = gdn_layer_rule_inputs(lp, NULL);
    return gdn_cp_backward(s->cp, lp->kplan, &gr, &in, s->s_in, lp->nrm, NULL);
}

int gdn_layer_cp_backward(gdn_cp *cp, gdn_layer_plan *lp, float *dx, float *dw, const float *x,
                          const float *w, const float *saved, const float *dy) {
    int rc = gdn_layer_check_trainable(lp);
    if (!rc) rc = gdn_layer_check_inputs(lp, x, "x", w);
    if (!rc && lp) rc = gdn_check_tensor("dy", dy, lp->N * lp->cfg.E, lp->cfg.check_finite, lp->threads);
    if (!rc && (!dx || !dw)) rc = gdn_fail(GDN_ERR_ARG, "layer output '%s' is NULL", dx ? "dw" : "dx");
    if ((rc = layer_agree(cp, lp, 1, saved, rc))) return rc;
    const gdn_layer_config *c = &lp->cfg;
    gdn_layer_saved sv = gdn_layer_saved_view(lp, (float *)saved);
    const float *proj = sv.proj, *o = sv.o, *halo = sv.halo;
    cp_bwd kb = {cp, sv.h0};
    if (!proj) {
        gdn_layer_project(lp, lp->N, lp->proj, x, w);
        proj = lp->proj;
    }
    if (!halo) { /* not saved (on every rank: agreed above): exchange it again */
        if ((rc = gdn_cp_halo_forward(cp, lp->halo, proj, c->B, c->T, lp->cd, lp->P, c->Kc - 1, GDN_OK)))
            return rc;
        halo = lp->halo;
    }
    gdn_layer_conv_gates(lp, proj, halo, w);
    if (!o) {
        /* The kernel's output again: from the saved incoming state on this rank alone, or (no
         * saved state, or the heads strategy, which forms none) by the CP forward. */
        const gdn_rule_inputs from_s_in = gdn_layer_rule_inputs(lp, kb.s_in), from_zero = gdn_layer_rule_inputs(lp, NULL);
        if (kb.s_in && c->cp != GDN_CP_HEADS && c->cu_seqlens)
            rc = gdn_streams_forward(lp->kplan, lp->o, NULL, NULL, lp->q, lp->k, lp->v, lp->g, lp->beta, NULL,
                                    kb.s_in, NULL); /* documents from zeros, a continued one from s_in */
        else if (kb.s_in && c->cp != GDN_CP_HEADS)
            rc = gdn_forward(lp->kplan, lp->o, NULL, &from_s_in);
        else
            rc = gdn_cp_forward(cp, lp->kplan, lp->o, NULL, NULL, &from_zero);
        if (rc) return rc;
        o = lp->o;
    }
    rc = gdn_layer_backward_to_proj(lp, dw, lp->dhalo, w, proj, o, halo, dy, kernel_backward_cp, &kb);
    rc = gdn_cp_halo_backward(cp, lp->dproj, lp->dhalo, c->B, c->T, lp->cd, lp->P, c->Kc - 1, rc);
    if (rc) return rc;
    gdn_layer_project_backward(lp, dx, dw, x, w);
    return GDN_OK;
}
