"""Compatibility name: the protocol both sides speak lives in `inaproto.rng`; this module is that module."""
import sys

from inaproto import rng as _impl

sys.modules[__name__] = _impl
