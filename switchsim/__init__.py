"""Switch side of the INA emulator: the reference data-plane model, its servers and the CLI."""
from .model import Switch

__all__ = ["Switch"]
