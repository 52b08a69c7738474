"""``python -m posenc.gpusession``: the entry point; the session itself lives in ``posenc/gpu/``."""

import sys

from posenc.gpu.session import main

if __name__ == "__main__":
    sys.exit(main())
