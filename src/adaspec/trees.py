"""Draft trees: several candidate continuations verified in one target forward.

A ``DraftTree`` holds n drafted nodes; node i has a token and a parent (``-1``: the root, i.e.
the last verified token; otherwise an earlier node, so parents come before children). The
target runs once over ``[last token] + nodes`` with a tree attention mask (every node sees the
cached prefix, its ancestors and itself) and tree position ids (cache length + depth), as in
SpecInfer (Miao et al. 2024, tree-based parallel decoding) and Medusa / EAGLE-2. Row 0 of the
logits is the root's next-token distribution, row i + 1 the one after node i's path.

Acceptance is exact:
- greedy (every tree kind): the longest root-to-node path whose every token is the target's
  argmax after its parent, plus the target's argmax after that path;
- sampling (every tree kind: model-free and model drafters alike): at the current node draw
  x ~ p (the processed target distribution); if x is one of its children, descend to that
  child, else emit x and stop. Every emitted token is a draw from p given the tokens before it,
  so the output is exactly the target's distribution, whatever the children are, as long as
  they are chosen without looking at the draw (a deterministic function of the context and the
  drafter's state). It equals in distribution SpecInfer's multi-step speculative sampling
  (MSS; Miao et al. 2024, Alg. 2 VerifyStochastic) with one-hot proposals, where rejecting
  child c leaves the residual p with c removed, renormalised; a child is accepted with
  probability gamma = the target mass of the children (Not-a-Bandit Theorem 2).

Which trees: prompt lookup and suffix propose the continuations of their matches; model
drafters (``model:``, ``self``, ``early-exit``, tiny LMs) and EAGLE-style feature heads grow
EAGLE-2 dynamic trees (``dynamic_tree``: Li et al. 2024) whose children are the *top* tokens of
each node's q, chosen deterministically, never sampled. MSS / recursive rejection sampling
(Jeon et al. 2024) with q are exact only for children *sampled* from q (with, resp. without,
replacement): applied to deterministic top-k children they would bias the output. So q ranks
and prunes the nodes (a node's score is the product of q along its path, EAGLE-2's value) and
the one-hot rule verifies them. A step accepts with the target mass of the drafted children
(p summed over q's top-k) where a sampled chain accepts with 1 - TV(p, q): the chain is ahead
when q is close to a flat p, the tree when q's top tokens cover most of p's mass (a sharp
target, the usual case at low temperature). Exact MSS over sampled children is not built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .errors import ConfigError
from .sampling import row_argmax, sample


@dataclass(frozen=True)
class DraftTree:
    """Drafted nodes: ``tokens[i]`` with parent ``parents[i]`` (-1 = the root, else < i).

    ``scores[i]``: the drafter's estimate of the probability that node i is accepted (its path
    matches the target), non-increasing from parent to child; nodes are in best-first order
    when the drafter builds by score, so every prefix of the nodes is a tree (``prefix``).
    Sibling tokens are distinct (a duplicate could never be told apart by the target).
    """

    tokens: list[int]
    parents: list[int]
    scores: list[float] | None = None
    depths: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.parents) != n or (self.scores is not None and len(self.scores) != n):
            raise ConfigError(f"a draft tree needs one parent (and score) per token: {n} tokens, "
                              f"{len(self.parents)} parents")
        depths: list[int] = []
        seen: set[tuple[int, int]] = set()
        for i, (tok, par) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= par < i:
                raise ConfigError(f"draft tree node {i} has parent {par}: parents must be -1 (the root) "
                                  "or an earlier node")
            if (par, tok) in seen:
                raise ConfigError(f"draft tree node {i} repeats token {tok} among its siblings: merge them")
            seen.add((par, tok))
            depths.append(1 if par < 0 else depths[par] + 1)
        object.__setattr__(self, "depths", depths)

    @classmethod
    def chain(cls, tokens: Sequence[int]) -> DraftTree:
        """A chain: node i is the child of node i - 1."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def prefix(self, m: int) -> DraftTree:
        """The first ``m`` nodes (a tree, since parents come first)."""
        if m >= len(self):
            return self
        return DraftTree(self.tokens[:m], self.parents[:m],
                         None if self.scores is None else self.scores[:m])

    def children(self) -> list[list[int]]:
        """Child node indices of every row: row 0 is the root, row i + 1 is node i."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, par in enumerate(self.parents):
            out[par + 1].append(i)
        return out

    def path(self, node: int) -> list[int]:
        """Node indices from depth 1 down to ``node``."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def visibility(self) -> torch.Tensor:
        """Bool [n + 1, n + 1]: row r may attend to row c (c is r, or an ancestor of r)."""
        n = len(self)
        vis = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        vis[0, 0] = True
        for i, par in enumerate(self.parents):
            vis[i + 1] = vis[par + 1]
            vis[i + 1, i + 1] = True
        return vis

    def position_offsets(self) -> list[int]:
        """Depth of every row (the root is 0): position id = cache length + depth."""
        return [0, *self.depths]


