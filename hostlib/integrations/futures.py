"""Handing a collective's error to c10d as C++ code expects it.

torch.futures.Future.set_exception stores the exception as the future's *value* (with a Python-only unwrap
function), so C++ readers of the future — DDP's reducer, c10d's comm hook plumbing — read an exception
object where they expect tensors, and crash (SIGSEGV) or fail with "Unable to cast ... to Tensor". A
process group written in Python must complete the future with a C++ error instead. Two ways, best first:

- `future_error.cpp`, a small torch extension built once per machine and torch version (torch's
  cpp_extension, cached in $TORCH_EXTENSIONS_DIR, ~1 minute on 2 cores; `python -m
  hostlib.integrations.futures` builds it, `make install-test` does): the error is a torch::python_error
  holding the exception, so `loss.backward()` under DDP raises the *same* exception (PeerDead, ValueError,
  ...) on every rank.
- Without a compiler: the future is a `then` of a private one whose callback raises; torch stores that as a
  RuntimeError whose text starts with the exception's class and message. Never a crash, but the class is
  only in the text (wait() on the Work still raises the exception itself).
"""
from __future__ import annotations

import os
import threading
import warnings

import torch

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "future_error.cpp")
_lock = threading.Lock()
_module = None
_tried = False


def extension():
    """The compiled extension (built on first use, then loaded from torch's cache), or None where it cannot
    be built or $INA_FUTURE_EXTENSION=0 (then errors reach DDP as RuntimeError text)."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("INA_FUTURE_EXTENSION") == "0":
            return None
        from torch.utils import cpp_extension

        try:
            _module = cpp_extension.load("hostlib_future_error", [_SOURCE], verbose=False)
        except Exception as e:  # noqa: BLE001 - no compiler, no headers: the portable path still works
            warnings.warn(f"hostlib: could not build {os.path.basename(_SOURCE)} ({e}); collective errors reach "
                          f"DDP as RuntimeError naming the exception", RuntimeWarning, stacklevel=2)
        return _module


class ErrorFuture:
    """A torch Future for one collective, completed from the worker thread with a result or an exception;
    `future` is what c10d gets (Work.get_future())."""

    def __init__(self):
        self._ext = extension()
        self.error: BaseException | None = None
        self.completed = threading.Event()  # set once the future is complete (callbacks run)
        if self._ext is not None:
            self._source = self.future = torch.futures.Future()
        else:
            self._source = torch.futures.Future()
            self.future = self._source.then(self._unwrap)

    def _unwrap(self, source):
        if self.error is not None:
            raise self.error
        return source.value()

    def set_result(self, value):
        self._source.set_result(value)
        self.completed.set()

    def set_exception(self, error: BaseException):
        self.error = error
        if self._ext is not None:
            self._ext.set_error(self._source, error)
        else:
            self._source.set_result(None)
        self.completed.set()


if __name__ == "__main__":
    module = extension()
    print(f"hostlib: {'built' if module is not None else 'could not build'} the future-error extension "
          f"({_SOURCE})")
    raise SystemExit(0 if module is not None else 1)
