/*
 * gdncp — the Gated DeltaNet token mixer (Qwen3.5 / Qwen3-Next), exact and fast, with context
 * parallelism over MPI.
 *
 * The umbrella header of the single-process API, one header per concern:
 *   gdncp/version.h  the version, gdn_version(), the export macro
 *   gdncp/status.h   status codes (GDN_ERR_MPI included), gdn_strerror, gdn_errmsg
 *   gdncp/isa.h      the instruction sets the library dispatches on, and GDNCP_ISA's cap
 *   gdncp/compute.h  the compute precision of the projections (fp32, or BF16 operands)
 *   gdncp/kernel.h   the gated delta rule: config, plan, forward/backward, summaries, oracle, step
 *   gdncp/layer.h    the GatedDeltaNet layer
 *   gdncp/attention.h Qwen3.5's gated full-attention layer
 *   gdncp/moe.h      the sparse mixture-of-experts MLP (Qwen3.5-MoE, Qwen3-Next)
 *   gdncp/io.h       safetensors, layer weights from checkpoints, problem files
 *   gdncp/bench.h    benchmark probes (measured peak, issued FLOPs)
 *   gdncp/sample.h   the next token from logits (greedy, temperature, top-k, top-p, a seed)
 *   gdncp/model.h    the hybrid language model: config, tensors, training forward/backward, decoder
 *   gdncp/optim.h    AdamW
 *   gdncp/data.h     training data (byte text, token files, packed documents)
 *   gdncp/checkpoint.h checkpoints in Hugging Face's layout
 * All of these are libgdncp, which links no MPI. The MPI wing, libgdncp_mpi, has its own headers,
 * which include <mpi.h> and are included on their own:
 *   gdncp/cp.h       context parallelism (the rule, the layers, the conv halo, the model, agreement)
 *   gdncp/ep.h       expert parallelism (the MoE block's experts split over ranks)
 *   gdncp/train.h    the trainer over a DP x CP grid of ranks
 *   gdncp/abi.h      every public struct's size and field offsets as compiled, both libraries'
 *                    (for bindings: its table includes the wing's headers, so it is the wing's)
 * Conventions: docs/design.md. Outputs first, then inputs, then sizes; a NULL where a tensor
 * is required is GDN_ERR_ARG naming it; on failure gdn_errmsg() names what is wrong.
 */
#ifndef GDNCP_H
#define GDNCP_H

#include "gdncp/version.h"
#include "gdncp/status.h"
#include "gdncp/isa.h"
#include "gdncp/compute.h"
#include "gdncp/kernel.h"
#include "gdncp/layer.h"
#include "gdncp/attention.h"
#include "gdncp/moe.h"
#include "gdncp/io.h"
#include "gdncp/bench.h"
#include "gdncp/sample.h"
#include "gdncp/model.h"
#include "gdncp/optim.h"
#include "gdncp/data.h"
#include "gdncp/checkpoint.h"

#endif /* GDNCP_H */
