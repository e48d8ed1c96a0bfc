"""Index codecs, one file each behind `IndexCodec`."""
from .base import IndexCodec
from .bitmap import BitmapCodec
from .bloom import BloomCodec
from .delta import DeltaCodec
from .golomb import GolombCodec
from .huffman import HuffmanCodec
from .rle import RLECodec

INDEX_CODECS = {
    "bloom-naive": lambda **kw: BloomCodec("naive", **kw),
    "bloom-p0": lambda **kw: BloomCodec("p0", **kw),
    "bloom-p1": lambda **kw: BloomCodec("p1", **kw),
    "bloom-p2": lambda **kw: BloomCodec("p2", **kw),
    "rle": RLECodec,
    "huffman": HuffmanCodec,
    "golomb": GolombCodec,
    "delta": DeltaCodec,
    "bitmap": BitmapCodec,
}

__all__ = ["IndexCodec", "INDEX_CODECS"]
