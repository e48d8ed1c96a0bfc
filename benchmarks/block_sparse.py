"""Issue 4's block-sparse INA benchmark: allreduce(x, sparse=True) against dense INA of the same
block-sparse tensors and gloo's dense allreduce, by fraction of non-zero blocks. Same as `switchsim bench
blocksparse`; arguments pass through, e.g. `python benchmarks/block_sparse.py --sizes 16 --workers 2,4
--backends c --codecs int32,fixed,nc --densities 0.001,0.01,0.1,1`."""
import sys

from inacli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "blocksparse", *sys.argv[1:]]))