def tree_attention_mask(tree: DraftTree, cached: int, dtype: torch.dtype,
                        device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive float mask [1, 1, n + 1, cached + n + 1]: 0 where a row may attend (the whole
    cached prefix, its ancestors and itself), the dtype's minimum elsewhere (eager and SDPA
    attention both add it to the scores)."""
    vis = tree.visibility()
    n1 = vis.shape[0]
    mask = torch.zeros(n1, cached + n1, dtype=dtype)
    mask[:, cached:].masked_fill_(~vis, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying a tree: the accepted nodes (root to leaf) and the next token."""

    path: list[int]
    next_token: int

    @property
    def rows(self) -> list[int]:
        """Logit rows of the accepted path's positions: the root and every accepted node."""
        return [0, *(i + 1 for i in self.path)]


def walk_tree(tree: DraftTree, pick: Callable[[int], int]) -> TreeVerdict:
    """Descend from the root while ``pick(row)`` (the target's token at that row) is a child."""
    kids = tree.children()
    row, path = 0, []
    while True:
        x = pick(row)
        nxt = next((c for c in kids[row] if tree.tokens[c] == x), None)
        if nxt is None:
            return TreeVerdict(path, x)
        path.append(nxt)
        row = nxt + 1


def verify_tree_greedy(target_logits: torch.Tensor, tree: DraftTree) -> TreeVerdict:
    """Greedy: the longest path whose tokens equal the target's argmax, plus the next argmax."""
    argmax = row_argmax(target_logits)
    return walk_tree(tree, argmax.__getitem__)


def verify_tree_sampling(p: torch.Tensor, tree: DraftTree,
                         generator: torch.Generator | None) -> TreeVerdict:
    """Exact sampling for a one-hot tree (SpecInfer MSS with deterministic proposals): draw
    x ~ p at the current node, descend if x is a child, else emit x (module docstring)."""
    return walk_tree(tree, lambda row: sample(p[row], generator))


def tree_gammas(probs: torch.Tensor, tree: DraftTree, rows: Sequence[int]) -> list[float]:
    """Not-a-Bandit Theorem 2 at each of ``rows``: the target mass of the row's drafted
    children (the probability that the round goes on past it)."""
    kids = tree.children()
    out = []
    for r in rows:
        toks = [tree.tokens[c] for c in kids[r]]
        out.append(float(probs[r, toks].sum()) if toks else 0.0)
    return out


def node_probabilities(tree: DraftTree) -> list[float]:
    """Each node's own probability q_i: its score over its parent's (EAGLE-2 scores are
    products of q along the path)."""
    assert tree.scores is not None
    out: list[float] = []
    for s, p in zip(tree.scores, tree.parents):
        up = 1.0 if p < 0 else tree.scores[p]
        out.append(s / up if up > 0.0 else 0.0)
    return out


