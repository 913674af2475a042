"""On-chip tree verify of a Mamba2 layer (issue 41, item 3; ``speculative/ops/verify/mamba2_onchip.py``):
the Triton kernel (CPU: Triton's interpreter) against its torch reference on EAGLE trees,
chains and padding rows, with SGLang's expanded ``dt`` / ``A`` / ``D`` / ``dt_bias`` views; and
against SGLang 0.5.23's own ``selective_state_update`` in its tree-verify form (node states
in an intermediate buffer, ``retrieve_parent_token``), in a subprocess under the interpreter."""

import json
import os
import subprocess
import sys
import textwrap
import unittest

import torch

from conftest import full_suite_only
from sglang_mamba_ext.testing.spec_pair import load_kernel_modules_for_cpu, triton_subprocess_case

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HV, P, N, G = 4, 8, 16, 2
_OPS = "sglang_mamba_ext.speculative.ops.verify."
_CAN_RUN = load_kernel_modules_for_cpu([_OPS + "mamba2_onchip"], [(_OPS + "mamba2_onchip", "_mamba2_tree_verify_kernel")])

#: a topk-2, 3-step EAGLE tree of 6 nodes (root 0; 1, 2 under it; 3 under 1; 4, 5 under 3)
TREE = [-1, 0, 0, 1, 3, 3]


def _inputs(bs, T, seed=0, dtype=torch.float32):
    """SGLang's verify arguments as ``MambaMixer2.forward`` builds them: ``dt`` / ``A`` / ``D`` /
    ``dt_bias`` expanded over the head dim (stride 0)."""
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(7, HV, P, N, generator=g)
    x = torch.randn(bs, T, HV, P, generator=g).to(dtype)
    dt = (torch.randn(bs, T, HV, generator=g) / 2).to(dtype)[..., None].expand(bs, T, HV, P)
    A = (-torch.exp(torch.rand(HV, generator=g)))[:, None, None].expand(HV, P, N)
    B = torch.randn(bs, T, G, N, generator=g).to(dtype)
    C = torch.randn(bs, T, G, N, generator=g).to(dtype)
    D = torch.randn(HV, generator=g)[:, None].expand(HV, P)
    dt_bias = (torch.randn(HV, generator=g) / 2 - 1)[:, None].expand(HV, P)
    return state, x, dt, A, B, C, D, dt_bias


