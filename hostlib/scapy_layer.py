"""Compatibility name: the protocol both sides speak lives in `inaproto.scapy_layer`; this module is that module."""
import sys

from inaproto import scapy_layer as _impl

sys.modules[__name__] = _impl
