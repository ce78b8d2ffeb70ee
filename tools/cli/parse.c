/* Option values of the gdncp command (see parse.h). */
#include "parse.h"

#include "gdncp/compute.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* ---- option tables */

static void store_int(void *dst, int size, int64_t v) {
    if (size == (int)sizeof(int)) {
        const int x = (int)v;
        memcpy(dst, &x, sizeof x);
    } else memcpy(dst, &v, sizeof v);
}

static int64_t load_int(const void *src, int size) {
    if (size == (int)sizeof(int)) {
        int x;
        memcpy(&x, src, sizeof x);
        return x;
    }
    int64_t v;
    memcpy(&v, src, sizeof v);
    return v;
}

static double load_real(const void *src, int size) {
    if (size == (int)sizeof(float)) {
        float x;
        memcpy(&x, src, sizeof x);
        return x;
    }
    double v;
    memcpy(&v, src, sizeof v);
    return v;
}

/* Word i of an enum's "a|b|c" into buf; 0 when there is none. */
static int enum_word(const char *words, int i, char *buf, size_t n) {
    const char *p = words;
    for (int k = 0; k < i; k++)
        if (!(p = strchr(p, '|'))) return 0;
        else p++;
    const char *e = strchr(p, '|');
    const size_t len = e ? (size_t)(e - p) : strlen(p);
    if (len + 1 > n) return 0;
    memcpy(buf, p, len), buf[len] = 0;
    return 1;
}

/* "a, b or c" of an enum's words. */
static void enum_list(const char *words, char *buf, size_t n) {
    char w[64];
    int count = 0;
    while (enum_word(words, count, w, sizeof w)) count++;
    buf[0] = 0;
    for (int i = 0; i < count; i++) {
        enum_word(words, i, w, sizeof w);
        const size_t at = strlen(buf);
        snprintf(buf + at, n - at, "%s%s", i == 0 ? "" : i == count - 1 ? " or " : ", ", w);
    }
}

static const cli_opt *find_opt(const cli_command *c, const char *flag) {
    for (int i = 0; i < c->n_opts; i++)
        if (!strcmp(c->opts[i].flag, flag)) return &c->opts[i];
    return NULL;
}

int cli_given(const cli_command *c, const unsigned char *seen, const char *flag) {
    const cli_opt *o = find_opt(c, flag);
    return o && seen[o - c->opts];
}

void cli_free(const cli_command *c, void *opts) {
    for (int i = 0; i < c->n_opts; i++)
        if (c->opts[i].kind == CLI_K_LIST) {
            int64_t **p = (int64_t **)((char *)opts + c->opts[i].off);
            free(*p), *p = NULL;
        }
}

/* "--a, --b and --c are required" (or "--a is required"): every required option of c. */
static void print_required(const cli_command *c) {
    int n = 0, k = 0;
    for (int i = 0; i < c->n_opts; i++) n += c->opts[i].req != 0;
    fprintf(stderr, "gdncp %s: ", c->name);
    for (int i = 0; i < c->n_opts; i++)
        if (c->opts[i].req)
            fprintf(stderr, "%s%s", k == 0 ? "" : k == n - 1 ? " and " : ", ", c->opts[i].flag), k++;
    fprintf(stderr, " %s required\n", n == 1 ? "is" : "are");
}

static int refuse_usage(const cli_command *c) {
    fprintf(stderr, "%s(gdncp %s --help lists every option)\n", c->usage, c->name);
    return CLI_USAGE_ERROR;
}

