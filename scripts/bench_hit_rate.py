#!/usr/bin/env python
"""Entry point of ``python -m sglang_mamba_ext.benchmarks.hit_rate``: usable hit rate and recomputed prefill, SGLang's strategies vs this cache.

Same arguments, output and exit status as the module (see its docstring, or ``--help``).
"""

import sys

from sglang_mamba_ext.benchmarks.hit_rate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
