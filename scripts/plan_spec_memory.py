#!/usr/bin/env python
"""Entry point of ``python -m sglang_mamba_ext.benchmarks.spec_memory``: memory of the speculative SSM buffers, snapshot vs deferred.

Same arguments, output and exit status as the module (see its docstring, or ``--help``).
"""

import sys

from sglang_mamba_ext.benchmarks.spec_memory import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