/* One option's value: 0, or 1 after printing what is wrong. */
static int parse_one(const cli_command *c, const cli_opt *o, const char *v, void *opts) {
    void *dst = (char *)opts + o->off;
    int64_t n;
    double x;
    char buf[256], w[64];
    switch (o->kind) {
    case CLI_K_I64:
        if (cli_parse_i64(c->name, o->flag, v, o->imin, o->imax, &n)) return 1;
        store_int(dst, o->size, n);
        return 0;
    case CLI_K_F64:
        if (cli_parse_f64(c->name, o->flag, v, o->fmin, o->fmax, &x)) return 1;
        if (o->size == (int)sizeof(float)) {
            const float f = (float)x;
            memcpy(dst, &f, sizeof f);
        } else memcpy(dst, &x, sizeof x);
        return 0;
    case CLI_K_FLAG: store_int(dst, o->size, o->imin); return 0;
    case CLI_K_LIST: {
        int64_t **list = dst, count = 0;
        free(*list), *list = NULL;
        if (cli_parse_i64_list(c->name, o->flag, v, list, &count)) return 1;
        memcpy((char *)opts + o->off2, &count, sizeof count);
        return 0;
    }
    case CLI_K_COMPUTE: {
        int cm;
        if (cli_parse_compute(c->name, o->flag, v, &cm)) return 1;
        store_int(dst, o->size, cm);
        return 0;
    }
    default: break;
    }
    if (!v) {
        fprintf(stderr, "gdncp %s: option %s needs a value (%s)\n", c->name, o->flag, o->arg ? o->arg : "");
        return 1;
    }
    if (o->kind == CLI_K_STR) {
        memcpy(dst, &v, sizeof v);
        return 0;
    }
    if (o->kind == CLI_K_FN) return o->fn(opts, c->name, o->flag, v) ? 1 : 0;
    for (int i = 0; enum_word(o->arg, i, w, sizeof w); i++) /* CLI_K_ENUM */
        if (!strcmp(w, v)) {
            store_int(dst, o->size, o->values ? o->values[i] : i);
            return 0;
        }
    enum_list(o->arg, buf, sizeof buf);
    fprintf(stderr, "gdncp %s: unknown %s '%s' (%s)\n", c->name, o->flag, v, buf);
    return 1;
}

int cli_parse(const cli_command *c, int argc, char **argv, void *opts, unsigned char *seen) {
    unsigned char local[CLI_MAX_OPTS];
    if (!seen) seen = local;
    memset(seen, 0, CLI_MAX_OPTS);
    memset(opts, 0, c->size);
    if (c->init) c->init(opts);
    int npos = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-' || !a[1]) { /* a positional argument */
            if (npos >= c->max_pos) {
                fprintf(stderr, "gdncp %s: unexpected argument '%s'\n", c->name, a);
                return refuse_usage(c);
            }
            memcpy((char *)opts + c->pos_off + sizeof(const char *) * npos++, &a, sizeof a);
            continue;
        }
        const cli_opt *o = find_opt(c, a);
        if (!o) {
            fprintf(stderr, "gdncp %s: unknown option or missing value: %s\n", c->name, a);
            return refuse_usage(c);
        }
        seen[o - c->opts] = 1;
        if (parse_one(c, o, i + 1 < argc ? argv[i + 1] : NULL, opts)) return CLI_USAGE_ERROR;
        if (o->kind != CLI_K_FLAG) i++;
    }
    for (int i = 0; i < c->n_opts; i++)
        if (c->opts[i].req && !seen[i]) {
            print_required(c);
            return refuse_usage(c);
        }
    return 0;
}

/* ---- help and docs */

/* A range's bound as the help shows it: 2^k above 4096, 2^63-1 for INT64_MAX. */
static void fmt_int(char *buf, size_t n, int64_t v) {
    if (v == INT64_MAX) snprintf(buf, n, "2^63-1");
    else if (v > 4096 && !(v & (v - 1))) {
        int k = 0;
        while (((int64_t)1 << k) != v) k++;
        snprintf(buf, n, "2^%d", k);
    } else snprintf(buf, n, "%" PRId64, v);
}

/* The accepted values of a row ("" when it takes none). */
static void fmt_range(const cli_opt *o, char *buf, size_t n) {
    char lo[32], hi[32];
    buf[0] = 0;
    switch (o->kind) {
    case CLI_K_I64:
        fmt_int(lo, sizeof lo, o->imin), fmt_int(hi, sizeof hi, o->imax);
        snprintf(buf, n, "%s .. %s", lo, hi);
        break;
    case CLI_K_F64: snprintf(buf, n, "%g .. %g", o->fmin, o->fmax); break;
    case CLI_K_LIST: snprintf(buf, n, "comma-separated whole numbers >= 0"); break;
    default: break;
    }
}