def calibrated_scores(tree: DraftTree, factor: float) -> list[float]:
    """A model drafter's node scores with each node's own probability q_i
    (``node_probabilities``) calibrated as a chain token's is
    (``length.cost_rule.ConfidenceCalibration``): c_i = c_parent min(1, q_i f), f the
    drafter's observed / predicted acceptance of tree nodes (``node_trials``)."""
    out: list[float] = []
    for q, p in zip(node_probabilities(tree), tree.parents):
        out.append((1.0 if p < 0 else out[p]) * min(1.0, q * factor))
    return out


def node_trials(tree: DraftTree, path: Sequence[int]) -> tuple[list[float], list[float]]:
    """(hit, q) of every verified node whose parent was accepted (the root's children too):
    the node's own probability q (score over its parent's) against whether the target took it
    (under sampling the realised acceptance is unbiased for the one-hot acceptance
    probability, as ``selection.auto.peek_chain``)."""
    accepted = {-1, *path}
    hits: list[float] = []
    qs: list[float] = []
    for i, (q, p) in enumerate(zip(node_probabilities(tree), tree.parents)):
        if p in accepted:
            qs.append(q)
            hits.append(1.0 if i in accepted else 0.0)
    return hits, qs


def nodes_worth_verifying(scores: Sequence[float], verify_cost: Callable[[int], float],
                          fixed_s: float = 0.0, rate: float | None = None) -> int:
    """How many of the first nodes (best-first) to verify; a node's score estimates its
    acceptance probability (its expected accepted tokens), so the first m give the round
    E_m = 1 + their scores' sum expected tokens in T_m = fixed_s + V(m + 1) seconds.

    Without ``rate``: the m that maximises the round's own rate E_m / T_m. With ``rate`` R
    (the generation's running tokens per second, the opportunity cost of a second): the m that
    maximises E_m - R T_m, i.e. a node is worth its extra verify seconds when its expected
    tokens exceed what those seconds yield on average (the ratio objective's optimal policy:
    Dinkelbach 1967; renewal-reward, a round's rate is not the generation's). A round better
    than average then verifies more nodes than its own rate would keep, a worse one fewer.
    Over every prefix, so a cost cliff (a wider forward that is cheaper) is found; without
    costs (V = 0) every node is kept. (``PrefixCut`` computes the same m node by node.)"""
    cut = PrefixCut.priced(verify_cost, fixed_s, len(scores), rate)
    for s in scores:
        cut.add(s)
    return cut.best_m


class PrefixCut:
    """``nodes_worth_verifying`` one node at a time, for a tree whose nodes arrive best-first
    (scores non-increasing, as a model-free drafter's heap pops them: ``offer``), so that its
    drafter stops growing the tree once no later node could change the cut. A drafter adds
    its nodes with ``add`` while it has offered one candidate at every node (a chain is the
    drafter's chain, cut by the length policy, never by the budget), with ``offer`` once the
    tree branched. On SmolLM2's mixed suite (replay) every model-free tree was drafted to its
    15 nodes, and ``auto`` verified 160 of 1,108 as trees (the rest gave way to its planned
    chain, or were one chain): 0.3-0.4 ms of lookups a round, more on caches a forward has
    just evicted.

    ``seconds[m]`` = fixed_s + V(m + 1), m = 0 .. the most nodes; ``rate``: the objective
    E_m - R T_m, else E_m / T_m. The cut after the nodes so far is ``best_m``; ``stopped``:
    ``offer`` refused a node."""

    def __init__(self, seconds: Sequence[float], rate: float | None = None):
        self.seconds, self.rate = list(seconds), rate
        #: no costs known (V(1) + fixed_s <= 0): every node is kept
        self.free = not self.seconds or self.seconds[0] <= 0.0
        self.m, self.total, self.best_m, self.stopped = 0, 1.0, 0, False
        self.best = 0.0 if self.free else self._value(0, 1.0)

    @classmethod
    def priced(cls, verify_cost: Callable[[int], float], fixed_s: float, max_nodes: int,
               rate: float | None = None) -> PrefixCut:
        """A cut over up to ``max_nodes`` nodes at ``verify_cost``'s widths plus ``fixed_s``."""
        if verify_cost(1) + fixed_s <= 0.0:
            return cls([], rate)
        return cls([fixed_s + verify_cost(m + 1) for m in range(max_nodes + 1)], rate)

    def _value(self, m: int, total: float) -> float:
        t = self.seconds[m]
        return total - self.rate * t if self.rate is not None else total / t

    def add(self, score: float) -> None:
        """The next best-first node: the cut moves to it when its prefix is strictly better."""
        self.m += 1
        self.total += score
        if self.free:
            self.best_m = self.m
            return
        value = self._value(self.m, self.total)
        if value > self.best:
            self.best_m, self.best = self.m, value

    def offer(self, score: float) -> bool:
        """Add a node of ``score`` if some prefix ending at it or later may still beat the best
        so far: every later node scores at most ``score``, so a prefix of m'
        nodes has E_m' <= E_m + (m' - m) score. Otherwise refuse it, and every later one."""
        if self.free:
            self.add(score)
            return True
        if self.stopped or self.m + 1 >= len(self.seconds):
            self.stopped = True
            return False
        total = self.total
        for m in range(self.m + 1, len(self.seconds)):
            total += score
            if self._value(m, total) > self.best:
                self.add(score)
                return True
        self.stopped = True
        return False


