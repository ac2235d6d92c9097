# SPDX-License-Identifier: Apache-2.0
"""Loading streams a checkpoint layer by layer: peak resident memory while loading stays within 1.3x of the bf16
weights (a real Llama-3.1-8B folder is 16 GB of bf16 shards; reading them all before converting took ~2.5x).

Measured in a fresh subprocess: its peak RSS (VmHWM, reset through /proc/self/clear_refs right before the load)
minus its RSS before the load, over the weight bytes, on a sharded random checkpoint of ~300 MB in real
Hugging Face layout (config.json, model-0000x-of-0000y.safetensors, model.safetensors.index.json).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..conftest import CPU_KERNELS, REPO_ROOT, save_tiny_hf_checkpoint

LIMIT = 1.3
SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8)
SHARD_BYTES = 100 * 2**20

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux /proc")


def write_sharded_checkpoint(folder: Path, tie_word_embeddings: bool) -> int:
    """A random bf16 Llama checkpoint in shards of ~100 MB; returns its weight bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    config = LlamaConfig(**SHAPE, tie_word_embeddings=tie_word_embeddings, dtype="bfloat16")
    folder.mkdir()
    (folder / "config.json").write_text(config.to_json_string())
    d, h, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"] * 64
    shapes = {"model.embed_tokens.weight": (SHAPE["vocab_size"], d), "model.norm.weight": (d,)}
    if not tie_word_embeddings:
        shapes["lm_head.weight"] = (SHAPE["vocab_size"], d)
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (kv, d),
                       p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, d),
                       p + "mlp.gate_proj.weight": (h, d), p + "mlp.up_proj.weight": (h, d),
                       p + "mlp.down_proj.weight": (d, h), p + "input_layernorm.weight": (d,),
                       p + "post_attention_layernorm.weight": (d,)})
    gen = torch.Generator().manual_seed(0)
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        current[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += current[name].numel() * 2
        if size >= SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
    shards += [current] if current else []
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                     "weight_map": weight_map}))
    return total


MEASURE = """
import json, re, sys, torch
from loguru import logger
logger.remove()
from models.tt_transformers.checkpoints.cache import cache_root
from models.tt_transformers.checkpoints.checkpoint import resolve_checkpoint
from models.tt_transformers.torch_backend.load import load_model
from models.tt_transformers.torch_backend.cpu_kernels import load_cpu_kernels
load_cpu_kernels(cache_root() / "kernels")  # built or loaded before the measurement
# A tiny model first: the runtime's one-time set-up (thread pools, allocator arenas, ~75 MB) is not loading.
load_model(resolve_checkpoint(sys.argv[3]), torch.bfloat16, 64, cpu_kernels=sys.argv[2] == "1")
def kib(key):
    return int(re.search(key + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))
before = kib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
model = load_model(resolve_checkpoint(sys.argv[1]), torch.bfloat16, 64, cpu_kernels=sys.argv[2] == "1")
print(json.dumps({"peak": (kib("VmHWM") - before) * 1024, "after": (kib("VmRSS") - before) * 1024,
                  "kernels": model.kernels is not None}))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    save_tiny_hf_checkpoint(root / "tiny")
    return root / "tiny", {tied: (root / f"tied-{tied}", write_sharded_checkpoint(root / f"tied-{tied}", tied))
                           for tied in (False, True)}


@pytest.mark.parametrize("tied,cpu_kernels", [(False, True), (False, False), (True, True)],
                         ids=["untied-kernels", "untied-torch-ops", "tied-kernels"])
def test_peak_memory_while_loading_stays_within_1_3x_of_the_weights(checkpoints, tied, cpu_kernels):
    tiny, by_tie = checkpoints
    folder, weight_bytes = by_tie[tied]
    assert len(list(folder.glob("*.safetensors"))) >= 3  # really sharded
    out = subprocess.run([sys.executable, "-c", MEASURE, str(folder), str(int(cpu_kernels)), str(tiny)], cwd=REPO_ROOT,
                         capture_output=True, text=True, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    if cpu_kernels and CPU_KERNELS is not None:  # the "kernels" cases ran on the kernels where this machine has them
        assert measured["kernels"], "the model loaded without its CPU kernels"
    assert cpu_kernels or not measured["kernels"]
    peak, after = measured["peak"] / weight_bytes, measured["after"] / weight_bytes
    print(f"{folder.name}, kernels {measured['kernels']}: {weight_bytes / 2**20:.0f} MiB of bf16 weights, peak "
          f"{peak:.2f}x while loading, {after:.2f}x once loaded")
    assert peak <= LIMIT, f"peak resident memory while loading was {peak:.2f}x the weights"
