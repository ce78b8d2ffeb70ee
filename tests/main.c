/* gdncp test runner. Usage: gdncp_tests [suite ...]; no argument runs every suite. */
#include "harness.h"

#include <stdio.h>
#include <string.h>

#define SUITE(name) void test_##name(void);
#ifndef GDN_CLI_PATH
#define SUITE_CLI(name) /* no command line in this build (GDN_MPI=OFF) */
#endif
#include "suites.h"
#undef SUITE

static const struct { const char *name; void (*fn)(void); } suites[] = {
#define SUITE(name) {#name, test_##name},
#ifndef GDN_CLI_PATH
#define SUITE_CLI(name)
#endif
#include "suites.h"
#undef SUITE
};

int main(int argc, char **argv) {
    const int n = sizeof suites / sizeof suites[0];
    for (int a = 1; a < argc; a++) { /* a misspelt suite would otherwise run nothing and pass */
        int known = 0;
        for (int i = 0; i < n; i++) known |= !strcmp(argv[a], suites[i].name);
        if (!known) {
            fprintf(stderr, "gdncp_tests: no suite named '%s' in this build (tests/suites.h)\n", argv[a]);
            return 2;
        }
    }
    for (int i = 0; i < n; i++) {
        int run = argc < 2;
        for (int a = 1; a < argc; a++) run |= !strcmp(argv[a], suites[i].name);
        if (!run) continue;
        printf("== %s\n", suites[i].name);
        fflush(stdout);
        suites[i].fn();
        fflush(stdout);
    }
    printf("%d passed, %d failed\n", tests_passed, tests_failed);
    return tests_failed ? 1 : 0;
}
