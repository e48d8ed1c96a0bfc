"""int32: integers summed exactly by the switch (which flags any sum outside int32)."""
from __future__ import annotations

import numpy as np

from .. import wire
from .base import Codec

I32 = np.iinfo(np.int32)


class Int32Codec(Codec):
    """Integers summed exactly: no scale, no negotiation, the one codec whose results need no error
    bound (methods as in Codec)."""

    name = "int32"

    def native_kind(self, flat):
        return "INT32" if np.issubdtype(flat.dtype, np.integer) or flat.dtype == np.bool_ else None
    wire_codec = wire.CODEC_INT32

    def check_input(self, flat):
        """Raises:
            TypeError: floats (they would be truncated; use fixed or nc).
            OverflowError: a value outside int32.
        """
        if not (np.issubdtype(flat.dtype, np.integer) or flat.dtype == np.bool_):
            raise TypeError(f"codec 'int32' sums integers exactly; got {flat.dtype} (use 'fixed' or 'nc' for floats)")
        if flat.size and not np.can_cast(flat.dtype, np.int32) and (flat.min() < I32.min or flat.max() > I32.max):
            raise OverflowError("codec 'int32': input values do not fit in int32")

    def encode(self, block, exp, world_size, seed, offset):
        return block.astype(">i4").tobytes()

    def decode(self, payloads, exps, world_size, k):
        return payloads
