/* The training state over the grid (DESIGN §15, --zero): which rank owns which slice of every
 * replicated parameter, the gradients summed (all-reduced, or reduce-scattered to their owners),
 * the gradient norm, the AdamW update of each rank's slice and the weights all-gathered after it,
 * and the checkpoints written in parallel, each rank its own slices.
 *
 * The flat parameter array is cut into runs: maximal stretches of one layer's tensors (or the
 * embedding's, the head's) of one kind, shared by the whole grid or (the routed experts under
 * --ep) by the ranks holding the same expert slice (its replicas). Each run, padding included, is
 * split over its group's N ranks in rank order, rank i owning floats [i len / N, (i + 1) len / N)
 * of it: any length, any N (uneven slices). Level 0 keeps the moments of everything; levels >= 1
 * keep only the owned slices' moments, packed run after run. */
#include "trainer_internal.h"
#include "cp_internal.h" /* gdn_cp_wait_all */

/* The layer a tensor belongs to (-1: the embedding, the final norm, lm_head). */
static long layer_of(const char *name) {
    const char *p = strstr(name, "layers.");
    return p ? strtol(p + 7, NULL, 10) : -1;
}

static MPI_Comm group_of(const trainer *t, const gdn_shard_run *r) {
    return r->kind ? t->replica_comm : t->world;
}

void gdn_trainer_shard_free(trainer *t) {
    for (int i = 0; i < t->nruns; i++) free(t->runs[i].counts);
    free(t->runs), free(t->unit_first), free(t->sched.gathered), free(t->sched.req), free(t->sched.pend);
    free(t->w_own), free(t->dw_own), free(t->rs_scratch);
    t->runs = NULL, t->nruns = 0;
}

int gdn_trainer_shard_setup(trainer *t) {
    const int n = gdn_model_tensor_count(&t->cfg);
    t->runs = gdn_calloc("trainer_shard: runs", (size_t)n, sizeof *t->runs);
    if (!t->runs) return gdn_fail(GDN_ERR_NOMEM, "the table of the parameters' runs");
    gdn_model_tensor_info ti;
    long layer = -2;
    int kind = -1;
    for (int i = 0; i < n; i++) {
        gdn_model_tensor(&t->cfg, i, &ti);
        const int k = ti.experts_whole > 0 && t->ep_size > 1;
        const long l = layer_of(ti.name);
        if (k == kind && l == layer) continue;
        if (t->nruns) t->runs[t->nruns - 1].hi = ti.offset;
        t->runs[t->nruns++] = (gdn_shard_run){.lo = i ? ti.offset : 0, .kind = k};
        kind = k, layer = l;
    }
    t->runs[t->nruns - 1].hi = t->nw;
    t->owned = 0;
    for (int i = 0; i < t->nruns; i++) {
        gdn_shard_run *r = &t->runs[i];
        MPI_Comm g = group_of(t, r);
        MPI_Comm_size(g, &r->size);
        MPI_Comm_rank(g, &r->me);
        r->counts = gdn_malloc("trainer_shard: counts", sizeof(int) * 2 * (size_t)r->size);
        if (!r->counts) return gdn_fail(GDN_ERR_NOMEM, "the slices' table");
        r->displs = r->counts + r->size;
        const size_t len = r->hi - r->lo;
        for (int j = 0; j < r->size; j++) {
            const size_t a = len * (size_t)j / (size_t)r->size, b = len * (size_t)(j + 1) / (size_t)r->size;
            r->displs[j] = (int)a, r->counts[j] = (int)(b - a);
        }
        r->own_lo = r->lo + (size_t)r->displs[r->me], r->own_hi = r->own_lo + (size_t)r->counts[r->me];
        r->at = t->owned;
        t->owned += r->own_hi - r->own_lo;
        t->rs_floats = (size_t)r->counts[r->me] > t->rs_floats ? (size_t)r->counts[r->me] : t->rs_floats;
    }
    if (t->o->zero < 2 && !(t->rs_scratch = gdn_malloc("trainer_shard: rs_scratch", sizeof(float) * (t->rs_floats + 1))))
        return gdn_fail(GDN_ERR_NOMEM, "the gradients' sum scratch (%zu floats)", t->rs_floats);
    return GDN_OK;
}

