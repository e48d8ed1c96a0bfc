"""One torchrun worker of the liveness test (tests/test_torch_backend.py): DDP steps through the "ina"
backend until an error or $INA_TEST_SECONDS; writes its pid, then its step count, then what it raised
(class, message, time) as JSON lines to $INA_TEST_OUT/rank<RANK>.jsonl."""
import json
import os
import time

import torch
import torch.distributed as dist

import hostlib  # noqa: F401 - registers "ina"

rank = int(os.environ["RANK"])
path = os.path.join(os.environ["INA_TEST_OUT"], f"rank{rank}.jsonl")


def note(**fields):
    with open(path, "a") as f:
        f.write(json.dumps(fields) + "\n")


torch.set_num_threads(1)
dist.init_process_group("ina")
note(pid=os.getpid())
torch.manual_seed(0)
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4)))
deadline = time.monotonic() + float(os.environ.get("INA_TEST_SECONDS", "60"))
step = 0
try:
    while time.monotonic() < deadline:
        ddp(torch.randn(8, 32)).pow(2).mean().backward()
        step += 1
        if step % 10 == 0:
            note(step=step)
        time.sleep(0.01)
    note(error=None)
except Exception as e:  # noqa: BLE001 - what the test checks
    note(error=type(e).__name__, message=str(e), at=time.time())
os._exit(0)  # a dead peer: no clean shutdown to wait for
