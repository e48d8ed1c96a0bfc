"""Value codecs, one file each behind `ValueCodec`."""
from .base import ValueCodec
from .deflate import DeflateCodec
from .dexp import DExpCodec
from .nc import NCValueCodec
from .none import NoneCodec
from .polyfit import PolyFitCodec
from .qsgd import QSGDCodec

VALUE_CODECS = {"polyfit": PolyFitCodec, "dexp": DExpCodec, "qsgd": QSGDCodec, "deflate": DeflateCodec,
                "nc": NCValueCodec, "none": NoneCodec}

__all__ = ["ValueCodec", "VALUE_CODECS"]
