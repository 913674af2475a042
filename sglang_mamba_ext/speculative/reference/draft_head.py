"""A tiny MTP-style draft head over the target's frozen KV, and EAGLE tree proposal, for the
reference decode loop (``docs/design.md``, "Speculative verify"). The head has no linear
(Mamba) layers and writes no KV: each draft step combines the previous hidden state with the
embedding of the token just drafted, attends read-only to the target's K/V of one attention
layer at the frozen RoPE position ``seq_len - 1`` and predicts with the target's LM head —
SGLang's FROZEN_KV_MTP contract (``speculative/frozen_kv_mtp_utils.py``). Because the draft
never reads SSM state, the deferred mode may leave the main SSM state one round behind while
drafting ("Deferred update"). Layer math comes from :mod:`sglang_mamba_ext.models.tiny_hybrid`.
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from torch import nn

from sglang_mamba_ext.models.tiny_hybrid import (
    FullAttention,
    RMSNorm,
    SwiGLUMLP,
    TinyHybridConfig,
    TinyHybridReference,
    attention,
)
from sglang_mamba_ext.speculative.tree import DraftTree

__all__ = ["FrozenKVDraftHead", "propose_tree"]


class FrozenKVDraftHead(nn.Module):
    """``x = fc([norm_e(embed(tok)), norm_h(h)]); x += attn(x | target KV); x += mlp(x);
    logits = target.lm_head(norm(x))``.

    Args:
        config: the target's config (head sizes, hidden size).
        kv_layer_id: the target attention layer whose K/V the head reads.

    Raises:
        ValueError: ``kv_layer_id`` is not an attention layer of the target.
    """

    def __init__(self, config: TinyHybridConfig, kv_layer_id: int) -> None:
        super().__init__()
        if kv_layer_id not in config.full_attention_layer_ids:
            raise ValueError(f"FrozenKVDraftHead: layer {kv_layer_id} is not a full-attention layer of the target")
        h = config.hidden_size
        self.kv_layer_id = kv_layer_id
        self.norm_e = RMSNorm(h, config.rms_norm_eps)
        self.norm_h = RMSNorm(h, config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = FullAttention(config)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(h, config.intermediate_size)
        self.norm = RMSNorm(h, config.rms_norm_eps)

    @torch.no_grad()
    def step(
        self,
        target: TinyHybridReference,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        kv: Tuple[torch.Tensor, torch.Tensor],
        seq_len: int,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One draft step for ``B`` leaves of one request.

        Args:
            hidden: ``[B, hidden]`` previous hidden (target's at the last committed node for
                the first step, the head's own afterwards).
            tokens: ``[B]`` int64 the leaves' tokens.
            kv: the target's ``(k, v)`` ``[S, NKV, D]`` of ``kv_layer_id`` (read only).
            seq_len: tokens in the target KV; queries sit at position ``seq_len - 1``.

        Returns:
            ``(logits [B, vocab] float32, new_hidden [B, hidden])``.
        """
        e = target.embed(tokens)
        x = self.fc(torch.cat([self.norm_e(e), self.norm_h(hidden)], dim=-1))
        a_in = self.input_layernorm(x)
        pos = torch.full((x.shape[0],), seq_len - 1, dtype=torch.long, device=x.device)
        q, _, _ = self.self_attn.project_qkv(a_in, pos)
        k, v = kv
        mask = torch.ones(x.shape[0], k.shape[0], dtype=torch.bool, device=x.device)
        x = x + self.self_attn.finish(attention(q, k, v, mask, self.self_attn.scaling))
        x = x + self.mlp(self.post_attention_layernorm(x))
        return target.lm_head(self.norm(x)).float(), x


@torch.no_grad()
def propose_tree(
    head: FrozenKVDraftHead,
    target: TinyHybridReference,
    root_token: int,
    hidden: torch.Tensor,
    kv: Tuple[torch.Tensor, torch.Tensor],
    seq_len: int,
    topk: int,
    steps: int,
    draft_token_num: int,
) -> Tuple[List[int], List[int]]:
    """EAGLE tree of one request: ``(tokens [T], retrieve_parent_token [T])``, node 0 = root.

    Step 1 drafts ``topk`` children of the root; each later step expands the ``topk`` leaves with
    the best cumulative log-probability by ``topk`` children each; the ``T - 1`` best candidates
    (ties: earlier first, so parents precede children) plus the root form the tree, ordered by
    depth then creation (topological). ``topk == 1`` gives a chain of ``steps`` drafts.

    Raises:
        ValueError: ``draft_token_num`` exceeds the candidates.
    """
    from sglang_mamba_ext.speculative.tree import max_draft_token_num

    T = draft_token_num
    if not 1 <= T <= max_draft_token_num(topk, steps):
        raise ValueError(
            f"propose_tree: draft_token_num={T} outside [1, {max_draft_token_num(topk, steps)}] "
            f"for topk={topk}, steps={steps} (--speculative-num-draft-tokens)"
        )
    # candidates: (score, id, parent_id, token, depth); id 0 = root
    cands = [(0.0, 0, -1, int(root_token), 0)]
    hid = {0: hidden.reshape(1, -1)}
    frontier = [0]
    for _ in range(steps):
        toks = torch.tensor([cands[i][3] for i in frontier], dtype=torch.long)
        hs = torch.cat([hid[i] for i in frontier], dim=0)
        logits, new_h = head.step(target, hs, toks, kv, seq_len)
        logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, topk, dim=-1)
        new_ids = []
        for b, p in enumerate(frontier):
            for j in range(topk):
                cid = len(cands)
                cands.append((cands[p][0] + float(top.values[b, j]), cid, p, int(top.indices[b, j]), cands[p][4] + 1))
                hid[cid] = new_h[b : b + 1]
                new_ids.append(cid)
        frontier = sorted(new_ids, key=lambda i: (-cands[i][0], i))[:topk]
    chosen = {0}
    for c in sorted(cands[1:], key=lambda c: (-c[0], c[1])):
        if len(chosen) >= T:
            break
        if c[2] in chosen:
            chosen.add(c[1])
    order = sorted(chosen, key=lambda i: (cands[i][4], i))
    pos = {cid: n for n, cid in enumerate(order)}
    tokens = [cands[i][3] for i in order]
    parents = [-1 if cands[i][2] < 0 else pos[cands[i][2]] for i in order]
    return tokens, parents


def stack_proposals(props: List[Tuple[List[int], List[int]]]) -> DraftTree:
    """Batch per-request proposals (all of length ``T``) into a :class:`DraftTree`."""
    return DraftTree(
        torch.tensor([p[0] for p in props], dtype=torch.long),
        torch.tensor([p[1] for p in props], dtype=torch.long),
    )
