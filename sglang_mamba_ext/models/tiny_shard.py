"""Tensor-parallel sharding of the tiny hybrid model (``docs/design.md``, "Tiny hybrid model"):
which slice of each checkpoint tensor one of ``tp_size`` ranks holds, and the per-rank config
its modules are built from. Torch only (no SGLang): the SGLang model class
(``plugin/tiny_hybrid/model.py``) applies it and all-reduces the two row-parallel outputs.

Layout, Megatron style, heads split evenly over the ranks:

- full attention: ``q_proj`` rows of this rank's query heads, ``k_proj`` / ``v_proj`` rows of
  its K/V heads (column parallel), ``o_proj`` the matching input columns (row parallel: the
  ranks' outputs are summed);
- linear attention: the ``q``, ``k`` and ``v`` blocks of ``qkv_proj`` and of the conv taps each
  split by heads (SGLang's ``conv_shard_groups = [H*K, H*K, HV*V]``; the rank's conv channels
  are its q, k, v slices in that order), the per-value-head gate, ``A_log``, ``dt_bias``,
  ``b_proj`` and ``g_proj`` rows, ``out_proj`` input columns (row parallel); ``f_a`` (the
  low-rank gate's first factor) and ``o_norm_weight`` (per head, shared) whole;
- embeddings, norms, MLPs and ``lm_head``: whole on every rank (tiny; no communication).

So per rank: ``NH / tp`` query heads, ``NKV / tp`` K/V heads (SGLang's KV pool holds exactly
these), ``H / tp`` key heads and ``HV / tp`` value heads in the linear layers (SGLang's
``Mamba2StateShape.create(tp_world_size=tp)``).
"""

from __future__ import annotations

import copy
from typing import List, Tuple

import torch

from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig

__all__ = ["rank_config", "shard_tensor"]


def _check(config: TinyHybridConfig, tp_size: int) -> None:
    for name in ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
        n = getattr(config, name)
        if n % tp_size:
            raise ValueError(
                f"tiny hybrid model: {name}={n} is not divisible by the tensor-parallel size {tp_size} "
                f"(use --tp {', '.join(str(d) for d in range(1, n + 1) if n % d == 0)}, or build the model "
                "with more heads)"
            )


def rank_config(config: TinyHybridConfig, tp_size: int) -> TinyHybridConfig:
    """A copy of ``config`` with each rank's head counts (the modules of one rank).

    Raises:
        ValueError: a head count not divisible by ``tp_size``.
    """
    _check(config, tp_size)
    c = copy.deepcopy(config)
    c.num_attention_heads //= tp_size
    c.num_key_value_heads //= tp_size
    c.linear_num_key_heads //= tp_size
    c.linear_num_value_heads //= tp_size
    return c


def _blocks(config: TinyHybridConfig) -> List[int]:
    """Widths of the q, k, v blocks of ``mixed_qkv`` (``conv_shard_groups``)."""
    s = config.linear_attn_shape
    return [s.key_dim, s.key_dim, s.value_dim]


def _rows(t: torch.Tensor, rank: int, tp: int, dim: int = 0) -> torch.Tensor:
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)


def _grouped(t: torch.Tensor, groups: List[int], rank: int, tp: int) -> torch.Tensor:
    parts, start = [], 0
    for g in groups:
        parts.append(_rows(t.narrow(0, start, g), rank, tp))
        start += g
    return torch.cat(parts, 0)


def shard_tensor(name: str, tensor: torch.Tensor, config: TinyHybridConfig, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This rank's slice of the checkpoint tensor ``name`` (``config`` unsharded); the tensor
    itself when the parameter is whole on every rank (module docstring).

    Raises:
        ValueError: head counts not divisible by ``tp_size``.
    """
    if tp_size == 1:
        return tensor
    _check(config, tp_size)
    r, tp = tp_rank, tp_size
    if ".self_attn." in name:
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            return _rows(tensor, r, tp)
        if name.endswith("o_proj.weight"):
            return _rows(tensor, r, tp, dim=1)
        return tensor
    if ".linear_attn." in name:
        leaf = name.rsplit("linear_attn.", 1)[1]
        if leaf in ("qkv_proj.weight", "conv_weight", "conv_bias"):
            return _grouped(tensor, _blocks(config), r, tp)
        if leaf in ("f_b.weight", "a_proj.weight", "A_log", "dt_bias", "b_proj.weight", "g_proj.weight"):
            return _rows(tensor, r, tp)
        if leaf == "out_proj.weight":
            return _rows(tensor, r, tp, dim=1)
        return tensor  # f_a, o_norm_weight
    return tensor


def shard_state_dict(state: dict, config: TinyHybridConfig, tp_rank: int, tp_size: int) -> List[Tuple[str, torch.Tensor]]:
    """:func:`shard_tensor` over a whole checkpoint, as ``(name, tensor)`` pairs."""
    return [(k, shard_tensor(k, v, config, tp_rank, tp_size)) for k, v in state.items()]
