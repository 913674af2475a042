#!/usr/bin/env python
"""Entry point of ``python -m sglang_mamba_ext.benchmarks.serving_defaults``: the CPU server with --enable-mamba-radix under its old default (--radix-eviction-policy lru), its new default (no policy flag) and optionally --disable-overlap-schedule, measured with SGLang's own bench_serving on a multi-turn shared-prefix and a no-reuse workload, alternating rounds.

Same arguments, output and exit status as the module (see its docstring, or ``--help``).
"""

import sys

from sglang_mamba_ext.benchmarks.serving_defaults import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
