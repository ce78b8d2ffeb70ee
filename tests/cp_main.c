/* gdncp context-parallel tests: run under mpiexec with any number of ranks. Every rank checks;
 * rank 0 prints one line per case and the closing "N passed, N failed". */
#include "harness.h"

#include <mpi.h>
#include <stdio.h>
#include <string.h>

void test_cp(void);
void test_layer_cp(void);
void test_model_cp(void);
void test_pack_cp(void);
void test_attention_cp(void);
void test_model_cp_hybrid(void);

int main(int argc, char **argv) {
    int provided = MPI_THREAD_SINGLE;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (provided < MPI_THREAD_FUNNELED) { /* OpenMP inside the ranks needs it */
        if (!rank) fprintf(stderr, "gdncp_cp_tests: MPI provides thread level %d, below MPI_THREAD_FUNNELED\n", provided);
        MPI_Finalize();
        return 1;
    }
    tests_quiet = rank != 0;
    /* suites named on the command line run alone (all by default) */
    static const struct { const char *name; void (*run)(void); } suites[] = {
        {"cp", test_cp}, {"layer_cp", test_layer_cp}, {"model_cp", test_model_cp}, {"pack_cp", test_pack_cp},
        {"attention_cp", test_attention_cp}, {"model_cp_hybrid", test_model_cp_hybrid}};
    for (size_t i = 0; i < sizeof suites / sizeof suites[0]; i++) {
        int run = argc < 2;
        for (int a = 1; a < argc; a++) run |= !strcmp(argv[a], suites[i].name);
        if (!run) continue;
        if (!rank) printf("== %s (D=%d)\n", suites[i].name, size);
        suites[i].run();
    }
    int failed = tests_failed, any = 0;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!rank) printf("%d passed, %d failed\n", tests_passed, tests_failed);
    MPI_Finalize();
    return any ? 1 : 0;
}
