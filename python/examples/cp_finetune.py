"""Fine-tune a transformers Qwen3.5 checkpoint with its sequence split over MPI ranks or a
torchrun (torch.distributed, gloo) group (context parallelism): a standard PyTorch loop with
AdamW, two lines of gdncp.

    mpiexec.mpich -n 4 python python/examples/cp_finetune.py --model tests/data/qwen35_tiny \
        --text README.md --seq 4096 --steps 20
    torchrun --standalone --nproc-per-node 4 python/examples/cp_finetune.py --model ... (the same)

Under torchrun (its environment: LOCAL_RANK, no MPI rank) the script uses a gloo process group and
gdncp.transformers.patch(group=...); under mpiexec, mpi4py's COMM_WORLD and patch(comm=...).

Every rank loads the same checkpoint and reads the same text; each takes its own contiguous
slice of every sequence (rank 0 the first tokens). Under gdncp.transformers.patch(comm=comm) the
model's loss is the whole sequence's mean on every rank, and all_reduce_grads sums the ranks'
gradients into the single-process gradient, so the optimizer step is the same on every rank and
the copies of the model stay equal. The tokens here are bytes (the tiny checkpoint's vocabulary
is 256); for a real Qwen3.5 checkpoint tokenise with its tokenizer (python -m gdncp.tokenize).
"""
import argparse
import os
import resource
import time

import torch
from transformers import AutoModelForCausalLM

import gdncp.transformers as gtr


class Ranks:
    """The few collectives the loop needs, over mpi4py or torch.distributed (gloo)."""

    def __init__(self):
        self.torchrun = "LOCAL_RANK" in os.environ and "PMI_RANK" not in os.environ
        if self.torchrun:
            import torch.distributed as dist
            dist.init_process_group("gloo")
            self.dist, self.group = dist, dist.group.WORLD
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        else:
            from mpi4py import MPI
            self.MPI, self.comm = MPI, MPI.COMM_WORLD
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def patch(self, strategy, attention):
        if self.torchrun:
            return gtr.patch(group=self.group)
        return gtr.patch(comm=self.comm, strategy=strategy, attention=attention)

    def all_reduce_grads(self, model):
        gtr.all_reduce_grads(model, self.group if self.torchrun else self.comm)

    def max(self, x):
        if self.torchrun:
            t = torch.tensor([x], dtype=torch.float64)
            self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
            return float(t)
        return self.comm.allreduce(x, op=self.MPI.MAX)

    def gather(self, x):
        if self.torchrun:
            out = [None] * self.size
            self.dist.all_gather_object(out, x)
            return out
        return self.comm.gather(x, root=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Qwen3.5 / Qwen3-Next checkpoint directory")
    ap.add_argument("--text", required=True, help="training text (bytes as tokens)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per sequence (all ranks together)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--strategy", default="scan",
                    help="GatedDeltaNet CP under mpiexec: scan allgather relay heads")
    ap.add_argument("--attention", default="kv", help="attention CP under mpiexec: kv heads")
    ap.add_argument("--save", default=None, help="save the fine-tuned model here (rank 0)")
    a = ap.parse_args()

    ranks = Ranks()
    rank, size = ranks.rank, ranks.size
    torch.set_num_threads(max(1, torch.get_num_threads() // size))
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).train()
    data = torch.tensor(list(open(a.text, "rb").read()), dtype=torch.long)
    if data.numel() < a.seq + 1:
        raise SystemExit(f"{a.text} holds {data.numel()} bytes, fewer than --seq {a.seq}")
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    lo, hi = a.seq * rank // size, a.seq * (rank + 1) // size   # this rank's slice
    gen = torch.Generator().manual_seed(0)                        # the same sequences everywhere
    t_start = time.perf_counter()
    for step in range(1, a.steps + 1):
        start = int(torch.randint(0, data.numel() - a.seq, (1,), generator=gen))
        tokens = data[start:start + a.seq][None]
        t0 = time.perf_counter()
        opt.zero_grad()
        with ranks.patch(a.strategy, a.attention):
            loss = model(input_ids=tokens[:, lo:hi], labels=tokens[:, lo:hi]).loss
            loss.backward()
        ranks.all_reduce_grads(model)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = ranks.max(time.perf_counter() - t0)
        if rank == 0:
            print(f"step {step:4d}/{a.steps}  loss {loss.item():.4f}  {a.seq / dt:8.0f} tok/s",
                  flush=True)
    peak = ranks.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if rank == 0:
        print(f"{size} ranks ({'torchrun, gloo' if ranks.torchrun else 'mpiexec'}), {a.seq} tokens per sequence ({a.seq // size} per rank), "
              f"{time.perf_counter() - t_start:.1f} s; peak resident memory per rank (MB): "
              + ", ".join(f"{m:.0f}" for m in peak))
        if a.save:
            model.save_pretrained(a.save)
            print(f"saved {a.save}")


if __name__ == "__main__":
    main()
