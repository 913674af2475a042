"""Tensor-parallel sharding of the tiny hybrid model (``models/tiny_shard.py``), checked without
SGLang: the ranks' row-parallel outputs summed equal the whole layer's output, and each rank's
linear-attention states are its heads' (and conv channels') slices of the whole layer's states,
for both gates and tp = 2 (and 4 where the heads allow)."""

import unittest

import torch

from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig, TinyHybridDecoderLayer
from sglang_mamba_ext.models.tiny_shard import rank_config, shard_tensor


def _config(gate="kda", **kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                layer_types=["full_attention", "linear_attention"], num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_gate_rank=8, linear_gate=gate)
    base.update(kw)
    return TinyHybridConfig(**base)


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _ranks(config, layer_id, full, tp, prefix):
    """Per-rank decoder layers loaded with their shards of ``full``'s parameters."""
    out = []
    for r in range(tp):
        layer = TinyHybridDecoderLayer(rank_config(config, tp), layer_id)
        state = {k: shard_tensor(f"{prefix}{k}", v, config, r, tp) for k, v in full.state_dict().items()}
        layer.load_state_dict(state)
        out.append(layer)
    return out


class TestShardedLayersSumToTheWhole(unittest.TestCase):
    def _attention(self, tp):
        cfg = _config()
        full = TinyHybridDecoderLayer(cfg, 0)
        _randomize(full, 1)
        x, pos = torch.randn(7, 32), torch.arange(7)
        want, k, v = full.self_attn(x, pos)
        ranks = _ranks(cfg, 0, full, tp, "model.layers.0.")
        parts = [rk.self_attn(x, pos) for rk in ranks]
        torch.testing.assert_close(sum(p[0] for p in parts), want, rtol=1e-5, atol=1e-5)
        # each rank's K/V are its K/V heads: what SGLang's KV pool holds per rank
        torch.testing.assert_close(torch.cat([p[1] for p in parts], dim=1), k, rtol=1e-6, atol=1e-6)

    def _linear(self, gate, tp):
        cfg = _config(gate)
        full = TinyHybridDecoderLayer(cfg, 1)
        _randomize(full, 2)
        x = torch.randn(9, 32)
        want, conv, ssm = full.linear_attn(x)
        ranks = _ranks(cfg, 1, full, tp, "model.layers.1.")
        outs = [rk.linear_attn(x) for rk in ranks]
        torch.testing.assert_close(sum(o[0] for o in outs), want, rtol=1e-5, atol=1e-5)
        s = cfg.linear_attn_shape
        # states: heads split in order; conv channels are each rank's q, k, v slices
        torch.testing.assert_close(torch.cat([o[2] for o in outs]), ssm, rtol=1e-6, atol=1e-6)
        blocks = torch.split(conv, [s.key_dim, s.key_dim, s.value_dim])
        for r, o in enumerate(outs):
            want_conv = torch.cat([b.chunk(tp)[r] for b in blocks])
            torch.testing.assert_close(o[1], want_conv, rtol=0, atol=0)

    def test_attention_tp2(self):
        self._attention(2)

    def test_linear_kda_and_gdn(self):
        for gate in ("kda", "gdn"):
            for tp in (2,):
                with self.subTest(gate=gate, tp=tp):
                    self._linear(gate, tp)

    def test_linear_tp4(self):
        cfg_heads = dict(linear_num_key_heads=4, linear_num_value_heads=8, num_key_value_heads=4)
        cfg = _config(**cfg_heads)
        full = TinyHybridDecoderLayer(cfg, 1)
        _randomize(full, 3)
        x = torch.randn(5, 32)
        want = full.linear_attn(x)[0]
        got = sum(rk.linear_attn(x)[0] for rk in _ranks(cfg, 1, full, 4, "model.layers.1."))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_indivisible_heads_refused(self):
        with self.assertRaisesRegex(ValueError, "num_key_value_heads=2 is not divisible by the tensor-parallel size 4"):
            rank_config(_config(num_attention_heads=4, num_key_value_heads=2), 4)

    def test_replicated_parameters_untouched(self):
        cfg = _config()
        t = torch.randn(5, 32)
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.linear_attn.f_a.weight",
                     "model.layers.1.linear_attn.o_norm_weight", "model.layers.0.mlp.gate_proj.weight"):
            self.assertIs(shard_tensor(name, t, cfg, 1, 2), t)


if __name__ == "__main__":
    unittest.main()
