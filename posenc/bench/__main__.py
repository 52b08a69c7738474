"""``python -m posenc.bench``: the entry point; the benchmark itself is ``posenc/bench/run.py``."""

import sys

from posenc.bench.run import main
from posenc.config import check_command_line

if __name__ == "__main__":
    check_command_line(sys.argv[1:], "bench", "posenc.bench")  # a typo refused in one line, before any work
    main()
