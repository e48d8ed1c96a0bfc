"""Worker side of the INA emulator: codecs, the SwitchML protocol, and `connect`."""
from .worker import Communicator, CommStats, INAError, connect

__all__ = ["connect", "Communicator", "CommStats", "INAError"]
__version__ = "0.1.0"
