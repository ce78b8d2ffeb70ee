/* gdncp context-parallel tests: run under mpiexec with any number of ranks. Every rank checks;
 * rank 0 prints one line per case and the closing "N passed, N failed". */
#include "harness.h"

#include <mpi.h>
#include <stdio.h>
#include <string.h>

#define SUITE(name)
#define SUITE_CLI(name)
#define SUITE_CP(name) void test_##name(void);
#include "suites.h"

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
#define SUITE_CLI(name)
#define SUITE_CP(name) {#name, test_##name},
#include "suites.h"
    };
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
