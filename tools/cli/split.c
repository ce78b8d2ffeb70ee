/* The pieces every --cp subcommand shares: this rank's shard of the tokens, the first agreement
 * of options between ranks (and joining it with a failure), the memory check of the ranks on
 * one machine, and writing every rank's rows into one file. */
#include "cli.h"
#include "gdncp/cp.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

int cli_shard_of(const char *spec, int D, int rank, int64_t T, int64_t *t0, int64_t *tn) {
    if (!spec) { /* (decided from T and D alone, so every rank reaches the same verdict) */
        if (T < D) {
            if (!rank)
                fprintf(stderr, "gdncp: %d ranks for T = %lld tokens: more ranks than tokens (each rank needs at "
                                "least one)\n", D, (long long)T);
            return 1;
        }
        *tn = T / D + (rank < T % D);
        *t0 = rank * (T / D) + (rank < T % D ? rank : T % D);
        return 0;
    }
    int64_t acc = 0, n = 0;
    const char *p = spec;
    while (*p) {
        char *end = (char *)p;
        errno = 0;
        /* digits only (strtoll would also take blanks and signs), and no empty last entry */
        long long v = *p >= '0' && *p <= '9' ? strtoll(p, &end, 10) : 0;
        if (v < 1 || errno || (*end && *end != ',') || (*end == ',' && !end[1])) {
            if (!rank) fprintf(stderr, "gdncp: --shards needs positive integers separated by commas, got '%s'\n", spec);
            return 1;
        }
        if (v > T - acc) { /* (also keeps acc + v from overflowing) */
            if (!rank) fprintf(stderr, "gdncp: --shards '%s' sums to more than T = %lld\n", spec, (long long)T);
            return 1;
        }
        if (n == rank) *t0 = acc, *tn = v;
        acc += v, n++;
        p = *end ? end + 1 : end;
    }
    if (n != D || acc != T) {
        if (!rank) fprintf(stderr, "gdncp: --shards lists %lld sizes summing to %lld; need %d sizes (one per rank) summing to T = %lld\n",
                (long long)n, (long long)acc, D, (long long)T);
        return 1;
    }
    return 0;
}

int cli_cp_write_rows(gdn_cp *cp, const char *path, const char *producer, int64_t B, int64_t T_full,
                      int64_t t0, int64_t tn, const cli_out_tensor *t, int n,
                      int (*add_more)(gdn_st_writer *w, int rank, void *ctx), void *ctx) {
    const int rank = gdn_cp_rank(cp);
    /* every rank builds the same writer: the layout (header, offsets) agrees without messages;
     * rank 0 also holds the whole-sequence tensors (states) and writes them with the header */
    gdn_st_writer *w = NULL;
    int rc = gdn_st_writer_create(&w);
    if (!rc) rc = gdn_st_writer_metadata(w, "producer", producer);
    for (int i = 0; i < n && !rc; i++)
        if (t[i].data || t[i].rows) /* a rows tensor absent here is absent on every rank (agreed) */
            rc = gdn_st_writer_add(w, t[i].name, GDN_F32, t[i].ndim, t[i].shape,
                                   t[i].rows || rank ? NULL : t[i].data, GDN_F32);
    if (!rc && add_more) rc = add_more(w, rank, ctx);
    char tmp[4096] = {0};
    if (!rank && !rc) rc = gdn_st_writer_begin(w, path, tmp, sizeof tmp);
    if ((rc = gdn_cp_agree_status(cp, rc))) goto done;
    if (MPI_Bcast(tmp, sizeof tmp, MPI_CHAR, 0, MPI_COMM_WORLD) != MPI_SUCCESS) {
        rc = gdn_cp_agree_status(cp, GDN_ERR_MPI);
        goto done;
    }
    for (int i = 0; i < n && !rc; i++) {
        if (!t[i].rows || !t[i].data) continue;
        uint64_t off;
        int64_t inner = 1; /* a 2-D rows tensor is [T_full, inner] (B = 1) */
        for (int d = t[i].ndim == 2 ? 1 : 2; d < t[i].ndim; d++) inner *= t[i].shape[d];
        rc = gdn_st_writer_offset(w, t[i].name, &off);
        for (int64_t b = 0; b < B && !rc; b++)
            rc = gdn_st_write_at(tmp, off + 4 * (uint64_t)((b * T_full + t0) * inner), t[i].data + b * tn * inner,
                                 (size_t)(tn * inner));
    }
    /* all rows on disk everywhere before the rename */
    rc = gdn_cp_agree_status(cp, rc);
    if (!rank) {
        if (!rc) rc = gdn_st_commit(tmp, path);
        else unlink(tmp);
    }
    rc = gdn_cp_agree_status(cp, rc);
done:
    gdn_st_writer_destroy(w);
    return rc;
}

