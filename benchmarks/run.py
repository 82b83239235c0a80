"""Run the benchmarks: ``python benchmarks/run.py [--backend NAME] [--op NAME] [--quick] ...``.

The same runner as ``portable-llm bench`` and ``tox -e bench``; see benchmarks/README.md.
"""

import sys

from portable_llm.cli.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", *sys.argv[1:]]))
