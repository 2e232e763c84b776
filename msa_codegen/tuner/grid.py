"""``python -m msa_codegen.tuner.grid``: the shipped grid's command line (``msa_codegen.tuning.grid``)."""
import sys

from ..tuning.grid import main

if __name__ == "__main__":
    sys.exit(main())