int cli_cp_fail_early(int argc, char **argv) {
    int under_cp = 0, inited = 0;
    for (int i = 1; i < argc; i++) under_cp |= !strcmp(argv[i], "--cp") || !strcmp(argv[i], "--ep");
    MPI_Initialized(&inited);
    if (!under_cp || !inited) return 1;
    /* the other ranks' first collectives: the context's communicator, then their first agreement
     * step, whatever number of values they pass (every rank sends one fixed-width row) */
    gdn_cp *cp = NULL;
    if (gdn_cp_create(&cp, MPI_COMM_WORLD)) return 1;
    gdn_cp_agree_values(cp, NULL, 0, NULL, GDN_ERR_ARG);
    gdn_cp_destroy(cp);
    return 1;
}

int cli_cp_begin(const char *cmd, const char *name, int strategy, const char *known, int argc, char **argv,
                 gdn_cp **cp, int *rank, int *D) {
    *cp = NULL;
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, D);
    if (strategy < 0) {
        fprintf(stderr, "gdncp %s: rank %d: unknown --cp strategy '%s' (%s)\n", cmd, *rank, name, known);
        return cli_cp_fail_early(argc, argv);
    }
    return gdn_cp_create(cp, MPI_COMM_WORLD) ? cli_error(cmd, GDN_ERR_MPI) : 0;
}

int cli_cp_agree_first(gdn_cp *cp, const char *cmd, const int64_t *vals, int n, const char *const *names, int local,
                       int *reported) {
    const int rc = gdn_cp_agree_values(cp, vals, n, names, local);
    if (rc && !local) cli_error(cmd, rc), *reported = 1;
    return rc;
}

int cli_cp_sum_to_root(gdn_cp *cp, const char *cmd, const float *dw, size_t n, float **sum, int *reported) {
    *sum = NULL;
    int rc = GDN_OK;
    if (n > INT32_MAX) /* (alike on every rank) */
        fprintf(stderr, "gdncp %s: %zu weights exceed MPI's int count\n", cmd, n), rc = GDN_ERR_SHAPE;
    else if (!gdn_cp_rank(cp) && !(*sum = malloc(sizeof(float) * (n ? n : 1))))
        fprintf(stderr, "gdncp %s: out of memory for the summed weight gradients (%zu floats)\n", cmd, n), rc = GDN_ERR_NOMEM;
    if (rc) *reported = 1;
    if ((rc = gdn_cp_agree_status(cp, rc))) return rc;
    if (MPI_Reduce(dw, *sum, (int)n, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD) != MPI_SUCCESS)
        fprintf(stderr, "gdncp %s: MPI_Reduce of the weight gradients failed\n", cmd), rc = GDN_ERR_MPI, *reported = 1;
    return rc;
}

int cli_cp_check_fits(gdn_cp *cp, const char *cmd, const char *what, double bytes) {
    /* ranks on one machine share its memory: each alone could fit while together they cannot */
    MPI_Comm node;
    double together = bytes;
    int on_node = 1, node_rank = 0;
    if (MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) == MPI_SUCCESS) {
        if (MPI_Allreduce(&bytes, &together, 1, MPI_DOUBLE, MPI_SUM, node) != MPI_SUCCESS) together = bytes;
        MPI_Comm_size(node, &on_node), MPI_Comm_rank(node, &node_rank);
        MPI_Comm_free(&node);
    }
    char whole[512];
    snprintf(whole, sizeof whole, "%s, for the %d rank(s) on this machine together,", what, on_node);
    const int local = gdn_check_fits(whole, together);
    if (local && !node_rank) cli_error(cmd, local);
    return gdn_cp_agree_status(cp, local);
}

/* FNV-1a of a string (0 for NULL): lets ranks agree on a whole option string in one value. */
int64_t cli_hash(const char *s) { return s ? gdn_cp_digest(s, strlen(s)) : 0; }

int cli_cp_agree_weights(gdn_cp *cp, const char *cmd, const int64_t *vals, const char *const *names, int n,
                         const void *w, size_t bytes, const char *what) {
    enum { MAX_VALUES = 16 };
    int64_t v[MAX_VALUES + 1];
    const char *nv[MAX_VALUES + 1];
    if (n < 0 || n > MAX_VALUES) n = 0; /* (the callers pass fewer) */
    for (int i = 0; i < n; i++) v[i] = vals[i], nv[i] = names[i];
    v[n] = gdn_cp_digest(w, bytes), nv[n] = what;
    const int rc = gdn_cp_agree_values(cp, v, n + 1, nv, GDN_OK);
    if (rc) cli_error(cmd, rc);
    return rc;
}

int64_t cli_f64_bits(double x) {
    int64_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}
