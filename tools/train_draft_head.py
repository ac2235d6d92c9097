# SPDX-License-Identifier: Apache-2.0
"""Train an EAGLE-3 draft head (torch_backend/eagle3_head.py) for a target on its own greedy responses, written in
speculators' layout (vLLM and SGLang load it too): `make train-draft-head`.

    python tools/train_draft_head.py --out models/tt_transformers/draft_heads/<name>

1. Prompts the project generates, never the benchmark's (checked: no shared 8-token run): topic x task templates,
   questions and requests the target writes about a topic, summaries and QA of passages it writes, translations of
   sentences it writes, and word problems with random numbers. A fifth of the topics is held out for evaluation.
2. The target's greedy responses (batched; cached under TT_CACHE_PATH by recipe, greedy so the same every time),
   and its tapped states (the residual stream entering layers 2, N/2 and N-3) over prompt + response.
3. The draft vocabulary: the most frequent response tokens (--vocab_size; coverage of held-out responses measured).
4. Training (EAGLE-3's recipe): cross-entropy for the token after next, at --ttt_levels training-time-test levels
   (level j drafts from level j-1's output, attending as drafting does), in batches of sequences (--batch_tokens),
   with uniform noise on the taps; the layer starts from the target's last layer, the LM head from its rows.
5. Evaluation with the shipped bf16 head as the loop runs it: greedy chains of --eval_k drafts from every response
   position of the held-out topics and of the target's responses to the benchmark prompt sets (--eval_sets); tokens
   per target forward each. Writes config.json, model.safetensors and card.json.
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
from typing import Optional

import torch
import torch.nn.functional as F
from loguru import logger

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a tool over the library, run by its path (make train-draft-head)

from models.tt_transformers.prompts import encode, load_prompts
from models.tt_transformers.speculative.generator import SpeculativeGenerator  # noqa: E402
from models.tt_transformers.checkpoints.cache import cache_root  # noqa: E402
from models.tt_transformers.checkpoints.checkpoint import load_tokenizer, resolve_checkpoint  # noqa: E402
from models.tt_transformers.checkpoints.eagle3_format import HeadConfig, default_taps  # noqa: E402
from models.tt_transformers.checkpoints.model_shape import ModelShape  # noqa: E402
from models.tt_transformers.checkpoints.rope import rope_tables  # noqa: E402
from models.tt_transformers.torch_backend.attention import apply_rope  # noqa: E402
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM  # noqa: E402
from models.tt_transformers.torch_backend.eagle3_head import (  # noqa: E402
    Eagle3Head,
    HeadRunner,
    build_draft_head,
    head_tensors,
    save_draft_head,
)
from models.tt_transformers.torch_backend.load import load_model  # noqa: E402

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
QUESTION_ASKS = ["Write one interesting question about {t}. Reply with the question only.",
                 "Write a question a curious person might ask an assistant about {t}. Reply with the question only.",
                 "Write a request for practical advice related to {t}. Reply with the request only.",
                 "Write a 'why' or 'how' question about {t} that a student might ask. Reply with the question only.",
                 "Write a question comparing two things related to {t}. Reply with the question only.",
                 "Write a short request asking an assistant to suggest ideas involving {t}. Reply with the request only."]
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
    stage_one = ([("question", t, ask.format(t=t)) for t in topics for ask in QUESTION_ASKS[: args.questions_per_topic]]
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
    files = sorted((REPO / "benchmarks" / "prompt_sets").glob("*.json")) + [REPO / "sample_prompts.json"]
    grams = set()
    for f in files:
        for p in load_prompts(str(f)):
            grams |= ngrams(tokenizer(p, add_special_tokens=False).input_ids)
    return grams


def features(target: TorchCausalLM, sequences: list[list[int]], taps: tuple[int, ...]) -> list[torch.Tensor]:
    """The target's tapped states over each whole sequence (bf16)."""
    return [target.prefill(0, seq, taps=taps).hidden[0].to(torch.bfloat16) for seq in sequences]