# -- dynamic trees from model drafters (EAGLE-2) -------------------------------------------------
@dataclass(frozen=True)
class TreeNode:
    """A node of a dynamic tree under construction: ``parent`` is a node id (-1: the root) and
    ``score`` the product of the draft probabilities along its path (EAGLE-2's value)."""

    token: int
    parent: int
    depth: int
    score: float


#: runs the drafter on a level's frontier (node ids into the node list): their next-token q rows
LevelStep = Callable[[Sequence[int], Sequence[TreeNode]], torch.Tensor]


#: how many of a tree's best-first nodes would be verified (the engine's node budget)
TreeBudget = Callable[["DraftTree"], int]


def _ranked(nodes: Sequence[TreeNode], max_nodes: int) -> tuple[list[int], DraftTree]:
    """The best ``max_nodes`` nodes by score (ties: shallower, then older) as a best-first
    ``DraftTree`` (every prefix a tree), with their ids in that order."""
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:max_nodes]
    new_id = {old: new for new, old in enumerate(order)}
    return order, DraftTree([nodes[i].token for i in order],
                            [-1 if nodes[i].parent < 0 else new_id[nodes[i].parent] for i in order],
                            [nodes[i].score for i in order])


def dynamic_tree(root_q: torch.Tensor, step: LevelStep, max_depth: int, max_nodes: int,
                 branch: int = 4, width: int = 4, level_gain: float = 0.0,
                 budget: TreeBudget | None = None, columns: torch.Tensor | None = None) -> DraftTree:
    """EAGLE-2 dynamic draft tree (Li et al. 2024, Sec. 4): every expanded node offers its
    ``branch`` most probable tokens (score = parent score x q); at each depth the ``width``
    best-scoring new nodes are expanded with one ``step`` (one drafter forward per level);
    finally all nodes are reranked by score and the best ``max_nodes`` kept (best-first, so
    every prefix is a tree). A frontier node is expanded only while it scores above the
    ``max_nodes``-th best score so far (its children score at most its own, so could not be
    kept); expansion stops when none does, or when the frontier's scores sum to at most
    ``level_gain`` (a node's children's scores sum to at most its own, so by the drafter's
    estimates the level adds at most that many expected tokens: the engine passes what a
    level's drafting seconds yield at the running rate, ``SpeculativeEngine._draft_tree``).
    ``budget``: how many best-first nodes of the tree so far would be verified (the engine's
    ``nodes_worth_verifying``); only frontier nodes among them are expanded. A node the budget
    cuts has children that score at most its own and need it verified, so they would be cut too
    (on a verify curve without a cliff past the cut): the level's forward would be thrown away.
    On SmolLM2's mixed suite the generalist head's trees were drafted 0.9 levels deeper than
    their verified part on average (~1.8 ms a level).
    With one child per node (``branch`` 1) the tree is the drafter's chain, as deep as the
    length policy's cap: neither ``level_gain`` nor ``budget`` cuts it (a tree of one chain is
    the chain path). ``columns``: the q rows' columns are these token ids (a drafter's reduced
    draft vocabulary; q is zero elsewhere), else column t is token t."""
    nodes: list[TreeNode] = []

    def offer(parents: Sequence[int], rows: torch.Tensor) -> list[int]:
        vals, idx = torch.topk(rows.float(), min(branch, rows.shape[-1]), dim=-1)
        if columns is not None:
            idx = columns[idx]
        new = []
        for pid, vs, ts in zip(parents, vals.tolist(), idx.tolist()):
            base, depth = (1.0, 1) if pid < 0 else (nodes[pid].score, nodes[pid].depth + 1)
            for v, t in zip(vs, ts):
                if v <= 0.0:  # q(t) = 0: outside the drafter's support
                    break
                nodes.append(TreeNode(int(t), pid, depth, base * v))
                new.append(len(nodes) - 1)
        return new

    level = offer([-1], root_q.reshape(1, -1)) if max_depth >= 1 and max_nodes >= 1 else []
    for _ in range(2, max_depth + 1):
        ranked = sorted((nd.score for nd in nodes), reverse=True)
        bar = ranked[max_nodes - 1] if len(ranked) >= max_nodes else 0.0  # the last kept score
        # a child scores at most its parent: expanding a node at or below the bar cannot pay
        frontier = [i for i in sorted(level, key=lambda i: -nodes[i].score)[:width] if nodes[i].score > bar]
        if branch > 1 and budget is not None and frontier:
            order, tree = _ranked(nodes, max_nodes)
            verified = set(order[:budget(tree)])
            frontier = [i for i in frontier if i in verified]
        if not frontier or (branch > 1 and sum(nodes[i].score for i in frontier) <= level_gain):
            break
        level = offer(frontier, step(frontier, nodes))
    return _ranked(nodes, max_nodes)[1]


