"""Handing a collective's error to c10d as C++ code expects it.

torch.futures.Future.set_exception stores the exception as the future's *value* (with a Python-only unwrap
function), so C++ readers of the future — DDP's reducer, c10d's comm hook plumbing — read an exception
object where they expect tensors, and crash (SIGSEGV) or fail with "Unable to cast ... to Tensor". A
process group written in Python must complete the future with a C++ error instead. Two ways, best first:

- `future_error.cpp`, a small torch extension built once per machine and torch version (torch's
  cpp_extension, cached in $TORCH_EXTENSIONS_DIR, ~30 s on 2 cores; `python -m
  hostlib.integrations.futures` builds it, `make install-test` does): the error is a torch::python_error
  holding the exception, so `loss.backward()` under DDP raises the *same* exception (PeerDead, ValueError,
  ...) on every rank. The same extension holds `inline_call.cpp`, the torch backend's reads of a small
  call's tensor and options in one call (torch_backend.ProcessGroupINA._inline_allreduce).
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
_SOURCES = [_SOURCE, os.path.join(os.path.dirname(_SOURCE), "inline_call.cpp")]  # the torch backend's inline reads
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
            _module = cpp_extension.load("hostlib_torch", _SOURCES, verbose=False)
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


_MAIN_THREAD = threading.main_thread().ident  # read once: on_callers_thread runs on every call


def on_callers_thread() -> bool:
    """Whether a call made now may run on the thread that waits for it: made from the main thread, outside
    backward (whose calls must progress with nobody waiting on them). inline_call.cpp answers the same in C."""
    return threading.get_ident() == _MAIN_THREAD and torch._C._current_autograd_node() is None


class CallQueue:
    """A group's calls in call order, run by one thread or by the caller that waits for them.

    A call submitted from a background thread (DDP's autograd engine, FSDP's hooks) wakes the queue's
    thread, so it progresses while the caller computes. A call from the main thread does not: the thread that
    waits for it (c10d's synchronous all_reduce, wait() on an async Work, a barrier) runs it, and every call
    queued before it, itself. A synchronous call then costs no hand-off between threads (two wake-ups, a
    millisecond or more on a busy 2-core machine); an async_op=True call from the main thread runs when it is
    waited for, or when a background call wakes the thread."""

    def __init__(self, name: str):
        self._lock = lock = threading.Lock()  # taken bare on the synchronous path (a Condition's is Python code)
        self._cv = threading.Condition(lock)  # the queue's thread waits here (for calls to run)
        self._idle = threading.Condition(lock)  # callers wait here (for a running call to end): a call that
        # ends wakes them, not the queue's thread, which would cost a wake-up per synchronous call
        self._idle_waiters = 0  # callers in _idle.wait_for: a call that ends notifies only if there are some
        self._tasks: collections.deque = collections.deque()
        self._running = False
        self._closed = False
        self.inline = 0  # calls run by the thread that waited for them
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, *args, wake: bool | None = None) -> "_Call":
        """Queue fn(*args) and return its entry. wake=None: wake the queue's thread for a call made from
        another thread or inside backward (DDP's reducer, FSDP's hooks: the autograd engine runs CPU graphs
        on the caller's thread), which must progress with nobody waiting on it."""
        if wake is None:
            wake = not on_callers_thread()
        entry = _Call(fn, args)
        with self._cv:
            if self._closed:
                raise RuntimeError("process group 'ina' is shut down")
            self._tasks.append(entry)
            if wake:
                self._cv.notify()
        return entry

    def try_run(self, fn) -> bool:
        """Run fn on this thread at once when no call is queued or running (a synchronous call from the main
        thread: nothing to order it after, no future to make); False, and nothing run, otherwise."""
        if not self.enter():
            return False
        try:
            fn()
        finally:
            self.leave()
        return True

    def enter(self) -> bool:
        """try_run's first half, for a caller that runs its call itself: True, and the queue is running this
        thread's call until leave(), when no call is queued or running; False, and nothing changed, otherwise."""
        with self._lock:
            if self._tasks or self._running or self._closed:
                return False
            self._running = True
            self.inline += 1
        return True

    def wake(self):
        """Let the queue's thread run the queued calls (someone will wait on a call's future, not here)."""
        with self._cv:
            self._cv.notify()

    def run_until(self, entry):
        """Run, on this thread, the queued calls up to entry (in order), unless the queue's thread is busy
        with them; returns once entry has left the queue (run here, or taken by the queue's thread)."""
        while True:
            with self._cv:
                self._wait_idle(lambda: not self._running or entry not in self._tasks)
                if entry not in self._tasks:
                    return
                head = self._tasks.popleft()
                self._running = True
                self.inline += 1
            self._run(head)

    def drain(self):
        """Run (or wait for) every call queued so far."""
        with self._cv:
            last = self._tasks[-1] if self._tasks else None
        if last is not None:
            self.run_until(last)
        with self._cv:
            self._wait_idle(lambda: not self._running)

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
                self._cv.wait_for(lambda: (self._tasks and not self._running) or self._closed)
                if not self._tasks:
                    if self._closed and not self._running:
                        return
                    continue
                entry = self._tasks.popleft()
                self._running = True
            self._run(entry)

    def _wait_idle(self, predicate):
        """_idle.wait_for(predicate), counted (the lock is held)."""
        self._idle_waiters += 1
        try:
            self._idle.wait_for(predicate)
        finally:
            self._idle_waiters -= 1

    def _run(self, entry):
        try:
            entry.fn(*entry.args)
        finally:
            self.leave()

    def leave(self):
        """The call enter() (or the queue) began has ended: wake whoever waits for that."""
        with self._lock:
            self._running = False
            if self._idle_waiters:
                self._idle.notify_all()
            if self._tasks or self._closed:
                self._cv.notify()


class _Call:
    """A queued call (compared by identity)."""

    __slots__ = ("fn", "args")

    def __init__(self, fn, args):
        self.fn, self.args = fn, args


if __name__ == "__main__":
    module = extension()
    print(f"hostlib: {'built' if module is not None else 'could not build'} the torch extension "
          f"({', '.join(_SOURCES)})")
    raise SystemExit(0 if module is not None else 1)
