# SPDX-License-Identifier: Apache-2.0
"""Our decoder against Hugging Face transformers (the correctness oracle), in float32 on the same weights, and batched
greedy decoding in bf16 with an EOS."""
import pytest
import torch

from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
from models.tt_transformers.torch_backend.load import load_model
from models.tt_transformers.torch_backend.causal_lm import TorchCausalLM
from models.tt_transformers.speculative.generator import SpeculativeGenerator

from models.tt_transformers.torch_backend import model as model_module

from ..conftest import CPU_KERNELS, needs_cpu_kernels, random_model, save_tiny_hf_checkpoint


def pcc(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1].item()


def our_logits(folder, tokens, max_seq_len=256):
    model = load_model(resolve_checkpoint(str(folder)), torch.float32, max_seq_len)
    return TorchCausalLM(model, model.args.n_layers, 1).forward_logits([tokens], [0], [0])[0]


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
    ("llama", {"rope_parameters": LLAMA3_ROPE}),
    ("mistral", {"sliding_window": 8}),
], ids=["llama-gqa", "llama-tied-mha", "llama3-rope", "mistral-sliding-window"])
def test_logits_match_hf_on_random_checkpoints(tmp_path, model_type, overrides):
    hf = save_tiny_hf_checkpoint(tmp_path, model_type, **overrides)
    tokens = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = our_logits(tmp_path, tokens)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
    assert pcc(ours, ref) > 0.99999


@pytest.mark.parametrize("chunk", [model_module.PREFILL_CHUNK, 16], ids=["one-chunk", "chunks-of-16"])
@pytest.mark.parametrize("model_type,overrides", [("llama", {}), ("mistral", {"sliding_window": 16})],
                         ids=["llama", "mistral-window-16"])
def test_long_prompts_and_decode_steps_match_hf(tmp_path, model_type, overrides, chunk, monkeypatch):
    """A 100-token prompt takes the masked (padded) prefill path, not the packed one of short steps, in one attention
    call or in chunks of 16 queries (each reading only the keys it sees); with Mistral's 16-token window the mask cuts
    every query's past. Then 20 one-token decode steps and a 5-token verification step continue from the cache:
    every position's logits match Hugging Face's on the whole sequence."""
    monkeypatch.setattr(model_module, "PREFILL_CHUNK", chunk)
    hf = save_tiny_hf_checkpoint(tmp_path, model_type, **overrides)
    tokens = torch.randint(0, 128, (125,), generator=torch.Generator().manual_seed(2)).tolist()
    model = load_model(resolve_checkpoint(str(tmp_path)), torch.float32, 256)
    lm = TorchCausalLM(model, model.args.n_layers, 1)
    ours = [lm.forward_logits([tokens[:100]], [0], [0])[0]]
    ours += [lm.forward_logits([[t]], [100 + i], [0])[0] for i, t in enumerate(tokens[100:120])]
    ours.append(lm.forward_logits([tokens[120:]], [120], [0])[0])
    ours = torch.cat(ours)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
    assert pcc(ours, ref) > 0.99999


def test_prefill_attends_in_causal_chunks(monkeypatch):
    """A prefill's attention is one fused call per chunk of PREFILL_CHUNK queries over the keys its queries see, so
    a causal prompt costs about half its T x T scores (one call over every key for every query cost all of them,
    with a mask G times as large), with GQA's heads sharing their K/V."""
    import torch.nn.functional as F

    monkeypatch.setattr(model_module, "PREFILL_CHUNK", 64)
    model = random_model(torch.float32, max_seq_len=320, dim=64, head_dim=32, hidden_dim=96, n_heads=4, n_kv_heads=2)
    calls, sdpa = [], F.scaled_dot_product_attention

    def counting(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.shape[-2], k.shape[-2], tuple(attn_mask.shape), q.shape[1], k.shape[1]))
        return sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    TorchCausalLM(model, model.args.n_layers, 1).prefill(0, [t % 64 for t in range(300)])
    per_layer = [(q, k, (1, 1, q, k), 4, 2) for q, k in ((64, 64), (64, 128), (64, 192), (64, 256), (44, 300))]
    assert calls == per_layer * model.args.n_layers


