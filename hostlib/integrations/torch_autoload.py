"""torch's backend autoload entry point ("torch.backends" in pyproject.toml), apart from torch_backend so that
importing torch_backend first (which imports torch, which autoloads) never meets its own half-done module."""
from __future__ import annotations

import sys
import warnings

MODULE = "hostlib.integrations.torch_backend"


def being_imported() -> bool:
    """torch_backend is half imported (it imported torch, which is loading its backends): it registers "ina"
    itself when its import ends."""
    module = sys.modules.get(MODULE)
    return module is not None and not hasattr(module, "ProcessGroupINA")


def autoload():
    """Register "ina" while torch is being imported; an error here would make `import torch` fail, so it only
    warns."""
    if being_imported():
        return
    try:
        from .torch_backend import register
        register()
    except Exception as e:  # noqa: BLE001 - never break torch's import
        warnings.warn(f"hostlib: torch.distributed backend 'ina' not registered: {e}", stacklevel=2)
