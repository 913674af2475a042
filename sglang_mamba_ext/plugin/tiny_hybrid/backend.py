"""Pure-torch linear-attention backend for the tiny hybrid model on SGLang 0.5.23
(``docs/design.md``, "Tiny hybrid model"). SGLang wraps it with the full-attention backend in
``HybridLinearAttnBackend`` (``srt/layers/attention/hybrid_linear_attn_backend.py``), which
hands it each linear layer's ``mixed_qkv`` ``[T, conv_dim]``, ``a`` = the raw decay gate
``[T, gate_dim]`` and ``b`` = the raw ``beta`` logits ``[T, HV]`` (``GatedDeltaRuleMixer.project_raw``,
as SGLang's KDA/GDN layers pass them; activated here with ``mixer.activate_gates``). For batch row ``i`` it reads pool slot
``forward_metadata.mamba_cache_indices[i]`` of ``req_to_token_pool.mamba2_layer_cache(layer_id)``
(``.conv[0]`` ``[slots, conv_dim, W-1]``, ``.temporal`` ``[slots, HV, V, K]``: SGLang's GDN
layout, read and written through ``[slots, HV, K, V]`` views, the mixer's), runs the
layer's own segment runner ``layer.mixer.run_segments`` over the row's tokens
``query_start_loc[i]:query_start_loc[i+1]`` (continuing from the slot's state when
``extend_prefix_lens[i] > 0``, from zeros otherwise) and writes the states back; metadata comes
from the inherited ``MambaAttnBackendBase._forward_metadata``. The segments are cut where
:meth:`~TinyHybridLinearAttnBackend.checkpoint_plan` asks for a copy of the row's state into
another slot: by default SGLang's extra_buffer ping-pong track metadata (``schedule_batch.py``,
the checkpoints SGLang's GPU backends write in ``_track_mamba_state_extend`` / ``_decode``) plus,
under ``--enable-mamba-radix``, the prefix checkpoints the plugin's pool planned. Target verify
(speculative decoding, :meth:`~TinyHybridLinearAttnBackend._forward_target_verify`) follows
SGLang's snapshot contract. Not supported: draft-extend (a frozen-KV draft has no linear layers),
tensor parallelism, CUDA graphs (CPU serving never captures).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase

from sglang_mamba_ext.models.linear_attn import gated_delta_rule_step

# (offset in tokens within this forward's new tokens of the row, destination pool slot)
Checkpoint = Tuple[int, int]
CheckpointPlan = Dict[int, List[Checkpoint]]


class TinyHybridLinearAttnBackend(MambaAttnBackendBase):
    """Linear-attention backend (gated delta rule + short conv) in plain torch."""

    #: Optional ``fn(backend, forward_batch) -> {row: [(offset, dst_slot), ...]}`` used by
    #: the default :meth:`checkpoint_plan`. Class attribute so a plugin can install it
    #: without subclassing; ``None`` = no checkpoints.
    checkpoint_plan_fn: Optional[Callable[["TinyHybridLinearAttnBackend", object], CheckpointPlan]] = None
    #: This backend writes SGLang's extra_buffer checkpoints itself (plain torch, any
    #: device); read by sglang_mamba_ext's start-up check of ``--enable-mamba-radix``.
    writes_mamba_track_states = True

    def __init__(self, model_runner) -> None:
        super().__init__(model_runner)
        self._plan: CheckpointPlan = {}
        if hasattr(model_runner.req_to_token_pool, "prefix_checkpoint_writer"):
            # This backend writes a state at any token position: the mamba-radix pool may
            # plan exact branch-point and prompt-end checkpoints (with overlap scheduling
            # too: every state write is inside a forward, in batch order; docs/design.md,
            # "Overlap scheduling").
            model_runner.req_to_token_pool.prefix_checkpoint_writer = True
        # MambaAttnBackendBase's extend track metadata reads the conv window length here.
        self.conv_states_shape = tuple(model_runner.req_to_token_pool.mamba_pool.mamba_cache.conv[0].shape)

    # -- metadata ------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch) -> None:
        super().init_forward_metadata(forward_batch)
        self._plan = self._validated_plan(forward_batch)

    def checkpoint_plan(self, forward_batch) -> CheckpointPlan:
        """Hook: extra state copies for this forward, ``{row: [(offset, dst_slot), ...]}``.

        Rows are batch rows (the order of ``forward_batch.req_pool_indices``); offsets are
        token counts into the row's new tokens of this forward (1 for a decode row), ``0 <=
        offset <= new tokens``: after that many tokens the row's working conv + temporal state
        is also copied into ``dst_slot`` (offset 0: the state the row starts from, zeros for a
        fresh row). Every linear layer applies the same plan.
        Default: :attr:`checkpoint_plan_fn` if set, else SGLang's track metadata
        (:meth:`sglang_track_plan`) joined with the mamba-radix pool's planned prefix
        checkpoints (:meth:`_prefix_checkpoint_plan`)."""
        fn = type(self).checkpoint_plan_fn
        if fn is not None:
            return fn(self, forward_batch)
        plan = self.sglang_track_plan(forward_batch)
        extra = self._prefix_checkpoint_plan(forward_batch)
        for row, items in extra.items():
            plan[row] = plan.get(row, []) + items
        return plan

    def _prefix_checkpoint_plan(self, forward_batch) -> CheckpointPlan:
        """The mamba-radix pool's planned prefix checkpoints inside this forward
        (``MambaRadixReqToTokenPool.prefix_checkpoint_plan``); empty with another pool."""
        fn = getattr(self.req_to_token_pool, "prefix_checkpoint_plan", None)
        return fn(forward_batch) if fn is not None else {}

    def sglang_track_plan(self, forward_batch) -> CheckpointPlan:
        """SGLang's extra_buffer track metadata as a plan: an extend row with
        ``mamba_prefill_track_mask_cpu`` set checkpoints after
        ``mamba_track_aligned_lens()[row]`` tokens, a decode row with ``mamba_track_mask``
        set after its token; the destination is ``forward_metadata.mamba_track_indices[row]``
        (negative = no slot, skipped). Empty without tracking."""
        md = self.forward_metadata
        dst_all = getattr(md, "mamba_track_indices", None) if md is not None else None
        mode = getattr(forward_batch, "forward_mode", None)
        if dst_all is None or mode is None:
            return {}
        plan: CheckpointPlan = {}
        if mode.is_decode():
            mask = getattr(forward_batch, "mamba_track_mask", None)
            if mask is None:
                return {}
            rows = mask.nonzero().flatten().tolist()
            dsts = dst_all.tolist()
            for r in rows:
                if dsts[r] >= 0:
                    plan[r] = [(1, dsts[r])]
            return plan
        if not mode.is_extend() or mode.is_target_verify() or mode.is_draft_extend_v2():
            return {}
        mask = getattr(forward_batch, "mamba_prefill_track_mask_cpu", None)
        if mask is None:
            t = getattr(forward_batch, "mamba_track_mask", None)
            mask = t.tolist() if t is not None else None
        if not mask or not any(mask):
            return {}
        aligned = forward_batch.mamba_track_aligned_lens()
        if aligned is None:
            return {}
        offs = aligned.tolist()
        dsts = dst_all.tolist()
        for r, m in enumerate(mask):
            if m and dsts[r] >= 0 and offs[r] > 0:
                plan[r] = [(offs[r], dsts[r])]
        return plan

    def _validated_plan(self, forward_batch) -> CheckpointPlan:
        plan = self.checkpoint_plan(forward_batch) or {}
        if not plan:
            return {}
        lens = self._new_token_counts(forward_batch)
        out: CheckpointPlan = {}
        for row, items in plan.items():
            if not 0 <= row < len(lens):
                raise ValueError(f"checkpoint_plan: row {row} outside batch of {len(lens)}")
            items = sorted((int(o), int(s)) for o, s in items)
            for off, _ in items:
                if not 0 <= off <= lens[row]:
                    raise ValueError(
                        f"checkpoint_plan: offset {off} outside row {row}'s {lens[row]} new tokens"
                    )
            out[row] = items
        return out

    def _new_token_counts(self, forward_batch) -> List[int]:
        qsl = self.forward_metadata.query_start_loc
        if qsl is None:
            return []
        q = qsl.tolist()
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]

    # -- state I/O -----------------------------------------------------------------------

    def _layer_pools(self, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        cache = self.req_to_token_pool.mamba2_layer_cache(layer_id)
        return cache.conv[0], cache.temporal.transpose(-1, -2)  # [slots, HV, K, V] view

    @staticmethod
    def write_state(
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
        slot: int,
        conv_state: torch.Tensor,
        temporal_state: torch.Tensor,
    ) -> None:
        """Store one row's states into pool ``slot`` (casting to the pool dtypes)."""
        conv_pool[slot].copy_(conv_state)
        ssm_pool[slot].copy_(temporal_state)

    # -- forward -------------------------------------------------------------------------

    def forward_extend(self, layer=None, forward_batch=None, mixed_qkv=None, a=None, b=None, **kwargs) -> torch.Tensor:
        """Extend (prefill / chunked prefill / mixed) for every row of the batch: each row
        runs ``layer.mixer.run_segments`` over its tokens, cut at its plan's offsets.

        ``mixed_qkv`` ``[T, conv_dim]``, ``a`` ``[T, gate_dim]`` and ``b`` ``[T, HV]`` raw gates
        (``q, k, v, save_kv_cache`` arrive in ``kwargs``, unused). Returns
        ``[1, T, HV, V]`` in ``mixed_qkv.dtype``.

        Raises:
            NotImplementedError: a draft-extend batch."""
        mode = forward_batch.forward_mode
        if mode.is_target_verify():
            return self._forward_target_verify(layer, forward_batch, mixed_qkv, a, b)
        if mode.is_draft_extend_v2():
            raise NotImplementedError(
                "TinyHybridLinearAttnBackend: speculative draft-extend is not supported by the tiny "
                "hybrid model's SGLang backend (a frozen-KV draft has no linear layers)"
            )
        mixer = layer.mixer
        s = mixer.shape
        T = mixed_qkv.shape[0]
        g, b = mixer.activate_gates(a, b)
        out = mixed_qkv.new_zeros(T, s.num_v_heads, s.head_v_dim)
        conv_pool, ssm_pool = self._layer_pools(layer.layer_id)
        md = self.forward_metadata
        qsl = md.query_start_loc.tolist()
        slots = md.mamba_cache_indices.tolist()
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        if prefix_lens is None or len(prefix_lens) != len(qsl) - 1:
            prefix_lens = forward_batch.extend_prefix_lens.tolist()
        for row in range(len(qsl) - 1):
            start, end, slot = qsl[row], qsl[row + 1], slots[row]
            if end <= start or slot < 0:
                continue
            has_state = int(prefix_lens[row]) > 0
            cuts = self._plan.get(row, [])

            def checkpoint(offset, conv_state, ssm_state, cuts=cuts) -> None:
                for off, dst in cuts:
                    if off == offset:
                        self._checkpoint(conv_pool, ssm_pool, dst, conv_state, ssm_state)

            o, conv_state, ssm_state = mixer.run_segments(
                mixed_qkv[start:end], g[start:end], b[start:end],
                conv_pool[slot] if has_state else None, ssm_pool[slot] if has_state else None,
                cuts=[off for off, _ in cuts], on_cut=checkpoint,
            )
            out[start:end] = o.to(out.dtype)
            self.write_state(conv_pool, ssm_pool, slot, conv_state, ssm_state)
        return out.unsqueeze(0)

    def forward_decode(self, layer=None, forward_batch=None, mixed_qkv=None, a=None, b=None, **kwargs) -> torch.Tensor:
        """One token per row, all rows at once (batched conv + gated-delta-rule step).

        Inputs as :meth:`forward_extend` with ``T = bs``. Returns ``[1, bs, HV, V]`` in
        ``mixed_qkv.dtype``."""
        mixer = layer.mixer
        bs = mixed_qkv.shape[0]
        conv_pool, ssm_pool = self._layer_pools(layer.layer_id)
        slots = self.forward_metadata.mamba_cache_indices[:bs].to(torch.long)
        valid = slots >= 0
        safe = torch.where(valid, slots, torch.zeros_like(slots))
        y, new_conv = mixer.conv(mixed_qkv[:, None, :], conv_pool[safe])  # [bs, 1, D]
        qh, kh, vh = mixer.split_qkv(y[:, 0])
        g, beta = mixer.activate_gates(a, b)
        o, new_ssm = gated_delta_rule_step(qh, kh, vh, g, beta, ssm_pool[safe], scale=mixer.scale)
        if self._plan:
            for row, cuts in self._plan.items():
                for off, dst in cuts:
                    src_conv = conv_pool[safe[row]] if off == 0 else new_conv[row]
                    src_ssm = ssm_pool[safe[row]] if off == 0 else new_ssm[row]
                    self._checkpoint(conv_pool, ssm_pool, dst, src_conv, src_ssm)
        if bool(valid.all()):
            conv_pool[slots] = new_conv.to(conv_pool.dtype)
            ssm_pool[slots] = new_ssm.to(ssm_pool.dtype)
        else:
            conv_pool[slots[valid]] = new_conv[valid].to(conv_pool.dtype)
            ssm_pool[slots[valid]] = new_ssm[valid].to(ssm_pool.dtype)
        return o.to(mixed_qkv.dtype).unsqueeze(0)

    def _checkpoint(self, conv_pool, ssm_pool, dst, conv_state, ssm_state) -> None:
        """Copy a row's state at a plan offset into ``dst`` (zeros for a fresh row)."""
        if conv_state is None:
            conv_pool[dst].zero_()
            ssm_pool[dst].zero_()
        else:
            self.write_state(conv_pool, ssm_pool, dst, conv_state, ssm_state)

    # -- speculative target verify -----------------------------------------------------

    @staticmethod
    def tree_parents(next_token, next_sibling, num_nodes: int) -> List[int]:
        """Parent of every node of one request's draft tree (``-1`` for node 0, the root),
        derived from SGLang's ``retrieve_next_token`` (first child) and
        ``retrieve_next_sibling`` (next sibling) rows (local node indices, ``-1`` = none;
        ``eagle_utils.build_tree_kernel_efficient``). ``None`` arrays mean a chain (topk 1).
        SGLang's ``retrieve_parent_token`` is not read: it may be uninitialised.

        Raises:
            ValueError: a node unreachable from the root, or a cycle."""
        if next_token is None:
            return [i - 1 for i in range(num_nodes)]
        nt = [int(x) for x in next_token]
        ns = [int(x) for x in next_sibling]
        parents = [-2] * num_nodes
        parents[0] = -1
        stack = [0]
        while stack:
            p = stack.pop()
            c = nt[p]
            while 0 <= c < num_nodes:
                if parents[c] != -2:
                    raise ValueError(f"draft tree: node {c} reached twice")
                parents[c] = p
                stack.append(c)
                c = ns[c]
        if any(x == -2 for x in parents):
            raise ValueError(f"draft tree: nodes {[i for i, x in enumerate(parents) if x == -2]} unreachable")
        return parents

    def _forward_target_verify(self, layer, forward_batch, mixed_qkv, a, b) -> torch.Tensor:
        """Target verify of a draft tree in SGLang's snapshot contract
        (``layers/attention/linear/gdn_backend.py``, ``MambaPool.SpeculativeState``): every row
        holds ``T = spec_info.draft_token_num`` nodes (``mixed_qkv`` ``[bs*T, conv_dim]``,
        ``a`` ``[bs*T, HV*K]``, ``b`` ``[bs*T, HV]``); node ``j`` runs one step from its
        parent's state (node 0 from the row's main state) and its conv window / SSM state
        go to ``intermediate_conv_window[0][row, j]`` / ``intermediate_ssm[row, j]``. The main
        state is never written: SGLang's commit scatter copies the accepted node's state
        afterwards (``spec_utils.commit_mamba_states_after_verify``). Under
        ``--mamba-spec-state-update deferred`` the intermediate buffers are the one-layer
        buffer and the raw inputs are first captured for replay
        (``plugin/speculative/hooks.py::capture_verify_inputs``); where the pool has no
        node-state SSM buffer (on-chip verify, ``speculative/verify_onchip.py``) the nodes'
        conv windows are computed here and the recurrence runs in the on-chip Triton kernel.
        Returns ``[1, bs*T, HV, V]``."""
        from sglang_mamba_ext.plugin.speculative.hooks import capture_verify_inputs, onchip_state

        mixer = layer.mixer
        capture_verify_inputs(self.req_to_token_pool, layer.layer_id, mixer.conv_weight, mixer.conv_bias,
                              mixer.A_log, mixer.dt_bias, mixed_qkv, a, b)
        s = mixer.shape
        spec = forward_batch.spec_info
        T = int(spec.draft_token_num)
        N = mixed_qkv.shape[0]
        bs = N // T
        g, b = mixer.activate_gates(a, b)
        cache = self.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
        # [.., HV, K, V] views of SGLang's [.., HV, V, K] layout
        conv_pool, ssm_pool = cache.conv[0], cache.temporal.transpose(-1, -2)
        inter_conv, inter_ssm = cache.intermediate_conv_window[0], cache.intermediate_ssm.transpose(-1, -2)
        slots = self.forward_metadata.mamba_cache_indices[:bs].tolist()
        nt_all = getattr(spec, "retrieve_next_token", None)
        ns_all = getattr(spec, "retrieve_next_sibling", None)
        chain = nt_all is None or int(getattr(spec, "topk", 1) or 1) <= 1
        out = mixed_qkv.new_zeros(N, s.num_v_heads, s.head_v_dim)
        chip = onchip_state(self.req_to_token_pool)
        if chip is not None:
            return self._verify_onchip(mixer, chip, mixed_qkv, g, b, conv_pool, ssm_pool, inter_conv, slots, T,
                                       None if chain else nt_all, None if chain else ns_all, out)
        for row in range(bs):
            slot = slots[row]
            if slot < 0:
                continue
            parents = self.tree_parents(None if chain else nt_all[row].tolist(),
                                        None if chain else ns_all[row].tolist(), T)
            depth = [0] * T
            for j in range(1, T):  # parents first (a node's parent may come later in the tree arrays)
                d, q = 0, j
                while parents[q] >= 0:
                    d, q = d + 1, parents[q]
                depth[j] = d
            for j in sorted(range(T), key=lambda n: depth[n]):
                p = parents[j]
                conv0 = conv_pool[slot] if p < 0 else inter_conv[row, p]
                ssm0 = ssm_pool[slot] if p < 0 else inter_ssm[row, p]
                t = row * T + j
                y, new_conv = mixer.conv(mixed_qkv[t][None, None, :], conv0[None])
                qh, kh, vh = mixer.split_qkv(y[:, 0])
                o, new_ssm = gated_delta_rule_step(qh, kh, vh, g[t][None], b[t][None], ssm0[None], scale=mixer.scale)
                inter_conv[row, j] = new_conv[0].to(inter_conv.dtype)
                inter_ssm[row, j] = new_ssm[0].to(inter_ssm.dtype)
                out[t] = o[0].to(out.dtype)
        return out.unsqueeze(0)

    def _verify_onchip(self, mixer, state, mixed_qkv, g, beta, conv_pool, ssm_pool, inter_conv, slots, T, nt_all, ns_all,
                       out) -> torch.Tensor:
        """:meth:`_forward_target_verify` without a node-state buffer: every node's conv window
        into ``inter_conv[row, j]`` (from its parent's), then one on-chip launch for the SSM
        recurrence of all rows (``speculative/verify_onchip.py::onchip_tree_recurrence``)."""
        from sglang_mamba_ext.plugin.speculative.hooks import kernel_impl
        from sglang_mamba_ext.speculative.verify_onchip import onchip_tree_recurrence

        s = mixer.shape
        bs = len(slots)
        y_all = mixed_qkv.new_zeros(bs, T, s.conv_dim)
        parents_all = torch.full((bs, T), -1, dtype=torch.int64)
        dmax = 1
        for row in range(bs):
            slot = slots[row]
            if slot < 0:
                continue
            parents = self.tree_parents(None if nt_all is None else nt_all[row].tolist(),
                                        None if ns_all is None else ns_all[row].tolist(), T)
            parents_all[row] = torch.tensor(parents)
            for j in range(T):  # tree depth (root = 1): the on-chip path tables' width
                d, a = 1, j
                while parents[a] >= 0:
                    d, a = d + 1, parents[a]
                dmax = max(dmax, d)
            done = [False] * T
            for j0 in range(T):  # parents first (a node's parent may come later in the tree arrays)
                chain = []
                j = j0
                while j >= 0 and not done[j]:
                    chain.append(j)
                    j = parents[j]
                for j in reversed(chain):
                    p = parents[j]
                    conv0 = conv_pool[slot] if p < 0 else inter_conv[row, p]
                    y, new_conv = mixer.conv(mixed_qkv[row * T + j][None, None, :], conv0[None])
                    inter_conv[row, j] = new_conv[0].to(inter_conv.dtype)
                    y_all[row, j] = y[0, 0]
                    done[j] = True
        q, k, v = mixer.split_qkv(y_all)
        g = g.reshape(bs, T, s.num_v_heads, s.head_k_dim)
        if state.layout.per_head_gate:
            g = g[..., 0]
        valid = torch.tensor([x >= 0 for x in slots])
        o = onchip_tree_recurrence(q, k, v, g, beta.reshape(bs, T, s.num_v_heads), ssm_pool,
                                   torch.tensor(slots).clamp(min=0), parents_all.to(q.device), dmax,
                                   mixer.scale, impl=kernel_impl(q))
        o = torch.where(valid[:, None, None, None], o, torch.zeros_like(o))
        out.copy_(o.reshape(out.shape).to(out.dtype))
        return out.unsqueeze(0)
