"""What a command needs beyond `make demo`'s install (the package alone), said once and by name instead of a
traceback per row: `switchsim bench ddp` in an environment without torch says which extra to install."""
from __future__ import annotations

import importlib.util
import sys

# module -> the pyproject extra that installs it
EXTRA_OF = {"torch": "torch", "matplotlib": "bench", "sklearn": "bench", "horovod": "test"}


def missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def require(command: str, *modules: str, why: str = "") -> bool:
    """True where every module imports; otherwise one line on stderr naming what to install, and False."""
    absent = [m for m in modules if missing(m)]
    if not absent:
        return True
    extras = sorted({EXTRA_OF.get(m, m) for m in absent})
    spec = ",".join(extras)
    print(f"switchsim {command} needs {', '.join(absent)}{f' ({why})' if why else ''}, which this environment "
          f"lacks: .venv/bin/pip install -e '.[{spec}]' (`make install-test` installs every extra)", file=sys.stderr)
    return False
