"""python -m bench: see bench/README.md."""

import os
import sys

# Before anything imports tqdm (gguf does): tqdm reads this once, at import. The peer's GGUF
# dequantisation would otherwise draw progress bars over the harness's own progress lines.
os.environ.setdefault("TQDM_DISABLE", "1")

from bench.run import main  # noqa: E402

sys.exit(main())
