"""Reference speculative decoding loop on the tiny hybrid model, snapshot vs deferred verify:
the numerical oracle of ``docs/design.md``, "Speculative verify" and "Deferred update"
("deferred == snapshot, spec == greedy"). :class:`SpecEngine` schedules a batch like SGLang's
FROZEN_KV_MTP worker, in plain torch: each round (deferred: replays the stash into the main
state), drafts EAGLE trees with the frozen-KV draft head, verifies all tree nodes through the
target (linear layers: ``ops/verify``), accepts greedily, then commits (snapshot: scatter the
accepted node's state of every layer; deferred: stash the accepted tokens' raw activations);
finishing requests are (replayed,) cached and freed. Prefill and decode of the linear layers
run the mixer's segment runner (``TinyHybridReference.forward_tokens``), replay the torch or
Triton ``ops/replay``. States live in pools shaped like SGLang's Mamba pool (``conv_state [L,
slots, conv_dim, W-1]``, ``temporal_state [L, slots, HV, K, V]`` fp32) indexed by a request's
``mamba_pool_idx``, plus two ping-pong track slots per request written when a round crosses a
``mamba_track_interval`` boundary; :class:`PrefixStore` (exact-prefix, copy-on-write) stands in
for the radix tree. Deferred verify buffers (``verify_buffer``): ``"one_layer"``,
``"head_chunk"`` or ``"on_chip"`` (no node-state buffer). Pure torch (+ Triton when asked).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from sglang_mamba_ext.models.tiny_hybrid import TinyHybridCache, TinyHybridReference, attention
from sglang_mamba_ext.speculative.ops.verify.naive import tree_conv, tree_recurrence
from sglang_mamba_ext.speculative.reference.draft_head import FrozenKVDraftHead, propose_tree, stack_proposals
from sglang_mamba_ext.speculative.replay import ReplayWeights, replay, track_steps
from sglang_mamba_ext.speculative.stash import ActivationStash, StashDims
from sglang_mamba_ext.speculative.tree import TreeIndex, greedy_accept, max_draft_token_num
from sglang_mamba_ext.speculative.verify_buffers import OneLayerBuffer, SnapshotBuffers, commit_snapshot

__all__ = ["SpecConfig", "SpecRequest", "PrefixStore", "SpecEngine"]


@dataclass
class SpecConfig:
    """Knobs of :class:`SpecEngine` (SGLang flag names in parentheses).

    Attributes:
        topk (``--speculative-eagle-topk``), steps (``--speculative-num-steps``),
        draft_token_num (``--speculative-num-draft-tokens``; None = all candidates).
        mode: ``"snapshot"`` or ``"deferred"`` (``--mamba-spec-state-update``).
        verify_buffer: deferred only: ``"one_layer"``, ``"head_chunk"`` or ``"on_chip"``.
        head_chunk: value heads per pass for ``"head_chunk"``.
        replay_impl: ``"torch"`` or ``"triton"``.
        mamba_track_interval: tokens between ping-pong checkpoints (None: off).
        max_running: ``--max-running-requests``; rows are ``max_running + 1``.
    """

    topk: int = 2
    steps: int = 3
    draft_token_num: Optional[int] = None
    mode: str = "snapshot"
    verify_buffer: str = "one_layer"
    head_chunk: Optional[int] = None
    replay_impl: str = "torch"
    mamba_track_interval: Optional[int] = None
    max_running: int = 4

    def __post_init__(self) -> None:
        if self.mode not in ("snapshot", "deferred"):
            raise ValueError(f"SpecConfig.mode must be 'snapshot' or 'deferred' (--mamba-spec-state-update), got {self.mode!r}")
        if self.verify_buffer not in ("one_layer", "head_chunk", "on_chip"):
            raise ValueError(f"SpecConfig.verify_buffer must be one_layer, head_chunk or on_chip, got {self.verify_buffer!r}")
        if self.draft_token_num is None:
            self.draft_token_num = max_draft_token_num(self.topk, self.steps)


@dataclass
class SpecRequest:
    """One request's bookkeeping (SGLang ``Req`` field names where they exist)."""

    rid: int
    prompt: List[int]
    max_new_tokens: int
    eos_token_id: Optional[int]
    row: int  # req_pool_idx
    slot: int  # mamba_pool_idx
    track_slots: Tuple[int, int]  # ping_pong_track_buffer
    next_track: int = 0  # mamba_next_track_idx
    output: List[int] = field(default_factory=list)
    seq_len: int = 0  # tokens in the target KV (prompt + committed)
    cached_prefix_len: int = 0
    kv: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    hidden: Optional[torch.Tensor] = None  # target hidden at the last committed token
    finished: bool = False
    accept_lengths: List[int] = field(default_factory=list)
    checkpoints: List[Tuple[int, int]] = field(default_factory=list)  # (seq_len, track slot) written
    truncated_runs: int = 0  # rounds whose accepted run was cut by EOS / max_new_tokens

    @property
    def root_token(self) -> int:
        return self.output[-1]


