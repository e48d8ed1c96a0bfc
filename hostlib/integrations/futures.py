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

import collections
import os
import sys
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

        path = os.environ.get("PATH", "")
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + path  # pip's ninja, beside python
        try:
            _module = cpp_extension.load("hostlib_future_error", [_SOURCE], verbose=False)
        except Exception as e:  # noqa: BLE001 - no compiler, no headers: the portable path still works
            warnings.warn(f"hostlib: could not build {os.path.basename(_SOURCE)} ({e}); collective errors reach "
                          f"DDP as RuntimeError naming the exception", RuntimeWarning, stacklevel=2)
        finally:
            os.environ["PATH"] = path
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


class CallQueue:
    """One thread runs a group's calls in call order (DDP overlaps its buckets with backward), and a caller
    that waits for a call nobody has started yet runs it itself: a synchronous all_reduce then costs no
    hand-off between threads (two wake-ups, ~1 ms each on a busy 2-core machine), an asynchronous one still
    progresses while the caller computes."""

    def __init__(self, name: str):
        self._cv = threading.Condition()
        self._tasks: collections.deque = collections.deque()
        self._running = False
        self._closed = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> list:
        """Queue fn(*args); returns its entry (for run_now)."""
        entry = [fn, args]
        with self._cv:
            if self._closed:
                raise RuntimeError("process group 'ina' is shut down")
            self._tasks.append(entry)
            self._cv.notify_all()
        return entry

    def run_now(self, entry) -> bool:
        """Run entry here if it is next and nothing runs (every earlier call is done); False otherwise."""
        with self._cv:
            if self._running or not self._tasks or self._tasks[0] is not entry:
                return False
            self._tasks.popleft()
            self._running = True
        self._run(entry)
        return True

    def drain(self):
        """Wait until every call queued so far has run."""
        with self._cv:
            self._cv.wait_for(lambda: not self._tasks and not self._running)

    def close(self):
        """Run what is queued, then stop the thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()

    def _loop(self):
        while True:
            with self._cv:
                self._cv.wait_for(lambda: (self._tasks and not self._running) or (self._closed and not self._tasks
                                                                                    and not self._running))
                if not self._tasks:
                    return
                entry = self._tasks.popleft()
                self._running = True
            self._run(entry)

    def _run(self, entry):
        fn, args = entry
        try:
            fn(*args)
        finally:
            with self._cv:
                self._running = False
                self._cv.notify_all()
