"""python/examples: cp_finetune.py runs over 2 MPI ranks (its own mpiexec) and over 2 torchrun
processes (gloo), and its first loss is transformers' on one process for the same sequence (the
whole-sequence loss of the patch; test_cp_train.py and test_torch_cp_train.py hold that
comparison's negative controls), and its saved model loads."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, TINY


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_cp_finetune_example_first_loss_is_transformers(tmp_path, launcher):
    text = os.path.join(REPO, "README.md")
    out_dir = tmp_path / "tuned"
    script = [os.path.join(REPO, "python", "examples", "cp_finetune.py"), "--model", TINY,
              "--text", text, "--seq", "96", "--steps", "2", "--save", str(out_dir)]
    if launcher == "mpiexec":
        cmd = ["mpiexec.mpich", "-n", "2", sys.executable] + script
    else:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--standalone", "--nproc-per-node", "2"] + script
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("GDNCP_TORCHRUN_TESTS", None)
    env.pop("GDNCP_MPI_TESTS", None)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    losses = [float(x) for x in re.findall(r"step +\d+/2 +loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 2, r.stdout
    assert re.search(r"peak resident memory per rank \(MB\): \d+, \d+", r.stdout), r.stdout
    assert ("torchrun, gloo" in r.stdout) == (launcher == "torchrun"), r.stdout
    # the example's first sequence, through transformers on one process
    from transformers import AutoModelForCausalLM
    data = torch.tensor(list(open(text, "rb").read()), dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    start = int(torch.randint(0, data.numel() - 96, (1,), generator=gen))
    ids = data[start:start + 96][None]
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    assert abs(losses[0] - ref) / ref < 1e-5, (losses, ref)
    tuned = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    with torch.no_grad():
        moved = max((a - b).abs().max().item()
                    for a, b in zip(tuned.parameters(), model.parameters()))
    assert moved > 0   # the two AdamW steps changed the weights that were saved