/* The moments of run r's owned slice in m or v: level 0 holds everything by flat offset. */
static float *moments_of(const trainer *t, const gdn_shard_run *r, float *a) {
    return a + (t->o->zero ? r->at : r->own_lo);
}

/* Run r's owned weights: level 3 keeps them apart (the flat array holds only gathered units). */
static float *own_weights(const trainer *t, const gdn_shard_run *r) {
    return t->o->zero >= 3 ? t->w_own + r->at : t->w + r->own_lo;
}

/* Run r's owned summed gradient: levels 2 and 3 reduce-scatter it apart. */
static float *own_grads(const trainer *t, const gdn_shard_run *r) {
    return t->o->zero >= 2 ? t->dw_own + r->at : t->dw + r->own_lo;
}

/* What one collective of run r moves on this rank: a reduce-scatter or an all-gather over n ranks
 * sends and receives (n - 1) / n of the run, 4 bytes a float (the ring's count). */
static void count_bytes(trainer *t, const gdn_shard_run *r) {
    if (r->size > 1) t->zero_bytes += 4.0 * (double)(r->hi - r->lo) * (double)(r->size - 1) / (double)r->size;
}

/* One rank's gradient left out of the sums (a test mutation: the sums must see it). */
static void leave_out(const gdn_shard_run *r, float *g) {
    if (r->size > 1 && r->me == r->size - 1) memset(g, 0, sizeof *g * (r->hi - r->lo));
}

/* Levels 0 and 1: the gradients summed where their weights are shared, after the backward:
 * everything over the grid, the routed experts' tensors under --ep only over their replicas. Each
 * run is reduce-scattered (every slice summed once, at its owner, in the order of levels 2 and 3)
 * and all-gathered (the same bits on every rank, so the replicas never drift apart). Levels 2 and
 * 3 sum each unit's runs during the backward (the units hook) into their owners' slices only. */
void gdn_trainer_reduce_grads(trainer *t) {
    if (t->o->zero >= 2) return;
    const int replicas_summed = !gdn_test_mutate("train: expert gradients not summed over their replicas");
    const int mutate = gdn_test_mutate("zero: one rank's gradient slice left out");
    for (int i = 0; i < t->nruns; i++) {
        const gdn_shard_run *r = &t->runs[i];
        float *g = t->dw + r->lo;
        if (r->kind && !replicas_summed) continue;
        if (mutate) leave_out(r, g);
        if (r->size < 2) continue;
        /* into a scratch slice (never MPI_IN_PLACE: MPICH 4's reduce-scatter of uneven counts then
         * copies between overlapping ranges and aborts), then all-gathered in place */
        MPI_Reduce_scatter(g, t->rs_scratch, r->counts, MPI_FLOAT, MPI_SUM, group_of(t, r));
        memcpy(t->dw + r->own_lo, t->rs_scratch, sizeof *g * (size_t)r->counts[r->me]);
        MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, g, r->counts, r->displs, MPI_FLOAT, group_of(t, r));
        count_bytes(t, r), count_bytes(t, r);
    }
}

/* The gradient's norm over the whole model, at every level from the owned slices: their squares
 * summed over the world (each element is owned by one rank of it), reduced on rank 0 and
 * broadcast (the same bits everywhere). */
double gdn_trainer_grad_norm(trainer *t) {
    double mine = 0, s[2], all = 0;
    for (int i = 0; i < t->nruns; i++) {
        const gdn_shard_run *r = &t->runs[i];
        gdn_grad_sumsq_range(&t->cfg, own_grads(t, r), r->own_lo, r->own_hi, s);
        mine += s[0] + s[1];
    }
    MPI_Reduce(&mine, &all, 1, MPI_DOUBLE, MPI_SUM, 0, t->world);
    MPI_Bcast(&all, 1, MPI_DOUBLE, 0, t->world);
    return sqrt(all);
}

/* Levels 1 and 2: the updated slices to every rank of their groups (in place). */
static void gather_weights(trainer *t) {
    for (int i = 0; i < t->nruns; i++) {
        const gdn_shard_run *r = &t->runs[i];
        MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, t->w + r->lo, r->counts, r->displs, MPI_FLOAT,
                       group_of(t, r));
        count_bytes(t, r);
    }
}

