"""Issue 4's codec benchmark: DeepReduce index/value codec combinations on a real gradient and on a
synthetic top-1 % of d = 25.5 M (bytes, encode/decode time, error). Same as `switchsim bench sparse`."""
import sys

from inacli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sparse", *sys.argv[1:]]))
