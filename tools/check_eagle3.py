# SPDX-License-Identifier: Apache-2.0
"""Our EAGLE-3 head's draft logits against vLLM's `speculators` (an independent implementation): `make check-eagle3`.

    .venv/bin/python tools/check_eagle3.py --reference_python .venv-eagle3/bin/python

For random heads in both layouts (speculators' and the EAGLE authors'), with and without speculators' norm options
(norm_before_residual in both; norm_output, fc_norm and norm_before_fc, which only speculators has, in its layout),
for the embedded model's shape (its real embedding and real tapped states of a real prompt) and a small
Llama-3.1-8B-shaped target (32 layers, 4:1 grouped-query attention, Llama-3 rope scaling, a draft vocabulary with
d2t): our HeadRunner is fed T true rows and then drafts a chain of K steps on its own states and argmax tokens; the
same inputs and drafted tokens go to tools/eagle3_reference.py, which drives speculators' own modules in its own venv
(speculators pins torch 2.14.1 and transformers <= 5.19). Compared: the logits after the last true row and after each
draft step, in float32 (our head in float32) and as shipped (our head in bf16, on the CPU kernels where the target
runs on them, fed the same drafted tokens), and whether the bf16 head's greedy drafts are the reference's. Writes a JSON report (--out) and exits non-zero if a case is outside the stated tolerance.
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # a tool over the library, run by its path

from models.tt_transformers.checkpoints.checkpoint import load_tokenizer, resolve_checkpoint  # noqa: E402
from models.tt_transformers.torch_backend.load import load_model  # noqa: E402
from models.tt_transformers.checkpoints.eagle3_format import HeadConfig, default_taps, random_head, write_head  # noqa: E402
from models.tt_transformers.torch_backend.eagle3_head import HeadRunner, load_draft_head  # noqa: E402
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM  # noqa: E402
from models.tt_transformers.torch_backend.model import Transformer  # noqa: E402
from models.tt_transformers.checkpoints.model_shape import ModelShape  # noqa: E402

# float32 against float32: the same arithmetic in another order. bf16 (weights and activations rounded to 8 bits of
# mantissa) against float32: a few percent of the logits' spread, and the same greedy draft.
F32_TOL = 1e-4  # max |ours - speculators'| / max |speculators' logits|
BF16_TOL = 5e-2
K = 4  # draft steps after the last true row


def llama8b_shaped() -> ModelShape:
    return ModelShape(dim=256, n_layers=32, n_heads=8, n_kv_heads=2, head_dim=32, hidden_dim=512, vocab_size=4096,
                     norm_eps=1e-5, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                     tie_word_embeddings=False, sliding_window=None, max_position_embeddings=131072,
                     model_type="llama")


def our_chain(head_folder: Path, target: Transformer, taps: torch.Tensor, tokens: list[int],
              drafted: Optional[list[int]] = None) -> tuple:
    """Our head over T true rows then K draft steps on its own states and argmax (or fed `drafted`, so two runs
    compare the same chain): logits [K + 1, V'] (float32) and the drafted target ids [K + 1]."""
    head = load_draft_head(head_folder, target)
    runner = HeadRunner(head, 1, 256, target.args)
    T = taps.shape[0]
    out, logits = runner.run([0], [0], [taps], [tokens[1 : T + 1]])[0]
    state, rows, ids = out[-1:], [logits], [int(head.vocab[logits.argmax()])]
    for k in range(K):
        fed = drafted[k] if drafted is not None else ids[-1]
        state, logits = runner.run([0], [T - 1 + k + 1], [state], [[fed]])[0]
        rows.append(logits)
        ids.append(int(head.vocab[logits.argmax()]))
    return torch.stack(rows).float(), ids


def reference_chain(python: str, head_folder: Path, taps, tokens, embed, drafted, work: Path) -> torch.Tensor:
    inputs, out = work / "in.pt", work / "ref.pt"
    torch.save({"taps": taps.float(), "tokens": torch.tensor(tokens), "embed": embed.float(),
                "draft_tokens": torch.tensor(drafted[:K]), "k": K}, inputs)
    subprocess.run([python, str(REPO / "tools" / "eagle3_reference.py"), "--head", str(head_folder), "--inputs",
                    str(inputs), "--out", str(out)], check=True)
    return torch.load(out)["logits"].float()


def cases():
    """(name, target model in float32, the same in bf16 as the demo runs it, taps, tokens, random heads: (config,
    tensors) at the scale of a trained layer)."""
    ckpt = resolve_checkpoint(None)
    model = load_model(ckpt, torch.bfloat16, 256)
    prompt = load_tokenizer(ckpt)("The water cycle moves water between the oceans, the air and the land.").input_ids
    args = model.args
    taps = TorchCausalLM(model, args.n_layers, 1).prefill(0, prompt, taps=default_taps(args.n_layers)).hidden[0]
    f32 = load_model(ckpt, torch.float32, 256, cpu_kernels=False, n_layers=0)
    yield ("SmolLM2-135M (real taps)", f32, model, taps[:-1].float(), prompt,
           [random_head(args, 0, draft_vocab=8192)])
    small = llama8b_shaped()
    torch.manual_seed(0)
    f32 = Transformer(small, torch.float32, 256)
    with torch.no_grad():
        f32.tok_embeddings.weight.normal_(0, 1)
    bf16 = Transformer(small, torch.bfloat16, 256)
    bf16.tok_embeddings.weight.data = f32.tok_embeddings.weight.data.to(torch.bfloat16)
    taps = torch.randn(14, 3 * small.dim)
    tokens = torch.randint(0, small.vocab_size, (15,), generator=torch.Generator().manual_seed(1)).tolist()
    yield ("Llama-3.1-8B-shaped (32 layers, 256 wide)", f32, bf16, taps, tokens,
           [random_head(small, 0, draft_vocab=1024), random_head(small, 1, draft_vocab=1024,
                                                                 options={"norm_before_residual": True}),
            random_head(small, 2, draft_vocab=1024, options={"norm_output": True, "fc_norm": True}),
            random_head(small, 3, options={"norm_before_fc": True})])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference_python", default=str(REPO / ".venv-eagle3" / "bin" / "python"))
    ap.add_argument("--out", default=None, help="JSON report")
    args = ap.parse_args(argv)
    report, failed = [], False
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name, f32, bf16, taps, tokens, heads in cases():
            for config, tensors in heads:
                # the authors' layout has no fc/output norm options (speculators' converter drops them)
                plain = not (config.norm_output or config.fc_norm or config.norm_before_fc)
                for layout in ("speculators", "eagle") if plain else ("speculators",):
                    folder = work / f"head-{layout}"
                    write_head(folder, config, tensors, layout)
                    ours, drafted = our_chain(folder, f32, taps, tokens)
                    shipped, _ = our_chain(folder, bf16, taps.to(torch.bfloat16), tokens, drafted)
                    ref = reference_chain(args.reference_python, folder, taps, tokens, f32.tok_embeddings.weight.data,
                                          drafted, work)
                    scale = float(ref.abs().max())
                    f32_err = float((ours - ref).abs().max()) / scale
                    bf16_err = float((shipped - ref).abs().max()) / scale
                    same_argmax = bool(torch.equal(shipped.argmax(-1), ref.argmax(-1)))
                    options = [o for o in HeadConfig.OPTIONS if getattr(config, o)] or ["no options"]
                    ok = f32_err <= F32_TOL and bf16_err <= BF16_TOL
                    failed |= not ok
                    report.append({"target": name, "layout": layout, "options": options,
                                   "draft_vocab": config.draft_vocab_size, "steps": K + 1,
                                   "float32_max_rel_error": f32_err, "bf16_max_rel_error": bf16_err,
                                   "bf16_same_greedy_drafts": same_argmax, "ok": ok})
                    print(f"{'ok ' if ok else 'BAD'} {name:42s} {layout:11s} {'+'.join(options):28s} float32 "
                          f"{f32_err:.1e}  bf16 {bf16_err:.1e}{'' if same_argmax else '  (a bf16 draft differs)'}")
    print(f"{len(report)} cases, tolerance float32 {F32_TOL:g} and bf16 {BF16_TOL:g} of the largest |logit| "
          f"(speculators' float32), over the last true row and {K} draft steps: "
          f"{'all within' if not failed else 'FAILURES'}")
    if args.out:
        Path(args.out).write_text(json.dumps({"cases": report, "f32_tol": F32_TOL, "bf16_tol": BF16_TOL}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
