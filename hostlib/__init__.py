"""Worker side of the INA emulator: codecs, the SwitchML protocol, and `connect`."""
from . import errors
from .errors import CallAborted, CallMismatch, CollectiveError, INAError, PeerDead, SwitchFault
from .worker import Communicator, CommStats, connect

__all__ = ["connect", "Communicator", "CommStats", "errors", "INAError", "CollectiveError", "CallMismatch",
           "CallAborted", "PeerDead", "SwitchFault"]
__version__ = "0.1.0"


def _register_torch_backend():
    """init_process_group("ina") (hostlib.integrations.torch_backend), registered without making `import
    hostlib` import torch: at once where torch is loaded already, else right after torch's own import
    (a one-shot import hook). Nothing happens where torch is not installed."""
    import sys

    def register():
        from .integrations.torch_autoload import being_imported
        if being_imported():
            return  # torch_backend imported torch: it registers itself at its end
        try:
            from .integrations.torch_backend import register as register_ina
            register_ina()
        except Exception as e:  # noqa: BLE001 - a torch without distributed: hostlib works without it
            import warnings
            warnings.warn(f"hostlib: torch.distributed backend 'ina' not registered: {e}", stacklevel=2)

    if "torch" in sys.modules:
        register()
        return

    import importlib.abc
    import importlib.util

    class AfterTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec("torch")
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            exec_module = spec.loader.exec_module

            def exec_then_register(module):
                exec_module(module)
                register()

            spec.loader.exec_module = exec_then_register
            return spec

    sys.meta_path.insert(0, AfterTorch())


_register_torch_backend()
