/* Option values of the gdncp command: every number a subcommand takes is read here, so each one
 * is range-checked the same way and a bad value gets the same kind of message. */
#ifndef GDNCP_CLI_PARSE_H
#define GDNCP_CLI_PARSE_H

#include <stdint.h>

/* Exit status of a command called wrongly (an unknown option, a missing or bad option value):
 * 2, as for an unknown command, apart from 1 for a run that failed. */
enum { CLI_USAGE_ERROR = 2 };

/* Read `text`, the value of option `opt` (NULL when the option ended the command line), as a
 * whole decimal number in [min, max]. Refuses an empty value, trailing characters ("12abc"),
 * values beyond int64 and values out of range, printing "gdncp CMD: option OPT needs an integer
 * in [min, max], got 'TEXT' (why)"; returns 0 with *out set, or 1 (*out untouched). */
int cli_parse_i64(const char *cmd, const char *opt, const char *text, int64_t min, int64_t max,
                  int64_t *out);
/* The same for a floating-point number in [min, max]: also refuses NaN and infinities, and
 * values that overflow or underflow a double. */
int cli_parse_f64(const char *cmd, const char *opt, const char *text, double min, double max,
                  double *out);
/* A comma-separated list of whole numbers >= 0 ("0,5,12": digits only, no blanks, signs or empty
 * entries), each within int64; *out is malloc'ed (the caller frees it), *count its length.
 * Returns 1 after printing what is wrong ("gdncp CMD: option OPT needs ..."), else 0. */
int cli_parse_i64_list(const char *cmd, const char *opt, const char *text, int64_t **out, int64_t *count);

/* --compute fp32|bf16 (gdncp/compute.h) into *out; 1 after printing what is wrong, else 0. */
int cli_parse_compute(const char *cmd, const char *opt, const char *text, int *out);

#endif
