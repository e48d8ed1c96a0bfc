"""Error feedback (GRACE's Memory): what a compressor did not send, kept per tensor key and added to the
next input, so nothing is lost, only delayed (Stich et al.; SBC's residual accumulation; DGC). The
sparsifiers, SBC and the training reducers all keep their residuals here."""
from __future__ import annotations

import numpy as np


class ErrorFeedback:
    """Per key, the residual of the last compression.

    Args:
        enabled: False makes compensate() a copy and update() a no-op (no memory kept), so callers need
            no branch of their own.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.residuals: dict = {}

    def compensate(self, x: np.ndarray, key) -> np.ndarray:
        """x plus the key's residual, before compressing x (a new array; x unchanged).

        Args:
            x: this step's input for the tensor.
            key: the tensor's identity across steps.

        Returns:
            x + residual; a residual of another shape is ignored (the tensor changed, e.g. a new bucket layout).
        """
        r = self.residuals.get(key) if self.enabled else None
        return x + r if r is not None and r.shape == x.shape else x.copy()

    def update(self, key, residual: np.ndarray):
        """Remember what was not sent this time, replacing the key's previous residual (compensate already
        folded it in).

        Args:
            key: the tensor's identity across steps.
            residual: compensated input minus what was sent.
        """
        if self.enabled:
            self.residuals[key] = residual
