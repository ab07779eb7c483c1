"""A torchrun script as PyTorch's DDP tutorial writes one: gloo, a DistributedSampler
DataLoader, a snapshot rank 0 saves every epoch and every rank loads at the start.

    torchrun --nproc-per-node 2 ddp_snapshot.py EPOCHS [--out final.pt] [--epoch-sleep S]
"""

import argparse
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


def on_sigterm(signum, frame):
    print(f"rank {os.environ['RANK']} got SIGTERM", flush=True)
    sys.exit(143)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("epochs", type=int)
    parser.add_argument("--snapshot", default="snapshot.pt")
    parser.add_argument("--out", default="final.pt")
    parser.add_argument("--epoch-sleep", type=float, default=0.0)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--env-out", default="")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    if args.env_out:
        with open(f"{args.env_out}.{rank}.json", "w") as f:
            json.dump({k: os.environ.get(k) for k in TORCHRUN_ENV}, f)
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x.sum(1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    first = 0
    if os.path.exists(args.snapshot):
        state = torch.load(args.snapshot)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = state["epoch"] + 1
        print(f"resumed from epoch {state['epoch']} at restart "
              f"{os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
    ddp = DDP(model)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    for epoch in range(first, args.epochs):
        sampler.set_epoch(epoch)
        for i, (xb, yb) in enumerate(loader):
            if rank == args.fail_rank and epoch == 1 and i == 2:
                try:
                    raise ValueError(f"a bad batch on rank {rank}")
                except ValueError:
                    traceback.print_exc()
                    sys.exit(7)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
        if rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       args.snapshot + ".tmp")
            os.replace(args.snapshot + ".tmp", args.snapshot)
        dist.barrier()
        print(f"epoch {epoch} loss {loss.item():.4f}", flush=True)
        time.sleep(args.epoch_sleep)
    if rank == 0:
        torch.save(model.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
