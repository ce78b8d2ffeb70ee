/* gdncp: the command-line tool. Subcommands live one per file. */
#include "cli/cli.h"
#include "commands.h"

#include "gdncp/cp.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How a subcommand meets MPI: never (a single process), always (it runs under mpiexec), or only
 * when its command line asks for context or expert parallelism (--cp, --ep). */
enum { MPI_NEVER, MPI_ALWAYS, MPI_WITH_CP };

/* The dispatch table: the command's words (a second word selects a bench), its function and its
 * MPI mode. Every function gets the arguments from the command's first word on. */
static const struct {
    const char *word, *sub; /* sub NULL: any (or no) second word */
    int (*fn)(int argc, char **argv);
    int mpi;
    const cli_command *cli; /* the command's options: its --help, its parser's table and docs/cli.md's lists */
} commands[] = {
    {"run", NULL, cmd_run, MPI_WITH_CP, &cmd_run_cli},
    {"layer", NULL, cmd_layer, MPI_WITH_CP, &cmd_layer_cli},
    {"attention", NULL, cmd_attention, MPI_WITH_CP, &cmd_attention_cli},
    {"bench", "layer", cmd_bench_layer, MPI_NEVER, &cmd_bench_layer_cli},
    {"bench", "attention", cmd_bench_attention, MPI_NEVER, &cmd_bench_attention_cli},
    {"bench", "cp", cmd_bench_cp, MPI_ALWAYS, &cmd_bench_cp_cli},
    {"bench", "attention-cp", cmd_bench_attention_cp, MPI_ALWAYS, &cmd_bench_attention_cp_cli},
    {"bench", "train", cmd_bench_train, MPI_NEVER, &cmd_bench_train_cli},
    {"bench", "decode", cmd_bench_decode, MPI_NEVER, &cmd_bench_decode_cli},
    {"bench", "matmul", cmd_bench_matmul, MPI_NEVER, &cmd_bench_matmul_cli},
    {"bench", "moe", cmd_bench_moe, MPI_WITH_CP, &cmd_bench_moe_cli},
    {"bench", NULL, cmd_bench, MPI_NEVER, &cmd_bench_cli}, /* bench kernel (and its refusals of unknown benches) */
    {"diff", NULL, cmd_diff, MPI_NEVER, &cmd_diff_cli},
    {"gen", NULL, cmd_gen, MPI_NEVER, &cmd_gen_cli},
    {"train", NULL, cmd_train, MPI_ALWAYS, &cmd_train_cli},
    {"sample", NULL, cmd_sample, MPI_WITH_CP, &cmd_sample_cli},
};

/* The commands in the order of `gdncp help` and docs/cli.md. */
static const cli_command *const listed[] = {
    &cmd_run_cli, &cmd_diff_cli, &cmd_gen_cli, &cmd_layer_cli, &cmd_attention_cli, &cmd_train_cli, &cmd_sample_cli,
    &cmd_bench_cli, &cmd_bench_layer_cli, &cmd_bench_attention_cli, &cmd_bench_decode_cli, &cmd_bench_matmul_cli,
    &cmd_bench_moe_cli, &cmd_bench_cp_cli, &cmd_bench_attention_cp_cli, &cmd_bench_train_cli,
};
enum { N_LISTED = sizeof listed / sizeof listed[0] };

/* `gdncp help`: every command's summary (its options: gdncp COMMAND --help). */
static void usage(FILE *out) {
    fprintf(out, "usage: gdncp <command> [options]\ncommands:\n");
    for (int i = 0; i < N_LISTED; i++) {
        fprintf(out, "  %-20s ", listed[i]->name);
        const char *p = listed[i]->summary;
        int col = 23;
        while (*p) { /* wrapped at 100 columns */
            const char *e = strchr(p, ' ');
            const int len = e ? (int)(e - p) : (int)strlen(p);
            if (col > 23 && col + 1 + len > 100) fprintf(out, "\n%23s", ""), col = 23;
            else if (col > 23) fputc(' ', out), col++;
            fprintf(out, "%.*s", len, p), col += len;
            p += len + (e != NULL);
        }
        fputc('\n', out);
    }
    fprintf(out, "  %-20s this text; gdncp COMMAND --help: that command's options; gdncp help --markdown\n"
                 "  %-20s [COMMAND..]: docs/cli.md's option sections\n", "help", "");
}

/* `gdncp help --markdown [COMMAND..]`: docs/cli.md's section of each command (all: in order). */
static int markdown(int argc, char **argv) {
    if (argc == 0) {
        for (int i = 0; i < N_LISTED; i++) cli_markdown(stdout, listed[i]);
        return 0;
    }
    for (int a = 0; a < argc; a++) {
        int found = 0;
        for (int i = 0; i < N_LISTED && !found; i++)
            if (!strcmp(argv[a], listed[i]->name)) cli_markdown(stdout, listed[i]), found = 1;
        if (!found) {
            fprintf(stderr, "gdncp help --markdown: unknown command '%s' (a command's words as one argument: "
                            "'bench moe')\n", argv[a]);
            return 2;
        }
    }
    return 0;
}

