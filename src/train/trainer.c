/* The training loop (train.h): data windows, steps, validation, logging; the set-up, the grid's
 * sums and the reports are in trainer_setup.c, trainer_grid.c, trainer_report.c. */
#include "trainer_internal.h"

/* Validation windows come from their own stream: the same windows at every evaluation. */
#define VAL_SEED_SALT 0x56414c4944415445ull

gdn_train_options gdn_train_defaults(void) {
    gdn_train_options o;
    memset(&o, 0, sizeof o);
    gdn_model_config_named("tiny", &o.model);
    o.val_fraction = 0.05;
    o.seq = 256, o.batch = 8, o.steps = 200;
    o.opt = gdn_adamw_default();
    o.seed = 1234;
    o.cp = 1, o.strategy = GDN_CP_SCAN;
    o.recompute = -1;
    o.keep_last = 2;
    o.eval_every = 50, o.eval_seqs = 16;
    o.log_every = 1;
    o.router_aux_coef = -1;
    return o;
}

/* Read this rank's rows of a batch: row r's window of seq + 1 tokens, this rank's shard of it.
 * Packing: every rank reads the rows' whole windows (ids; cheap next to a step) to find their
 * documents, and gives them to the model. *targets: the targets this rank predicts. */
static int read_batch(trainer *t, int split, int64_t step, int64_t row0, int64_t *targets) {
    const gdn_train_options *o = t->o;
    const int64_t len = gdn_data_split_len(t->data, split);
    const uint64_t seed = split == GDN_SPLIT_VAL ? o->seed ^ VAL_SEED_SALT : o->seed;
    int64_t at = 0;
    for (int64_t b = 0; b < o->batch; b++) {
        const int64_t start = gdn_data_window(seed, step, row0 + b, len, o->seq + 1);
        if (start < 0) return GDN_ERR_SHAPE; /* gdn_data_window named the sizes */
        gdn_token *mine = t->tokens + b * (t->tn + 1);
        int rc;
        if (!t->sep_len) {
            rc = gdn_data_read(t->data, split, start + t->t0, t->tn + 1, mine);
        } else {
            const gdn_token *ids = NULL;
            rc = gdn_data_window_docs(t->data, split, start, o->seq + 1, t->sep, t->sep_len, t->window, &ids,
                                      t->doc_cu + at, &t->n_docs[b]);
            if (!rc) memcpy(mine, ids + t->t0, sizeof *mine * (size_t)(t->tn + 1)), at += t->n_docs[b] + 1;
        }
        if (rc) return rc;
    }
    *targets = o->batch * t->tn;
    return t->sep_len ? gdn_model_set_docs(t->plan, t->doc_cu, t->n_docs, t->t0, targets) : GDN_OK;
}

static int evaluate(trainer *t, double *val_loss) {
    const gdn_train_options *o = t->o;
    const int64_t per_round = o->batch * t->dp;
    const int64_t rounds = (o->eval_seqs + per_round - 1) / per_round;
    double sum = 0, count = 0;
    for (int64_t r = 0; r < rounds; r++) {
        int64_t targets = 0;
        double denom = 0, ls = 0;
        int rc = read_batch(t, GDN_SPLIT_VAL, 0, r * per_round + t->dp_index * o->batch, &targets);
        if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
        if ((rc = gdn_cp_agree_status(t->agree, gdn_trainer_grid_targets(t, targets, &denom)))) return rc;
        rc = gdn_model_forward(t->plan, t->w, t->tokens, 1.0, &ls, 0);
        if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc; /* before the next collective */
        sum += ls, count += denom;
    }
    *val_loss = gdn_trainer_world_sum(t, sum) / count;
    return GDN_OK;
}

