from __future__ import annotations

import numpy as np


class ValueCodec:
    """Compresses the values of a sparse tensor (float32). `sorted_input`: the codec fits a curve to the
    values sorted in descending order, so the container sorts them first and sends the reordering map."""

    name = "?"
    lossless = True
    sorted_input = False

    def params(self) -> dict:
        return {}

    def encode(self, values: np.ndarray) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes, n: int) -> np.ndarray:
        raise NotImplementedError

    def metadata_length(self, data: bytes, n: int) -> int:
        """Leading bytes of `data` that describe its layout rather than values (DeepReduce's "metadata",
        counted apart from the value bits in DeepReduce.parts)."""
        return 0
