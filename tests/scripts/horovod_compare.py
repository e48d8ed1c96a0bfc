"""Run under horovodrun with 2 ranks: trains with Horovod's own DistributedOptimizer and with the INA one
(hostlib.integrations.horovod), saving every rank's final parameters to $OUT/<mode>-<rank>.pt."""
import os
import sys

import horovod.torch as hvd
import torch

from ddp_compare import STEPS, batch_loss, float_model, integer_model
from hostlib.integrations import horovod as ina_hvd


def train(mode, job):
    integer = mode.endswith("int32")
    model = integer_model() if integer else float_model()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=2.0 if integer else 0.1)
    if mode.startswith("hvd"):
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    elif mode == "ina-topk":  # the sparse path: top-25 %, Golomb + QSGD, through hvd.allgather_object
        opt = ina_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), codec="topk",
                                           ratio=0.25, index="golomb", value="qsgd")
    elif mode == "ina-blocktopk":  # top-50 % of 16-element blocks by block-sparse INA through the switch
        opt = ina_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), codec="fixed",
                                           block_topk=0.5, elements_per_packet=16, job=job, timeout=30)
    else:
        opt = ina_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           codec=mode.split("-")[1], job=job, timeout=30)
    g = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(STEPS):
        loss = batch_loss(model, integer, g)
        opt.zero_grad()
        loss.backward()
        opt.step()
    stats = None if mode.startswith("hvd") else {"bytes_sent": opt._ina.bytes_sent,
                                                  **(opt.ina_stats.as_dict() if opt.ina_stats else {})}
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "stats": stats},
               os.path.join(os.environ["OUT"], f"{mode}-{hvd.rank()}.pt"))


if __name__ == "__main__":
    hvd.init()
    for job, mode in enumerate(sys.argv[1:], start=1):
        train(mode, job)
