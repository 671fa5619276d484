"""python -m bench: see bench/README.md."""
import sys

from bench.run import main

sys.exit(main())
