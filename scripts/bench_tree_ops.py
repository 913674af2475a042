#!/usr/bin/env python
"""Entry point of ``python -m sglang_mamba_ext.benchmarks.tree_ops``: the cache cycle of this project's cache vs SGLang's UnifiedRadixCache.

Same arguments, output and exit status as the module (see its docstring, or ``--help``).
"""

import sys

from sglang_mamba_ext.benchmarks.tree_ops import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