/* One AdamW step: level 0 on every parameter, levels >= 1 on the owned slices (then gathered at
 * 1 and 2; level 3 gathers each unit when the model next needs it). */
void gdn_trainer_update(trainer *t, int64_t step, double lr, double scale) {
    const gdn_adamw_config *a = &t->o->opt;
    if (!t->o->zero) {
        gdn_adamw_update(a, &t->cfg, t->w, t->dw, t->m, t->v, step, lr, scale, t->threads);
        return;
    }
    const int twice = gdn_test_mutate("zero: a slice updated twice");
    for (int i = 0; i < t->nruns; i++) {
        const gdn_shard_run *r = &t->runs[i];
        for (int k = 0; k <= (twice && i == 0); k++)
            gdn_adamw_update_range(a, &t->cfg, own_weights(t, r), own_grads(t, r), moments_of(t, r, t->m),
                                   moments_of(t, r, t->v), r->own_lo, r->own_hi, step, lr, scale, t->threads);
    }
    if (t->o->zero < 3 && !gdn_test_mutate("zero: the updated weights not gathered (the other ranks' slices a step stale)"))
        gather_weights(t);
}

/* ------------------------------------------------------------------ levels 2 and 3: the units hook
 * The model calls it around each unit (model_group.h). Level 3 gathers a unit's runs from their
 * owners into the flat array before the model reads them (prefetching the next unit of the pass
 * with non-blocking all-gathers) and gives the pages back once it is done; levels 2 and 3
 * reduce-scatter each unit's gradient into the owned slices' array as soon as its backward is
 * complete; level 3 gives the unit's pages back once the sums have left. Level 2 keeps the
 * gradient array (the model's backward writes all of it, so its peak holds it anyway; giving
 * the pages back and touching them again each step cost 1.2x the step on a 2-core VM, measured). Every event that starts a collective first agrees the ranks'
 * statuses (one small all-reduce over the world), so a rank whose pass failed stops the others at
 * their next event instead of leaving them in a collective it never joins. */

typedef enum { PEND_NONE, PEND_GATHER, PEND_SCATTER } pend_kind;

/* The units' flat ranges. */
static size_t unit_lo(const trainer *t, int64_t u) { return gdn_model_unit_offset(&t->cfg, u); }
static size_t unit_len(const trainer *t, int64_t u) { return unit_lo(t, u + 1) - unit_lo(t, u); }

/* Start unit u's collectives (gather its weights or reduce-scatter its gradient) without waiting. */
static void start_unit(trainer *t, int64_t u, pend_kind kind) {
    gdn_shard_sched *z = &t->sched;

    const int mutate = kind == PEND_SCATTER && gdn_test_mutate("zero: one rank's gradient slice left out");
    const int replicas_summed = !gdn_test_mutate("train: expert gradients not summed over their replicas");
    for (int i = t->unit_first[u]; i < t->unit_first[u + 1]; i++) {
        const gdn_shard_run *r = &t->runs[i];
        MPI_Request *q = &z->req[z->nreq++];
        count_bytes(t, r);
        if (kind == PEND_GATHER) {
            MPI_Iallgatherv(t->w_own + r->at, r->counts[r->me], MPI_FLOAT, t->w + r->lo, r->counts, r->displs,
                            MPI_FLOAT, group_of(t, r), q);
        } else if (r->kind && !replicas_summed) { /* this replica's own gradient as if it were the sum */
            memcpy(t->dw_own + r->at, t->dw + r->own_lo, sizeof(float) * (size_t)r->counts[r->me]);
            *q = MPI_REQUEST_NULL;
        } else {
            if (mutate) leave_out(r, t->dw + r->lo);
            /* (never MPI_IN_PLACE: MPICH 4's reduce-scatter of uneven counts then copies between
             * overlapping ranges and aborts) */
            MPI_Ireduce_scatter(t->dw + r->lo, t->dw_own + r->at, r->counts, MPI_FLOAT, MPI_SUM, group_of(t, r), q);
        }
    }
    z->pend[z->npend++] = (gdn_shard_pending){.unit = u, .kind = kind, .last_req = z->nreq};
}

/* Wait for every pending collective up to and including the one of (unit, kind) (all of them when
 * unit < 0): collectives complete in the order they started; a finished reduce-scatter gives its
 * gradient's pages back. */
