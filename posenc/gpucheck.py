"""``python -m posenc.gpucheck``: the entry point; the check itself lives in ``posenc/gpu/check.py``."""

import sys

from posenc.gpu.check import main

if __name__ == "__main__":
    sys.exit(main())
