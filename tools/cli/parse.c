/* Option values of the gdncp command (see parse.h). */
#include "parse.h"

#include "gdncp/compute.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* Whitespace is refused too: strtoll/strtod skip it in front, and a value that a shell quoting
 * slip padded ("--T ' 12'") is more likely a mistake than meant. */
static int starts_blank(const char *s) {
    return *s == ' ' || *s == '\t' || *s == '\n' || *s == '\r' || *s == '\f' || *s == '\v';
}

int cli_parse_i64(const char *cmd, const char *opt, const char *text, int64_t min, int64_t max,
                  int64_t *out) {
    const char *why = NULL;
    long long v = 0;
    if (!text) why = "no value given";
    else if (!*text || starts_blank(text)) why = "not a whole number";
    else {
        char *end = NULL;
        errno = 0;
        v = strtoll(text, &end, 10);
        if (end == text || *end) why = "not a whole number";
        else if (errno == ERANGE) why = "beyond the 64-bit range";
        else if (v < min || v > max) why = "out of range";
    }
    if (why) {
        fprintf(stderr, "gdncp %s: option %s needs an integer in [%" PRId64 ", %" PRId64 "], got '%s' (%s)\n",
                cmd, opt, min, max, text ? text : "", why);
        return 1;
    }
    *out = (int64_t)v;
    return 0;
}

int cli_parse_f64(const char *cmd, const char *opt, const char *text, double min, double max,
                  double *out) {
    const char *why = NULL;
    double v = 0;
    if (!text) why = "no value given";
    else if (!*text || starts_blank(text)) why = "not a number";
    else {
        char *end = NULL;
        errno = 0;
        v = strtod(text, &end);
        if (end == text || *end) why = "not a number";
        else if (isnan(v)) why = "NaN";
        else if (isinf(v)) why = errno == ERANGE ? "beyond the range of a double" : "infinite";
        else if (errno == ERANGE) /* strtod's overflow is infinite, so this is underflow */
            why = "too close to zero for a double";
        else if (!(v >= min && v <= max)) why = "out of range";
    }
    if (why) {
        fprintf(stderr, "gdncp %s: option %s needs a number in [%g, %g], got '%s' (%s)\n", cmd, opt, min,
                max, text ? text : "", why);
        return 1;
    }
    *out = v;
    return 0;
}

int cli_parse_i64_list(const char *cmd, const char *opt, const char *text, int64_t **out, int64_t *count) {
    const char *why = NULL;
    int64_t *list = NULL, n = 0;
    if (!text) why = "no value given";
    else if (!*text) why = "empty";
    else {
        /* at most one number per character: the list's size is bounded before parsing */
        size_t len = 0;
        while (text[len]) len++;
        if (!(list = malloc(sizeof(int64_t) * (len / 2 + 1)))) why = "out of memory for the list";
        for (const char *p = text; !why && *p;) {
            char *end = NULL;
            errno = 0;
            /* digits only: strtoll would also take blanks and signs */
            long long v = *p >= '0' && *p <= '9' ? strtoll(p, &end, 10) : 0;
            if (!end || end == p) why = "not a comma-separated list of whole numbers >= 0";
            else if (errno == ERANGE) why = "a value beyond the 64-bit range";
            else if (*end && *end != ',') why = "not a comma-separated list of whole numbers >= 0";
            else if (*end == ',' && !end[1]) why = "an empty last entry";
            else list[n++] = (int64_t)v, p = *end ? end + 1 : end;
        }
    }
    if (why) {
        fprintf(stderr, "gdncp %s: option %s needs comma-separated whole numbers (e.g. 0,5,12), got '%s' (%s)\n",
                cmd, opt, text ? text : "", why);
        free(list);
        return 1;
    }
    *out = list, *count = n;
    return 0;
}

int cli_parse_compute(const char *cmd, const char *opt, const char *text, int *out) {
    if (text && !gdn_compute_parse(text, out)) return 0;
    fprintf(stderr, "gdncp %s: option %s needs fp32 or bf16, got '%s'\n", cmd, opt, text ? text : "");
    return 1;
}
