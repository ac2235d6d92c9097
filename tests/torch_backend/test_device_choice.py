# SPDX-License-Identifier: Apache-2.0
"""--device auto picks the faster torch device for the model at hand and says why; --device cuda without CUDA is a
clear error."""
import pytest
import torch

from models.tt_transformers.torch_backend.device import choose_device, estimated_ms_per_token
from models.tt_transformers.checkpoints.model_shape import ModelShape

SMOLLM2_135M = ModelShape(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, hidden_dim=1536,
                         vocab_size=49152, norm_eps=1e-5, rope_theta=1e5, rope_scaling=None, tie_word_embeddings=True,
                         sliding_window=None, max_position_embeddings=8192, model_type="llama")
LLAMA_3_1_8B = ModelShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, hidden_dim=14336,
                         vocab_size=128256, norm_eps=1e-5, rope_theta=5e5, rope_scaling=None,
                         tie_word_embeddings=False, sliding_window=None, max_position_embeddings=131072,
                         model_type="llama")


def test_auto_keeps_the_small_model_on_the_cpu_kernels_and_puts_8b_on_cuda():
    small = choose_device("auto", SMOLLM2_135M, torch.bfloat16, cpu_kernels=True, cuda_available=True)
    assert small.device == "cpu" and "launch-bound" in small.reason
    big = choose_device("auto", LLAMA_3_1_8B, torch.bfloat16, cpu_kernels=True, cuda_available=True)
    assert big.device == "cuda"
    # Without the kernels (torch ops) even the small model is faster on CUDA.
    assert choose_device("auto", SMOLLM2_135M, torch.bfloat16, cpu_kernels=False, cuda_available=True).device == "cuda"


def test_estimates_follow_the_measured_figures():
    """SmolLM2 measured 10.7 ms/token on the kernels, 28.6 on torch ops (2-core CPU) and 27 on an H100."""
    assert 9 < estimated_ms_per_token("cpu", SMOLLM2_135M, torch.bfloat16, True) < 13
    assert 24 < estimated_ms_per_token("cpu", SMOLLM2_135M, torch.bfloat16, False) < 33
    assert 24 < estimated_ms_per_token("cuda", SMOLLM2_135M, torch.bfloat16, True) < 30
    assert 25 < estimated_ms_per_token("cuda", LLAMA_3_1_8B, torch.bfloat16, True) < 40


def test_explicit_choices_and_errors():
    assert choose_device("auto", LLAMA_3_1_8B, torch.bfloat16, True, cuda_available=False).device == "cpu"
    assert choose_device("cpu", LLAMA_3_1_8B, torch.bfloat16, True, cuda_available=True).device == "cpu"
    with pytest.raises(ValueError, match="--device cuda: .* sees no CUDA device here; use --device cpu"):
        choose_device("cuda", SMOLLM2_135M, torch.bfloat16, True, cuda_available=False)
    with pytest.raises(ValueError, match="--device 'tpu' is not one of auto, cpu, cuda"):
        choose_device("tpu", SMOLLM2_135M, torch.bfloat16, True, cuda_available=False)


