"""What allreduce does with its caller's arrays and tensors: sizes, views that share memory, copies back, the
GPU path's test. numpy and torch alike (torch imported only for torch tensors)."""
from __future__ import annotations

import numpy as np


def numel(x) -> int:
    n = getattr(x, "numel", None)
    return int(n()) if callable(n) else int(np.size(x))


def on_gpu_path(codec, x) -> bool:
    """Whether allreduce encodes x on its GPU (hostlib.cuda.allreduce_applies; hostlib.cuda loads ctypes and
    the library only for CUDA tensors)."""
    if not getattr(x, "is_cuda", False):
        return False
    from . import cuda

    return cuda.allreduce_applies(codec, x)


def out_view(out, x, arr: np.ndarray) -> np.ndarray | None:
    """allreduce's out as a flat array sharing its memory, or None where it cannot (a non-contiguous or
    GPU out: the sum is copied into it at the end).

    Raises:
        ValueError: out's shape or dtype is not x's, or out is read-only.
    """
    if tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype:
        raise ValueError(f"allreduce out must have x's shape and dtype: got {tuple(out.shape)} {out.dtype}, "
                         f"x is {tuple(x.shape)} {x.dtype}")
    if type(out).__module__.startswith("torch"):
        if out.device.type != "cpu" or not out.is_contiguous() or arr.dtype != to_numpy(out[:0]).dtype:
            return None
        return out.detach().numpy().reshape(-1)
    if not isinstance(out, np.ndarray) or not out.flags.writeable:
        raise ValueError("allreduce out must be a writable numpy array or a torch tensor")
    return out.reshape(-1) if out.flags.c_contiguous else None


def copy_into(out, res: np.ndarray, shape):
    """The sum into an out that allreduce could not write in place."""
    if type(out).__module__.startswith("torch"):
        import torch

        out.copy_(res.reshape(shape) if isinstance(res, torch.Tensor) else torch.from_numpy(res.reshape(shape)))
    else:
        np.copyto(out, np.asarray(res).reshape(shape), casting="unsafe")


def to_numpy(t):
    import torch

    t = t.detach().to("cpu")
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    return t.numpy()


def from_numpy(a, like):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype=like.dtype, device=like.device)
