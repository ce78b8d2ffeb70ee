/* The trainer's reports (train.h): the status line, the time per layer type, the experts' load and
 * the expert-parallel summary. */
#include "trainer_internal.h"

/* h:mm:ss (or m:ss) of a duration in seconds. */
void gdn_trainer_fmt_duration(char *buf, size_t n, double secs) {
    const long s = secs > 0 && secs < 1e9 ? (long)(secs + 0.5) : 0;
    if (s >= 3600) snprintf(buf, n, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
    else snprintf(buf, n, "%ld:%02ld", s / 60, s % 60);
}

/* Rank 0 with --progress line: erase the status line before a full line is printed. */
void gdn_trainer_clear_status(trainer *t) {
    if (t->progress && t->o->progress_line && t->status_shown) fputs("\r\033[K", t->progress), t->status_shown = 0;
}

/* The time per step by layer type, mean over the steps run: each rank's seconds in its
 * GatedDeltaNet and attention mixers (forward + backward, their CP waits included), the mean over
 * ranks with the range; the rest is the step (the slowest rank's) minus the mean of both. */
void gdn_trainer_layer_type_times(trainer *t, const double mixer_sum[4], double step_sum, int64_t steps) {
    if (steps < 1) return;
    /* per rank: GatedDeltaNet forward, backward, both; attention forward, backward, both */
    const double v[6] = {mixer_sum[0], mixer_sum[1], mixer_sum[0] + mixer_sum[1],
                         mixer_sum[2], mixer_sum[3], mixer_sum[2] + mixer_sum[3]};
    double mean[6], lo[6], hi[6];
    MPI_Allreduce(v, mean, 6, MPI_DOUBLE, MPI_SUM, t->world);
    MPI_Allreduce(v, lo, 6, MPI_DOUBLE, MPI_MIN, t->world);
    MPI_Allreduce(v, hi, 6, MPI_DOUBLE, MPI_MAX, t->world);
    if (!t->progress) return;
    const double per = 1.0 / (double)steps;
    for (int i = 0; i < 6; i++) mean[i] *= per / (double)t->size, lo[i] *= per, hi[i] *= per;
    gdn_trainer_clear_status(t);
    fprintf(t->progress, "gdncp train: time per step by layer type (mean of %lld steps; over %d ranks: mean, "
                         "min-max): GatedDeltaNet layers %.3f s (forward %.3f, backward %.3f; %.3f-%.3f), attention "
                         "layers %.3f s (forward %.3f, backward %.3f; %.3f-%.3f), the rest %.3f s of %.3f s\n",
            (long long)steps, t->size, mean[2], mean[0], mean[1], lo[2], hi[2], mean[5], mean[3], mean[4], lo[5], hi[5],
            step_sum * per - mean[2] - mean[5], step_sum * per);
    fflush(t->progress);
}

/* The experts' load over the steps run, summed over every rank: per MoE layer the (token, slot)
 * choices per expert, min / mean / max and the busiest expert's share over the mean (1.00:
 * balanced), the aux loss's target. */
void gdn_trainer_expert_load(trainer *t) {
    const int64_t nm = gdn_model_moe_layers(&t->cfg), n = t->cfg.n_experts;
    if (!nm) return;
    double *c = t->load, *all = t->load + nm * n;
    gdn_model_expert_load(t->plan, c, 1);
    MPI_Reduce(c, all, (int)(nm * n), MPI_DOUBLE, MPI_SUM, 0, t->world);
    if (t->progress) {
        gdn_trainer_clear_status(t);
        fprintf(t->progress, "gdncp train: expert load (tokens x slots per expert over the run, all ranks):");
        for (int64_t m = 0, l = 0; m < nm; m++, l++) {
            while (!t->cfg.moe[l]) l++;
            double lo = INFINITY, hi = 0, sum = 0;
            for (int64_t e = 0; e < n; e++) {
                const double v = all[m * n + e];
                lo = v < lo ? v : lo, hi = v > hi ? v : hi, sum += v;
            }
            const double mean = sum / (double)n;
            fprintf(t->progress, "%s layer %lld min %.0f mean %.1f max %.0f (%.2fx)", m ? ";" : "", (long long)l, lo,
                    mean, hi, mean > 0 ? hi / mean : 0.0);
        }
        fprintf(t->progress, "\n");
        fflush(t->progress);
    }
}

/* Expert parallelism over the run: what each rank holds of the experts, what its all-to-alls
 * moved and waited, and how evenly the rows fell on the ranks (the busiest rank's rows over the
 * mean: the experts' GEMMs wait for it). */
void gdn_trainer_ep_summary(trainer *t, int64_t steps) {
    if (!t->ep || steps < 1) return;
    gdn_ep_stats st;
    gdn_ep_get_stats(t->ep, &st, 1);
    double expert_floats = 0, all_floats = 0;
    gdn_model_tensor_info ti;
    for (int i = 0; i < gdn_model_tensor_count(&t->cfg); i++) {
        gdn_model_tensor(&t->cfg, i, &ti);
        all_floats += (double)ti.numel;
        if (ti.experts_whole) expert_floats += (double)ti.numel;
    }
    const double mine[5] = {st.exchange_s, st.experts_s, st.bytes_sent + st.bytes_recv, st.rows_owned, expert_floats};
    double *all = t->rank == 0 ? gdn_malloc("trainer_report: all", sizeof mine * (size_t)t->size) : NULL;
    MPI_Gather(mine, 5, MPI_DOUBLE, all, 5, MPI_DOUBLE, 0, t->world);
    if (!all) return;
    if (t->progress) {
        double mx[5] = {0}, mean[5] = {0};
        for (int r = 0; r < t->size; r++)
            for (int k = 0; k < 5; k++) {
                const double v = all[5 * r + k];
                mx[k] = v > mx[k] ? v : mx[k], mean[k] += v / (double)t->size;
            }
        const double whole = all_floats + expert_floats * (double)(t->ep_size - 1);
        const double per_step = 1.0 / (double)steps, layers = (double)gdn_model_moe_layers(&t->cfg);
        gdn_trainer_clear_status(t);
        fprintf(t->progress,
                "gdncp train: expert parallelism over %d ranks per group: %lld of %lld experts per MoE layer on each "
                "rank: %.0f expert parameters and %.0f in all, %.3f of the whole model's %.0f (weights, gradients and "
                "moments alike); per step and rank (mean, max): all-to-all wait %.4f s, %.4f s, bytes %.3g, %.3g "
                "(per MoE layer %.3g, %.3g), the experts' GEMMs on the rows they own %.4f s, %.4f s; rows imbalance "
                "(busiest rank / mean) %.2fx\n",
                t->ep_size, (long long)(t->cfg.n_experts / t->ep_size), (long long)t->cfg.n_experts, mean[4],
                all_floats, all_floats / whole, whole, mean[0] * per_step, mx[0] * per_step, mean[2] * per_step,
                mx[2] * per_step, mean[2] * per_step / layers, mx[2] * per_step / layers, mean[1] * per_step,
                mx[1] * per_step, mean[3] > 0 ? mx[3] / mean[3] : 0.0);
        fflush(t->progress);
    }
    free(all);
}

/* bytes as "152 kB", "3.21 MB", "7.53 GB" (decimal units, three significant digits). */
void gdn_trainer_fmt_bytes(char *buf, size_t n, double bytes) {
    static const char *const unit[] = {"B", "kB", "MB", "GB", "TB", "PB"};
    int u = 0;
    while (bytes >= 1000 && u < 5) bytes /= 1000, u++;
    snprintf(buf, n, "%.3g %s", bytes, unit[u]);
}
