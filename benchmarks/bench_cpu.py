"""CPU benchmark: ours vs torch's SDPA vs the naive composition (see benchmarks/README.md).

The implementation lives in the package (attention_ext/bench.py) so that an installed wheel has
it too: `python -m attention_ext bench` runs the same code.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from attention_ext.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
