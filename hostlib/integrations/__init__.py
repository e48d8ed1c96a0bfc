"""Framework integrations: `torch` (a DDP communication hook) and `horovod` (a DistributedOptimizer).
Both hand gradients to `common.GradientReducer`, which owns the switch connection and error feedback."""
