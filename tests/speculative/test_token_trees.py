# SPDX-License-Identifier: Apache-2.0
"""Token trees: every node verified in one step equals the chain along its path (every CPU kernel path and torch ops), and
greedy and cross-request drafting with trees, recycling and memory stays token-identical to plain decoding."""
import pytest
import torch

from models.tt_transformers.speculative.copy_sources import implementations
from models.tt_transformers.speculative.copy_sources.token_tree import reference_build_tree
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM

from ..conftest import every_cpu_path_and_torch_ops, kernels_of, random_model


TREE = ([79, 32, 38, 46, 26, 43, 11], [-1, 0, 0, 1, 1, 3, 2])  # a root, two branches, depth 3


def paths(parents):
    out = []
    for i in range(len(parents)):
        path = [i] if parents[i] == -1 else out[parents[i]] + [i]
        out.append(path)
    return out


@every_cpu_path_and_torch_ops
@pytest.mark.parametrize("sliding_window", [None, 4])
def test_token_tree_nodes_equal_their_chains(cpu_path, sliding_window):
    """Every node of a token tree verified in one step gets the logits of the chain along its path, bit for bit,
    and after commit_path the cache holds the accepted path where a chain would have put it."""
    model = random_model(torch.bfloat16, max_seq_len=96, std=0.3, dim=64, n_layers=2, head_dim=32, n_kv_heads=2,
                         hidden_dim=96, vocab_size=100, sliding_window=sliding_window)
    if cpu_path:
        model.use_cpu_kernels(kernels_of(cpu_path))
    prompt = [3, 14, 15, 92, 65, 35, 89]
    tokens, parents = TREE

    def fresh():
        lm = TorchCausalLM(model, model.args.n_layers, 1)
        lm.forward_logits([prompt], [0], [0], last_only=True)
        return lm
    lm = fresh()
    tree = lm.forward_logits([tokens], [len(prompt)], [0], parents=[parents])[0]
    for i, path in enumerate(paths(parents)):
        chain = fresh().forward_logits([[tokens[r] for r in path]], [len(prompt)], [0])[0]
        assert torch.equal(tree[i], chain[-1]), path
    accepted = paths(parents)[5]  # 0 -> 1 -> 3 -> 5: rows 1, 3, 5 sit in slots past their positions
    lm.commit_path(0, len(prompt), accepted)
    reference = fresh()
    reference.forward_logits([[tokens[r] for r in accepted]], [len(prompt)], [0])
    after = len(prompt) + len(accepted)
    assert torch.equal(lm.forward_logits([[7]], [after], [0])[0], reference.forward_logits([[7]], [after], [0])[0])
    with pytest.raises(ValueError, match="parents"):
        lm.forward_logits([tokens], [len(prompt)], [0], parents=[[-1, 2, 0, 1, 1, 3, 2]])  # a parent after its child


def test_verify_tree():
    from models.tt_transformers.speculative.verification import verify_tree

    tokens, parents = [5, 6, 7, 8], [-1, -1, 0, 1]  # 5 -> 7 and 6 -> 8
    assert verify_tree(tokens, parents, [6, 0, 8, 0, 9]) == ([6, 8, 9], [1, 3])  # second branch, bonus token
    assert verify_tree(tokens, parents, [5, 4, 0, 0, 0]) == ([5, 4], [0])  # correction after the first node
    assert verify_tree(tokens, parents, [3, 0, 0, 0, 0]) == ([3], [])  # no child matches


def test_memory_store_is_bounded_and_never_matches_across_documents():
    from models.tt_transformers.speculative.copy_sources.draft_memory import TokenStore

    store = TokenStore(max_tokens=100)
    for i in range(30):
        store.add([1000 + i] * 5 + [7, 8, 9])
        assert store.n_tokens <= 100
    assert len(store.docs) < 30 and store.docs[-1][0] == 1029  # the oldest went first
    state, length = store.match(0, [1, 2, 1029, 1029])
    assert length == 2
    tokens = store.sam.continuation(state, length, 20, [1.0] * 9, 0.0)[0]
    # the most frequent continuations (1029 twice, then a tie), then the document's own end: never a separator
    assert tokens[:2] == [1029, 1029] and tokens[-3:] == [7, 8, 9] and set(tokens) == {1029, 7, 8, 9}


