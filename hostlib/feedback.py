"""Error feedback (GRACE's Memory): what a compressor did not send, kept per tensor key and added to the
next input, so nothing is lost, only delayed (Stich et al.; SBC's residual accumulation; DGC). The
sparsifiers, SBC and the training reducers all keep their residuals here."""
from __future__ import annotations

import numpy as np


class ErrorFeedback:
    """Per key, the residual of the last compression.

    Args:
        enabled: False makes compensate() a copy and update() a no-op (no memory kept).
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.residuals: dict = {}

    def compensate(self, x: np.ndarray, key) -> np.ndarray:
        """x plus the key's residual (a new array; x unchanged). A residual of another shape is dropped."""
        r = self.residuals.get(key) if self.enabled else None
        return x + r if r is not None and r.shape == x.shape else x.copy()

    def update(self, key, residual: np.ndarray):
        """Remember what was not sent this time."""
        if self.enabled:
            self.residuals[key] = residual
