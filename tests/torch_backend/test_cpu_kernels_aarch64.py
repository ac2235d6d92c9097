# SPDX-License-Identifier: Apache-2.0
"""The aarch64 NEON build of the CPU kernels, compiled with Debian's cross compiler and run under qemu-user (through
tests/cpu_kernels_driver.c): bit for bit the Python reference's arithmetic, row-invariant, and identical to the widened
x86-64 paths. `make test` installs gcc-aarch64-linux-gnu and qemu-user with apt-get where it can
(tests/aarch64/setup.sh); elsewhere these are skipped with that reason."""
import os
import shutil
import struct
import subprocess

import numpy as np
import pytest
import torch

from models.tt_transformers.torch_backend.cpu_kernels import SOURCE, CpuKernels, StepTable

from .. import cpu_kernels_reference as reference
from ..conftest import CPU_PATHS, REPO_ROOT, kernels_of
from .test_cpu_kernels import CHAINS, LONG, TREE, VERIFY, WINDOWED, bits, layer_case, step_qkv
from .test_prefill_attention import prefill_inputs, prefill_reference

CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
pytestmark = pytest.mark.skipif(not (shutil.which(CC) and shutil.which(QEMU)), reason=(
    f"needs {CC} and {QEMU} (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user; make test does this where it can)"))
LINEAR, LAYER, ARGMAX, ATTENTION, PREFILL = 0, 1, 2, 3, 4


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    """The NEON kernels and the driver, linked statically for qemu-aarch64."""
    out = tmp_path_factory.mktemp("aarch64") / "cpu_kernels_driver"
    subprocess.run([CC, "-O3", "-ffp-contract=off", "-fopenmp", "-static", "-DTT_ISA_NEON", str(SOURCE),
                    str(REPO_ROOT / "tests" / "cpu_kernels_driver.c"), "-o", str(out), "-lm"], check=True,
                   capture_output=True)
    return out


def run(driver, call: int, scalars: list[int], buffers: list[np.ndarray]) -> list[np.ndarray]:
    """One kernel call on the NEON build under qemu (2 OpenMP threads); every buffer as it is after the call."""
    data = struct.pack(f"<qq{len(scalars)}qq", call, len(scalars), *scalars, len(buffers))
    for b in buffers:
        data += struct.pack("<q", b.nbytes) + np.ascontiguousarray(b).tobytes()
    out = subprocess.run([QEMU, str(driver)], input=data, capture_output=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout
    results, at = [], 0
    for b in buffers:
        results.append(np.frombuffer(out[at : at + b.nbytes], dtype=b.dtype).reshape(b.shape))
        at += b.nbytes
    return results


def linear(driver, x: torch.Tensor, w: torch.Tensor, out_f32=True) -> np.ndarray:
    m, (n, k) = x.shape[0], w.shape
    y = np.zeros((m, n), dtype=np.float32 if out_f32 else np.uint16)
    return run(driver, LINEAR, [m, k, n, int(out_f32)], [bits(x), bits(CpuKernels.pack_weight(w)), y])[2]


@pytest.mark.parametrize("n_out,n_in", [(96, 160), (50, 64), (200, 576)])
def test_neon_linear_is_the_reference_and_row_invariant(driver, n_out, n_in):
    torch.manual_seed(0)
    w, x = torch.randn(n_out, n_in, dtype=torch.bfloat16), torch.randn(9, n_in, dtype=torch.bfloat16)
    full = linear(driver, x, w)
    assert np.array_equal(full, reference.linear(bits(x), bits(w), odd_first=False))
    for m in (1, 2, 5):
        assert np.array_equal(linear(driver, x[:m], w), full[:m]), m
    assert np.array_equal(linear(driver, x, w, out_f32=False), reference.to_bf16(full))


@pytest.mark.parametrize("head_dim,n_heads,n_kv_heads,tokens", [
    (64, 3, 1, CHAINS), (96, 6, 1, TREE), (128, 2, 1, WINDOWED), (64, 6, 2, VERIFY)],
    ids=["chains-d64", "tree-d96", "window-d128", "verify-d64"])
def test_neon_decoder_layer_is_the_reference(driver, head_dim, n_heads, n_kv_heads, tokens):
    model, table, x, (k_cache, v_cache) = layer_case(head_dim, n_heads, n_kv_heads, tokens)
    args, layer = model.args, model.layers[0]
    linears = (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w_gate_up, layer.feed_forward.w_down)
    weights = [bits(layer.attention_norm.weight.data), *[bits(CpuKernels.pack_weight(m.weight.data)) for m in linears[:2]],
               bits(layer.ffn_norm.weight.data), *[bits(CpuKernels.pack_weight(m.weight.data)) for m in linears[2:]]]
    eps_bits = int(np.float32(args.norm_eps).view(np.uint32))
    got_x, *_, got_k, got_v = run(driver, LAYER, [
        len(tokens), args.dim, args.hidden_dim, args.n_heads, args.n_kv_heads, args.head_dim, eps_bits,
        k_cache.shape[2], 2], [bits(x[0]), *weights, table.tensor.numpy(), table.ancestors.numpy(),
                                               bits(model.rope_cos), bits(model.rope_sin), bits(k_cache), bits(v_cache)])
    want_k, want_v = bits(k_cache).copy(), bits(v_cache).copy()
    unpacked = [bits(t.data) for t in (layer.attention_norm.weight, linears[0].weight, linears[1].weight,
                                       layer.ffn_norm.weight, linears[2].weight, linears[3].weight)]
    want = reference.decoder_layer(bits(x[0]), args, unpacked, table.tensor.numpy(), table.ancestors.numpy(),
                                   bits(model.rope_cos), bits(model.rope_sin), want_k, want_v, odd_first=False)
    assert np.array_equal(got_x, want)
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)