def level_attention_mask(ancestors: Sequence[Sequence[int]], prefix: int, fed: int,
                         dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive mask [1, 1, n, prefix + fed + n] for feeding n tree nodes to a drafter whose
    cache holds ``prefix`` context entries then ``fed`` tree nodes: row r sees the context, the
    cached tree slots ``ancestors[r]`` (0-based after the context) and itself (EAGLE-2 tree
    attention while drafting; same convention as ``tree_attention_mask``)."""
    n = len(ancestors)
    allowed = torch.zeros(n, fed + n, dtype=torch.bool)
    for r, anc in enumerate(ancestors):
        allowed[r, list(anc)] = True
        allowed[r, fed + r] = True
    mask = torch.zeros(n, prefix + fed + n, dtype=dtype)
    mask[:, prefix:].masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


@dataclass
class TreeSlots:
    """Drafter cache slots of the tree nodes fed so far, after ``prefix`` context entries."""

    prefix: int
    slot_of: dict[int, int] = field(default_factory=dict)  # node id -> slot after the prefix

    def feed(self, frontier: Sequence[int], nodes: Sequence[TreeNode], dtype: torch.dtype,
             device: torch.device | str = "cpu") -> torch.Tensor:
        """Give the frontier nodes the next slots; their mask (``level_attention_mask``)."""
        ancestors = []
        for i in frontier:
            anc, p = [], nodes[i].parent
            while p >= 0:
                anc.append(self.slot_of[p])
                p = nodes[p].parent
            ancestors.append(anc)
        fed = len(self.slot_of)
        for r, i in enumerate(frontier):
            self.slot_of[i] = fed + r
        return level_attention_mask(ancestors, self.prefix, fed, dtype, device)
