"""Run under torchrun with 2 ranks: trains the same model with DDP's default hook and with ina_hook
(int32 on integer gradients, fixed, nc) and saves every rank's final parameters to $OUT/<mode>-<rank>.pt."""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hostlib.integrations.torch import INAHookState, ina_hook

STEPS = 4


def integer_model():
    g = torch.Generator().manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 4, bias=False))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-2, 3, p.shape, generator=g).float())
    return m


def float_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))


def batch_loss(model, integer, g):
    """A step's loss; with integer inputs, targets and weights every gradient is an integer."""
    if integer:
        x = torch.randint(-3, 4, (5, 8), generator=g).float()
        t = torch.randint(-1, 2, (5, 4), generator=g).float()
        return (model(x) * t).sum()
    return model(torch.randn(16, 20, generator=g)).pow(2).mean()


def train(mode, hook_state, rank):
    integer = mode.endswith("int32")
    model = integer_model() if integer else float_model()
    ddp = DDP(model, bucket_cap_mb=0.001)  # several buckets per step
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, ina_hook)
    # lr 2 with 2 ranks: the update is the integer sum of both ranks' gradients, so parameters stay integers
    opt = torch.optim.SGD(ddp.parameters(), lr=2.0 if integer else 0.1)
    g = torch.Generator().manual_seed(100 + rank)
    grad_max = 0.0
    for _ in range(STEPS):
        loss = batch_loss(ddp, integer, g)
        opt.zero_grad()
        loss.backward()
        grad_max = max(grad_max, max(float(p.grad.abs().max()) for p in model.parameters()))
        opt.step()
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "grad_max": grad_max},
               os.path.join(os.environ["OUT"], f"{mode}-{rank}.pt"))


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    modes = sys.argv[1:]
    for job, mode in enumerate(modes, start=1):
        if mode.startswith("default"):
            train(mode, None, rank)
        else:
            state = INAHookState(codec=mode.split("-")[1], job=job, timeout=30)
            train(mode, state, rank)
            state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
