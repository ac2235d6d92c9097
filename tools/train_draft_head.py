# SPDX-License-Identifier: Apache-2.0
"""Train a draft head (draft_head.py) for a target on the target's own greedy responses: `make train-draft-head`.

    python tools/train_draft_head.py --out models/tt_transformers/draft_heads/<name>

1. Prompts the project generates, never the benchmark's (checked: no shared 8-token run): topic x task templates,
   questions the target writes about a topic, summaries and QA of passages the target writes, translations of
   sentences it writes, and word problems with random numbers. A fifth of the topics is held out for evaluation.
2. The target's greedy responses to them (batched, on the CPU kernels where they run; CUDA where present), and its
   final hidden states over prompt + response (one prefill each).
3. The draft vocabulary: the most frequent response tokens (--vocab_size; coverage of held-out responses measured).
4. Training (EAGLE-1/3 recipe): at each position t the head reads [hidden state t ; embedding of token t+1] and is
   trained to predict hidden state t+1 (smooth L1) and token t+2 (cross-entropy over the draft vocabulary), with
   uniform noise on its input states; a second pass feeds the head its own predictions (training-time test), as
   drafting does after the first token. The layer starts from the target's last layer.
5. Evaluation: on held-out topics, chains of --eval_k drafts from every response position (greedy, as verified),
   giving accepted tokens and tokens per target forward. Writes head.safetensors and card.json.
"""
import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from loguru import logger

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a tool over the library, run by its path (make train-draft-head)

from models.tt_transformers.demo.speculative_decoding.speculative_demo import (  # noqa: E402
    DEFAULT_PROMPTS,
    encode,
    load_prompts,
)
from models.tt_transformers.demo.speculative_decoding.speculative_generator import SpeculativeGenerator  # noqa: E402
from models.tt_transformers.torch_backend.checkpoint import (  # noqa: E402
    cache_root,
    load_model,
    load_tokenizer,
    resolve_checkpoint,
)
from models.tt_transformers.torch_backend.draft_head import (  # noqa: E402
    DraftHead,
    HeadRunner,
    build_draft_head,
    head_weights,
    save_draft_head,
)
from models.tt_transformers.torch_backend.generator import TorchCausalLM  # noqa: E402

TOPICS = """volcanoes|the water cycle|personal budgeting|photosynthesis|the Roman Empire|machine learning|coffee brewing
|sleep hygiene|electric cars|the human heart|climate change|chess openings|bread baking|the stock market|honeybees
|the French Revolution|solar panels|marathon training|black holes|vaccines|the printing press|recycling|jazz music
|ancient Egypt|time management|cloud computing|rainforests|the immune system|public speaking|composting|earthquakes
|the Renaissance|cryptocurrency|yoga|the Moon landing|antibiotics|urban gardening|the Internet|ocean tides|meditation
|the Industrial Revolution|3D printing|migratory birds|nutrition labels|the Great Wall of China|wind turbines
|learning a language|dinosaurs|job interviews|the periodic table|video game design|coral reefs|first aid|democracy
|the Silk Road|nuclear energy|houseplants|the speed of light|remote teams|volunteering|glaciers|the Olympic Games
|credit scores|bicycles|the brain|impressionist painting|hurricanes|electric circuits|tea|the Amazon river|robots
|friendship|camping|the Pyramids|gene editing|podcasts|deserts|saving for retirement|cats|the Cold War|snowflakes
|running a small business|DNA|fermentation|lighthouses|social media|the metric system|wolves|space telescopes
|minimalism|pottery|the Eiffel Tower|hydroelectric dams|insomnia|origami|whales|the Vikings|smartphones|compound
interest|mountain climbing|bees and flowers|rain|libraries|trains|gardening tools|the solar system|cheese making""".replace(
    "\n", "").split("|")
