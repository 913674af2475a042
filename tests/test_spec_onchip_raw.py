"""The on-chip verify entry in one launch (``speculative/ops/verify/onchip_raw.py``; issue 39,
item 2): from SGLang's raw ``target_verify`` arguments (pre-norm q/k, raw gates, states ``[slots,
HV, V, K]``, ``retrieve_parent_token``), equal to the two-step path it replaced (torch prep,
then ``ops/verify/fused.py``), to the torch tree recurrence and to the entry's torch form, for KDA and GDN gates, EAGLE
trees with padding entries, chains, a padding row and bf16 activations (CPU: Triton's
interpreter)."""

import unittest
from unittest import mock

import torch

from sglang_mamba_ext.testing.spec_pair import load_triton_kernels_for_cpu, triton_subprocess_case

_CAN_RUN = load_triton_kernels_for_cpu()
SELECT = "OnChipRaw"


@unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestOnChipRawEntry(unittest.TestCase):
    def _case(self, gate, parents_kind, dtype=torch.float32, H=2, HV=2, K=16, V=16, bs=2):
        from sglang_mamba_ext.speculative import verify_onchip
        from sglang_mamba_ext.speculative.tree import eagle_tree_parents

        g = torch.Generator().manual_seed(0)
        if parents_kind == "chain":
            T, parents, depth = 4, None, 4
        else:
            # topk 2, 3 steps cut to 8 draft tokens: [-1, 0, 0, 1, 1, 2, 2, 3], depth 4 (node 7)
            par = eagle_tree_parents(2, 3, 8)
            T, depth = len(par), 4
            parents = torch.tensor([par] * bs, dtype=torch.int32)
            parents[0, 0] = 7  # the root's entry is ignored
            parents[1, 5] = 99  # outside [0, T): read as the root (a padding row's unwritten entry)
        n = bs * T
        q = torch.randn(1, n, H, K, generator=g).to(dtype)
        k = torch.randn(1, n, H, K, generator=g).to(dtype)
        v = torch.randn(1, n, HV, V, generator=g).to(dtype)
        a = torch.randn(n, HV * K if gate == "kda" else HV, generator=g).to(dtype)
        b = torch.randn(1, n, HV, generator=g).to(dtype)
        A_log = torch.randn(HV, generator=g) * 0.5
        dt_bias = torch.randn(HV * K if gate == "kda" else HV, generator=g)
        pool = torch.randn(5, HV, V, K, generator=g) * 0.5
        slots = torch.tensor([3, -1, 1], dtype=torch.int32)  # row 1: padding (reads slot 0); one entry past bs
        out = {}
        for raw in (True, False):
            with mock.patch.object(verify_onchip, "RAW_ENTRY", raw):
                out[raw] = verify_onchip.onchip_tree_verify(q, k, v, a, b, A_log, dt_bias, pool, slots, T, parents,
                                                            depth, per_head_gate=gate == "gdn")
        self.assertEqual(out[True].dtype, dtype)
        self.assertEqual(tuple(out[True].shape), (1, n, HV, V))
        self.assertGreater(float(out[False].float().abs().max()), 0.1)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[True], out[False], rtol=tol, atol=tol)
        # the torch form CPU serving uses (hooks.kernel_impl): the same outputs as the kernel
        torch_form = verify_onchip.onchip_tree_verify(q, k, v, a, b, A_log, dt_bias, pool, slots, T, parents, depth,
                                                      per_head_gate=gate == "gdn", impl="torch")
        self.assertEqual(torch_form.dtype, dtype)
        torch.testing.assert_close(torch_form, out[True], rtol=tol, atol=tol)
        return out[True]

    def test_kda_tree(self):
        self._case("kda", "tree")  # H == HV, as Kimi-Linear's KDA; grouped heads: the GDN cases

    def test_gdn_tree_grouped_heads(self):
        self._case("gdn", "tree", H=2, HV=4)

    def test_chains(self):
        self._case("kda", "chain")
        self._case("gdn", "chain", H=2, HV=4)

    def test_bf16(self):
        self._case("kda", "tree", dtype=torch.bfloat16)

    def test_against_the_torch_tree_recurrence(self):
        """Independent of both Triton paths: the mixer-free torch recurrence per node."""
        from sglang_mamba_ext.models.linear_attn import l2_normalize
        from sglang_mamba_ext.speculative import verify_onchip
        from sglang_mamba_ext.speculative.tree import eagle_tree_parents

        g = torch.Generator().manual_seed(1)
        H = HV = 2
        K = V = 8
        par = eagle_tree_parents(2, 2)
        T = len(par)
        q, k = (torch.randn(1, T, H, K, generator=g) for _ in range(2))
        v = torch.randn(1, T, HV, V, generator=g)
        a, b = torch.randn(T, HV, generator=g), torch.randn(1, T, HV, generator=g)
        A_log, dt_bias = torch.randn(HV, generator=g) * 0.5, torch.randn(HV, generator=g)
        pool = torch.randn(2, HV, V, K, generator=g)
        o = verify_onchip.onchip_tree_verify(q, k, v, a, b, A_log, dt_bias, pool, torch.tensor([1]), T,
                                             torch.tensor([par]), 3, per_head_gate=True)[0]
        gg, beta = verify_onchip.activate_gates(a, b, A_log, dt_bias, HV, K, True)
        qn, kn = l2_normalize(q[0]), l2_normalize(k[0])
        for i in range(T):
            path, p = [], i
            while p >= 0:
                path.append(p)
                p = par[p] if p != 0 else -1
            S = pool[1].transpose(-1, -2).clone()  # [HV, K, V]
            for t in reversed(path):
                S = S * torch.exp(gg[t])[:, None, None]
                pred = (kn[t][..., None] * S).sum(-2)
                S = S + kn[t][..., None] * ((v[0, t] - pred) * beta[t][:, None])[:, None, :]
            ref = (qn[i][..., None] * K ** -0.5 * S).sum(-2)
            torch.testing.assert_close(o[i], ref, rtol=1e-5, atol=1e-5)


TestUnderTritonInterpreter = triton_subprocess_case(__file__, SELECT, skip=_CAN_RUN)


if __name__ == "__main__":
    unittest.main()
