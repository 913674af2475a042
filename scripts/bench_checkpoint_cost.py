#!/usr/bin/env python
"""Entry point of ``python -m sglang_mamba_ext.benchmarks.checkpoint_cost``: the in-chunk checkpoint writers' CPU cost per checkpoint at offsets 63 and 2047.

Same arguments, output and exit status as the module (see its docstring, or ``--help``).
"""

import sys

from sglang_mamba_ext.benchmarks.checkpoint_cost import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
