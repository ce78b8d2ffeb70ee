/* gdncp test runner. Usage: gdncp_tests [suite ...]; no argument runs every suite. */
#include "harness.h"

#include <stdio.h>
#include <string.h>

static const struct { const char *name; void (*fn)(void); } suites[] = {
    {"forward", test_forward},       {"golden", test_golden}, {"summary", test_summary},
    {"backward", test_backward}, {"backward_chunked", test_backward_chunked},
    {"safetensors", test_safetensors}, {"errors", test_errors}, {"cli", test_cli},
    {"matmul", test_matmul}, {"step", test_step}, {"layer_reference", test_layer_reference},
    {"layer_io", test_layer_io}, {"layer", test_layer}, {"model", test_model},
    {"train_io", test_train_io}, {"pack", test_pack},
    {"attention", test_attention}, {"attn_decode", test_attn_decode}, {"attn_io", test_attn_io},
    {"model_hybrid", test_model_hybrid}, {"matmul_bf16", test_matmul_bf16},
    {"sdpa", test_sdpa}, {"compute_bf16", test_compute_bf16}, {"tokens", test_tokens},
    {"sample", test_sample}, {"hf_layouts", test_hf_layouts}, {"moe", test_moe}, {"model_moe", test_model_moe},
};

int main(int argc, char **argv) {
    const int n = sizeof suites / sizeof suites[0];
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
