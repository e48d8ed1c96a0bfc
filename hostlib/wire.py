"""Compatibility name: the protocol both sides speak lives in `inaproto.wire`; this module is that module."""
import sys

from inaproto import wire as _impl

sys.modules[__name__] = _impl
