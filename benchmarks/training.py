"""Issue 5's benchmarks: data-parallel training on scikit-learn's digits with gloo vs the INA hook (fixed,
nc): accuracy, bytes per worker, NC exponent histogram; and allreduce time vs size and worker count
against gloo. Same as `switchsim bench train|allreduce`, e.g.
`python benchmarks/training.py --workers 4 --epochs 30 --plot train.png` (train is the default)."""
import sys

from inacli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(["bench", *(args if args and not args[0].startswith("-") else ["train", *args])]))
