/* The compute precision of gdncp's large matrix products (docs/design.md, "BF16 compute").
 *
 * GDN_COMPUTE_FP32 (the default): every product in fp32.
 * GDN_COMPUTE_BF16: the projections' GEMMs (the GatedDeltaNet layer's in_proj_qkv, in_proj_z and
 * out_proj, the attention layer's q/k/v/o_proj, the model's MLP and lm_head), forward and
 * backward (input and weight gradients), take both operands rounded to bfloat16 (nearest even)
 * and accumulate in fp32, on the best path the CPU and OS allow: AMX tiles (TDPBF16PS), else
 * AVX512-BF16 (VDPBF16PS), else an fp32-vector fallback with the same roundings. Products of at
 * most 16 rows (decoding a token) stay fp32 in either mode: reading the weights bounds them, and
 * the BF16 path would add a packing pass. The chunk kernel's forward sweep (gdn_config.compute;
 * a BF16 layer sets it) runs its chunk products the same way. Everything else stays fp32: the
 * recurrent state (only its operand copy in a product is rounded) and its composition across
 * ranks, the kernel's triangular solve, summaries and backward, the conv, the gate projections (in_proj_a / in_proj_b: their errors would compound through the
 * gates' cumulative products) and gates, norms, RoPE, the attention core's softmax and its
 * statistics, losses, optimizer moments and master weights. The attention core's products (QK^T,
 * PV; the backward's QK^T, dO V^T, P^T dO, dS^T Q, dS K) run bf16 on blocks of more than 8 query
 * rows (prefill and training; a decode step's few rows stay fp32), P rounded after it is scaled
 * against the running max. */
#ifndef GDNCP_COMPUTE_H
#define GDNCP_COMPUTE_H

#include <stddef.h>
#include <stdint.h>
#include "version.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { GDN_COMPUTE_FP32 = 0, GDN_COMPUTE_BF16 = 1 } gdn_compute;

/* The storage dtypes of tensors: files (io.h: safetensors), weights held in memory (a layer's
 * weight_dtype) and caches (a KV cache's). */
typedef enum { GDN_F32 = 0, GDN_F64 = 1, GDN_BF16 = 2, GDN_DTYPE_OTHER = 3 } gdn_dtype;

/* One tensor of a layer's flat parameter array (gdn_layer_param, gdn_attn_param, gdn_moe_param):
 * its Hugging Face name, its shape (PyTorch's; ndim 0 and numel 0 for a tensor the configuration
 * leaves out, e.g. the MoE shared expert when Is = 0), its offset in floats in the flat array
 * (each tensor on a 16-float boundary) and its element count. */
typedef struct {
    const char *name;
    int ndim;
    int64_t shape[3]; /* shape[0..ndim); the rest 0 */
    size_t offset, numel;
} gdn_param_info;

/* "fp32" / "bf16" -> *compute; GDN_ERR_ARG naming the text otherwise. */
GDN_API int gdn_compute_parse(const char *name, int *compute);
/* "fp32", "bf16" (NULL for another value). */
GDN_API const char *gdn_compute_name(int compute);
/* What runs the products in this mode on this machine, e.g. "bf16 AMX (TDPBF16PS, 32x32 block)". */
GDN_API const char *gdn_compute_path(int compute);

#ifdef __cplusplus
}
#endif
#endif /* GDNCP_COMPUTE_H */
