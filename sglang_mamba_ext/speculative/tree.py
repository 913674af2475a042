"""EAGLE draft trees as ``retrieve_parent_token`` arrays, greedy acceptance along them, and the
index tables tree verify uses (``docs/design.md``, "Speculative verify"). Conventions follow
SGLang's tree verify (``kernels/ops/mamba/causal_conv1d_triton.py``,
``speculative/eagle_utils.py``): a request verifies ``draft_token_num`` (``T``) nodes; node 0
is the root (the bonus token the target sampled last round, not yet seen by it), nodes
``1..T-1`` are drafts; ``retrieve_parent_token[i]`` is node ``i``'s parent among the same
request's nodes, or ``-1`` when the node continues the request's main state; nodes are in
topological order (``parent < child``). Greedy acceptance (EAGLE ``verify_tree_greedy``):
node 0 is always accepted, then the child whose token equals the target's argmax at the
current accepted node, until none matches; the accepted nodes form a root-to-node chain
(``accept_length + 1`` tokens reach the target's state) and the argmax at its last node is the
next root. Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

__all__ = [
    "DraftTree",
    "TreeIndex",
    "eagle_tree_parents",
    "max_draft_token_num",
    "greedy_accept",
    "Acceptance",
]


def max_draft_token_num(topk: int, steps: int) -> int:
    """Largest ``draft_token_num`` an EAGLE tree of ``topk``/``steps`` can fill (root included).

    Step 1 proposes ``topk`` children of the root; every later step expands the ``topk`` best
    leaves by ``topk`` children each, so the candidates are ``topk + (steps-1) * topk**2``
    (SGLang ``eagle_utils.build_tree_kernel_efficient``'s candidate count).
    """
    if topk < 1 or steps < 1:
        raise ValueError(f"topk ({topk}) and steps ({steps}) must be >= 1 (--speculative-eagle-topk, --speculative-num-steps)")
    if topk == 1:
        return steps + 1
    return 1 + topk + (steps - 1) * topk * topk


def eagle_tree_parents(topk: int, steps: int, draft_token_num: Optional[int] = None) -> List[int]:
    """A fixed EAGLE-shaped tree (without scores): ``retrieve_parent_token`` of one request.

    The first ``topk`` leaves of each level are the ones expanded (as EAGLE keeps the ``topk``
    best); nodes are listed level by level, truncated to ``draft_token_num`` (default: all
    candidates). Used for sizing and for tests; the reference engine builds score-ranked trees
    with :class:`DraftTree` directly.

    Returns:
        list of ``draft_token_num`` ints, ``[-1, 0, 0, ...]``.
    """
    full = max_draft_token_num(topk, steps)
    T = full if draft_token_num is None else int(draft_token_num)
    if not 1 <= T <= full:
        raise ValueError(
            f"draft_token_num={T} outside [1, {full}] for topk={topk}, steps={steps} "
            "(--speculative-num-draft-tokens)"
        )
    parents = [-1]
    frontier = [0]
    for _ in range(steps):
        level = []
        for p in frontier:
            for _ in range(topk):
                level.append(p)
        start = len(parents)
        parents.extend(level)
        # EAGLE expands only topk leaves of each level (the best ones; here: the first ones).
        frontier = list(range(start, start + len(level)))[:topk]
    return parents[:T]


@dataclass(frozen=True)
class DraftTree:
    """A batch of draft trees: ``tokens [N, T]`` int64 and ``retrieve_parent_token [N, T]`` int64.

    Rows must be topologically ordered (``parent < index`` or ``-1``). All requests of one
    batch share ``T = draft_token_num`` (as SGLang pads to a fixed tree size).

    Raises:
        ValueError: shapes disagree or a parent index is out of order.
    """

    tokens: torch.Tensor
    retrieve_parent_token: torch.Tensor

    def __post_init__(self) -> None:
        if self.tokens.shape != self.retrieve_parent_token.shape or self.tokens.dim() != 2:
            raise ValueError(
                f"DraftTree: tokens {tuple(self.tokens.shape)} and retrieve_parent_token "
                f"{tuple(self.retrieve_parent_token.shape)} must both be [N, T]"
            )
        par = self.retrieve_parent_token
        idx = torch.arange(par.shape[1]).expand_as(par)
        if bool(((par >= idx) | (par < -1)).any()):
            raise ValueError(
                "DraftTree: retrieve_parent_token must satisfy -1 <= parent < node index "
                f"(topological order); got {par.tolist()}"
            )

    @property
    def num_requests(self) -> int:
        return self.tokens.shape[0]

    @property
    def draft_token_num(self) -> int:
        return self.tokens.shape[1]

    def depth(self) -> torch.Tensor:
        """``[N, T]`` int64: 1 for a node whose parent is the main state, parent depth + 1 else."""
        par = self.retrieve_parent_token
        d = torch.zeros_like(par)
        for i in range(par.shape[1]):
            p = par[:, i]
            d[:, i] = torch.where(p < 0, torch.ones_like(p), d.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1)
        return d

    def path(self, n: int, i: int) -> List[int]:
        """Nodes from the first node after the main state down to node ``i`` (inclusive)."""
        out = []
        par = self.retrieve_parent_token[n].tolist()
        while i >= 0:
            out.append(i)
            i = par[i]
        return out[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        """``[N, T, T]`` bool: ``mask[n, i, j]`` iff node ``j`` is node ``i`` or an ancestor of it
        (the tree attention mask over the draft part of the sequence)."""
        par = self.retrieve_parent_token
        N, T = par.shape
        m = torch.zeros(N, T, T, dtype=torch.bool)
        for i in range(T):
            m[:, i, i] = True
            p = par[:, i]
            has = p >= 0
            if bool(has.any()):
                rows = torch.nonzero(has)[:, 0]
                m[rows, i] |= m[rows, p[rows]]
        return m


@dataclass(frozen=True)
class Acceptance:
    """Result of greedy verify for a batch.

    Attributes:
        accept_index: ``[N, max_len]`` int64 node indices of the accepted chain (root first),
            padded with -1; ``max_len = max tree depth``.
        accept_length: ``[N]`` int64 number of accepted *draft* nodes (SGLang's
            ``accept_length``; the chain holds ``accept_length + 1`` nodes).
        bonus_token: ``[N]`` int64 target argmax at the last accepted node.
        last_node: ``[N]`` int64 index of the last accepted node (SGLang's
            ``last_correct_step_indices``).
    """

    accept_index: torch.Tensor
    accept_length: torch.Tensor
    bonus_token: torch.Tensor
    last_node: torch.Tensor

    @property
    def num_committed(self) -> torch.Tensor:
        """``[N]`` tokens that enter the target's state this round (``accept_length + 1``)."""
        return self.accept_length + 1

    def committed_nodes(self, n: int) -> List[int]:
        return [int(x) for x in self.accept_index[n, : int(self.accept_length[n]) + 1]]


def greedy_accept(tree: DraftTree, target_predict: torch.Tensor) -> Acceptance:
    """Greedy tree acceptance (EAGLE; SGLang ``verify_tree_greedy``), in plain torch.

    Args:
        tree: the verified trees.
        target_predict: ``[N, T]`` int64 target argmax token at every node.

    Returns:
        :class:`Acceptance`. Node 0 must be the only node with parent ``-1`` in each row
        (EAGLE layout).

    Raises:
        ValueError: shapes disagree, or a row has a parent ``-1`` other than node 0.
    """
    par = tree.retrieve_parent_token
    N, T = par.shape
    if target_predict.shape != (N, T):
        raise ValueError(f"greedy_accept: target_predict {tuple(target_predict.shape)} != [N, T]=({N}, {T})")
    if bool((par[:, 1:] < 0).any()) or bool((par[:, 0] != -1).any()):
        raise ValueError("greedy_accept: EAGLE trees have exactly one root, node 0 (parent -1)")
    depth_max = int(tree.depth().max())
    accept_index = torch.full((N, depth_max), -1, dtype=torch.int64)
    accept_length = torch.zeros(N, dtype=torch.int64)
    bonus = torch.zeros(N, dtype=torch.int64)
    last = torch.zeros(N, dtype=torch.int64)
    tok = tree.tokens.tolist()
    parl = par.tolist()
    pred = target_predict.tolist()
    for n in range(N):
        children: List[List[int]] = [[] for _ in range(T)]
        for i in range(1, T):
            children[parl[n][i]].append(i)
        cur, chain = 0, [0]
        while True:
            nxt = next((c for c in children[cur] if tok[n][c] == pred[n][cur]), None)
            if nxt is None:
                break
            chain.append(nxt)
            cur = nxt
        accept_index[n, : len(chain)] = torch.tensor(chain)
        accept_length[n] = len(chain) - 1
        last[n] = cur
        bonus[n] = pred[n][cur]
    return Acceptance(accept_index, accept_length, bonus, last)


def chain_parents(T: int) -> List[int]:
    """``retrieve_parent_token`` of a linear chain of ``T`` nodes (topk == 1)."""
    return [-1] + list(range(T - 1))


def stack_trees(rows: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> DraftTree:
    """Build a :class:`DraftTree` from per-request ``(tokens, parents)`` lists of equal length."""
    toks = torch.tensor([list(r[0]) for r in rows], dtype=torch.int64)
    pars = torch.tensor([list(r[1]) for r in rows], dtype=torch.int64)
    return DraftTree(toks, pars)


@dataclass(frozen=True)
class TreeIndex:
    """Index tables of a :class:`DraftTree` batch for verify kernels.

    Attributes:
        parents: ``[N, T]`` int64 ``retrieve_parent_token``.
        depth: ``[N, T]`` int64 (1 = child of the main state).
        path: ``[N, T, Dmax]`` int64 nodes from the first node after the main state to the
            node itself, ``-1`` padded.
        conv_src: ``[N, T, W-1]`` int64 where each column of the node's *input* window (the
            ``W-1`` inputs before it, oldest first) comes from: ``j >= 0`` node ``j``'s input,
            ``j < 0`` column ``-1 - j`` of the main conv window.
    """

    parents: torch.Tensor
    depth: torch.Tensor
    path: torch.Tensor
    conv_src: torch.Tensor

    @classmethod
    def build(cls, tree: DraftTree, conv_kernel: int) -> "TreeIndex":
        par = tree.retrieve_parent_token
        N, T = par.shape
        depth = tree.depth()
        dmax = int(depth.max()) if T > 0 else 1
        path = torch.full((N, T, dmax), -1, dtype=torch.int64)
        conv_src = torch.empty((N, T, conv_kernel - 1), dtype=torch.int64)
        parl = par.tolist()
        for n in range(N):
            for i in range(T):
                chain = []
                j = i
                while j >= 0:
                    chain.append(j)
                    j = parl[n][j]
                chain.reverse()  # first node after main state .. i
                path[n, i, : len(chain)] = torch.tensor(chain)
                # inputs before node i along its path: chain[:-1], preceded by the main window
                before = chain[:-1]
                for c in range(conv_kernel - 1):
                    back = conv_kernel - 1 - c  # distance back from node i (1 = parent)
                    if back <= len(before):
                        conv_src[n, i, c] = before[len(before) - back]
                    else:
                        # main window column: the (back - len(before))-th last
                        conv_src[n, i, c] = -1 - (conv_kernel - 1 - (back - len(before)))
        return cls(par, depth, path, conv_src)
