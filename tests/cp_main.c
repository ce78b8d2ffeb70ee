/* gdncp context-parallel tests: run under mpiexec with any number of ranks. Every rank checks;
 * rank 0 prints one line per case and the closing "N passed, N failed". */
#include "harness.h"

#include <mpi.h>
#include <stdio.h>

void test_cp(void);
void test_layer_cp(void);
void test_model_cp(void);
void test_pack_cp(void);

int main(int argc, char **argv) {
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    tests_quiet = rank != 0;
    if (!rank) printf("== cp (D=%d)\n", size);
    test_cp();
    if (!rank) printf("== layer_cp (D=%d)\n", size);
    test_layer_cp();
    if (!rank) printf("== model_cp (D=%d)\n", size);
    test_model_cp();
    if (!rank) printf("== pack_cp (D=%d)\n", size);
    test_pack_cp();
    int failed = tests_failed, any = 0;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!rank) printf("%d passed, %d failed\n", tests_passed, tests_failed);
    MPI_Finalize();
    return any ? 1 : 0;
}
