"""`python -m switchsim`: the command line (inacli, the package on top of this one; an entry point, which
nothing imports)."""
from inacli.main import main

raise SystemExit(main())