class PrefixStore:
    """Exact-prefix state store standing in for the radix tree in this oracle.

    ``insert(tokens, kv, conv [L, conv_dim, W-1], temporal [L, HV, K, V])``; ``match(prompt)``
    returns the longest stored key that is a proper prefix of ``prompt``.
    """

    def __init__(self) -> None:
        self.entries: Dict[Tuple[int, ...], Tuple[Dict, torch.Tensor, torch.Tensor]] = {}

    def insert(self, tokens: Sequence[int], kv, conv: torch.Tensor, temporal: torch.Tensor) -> None:
        self.entries[tuple(tokens)] = ({i: (k.clone(), v.clone()) for i, (k, v) in kv.items()}, conv.clone(), temporal.clone())

    def match(self, prompt: Sequence[int]):
        best = None
        for key in self.entries:
            if len(key) < len(prompt) and tuple(prompt[: len(key)]) == key and (best is None or len(key) > len(best)):
                best = key
        return (best, self.entries[best]) if best is not None else (None, None)


class SpecEngine:
    """Batch speculative decoding of :class:`TinyHybridReference` with a frozen-KV draft head.

    Args:
        target: the target model (fp32 for exact comparisons).
        draft: the draft head.
        cfg: :class:`SpecConfig`.
        prefix_store: shared store (several engines may share one to test reuse).
    """

    def __init__(self, target: TinyHybridReference, draft: FrozenKVDraftHead, cfg: SpecConfig,
                 prefix_store: Optional[PrefixStore] = None) -> None:
        self.target, self.draft, self.cfg = target, draft, cfg
        c = target.config
        self.linear_ids = list(c.linear_layer_ids)
        self.attn_ids = list(c.full_attention_layer_ids)
        self.shape = c.linear_attn_shape
        s = self.shape
        L = len(self.linear_ids)
        R = cfg.max_running + 1
        self.num_slots = 1 + 3 * cfg.max_running  # slot 0 unused; main + 2 track per request
        dev = target.lm_head.weight.device
        self.conv_state = torch.zeros(L, self.num_slots, *s.conv_state_shape, device=dev)
        self.temporal_state = torch.zeros(L, self.num_slots, *s.temporal_state_shape, device=dev)
        self.free_rows = list(range(1, R))
        self.free_slots = list(range(1, self.num_slots))
        self.prefix_store = prefix_store if prefix_store is not None else PrefixStore()
        self.running: List[SpecRequest] = []
        self.finished: List[SpecRequest] = []
        self._next_rid = 0
        T = cfg.draft_token_num
        mixers = [target.layers[i].linear_attn for i in self.linear_ids]
        self.replay_weights = ReplayWeights.from_mixers(mixers)
        if cfg.mode == "snapshot":
            self.snapshot = SnapshotBuffers(L, R, T, s, device=dev)
        else:
            if cfg.verify_buffer == "on_chip":
                self.one_layer = None
            else:
                hc = cfg.head_chunk if cfg.verify_buffer == "head_chunk" else None
                self.one_layer = OneLayerBuffer(R, T, s, head_chunk=hc, device=dev)
            gate_dim = mixers[0].f_b.out_features
            self.stash = ActivationStash(L, R, cfg.steps + 1, StashDims(s.conv_dim, gate_dim, s.num_v_heads),
                                         dtype=target.lm_head.weight.dtype, device=dev)
        self.rounds = 0
        self.replay_calls: List[Tuple[List[int], List[int], List[int]]] = []  # (rows, slots, counts)

    # -- requests -------------------------------------------------------------------------

    @torch.no_grad()
    def add_request(self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: Optional[int] = None) -> SpecRequest:
        """Admit a request: prefix-store match, copy-on-write of the cached state, prefill of
        the rest, first token by argmax.

        Raises:
            RuntimeError: no free row/slot (more than ``max_running`` requests).
        """
        if not self.free_rows or len(self.free_slots) < 3:
            raise RuntimeError("SpecEngine: no free request row / SSM slots (raise max_running)")
        prompt = [int(t) for t in prompt]
        row = self.free_rows.pop(0)
        slot, t0, t1 = (self.free_slots.pop(0) for _ in range(3))
        req = SpecRequest(self._next_rid, prompt, max_new_tokens, eos_token_id, row, slot, (t0, t1))
        self._next_rid += 1
        key, entry = self.prefix_store.match(prompt)
        cache = TinyHybridCache()
        if key is not None:
            kv, conv, temporal = entry
            self.conv_state[:, slot] = conv  # COW: the store's copy is never written
            self.temporal_state[:, slot] = temporal
            cache = self._cache_from_slot(slot, {i: (k.clone(), v.clone()) for i, (k, v) in kv.items()}, len(key))
            req.cached_prefix_len = len(key)
        logits, new, hidden = self.target.forward_tokens(prompt[req.cached_prefix_len :], cache, return_hidden=True)
        self._slot_from_cache(slot, new)
        req.kv = dict(new.kv)
        req.seq_len = len(prompt)
        req.hidden = hidden[-1]
        req.output.append(int(torch.argmax(logits[-1])))
        if self._done(req):
            self._finish([req])
        else:
            self.running.append(req)
        return req

    def _cache_from_slot(self, slot: int, kv, seq_len: int) -> TinyHybridCache:
        c = TinyHybridCache(seq_len=seq_len, kv=kv)
        for l, i in enumerate(self.linear_ids):
            c.conv[i] = self.conv_state[l, slot].clone()
            c.temporal[i] = self.temporal_state[l, slot].clone()
        return c

    def _slot_from_cache(self, slot: int, cache: TinyHybridCache) -> None:
        for l, i in enumerate(self.linear_ids):
            self.conv_state[l, slot] = cache.conv[i]
            self.temporal_state[l, slot] = cache.temporal[i]

    def _done(self, req: SpecRequest) -> bool:
        return len(req.output) >= req.max_new_tokens or (
            req.eos_token_id is not None and req.output[-1] == req.eos_token_id
        )

    # -- one round ------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """One speculative round for every running request."""
        if not self.running:
            return
        reqs = list(self.running)
        cfg = self.cfg
        rows = torch.tensor([r.row for r in reqs])
        slots = torch.tensor([r.slot for r in reqs])
        if cfg.mode == "deferred":
            self._replay(reqs)
        # draft (reads only the target's KV, never SSM state)
        props = [
            propose_tree(self.draft, self.target, r.root_token, r.hidden, r.kv[self.draft.kv_layer_id], r.seq_len,
                         cfg.topk, cfg.steps, cfg.draft_token_num)
            for r in reqs
        ]
        tree = stack_proposals(props)
        index = TreeIndex.build(tree, self.shape.conv_kernel)
        logits, hidden, node_kv, pending = self._verify(reqs, rows, slots, tree, index)
        acc = greedy_accept(tree, torch.argmax(logits, dim=-1))
        # output tokens, finish truncation: the state covers prompt + output[:-1]
        counts = []
        for n, r in enumerate(reqs):
            chain = acc.committed_nodes(n)
            new_tokens = [int(tree.tokens[n, j]) for j in chain[1:]] + [int(acc.bonus_token[n])]
            appended = 0
            for t in new_tokens:
                r.output.append(t)
                appended += 1
                if self._done(r):
                    r.finished = True
                    break
            counts.append(min(len(chain), appended))
            if counts[-1] < len(chain):
                r.truncated_runs += 1
            r.accept_lengths.append(int(acc.accept_length[n]))
        counts_t = torch.tensor(counts)
        commit_index = acc.accept_index.clone()
        for n, c in enumerate(counts):
            commit_index[n, c:] = -1
        seq_pre = torch.tensor([r.seq_len for r in reqs])
        # attention KV of the committed nodes, hidden for the next draft
        for n, r in enumerate(reqs):
            nodes = commit_index[n, : counts[n]]
            for a in self.attn_ids:
                k, v = r.kv[a]
                nk, nv = node_kv[a][n]
                r.kv[a] = (torch.cat([k, nk[nodes]]), torch.cat([v, nv[nodes]]))
            r.hidden = hidden[n, int(nodes[-1])]
            r.seq_len += counts[n]
        # SSM state
        tslots = torch.tensor([r.track_slots[r.next_track] for r in reqs])
        if cfg.mode == "snapshot":
            tsteps = track_steps(seq_pre, counts_t, cfg.mamba_track_interval)
            last = commit_index.gather(1, (counts_t - 1)[:, None])[:, 0]
            tnode = torch.where(tsteps >= 0, commit_index.gather(1, tsteps.clamp(min=0)[:, None])[:, 0], torch.full_like(tsteps, -1))
            commit_snapshot(self.snapshot, rows, slots, last, self.conv_state, self.temporal_state, tslots, tnode)
            for n, r in enumerate(reqs):
                if int(tsteps[n]) >= 0:
                    r.checkpoints.append((int(seq_pre[n] + tsteps[n] + 1), int(tslots[n])))
                    r.next_track ^= 1
        else:
            # As SGLang's commit sees it: the whole accepted chain (accept_lens), whatever the
            # scheduler decides about EOS later; a finishing request's extra tokens are cut at
            # its flush (keep=...).
            chain_lens = acc.num_committed
            for l in range(len(self.linear_ids)):
                mq, gr, br = pending[l]
                self.stash.write_layer(l, rows, acc.accept_index, mq, gr, br)
            self.stash.set_pending(rows, chain_lens, seq_pre, tslots)
            tsteps = track_steps(seq_pre, chain_lens, cfg.mamba_track_interval)
            for n, r in enumerate(reqs):
                if int(tsteps[n]) >= 0:
                    r.next_track ^= 1
        self.rounds += 1
        done = [r for r in reqs if r.finished]
        if done:
            self._finish(done)

    def _replay(self, reqs: List[SpecRequest], keep: Optional[torch.Tensor] = None) -> None:
        rows = torch.tensor([r.row for r in reqs])
        pend = self.stash.pending(rows)
        if not bool(pend.any()):
            return
        if keep is not None:
            keep = keep[pend]
        reqs = [r for r, p in zip(reqs, pend.tolist()) if p]
        rows = rows[pend]
        slots = torch.tensor([r.slot for r in reqs])
        counts = self.stash.count[rows].clone()
        if keep is not None:
            counts = torch.minimum(counts, keep.to(counts.dtype))
        seqs = self.stash.seq_len[rows].clone()
        tslots = self.stash.track_slot[rows].clone()
        self.replay_calls.append((rows.tolist(), slots.tolist(), counts.tolist()))
        tracked = replay(self.stash, rows, slots, self.conv_state, self.temporal_state, self.replay_weights,
                         self.cfg.mamba_track_interval, keep=keep, impl=self.cfg.replay_impl)
        tsteps = track_steps(seqs, counts, self.cfg.mamba_track_interval)
        for n, r in enumerate(reqs):
            if bool(tracked[n]):
                r.checkpoints.append((int(seqs[n] + tsteps[n] + 1), int(tslots[n])))

    def _verify(self, reqs, rows, slots, tree, index):
        """Tree-shaped verify forward. Returns logits ``[N, T, vocab]``, hidden ``[N, T, h]``,
        per attention layer the nodes' ``(k, v)`` ``[N][T, NKV, D]``, per linear layer the raw
        activations ``(mixed_qkv, g_raw, b_raw)`` ``[N, T, *]`` (deferred mode's pending)."""
        tgt, cfg = self.target, self.cfg
        N, T = tree.tokens.shape
        anc = tree.ancestor_mask()
        seq = torch.tensor([r.seq_len for r in reqs])
        positions = seq[:, None] + index.depth - 1
        h = tgt.embed(tree.tokens.reshape(-1)).view(N, T, -1)
        node_kv: Dict[int, List] = {}
        pending = []
        for layer in tgt.layers:
            x = layer.input_layernorm(h)
            if layer.is_linear:
                l = self.linear_ids.index(layer.layer_id)
                mixer = layer.linear_attn
                mq, gr, br = mixer.project_raw(x)
                g, beta = mixer.activate_gates(gr, br)
                y, windows = tree_conv(mixer, mq, self.conv_state[l, slots], index)
                q, k, v = mixer.split_qkv(y)
                S0 = self.temporal_state[l, slots]
                if cfg.mode == "snapshot":
                    ssm_buf, conv_buf = self.snapshot.layer(l)
                    conv_buf[rows] = windows.to(conv_buf.dtype)
                    o = tree_recurrence(mixer, q, k, v, g, beta, S0, index, ssm_buf, rows)
                else:
                    pending.append((mq, gr, br))
                    if self.one_layer is None:
                        from sglang_mamba_ext.speculative.ops.verify.fused import tree_recurrence_onchip

                        o = tree_recurrence_onchip(q, k, v, g, beta, S0, index, scale=mixer.scale)
                    else:
                        ssm_buf, conv_buf = self.one_layer.layer(l)
                        conv_buf[rows] = windows.to(conv_buf.dtype)
                        o = tree_recurrence(mixer, q, k, v, g, beta, S0, index, ssm_buf, rows, self.one_layer.head_chunk)
                out = mixer.finish(o.to(x.dtype).reshape(N * T, *o.shape[2:]), x.reshape(N * T, -1)).view(N, T, -1)
            else:
                attn = layer.self_attn
                outs, kvs = [], []
                for n, r in enumerate(reqs):
                    qn, kn, vn = attn.project_qkv(x[n], positions[n])
                    pk, pv = r.kv[layer.layer_id]
                    mask = torch.cat([torch.ones(T, pk.shape[0], dtype=torch.bool), anc[n]], dim=1)
                    o = attention(qn, torch.cat([pk, kn]), torch.cat([pv, vn]), mask, attn.scaling)
                    outs.append(attn.finish(o))
                    kvs.append((kn, vn))
                out = torch.stack(outs)
                node_kv[layer.layer_id] = kvs
            h = layer.mlp_block(h + out)
        return tgt.logits(h), h, node_kv, pending

    # -- finishing ------------------------------------------------------------------------

    def _finish(self, reqs: List[SpecRequest]) -> None:
        """Finished requests: replay pending tokens (deferred), insert ``prompt + output[:-1]``
        with the final state into the prefix store, free row and slots."""
        if self.cfg.mode == "deferred":
            # the state to cache covers prompt + output[:-1]: cut the accepted run there
            keep = torch.tensor([len(r.prompt) + len(r.output) - 1 for r in reqs]) - self.stash.seq_len[
                torch.tensor([r.row for r in reqs])]
            self._replay(reqs, keep)
            rows = torch.tensor([r.row for r in reqs])
            if bool(self.stash.pending(rows).any()):
                raise AssertionError("deferred finish: stash still pending after replay")
        for r in reqs:
            tokens = r.prompt + r.output[:-1]
            assert r.seq_len == len(tokens), (r.seq_len, len(tokens))
            self.prefix_store.insert(tokens, r.kv, self.conv_state[:, r.slot], self.temporal_state[:, r.slot])
            if r in self.running:
                self.running.remove(r)
            self.finished.append(r)
            self.free_rows.append(r.row)
            self.free_slots.extend([r.slot, *r.track_slots])

    def run(self, max_rounds: int = 1000) -> None:
        """Rounds until no request runs."""
        while self.running and max_rounds > 0:
            self.step()
            max_rounds -= 1

    # -- inspection -----------------------------------------------------------------------

    def materialized_state(self, req: SpecRequest) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(conv [L, conv_dim, W-1], temporal [L, HV, K, V])`` of ``req`` after all committed
        tokens: the main state, with pending stash records replayed into a copy (the engine's
        own pools and stash are untouched)."""
        conv = self.conv_state[:, req.slot].clone()
        temp = self.temporal_state[:, req.slot].clone()
        if self.cfg.mode == "snapshot" or int(self.stash.count[req.row]) == 0:
            return conv, temp
        cs = self.conv_state.clone()
        ts = self.temporal_state.clone()
        saved = (self.stash.count.clone(), self.stash.seq_len.clone())
        saved_track = self.stash.track_slot.clone()
        self.stash.track_slot.fill_(-1)
        replay(self.stash, torch.tensor([req.row]), torch.tensor([req.slot]), cs, ts, self.replay_weights, impl="torch")
        self.stash.track_slot.copy_(saved_track)
        self.stash.count.copy_(saved[0])
        self.stash.seq_len.copy_(saved[1])
        return cs[:, req.slot], ts[:, req.slot]