TASKS = ["Explain {t} to a beginner in a short paragraph.", "Give three practical tips about {t}.",
         "What are two common misconceptions about {t}?", "Write a short paragraph about the history of {t}.",
         "Write a four-line poem about {t}.", "List five interesting facts about {t}.",
         "How would you explain {t} to a ten-year-old?", "Write a short email to a friend recommending {t}.",
         "What are the advantages and disadvantages of {t}?", "Describe a typical day of someone who works with {t}.",
         "Why does {t} matter today? Answer in a few sentences.", "Write a short dialogue between two people about {t}.",
         "Give a step-by-step guide to getting started with {t}.", "Summarize what most people should know about {t}.",
         "Write a JSON object describing {t} with the keys name, summary and three_facts."]
LANGUAGES = ["French", "Spanish", "German"]
ITEMS = ["apples", "notebooks", "tickets", "pens", "cupcakes", "plants", "books", "candles"]


def generate(target: TorchCausalLM, tokenizer, prompts: list[str], max_tokens: int, batch: int) -> list[list[int]]:
    """Greedy responses, `batch` users at a time (plain decoding on our loop)."""
    eos = [tokenizer.eos_token_id]
    gen = SpeculativeGenerator(target, None, 0, eos)
    out = []
    logger.disable(SpeculativeGenerator.__module__)  # no per-iteration lines
    for i in range(0, len(prompts), batch):
        chunk = [encode(tokenizer, p, True) for p in prompts[i : i + batch]]
        out += [r.output_tokens for r in gen.generate(chunk, max_tokens)]
        if i // batch % 20 == 0:
            logger.info(f"generated {i + len(chunk)}/{len(prompts)}")
    logger.enable(SpeculativeGenerator.__module__)
    return out


def ngrams(tokens: list[int], n: int = 8) -> set:
    return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)}


def build_prompts(target, tokenizer, rng: random.Random, args) -> list[dict]:
    """Every training prompt with its source; stage-one prompts ask the target for questions, passages and
    sentences that stage two builds prompts from."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
    topics = TOPICS[: args.topics]
    prompts = [{"prompt": task.format(t=topic), "source": "topic x task", "topic": topic}
               for topic in topics for task in rng.sample(TASKS, args.tasks_per_topic)]
    stage_one = ([("question", t, f"Write one interesting question about {t}. Reply with the question only.")
                  for t in topics] * 2
                 + [("passage", t, f"Write a paragraph of about 100 words about {t}.") for t in topics]
                 + [("sentence", t, f"Write one simple sentence about {t}.") for t in topics])
    outputs = generate(target, tokenizer, [p for _, _, p in stage_one], args.stage_one_tokens, args.batch)
    for (kind, topic, _), ids in zip(stage_one, outputs):
        text = decode(ids)
        if len(text) < 10:
            continue
        if kind == "question":
            prompts.append({"prompt": text, "source": "model-written question", "topic": topic})
        elif kind == "passage":
            prompts.append({"prompt": f"Summarize the following passage in two sentences:\n\n{text}",
                            "source": "derived summary", "topic": topic})
            prompts.append({"prompt": f"Read the passage and answer the question.\n\n{text}\n\nQuestion: What is "
                                      f"the main idea of this passage, and which detail supports it?",
                            "source": "passage QA", "topic": topic})
        else:
            prompts.append({"prompt": f"Translate into {rng.choice(LANGUAGES)}: {text}", "source": "translation",
                            "topic": topic})
    for i in range(args.word_problems):
        a, b, item = rng.randint(2, 9), rng.randint(3, 12), rng.choice(ITEMS)
        prompts.append({"prompt": f"A shop sells {item} for ${a} each. Sam buys {b} {item} and pays with a "
                                  f"${(a * b // 10 + 1) * 10} bill. How much change does Sam get? Explain step by step.",
                        "source": "word problem", "topic": f"word problem {i % 20}"})
    return prompts


def benchmark_ngrams(tokenizer) -> set:
    files = sorted((REPO / "benchmarks" / "prompt_sets").glob("*.json")) + [DEFAULT_PROMPTS]
    grams = set()
    for f in files:
        for p in load_prompts(str(f)):
            grams |= ngrams(tokenizer(p, add_special_tokens=False).input_ids)
    return grams


def features(target: TorchCausalLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """The target's final hidden states over each whole sequence (bf16)."""
    return [target.prefill(0, seq, hidden=True).hidden[0].to(torch.bfloat16) for seq in sequences]