static int train_steps(trainer *t) {
    const gdn_train_options *o = t->o;
    const double t_start = MPI_Wtime();
    const double tokens_per_step = (double)(o->batch * t->dp) * (double)o->seq;
    double loss = NAN;
    int rc = GDN_OK;
    double mixer_sum[4] = {0}, step_sum = 0; /* this rank's seconds in each kind of mixer; steps' */
    for (int64_t step = t->first_step; step <= o->steps; step++) {
        const double t_begin = MPI_Wtime();
        int64_t targets = 0;
        double denom = 0;
        rc = read_batch(t, GDN_SPLIT_TRAIN, step, t->dp_index * o->batch, &targets);
        if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
        if ((rc = gdn_cp_agree_status(t->agree, gdn_trainer_grid_targets(t, targets, &denom)))) return rc;
        double ls = 0, aux = 0;
        rc = gdn_model_forward(t->plan, t->w, t->tokens, denom, &ls, 1);
        /* every DP group's forward done before the world's sums: the MoE routers' statistics, and
         * under --zero 2 the backward's reduce-scatters */
        if (gdn_model_moe_layers(&t->cfg) || t->o->zero == 2) {
            if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
            rc = gdn_trainer_grid_router_stats(t, &aux);
        }
        if (!rc) rc = gdn_model_backward(t->plan, t->w, t->dw, t->tokens);
        /* a failure inside is its CP group's; make it every DP group's before the reduction */
        if ((rc = gdn_cp_agree_status(t->agree, rc))) return rc;
        gdn_trainer_reduce_grads(t);
        loss = gdn_trainer_world_sum(t, ls) / denom + (t->cfg.router_aux ? t->cfg.router_aux_coef * aux : 0.0);
        const double gnorm = gdn_trainer_grad_norm(t);
        if (!isfinite(loss) || !isfinite(gnorm))
            return gdn_fail(GDN_ERR_NONFINITE, "step %lld: the loss (%g) or gradient norm (%g) is not finite: "
                            "training diverged (lower --lr)", (long long)step, loss, gnorm);
        const double lr = gdn_adamw_lr(&o->opt, step);
        const double scale = o->opt.clip > 0 && gnorm > o->opt.clip ? o->opt.clip / gnorm : 1.0;
        gdn_trainer_update(t, step, lr, scale);
        double dt = MPI_Wtime() - t_begin;
        MPI_Allreduce(MPI_IN_PLACE, &dt, 1, MPI_DOUBLE, MPI_MAX, t->world);
        double ms[4];
        gdn_model_mixer_seconds(t->plan, ms, 1);
        for (int i = 0; i < 4; i++) mixer_sum[i] += ms[i];
        step_sum += dt;

        double val = NAN;
        if (o->eval_every && (step % o->eval_every == 0 || step == o->steps)) {
            if ((rc = evaluate(t, &val))) return rc;
            gdn_model_mixer_seconds(t->plan, ms, 1); /* (validation's forwards are not a step's) */
        }
        /* peak memory of every rank, for the progress line */
        double rss = gdn_peak_rss_mb();
        double *all = t->rank == 0 ? gdn_malloc("trainer: all", sizeof(double) * (size_t)t->size) : NULL;
        MPI_Gather(&rss, 1, MPI_DOUBLE, all, 1, MPI_DOUBLE, 0, t->world);
        if (t->rank == 0) {
            double rmax = 0;
            for (int r = 0; r < t->size; r++) rmax = all[r] > rmax ? all[r] : rmax;
            const double tps = tokens_per_step / dt, frac = tps * t->flops_per_token / (t->peak_gflops * 1e9);
            const int full = o->log_every <= 1 || step % o->log_every == 0 || step == t->first_step ||
                             step == o->steps || !isnan(val);
            if (t->progress && !full && o->progress_line) {
                char el[32], eta[32];
                const double elapsed = MPI_Wtime() - t_start;
                gdn_trainer_fmt_duration(el, sizeof el, elapsed);
                gdn_trainer_fmt_duration(eta, sizeof eta, elapsed / (double)(step - t->first_step + 1) * (double)(o->steps - step));
                fprintf(t->progress, "\rstep %5lld/%lld  loss %.4f  %8.0f tok/s  elapsed %s  ETA %s\033[K",
                        (long long)step, (long long)o->steps, loss, tps, el, eta);
                fflush(t->progress);
                t->status_shown = 1;
            }
            if (t->progress && full) {
                gdn_trainer_clear_status(t);
                fprintf(t->progress, "step %5lld/%lld  loss %.4f", (long long)step, (long long)o->steps, loss);
                if (!isnan(val)) fprintf(t->progress, "  val %.4f", val);
                if (gdn_model_moe_layers(&t->cfg)) fprintf(t->progress, "  aux %.4f", aux);
                fprintf(t->progress, "  %8.0f tok/s  %7.1f ms/step  lr %.2e  gnorm %.3f  %4.1f%% of peak  rss MB",
                        tps, 1e3 * dt, lr, gnorm, 100 * frac);
                if (t->size <= 8)
                    for (int r = 0; r < t->size; r++) fprintf(t->progress, " %.0f", all[r]);
                else
                    fprintf(t->progress, " max %.0f over %d ranks", rmax, t->size);
                fprintf(t->progress, "\n");
                fflush(t->progress);
            }
            if (t->csv) {
                fprintf(t->csv, "%lld,%.6f,", (long long)step, loss);
                if (!isnan(val)) fprintf(t->csv, "%.6f", val);
                fprintf(t->csv, ",%.1f,%.1f,%.6g,%.6g,%.2f,", tps, rmax, lr, gnorm, 1e3 * dt);
                if (gdn_model_moe_layers(&t->cfg)) fprintf(t->csv, "%.6f", aux);
                fprintf(t->csv, "\n");
                fflush(t->csv);
            }
        }
        free(all);
        if (o->out && ((o->save_every && step % o->save_every == 0) || step == o->steps))
            if ((rc = gdn_trainer_save(t, step, loss))) return rc;
    }
    gdn_trainer_layer_type_times(t, mixer_sum, step_sum, o->steps - t->first_step + 1);
    gdn_trainer_expert_load(t);
    gdn_trainer_ep_summary(t, o->steps - t->first_step + 1);
    gdn_trainer_zero_summary(t, o->steps - t->first_step + 1);
    return GDN_OK;
}

