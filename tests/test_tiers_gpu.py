"""``benchmarks/tiers_gpu.py`` (the state tiers' copy costs, run on a GPU by
``scripts/gpu_check.sh``) in its ``--tiny`` CPU mode: it runs, its round trips hold (int8
within half a quantization step, host copies exact), and its last line has the three ratios.
Timings on CPU mean nothing and are not checked."""

import contextlib
import io
import re
import unittest

from sglang_mamba_ext.benchmarks import tiers_gpu


class TestTiersGpuTinyMode(unittest.TestCase):
    def test_tiny_mode_runs_and_round_trips_hold(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = tiers_gpu.main(["--tiny", "--reps", "2"])
        self.assertEqual(rc, 0, out.getvalue())
        lines = out.getvalue().strip().splitlines()
        self.assertIn("host round trip exact=True", lines[-2])
        self.assertRegex(lines[-1], r"^int8_load_ratio=[0-9.]+ host_load_ratio=[0-9.]+ host_load_gbps=[0-9.]+$")
        err = float(re.search(r"max rel err=([0-9.e+-]+)", lines[-2]).group(1))
        self.assertLessEqual(err, 1 / 254 + 1e-6)


if __name__ == "__main__":
    unittest.main()