def _chain_reference(state, x, dt, A, B, C, D, dt_bias, slot, b, nodes):
    """Outputs along a root path ``nodes`` of request ``b``, stepped one by one (independent
    of the kernel's tables)."""
    h = state[slot].float().clone()
    ys = []
    for t in nodes:
        d = torch.nn.functional.softplus(dt[b, t].float() + dt_bias.float())
        Bh = B[b, t].float().repeat_interleave(HV // G, 0)
        h = torch.exp(A.float() * d[..., None]) * h + (d * x[b, t].float())[..., None] * Bh[:, None, :]
        Ch = C[b, t].float().repeat_interleave(HV // G, 0)
        ys.append((h * Ch[:, None, :]).sum(-1) + D.float() * x[b, t].float())
    return ys


class TestMamba2TreeVerifyTorch(unittest.TestCase):
    def test_reference_follows_each_root_path(self):
        from sglang_mamba_ext.speculative.ops.verify.mamba2_onchip import mamba2_tree_verify_torch

        state, x, dt, A, B, C, D, dtb = _inputs(2, 6)
        parents = torch.tensor([TREE, TREE])
        y = mamba2_tree_verify_torch(state, x, dt, A, B, C, D, dtb, torch.tensor([3, 5]), parents, 4)
        for b, slot in ((0, 3), (1, 5)):
            for leaf_path in ([0, 1, 3, 4], [0, 1, 3, 5], [0, 2]):
                want = _chain_reference(state, x, dt, A, B, C, D, dtb, slot, b, leaf_path)
                for node, w in zip(leaf_path, want):
                    torch.testing.assert_close(y[b, node], w, rtol=1e-5, atol=1e-5)


@unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestMamba2TreeVerifyTriton(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.testing.spec_pair import triton_interpreter_env

        cls.enterClassContext(triton_interpreter_env())

    def _check(self, bs, T, parents, slots, dtype=torch.float32, max_depth=4):
        from sglang_mamba_ext.speculative.ops.verify.mamba2_onchip import mamba2_tree_verify

        state, x, dt, A, B, C, D, dtb = _inputs(bs, T, dtype=dtype)
        args = (state, x, dt, A, B, C, D, dtb, slots, parents, max_depth)
        want = mamba2_tree_verify(*args, impl="torch")
        out = torch.zeros(bs, T, HV, P, dtype=dtype)
        got = mamba2_tree_verify(*args, out=out)
        self.assertIs(got, out)
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        valid = [b for b in range(bs) if int(slots[b]) >= 0]
        torch.testing.assert_close(got[valid].float(), want[valid], **tol)
        self.assertEqual(state.shape, (7, HV, P, N))
        # the buffered form (the GPU check's snapshot-verify side): same outputs, every node's
        # state written to its buffer row
        buf = torch.zeros(bs, T, HV, P, N)
        buffered = mamba2_tree_verify(*args, out=torch.zeros(bs, T, HV, P, dtype=dtype), node_states=buf)
        torch.testing.assert_close(buffered[valid].float(), want[valid], **tol)
        self.assertGreater(buf[valid].abs().sum().item(), 0.0)

    def test_tree(self):
        self._check(2, 6, torch.tensor([TREE, [-1, 0, 1, 2, 0, 4]]), torch.tensor([3, 5]))

    def test_chain_without_parents(self):
        self._check(3, 4, None, torch.tensor([1, 0, 6]), max_depth=4)

    def test_padding_row_and_fp16(self):
        # row 1 is padding (slot -1): it reads slot 0, its output is discarded
        self._check(2, 6, torch.tensor([TREE, TREE]), torch.tensor([4, -1]), dtype=torch.float16)


_AGAINST_SGLANG = textwrap.dedent(r'''
    import json, torch
    from sglang_mamba_ext.testing.spec_pair import load_kernel_modules_for_cpu
    assert load_kernel_modules_for_cpu(["sglang_mamba_ext.speculative.ops.verify.mamba2_onchip"], [])
    from sglang.kernels.ops.mamba.triton_ops.mamba_ssm import selective_state_update
    from sglang_mamba_ext.plugin.cpu_bridges import cpu_device_module
    from sglang_mamba_ext.speculative.ops.verify.mamba2_onchip import mamba2_tree_verify
    HV, P, N, G = 4, 8, 16, 2
    g = torch.Generator().manual_seed(4)
    bs, T = 2, 6
    state = torch.randn(5, HV, P, N, generator=g)
    x = torch.randn(bs, T, HV, P, generator=g)
    dt = (torch.randn(bs, T, HV, generator=g) / 2)[..., None].expand(bs, T, HV, P)
    A = (-torch.exp(torch.rand(HV, generator=g)))[:, None, None].expand(HV, P, N)
    B, C = torch.randn(bs, T, G, N, generator=g), torch.randn(bs, T, G, N, generator=g)
    D = torch.randn(HV, generator=g)[:, None].expand(HV, P)
    dtb = (torch.randn(HV, generator=g) / 2 - 1)[:, None].expand(HV, P)
    slots = torch.tensor([4, 1], dtype=torch.int32)
    res = {}
    for name, parents in (("tree", torch.tensor([[-1, 0, 0, 1, 3, 3], [-1, 0, 1, 2, 0, 4]], dtype=torch.int32)),
                          ("chain", None)):
        before = state.clone()
        buf = torch.zeros(bs, T, HV, P, N)
        theirs = torch.zeros(bs, T, HV, P)
        with cpu_device_module():  # SGLang's kernel enters torch.cpu.device(...) (the plugin's CPU bridge)
            selective_state_update(state, x, dt, A, B, C, D, z=None, dt_bias=dtb, dt_softplus=True,
                                   state_batch_indices=slots, out=theirs, disable_state_update=True,
                                   intermediate_states_buffer=buf, cache_steps=T, retrieve_parent_token=parents,
                                   intermediate_state_indices=torch.arange(bs, dtype=torch.int32))
        assert torch.equal(state, before)
        mine = mamba2_tree_verify(state, x, dt, A, B, C, D, dtb, slots, parents, 4)
        res[name] = (mine - theirs).abs().max().item()
    print(json.dumps(res))
''')


class TestMamba2TreeVerifyAgainstSGLang(unittest.TestCase):
    def test_outputs_match_sglang_buffered_verify(self):
        """Every node's output equals SGLang's buffered tree verify (its Triton kernel,
        interpreted), for an EAGLE tree and for a chain; the main state is left unchanged."""
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", _AGAINST_SGLANG], env=env, capture_output=True, text=True,
                              timeout=900)
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        self.assertLess(res["tree"], 1e-4, res)
        self.assertLess(res["chain"], 1e-4, res)


@full_suite_only("scripts/gpu_check.sh's Mamba2 speculative section in its CPU mode: its kernels are checked "
                 "under the interpreter by TestMamba2TreeVerifyTriton and test_spec_replay_mamba2.py; the GPU "
                 "checks' CPU mode runs by default for the in-chunk section (test_inchunk_checkpoints.py)")
class TestMamba2SpecGpuCheckTinyMode(unittest.TestCase):
    def test_tiny_mode_runs(self):
        """``scripts/gpu_check.sh``'s Mamba2 deferred-verify section at toy shapes under the
        interpreter: its correctness line within tolerance and its three result lines."""
        from sglang_mamba_ext.testing.spec_pair import run_interpreted

        r = run_interpreted("sglang_mamba_ext.speculative.ops.gpu_check_mamba2_spec", ["--tiny", "--iters", "1"],
                            timeout=600)
        self.assertEqual(r.returncode, 0, (r.stdout + r.stderr)[-3000:])
        lines = r.stdout.splitlines()
        corr = next(l for l in lines if "correctness:" in l)
        errs = [float(w) for w in corr.replace(";", " ").split() if w[:1].isdigit() and "e" in w]
        self.assertEqual(len(errs), 2, corr)
        self.assertTrue(all(e < 1e-4 for e in errs), corr)
        self.assertEqual([l.split("=")[0] for l in lines[-3:]],
                         ["mamba2_onchip_vs_buffered", "mamba2_replay_overhead", "mamba2_memory_ratio"])


TestUnderTritonInterpreter = triton_subprocess_case(__file__, "Mamba2TreeVerifyTriton", skip=_CAN_RUN)


if __name__ == "__main__":
    unittest.main()
