/* Errors and the clock of the gdncp command. */
#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int cli_error(const char *what, int status) {
    fprintf(stderr, "gdncp %s: %s: %s\n", what, gdn_strerror(status), gdn_errmsg());
    return 1;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}