def head_inputs(hidden, tokens, vocab_index, prompt_len):
    """Inputs and targets at positions t = 0 .. L-3: hidden t, token t+1; predict hidden t+1 and token t+2 (its
    draft-vocabulary index, -100 when outside it or inside the prompt)."""
    tokens = torch.tensor(tokens)
    nxt, target_tokens = tokens[1:-1], tokens[2:]
    labels = vocab_index[target_tokens].clone()
    labels[: max(0, prompt_len - 2)] = -100  # the prompt is context, not what drafts copy
    return hidden[:-2].float(), nxt, hidden[1:-1].float(), labels


def head_forward(head: DraftHead, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Training pass over one whole sequence (causal): the predicted next hidden states [T, dim]."""
    model = head.target
    T = hidden.shape[0]
    cache = model.new_cache(1, 1)
    positions = torch.arange(T).view(1, T)
    step = model.step_inputs(positions=positions, query_pos=positions, rows=torch.zeros(1, 1, dtype=torch.long),
                             kv_len=T, all_rows=True)
    x = head.fc(torch.cat([hidden.unsqueeze(0), model.tok_embeddings(next_tokens.unsqueeze(0)).float()], -1))
    return head.norm(head.block(x, step, cache.k[0], cache.v[0]))[0]


def train(head: DraftHead, data, args) -> dict:
    params = list(head.parameters())  # the target is borrowed, not a submodule
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    total = args.epochs * len(data)
    updates = max(1, total // args.accumulate)  # warm-up, then cosine decay over the optimizer's updates
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / updates))))
    device = head.fc.weight.device
    rows = head.lm_head_rows().float()
    head.train()
    started, step, history = time.time(), 0, []
    for epoch in range(args.epochs):
        random.Random(epoch).shuffle(data)
        for sample in data:
            hidden, nxt, want_hidden, labels = (t.to(device) for t in sample)
            noisy = hidden + (torch.rand_like(hidden) - 0.5) * 2 * args.noise
            predicted = head_forward(head, noisy, nxt)
            loss = F.cross_entropy(predicted @ rows.T, labels, ignore_index=-100)
            loss = loss + args.feature_weight * F.smooth_l1_loss(predicted, want_hidden)
            # training-time test: the head's own predictions as the states of the next position
            second = head_forward(head, torch.cat([hidden[:1], predicted[:-1]]), nxt)
            loss = loss + args.second_weight * F.cross_entropy(second @ rows.T, labels, ignore_index=-100)
            (loss / args.accumulate).backward()
            step += 1
            if step % args.accumulate == 0:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                optimizer.zero_grad()
                schedule.step()
            history.append(loss.item())
            if step % 500 == 0:
                logger.info(f"epoch {epoch} step {step}/{total}: loss {sum(history[-500:]) / 500:.3f} "
                            f"({time.time() - started:.0f} s)")
    head.eval()
    return {"steps": step, "epochs": args.epochs, "final_loss": sum(history[-500:]) / max(1, len(history[-500:])),
            "train_seconds": time.time() - started}


@torch.inference_mode()
def evaluate(head: DraftHead, sequences, hiddens, prompt_lens, k: int, max_positions: int = 40000) -> dict:
    """Greedy chains of up to k drafts from every response position of held-out sequences, as the loop drafts:
    the head is fed the true state at t, then drafts on its own predictions; accepted = drafts equal to the target's
    greedy continuation."""
    runner = HeadRunner(head, 1)
    vocab = head.vocab
    accepted_total = positions = 0
    for seq, hidden, plen in zip(sequences, hiddens, prompt_lens):
        runner.cache = head.target.new_cache(1, 1)  # nothing shared between sequences
        start = max(0, plen - 1)
        if start:
            runner.run([0], [0], [hidden[:start]], [seq[1 : start + 1]])
        for t in range(start, len(seq) - 2):
            pred, logits = runner.run([0], [t], [hidden[t : t + 1]], [[seq[t + 1]]])[0]
            accepted, pos, token = 0, t + 1, int(vocab[logits.argmax()])  # pos: the last token's position
            while token == seq[pos + 1]:
                accepted += 1
                if accepted == k or pos + 2 >= len(seq):
                    break
                pred, logits = runner.run([0], [pos], [pred], [[token]])[0]
                token, pos = int(vocab[logits.argmax()]), pos + 1
            accepted_total += accepted
            positions += 1
            if positions >= max_positions:
                break
        if positions >= max_positions:
            break
    return {"positions": positions, "mean_accepted": accepted_total / max(1, positions),
            "tokens_per_target_forward": 1 + accepted_total / max(1, positions), "chain": k}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: models/tt_transformers/draft_heads/<target "
                    "name>, where the demo looks for the target's head)")
    ap.add_argument("--model", default=None, help="target checkpoint (default: HF_MODEL, else the embedded model)")
    ap.add_argument("--topics", type=int, default=len(TOPICS), help=f"topics used (of {len(TOPICS)})")
    ap.add_argument("--tasks_per_topic", type=int, default=10, help=f"task templates per topic (of {len(TASKS)})")
    ap.add_argument("--stage_one_tokens", type=int, default=120, help="tokens per model-written question/passage")
    ap.add_argument("--word_problems", type=int, default=200)
    ap.add_argument("--max_tokens", type=int, default=192, help="tokens per training response")
    ap.add_argument("--batch", type=int, default=16, help="users per generation step")
    ap.add_argument("--vocab_size", type=int, default=8192)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--accumulate", type=int, default=1, help="sequences per optimizer update")
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--feature_weight", type=float, default=1.0)
    ap.add_argument("--second_weight", type=float, default=0.5)
    ap.add_argument("--eval_k", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reuse_data", action="store_true", help="reuse the prompts and responses an earlier run with the "
                    "same data settings saved under TT_CACHE_PATH (to try training settings without regenerating)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    started = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ckpt = resolve_checkpoint(args.model)
    tokenizer = load_tokenizer(ckpt)
    model = load_model(ckpt, torch.bfloat16, 1024, device)
    target = TorchCausalLM(model, model.args.n_layers, args.batch)

    recipe = {k: getattr(args, k) for k in ("topics", "tasks_per_topic", "stage_one_tokens", "word_problems",
                                            "max_tokens", "batch", "seed")}
    saved = cache_root() / "draft_head_data" / f"{ckpt.name}-{hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]}.json"
    topics = TOPICS[: args.topics]
    if args.reuse_data and saved.is_file():
        data = json.loads(saved.read_text())
        prompts, responses, held_out = data["prompts"], data["responses"], set(data["held_out"])
        logger.info(f"reusing {len(prompts)} prompts and responses from {saved}")
    else:
        prompts = build_prompts(target, tokenizer, rng, args)
        banned = benchmark_ngrams(tokenizer)
        prompts = [p for p in prompts if not ngrams(tokenizer(p["prompt"], add_special_tokens=False).input_ids) & banned]
        held_out = set(rng.sample(topics, max(1, len(topics) // 5)))
        logger.info(f"{len(prompts)} prompts ({len(held_out)} held-out topics); generating responses")
        responses = generate(target, tokenizer, [p["prompt"] for p in prompts], args.max_tokens, args.batch)
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = saved.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"prompts": prompts, "responses": responses, "held_out": sorted(held_out)}))
        os.replace(tmp, saved)


    sequences = [encode(tokenizer, p["prompt"], True) + r for p, r in zip(prompts, responses)]
    prompt_lens = [len(s) - len(r) for s, r in zip(sequences, responses)]
    single = TorchCausalLM(model, model.args.n_layers, 1)
    hiddens = features(single, sequences)
    gen_seconds = time.time() - started
    train_ids = [i for i, p in enumerate(prompts) if p["topic"] not in held_out]
    eval_ids = [i for i, p in enumerate(prompts) if p["topic"] in held_out]

    counts = torch.bincount(torch.tensor([t for i in train_ids for t in responses[i]]), minlength=model.args.vocab_size)
    counts[tokenizer.eos_token_id] += counts.max()  # EOS ends every response: always draftable
    vocab = counts.argsort(descending=True)[: args.vocab_size].sort().values
    held = torch.tensor([t for i in eval_ids for t in responses[i]])
    coverage = float(torch.isin(held, vocab).float().mean())
    vocab_index = torch.full((model.args.vocab_size,), -100, dtype=torch.long)
    vocab_index[vocab] = torch.arange(len(vocab))

    trainer = load_model(ckpt, torch.float32, 1024, device, cpu_kernels=False)  # float32 target parts for training
    head = DraftHead(trainer, vocab).to(device)
    head.block.load_state_dict(trainer.layers[-1].state_dict())  # start from the target's last layer
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, : model.args.dim] = torch.eye(model.args.dim)  # start by passing the state through
        head.norm.weight.copy_(trainer.norm.weight)
    data = [head_inputs(hiddens[i], sequences[i], vocab_index, prompt_lens[i]) for i in train_ids]
    logger.info(f"training on {sum(len(responses[i]) for i in train_ids):,} response tokens, vocab {len(vocab)} "
                f"(held-out coverage {coverage:.1%})")
    trained = train(head, data, args)

    weights = head_weights(head)
    shipped = build_draft_head(weights, model)  # the bf16 head the demo loads, evaluated on the bf16 target's states
    metrics = evaluate(shipped, [sequences[i] for i in eval_ids], [hiddens[i] for i in eval_ids],
                       [prompt_lens[i] for i in eval_ids], args.eval_k)
    by_source = {}
    for p, r in zip(prompts, responses):
        entry = by_source.setdefault(p["source"], {"prompts": 0, "response_tokens": 0})
        entry["prompts"] += 1
        entry["response_tokens"] += len(r)
    card = {
        "target": ckpt.name, "kind": "EAGLE-style draft head: fc(2d->d) + one decoder layer + norm, the target's LM "
        "head restricted to the draft vocabulary",
        "data": {"sources": by_source, "train_response_tokens": sum(len(responses[i]) for i in train_ids),
                 "held_out_topics": sorted(held_out), "held_out_response_tokens": int(held.numel()),
                 "benchmark_prompts_excluded": "no shared 8-token run with benchmarks/prompt_sets or sample_prompts"},
        "draft_vocabulary": {"size": len(vocab), "held_out_coverage": coverage},
        "training": {**trained, **{k: getattr(args, k) for k in ("lr", "accumulate", "noise", "feature_weight",
                                                                 "second_weight", "max_tokens", "seed")},
                     "device": device, "generation_seconds": gen_seconds, "total_seconds": time.time() - started},
        "measured_on_held_out_topics": metrics,
        "command": "make train-draft-head" + (f" ARGS='{' '.join(argv)}'" if argv else ""),
    }
    out = Path(args.out) if args.out else REPO / "models/tt_transformers/draft_heads" / ckpt.name
    save_draft_head(weights, out, card)
    logger.info(f"wrote {out}: {json.dumps(metrics)}")


if __name__ == "__main__":
    main()