/* The default of a row: .dflt, else the field's value after init ("" when there is none to show). */
static void fmt_default(const cli_opt *o, const void *opts, char *buf, size_t n) {
    const void *src = (const char *)opts + o->off;
    char w[64];
    buf[0] = 0;
    if (o->dflt) snprintf(buf, n, "%s", o->dflt);
    else if (o->req) snprintf(buf, n, "required");
    else if (o->kind == CLI_K_I64) snprintf(buf, n, "%" PRId64, load_int(src, o->size));
    else if (o->kind == CLI_K_F64) snprintf(buf, n, "%g", load_real(src, o->size));
    else if (o->kind == CLI_K_STR) {
        const char *s;
        memcpy(&s, src, sizeof s);
        if (s) snprintf(buf, n, "%s", s);
    } else if (o->kind == CLI_K_ENUM || o->kind == CLI_K_COMPUTE) {
        const int64_t v = load_int(src, o->size);
        for (int i = 0; enum_word(o->arg, i, w, sizeof w); i++)
            if ((o->kind == CLI_K_ENUM && o->values ? o->values[i] : i) == v) {
                snprintf(buf, n, "%s", w);
                break;
            }
    }
}

/* The command's options after init (freed by the caller), for the defaults. */
static void *defaults_of(const cli_command *c) {
    void *opts = calloc(1, c->size ? c->size : 1);
    if (opts && c->init) c->init(opts);
    return opts;
}

/* Print text wrapped at 100 columns, continuation lines indented by `indent` (the first line
 * starts at column `col`). */
static void wrapped(FILE *out, const char *text, int col, int indent) {
    const char *p = text;
    while (*p) {
        const char *e = p;
        while (*e && *e != ' ') e++;
        const int len = (int)(e - p);
        if (col > indent && col + 1 + len > 100) fprintf(out, "\n%*s", indent, ""), col = indent;
        else if (col > indent) fputc(' ', out), col++;
        fprintf(out, "%.*s", len, p), col += len;
        p = *e ? e + 1 : e;
    }
    fputc('\n', out);
}

void cli_help(FILE *out, const cli_command *c) {
    void *d = defaults_of(c);
    char range[256], def[128], text[1024], head[96];
    fputs(c->usage, out);
    if (c->about) fputs(c->about, out);
    if (c->n_opts) fprintf(out, "options:\n");
    for (int i = 0; i < c->n_opts; i++) {
        const cli_opt *o = &c->opts[i];
        if (!o->help) continue;
        fmt_range(o, range, sizeof range);
        if (d) fmt_default(o, d, def, sizeof def);
        else def[0] = 0;
        snprintf(head, sizeof head, "  %s%s%s", o->flag, o->arg ? " " : "", o->arg ? o->arg : "");
        snprintf(text, sizeof text, "%s%s%s%s%s%s%s", o->help, range[0] || def[0] ? " (" : "", range,
                 range[0] && def[0] ? "; " : "", def[0] && !o->req ? "default " : "", def,
                 range[0] || def[0] ? ")" : "");
        fputs(head, out);
        int col = (int)strlen(head);
        if (col < 30) fprintf(out, "%*s", 30 - col, ""), col = 30;
        else fprintf(out, "\n%30s", ""), col = 30;
        wrapped(out, text, col, 30);
    }
    free(d);
}

/* A table cell: '|' escaped. */
static void cell(FILE *out, const char *s) {
    for (; *s; s++) {
        if (*s == '|') fputc('\\', out);
        fputc(*s, out);
    }
}

void cli_markdown(FILE *out, const cli_command *c) {
    void *d = defaults_of(c);
    char range[256], def[128];
    fprintf(out, "<!-- BEGIN gdncp help --markdown: %s (generated from the option table in tools/; edit it there, "
                 "then scripts/gen_cli_docs.py --write) -->\n```\n", c->name);
    fputs(c->usage, out);
    if (c->about) fputs(c->about, out);
    fprintf(out, "```\n");
    int any = 0;
    for (int i = 0; i < c->n_opts; i++) any |= c->opts[i].help != NULL;
    if (any) fprintf(out, "\n| option | value | default | meaning |\n|---|---|---|---|\n");
    for (int i = 0; i < c->n_opts; i++) {
        const cli_opt *o = &c->opts[i];
        if (!o->help) continue;
        fmt_range(o, range, sizeof range);
        if (d) fmt_default(o, d, def, sizeof def);
        else def[0] = 0;
        fprintf(out, "| `");
        cell(out, o->flag);
        if (o->arg) fputc(' ', out), cell(out, o->arg);
        fprintf(out, "` | ");
        cell(out, range);
        fprintf(out, " | ");
        cell(out, def);
        fprintf(out, " | ");
        cell(out, o->help);
        fprintf(out, " |\n");
    }
    fprintf(out, "<!-- END gdncp help --markdown: %s -->\n", c->name);
    free(d);
}