@needs_cpu_kernels
def test_long_prefill_on_the_kernels_is_deterministic_and_close_to_torch_ops():
    """On the CPU kernels a long prompt's prefill runs the layers' matmuls through torch's oneDNN where it has bf16 dot
    products (else on the kernels) and its attention on the kernels (prefill_attention): its logits are the torch-ops
    model's to bf16 rounding,
    and the same run to run at one thread count (what plain and speculative runs both start from)."""
    from models.tt_transformers.torch_backend.cpu_isa import onednn_bf16_dot_products

    tokens = torch.randint(0, 64, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    torch_ops = random_model(torch.bfloat16, max_seq_len=256, dim=64, head_dim=32, hidden_dim=96)
    kernels = random_model(torch.bfloat16, max_seq_len=256, dim=64, head_dim=32, hidden_dim=96)
    kernels.use_cpu_kernels(CPU_KERNELS)
    assert kernels.layers[0].feed_forward.w_down.onednn == onednn_bf16_dot_products()
    want = TorchCausalLM(torch_ops, 3, 1).forward_logits([tokens], [0], [0])[0].float()
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (threads, 1, threads):
            torch.set_num_threads(n)
            runs.append(TorchCausalLM(kernels, 3, 1).forward_logits([tokens], [0], [0])[0])
    finally:
        torch.set_num_threads(threads)
    # oneDNN's matmuls (AMX, where a Xeon has it) promise the same bits run to run at one thread count, not across
    # thread counts: equal at the same count, close at another
    assert torch.equal(runs[0], runs[2])
    assert pcc(runs[1], runs[0]) > 0.9999
    assert pcc(runs[0], want) > 0.999


def test_sharded_checkpoint_loads(tmp_path):
    hf = save_tiny_hf_checkpoint(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = list(range(10))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (our_logits(tmp_path, tokens) - ref).abs().max().item() < 1e-4


def test_embedded_model_logits_match_hf(embedded_checkpoint, sample_prompt_tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(embedded_checkpoint.folder, dtype=torch.float32).eval()
    tokens = sample_prompt_tokens[1]
    ours = our_logits(embedded_checkpoint.folder, tokens, 512)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    err = (ours - ref).abs().max().item()
    print(f"SmolLM2-135M float32 logits vs HF: max abs error {err:.2e}, PCC {pcc(ours, ref):.8f}")
    assert err < 1e-3 and pcc(ours, ref) > 0.99999


def test_plain_greedy_reproduces_hf_generate(embedded_checkpoint, embedded_tokenizer, sample_prompt_tokens):
    """Our plain greedy decode equals HF generate(do_sample=False), token for token, on every sample prompt."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(embedded_checkpoint.folder, dtype=torch.float32).eval()
    model = load_model(embedded_checkpoint, torch.float32, 512)
    plain = SpeculativeGenerator(TorchCausalLM(model, model.args.n_layers, 1), None, 0, [embedded_tokenizer.eos_token_id])
    for tokens in sample_prompt_tokens:
        ours = plain.generate([tokens], 24)[0].output_tokens
        ref = hf.generate(torch.tensor([tokens]), max_new_tokens=24, do_sample=False,
                          eos_token_id=embedded_tokenizer.eos_token_id)[0, len(tokens):].tolist()
        assert ours == ref


def test_bf16_batched_greedy_with_eos_reproduces_hf_generate(tmp_path):
    """bf16, three users in one batch (Hugging Face left-pads them), an EOS mid-answer for one of them: our plain and
    speculative greedy decoding equal HF generate token for token, stopping at the EOS (kept) as HF does. A random
    checkpoint with peaked distributions, so bf16 rounding differences between the two do not decide ties."""
    from transformers import AutoModelForCausalLM

    from models.tt_transformers.speculative.drafters import SuffixDrafter

    save_tiny_hf_checkpoint(tmp_path, initializer_range=1.0, vocab_size=128)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    pad, n = 0, 24
    prompts = [[5, 9, 17, 5, 9, 17, 5], [3, 4], [100, 7, 7, 7]]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def generate(eos):
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad,
                          eos_token_id=eos)
        rows = [row[width:].tolist() for row in out]
        return [r[: r.index(eos) + 1] if eos in r else r for r in rows]  # HF pads a finished row after its EOS
    eos = hf.generation_config.eos_token_id
    ref = generate(eos)
    if not any(r[-1] == eos and len(r) < n for r in ref):  # this CPU's bf16 sums took another path: an EOS the
        eos = next(t for t in ref[0][n // 2 :] if t != pad)  # first answer reaches halfway
        ref = generate(eos)
    assert any(r[-1] == eos and len(r) < n for r in ref)  # an EOS mid-answer is part of the comparison
    model = load_model(resolve_checkpoint(str(tmp_path)), torch.bfloat16, 128)
    lm = TorchCausalLM(model, model.args.n_layers, 3)
    for drafter, n_draft in ((None, 0), (SuffixDrafter(1), 4)):
        results = SpeculativeGenerator(lm, drafter, n_draft, [eos]).generate(prompts, n)
        assert [r.output_tokens for r in results] == ref