def test_recycled_table_keeps_the_actual_texts_rows():
    from models.tt_transformers.speculative.drafters import SuffixDrafter, Verified
    from models.tt_transformers.speculative.sampling import KeyedSampler, SamplingParams

    drafter = SuffixDrafter(recycle=2)
    drafter.start([0], [[1, 2]], KeyedSampler(SamplingParams()))
    # rows: last token 2, drafts 3 (accepted) and 4 (rejected): the rejected row's context never happened
    drafter.accept(0, Verified([3, 9], [0], [2, 3, 4], [[3, 5], [9, 6], [1, 1]]))
    table = drafter.recycled
    assert (len(table), table.get(2), table.get(3), table.get(4)) == (2, [3, 5], [9, 6], None)


def sequence_identical_to_plain(model, prompts, drafter, n_tokens, eos=()):
    """Prompts one after another through one drafter (as a server sees them), each equal to its plain output."""
    from models.tt_transformers.speculative.generator import SpeculativeGenerator

    target = TorchCausalLM(model, model.args.n_layers, 1)
    plain = SpeculativeGenerator(target, None, 0, eos)
    spec = SpeculativeGenerator(target, drafter, 16, eos)
    sources = []
    for p in prompts:
        result = spec.generate([p], n_tokens)[0]
        assert result.output_tokens == plain.generate([p], n_tokens)[0].output_tokens
        sources += [it.draft_source for it in result.iterations]
    return sources


def test_related_requests_draft_from_memory_losslessly(embedded_bf16, embedded_tokenizer):
    """Tool calls with one schema, in sequence: later requests draft from earlier responses (memory), as token
    trees with recycled predictions, and every output equals plain decoding."""
    from models.tt_transformers.prompts import encode, load_prompts
    from models.tt_transformers.speculative.copy_sources.draft_memory import DraftMemory
    from models.tt_transformers.speculative.drafters import SuffixDrafter

    from ..conftest import REPO_ROOT

    prompts = [encode(embedded_tokenizer, p, True)
               for p in load_prompts(str(REPO_ROOT / "benchmarks/prompt_sets/related_requests.json"))[:4]]
    sources = sequence_identical_to_plain(embedded_bf16, prompts, SuffixDrafter(1, DraftMemory(4096), recycle=4), 48,
                                          [embedded_tokenizer.eos_token_id])
    assert "memory" in sources and "tree" in sources


def test_corpus_store_drafts_what_the_request_lacks():
    """A context that matches the corpus but not its own text gets the corpus's continuation."""
    from models.tt_transformers.speculative.draft_length import linear_cost
    from models.tt_transformers.speculative.copy_sources.draft_memory import DraftMemory
    from models.tt_transformers.speculative.drafters import SuffixDrafter
    from models.tt_transformers.speculative.sampling import KeyedSampler, SamplingParams

    drafter = SuffixDrafter(1, DraftMemory(0, corpus=[[40, 41, 42, 43, 44, 45, 46, 47]]))
    drafter.start([0], [[1, 2, 40, 41, 42]], KeyedSampler(SamplingParams()))
    for _ in range(5):  # the corpus store's rate rises as its drafts pass
        draft = drafter.propose([0], [[1, 2, 40, 41, 42]], [4], linear_cost(0.0))[0]
    assert draft.source == "corpus" and draft.tokens[:2] == [43, 44]


@pytest.mark.parametrize("threshold", [1, 3])
def test_copy_mode_re_anchors_after_an_edit(threshold):
    """A rename while copying a passage: after the edit token (no 3-token match any more) the next draft copies the
    passage from just past the replaced token at once; a deletion skips ahead to the edit token's occurrence; after
    a few edits in a row the copy is given up."""
    from models.tt_transformers.speculative.draft_length import linear_cost
    from models.tt_transformers.speculative.drafters import SuffixDrafter
    from models.tt_transformers.speculative.sampling import KeyedSampler, SamplingParams

    passage = list(range(1, 21))
    drafter = SuffixDrafter(threshold)
    drafter.start([0], [passage + [500]], KeyedSampler(SamplingParams()))
    propose = lambda ctx: drafter.propose([0], [ctx], [6], linear_cost(0.01))[0]  # noqa: E731
    base = passage + [500]
    assert propose(base + [1, 2, 3, 4]).tokens[:3] == [5, 6, 7]  # a long match: copied as before
    draft = propose(base + [1, 2, 3, 4, 99])  # 5 replaced by 99: no earlier match of (3, 4, 99)
    assert draft.source == "copy" and draft.tokens[:3] == [6, 7, 8]
    draft = propose(base + [1, 2, 3, 4, 99, 6, 7, 77, 9])  # 8 replaced too: still copying
    assert draft.source == "copy" and draft.tokens[:2] == [10, 11]
    draft = propose(base + [1, 2, 3, 4, 99, 6, 7, 77, 9, 10, 13])  # 11 and 12 deleted: skip to 13's occurrence
    assert draft.tokens[:2] == [14, 15]
    lost = base + [1, 2, 3, 4, 99, 6, 7, 77, 9, 10, 13, 801, 802, 803]  # edits in a row: the copy ends
    assert propose(lost).tokens == []


