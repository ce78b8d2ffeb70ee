/* The context of a CP group (cp.h): its communicator, tables, wait mode, and the table through
 * which the model (libgdncp, which links no MPI) reaches its peers (model_group.h). */
#include "cp_internal.h"

#include <omp.h>
#include <stdlib.h>
#include <unistd.h>

static int exscan_sum(gdn_cp *cp, int64_t mine, int64_t *before) {
    *before = 0;
    if (MPI_Exscan(&mine, before, 1, MPI_INT64_T, MPI_SUM, cp->comm) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Exscan of the shard lengths (the attention layers' seq_offset) failed");
    if (cp->rank == 0) *before = 0; /* Exscan leaves rank 0's undefined */
    return GDN_OK;
}

static int sum_doubles(gdn_cp *cp, const double *in, double *out, int n) {
    if (MPI_Allreduce(in, out, n, MPI_DOUBLE, MPI_SUM, cp->comm) != MPI_SUCCESS)
        return gdn_fail(GDN_ERR_MPI, "MPI_Allreduce of %d values (the MoE routers' statistics) failed", n);
    return GDN_OK;
}

int gdn_cp_create(gdn_cp **out, MPI_Comm comm) {
    if (!out) return gdn_fail(GDN_ERR_ARG, "cp output pointer is NULL");
    *out = NULL;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) return gdn_fail(GDN_ERR_MPI, "MPI is not initialised (call MPI_Init_thread first)");
    MPI_Comm dup = MPI_COMM_NULL;
    if (MPI_Comm_dup(comm, &dup) != MPI_SUCCESS) return gdn_fail(GDN_ERR_MPI, "MPI_Comm_dup failed");
    /* MPI failures on gdncp's communicator come back as return codes (the default handler
     * aborts the job), so they become gdncp errors with a message. */
    int local = MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN) == MPI_SUCCESS
                    ? GDN_OK
                    : gdn_fail(GDN_ERR_MPI, "MPI_Comm_set_errhandler(MPI_ERRORS_RETURN) failed");
    int rank = 0, size = 1;
    MPI_Comm_rank(dup, &rank);
    MPI_Comm_size(dup, &size);
    gdn_cp *cp = gdn_calloc("cp context", 1, sizeof *cp);
    if (cp) {
        cp->group = (gdn_model_group){.rank = rank, .agree_status = gdn_cp_agree_status, .exscan_sum = exscan_sum,
                                      .sum_doubles = sum_doubles, .layer_forward = gdn_layer_cp_forward,
                                      .layer_backward = gdn_layer_cp_backward, .attn_forward = gdn_attn_cp_forward,
                                      .attn_backward = gdn_attn_cp_backward};
        cp->comm = dup, cp->rank = rank, cp->size = size;
        cp->shard_T = gdn_calloc("cp context: shard sizes", (size_t)size, sizeof *cp->shard_T);
        cp->agree_tab = gdn_calloc("cp context: agreement table", (size_t)GDN_CP_AGREE_COLS * (size + 1), sizeof(int64_t));
        cp->tab64 = gdn_calloc("cp context: gather sizes", (size_t)size, sizeof(int64_t));
        cp->counts = gdn_calloc("cp context: gather counts", 4 * (size_t)size, sizeof(int));
    }
    if (!local && (!cp || !cp->shard_T || !cp->agree_tab || !cp->tab64 || !cp->counts))
        local = gdn_fail(GDN_ERR_NOMEM, "cp context (%d ranks)", size);
    /* before anyone uses the context: a rank that could not make its own stops every rank */
    /* the wait mode AUTO stands for: do this communicator's ranks on the node, with their
     * threads, outnumber its cores? */
    MPI_Comm node = MPI_COMM_NULL;
    int on_node = 1;
    if (MPI_Comm_split_type(dup, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node) == MPI_SUCCESS) { /* on every rank */
        MPI_Comm_size(node, &on_node);
        MPI_Comm_free(&node);
    }
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int sleepy = (long)on_node * omp_get_max_threads() > (cores > 0 ? cores : 1);
    /* one mode on every rank (a blocking collective never meets a nonblocking one): any node
     * oversubscribed makes all sleep */
    if (MPI_Allreduce(MPI_IN_PLACE, &sleepy, 1, MPI_INT, MPI_MAX, dup) != MPI_SUCCESS && !local)
        local = gdn_fail(GDN_ERR_MPI, "MPI_Allreduce failed (cp wait mode)");
    if (cp) cp->auto_sleep = cp->sleep_wait = sleepy;
    int worst = 0, who = 0, rc = gdn_cp_worst_status(NULL, dup, rank, local, &worst, &who);
    if (!rc && !local && worst)
        rc = gdn_fail(worst, "gdn_cp_create: rank %d failed (%s); see its message", who, gdn_strerror(worst));
    if (!rc) rc = local;
    if (rc) {
        if (cp) cp->comm = MPI_COMM_NULL;
        gdn_cp_destroy(cp);
        MPI_Comm_free(&dup);
        return rc;
    }
    *out = cp;
    return GDN_OK;
}

void gdn_cp_destroy(gdn_cp *cp) {
    if (!cp) return;
    if (cp->comm != MPI_COMM_NULL) MPI_Comm_free(&cp->comm);
    gdn_plan_destroy(cp->heads_plan);
    free(cp->shard_T), free(cp->agree_tab), free(cp->tab64), free(cp->counts);
    free(cp->scratch);
    free(cp);
}