/* SIGINT/SIGTERM (the library installs no handlers): remove the temporary files of the
 * safetensors writes in progress (gdn_st_writer_save's and the parallel writer's), then die of
 * the signal as before (SA_RESETHAND: the default action once this returns). */
static void on_signal(int sig) {
    gdn_st_remove_temporaries();
    raise(sig);
}

static void install_signal_handlers(void) {
    static const int sigs[2] = {SIGINT, SIGTERM};
    for (int i = 0; i < 2; i++) {
        struct sigaction old, sa;
        if (sigaction(sigs[i], NULL, &old) != 0 || old.sa_handler == SIG_IGN) continue; /* (nohup, ...) */
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_RESETHAND;
        sigaction(sigs[i], &sa, NULL);
    }
}

/* GDNCP_MUTATE names test sites (src/base/base.h, docs/testing.md) whose steps a run makes
 * deliberately wrong, for the negative controls of the shell tests: said once on stderr. */
static void mutation_notice(void) {
    const char *m = getenv("GDNCP_MUTATE");
    if (m && *m) fprintf(stderr, "gdncp: TESTING: GDNCP_MUTATE=%s: these steps are deliberately WRONG\n", m);
}

/* Run a subcommand inside MPI (context parallelism): every rank's exit status agrees. gdncp
 * runs OpenMP threads inside each rank and needs MPI_THREAD_FUNNELED: an MPI that cannot give it
 * is refused (every rank gets the same answer, so every rank stops). */
static int with_mpi(int (*cmd)(int, char **), int argc, char **argv) {
    int provided = MPI_THREAD_SINGLE, rank = 0;
    if (MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS) {
        fprintf(stderr, "gdncp %s: MPI_Init_thread failed\n", argv[1]);
        return 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (provided < MPI_THREAD_FUNNELED) {
        if (!rank)
            fprintf(stderr, "gdncp %s: the MPI library provides thread support level %d (%s), below "
                            "MPI_THREAD_FUNNELED (%d) that gdncp's OpenMP threads inside each rank need\n",
                    argv[1], provided, provided == MPI_THREAD_SINGLE ? "MPI_THREAD_SINGLE" : "?", MPI_THREAD_FUNNELED);
        MPI_Finalize();
        return 1;
    }
    if (!rank) mutation_notice();
    int rc = cmd(argc - 1, argv + 1), any = rc;
    MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return any;
}

int main(int argc, char **argv) {
    install_signal_handlers();
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        if (argc > 2 && !strcmp(argv[2], "--markdown")) return markdown(argc - 3, argv + 3);
        usage(stdout);
        return 0;
    }
    /* a control run by a build that cannot break the computation, or naming a site that does not
     * exist, would run the clean computation and pass vacuously */
    const char *mutate = getenv("GDNCP_MUTATE");
#if !GDN_TEST_HOOKS
    if (mutate && *mutate) {
        fprintf(stderr, "gdncp: GDNCP_MUTATE is set, but this build has no test hooks (GDN_TEST_HOOKS=OFF): it cannot "
                        "make any step wrong on purpose; unset it, or use a build with the hooks\n");
        return 2;
    }
#else
    int gdn_test_sites_check(const char *list); /* the library's test hook (src/base/base.h) */
    if (mutate && gdn_test_sites_check(mutate)) {
        fprintf(stderr, "gdncp: %s\n", gdn_errmsg());
        return 2;
    }
#endif
    /* GDNCP_ISA (gdncp/isa.h): a cap this CPU or build cannot honour stops here, on every rank,
     * before MPI or any kernel starts */
    gdn_isa_info isa;
    if (gdn_isa(&isa) != GDN_OK) {
        fprintf(stderr, "gdncp: %s\n", gdn_errmsg());
        return 2;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        if (strcmp(argv[1], commands[i].word) || (commands[i].sub && (argc < 3 || strcmp(argv[2], commands[i].sub))))
            continue;
        /* --help or -h anywhere among the options: this command's usage, no run (and no MPI) */
        for (int a = commands[i].sub ? 3 : 2; a < argc; a++)
            if (!strcmp(argv[a], "--help") || !strcmp(argv[a], "-h")) {
                cli_help(stdout, commands[i].cli);
                return 0;
            }
        int mpi = commands[i].mpi == MPI_ALWAYS;
        for (int a = 2; commands[i].mpi == MPI_WITH_CP && a < argc; a++)
            mpi |= !strcmp(argv[a], "--cp") || !strcmp(argv[a], "--ep");
        if (!mpi) mutation_notice();
        return mpi ? with_mpi(commands[i].fn, argc, argv) : commands[i].fn(argc - 1, argv + 1);
    }
    fprintf(stderr, "gdncp: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