static void finish_pending(trainer *t, int64_t unit, int kind) {
    gdn_shard_sched *z = &t->sched;
    int upto = -1;
    for (int k = 0; k < z->npend; k++)
        if (unit < 0 || (z->pend[k].unit == unit && (int)z->pend[k].kind == kind)) upto = k;
    if (upto < 0) return;
    const int nreq = z->pend[upto].last_req;
    gdn_cp_wait_all(t->agree, nreq, z->req); /* sleeping between tests when the ranks outnumber the cores */
    for (int k = 0; k <= upto && t->o->zero >= 3; k++) /* the sums are in dw_own: the unit's gradient pages go back */
        if (z->pend[k].kind == PEND_SCATTER)
            gdn_release_pages(t->dw + unit_lo(t, z->pend[k].unit), sizeof(float) * unit_len(t, z->pend[k].unit));
    memmove(z->req, z->req + nreq, sizeof *z->req * (size_t)(z->nreq - nreq));
    z->nreq -= nreq;
    for (int k = upto + 1; k < z->npend; k++) z->pend[k - upto - 1] = z->pend[k], z->pend[k - upto - 1].last_req -= nreq;
    z->npend -= upto + 1;
}

/* Every rank's status, agreed before a collective starts: any failure stops every rank, naming
 * the first rank that failed. */
static int agree_event(trainer *t, int status) {
    struct { int status, rank; } mine = {status ? 1 : 0, -t->rank}, first;
    MPI_Allreduce(&mine, &first, 1, MPI_2INT, MPI_MAXLOC, t->world); /* (ties: the lowest rank) */
    if (!first.status) return GDN_OK;
    int code = status;
    MPI_Bcast(&code, 1, MPI_INT, -first.rank, t->world); /* its status */
    finish_pending(t, -1, 0); /* every rank started them: they complete */
    t->sched.failed = 1;
    return status ? status : gdn_fail(code, "rank %d failed (%s); see its message", -first.rank, gdn_strerror(code));
}

static int resident(const trainer *t, int64_t u) { return t->sched.gathered[u]; }

static int units_hook(void *ctx, int64_t u, int event, int status) {
    trainer *t = ctx;
    gdn_shard_sched *z = &t->sched;
    const int level3 = t->o->zero >= 3;
    /* the events that agree: every one at level 3; at level 2 the backward's (its reduce-scatters) */
    const int agreeing = level3 || z->dir < 0;
    int rc = GDN_OK;
    switch (event) {
    case GDN_UNIT_BEGIN:
        z->dir = u ? -1 : 1, z->failed = 0, z->last_need = -1;
        z->keep_embedding = !u && t->cfg.tie_embeddings; /* the forward's head reads unit 0 again */
        return GDN_OK;
    case GDN_UNIT_NEED:
        if (!level3) return GDN_OK;
        if ((rc = agree_event(t, GDN_OK))) return rc;
        if (!resident(t, u)) {
            /* a unit kept from an earlier pass (a test mutation: its weights a step stale) */
            const int stale = u == 1 && z->kept_stale && gdn_test_mutate("zero: a gathered layer stale by one step");
            if (!stale) {
                int started = 0;
                for (int k = 0; k < z->npend; k++) started |= z->pend[k].unit == u && z->pend[k].kind == PEND_GATHER;
                if (!started) start_unit(t, u, PEND_GATHER);
                finish_pending(t, u, PEND_GATHER);
            }
            z->gathered[u] = 1;
        }
        /* prefetch the pass's next unit while this one computes (not after the tied head's second
         * need of the embedding: the forward ends there) */
        const int64_t next = u + z->dir;
        const int in_order = z->last_need < 0 || u == z->last_need + z->dir;
        z->last_need = u;
        if (in_order && next >= 1 && next <= t->cfg.L + 1 && !resident(t, next)) {
            int started = 0;
            for (int k = 0; k < z->npend; k++) started |= z->pend[k].unit == next && z->pend[k].kind == PEND_GATHER;
            if (!started) start_unit(t, next, PEND_GATHER);
        }
        return GDN_OK;
    case GDN_UNIT_DONE:
        if (!level3) return GDN_OK;
        if (u == 1 && gdn_test_mutate("zero: a gathered layer stale by one step")) {
            z->kept_stale = 1; /* never given back, never gathered again */
            return GDN_OK;
        }
        if (u == 0 && z->keep_embedding) { /* (gathering it again would cost what holding it saves) */
            z->keep_embedding = 0;
            return GDN_OK;
        }
        gdn_release_pages(t->w + unit_lo(t, u), sizeof(float) * unit_len(t, u));
        z->gathered[u] = 0;
        return GDN_OK;
    case GDN_UNIT_GRADS:
        if ((rc = agree_event(t, GDN_OK))) return rc;
        start_unit(t, u, PEND_SCATTER);
        return GDN_OK;
    case GDN_UNIT_END:
        if (agreeing) rc = agree_event(t, GDN_OK);
        finish_pending(t, -1, 0);
        return rc;
    default: /* GDN_UNIT_FAILED: meet the peers' next agreeing event, unless one agreed it already */
        if (agreeing && !z->failed) agree_event(t, status);
        finish_pending(t, -1, 0);
        z->failed = 0;
        return status;
    }
}

