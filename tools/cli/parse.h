/* Option values of the gdncp command: every number a subcommand takes is read here, so each one
 * is range-checked the same way and a bad value gets the same kind of message. */
#ifndef GDNCP_CLI_PARSE_H
#define GDNCP_CLI_PARSE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

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

/* ---- Option tables: each subcommand's options, parsed, checked and documented from one table.
 *
 * A command's options live in its own struct (run_opts, ...); a table row names an option, the
 * kind of value it takes, the struct field it writes (an offset, type-checked at compile time),
 * its range and its help. One row per option, e.g.
 *
 *     {CLI_I64("--chunk", run_opts, chunk, 16, 128, "C", "the kernel's chunk: 16, 32, 64 or 128")},
 *     {CLI_STR("--in", run_opts, in, "F", "the problem file"), .req = 1},
 *     {CLI_FLAG("--backward", run_opts, backward, "also compute the gradients")},
 *
 * cli_parse reads argv from the table (in argv order: a later option overrides an earlier one),
 * cli_help prints `gdncp CMD --help` and cli_markdown docs/cli.md's section of the command, so
 * the parser, the usage text and the reference cannot drift apart. The default a row shows is
 * the field's value after the command's init (or .dflt, where a value means something else, as
 * "0: all threads"). A row without help (NULL) is a hidden testing hook: parsed, not listed. */
typedef enum {
    CLI_K_I64,     /* a whole number in [imin, imax] into an int64_t / int field (cli_parse_i64) */
    CLI_K_F64,     /* a real number in [fmin, fmax] into a double / float field (cli_parse_f64) */
    CLI_K_STR,     /* the text itself into a const char * field */
    CLI_K_FLAG,    /* no value: the int field set to imin (1, or CLI_SET's value) */
    CLI_K_ENUM,    /* one of arg's '|'-separated words: the int field gets values[its index] (the index without values) */
    CLI_K_LIST,    /* comma-separated whole numbers >= 0 (cli_parse_i64_list): int64_t * field, int64_t count at off2 */
    CLI_K_COMPUTE, /* fp32|bf16 (cli_parse_compute) into an int field */
    CLI_K_FN,      /* fn(opts, cmd, flag, value) decides: 0 accepted, else refused (it printed why) */
} cli_kind;

typedef struct {
    const char *flag;
    cli_kind kind;
    size_t off, off2;
    int size;               /* the field's size: an int or an int64_t, a float or a double */
    int64_t imin, imax;
    double fmin, fmax;
    const char *arg;        /* the value's name in the help (N, F, DIR); an enum's words "a|b|c" */
    const int *values;      /* an enum's values, one per word (NULL: the word's index) */
    int (*fn)(void *opts, const char *cmd, const char *flag, const char *value);
    const char *help;       /* one sentence; NULL: hidden (a testing hook) */
    const char *dflt;       /* the default as the help shows it (NULL: the field's initial value) */
    int req;                /* required */
} cli_opt;

/* A field of struct T, checked to be of an integer / floating / string / int64_t-pointer type. */
#define CLI_INT_AT(T, f) (offsetof(T, f) + 0 * sizeof(_Generic(((T *)0)->f, int: 1, long: 1, long long: 1, \
                                                                unsigned long: 1, unsigned long long: 1)))
#define CLI_REAL_AT(T, f) (offsetof(T, f) + 0 * sizeof(_Generic(((T *)0)->f, float: 1, double: 1)))
#define CLI_STR_AT(T, f) (offsetof(T, f) + 0 * sizeof(_Generic(((T *)0)->f, const char *: 1)))
#define CLI_LIST_AT(T, f) (offsetof(T, f) + 0 * sizeof(_Generic(((T *)0)->f, int64_t *: 1)))
#define CLI_SIZE(T, f) ((int)sizeof(((T *)0)->f))

/* The rows' kinds (designators: a row may add .req = 1 or .dflt = "text"). */
#define CLI_I64(flag_, T, f, lo, hi, arg_, help_) .flag = (flag_), .kind = CLI_K_I64, .off = CLI_INT_AT(T, f), \
    .size = CLI_SIZE(T, f), .imin = (lo), .imax = (hi), .arg = (arg_), .help = (help_)
