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
    free(t->runs);
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
    }
    return GDN_OK;
}

/* The moments of run r's owned slice in m or v: level 0 holds everything by flat offset. */
static float *moments_of(const trainer *t, const gdn_shard_run *r, float *a) {
    return a + (t->o->zero ? r->at : r->own_lo);
}

/* The gradients summed where their weights are shared: everything over the grid, the routed
 * experts' tensors under --ep only over their replicas. Each run is reduce-scattered (every slice
 * summed once, at its owner, in the same order at every level), then at levels 0 and 1
 * all-gathered (the all-reduce; the same bits on every rank, so the replicas never drift apart);
 * level 2 keeps only the owned slices' sums (half the bytes). */
void gdn_trainer_reduce_grads(trainer *t) {
    const int replicas_summed = !gdn_test_mutate("train: expert gradients not summed over their replicas");
    const int leave_out = gdn_test_mutate("zero: one rank's gradient slice left out");
    for (int i = 0; i < t->nruns; i++) {
        const gdn_shard_run *r = &t->runs[i];
        float *g = t->dw + r->lo;
        if (r->kind && !replicas_summed) continue;
        if (leave_out && r->me == r->size - 1 && r->size > 1) memset(g, 0, sizeof *g * (r->hi - r->lo));
        if (r->size < 2) continue;
        /* in place: the owned slice's sum lands at the front of the run */
        MPI_Reduce_scatter(MPI_IN_PLACE, g, r->counts, MPI_FLOAT, MPI_SUM, group_of(t, r));
        memmove(t->dw + r->own_lo, g, sizeof *g * (size_t)r->counts[r->me]);
        if (t->o->zero < 2)
            MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, g, r->counts, r->displs, MPI_FLOAT, group_of(t, r));
    }
}

/* The gradient's norm over the whole model, at every level from the owned slices: their squares
 * summed over the world (each element is owned by one rank of it), reduced on rank 0 and
 * broadcast (the same bits everywhere). */
double gdn_trainer_grad_norm(trainer *t) {
    double mine = 0, s[2], all = 0;
    for (int i = 0; i < t->nruns; i++) {
        gdn_grad_sumsq_range(&t->cfg, t->dw, t->runs[i].own_lo, t->runs[i].own_hi, s);
        mine += s[0] + s[1];
    }
    MPI_Reduce(&mine, &all, 1, MPI_DOUBLE, MPI_SUM, 0, t->world);
    MPI_Bcast(&all, 1, MPI_DOUBLE, 0, t->world);
    return sqrt(all);
}

/* Level >= 1: the updated slices to every rank of their groups (in place). */
static void gather_weights(trainer *t) {
    for (int i = 0; i < t->nruns; i++) {
        const gdn_shard_run *r = &t->runs[i];
        MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, t->w + r->lo, r->counts, r->displs, MPI_FLOAT,
                       group_of(t, r));
    }
}

/* One AdamW step: level 0 on every parameter, levels >= 1 on the owned slices, then gathered. */
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
            gdn_adamw_update_range(a, &t->cfg, t->w, t->dw, moments_of(t, r, t->m), moments_of(t, r, t->v), r->own_lo,
                                   r->own_hi, step, lr, scale, t->threads);
    }
    if (!gdn_test_mutate("zero: the updated weights not gathered (the other ranks' slices a step stale)"))
        gather_weights(t);
}

/* A resume at level >= 1: this rank's slices of the moments (and of the fp32 master weights of a
 * BF16 save) from the checkpoint, whatever grid and level wrote it, then the weights gathered. */
int gdn_trainer_load_slices(trainer *t, const char *dir) {
    int rc = GDN_OK;
    for (int i = 0; i < t->nruns && !rc; i++) {
        const gdn_shard_run *r = &t->runs[i];
        rc = gdn_ckpt_load_part(dir, &t->cfg, r->own_lo, r->own_hi, t->w, moments_of(t, r, t->m),
                                moments_of(t, r, t->v));
    }
    if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
    gather_weights(t);
    return GDN_OK;
}

/* The trainer's state for a checkpoint: what a resume must find unchanged, and where it was. */
static char *state_json(const trainer *t, int64_t step, double loss) {
    const gdn_train_options *o = t->o;
    char hex[2 * GDN_DATA_MAX_SEP + 1];
    gdn_trainer_pack_hex(o, hex);
    json_t *j = json_pack("{s:I, s:I, s:I, s:I, s:f, s:s, s:I, s:f, s:I, s:I, s:f, s:s, s:I, s:s, s:I, s:I}", "step",
                          (json_int_t)step, "seed", (json_int_t)o->seed, "seq", (json_int_t)o->seq,
                          "global_batch", (json_int_t)(o->batch * t->dp), "val_fraction",
                          o->val_fraction, "data", o->data, "data_bytes",
                          (json_int_t)(gdn_data_split_len(t->data, GDN_SPLIT_TRAIN) +
                                       gdn_data_split_len(t->data, GDN_SPLIT_VAL)),
                          "loss", loss, "dp", (json_int_t)t->dp, "cp", (json_int_t)t->cp_size,
                          "lr_peak", o->opt.lr, "pack_separator_hex", hex, "pack_separator_id",
                          (json_int_t)gdn_trainer_pack_id(o), "data_kind", t->data_info.tokens ? "tokens" : "text",
                          "zero", (json_int_t)o->zero, "ep", (json_int_t)t->ep_size);
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
        rc = gdn_ckpt_parts_write(&p, &t->cfg, r->own_lo, r->own_hi, t->w, moments_of(t, r, t->m),
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
