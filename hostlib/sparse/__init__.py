"""The sparse path: sparsifiers with error feedback and the DeepReduce container with its index and value
codecs (one file each under index/ and values/).

    from hostlib import sparse
    idx, val = sparse.Sparsifier("topk", ratio=0.01)(grad)
    dr = sparse.DeepReduce(index="bloom-p0", value="qsgd")
    blob = dr.encode(idx, val, grad.size)
    idx2, val2, size = sparse.DeepReduce.decode(blob)
"""
from .bits import CodecError
from .container import DeepReduce, index_codec, value_codec
from .index import INDEX_CODECS
from .sbc import SBC
from .sparsify import Sparsifier
from .values import VALUE_CODECS

__all__ = ["CodecError", "DeepReduce", "INDEX_CODECS", "SBC", "VALUE_CODECS", "Sparsifier", "index_codec",
           "value_codec"]
