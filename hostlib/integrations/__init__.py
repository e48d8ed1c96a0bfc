"""Framework integrations: `torch` (a DDP communication hook), `torch_backend` (the "ina" torch.distributed
backend: init_process_group("ina"), with gloo as its fallback) and `horovod` (a DistributedOptimizer). The
hook and the optimizer hand gradients to `common.GradientReducer`, which owns the switch connection and error
feedback."""
