#!/usr/bin/env python
"""Entry point of the GPU check of the speculative kernels: ``python scripts/gpu_check.py
[--tiny] [--state-dtype bf16]`` runs :mod:`sglang_mamba_ext.speculative.ops.gpu_check` (the
package must be importable: installed, or the repository root on ``PYTHONPATH`` as
``scripts/gpu_check.sh`` sets it)."""

import sys

from sglang_mamba_ext.speculative.ops.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
