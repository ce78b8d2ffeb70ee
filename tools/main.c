/* gdncp: the command-line tool. Subcommands live one per file. */
#include "cli/cli.h"
#include "commands.h"

#include "gdncp/cp.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>

static void usage(FILE *out) {
    fprintf(out,
            "usage: gdncp <command> [options]\n"
            "commands:\n"
            "  run    --in IN.safetensors --out OUT.safetensors [--chunk C] [--scale S]\n"
            "         [--no-l2norm] [--reference] [--threads N]   gated delta rule forward\n"
            "         [--backward]: also read do [, dht], write dq dk dv dg dbeta [dh0]\n"
            "         [--cu-seqlens 0,a,..,T]: packed documents (or a cu_seqlens tensor in IN;\n"
            "         B = 1; h0 ht dht dh0 per document [N_docs,Hv,K,V]; every --cp strategy)\n"
            "         [--cp scan|allgather|relay|heads [--shards a,b,..] [--stats]]\n"
            "         under mpiexec -n D: the sequence split over D ranks; [--fault drop-incoming]:\n"
            "         testing only (negative controls), deliberately WRONG results\n"
            "  layer  --weights W [--config C] [--prefix P] --in IN --out OUT [--backward]\n"
            "         [--keep min|proj] [--decode N] [--cp S [--shards ..]]  the Qwen3.5 layer\n"            "         [--cu-seqlens 0,a,..,T]: packed documents (or a cu_seqlens tensor in IN; B = 1)\n"
            "  attention --weights W [--config C] [--prefix P] --in IN --out OUT [--backward]\n"
            "         [--decode N] [--position-offset P] [--cu-seqlens ..] [--cp kv|heads [--shards ..]]\n"
            "         Qwen3.5's gated attention layer (positions also from position_ids in IN)\n"
            "  bench  kernel [--json] [--quick] [--case NAME,..]    kernel benchmark\n"
            "  bench  layer [--json] [--quick] [--T N] [--compute fp32|bf16|both]  layer benchmark (fwd, fwd+bwd, decode)\n"
            "  bench  attention [--json] [--quick] [--shape S] [--T N,..] [--threads N] [--reps R]\n"
            "         [--what core,layer]   attention layer and core (gdn_sdpa) benchmark\n"
            "  bench  train [--json] [--quick] [--T N] [--B N]      training step (tiny, small)\n"
            "  bench  decode [--json] [--quick]                     decode step (gdn_step) benchmark\n"
            "  bench  matmul [--json] [--quick] [--M N] [--reps R]  projection GEMM, fp32 and BF16 compute\n"
            "  bench  moe [--json] [--quick] [--shape 35b|next|both] [--T N,..] [--compute fp32|bf16|both]\n"
            "         [--threads N] [--reps R]   sparse MoE block benchmark (fwd, fwd+bwd, decode)\n"
            "  bench  cp [--json] [--T N] [--reps R]  (under mpiexec) context-parallel benchmark\n"
            "  bench  attention-cp [--T N] [--H --Hkv --d --E N] [--reps R]  (under mpiexec) attention CP\n"
            "  diff   OURS REF [--tol X]                           per-tensor relative error\n"
            "  gen    --out F [--B --T --Hk --Hv --K --V --seed]   write a random problem\n"
            "         [--gates qwen|mild|strong (default qwen)] [--slow-fraction F (0.25)]\n"
            "         [--cu-seqlens 0,a,..,T]: also write them, h0 and dht per document\n"
            "  train  --data FILE [--model tiny|small|long] [--seq T] [--batch B] [--steps N]\n"
            "         [--cp C] [--out DIR] [--resume DIR] [--log F.csv] ...  (under mpiexec: DP x CP)\n"
            "         train the hybrid language model on byte text or a token file; gdncp train for every option\n"
            "  sample --ckpt DIR --prompt TEXT [--tokens N] [--temperature T]  generate text (or ids)\n"
            "  help                                                 this text (gdncp COMMAND --help: its options)\n");
}

/* How a subcommand meets MPI: never (a single process), always (it runs under mpiexec), or only
 * when its command line asks for context parallelism (--cp). */
enum { MPI_NEVER, MPI_ALWAYS, MPI_WITH_CP };

/* The dispatch table: the command's words (a second word selects a bench), its function and its
 * MPI mode. Every function gets the arguments from the command's first word on. */
static const struct {
    const char *word, *sub; /* sub NULL: any (or no) second word */
    int (*fn)(int argc, char **argv);
    int mpi;
    const char *usage;       /* (a command not yet on an option table) */
    const cli_command *cli;  /* the command's options: its --help, parser and docs */
} commands[] = {
    {"run", NULL, cmd_run, MPI_WITH_CP, NULL, &cmd_run_cli},
    {"layer", NULL, cmd_layer, MPI_WITH_CP, NULL, &cmd_layer_cli},
    {"attention", NULL, cmd_attention, MPI_WITH_CP, NULL, &cmd_attention_cli},
    {"bench", "layer", cmd_bench_layer, MPI_NEVER, cmd_bench_layer_usage},
    {"bench", "attention", cmd_bench_attention, MPI_NEVER, cmd_bench_attention_usage},
    {"bench", "cp", cmd_bench_cp, MPI_ALWAYS, cmd_bench_cp_usage},
    {"bench", "attention-cp", cmd_bench_attention_cp, MPI_ALWAYS, cmd_bench_attention_cp_usage},
    {"bench", "train", cmd_bench_train, MPI_NEVER, cmd_bench_train_usage},
    {"bench", "decode", cmd_bench_decode, MPI_NEVER, cmd_bench_decode_usage},
    {"bench", "matmul", cmd_bench_matmul, MPI_NEVER, cmd_bench_matmul_usage},
    {"bench", "moe", cmd_bench_moe, MPI_NEVER, cmd_bench_moe_usage},
    {"bench", NULL, cmd_bench, MPI_NEVER, cmd_bench_usage}, /* bench kernel (and its refusals of unknown benches) */
    {"diff", NULL, cmd_diff, MPI_NEVER, NULL, &cmd_diff_cli},
    {"gen", NULL, cmd_gen, MPI_NEVER, NULL, &cmd_gen_cli},
    {"train", NULL, cmd_train, MPI_ALWAYS, NULL, &cmd_train_cli},
    {"sample", NULL, cmd_sample, MPI_NEVER, NULL, &cmd_sample_cli},
};

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
        usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        if (strcmp(argv[1], commands[i].word) || (commands[i].sub && (argc < 3 || strcmp(argv[2], commands[i].sub))))
            continue;
        /* --help or -h anywhere among the options: this command's usage, no run (and no MPI) */
        for (int a = commands[i].sub ? 3 : 2; a < argc; a++)
            if (!strcmp(argv[a], "--help") || !strcmp(argv[a], "-h")) {
                if (commands[i].cli) cli_help(stdout, commands[i].cli);
                else fputs(commands[i].usage, stdout);
                return 0;
            }
        int mpi = commands[i].mpi == MPI_ALWAYS;
        for (int a = 2; commands[i].mpi == MPI_WITH_CP && a < argc; a++) mpi |= !strcmp(argv[a], "--cp");
        return mpi ? with_mpi(commands[i].fn, argc, argv) : commands[i].fn(argc - 1, argv + 1);
    }
    fprintf(stderr, "gdncp: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
