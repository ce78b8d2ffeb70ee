"""What the two whole-model CP test files share (test_cp_train.py over mpi4py, patch(comm=);
test_torch_cp_train.py over a torch.distributed group, patch(group=)): the models, the
gradients, the error metric, and the comparison with the exact float64 references."""
import os

import numpy as np
import torch

from conftest import TINY, read_safetensors

# The exact references (tests/data/qwen35_tiny/model_grads.io.safetensors): plain tolerances,
# measured 8.5e-8 (loss) and 1.4e-6 (mpi4py), 3.3e-6 (gloo) (worst gradient) over 3 ranks.
EXACT_LOSS_TOL, EXACT_GRAD_TOL = 1e-6, 2e-5


def tiny():
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).train()


def next_tiny(seed=7):
    """A dense Qwen3-Next (no experts: fused GatedDeltaNet projections, plain MLPs), random."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = Qwen3NextConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=8, linear_value_head_dim=12, num_experts=0,
                          layer_types=["linear_attention", "full_attention", "linear_attention",
                                       "full_attention"])
    torch.manual_seed(seed)
    return Qwen3NextForCausalLM(cfg).float().train()


def moe_tiny(**extra):
    """Qwen3_5MoeForCausalLM (4 experts, 2 per token, a shared expert) made in the test."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    cfg = Qwen3_5MoeTextConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4,
                               num_experts_per_tok=2, moe_intermediate_size=32,
                               shared_expert_intermediate_size=32,
                               layer_types=["linear_attention"] * 3 + ["full_attention"], **extra)
    torch.manual_seed(9)
    return Qwen3_5MoeForCausalLM(cfg).float().train()


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a, b):
    """max-abs error / max-abs reference, in double."""
    a, b = a.double(), b.double()
    s = b.abs().max().item()
    return (a - b).abs().max().item() / (s if s > 0 else 1.0)


def exact_errors(cp_run, allgather):
    """cp_run(model, ids) -> (loss, gradients summed over the ranks) of the golden checkpoint on
    model_grads.io's two rows of 200 ids; allgather(obj) -> every rank's obj. Returns {name:
    (worst error over the ranks, tolerance)} against the exact float64 references, 'loss'
    included."""
    exact = read_safetensors(os.path.join(TINY, "model_grads.io.safetensors"))
    ids = torch.from_numpy(np.asarray(exact["input_ids"])).long()
    ref_loss = float(np.asarray(exact["loss"]).reshape(-1)[0])
    loss, got = cp_run(tiny(), ids)
    e = {"loss": (abs(loss - ref_loss) / abs(ref_loss), EXACT_LOSS_TOL)}
    for n, g in got.items():
        e[n] = (rel(g, torch.from_numpy(np.asarray(exact["grad." + n]))), EXACT_GRAD_TOL)
    table = allgather(e)
    return {k: (max(t[k][0] for t in table), tol) for k, (_, tol) in e.items()}


def worst_gradient(errs):
    return max(v for k, (v, _) in errs.items() if k != "loss")