@pytest.mark.parametrize("cap", [2, 4, 8])
def test_tree_never_exceeds_the_draft_cap(cap):
    """Several copied continuations merged into one tree keep at most `cap` nodes (the cap also carries the room
    left in the KV cache and the row budget), parents first (which nodes: test_capped_tree_keeps_the_most_probable_nodes)."""
    from models.tt_transformers.speculative.draft_length import linear_cost
    from models.tt_transformers.speculative.drafters import SuffixDrafter
    from models.tt_transformers.speculative.sampling import KeyedSampler, SamplingParams

    text = [50, 1, 2, *range(60, 65), 70, 1, 2, *range(80, 85), 71, 1, 2, *range(80, 85), 72, 1, 2, *range(80, 85)]
    drafter = SuffixDrafter(1, recycle=2)
    drafter.start([0], [text], KeyedSampler(SamplingParams()))
    drafter.recycled.observe([2, 60, 80], [[60, 80], [61, 7], [81, 9]])
    draft = drafter.propose([0], [text + [50, 1, 2]], [cap], linear_cost(0.0), trees=True)[0]
    assert 0 < len(draft.tokens) <= cap
    assert all(p < i for i, p in enumerate(draft.parents or [])), draft.parents


@pytest.mark.parametrize("build", [reference_build_tree, implementations().build_tree], ids=["reference", "running"])
def test_sibling_probabilities_never_exceed_their_parents(build):
    """Siblings are exclusive (the target accepts one next token): two sources proposing different next tokens with
    0.6 each must not count 1.2 expected tokens, and every node's children together stay within its probability."""
    candidates = [([5, 6, 7], [0.6, 0.5, 0.4]), ([8, 9], [0.6, 0.54]), ([5, 10], [0.5, 0.45])]
    tokens, parents, probs, origins, offsets = build(1, candidates, None, None, 16, 0.01)
    for parent in range(-1, len(tokens)):
        assert sum(p for p, up in zip(probs, parents) if up == parent) <= (probs[parent] if parent >= 0 else 1) + 1e-9
    prob = dict(zip(tokens, probs))
    assert prob[5] == pytest.approx(0.6) and prob[8] == pytest.approx(0.4)  # what 5 leaves
    assert prob[9] == pytest.approx(0.4 * 0.54 / 0.6)  # 8's descendants scale with it
    assert prob[6] == pytest.approx(0.5) and prob[7] == pytest.approx(0.4)
    assert prob[10] == pytest.approx(0.6 - 0.5)  # below the shared 5: what its sibling 6 leaves
    at = {t: i for i, t in enumerate(tokens)}
    assert (origins[at[10]], offsets[at[10]]) == (2, 1) and (origins[at[9]], offsets[at[9]]) == (1, 1)  # where from


@pytest.mark.parametrize("build", [reference_build_tree, implementations().build_tree], ids=["reference", "running"])
def test_capped_tree_keeps_the_most_probable_nodes(build):
    """A tree cut to n nodes keeps the n most probable nodes of the uncut tree (a child is never more probable than
    its parent, so they form a tree), in order of probability."""
    candidates = [([5, 6, 7, 3], [0.7, 0.5, 0.4, 0.2]), ([8, 9], [0.6, 0.54]), ([5, 10], [0.5, 0.45])]
    tokens, parents, probs, *_ = build(1, candidates, None, None, 16, 0.01)
    full = sorted(zip(probs, tokens), reverse=True)
    for n in range(1, len(tokens) + 1):
        cut_tokens, cut_parents, cut_probs, *_ = build(1, candidates, None, None, n, 0.01)
        assert sorted(cut_probs, reverse=True) == cut_probs == [p for p, _ in full[:n]]
        assert all(p < i for i, p in enumerate(cut_parents))