int gdn_train(MPI_Comm world, const gdn_train_options *o, FILE *progress) {
    trainer t;
    memset(&t, 0, sizeof t);
    t.o = o, t.world = world, t.cp_comm = t.ep_comm = t.replica_comm = MPI_COMM_NULL;
    MPI_Comm_rank(world, &t.rank);
    MPI_Comm_size(world, &t.size);
    t.progress = t.rank == 0 ? progress : NULL;
    int rc = gdn_cp_create(&t.agree, world);
    if (rc) return rc;
    rc = gdn_trainer_setup(&t);
    if (!rc && !o->dry_run) rc = train_steps(&t);
    rc = gdn_cp_agree_status(t.agree, rc);
    if (t.csv) fclose(t.csv);
    gdn_model_plan_destroy(t.plan);
    gdn_data_close(t.data);
    gdn_cp_destroy(t.cp);
    gdn_cp_destroy(t.agree);
    gdn_ep_destroy(t.ep);
    gdn_cp_destroy(t.replica_agree);
    if (t.cp_comm != MPI_COMM_NULL) MPI_Comm_free(&t.cp_comm);
    if (t.ep_comm != MPI_COMM_NULL) MPI_Comm_free(&t.ep_comm);
    if (t.replica_comm != MPI_COMM_NULL) MPI_Comm_free(&t.replica_comm);
    gdn_trainer_shard_free(&t);
    free(t.w), free(t.dw), free(t.m), free(t.v), free(t.router), free(t.load), free(t.tokens), free(t.window), free(t.doc_cu), free(t.n_docs);
    return rc;
}
