/* Errors, option numbers and the clock of the gdncp command. */
#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int cli_error(const char *what, int status) {
    fprintf(stderr, "gdncp %s: %s: %s\n", what, gdn_strerror(status), gdn_errmsg());
    return 1;
}

int cli_int(const char *opt, const char *val, long lo, long hi, long *out) {
    char *end = NULL;
    errno = 0;
    long v = val ? strtol(val, &end, 10) : 0;
    if (!val || errno || *end || end == val || v < lo || v > hi) {
        fprintf(stderr, "gdncp: option %s needs an integer in [%ld, %ld], got '%s'\n", opt, lo, hi,
                val ? val : "(nothing)");
        return 1;
    }
    *out = v;
    return 0;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
