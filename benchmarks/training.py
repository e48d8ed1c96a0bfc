"""Issue 5's benchmarks: data-parallel training on scikit-learn's digits with gloo vs the INA hook (fixed,
nc): accuracy, bytes per worker, NC exponent histogram; and allreduce time vs size and worker count
against gloo. Same as `switchsim bench train|allreduce`, e.g.
`python benchmarks/training.py train --workers 4 --epochs 30 --plot train.png`."""
import sys

from switchsim.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "train", *sys.argv[1:]]))
