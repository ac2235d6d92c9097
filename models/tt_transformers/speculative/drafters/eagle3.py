# SPDX-License-Identifier: Apache-2.0
"""Drafting with an EAGLE-3 draft head beside the target, on its tapped hidden states (arXiv 2503.01840), in chains or
in EAGLE-2's dynamic trees (arXiv 2406.16858).

The head (a DraftHeadModel: the torch backend's HeadRunner) reads, at position t, the residual streams entering the
layers it taps at t and token t+1, and gives the token at t+2 and a state the next draft step reads. The target returns
the tapped states for the rows it verifies (and for the prompt at prefill), so a draft always starts from true states:
the last step's accepted rows are fed first (one run, with everything else the head has not seen), then the head drafts
on its own states, one run per token (per tree depth). Its KV cache (one layer) is rolled back by position as the
target's is. On a TT device the head runs on the device instead (eagle3_device.py)."""
import time
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from ..config import MAX_TREE_NODES
from ..draft_length import PROBE_BUDGET, ExtraCost, MatchAcceptance
from ..sampling import probabilities
from .base import Draft, Verified
from .eagle3_base import HeadChain, HeadDraft, HeadDrafterBase


class DraftHeadModel(Protocol):
    vocab: torch.Tensor  # [V'] the draft vocabulary: the target's token ids the head can propose
    vocab_size: int  # the target's vocabulary
    taps: tuple[int, ...]  # the target layers whose input the head reads
    draft_cost: float  # estimated cost of one head run, in units of a plain decode step of the target (until measured)
    max_rows: int  # rows one run may carry per user (longer catch-ups go in chunks)
    window: int  # positions a row attends back, its own included: rows further back are never fed
    max_tree_nodes: int  # nodes of one user's draft tree the head can hold (its cache slots past max_seq_len)

    def run(self, users: Sequence[int], start_pos: Sequence[int], hidden: Sequence[torch.Tensor],
            next_tokens: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each user, rows (tapped states at t, or the head's own state, and token t+1) at t = start_pos,
        start_pos + 1, ...: the head's state after its last row [1, h] and the logits over the draft vocabulary after
        it [V']; the rows before it only feed the head's cache. A row's results do not depend on how many rows share
        the run."""

    def run_tree(self, nodes: Sequence[tuple[int, int, int, tuple[int, ...]]], states: torch.Tensor,
                 tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-tree nodes (user, position, node number, ancestors' node numbers): states [n, h] and logits [n, V']."""


class HeadDrafter(HeadDrafterBase):
    """Drafts with a trained head beside the target (HeadDrafterBase: acceptance, gating, cost), run by run: chains
    drawn token by token, or EAGLE-2 trees grown depth by depth, where the target verifies trees.

    States: known[u] holds the target's hidden states the head has not been fed yet, for positions fed_len[u],
    fed_len[u] + 1, ... (from the prefill, then from every verified step's accepted rows, whichever source drafted).
    """

    TREE_TOP_K = 4  # children per expanded node and nodes expanded per depth (EAGLE-2's top-k)

    def __init__(self, head: DraftHeadModel):
        super().__init__(head)
        self.known: dict[int, list[torch.Tensor]] = {}  # chunks, joined only when the head is fed
        self.fed_len: dict[int, int] = {}
        self.prompt_len: dict[int, int] = {}

    def start(self, users, prompts, sampler, hidden=None):
        self._reset(users, sampler, hidden)
        self.known = {u: [h] for u, h in zip(users, hidden)}
        self.fed_len = {u: 0 for u in users}
        self.prompt_len = {u: len(p) for u, p in zip(users, prompts)}

    def catch_up_pays(self, user: int, context: Sequence[int], n: int, extra_cost: ExtraCost) -> bool:
        """Whether the user's head may be fed the rows it is behind now. A gap longer than one run's rows (a whole
        prompt's at the first proposal, a long pause's) is a one-time cost of rows x RunCost.feed_row_value plain
        steps, paid once the request has made as many tokens as the head's drafts, at their expected value, need to win
        it back (the tokens made so far standing for those to come): a short answer after a long prompt does not
        pay for the head's prefill, a long one pays it after a few tokens. A head whose drafts do not pay is probed
        across such a gap only when those tokens cover it at the probe budget. Rows past the head's window are never
        fed (_catch_up): a gap costs its last `window` rows at most."""
        behind = min(len(context) - 1 - self.fed_len[user], self.head.window)
        if behind <= self.head.max_rows:
            return True
        value = self.draft_value(user, n, extra_cost)
        gain = max(1 - 1 / value, PROBE_BUDGET)
        return (len(context) - self.prompt_len[user]) * gain >= behind * self.cost.feed_row_value

    def warm_up(self, logits: bool = False) -> dict[str, float]:
        return {}  # a head beside the target runs eagerly

    def _unfed(self, user: int) -> torch.Tensor:
        """The states of positions fed_len, fed_len + 1, ...: the verified steps' rows since the head last ran, joined
        once."""
        if len(self.known[user]) > 1:
            self.known[user] = [torch.cat(self.known[user])]
        return self.known[user][0]

    def _rows(self, user: int, context: Sequence[int], end: int) -> tuple[int, torch.Tensor, list[int]]:
        """The head's next rows for positions fed_len .. end - 1: (start, hidden states, next tokens)."""
        start = self.fed_len[user]
        return start, self._unfed(user)[: end - start], list(context[start + 1 : end + 1])

    def _feed(self, users: list[int], rows: list[tuple[int, torch.Tensor, list[int]]]):
        outs = self.head.run(users, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        for u, (start, states, _) in zip(users, rows):
            self.fed_len[u] = start + len(states)
            self.known[u] = [self.known[u][0][len(states):]]
        return outs

    def _catch_up(self, live: list[tuple[int, Sequence[int]]], last_rows: int) -> None:
        """Feed the known states of each user's positions before len(context) - 1, in chunks of the head's row budget,
        except its last `last_rows`..max_rows rows when last_rows > 0 (the caller's first drafting run takes them).
        Rows that no row from here on attends (further back than the head's window) are dropped unfed. Timed per row
        (RunCost.fed: catch_up_pays prices the next gap with it)."""
        for u, ctx in live:
            skip = len(ctx) - 1 - self.head.window - self.fed_len[u]
            if skip > 0:
                self.known[u] = [self._unfed(u)[skip:]]
                self.fed_len[u] += skip
        while True:
            behind = [(u, ctx) for u, ctx in live
                      if len(ctx) - 1 - self.fed_len[u] > (self.head.max_rows if last_rows else 0)]
            if not behind:
                return
            ends = [min(len(ctx) - 1, self.fed_len[u] + self.head.max_rows) for u, ctx in behind]
            rows, start = sum(end - self.fed_len[u] for (u, _), end in zip(behind, ends)), time.perf_counter()
            self._feed([u for u, _ in behind], [self._rows(u, ctx, end) for (u, ctx), end in zip(behind, ends)])
            self.cost.fed(time.perf_counter() - start, rows)

    def _choose(self, logits: torch.Tensor, user: int, position: int) -> tuple[int, float]:
        """The draft token at `position` after these logits over the draft vocabulary, and the head's probability of
        it: its argmax, or when sampling its draw from q (over the target's ids, through d2t) with the target's key."""
        if self.sampler.params.greedy:
            p = torch.softmax(logits.float(), dim=-1)
            i = int(p.argmax())
            return int(self.vocab[i]), float(p[i])
        q_draft = probabilities(logits, self.sampler.params)
        q = torch.zeros(self.head.vocab_size, dtype=q_draft.dtype, device=q_draft.device)
        q[self.vocab.to(q.device)] = q_draft
        token = self.sampler.sample(q, user, position)
        return token, float(q[token])

    def propose(self, users, contexts, max_tokens, extra_cost: ExtraCost, trees=False):
        """Chains, or EAGLE-2 trees when the target verifies trees."""
        # a one-token context has no row yet (the head's first row predicts the token at position 2); a user whose
        # head drafts do not pay is not run, but for a probe now and then
        probes = set()
        live = [(u, ctx) for u, ctx, n in zip(users, contexts, max_tokens) if n > 0 and len(ctx) > 1
                and self.catch_up_pays(u, ctx, n, extra_cost) and self._gated(u, n, extra_cost, probes)]
        self._catch_up(live, 1)
        outs = self._feed([u for u, _ in live], [self._rows(u, ctx, len(ctx) - 1) for u, ctx in live]) if live else []
        roots = {u: (len(ctx) - 1, out[0][-1:], out[1]) for (u, ctx), out in zip(live, outs)}  # position, h, logits
        wanted = dict(zip(users, max_tokens))
        # Only the drafting runs are timed: the feed above is the head's prefill of rows the target verified (a whole
        # prompt's, or a long gap's, at a first proposal); counted as a run's cost it would price the head at many
        # target steps at long contexts, and the policy would stop running it.
        drafting = time.perf_counter()
        if trees:
            drafts, runs = self._trees(roots, wanted, extra_cost, probes)
        else:
            drafts, runs = self._chains(roots, wanted, extra_cost, probes)
        if runs:
            self.cost.ran((time.perf_counter() - drafting) / runs)
        if live:
            self.cost.proposed(extra_cost)
        self._learn_declines([u for u, _ in live], drafts)
        return [drafts.get(u, Draft([], "none")) for u in users]

    def _chains(self, roots: dict, wanted: dict, extra_cost: ExtraCost, probes: set) -> tuple[dict, int]:
        """Each user's chain, extended while one more token pays for its run and verification; and the number of
        drafting runs (after the feed's)."""
        state, going, runs = dict(roots), list(roots), 0
        chains = {u: HeadChain() for u in going}
        while going:
            for u in going:
                chains[u].extend(*self._choose(state[u][2], u, state[u][0] + 1), self.acceptance, self.draft_cost,
                                 extra_cost)
            going = [u for u in going if chains[u].paying == len(chains[u].tokens) < wanted[u]]
            if going:
                outs = self.head.run(going, [state[u][0] for u in going], [state[u][1] for u in going],
                                     [[chains[u].tokens[-1]] for u in going])
                runs += 1
                for u, (h, logits) in zip(going, outs):
                    state[u] = (state[u][0] + 1, h, logits)
        drafts = {}
        for u, chain in chains.items():
            # a probe drafts one token; the runs being spent, a first token pays if it is likelier than its row costs
            draft = self._chain_draft(u, chain, chain.paying or int(u in probes or chain.path_probs[0] > extra_cost(1)))
            if draft is not None:
                drafts[u] = draft
        return drafts, runs

    def _trees(self, roots: dict, wanted: dict, extra_cost: ExtraCost, probes: set) -> tuple[dict, int]:
        """EAGLE-2's dynamic trees: at each depth (up to the user's draft budget) the TREE_TOP_K likeliest nodes (by
        estimated path acceptance) are run, all users' together, and give TREE_TOP_K children each; then the tree is
        cut to the nodes, likeliest first, whose acceptance pays for their rows (extra_cost: a CPU affords few, a TT
        tile up to its rows), within the budget (--n_draft_tokens counts nodes). Nodes are the head's own choices (its top k),
        not samples, under sampling too: the child equal to the target's draw at its position is accepted. Also
        returns the number of drafting runs (after the feed's)."""
        K = self.TREE_TOP_K
        trees = {u: HeadTree() for u in roots}
        frontier = {u: [(-1, roots[u][2])] for u in roots}  # (expanded node, its logits) per user
        runs, depth = 0, 1
        while frontier:
            for u, expanded in frontier.items():
                for parent, logits in expanded:
                    p = torch.softmax(logits.float(), dim=-1)
                    top = p.topk(min(K, p.numel()))
                    for prob, i in zip(top.values.tolist(), top.indices.tolist()):
                        trees[u].add(int(self.vocab[i]), parent, depth, prob, self.acceptance)
            depth += 1
            run = []  # (user, node) of the nodes to expand at this depth: while their children could pay for a run
            for u, tree in trees.items():
                if u in probes:  # a probe verifies one token: its first depth is all it needs
                    continue
                best = tree.best_at(depth - 1, K)
                could_gain = sum(tree.nodes[i].path_prob for i in best)  # the children's path probabilities at most
                if (depth <= wanted[u] and len(tree.nodes) + K * K <= self.head.max_tree_nodes
                        and could_gain > self.draft_cost + extra_cost(1)):
                    run += [(u, i) for i in best]
            if not run:
                break
            nodes = [(u, roots[u][0] + depth - 2, i, trees[u].ancestors(i)) for u, i in run]
            states = torch.cat([roots[u][1] if trees[u].nodes[i].parent < 0 else trees[u].nodes[trees[u].nodes[i].parent].state
                                for u, i in run])
            out, logits = self.head.run_tree(nodes, states, [trees[u].nodes[i].token for u, i in run])
            runs += 1
            frontier = {}
            for j, (u, i) in enumerate(run):
                trees[u].nodes[i].state = out[j : j + 1]
                frontier.setdefault(u, []).append((i, logits[j]))
        drafts = {}
        for u, tree in trees.items():
            chosen = tree.cut((1 + runs) * self.draft_cost, extra_cost, wanted[u], force=u in probes)
            if chosen:
                tokens, parents, probs = tree.draft(chosen)
                self.pending[u] = HeadDraft([tree.nodes[i].confidence for i in chosen], max(
                    tree.nodes[i].depth for i in chosen), tree=(chosen, tree))
                drafts[u] = Draft(tokens, "head", parents=parents, expected=sum(probs))
        return drafts, runs

    def accept(self, user, verified: Verified):
        self.known[user].append(verified.hidden[verified.true_rows].to(self.known[user][0].dtype))
        self._learn(user, verified)


@dataclass
class TreeNode:
    token: int
    parent: int  # node number, -1 for the context's last token
    depth: int
    confidence: float  # the head's probability of the token after its parent
    path_prob: float  # estimated probability that it and its ancestors are all accepted
    state: Optional[torch.Tensor] = None  # the head's state after it, once expanded


class HeadTree:
    """An EAGLE-2 draft tree being grown: nodes in the order they were made (parents first)."""

    MAX_NODES = MAX_TREE_NODES  # verified per user and step, as the suffix drafter's trees

    def __init__(self):
        self.nodes: list[TreeNode] = []

    def add(self, token: int, parent: int, depth: int, confidence: float, acceptance: MatchAcceptance) -> None:
        above = self.nodes[parent].path_prob if parent >= 0 else 1.0
        self.nodes.append(TreeNode(token, parent, depth, confidence, above * acceptance.prob(depth, confidence)))

    def best_at(self, depth: int, k: int) -> list[int]:
        at = [i for i, n in enumerate(self.nodes) if n.depth == depth]
        return sorted(at, key=lambda i: -self.nodes[i].path_prob)[:k]

    def ancestors(self, i: int) -> tuple[int, ...]:
        out = []
        while self.nodes[i].parent >= 0:
            i = self.nodes[i].parent
            out.append(i)
        return tuple(reversed(out))

    def cut(self, draft_cost: float, extra_cost: ExtraCost, max_nodes: int, force: bool) -> list[int]:
        """The nodes to verify, likeliest first (a parent is never less likely than its child, so the set is a tree),
        at most max_nodes (the user's draft budget this step): the count that maximises (1 + sum of path
        probabilities) / (1 + draft_cost + extra_cost(count)); one node for a probe."""
        order = sorted(range(len(self.nodes)), key=lambda i: (-self.nodes[i].path_prob, i))
        order = order[: min(self.MAX_NODES, max_nodes)]
        best, best_value, total = 0, 1.0, 0.0
        for k, i in enumerate(order, 1):
            total += self.nodes[i].path_prob
            value = (1 + total) / (1 + draft_cost + extra_cost(k))
            if value > best_value:
                best, best_value = k, value
        return sorted(order[: max(best, int(force and bool(order)))])

    def draft(self, chosen: list[int]) -> tuple[list[int], list[int], list[float]]:
        """Tokens, parents (indices into the draft, -1 for the root) and path probabilities of the chosen nodes."""
        index = {node: j for j, node in enumerate(chosen)}
        nodes = [self.nodes[i] for i in chosen]
        return ([n.token for n in nodes], [index[n.parent] if n.parent >= 0 else -1 for n in nodes],
                [n.path_prob for n in nodes])
