"""Train a converted (mode="train") Llama under FSDP2 or DDP, one process per rank.

    torchrun --nproc-per-node 2 examples/fsdp_train.py                 # FSDP2, gloo on CPU
    torchrun --nproc-per-node 2 examples/fsdp_train.py --wrap ddp
    torchrun --nproc-per-node 2 examples/fsdp_train.py --bf16-reduce  # gradients reduced in bf16

Every rank converts the same model (same seed) for bf16 with float32 master weights; the wrapper
then shards (FSDP2) or replicates (DDP) the converted module as a whole (sharding its submodules
does not work: the graph reads their parameters directly, so FSDP2's per-module hooks never run).
Rank 0 prints the all-reduced loss of each step. NCCL is used when every rank has a GPU, gloo otherwise.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers as hf

import mpgraph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wrap", choices=["fsdp2", "ddp"], default="fsdp2")
    ap.add_argument("--bf16-reduce", action="store_true",
                    help="FSDP2 MixedPrecisionPolicy(reduce_dtype=bfloat16): half the gradient "
                         "traffic (param_dtype stays None: mpgraph's plan casts the parameters)")
    ap.add_argument("--steps", type=int, default=10)
    opts = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    cfg = hf.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                         use_cache=False)
    torch.manual_seed(0)
    model = hf.LlamaForCausalLM(cfg).to(device).train()
    data = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (4 * world, 64), generator=data).to(device)
    converted = mpgraph.convert(model, ids[:4], dtype="bf16", mode="train")
    if opts.wrap == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(converted)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if opts.bf16_reduce else None)
        wrapped = fully_shard(converted, mp_policy=policy)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    batches = [torch.randint(0, cfg.vocab_size, (4 * world, 64), generator=data).to(device)
               for _ in range(2)]  # two batches, seen again and again: the loss must fall
    for step in range(opts.steps):
        mine = batches[step % 2][rank::world]
        logits = wrapped(mine).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), mine[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step}: loss {float(mean) / world:.4f}", flush=True)
    dist.barrier()
    # gloo's process group can deadlock while it is destroyed with the GIL held (pytorch#56297):
    # free the wrapper first, then the group
    del wrapped, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
