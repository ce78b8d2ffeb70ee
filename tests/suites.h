/* Every test suite, once: read by the runners (tests/main.c: SUITE and SUITE_CLI;
 * tests/cp_main.c: SUITE_CP, every one run at each rank count) and by CMakeLists.txt, which
 * registers one CTest per SUITE / SUITE_CLI line (the CP ones as cp.D<ranks>). A suite named
 * NAME is the function test_NAME(void). SUITE_CLI suites run the command line, so they exist only
 * in builds with the MPI wing (GDN_MPI). Keep one suite per line: CMake reads the lines. */
#ifndef SUITE_CLI
#define SUITE_CLI(name) SUITE(name)
#endif
#ifndef SUITE_CP
#define SUITE_CP(name)
#endif
SUITE(forward)          /* kernel/test_forward.c: the chunked forward against the oracle */
SUITE(golden)           /* kernel/test_forward.c: the golden problems */
SUITE(summary)          /* kernel/test_summary.c: the (A, B) summaries */
SUITE(backward)         /* kernel/test_backward.c: the backward against the oracle */
SUITE(backward_chunked) /* kernel/test_backward.c: the chunked backward */
SUITE(safetensors)      /* io/test_safetensors.c: the reader and writer */
SUITE(errors)           /* kernel/test_errors.c: bad input everywhere */
SUITE_CLI(cli)          /* tools/test_cli.c: the command line's exit statuses and messages */
SUITE(matmul)           /* blas/test_matmul.c: the large GEMM */
SUITE(step)             /* kernel/test_step.c: gdn_step (decode) */
SUITE(layer_reference)  /* layer/test_layer_reference.c: the double layer vs finite differences and golden */
SUITE(layer_io)         /* io/test_layer_io.c: loading layer weights */
SUITE(layer)            /* layer/test_layer.c: the fp32 layer */
SUITE(model)            /* model/test_model.c: the decoder model and AdamW */
SUITE(train_io)         /* model/test_train_io.c: checkpoints and training text */
SUITE(pack)             /* kernel/test_pack.c: packed documents (cu_seqlens), one rank */
SUITE(attention)        /* layer/test_attention.c: the gated full-attention layer */
SUITE(attn_decode)      /* layer/test_attention_decode.c: its KV cache and decode */
SUITE(attn_io)          /* io/test_attn_io.c: loading attention weights */
SUITE(model_hybrid)     /* model/test_model_hybrid.c: the hybrid model against transformers */
SUITE(matmul_bf16)      /* blas/test_matmul_bf16.c: the BF16-compute GEMM, every path */
SUITE(sdpa)             /* layer/test_sdpa.c: the attention core alone (gdn_sdpa_*) */
SUITE(compute_bf16)     /* layer/test_compute_bf16.c: the layers in BF16 compute mode */
SUITE(tokens)           /* model/test_tokens.c: token files */
SUITE(sample)           /* model/test_sample.c: gdn_sample_next */
SUITE(hf_layouts)       /* model/test_hf_layouts.c: the model's weights in transformers' layouts */
SUITE(moe)              /* layer/test_moe.c: the sparse mixture-of-experts MLP */
SUITE(model_moe)        /* model/test_model_hybrid.c: the Qwen3.5-MoE model against transformers */
SUITE(alloc_failures)   /* model/test_alloc_failures.c: every allocation of forward, backward, decode, checkpoints failed in turn */
SUITE_CP(cp)            /* cp/test_cp.c: the rule's CP strategies, agreement, faults */
SUITE_CP(layer_cp)      /* cp/test_layer_cp.c: the GatedDeltaNet layer under CP */
SUITE_CP(model_cp)      /* cp/test_model_cp.c: the model under CP */
SUITE_CP(pack_cp)       /* cp/test_pack_cp.c: packed documents crossing ranks */
SUITE_CP(attention_cp)  /* cp/test_attention_cp.c: the attention layer under CP (kv, heads) */
SUITE_CP(model_cp_hybrid) /* cp/test_model_cp.c: the hybrid model under CP */
SUITE_CP(moe_ep)        /* cp/test_moe_ep.c: the MoE block with its experts split over ranks */
#undef SUITE_CLI
#undef SUITE_CP