int gdn_trainer_units_setup(trainer *t) {
    if (t->o->zero < 2) return GDN_OK;
    const int64_t U = t->cfg.L + 2;
    gdn_shard_sched *z = &t->sched;
    t->unit_first = gdn_calloc("trainer_shard: unit_first", (size_t)U + 1, sizeof *t->unit_first);
    z->gathered = gdn_calloc("trainer_shard: gathered", (size_t)U, sizeof *z->gathered);
    z->req = gdn_malloc("trainer_shard: req", sizeof *z->req * (size_t)(2 * t->nruns + 2));
    z->pend = gdn_malloc("trainer_shard: pend", sizeof *z->pend * (size_t)(2 * U + 2));
    if (!t->unit_first || !z->gathered || !z->req || !z->pend)
        return gdn_fail(GDN_ERR_NOMEM, "the units' tables of --zero %d", t->o->zero);
    for (int64_t u = 0, i = 0; u <= U; u++) {
        while (i < t->nruns && t->runs[i].lo < unit_lo(t, u)) i++;
        t->unit_first[u] = (int)i;
    }
    gdn_model_units_hook hook = {.ctx = t, .call = units_hook};
    return gdn_model_plan_set_units_hook(t->plan, &hook);
}

/* The starting weights from the seed: level 3 draws only this rank's slices (the whole array is
 * never held), the others the whole array. */
void gdn_trainer_init_weights(trainer *t) {
    if (t->o->zero < 3) {
        gdn_model_init(&t->cfg, t->w, t->o->seed);
        return;
    }
    for (int i = 0; i < t->nruns; i++)
        gdn_model_init_range(&t->cfg, t->w_own + t->runs[i].at, t->o->seed, t->runs[i].own_lo, t->runs[i].own_hi);
}

/* Level 3 after the weights are loaded whole: this rank's slices kept apart,
 * the flat array's pages given back (the units are gathered when the model needs them). */
void gdn_trainer_keep_slices(trainer *t) {
    for (int i = 0; t->o->zero >= 3 && i < t->nruns; i++) {
        const gdn_shard_run *r = &t->runs[i];
        memcpy(t->w_own + r->at, t->w + r->own_lo, sizeof(float) * (size_t)r->counts[r->me]);
    }
}

void gdn_trainer_release_weights(trainer *t) {
    if (t->o->zero >= 3) gdn_release_pages(t->w, sizeof(float) * t->nw);
}

/* A resume at level >= 1: this rank's slices of the moments (and of the fp32 master weights of a
 * BF16 save) from the checkpoint, whatever grid and level wrote it, then (levels 1, 2) the
 * weights gathered. */
int gdn_trainer_load_slices(trainer *t, const char *dir) {
    int rc = GDN_OK;
    for (int i = 0; i < t->nruns && !rc; i++) {
        const gdn_shard_run *r = &t->runs[i];
        rc = gdn_ckpt_load_part(dir, &t->cfg, r->own_lo, r->own_hi, own_weights(t, r), moments_of(t, r, t->m),
                                moments_of(t, r, t->v));
    }
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    if (t->o->zero < 3) gather_weights(t);
    return GDN_OK;
}

