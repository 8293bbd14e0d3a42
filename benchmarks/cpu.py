"""CPU benchmark beside llama-cpp-python and transformers: the same as `superslm bench` (superslm/bench.py).

    python benchmarks/cpu.py [--model PATH_OR_NAME] [--threads 2] [--peer llama.cpp] [--peer transformers]
"""

from __future__ import annotations

import sys

from superslm.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
