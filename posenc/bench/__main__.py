"""``python -m posenc.bench``: the entry point; the benchmark itself is ``posenc/bench/run.py``."""

from posenc.bench.run import main

if __name__ == "__main__":
    main()
