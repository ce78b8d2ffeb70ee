/* Internals of the context-parallel layer, shared by its files and by the tests' negative
 * controls (deliberate faults injected into the real code path). */
#ifndef GDNCP_CP_INTERNAL_H
#define GDNCP_CP_INTERNAL_H

#include "gdncp/cp.h"
#include "kernel_internal.h"
#include "model_group.h"

struct gdn_cp {
    gdn_model_group group; /* first: the model reaches its peers through it (model_group.h) */
    MPI_Comm comm;
    int rank, size;
    gdn_cp_stats stats;
    int sleep_wait;      /* gdn_cp_wait_all sleeps between tests (GDN_CP_WAIT_SLEEP) */
    int auto_sleep;      /* what GDN_CP_WAIT_AUTO means here (the node count at creation) */
    int64_t *shard_T;    /* every rank's T_r, filled by the agreement check */
    /* Fixed-size tables of every call, allocated once by gdn_cp_create (so no call allocates
     * them, and no allocation failure can strand the other ranks in the collective they feed):
     * agree_tab holds GDN_CP_AGREE_COLS int64 for this rank then as many per rank; tab64 D
     * int64; counts 4 D ints (counts and displacements of gathers). */
    int64_t *agree_tab, *tab64;
    int *counts;
    float *scratch;      /* grow-only buffer for pairs and states */
    size_t scratch_cap;
    gdn_plan *heads_plan; /* cached plan of the head-parallel shape */
    gdn_config heads_key; /* the config it was made from (its cu_seqlens pointer only says whether packed) */
};

/* Columns of the preallocated agreement table and the width of every row gdn_cp_agree_values
 * exchanges, whatever a rank's n (gdn_cp_agree's signature and the halo's fit it too). */
enum { GDN_CP_AGREE_COLS = 32 };

/* The CP layer allocates through base.h's gdn_malloc family, as the whole library does. A
 * failure is local: the caller folds it into a collective status (gdn_cp_agree_status, or the
 * local status of an agreement step) before the next collective, so no rank is left waiting. */
/* An MPI datatype constructor, unless the fault hook fails it first (then MPI_ERR_OTHER, and
 * nothing was created). */
#define GDN_CP_MPI_TYPE(site, call) (gdn_test_fault(site) ? MPI_ERR_OTHER : (call))

/* The worst status over the ranks of comm and the lowest rank that has it (MAXLOC): one
 * Allreduce (nonblocking and waited as cp says, when cp is given). *worst = 0 when every rank
 * passed GDN_OK. */
int gdn_cp_worst_status(const gdn_cp *cp, MPI_Comm comm, int rank, int local, int *worst, int *who);

/* Packed documents' offsets as one value of an agreement row: a digest of cu_seqlens[0..n_docs]
 * (gdn_cp_digest), -1 for a dense plan (cu NULL). The one hash of documents every agreement uses. */
static inline int64_t gdn_cp_docs_hash(const int64_t *cu, int64_t n_docs) {
    return cu ? gdn_cp_digest(cu, sizeof *cu * (size_t)(n_docs + 1)) : -1;
}

/* Check that all ranks agree on the plan's shape and options (except T), the strategy and the
 * call (GDN_CP_CALL_* flags); fills shard_T. Collective. Also folds a local failure status into
 * a collective one. */
enum { GDN_CP_CALL_FORWARD = 1, GDN_CP_CALL_BACKWARD = 2, GDN_CP_CALL_SIN = 4,
       GDN_CP_CALL_HT = 8 /* packed: per-document final states (forward) or dh0 (backward) gathered */ };
int gdn_cp_agree(gdn_cp *cp, const gdn_plan *plan, int local_status, int call);
/* The grow-only scratch buffer (NULL when it cannot grow). Collective paths reserve what they
 * will need (gdn_cp_combine_reserve) before the agreement step that precedes their messages. */
float *gdn_cp_scratch(gdn_cp *cp, size_t floats);
/* Reserve the scratch gdn_cp_combine needs for pairs of this shape (GDN_OK or GDN_ERR_NOMEM,
 * local): call it before the agreement step that precedes the combine. */
int gdn_cp_combine_reserve(gdn_cp *cp, gdn_cp_strategy strategy, int64_t nm, int64_t K, int64_t V);

/* Complete n nonblocking MPI requests as cp's wait mode says (cp.h, gdn_cp_set_wait): MPI_Waitall,
 * or MPI_Test in a spin for the first GDN_CP_SPIN_S seconds (a quick partner answers within it),
 * then between sleeps that grow from 20 us to 1 ms. Every collective on the layers' hot paths goes
 * through this. Returns MPI_SUCCESS or the failing MPI call's status. */
