"""Issue 3's benchmarks: C/numpy codec kernels vs np.copyto, aggregator packets/s (C core vs the Python
reference), allreduce time per backend and codec vs torch gloo. Same as `switchsim bench`; arguments pass
through (none: every benchmark; `BENCHMARK [its flags]`: one, see `switchsim bench BENCHMARK -h`), e.g.
`python benchmarks/native_dataplane.py allreduce --sizes 1,16,64,256 --plot bench.png`."""
import sys

from inacli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
