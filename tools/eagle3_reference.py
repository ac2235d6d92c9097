"""EAGLE-3 draft-head reference numerics from vLLM's `speculators` package, independent of this repo's code.

Runs in its own venv (nothing here imports the repo's `models` package):
  python3.11 -m venv .venv-eagle3
  .venv-eagle3/bin/pip install torch==2.14.1 torchvision==0.29.1 && .venv-eagle3/bin/pip install speculators==0.9.0
  .venv-eagle3/bin/python tools/eagle3_reference.py --head HEAD_DIR --inputs in.pt --out ref.pt [--k 4]
  .venv-eagle3/bin/python tools/eagle3_reference.py --selftest /tmp/e3   # random tiny head, both layouts

HEAD_DIR: a speculators checkpoint (config.json with speculators_model_type "eagle3") or an EAGLE authors'
checkpoint (architectures ["LlamaForCausalLMEagle3"], midlayer.* keys), converted with speculators' own
Eagle3Converter. Single-file model.safetensors or pytorch_model.bin.

in.pt (torch.save of a dict):
  taps    [T, n_aux*h] float: the target's tapped states at positions 0..T-1 (concatenated in tap order)
  tokens  [>= T+1] int64: tokens[i] is the token at position i; head row i reads (taps[i], tokens[i+1]),
          so tokens[T] is the token the target produced after position T-1. Entries past T are ignored.
  embed   [V, h] float: the target's input embedding (used unless the head carries its own embed_tokens)
  draft_tokens [K] int64 (optional): target ids fed to draft steps 1..K instead of the head's own argmax
  k (optional int): K when --k is not given (default: len(draft_tokens), else 3)
ref.pt: logits [K+1, V'] float32 (row 0: last true row T-1, row k: draft step k), draft_ids [K+1] target ids
  (argmax + d2t[argmax]), draft_argmax [K+1] draft-vocab ids, states [K+1, h] (state fed to the next step),
  true_logits [T, V'] (every true row), positions [K+1], fed_tokens [K] (target ids fed to draft steps 1..K).
Positions: true row i sits at rotary position i, draft step k at T-1+k (vLLM's convention; speculators' training
uses the input token's position, i+1: a constant shift that RoPE cancels, so logits agree up to rounding).
Driving: speculators' own modules (fc / input_norm / fc_norm, layers with HF LlamaAttention + its rotary, norm,
lm_head, d2t), with attention "eager" and a transformers DynamicCache: one causal pass over the T true rows,
then one query row per draft step attending to every cached row (the chain; in speculators' training mask this
is the last true row's causal prefix plus its own diagonal entries at earlier steps). --check_forward also runs
speculators' training forward (Eagle3DraftModel.forward) and checks its argmax ids and logits at row T-1.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
from loguru import logger
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from transformers import DynamicCache


logger.remove()  # speculators logs every converted key at DEBUG
logger.add(sys.stderr, level="WARNING")


def _read_weights(folder):
    st = os.path.join(folder, "model.safetensors")
    if os.path.exists(st):
        return load_file(st)
    return torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu")


def convert_authors_layout(folder, vocab_size, out_dir):
    """EAGLE authors' layout -> speculators layout with speculators' Eagle3Converter (midlayer.* -> layers.0.*,
    config -> transformer_layer_config). It wants the verifier's config.json only for vocab_size (when the head
    has no t2d), max_position_embeddings and architectures: a stub is enough."""
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter
    cfg = json.load(open(os.path.join(folder, "config.json")))
    src = os.path.join(out_dir, "authors_fp32")  # the converter casts weights to the config's torch_dtype before
    os.makedirs(src)                             # saving: ask for float32 so the conversion is lossless
    json.dump({**{k: v for k, v in cfg.items() if k != "dtype"}, "torch_dtype": "float32"},
              open(os.path.join(src, "config.json"), "w"))
    for f in ("model.safetensors", "pytorch_model.bin"):
        if os.path.exists(os.path.join(folder, f)):
            os.symlink(os.path.abspath(os.path.join(folder, f)), os.path.join(src, f))
    verifier = os.path.join(out_dir, "verifier_stub")
    os.makedirs(verifier, exist_ok=True)
    json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
               "max_position_embeddings": cfg.get("max_position_embeddings", 4096)},
              open(os.path.join(verifier, "config.json"), "w"))
    key = "eagle_aux_hidden_state_layer_ids"  # the converter reads it only as an argument
    ids = cfg.get(key) or (cfg.get("eagle_config") or {}).get(key)
    converted = os.path.join(out_dir, "converted")
    Eagle3Converter().convert(src, converted, base_model=verifier, validate=False,
                              norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                              eagle_aux_hidden_state_layer_ids=ids)
    return converted


def load_head(folder, embed):
    """Eagle3DraftModel in float32 with the head's weights; embed_tokens from the head if it has one, else `embed`."""
    tmp = None
    if "speculators_model_type" not in json.load(open(os.path.join(folder, "config.json"))):
        tmp = tempfile.mkdtemp(prefix="eagle3_conv_")
        folder = convert_authors_layout(folder, embed.shape[0], tmp)
    config = Eagle3SpeculatorConfig.from_pretrained(folder)  # reads config.json only; no verifier lookup
    weights = {k: v.float() if v.is_floating_point() else v for k, v in _read_weights(folder).items()}
    if tmp:
        shutil.rmtree(tmp)
    config.transformer_layer_config._attn_implementation = "eager"  # dense masks + DynamicCache, CPU-friendly
    model = Eagle3DraftModel(config)  # not from_pretrained: that resolves speculators_config.verifier
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if "embed_tokens.weight" in missing:
        model.embed_tokens.weight.data.copy_(embed.float())
    missing = [k for k in missing  # verifier_* only serve training targets
               if k not in ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")]
    assert not missing and not unexpected, f"missing {missing}, unexpected {unexpected}"
    return model.float().eval()


def to_target(model, draft_ids):
    return draft_ids if model.d2t is None else draft_ids + model.d2t[draft_ids]  # target id = draft id + d2t[draft id]


@torch.no_grad()
def reference(model, taps, tokens, k, draft_tokens=None):
    cfg = model.config
    T = taps.shape[0]
    assert tokens.numel() >= T + 1, "tokens must hold positions 0..T (row i reads tokens[i+1])"
    cache = DynamicCache()

    def layers(x, pos, mask):  # one pass of the decoder stack, exactly as Eagle3DraftModel.forward calls it
        pe = model.rotary_emb(x, pos)
        for layer in model.layers:
            x = layer(x, attention_mask=mask, position_ids=pos, past_key_values=cache, position_embeddings=pe)
        state = model.norm(x) if cfg.norm_output else x  # what the next step is fed (pre-norm unless norm_output)
        return state, model.lm_head(state if cfg.norm_output else model.norm(x))

    h = taps.float()[None]  # [1, T, n_aux*h]
    if model.input_norm is not None:  # norm_before_fc: one RMSNorm over the concatenated taps
        h = model.input_norm(h)
    if model.fc_norm is not None:  # fc_norm: one RMSNorm per tap
        h = torch.cat([n(c) for n, c in zip(model.fc_norm, h.chunk(len(model.fc_norm), -1))], -1)
    h = model.fc(h)  # [1, T, h]
    x = torch.cat([model.embed_tokens(tokens[1:T + 1])[None], h], -1)  # [embed(next token), fc(taps)]: 2h
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    state, logits = layers(x, torch.arange(T)[None], causal)
    true_logits = logits[0]
    out_logits, states, fed = [logits[0, -1]], [state[0, -1]], []
    for step in range(1, k + 1):
        prev = to_target(model, out_logits[-1].argmax()) if draft_tokens is None else draft_tokens[step - 1]
        fed.append(prev)
        x = torch.cat([model.embed_tokens(prev.view(1, 1)), states[-1].view(1, 1, -1)], -1)
        state, logits = layers(x, torch.tensor([[T - 1 + step]]), None)  # one query row: attends to all cached rows
        out_logits.append(logits[0, -1])
        states.append(state[0, -1])
    logits = torch.stack(out_logits)
    argmax = logits.argmax(-1)
    return {"logits": logits, "draft_argmax": argmax, "draft_ids": to_target(model, argmax),
            "states": torch.stack(states), "true_logits": true_logits, "positions": torch.arange(T - 1, T + k),
            "fed_tokens": torch.stack(fed) if fed else torch.zeros(0, dtype=torch.long)}


@torch.no_grad()
def check_forward(model, taps, tokens, ref):
    """speculators' training pass (teacher-forced TTT steps, its own masks and positions 1..): append the chain's
    input tokens after tokens[1..T] so that, at TTT step s, row T-1 reads draft step s's input token."""
    T, k = taps.shape[0], ref["logits"].shape[0] - 1
    ids = torch.cat([tokens[1:T + 1], ref["fed_tokens"]])[None]
    hs = torch.cat([taps.float(), taps.new_zeros(k, taps.shape[1]).float()])[None]
    seen = []  # forward returns only argmax ids; a hook on lm_head records its logits at every TTT step
    hook = model.lm_head.register_forward_hook(lambda mod, i, o: seen.append(o[0, T - 1]))
    try:
        drafts = model(hs, ids, document_ids=torch.zeros_like(ids), ttt_steps=k + 1)
    finally:
        hook.remove()
    fwd = torch.stack([d[0, T - 1] for d in drafts])
    assert torch.equal(fwd, ref["draft_argmax"]), f"forward argmax {fwd.tolist()} != {ref['draft_argmax'].tolist()}"
    diff = (torch.stack(seen) - ref["logits"]).abs().max().item()
    scale = ref["logits"].abs().max().item()
    assert diff <= 1e-4 * scale, f"forward logits differ by {diff} (scale {scale})"
    return diff


def selftest(d):
    """Random tiny head (h 64, 4 heads, 2 KV heads, MLP 128, vocab 1000, draft vocab 300, taps (2, 4, 5) of an
    8-layer target) in the speculators layout and the same weights in the authors' layout: both must agree exactly
    and match speculators' forward(); then each option on its own (speculators layout) against forward()."""
    from transformers import LlamaConfig
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    os.makedirs(d, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    h, V, Vd, T, K = 64, 1000, 300, 7, 4
    tl = dict(vocab_size=V, hidden_size=h, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=2048)
    embed, taps = torch.randn(V, h, generator=g), torch.randn(T, 3 * h, generator=g)
    inputs = {"taps": taps, "tokens": torch.randint(0, V, (T + K,), generator=g), "embed": embed, "k": K}
    torch.save(inputs, os.path.join(d, "inputs.pt"))

    def make_head(folder, **options):
        config = Eagle3SpeculatorConfig(transformer_layer_config=LlamaConfig(**tl), draft_vocab_size=Vd,
            eagle_aux_hidden_state_layer_ids=[2, 4, 5], **options, speculators_config=SpeculatorsConfig(
                algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
                default_proposal_method="greedy",
                verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
        model = Eagle3DraftModel(config)
        for name, p in model.named_parameters():  # weights ~ N(0, 1/fan_in), norms ~ 1 +- 0.2
            r = torch.randn(p.shape, generator=g)
            p.data = 1 + 0.2 * r if p.ndim == 1 else r / p.shape[1] ** 0.5
        model.embed_tokens.weight.data.copy_(embed)
        keep = torch.randperm(V, generator=g)[:Vd].sort().values  # draft vocab: 300 target ids, ascending
        model.d2t.copy_(keep - torch.arange(Vd))
        model.t2d.zero_()
        model.t2d[keep] = True
        model.save_pretrained(os.path.join(d, folder))
        return model

    def run(folder, label):
        m = load_head(os.path.join(d, folder), embed)
        ref = reference(m, taps, inputs["tokens"], K)
        diff = check_forward(m, taps, inputs["tokens"], ref)
        print(f"{label:28s} draft_ids {ref['draft_ids'].tolist()}  vs forward(): max |logits diff| {diff:.2e}")
        return ref

    model = make_head("head_speculators")
    sd = {k: v.contiguous() for k, v in model.state_dict().items() if not k.startswith(("verifier_", "embed_tokens"))}
    os.makedirs(os.path.join(d, "head_authors"), exist_ok=True)  # authors' layout: midlayer.*, no embed_tokens
    save_file({k.replace("layers.0.", "midlayer."): v for k, v in sd.items()},
              os.path.join(d, "head_authors", "model.safetensors"))
    json.dump({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
               "draft_vocab_size": Vd,
               "rope_theta": 10000.0, "torch_dtype": "float32", "tie_word_embeddings": False, **tl},
              open(os.path.join(d, "head_authors", "config.json"), "w"), indent=1)
    a, b = run("head_speculators", "speculators layout"), run("head_authors", "authors' layout (converted)")
    diff = (a["logits"] - b["logits"]).abs().max().item()
    same = torch.equal(a["draft_ids"], b["draft_ids"])
    print(f"speculators vs authors' layout: max |logits diff| {diff}, draft_ids equal {same}")
    assert diff == 0 and same
    for option in ("norm_before_residual", "norm_output", "fc_norm", "norm_before_fc"):
        make_head(f"head_{option}", **{option: True})
        run(f"head_{option}", option)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head"), p.add_argument("--inputs"), p.add_argument("--out"), p.add_argument("--k", type=int)
    p.add_argument("--check_forward", action="store_true", help="also cross-check against Eagle3DraftModel.forward")
    p.add_argument("--selftest", metavar="DIR", help="build a random tiny head in both layouts under DIR and compare")
    a = p.parse_args()
    if a.selftest:
        return selftest(a.selftest)
    inp = torch.load(a.inputs)
    draft_tokens = inp.get("draft_tokens")
    k = a.k if a.k is not None else int(inp.get("k", len(draft_tokens) if draft_tokens is not None else 3))
    model = load_head(a.head, inp["embed"])
    ref = reference(model, inp["taps"], inp["tokens"], k, draft_tokens)
    if a.check_forward:
        print(f"forward() cross-check: max |logits diff| {check_forward(model, inp['taps'], inp['tokens'], ref):.2e}")
    torch.save(ref, a.out)
    print(f"K={k} draft_ids {ref['draft_ids'].tolist()} -> {a.out}")


if __name__ == "__main__":
    main()