#define GDN_CP_SPIN_S 50e-6
int gdn_cp_wait_all(const gdn_cp *cp, int n, MPI_Request *rq);
/* MPI_Allgather (count elements of type from each rank) and MPI_Allgatherv in place on cp's
 * communicator, the blocking call when cp spins (MPICH's nonblocking collectives run slower
 * algorithms), the nonblocking one and gdn_cp_wait_all when it sleeps. */
int gdn_cp_allgather(const gdn_cp *cp, const void *send, int count, MPI_Datatype type, void *recv);
int gdn_cp_allgatherv_in_place(const gdn_cp *cp, void *buf, const int *counts, const int *displs, MPI_Datatype type);

/* The MPI wrapper that keeps the accounting. Counts in floats; dest/src may be MPI_PROC_NULL. */
int gdn_cp_sendrecv(gdn_cp *cp, const float *sbuf, int64_t scount, int dest, float *rbuf,
                    int64_t rcount, int src);

/* The prefix combine of affine pairs over ranks (cp.c): `mine` holds this rank's pair, A
 * [nm, K, K] then B [nm, K, V] (the first rank in the direction must hold a constant map, A =
 * 0); on exit `incoming` holds the state (dir +1: token order) or state gradient (dir -1: reverse
 * order, adjoint pairs) entering this rank. Scan and allgather strategies. Collective. */
int gdn_cp_combine(gdn_cp *cp, gdn_cp_strategy strategy, float *mine, float *incoming, int64_t nm, int64_t K,
                   int64_t V, int dir);

/* The scan, allgather and relay strategies over the plan's streams, dense or packed (rule.c):
 * called by gdn_cp_forward / gdn_cp_backward after the agreement step, same arguments. Packed:
 * h0, ht, dht and ds_in (then every document's dh0) per document, on every rank. */
int gdn_cp_rule_forward(gdn_cp *cp, gdn_plan *plan, float *o, float *ht, float *s_in,
                        const float *q, const float *k, const float *v, const float *g,
                        const float *beta, const float *h0);
int gdn_cp_rule_backward(gdn_cp *cp, gdn_plan *plan, float *dq, float *dk, float *dv, float *dg,
                         float *dbeta, float *ds_in, const float *q, const float *k, const float *v,
                         const float *g, const float *beta, const float *h0, const float *s_in,
                         const float *dout, const float *dht);

/* The rows each rank owns (rule.c): dense, every batch row starts on rank 0 and ends on the
 * last; packed, from the agreed shard sizes (cp->shard_T) and the whole stream's offsets: rank r's are [displ[r], displ[r] + count[r]), those that end on it (ending = 1: cu[d+1]
 * in (t_r, t_r + T_r]) or start on it (ending = 0: cu[d] in [t_r, t_r + T_r)). n_docs must fit
 * an int (the callers check). */
void gdn_cp_doc_ranges(const gdn_cp *cp, const gdn_config *c, int ending, int *count, int *displ);

/* The `heads` strategy's all-to-all sizes (heads.c). check: whether every count and displacement
 * of its exchanges (in token rows) and its state scatter/gather (in floats) fits MPI's int, and D
 * divides Hk; a GDN_ERR_SHAPE naming the sizes otherwise. Decided from agreed values only: every
 * rank reaches the same verdict. counts: this rank's counts and displacements in token rows (B
 * rows per token of a shard), towards the heads (B T_r rows to every rank) or back. */
int gdn_cp_heads_check(int D, const int64_t *shard_T, int64_t B, int64_t Hk, int64_t Hv, int64_t K,
                       int64_t V);
void gdn_cp_heads_counts(int D, const int64_t *shard_T, int rank, int64_t B, int towards_heads,
                         int *scount, int *sdispl, int *rcount, int *rdispl);

/* The heads strategy, dense or packed (then h0, ht, dht and ds_in per document as above). */
int gdn_cp_heads_forward(gdn_cp *cp, gdn_plan *plan, float *o, float *ht, float *s_in,
                         const float *q, const float *k, const float *v, const float *g,
                         const float *beta, const float *h0);
int gdn_cp_heads_backward(gdn_cp *cp, gdn_plan *plan, float *dq, float *dk, float *dv,
                          float *dg, float *dbeta, float *ds_in, const float *q, const float *k,
                          const float *v, const float *g, const float *beta, const float *h0,
                          const float *dout, const float *dht);

#endif
