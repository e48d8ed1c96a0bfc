"""Horovod: route the gradient allreduce of `hvd.DistributedOptimizer` through the INA switch.

One line changes in a Horovod training script:

    import horovod.torch as hvd
    from hostlib.integrations import horovod as ina_hvd
    opt = ina_hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), codec="fixed")
    # instead of hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

Rank and size come from Horovod (`hvd.init()` as usual; `hvd.broadcast_parameters` still sets the
start), the switch address from `switch`, $INA_SWITCH, or $MASTER_ADDR:$INA_SWITCH_PORT. `step()` (or
`synchronize()`) averages every gradient through the switch in one stream, in parameter order, which
is the same on every rank.
"""
from __future__ import annotations

import torch

from .common import GradientReducer


class _INAOptimizer:
    """Mixed into the wrapped optimizer's class, like Horovod's own _DistributedOptimizer."""

    def _ina_setup(self, reducer: GradientReducer, named_parameters):
        import horovod.torch as hvd

        self._ina = reducer
        self._ina_hvd = hvd
        reducer.allgather = hvd.allgather_object
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            ids = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(params) if id(p) not in ids]
            if missing:
                raise ValueError(f"named_parameters does not cover the optimizer's parameters {missing}")
        self._ina_params = params
        self._ina_synchronized = False

    def synchronize(self):
        """Average the gradients over all ranks through the switch (called by step() unless done already)."""
        hvd = self._ina_hvd
        if not hvd.is_initialized():
            raise RuntimeError("horovod is not initialised: call hvd.init() first")
        self._ina.connect(hvd.rank(), hvd.size())
        with_grad = [p for p in self._ina_params if p.grad is not None]
        if with_grad:
            flat = torch.cat([p.grad.detach().reshape(-1).to("cpu", torch.float32) for p in with_grad])
            mean = torch.from_numpy(self._ina.average(flat.numpy(), "gradients"))
            offset = 0
            for p in with_grad:
                n = p.grad.numel()
                p.grad.copy_(mean[offset:offset + n].view_as(p.grad))
                offset += n
        self._ina_synchronized = True

    def step(self, closure=None):
        if not self._ina_synchronized:
            self.synchronize()
        self._ina_synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        self._ina_synchronized = False
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    @property
    def ina_stats(self):
        """The switch connection's CommStats (bytes, packets, retransmissions), or None before the first step."""
        return self._ina.comm.stats if self._ina.comm is not None else None


def DistributedOptimizer(optimizer, named_parameters=None, switch=None, codec: str = "fixed", job=None,
                         error_feedback=None, **connect_kwargs):
    """Wrap `optimizer` so each step averages gradients through the INA switch (see the module doc).
    codec: 'fixed', 'nc' or 'int32'; other arguments as `hostlib.integrations.torch.INAHookState`."""
    reducer = GradientReducer(switch, codec, job, error_feedback, **connect_kwargs)
    methods = {k: v for k, v in _INAOptimizer.__dict__.items() if k not in ("__dict__", "__weakref__")}
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    opt = cls.__new__(cls)
    opt.__dict__ = optimizer.__dict__  # share state: the wrapped optimizer and this one are the same object
    opt._ina_setup(reducer, named_parameters)
    return opt


__all__ = ["DistributedOptimizer"]
