"""Errors a worker raises besides TimeoutError / OverflowError / ValueError."""


class INAError(RuntimeError):
    """The switch rejected a request (unknown job, wrong world size, bad rank...)."""
