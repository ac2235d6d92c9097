# SPDX-License-Identifier: Apache-2.0
"""Drafting with an EAGLE-3 draft head on the target's tapped hidden states (arXiv 2503.01840), in chains or in
EAGLE-2's dynamic trees (arXiv 2406.16858).

The head (torch_backend/draft_head.py) reads, at position t, the residual streams entering the layers it taps at t
and token t+1, and gives the token at t+2 and a state the next draft step reads. The target returns the tapped
states for the rows it verifies (and for the prompt at prefill), so a draft always starts from true states: the
last step's accepted rows are fed first (one run, with everything else the head has not seen), then the head drafts
on its own states, one run per token (per tree depth). Its KV cache (one layer) is rolled back by position as the
target's is. On the torch backend the head (`DraftHeadModel`) runs beside the target; on a TT device it runs on the
device (`ChainDraftHead`, TracedHeadDrafter), where the target leaves the taps.
"""
import time
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence

import torch
from loguru import logger

from .config import MAX_TREE_NODES
from .draft_length import LENGTH_BUCKETS, DraftLengthPolicy, ExtraCost, MatchAcceptance
from .drafters import Draft, Verified
from .sampling import KeyedSampler, SamplingParams, probabilities


class DraftHeadModel(Protocol):
    vocab: torch.Tensor  # [V'] the draft vocabulary: the target's token ids the head can propose
    vocab_size: int  # the target's vocabulary
    taps: tuple[int, ...]  # the target layers whose input the head reads
    draft_cost: float  # estimated cost of one head run, in units of a plain decode step of the target (until measured)
    max_rows: int  # rows one run may carry per user (longer catch-ups go in chunks)
    max_tree_nodes: int  # nodes of one user's draft tree the head can hold (its cache slots past max_seq_len)

    def run(self, users: Sequence[int], start_pos: Sequence[int], hidden: Sequence[torch.Tensor],
            next_tokens: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For each user, rows (tapped states at t, or the head's own state, and token t+1) at t = start_pos,
        start_pos + 1, ...: the head's state after each row [n, h] and the logits over the draft vocabulary after its
        last row [V']. A row's results do not depend on how many rows share the run."""

    def run_tree(self, nodes: Sequence[tuple[int, int, int, tuple[int, ...]]], states: torch.Tensor,
                 tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-tree nodes (user, position, node number, ancestors' node numbers): states [n, h] and logits [n, V']."""


@dataclass
class HeadDraft:
    """A proposed head draft, to learn from its verification."""

    confidences: list[float]  # the head's probability of each drafted token: what its acceptance is learned against
    length: int  # a chain's length, a tree's depth
    tree: Optional[tuple] = None  # (the chosen node numbers, the HeadTree) for a tree


class HeadDrafter:
    """Drafts with a trained head: each token's acceptance is estimated as a learned rate (per draft depth) times the
    head's probability for it (EAGLE-2, arXiv 2406.16858: the draft's confidence predicts acceptance), and the
    chain stops where one more token no longer pays for its head run and its verification. What a head run costs is
    measured as it drafts (RunCost); a user whose recent acceptance does not pay for the runs is not run at all,
    except for a 1-token probe now and then (DraftLengthPolicy.gate).

    States: known[u] holds the target's hidden states the head has not been fed yet, for positions fed_len[u],
    fed_len[u] + 1, ... (from the prefill, then from every verified step's accepted rows, whichever source drafted).
    """

    top_k = 0
    TREE_TOP_K = 4  # children per expanded node and nodes expanded per depth (EAGLE-2's top-k)

    def __init__(self, head: DraftHeadModel):
        self.head, self.cost = head, RunCost(head.draft_cost)
        self.vocab, self.taps = head.vocab, tuple(head.taps)
        # prior: a token with the head's probability c is accepted with probability ~0.9 c at any depth
        self.acceptance = MatchAcceptance(prior=[0.9] * len(LENGTH_BUCKETS))
        self.known: dict[int, list[torch.Tensor]] = {}  # chunks, joined only when the head is fed
        self.fed_len: dict[int, int] = {}
        self.policies: dict[int, DraftLengthPolicy] = {}
        self.pending: dict[int, HeadDraft] = {}
        self.sampler = KeyedSampler(SamplingParams())

    def start(self, users, prompts, sampler, hidden=None):
        self._reset(users, sampler, hidden)
        self.known = {u: [h] for u, h in zip(users, hidden)}
        self.fed_len = {u: 0 for u in users}

    def _reset(self, users, sampler, hidden) -> None:
        """A new request per user: its length policy (learned from the last request's), nothing pending."""
        if hidden is None:
            raise ValueError("a draft head drafts from the target's tapped hidden states: the generator must ask the "
                             "backend for them (Drafter.taps)")
        self.pending = {}
        self.policies = {u: DraftLengthPolicy.learned_from(self.policies.values(), self.draft_cost) for u in users}
        self.sampler = sampler
        # the head's prefill (the prompt's rows) waits for its first proposal: a request it never drafts for costs
        # nothing (on a CPU that is most of them: a long prompt's rows cost a sizeable share of the request)

    @property
    def draft_cost(self) -> float:
        return self.cost.value

    def warm_up(self) -> dict[str, float]:
        return {}  # a head beside the target runs eagerly

    def draft_value(self, user: int, n: int, extra_cost: ExtraCost) -> float:
        """Expected tokens per unit of work of a head draft of up to n tokens, from its recent acceptance: k tokens
        take k + 1 runs (the first feeds the last step's accepted rows, the last finds a token that no longer pays)."""
        return self.policies[user].value(n, extra_cost, self.draft_cost, fixed_cost=self.draft_cost)

    def _rows(self, user: int, context: Sequence[int], end: int) -> tuple[int, torch.Tensor, list[int]]:
        """The head's next rows for positions fed_len .. end - 1: (start, hidden states, next tokens)."""
        start = self.fed_len[user]
        if len(self.known[user]) > 1:  # the verified steps' rows since the head last ran, joined once
            self.known[user] = [torch.cat(self.known[user])]
        return start, self.known[user][0][: end - start], list(context[start + 1 : end + 1])

    def _feed(self, users: list[int], rows: list[tuple[int, torch.Tensor, list[int]]]):
        outs = self.head.run(users, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])
        for u, (start, states, _) in zip(users, rows):
            self.fed_len[u] = start + len(states)
            self.known[u] = [self.known[u][0][len(states):]]
        return outs

    def _catch_up(self, live: list[tuple[int, Sequence[int]]], last_rows: int) -> None:
        """Feed the known states of each user's positions before len(context) - 1, in chunks of the head's row budget,
        except its last `last_rows`..max_rows rows when last_rows > 0 (the caller's first drafting run takes them)."""
        while True:
            behind = [(u, ctx) for u, ctx in live
                      if len(ctx) - 1 - self.fed_len[u] > (self.head.max_rows if last_rows else 0)]
            if not behind:
                return
            ends = [min(len(ctx) - 1, self.fed_len[u] + self.head.max_rows) for u, ctx in behind]
            self._feed([u for u, _ in behind], [self._rows(u, ctx, end) for (u, ctx), end in zip(behind, ends)])

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
        live, probes = [], set()
        for u, ctx, n in zip(users, contexts, max_tokens):
            if n > 0 and len(ctx) > 1:
                pays = self.draft_value(u, n, extra_cost) > 1.0
                if self.policies[u].gate(int(pays), n):
                    live.append((u, ctx))
                    if not pays:
                        probes.add(u)
        start = time.perf_counter()
        self._catch_up(live, 1)
        outs = self._feed([u for u, _ in live], [self._rows(u, ctx, len(ctx) - 1) for u, ctx in live]) if live else []
        roots = {u: (len(ctx) - 1, out[0][-1:], out[1]) for (u, ctx), out in zip(live, outs)}  # position, h, logits
        wanted = dict(zip(users, max_tokens))
        if trees:
            drafts, runs = self._trees(roots, wanted, extra_cost, probes)
        else:
            drafts, runs = self._chains(roots, wanted, extra_cost, probes)
        if live:  # a proposal's head work, per run (catch-up runs of a long gap count in the first)
            self.cost.ran((time.perf_counter() - start) / runs)
            self.cost.proposed_at = time.perf_counter()
        return [drafts.get(u, Draft([], "none")) for u in users]

    def _chains(self, roots: dict, wanted: dict, extra_cost: ExtraCost, probes: set) -> tuple[dict, int]:
        """Each user's chain, extended while one more token pays for its run and verification."""
        state, going, runs = dict(roots), list(roots), 1
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
            k = chain.paying or int(u in probes or chain.path_probs[0] > extra_cost(1))
            if k:
                self.pending[u] = HeadDraft(chain.confidences[:k], k)
                drafts[u] = Draft(chain.tokens[:k], "head", expected=sum(chain.path_probs[:k]))
        return drafts, runs

    def _trees(self, roots: dict, wanted: dict, extra_cost: ExtraCost, probes: set) -> tuple[dict, int]:
        """EAGLE-2's dynamic trees: at each depth (up to the user's draft budget) the TREE_TOP_K likeliest nodes (by
        estimated path acceptance) are run, all users' together, and give TREE_TOP_K children each; then the tree is
        cut to the nodes, likeliest first, whose acceptance pays for their rows (extra_cost: a CPU affords few, a TT
        tile up to its rows), within the budget (--n_draft_tokens counts nodes). Nodes are the head's own choices (its top k),
        not samples, under sampling too: the child equal to the target's draw at its position is accepted."""
        K = self.TREE_TOP_K
        trees = {u: HeadTree() for u in roots}
        frontier = {u: [(-1, roots[u][2])] for u in roots}  # (expanded node, its logits) per user
        runs, depth = 1, 1
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
            chosen = tree.cut(runs * self.draft_cost, extra_cost, wanted[u], force=u in probes)
            if chosen:
                tokens, parents, probs = tree.draft(chosen)
                self.pending[u] = HeadDraft([tree.nodes[i].confidence for i in chosen], max(
                    tree.nodes[i].depth for i in chosen), tree=(chosen, tree))
                drafts[u] = Draft(tokens, "head", parents=parents, expected=sum(probs))
        return drafts, runs

    def accept(self, user, verified: Verified):
        self.known[user].append(verified.hidden[verified.true_rows].to(self.known[user][0].dtype))
        self._learn(user, verified)

    def _learn(self, user, verified: Verified) -> None:
        """What the verification says of the user's last head draft: acceptance per depth and confidence, and the
        length policy."""
        self.cost.verified()
        pending = self.pending.pop(user, None)
        if pending is None:
            return
        if pending.tree is None:
            for j in range(min(pending.length, verified.n_accepted + 1)):
                self.acceptance.observe(j + 1, pending.confidences[j], j < verified.n_accepted)
        else:  # the accepted path's nodes passed; the tried children of its last node failed
            chosen, tree = pending.tree
            on_path = [chosen[i] for i in verified.path]
            last = on_path[-1] if on_path else -1
            for i in on_path:
                self.acceptance.observe(tree.nodes[i].depth, tree.nodes[i].confidence, True)
            for i in chosen:
                if tree.nodes[i].parent == last:
                    self.acceptance.observe(tree.nodes[i].depth, tree.nodes[i].confidence, False)
        self.policies[user].update(pending.length, verified.n_accepted)


@dataclass
class HeadFeed:
    """Rows a traced head is fed before it drafts, at positions start_pos onward, each with the token after it: a
    verified step's true rows where the device left their tapped states (tile_rows, DeviceRows), or a prompt's states
    from the prefill (states [n, len(taps) * dim])."""

    user: int
    start_pos: int
    next_tokens: list[int]
    tile_rows: Optional[list[int]] = None
    states: Optional[torch.Tensor] = None


class ChainDraftHead(Protocol):
    vocab: torch.Tensor  # [V'] the draft vocabulary as target ids
    vocab_size: int
    taps: tuple[int, ...]
    draft_cost: float  # one chain step, in target steps (an estimate until measured)
    chain_len: int  # tokens one drafting replay gives (fixed per trace)
    last_draft_s: float  # seconds of the last replay of draft() (the prompt's feed-only replays before it excluded)

    def warm_up(self) -> float:
        """Plan its traces beside the target's (captured with them by the target's prepare_traces); seconds spent."""

    def draft(self, feeds: Sequence[HeadFeed], chain_users: Sequence[int], k: int
              ) -> dict[int, tuple[list[int], list[float]]]:
        """Feed every row of `feeds`, then draft k tokens (1 or chain_len) for each of chain_users from its last fed
        row: {user: (target ids, the head's probability of each)}."""


class TracedHeadDrafter(HeadDrafter):
    """A head that runs where its target keeps the taps (a TT device: ttnn_backend/draft_head.py). The target's step
    leaves them on the device, so every verified step's true rows are fed at the next proposal, whoever drafted them
    (the next step rewrites the tap tile), and one traced replay drafts a chain of chain_len tokens for every user
    that drafts. The chain is then cut where one more token no longer pays for its verification (the replay is
    spent), with acceptance learned and gated as HeadDrafter's. Under sampling the chain is the head's argmax (q over
    the draft vocabulary stays on the device), accepted where it equals the target's draws."""

    def __init__(self, head: ChainDraftHead):
        super().__init__(head)
        self.feeds: dict[int, HeadFeed] = {}
        self.prompt_states: dict[int, torch.Tensor] = {}

    def start(self, users, prompts, sampler, hidden=None):
        self._reset(users, sampler, hidden)
        self.feeds = {}
        self.prompt_states = dict(zip(users, hidden))  # fed at the first proposal, when the token after it is known

    def propose(self, users, contexts, max_tokens, extra_cost, trees=False):
        feeds = []
        for u, ctx in zip(users, contexts):
            if u in self.prompt_states:
                states = self.prompt_states.pop(u)
                feeds.append(HeadFeed(u, 0, list(ctx[1 : len(states) + 1]), states=states))
            elif u in self.feeds:
                feeds.append(self.feeds.pop(u))
        wanted, probes, fed = {}, set(), {f.user for f in feeds}
        for u, n in zip(users, max_tokens):
            n = min(n, self.head.chain_len)
            if n > 0 and u in fed:
                pays = self.draft_value(u, n, extra_cost) > 1.0
                if self.policies[u].gate(int(pays), n):
                    wanted[u] = n
                    if not pays:
                        probes.add(u)
        if not feeds:
            return [Draft([], "none") for _ in users]
        k = self.head.chain_len if wanted else 1
        chains = self.head.draft(feeds, list(wanted), k)
        if wanted:  # a chain step's share of the drafting replay (a prompt's feed-only replays are the prefill's)
            self.cost.ran(self.head.last_draft_s / k)
            self.cost.proposed_at = time.perf_counter()
        drafts = {}
        for u, n in wanted.items():
            chain = HeadChain()
            for token, p in zip(*(values[:n] for values in chains[u])):
                chain.extend(token, p, self.acceptance, 0.0, extra_cost)
            k = chain.paying or int(u in probes)
            if k:
                self.pending[u] = HeadDraft(chain.confidences[:k], k)
                drafts[u] = Draft(chain.tokens[:k], "head", expected=sum(chain.path_probs[:k]))
        return [drafts.get(u, Draft([], "none")) for u in users]

    def warm_up(self) -> dict[str, float]:
        return {"compile_decode": self.head.warm_up()}  # its traces, made with the target's

    def accept(self, user, verified: Verified):
        rows = verified.hidden  # DeviceRows: where the step left the user's tapped states
        true = verified.true_rows
        self.feeds[user] = HeadFeed(user, rows.start_pos, list(verified.new_tokens[: len(true)]),
                                    tile_rows=[rows.first_row + r for r in true])
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


@dataclass
class HeadChain:
    """A head draft being built: its tokens, and how many of them pay for their runs and verification (the value
    (1 + sum of path probabilities) / (1 + (k + 1) draft_cost + extra_cost(k)) grows with each paying token)."""

    tokens: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    path_probs: list[float] = field(default_factory=list)
    paying: int = 0
    value: float = 1.0

    def extend(self, token: int, confidence: float, acceptance: MatchAcceptance, draft_cost: float,
               extra_cost: ExtraCost) -> None:
        k = len(self.tokens) + 1
        path = (self.path_probs[-1] if self.path_probs else 1.0) * acceptance.prob(k, confidence)
        value = (1 + sum(self.path_probs) + path) / (1 + (k + 1) * draft_cost + extra_cost(k))
        self.tokens.append(token)
        self.confidences.append(confidence)
        self.path_probs.append(path)
        if value > self.value and self.paying == k - 1:
            self.paying, self.value = k, value


class RunCost:
    """What one head run costs, in target steps, measured on this machine: decayed means of a run's seconds and of a
    target step's (from the end of a proposal to its verification). Until both are measured, the estimate from the
    weights each streams, which is low on a CPU (a run's op launches do not shrink with its weights). measure=False
    keeps the estimate (drafts that do not depend on timing, for tests)."""

    decay = 0.9
    WARN_AFTER = 8  # verified proposals before a head slower than the target's step is reported (once)

    def __init__(self, estimate: float, measure: bool = True):
        self.estimate, self.measure, self.run_s, self.step_s = estimate, measure, None, None
        self.verifications = 0
        self.proposed_at: Optional[float] = None

    @property
    def value(self) -> float:
        if not self.measure or self.run_s is None or self.step_s is None:
            return self.estimate
        return self.run_s / self.step_s

    def ran(self, seconds: float) -> None:
        self.run_s = seconds if self.run_s is None else self.decay * self.run_s + (1 - self.decay) * seconds

    def verified(self) -> None:
        """The target verified the last proposal (the first call after it times the step)."""
        if self.proposed_at is not None:
            seconds, self.proposed_at = time.perf_counter() - self.proposed_at, None
            self.step_s = seconds if self.step_s is None else self.decay * self.step_s + (1 - self.decay) * seconds
            self.verifications += 1
            if self.measure and self.verifications == self.WARN_AFTER and self.value > 1.0:
                logger.warning(f"Draft head: a run takes {1e3 * self.run_s:.1f} ms, {self.value:.1f}x the target's step "
                               f"({1e3 * self.step_s:.1f} ms): its drafts rarely pay here (it drafts only when its "
                               "acceptance covers that)")