def head_batches(samples: list[dict], batch_tokens: int, rng: random.Random) -> list[list[dict]]:
    """Sequences grouped by length (little padding), up to batch_tokens padded tokens per batch, in random order."""
    order = sorted(samples, key=lambda x: len(x["tokens"]))
    batches, cur = [], []
    for x in order:
        if cur and (len(cur) + 1) * len(x["tokens"]) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(x)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def pad_batch(batch: list[dict], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Taps [B, T, 3h] at positions 0..T-1, next tokens [B, T] (token p+1 at row p) and labels [B, T] (the draft
    index of token p+2, -100 where there is none: padding, the prompt, outside the draft vocabulary)."""
    T = max(len(x["tokens"]) for x in batch) - 2
    taps = torch.zeros(len(batch), T, batch[0]["taps"].shape[1])
    nxt = torch.zeros(len(batch), T, dtype=torch.long)
    labels = torch.full((len(batch), T), -100, dtype=torch.long)
    for b, x in enumerate(batch):
        n = len(x["tokens"]) - 2
        taps[b, :n] = x["taps"][:n].float()
        nxt[b, :n] = x["tokens"][1 : n + 1]
        labels[b, :n] = x["labels"][:n]
    return taps.to(device), nxt.to(device), labels.to(device)


def ttt_forward(head: Eagle3Head, taps: torch.Tensor, next_tokens: torch.Tensor, levels: int,
                rows: Optional[list[torch.Tensor]] = None) -> list[torch.Tensor]:
    """EAGLE-3's training-time test over whole sequences: level 1 reads the true taps at every position; level j
    reads level j-1's output one position back (a chain drafted from position p - j + 1), and its row at position p
    attends to level 1's keys up to p - j + 1 and to levels 2..j's keys on its own chain, as drafting does. Returns
    each level's logits [B, T, V'] (rows[j]: only at these flat indices of level j, [n_j, V']: the LM head is half
    the work). The layer's arithmetic is the head's own modules (attention weights, norms, MLP); only the attention
    pattern is written out here."""
    layer, a = head.layer, head.args
    B, T, _ = taps.shape
    H, Hk, D = a.n_heads, a.n_kv_heads, a.head_dim
    cos, sin = (t[:T].view(1, T, 1, D) for t in rope_tables(a, T, taps.dtype))
    embeds = layer.input_layernorm(head.embedding(next_tokens).to(taps.dtype))
    pos = torch.arange(T, device=taps.device)
    state, keys, values, out = head.project(taps), [], [], []
    for j in range(1, levels + 1):
        normed = layer.hidden_norm(state)
        residual = normed if layer.norm_before_residual else state
        qkv = layer.attention.wqkv(torch.cat([embeds, normed], dim=-1)).view(B, T, H + 2 * Hk, D)
        qk = apply_rope(qkv[:, :, : H + Hk], cos, sin)
        q = qk[:, :, :H].transpose(1, 2).reshape(B, Hk, H // Hk, T, D)
        keys.append(qk[:, :, H:].transpose(1, 2).unsqueeze(2))  # [B, Hk, 1, T, D]
        values.append(qkv[:, :, H + Hk :].transpose(1, 2).unsqueeze(2))
        scale = D ** -0.5
        scores = [(q @ keys[0].transpose(-1, -2)) * scale]  # level 1's keys: positions <= p - j + 1
        scores[0] = scores[0].masked_fill(pos.view(1, T) > pos.view(T, 1) - j + 1, float("-inf"))
        for l in range(2, j + 1):  # level l's key on this chain: position p - (j - l)
            shifted = torch.roll(keys[l - 1], j - l, dims=3)
            scores.append(((q * shifted).sum(-1, keepdim=True)) * scale)
        weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1).nan_to_num(0.0)
        attn = weights[..., :T] @ values[0]
        for l in range(2, j + 1):
            attn = attn + weights[..., T + l - 2 : T + l - 1] * torch.roll(values[l - 1], j - l, dims=3)
        attn = attn.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)
        h = residual + layer.attention.wo(attn)
        h = h + layer.feed_forward(layer.ffn_norm(h))
        h = head.norm(h) if head.config.norm_output else h
        read = h if rows is None else h.flatten(0, 1)[rows[j - 1]]
        out.append(head.lm_head(read if head.config.norm_output else head.norm(read)))
        state = torch.roll(h, 1, dims=1)  # level j + 1 at position p reads level j's output at p - 1
    return out


def train(head: Eagle3Head, samples: list[dict], args) -> dict:
    """AdamW over batches of sequences (--batch_tokens padded tokens an update): cross-entropy for the token after
    next at each training-time-test level, level j weighted 0.8^(j-1); rows whose chain would start before position
    0 are masked. Runs --updates updates, else --epochs shortened to what --max_minutes allows."""
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    per_epoch = len(head_batches(samples, args.batch_tokens, random.Random(0)))
    # the cosine decay's length: --updates, else the epochs' updates shortened to what --max_minutes allows
    updates = [args.updates or args.epochs * per_epoch]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, s / updates[0]))))
    device = head.fc.weight.device
    head.train()
    started, step, history, epoch = time.time(), 0, [], 0
    while step < updates[0] and (args.updates or epoch < args.epochs):
        epoch += 1
        for batch in head_batches(samples, args.batch_tokens, rng):
            if step >= updates[0]:
                break
            taps, nxt, labels = pad_batch(batch, device)
            noisy = taps + (torch.rand_like(taps) - 0.5) * 2 * args.noise
            level_labels = []
            for j in range(1, args.ttt_levels + 1):
                at = labels.clone()
                at[:, : j - 1] = -100  # chains from before position 0
                level_labels.append(at.flatten())
            rows = [torch.nonzero(at != -100).flatten() for at in level_labels]
            loss = 0.0
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bool(args.bf16)):
                levels = ttt_forward(head, noisy, nxt, args.ttt_levels, rows)
            for j, (logits, at, idx) in enumerate(zip(levels, level_labels, rows)):
                loss = loss + 0.8 ** j * F.cross_entropy(logits.float(), at[idx])
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            history.append(loss.item())
            if step == 20 and not args.updates:  # the schedule ends when the time does
                fit = int(step * 60 * args.max_minutes / (time.time() - started))
                updates[0] = min(updates[0], fit)
                logger.info(f"{per_epoch} updates an epoch; {updates[0]} fit in {args.max_minutes:g} minutes")
            if step % 100 == 0:
                logger.info(f"epoch {epoch} update {step}/{updates[0]}: loss {sum(history[-100:]) / 100:.3f} "
                            f"({time.time() - started:.0f} s)")
    head.eval()
    return {"updates": step, "epochs_run": epoch, "final_loss": sum(history[-100:]) / max(1, len(history[-100:])),
            "train_seconds": time.time() - started}


@torch.inference_mode()
def evaluate(runner: HeadRunner, sequences, taps, prompt_lens, k: int, max_positions: int = 40000) -> dict:
    """Greedy chains of up to k drafts from every response position, as the loop drafts: the head is fed the true
    taps up to t, then drafts on its own states; accepted = drafts equal to the target's greedy continuation."""
    vocab = runner.vocab
    accepted_total = positions = 0
    for seq, states, plen in zip(sequences, taps, prompt_lens):
        start = max(0, plen - 1)
        if start:
            runner.run([0], [0], [states[:start]], [seq[1 : start + 1]])
        for t in range(start, len(seq) - 2):
            out, logits = runner.run([0], [t], [states[t : t + 1]], [[seq[t + 1]]])[0]
            accepted, pos, token = 0, t + 1, int(vocab[logits.argmax()])  # pos: the last token's position
            while token == seq[pos + 1]:
                accepted += 1
                if accepted == k or pos + 2 >= len(seq):
                    break
                out, logits = runner.run([0], [pos], [out], [[token]])[0]
                token, pos = int(vocab[logits.argmax()]), pos + 1
            accepted_total += accepted
            positions += 1
            if positions >= max_positions:
                break
        if positions >= max_positions:
            break
    return {"positions": positions, "mean_accepted": accepted_total / max(1, positions),
            "tokens_per_target_forward": 1 + accepted_total / max(1, positions), "chain": k}


def evaluate_sets(runner: HeadRunner, target: TorchCausalLM, tokenizer, sets: list[str], max_tokens: int, k: int,
                  batch: int) -> dict:
    """evaluate() on the target's greedy responses to each benchmark prompt set (prompts the head never saw)."""
    out = {}
    for name in sets:
        prompts = load_prompts(str(REPO / "benchmarks" / "prompt_sets" / f"{name}.json"))
        responses = generate(target, tokenizer, prompts, max_tokens, batch)
        sequences = [encode(tokenizer, p, True) + r for p, r in zip(prompts, responses)]
        taps = features(TorchCausalLM(target.model, target.n_layers, 1), sequences, runner.taps)
        out[name] = {**evaluate(runner, sequences, taps, [len(s) - len(r) for s, r in zip(sequences, responses)], k),
                     "prompts": len(prompts), "response_tokens": sum(len(r) for r in responses)}
        logger.info(f"{name}: {out[name]['tokens_per_target_forward']:.2f} tokens per target forward (chains of {k})")
    return out


def initial_head(trainer, vocab: torch.Tensor, taps: tuple[int, ...]) -> Eagle3Head:
    """A float32 head whose layer starts from the target's last layer (its q/k/v reading the state's half; the
    embedding's half small), fc passing the last tap through, and the target's final norm and LM-head rows."""
    a = trainer.args
    layer_args = ModelShape(**{**{f: getattr(a, f) for f in ModelShape.__dataclass_fields__}, "n_layers": 1})
    config = HeadConfig("speculators", layer_args, len(vocab), taps, a.dim, False)
    d2t = vocab - torch.arange(len(vocab))
    head = Eagle3Head(config, trainer.tok_embeddings, torch.float32, d2t)
    last = trainer.layers[-1]
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, (len(taps) - 1) * a.dim :] = torch.eye(a.dim)
        wqkv = head.layer.attention.wqkv.weight
        wqkv.normal_(0, 0.02)
        wqkv[:, a.dim :] = last.attention.wqkv.weight
        head.layer.attention.wo.weight.copy_(last.attention.wo.weight)
        head.layer.feed_forward.load_state_dict(last.feed_forward.state_dict())
        head.layer.hidden_norm.weight.copy_(last.attention_norm.weight)
        head.layer.ffn_norm.weight.copy_(last.ffn_norm.weight)
        head.norm.weight.copy_(trainer.norm.weight)
        head.lm_head.weight.copy_(trainer.output.weight[vocab])
    return head


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: models/tt_transformers/draft_heads/<target "
                    "name>, where the demo looks for the target's head)")
    ap.add_argument("--model", default=None, help="target checkpoint (default: HF_MODEL, else the embedded model)")
    ap.add_argument("--topics", type=int, default=len(TOPICS), help=f"topics used (of {len(TOPICS)})")
    ap.add_argument("--tasks_per_topic", type=int, default=len(TASKS), help=f"task templates per topic (of {len(TASKS)})")
    ap.add_argument("--questions_per_topic", type=int, default=len(QUESTION_ASKS),
                    help=f"questions the target writes per topic, each a prompt (of {len(QUESTION_ASKS)})")
    ap.add_argument("--stage_one_tokens", type=int, default=120, help="tokens per model-written question/passage")
    ap.add_argument("--word_problems", type=int, default=200)
    ap.add_argument("--max_tokens", type=int, default=192, help="tokens per training response")
    ap.add_argument("--batch", type=int, default=32, help="users per generation step")
    ap.add_argument("--vocab_size", type=int, default=8192, help="draft vocabulary (most frequent response tokens)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--max_minutes", type=float, default=600, help="stop training after about this long (the number "
                    "of updates is set from the first 20 updates' time; the card records it)")
    ap.add_argument("--updates", type=int, default=0, help="train exactly this many updates (the card's count "
                    "reproduces a head on any machine)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch_tokens", type=int, default=4096, help="padded tokens per update (sequences batched)")
    ap.add_argument("--ttt_levels", type=int, default=3, help="training-time-test levels (draft steps trained)")
    ap.add_argument("--noise", type=float, default=0.05, help="uniform noise on the taps")
    ap.add_argument("--bf16", type=int, default=1, help="1: bf16 autocast for the training passes (float32 weights)")
    ap.add_argument("--eval_k", type=int, default=5)
    ap.add_argument("--eval_sets", default="chat,qa,translation,summarization",
                    help="benchmark prompt sets to measure the head on (benchmarks/prompt_sets; '' for none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data_only", action="store_true", help="stop once the prompts and responses are generated and "
                    "saved under TT_CACHE_PATH (a later run with the same data settings reuses them)")
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

    recipe = {k: getattr(args, k) for k in ("topics", "tasks_per_topic", "questions_per_topic", "stage_one_tokens",
                                            "word_problems", "max_tokens", "batch", "seed")}
    saved = cache_root() / "draft_head_data" / f"{ckpt.name}-{hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]}.json"
    topics = TOPICS[: args.topics]
    if saved.is_file():  # greedy responses: the same recipe gives the same data
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
    if args.data_only:
        logger.info(f"{len(prompts)} prompts and responses saved in {saved}")
        return

    taps = default_taps(model.args.n_layers)
    sequences = [encode(tokenizer, p["prompt"], True) + r for p, r in zip(prompts, responses)]
    prompt_lens = [len(s) - len(r) for s, r in zip(sequences, responses)]
    single = TorchCausalLM(model, model.args.n_layers, 1)
    states = features(single, sequences, taps)
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
    head = initial_head(trainer, vocab, taps).to(device)
    samples = []
    for i in train_ids:
        tokens = torch.tensor(sequences[i])
        labels = vocab_index[tokens[2:]].clone()
        labels[: max(0, prompt_lens[i] - 2)] = -100  # the prompt is context, not what drafts copy
        samples.append({"tokens": tokens, "taps": states[i], "labels": labels})
    logger.info(f"training on {sum(len(responses[i]) for i in train_ids):,} response tokens, taps {list(taps)}, vocab "
                f"{len(vocab)} (held-out coverage {coverage:.1%})")
    trained = train(head, samples, args)

    shipped = build_draft_head(head.config, head_tensors(head), model)  # the bf16 head the demo loads
    runner = HeadRunner(shipped, 1, 1024, model.args)
    metrics = evaluate(runner, [sequences[i] for i in eval_ids], [states[i] for i in eval_ids],
                       [prompt_lens[i] for i in eval_ids], args.eval_k)
    logger.info(f"held-out topics: {metrics['tokens_per_target_forward']:.2f} tokens per target forward")
    sets = [x for x in args.eval_sets.split(",") if x]
    by_set = evaluate_sets(runner, target, tokenizer, sets, args.max_tokens, args.eval_k, args.batch) if sets else {}
    by_source = {}
    for p, r in zip(prompts, responses):
        entry = by_source.setdefault(p["source"], {"prompts": 0, "response_tokens": 0})
        entry["prompts"] += 1
        entry["response_tokens"] += len(r)
    card = {
        "target": ckpt.name, "kind": "EAGLE-3 draft head (speculators layout): fc over 3 taps + one decoder layer "
        "reading [embedding ; state] + norm + draft-vocabulary LM head, d2t to the target's ids",
        "taps": list(taps),
        "data": {"sources": by_source, "train_response_tokens": sum(len(responses[i]) for i in train_ids),
                 "held_out_topics": sorted(held_out), "held_out_response_tokens": int(held.numel()),
                 "benchmark_prompts_excluded": "no shared 8-token run with benchmarks/prompt_sets or sample_prompts"},
        "draft_vocabulary": {"size": len(vocab), "held_out_coverage": coverage},
        "training": {**trained, **{k: getattr(args, k) for k in ("epochs", "max_minutes", "lr", "batch_tokens",
                                                                 "ttt_levels", "noise", "bf16", "max_tokens", "seed")},
                     "device": device, "generation_seconds": gen_seconds, "total_seconds": time.time() - started},
        "measured_on_held_out_topics": metrics,
        "measured_on_benchmark_sets": by_set,
        "command": "make train-draft-head" + (f" ARGS='{' '.join(argv)}'" if argv else ""),
    }
    out = Path(args.out) if args.out else REPO / "models/tt_transformers/draft_heads" / ckpt.name
    save_draft_head(head, out, card)
    logger.info(f"wrote {out}: {json.dumps(metrics)}")


if __name__ == "__main__":
    main()