#define CLI_F64(flag_, T, f, lo, hi, arg_, help_) .flag = (flag_), .kind = CLI_K_F64, .off = CLI_REAL_AT(T, f), \
    .size = CLI_SIZE(T, f), .fmin = (lo), .fmax = (hi), .arg = (arg_), .help = (help_)
#define CLI_STR(flag_, T, f, arg_, help_) .flag = (flag_), .kind = CLI_K_STR, .off = CLI_STR_AT(T, f), \
    .arg = (arg_), .help = (help_)
#define CLI_SET(flag_, T, f, value, help_) .flag = (flag_), .kind = CLI_K_FLAG, .off = CLI_INT_AT(T, f), \
    .size = CLI_SIZE(T, f), .imin = (value), .help = (help_)
#define CLI_FLAG(flag_, T, f, help_) CLI_SET(flag_, T, f, 1, help_)
#define CLI_ENUM(flag_, T, f, words, vals, help_) .flag = (flag_), .kind = CLI_K_ENUM, .off = CLI_INT_AT(T, f), \
    .size = CLI_SIZE(T, f), .arg = (words), .values = (vals), .help = (help_)
#define CLI_LIST(flag_, T, f, count, arg_, help_) .flag = (flag_), .kind = CLI_K_LIST, .off = CLI_LIST_AT(T, f), \
    .off2 = CLI_INT_AT(T, count), .arg = (arg_), .help = (help_)
#define CLI_COMPUTE(flag_, T, f, help_) .flag = (flag_), .kind = CLI_K_COMPUTE, .off = CLI_INT_AT(T, f), \
    .size = CLI_SIZE(T, f), .arg = "fp32|bf16", .help = (help_)
#define CLI_FN(flag_, fn_, arg_, help_) .flag = (flag_), .kind = CLI_K_FN, .fn = (fn_), .arg = (arg_), .help = (help_)
/* An enum's values, a static array: CLI_VALUES(GDN_F32, GDN_BF16). */
#define CLI_VALUES(...) ((const int[]){__VA_ARGS__})

/* A subcommand: its words ("run", "bench matmul"), its usage lines (the synopsis: what is
 * required, how it is launched; no option list, the table prints that), a short summary for
 * `gdncp help`, what it does (more lines, may be NULL), its options struct (size, and init,
 * which sets the defaults: NULL leaves it zeroed) and table, and its positional arguments (at
 * most max_pos of them, into the const char *[max_pos] field at pos_off; max_pos 0: none). */
typedef struct {
    const char *name, *usage, *summary, *about;
    size_t size;
    void (*init)(void *opts);
    const cli_opt *opts;
    int n_opts;
    int max_pos;
    size_t pos_off;
} cli_command;
#define CLI_OPTS(table) .opts = (table), .n_opts = (int)(sizeof(table) / sizeof((table)[0]))

/* The most options a command has (the size of cli_parse's `seen`). */
enum { CLI_MAX_OPTS = 128 };

/* Parse argv[1..argc) (argv[0] is the command's last word) into opts (set by c->init first):
 * every option from the table, in order; positional arguments (not starting with '-') into
 * c->pos_off. Refuses (printing "gdncp CMD: ..." to stderr) an unknown option ("unknown option or
 * missing value: X", then the usage lines), a value out of range or of the wrong form, too many
 * positional arguments and a missing required option. seen (NULL, or CLI_MAX_OPTS bytes) marks
 * the rows given. Returns 0, or CLI_USAGE_ERROR; the lists it read are freed by cli_free either
 * way. */
int cli_parse(const cli_command *c, int argc, char **argv, void *opts, unsigned char *seen);
/* Whether the option `flag` of c was given (seen from cli_parse). */
int cli_given(const cli_command *c, const unsigned char *seen, const char *flag);
/* Free the lists (CLI_K_LIST fields) in opts. */
void cli_free(const cli_command *c, void *opts);
/* `gdncp CMD --help`: the usage lines, what the command does, then every option (flag and value,
 * what it does, its range and default). */
void cli_help(FILE *out, const cli_command *c);
/* docs/cli.md's section of the command: between a BEGIN and an END marker line, the usage lines in
 * a code block and a table of the options (option, value, default, meaning). */
void cli_markdown(FILE *out, const cli_command *c);

#endif
