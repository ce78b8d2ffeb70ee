"""gdncp: the Gated DeltaNet rule of Qwen3.5 / Qwen3-Next on the CPU, from Python.

NumPy (no torch needed):   gdncp.chunk_forward, chunk_backward, step, reference_forward,
                           reference_backward, Layer
PyTorch:                   gdncp.torch.chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
                           (flash-linear-attention's signatures)
Context parallelism (MPI): gdncp.cp.chunk_gated_delta_rule(..., comm=, strategy=) (PyTorch),
                           gdncp.cp_forward, cp_backward (NumPy); mpi4py built for the same MPI
CP over torch.distributed: gdncp.torch_cp.build_cp_context / chunk_gated_delta_rule /
                           causal_conv1d (FLA's cp_context= calls; torchrun, gloo)
transformers:              with gdncp.transformers.patch(): ...
The whole model:           gdncp.Model.from_pretrained(dir) -> .logits(ids), .generate(ids, ...),
                           .generate_text(prompt, ...) (a Qwen3.5 checkpoint or gdncp train's output)

Every call runs the C library (libgdncp.so, shipped inside this package) through ctypes; there is
no second implementation of the mathematics in Python.
"""
from ._lib import GdncpError, gdn_version as _gdn_version
from .core import (Layer, chunk_backward, chunk_forward, cp_backward, cp_forward,
                   layer_param_names, reference_backward, reference_forward, step)
from .model import Model, ModelConfig

__version__ = _gdn_version().decode()  # the library's own (test_abi: = the package metadata)
__all__ = ["chunk_forward", "chunk_backward", "reference_forward", "reference_backward", "step",
           "Layer", "layer_param_names", "cp_forward", "cp_backward", "GdncpError",
           "Model", "ModelConfig"]
