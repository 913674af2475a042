"""The in-chunk writers' CPU cost benchmark (``sglang_mamba_ext.benchmarks.checkpoint_cost``;
issue 39) at a tiny size: it runs, prints one line per writer and offset, and its last line."""

import contextlib
import io
import re
import unittest

from sglang_mamba_ext.benchmarks import checkpoint_cost


class TestCheckpointCostBench(unittest.TestCase):
    def test_tiny_run_prints_its_last_line(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = checkpoint_cost.main(["--tokens", "130", "--repeats", "1", "--old-repeats", "1"])
        self.assertEqual(rc, 0)
        lines = out.getvalue().strip().splitlines()
        self.assertRegex(lines[-1], r"^inchunk_offset_ratio=\d+\.\d{3} mamba2_offset_ratio=\d+\.\d{3}$")
        self.assertRegex(lines[-2], r"^selfpass_inchunk_offset_ratio=\d+\.\d{3} selfpass_mamba2_offset_ratio=\d+\.\d{3}$")
        self.assertRegex(lines[-3], r"^old_inchunk_offset_ratio=\d+\.\d{3} old_mamba2_offset_ratio=\d+\.\d{3}$")
        # from the prefill's chunk states, the writer's own pass, the old scan; two kinds of layer
        self.assertEqual(len([ln for ln in lines if re.search(r"offset 63: .* offset 129: ", ln)]), 6)

    def test_bad_arguments_exit_2(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(checkpoint_cost.main(["--tokens", "10"]), 2)
        self.assertIn("--tokens must be at least 65", err.getvalue())


if __name__ == "__main__":
    unittest.main()
