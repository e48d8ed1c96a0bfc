"""Element codecs for the dense INA path, one file each, behind one interface (`Codec`).

A codec turns a block of a float/integer tensor into the payload of one update packet and the payload of
a result packet back into numbers. Codecs that need a shared scale take part in the exponent
negotiation: each worker reports `block_exponents(x)`, the switch returns the max over workers, and
`encode`/`decode` then use that agreed exponent.
"""
from __future__ import annotations

from .base import Codec
from .ditherswitch import DitherCodec
from .fixed import FixedPointCodec
from .int32 import Int32Codec
from .natural import NaturalCodec

CODECS = {"int32": Int32Codec, "fixed": FixedPointCodec, "nc": NaturalCodec, "dither": DitherCodec}


def get_codec(name: str, **params) -> Codec:
    """A codec by the name connect() and the CLI take, so callers never import codec classes.

    Args:
        name: "int32", "fixed", "nc" or "dither" (a key of CODECS).
        **params: the codec's options (rounding="deterministic" for nc, rounding="stochastic" for fixed,
            levels=s for dither).

    Returns:
        A new Codec instance.

    Raises:
        ValueError: an unknown name, or an option value the codec refuses.
        TypeError: an option the codec does not have.
    """
    try:
        cls = CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(CODECS)}") from None
    return cls(**params)


__all__ = ["Codec", "CODECS", "get_codec", "Int32Codec", "FixedPointCodec", "NaturalCodec", "DitherCodec"]
