#!/usr/bin/env python
"""Entry point of ``python -m sglang_mamba_ext.benchmarks.serving_cpu``: the CPU server with --enable-mamba-radix vs SGLang's own cache (no_buffer) and vs --disable-radix-cache, multi-turn and no-reuse workloads, alternating rounds.

Same arguments, output and exit status as the module (see its docstring, or ``--help``).
"""

import sys

from sglang_mamba_ext.benchmarks.serving_cpu import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