@pytest.mark.parametrize("head_dim,n_heads,n_kv_heads,tokens", [(96, 6, 1, TREE), (64, 6, 2, VERIFY), (64, 6, 2, LONG)],
                         ids=["tree-d96", "verify-d64", "splits-d64"])
def test_neon_attention_is_the_reference(driver, head_dim, n_heads, n_kv_heads, tokens):
    """The attention in float32 (each user's rows in one pass over each split of its cache, the splits merged) equals
    the reference bit for bit."""
    model, table, _, (k_cache, v_cache) = layer_case(head_dim, n_heads, n_kv_heads, tokens)
    qkv, n = step_qkv(model, len(tokens)), len(tokens)
    *_, got_k, got_v, got = run(driver, ATTENTION, [n, n_heads, n_kv_heads, head_dim, k_cache.shape[2], 2], [
        bits(qkv), table.tensor.numpy(), table.ancestors.numpy(), bits(model.rope_cos), bits(model.rope_sin),
        bits(k_cache), bits(v_cache), np.zeros((n, n_heads, head_dim), dtype=np.float32)])
    want_k, want_v = bits(k_cache).copy(), bits(v_cache).copy()
    want = reference.attention(reference.widen(bits(qkv)), model.args, table.tensor.numpy(), table.ancestors.numpy(),
                               bits(model.rope_cos), bits(model.rope_sin), want_k, want_v, odd_first=False)
    assert np.array_equal(got, want)
    assert np.array_equal(got_k, want_k) and np.array_equal(got_v, want_v)


@pytest.mark.parametrize("case", ["causal", "ragged", "window"])
def test_neon_prefill_attention_is_the_reference(driver, case):
    """A prefill's attention in float32 (test_prefill_attention.py's cases, a group of 3 heads, the queries
    contiguous) equals the reference bit for bit."""
    q, (k_cache, v_cache), table = prefill_inputs(case, 64, 6, 2)
    (B, T), (H, D), (Hk, slots) = table.positions.shape, q.shape[2:], k_cache.shape[1:3]
    got = run(driver, PREFILL, [H * D, B, T, H, Hk, D, table.window, table.kv_len, slots, 2], [
        bits(q), table.rows.numpy(), table.positions.numpy(), bits(k_cache), bits(v_cache),
        np.zeros((B, T, H, D), dtype=np.float32)])[-1]
    assert np.array_equal(got, prefill_reference(case, 64, 6, 2, False))


def test_neon_argmax_topk_as_torch(driver):
    torch.manual_seed(0)
    logits = torch.randn(4, 1000).round(decimals=1)
    logits[1, [5, 900, 999]] = 50.0
    logits[2] = 1.0
    logits[3, 17] = float("nan")
    ids, top = run(driver, ARGMAX, [4, 1000, 4], [logits.numpy(), np.zeros(4, np.int64), np.zeros((4, 4), np.int64)])[1:]
    assert ids[:3].tolist() == logits[:3].argmax(dim=-1).tolist() and ids[3] == -1
    for r in range(3):
        assert top[r].tolist() == sorted(range(1000), key=lambda i: (-logits[r, i].item(), i))[:4]


@pytest.mark.skipif(not [p for p in CPU_PATHS if p != "avx512bf16"], reason="no widened x86-64 path here")
def test_neon_equals_the_widened_x86_paths(driver):
    """At the embedded model's LM head shape the NEON build's float32 logits equal this machine's widened path's."""
    widened = kernels_of(next(p for p in CPU_PATHS if p != "avx512bf16"))
    torch.manual_seed(4)
    w, x = torch.randn(49152, 576, dtype=torch.bfloat16), torch.randn(3, 576, dtype=torch.bfloat16)
    assert np.array_equal(linear(driver, x, w), widened.linear(x, widened.pack_weight(w), 49152, torch.float32).numpy())