/* The trainer's state for a checkpoint: what a resume must find unchanged, and where it was. */
static char *state_json(const trainer *t, int64_t step, double loss) {
    const gdn_train_options *o = t->o;
    char hex[2 * GDN_DATA_MAX_SEP + 1];
    gdn_trainer_pack_hex(o, hex);
    json_t *j = json_pack("{s:I, s:I, s:I, s:I, s:f, s:s, s:I, s:f, s:I, s:I, s:f, s:s, s:I, s:s, s:I, s:I, s:s}", "step",
                          (json_int_t)step, "seed", (json_int_t)o->seed, "seq", (json_int_t)o->seq,
                          "global_batch", (json_int_t)(o->batch * t->dp), "val_fraction",
                          o->val_fraction, "data", o->data, "data_bytes",
                          (json_int_t)(gdn_data_split_len(t->data, GDN_SPLIT_TRAIN) +
                                       gdn_data_split_len(t->data, GDN_SPLIT_VAL)),
                          "loss", loss, "dp", (json_int_t)t->dp, "cp", (json_int_t)t->cp_size,
                          "lr_peak", o->opt.lr, "pack_separator_hex", hex, "pack_separator_id",
                          (json_int_t)gdn_trainer_pack_id(o), "data_kind", t->data_info.tokens ? "tokens" : "text",
                          "zero", (json_int_t)o->zero, "ep", (json_int_t)t->ep_size, "run_id", t->run_id);
    char *s = j ? json_dumps(j, JSON_INDENT(2) | JSON_SORT_KEYS) : NULL;
    json_decref(j);
    return s;
}

/* A checkpoint: rank 0 begins it, every rank writes what it owns (its slices; replicated state
 * unsharded and without --ep, everything by rank 0), rank 0 finishes it once all have written. */
int gdn_trainer_save(trainer *t, int64_t step, double loss) {
    gdn_ckpt_parts p;
    int rc = GDN_OK;
    if (t->rank == 0) rc = gdn_ckpt_parts_begin(&p, t->o->out, step, &t->cfg, 1, t->o->save_dtype);
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    MPI_Bcast(&p, (int)sizeof p, MPI_BYTE, 0, t->world);
    const int all_mine = !t->o->zero && t->ep_size <= 1;
    if (all_mine && t->rank == 0) rc = gdn_ckpt_parts_write(&p, &t->cfg, 0, t->nw, t->w, t->m, t->v);
    for (int i = 0; i < t->nruns && !all_mine && !rc; i++) {
        const gdn_shard_run *r = &t->runs[i];
        rc = gdn_ckpt_parts_write(&p, &t->cfg, r->own_lo, r->own_hi, own_weights(t, r), moments_of(t, r, t->m),
                                  moments_of(t, r, t->v));
    }
    rc = gdn_cp_agree_status(t->agree, rc);
    if (t->rank == 0) {
        if (rc) {
            gdn_ckpt_parts_abort(&p);
        } else {
            char *st = state_json(t, step, loss);
            rc = st ? gdn_ckpt_parts_finish(&p, st, t->o->keep_last) : gdn_fail(GDN_ERR_NOMEM, "trainer state");
            free(st);
        }
        if (!rc && t->progress) {
            gdn_trainer_clear_status(t);
            fprintf(t->progress, "checkpoint: %s/checkpoint-%08lld\n", t->o->out, (long long)step);
            fflush(t->progress);
        }
    }
    return gdn_cp_agree_status(t->agree, rc);
}

/* Rank 0's line on what the sharding moved: the mean bytes a step on each rank (the steps'
 * forward, backward and update; validation's gathers included at level 3). */
void gdn_trainer_zero_summary(trainer *t, int64_t steps) {
    double most = 0;
    MPI_Reduce(&t->zero_bytes, &most, 1, MPI_DOUBLE, MPI_MAX, 0, t->world);
    if (!t->progress || steps < 1) return;
    char b[24];
    gdn_trainer_fmt_bytes(b, sizeof b, most / (double)steps);
    static const char *const what[4] = {"the gradients' all-reduce", "the gradients' all-reduce and the weights' all-gather",
                                        "the gradients' reduce-scatter and the weights' all-gather",
                                        "the gradients' reduce-scatter and each unit's weights gathered for the forward and again for the backward"};
    fprintf(t->progress, "gdncp train: --zero %d moved %s a step on the busiest rank (%s; sent and received alike)\n",
            t->o->zero, b, what[t->o->zero]);
}
