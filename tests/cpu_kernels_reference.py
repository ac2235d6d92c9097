# SPDX-License-Identifier: Apache-2.0
"""The arithmetic of cpu_kernels.c written out in numpy float32, operation by operation, so every path's results can
be checked against it bit for bit: the widened paths (AVX-512, AVX2, NEON, portable C) add a pair's even product
then its odd one; AVX512-BF16's vdpbf16ps adds the odd one first (Intel's pseudocode for VDPBF16PS; `odd_first`).
Products of two bf16 values are exact in float32, so "a * b + c" rounds once here as in a fused multiply-add.

Arrays of bf16 are uint16 bit patterns; every float is np.float32 and every operation rounds to float32 as the C
code's does (numpy computes float32 arithmetic in float32).
"""
import numpy as np

F32 = np.float32
NOT_SUBNORMAL = F32(-87.0)  # prefill's p: zero where s - m' is at most this (exp of it is still a normal float)


def widen(bits: np.ndarray) -> np.ndarray:
    """bf16 bit patterns -> float32."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns, round to nearest even, NaN kept NaN (f32_to_bf16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)


def round_bf16(x: np.ndarray) -> np.ndarray:
    return widen(to_bf16(x))


def add_pairs(acc: np.ndarray, even: np.ndarray, odd: np.ndarray, odd_first: bool) -> np.ndarray:
    return (acc + odd) + even if odd_first else (acc + even) + odd


def linear(x_bits: np.ndarray, w_bits: np.ndarray, odd_first: bool) -> np.ndarray:
    """x [M, K] x W [N, K]^T in float32: each output summed over k in order, a pair at a time."""
    x, w = widen(x_bits), widen(w_bits)
    acc = np.zeros((x.shape[0], w.shape[0]), dtype=F32)
    for k in range(0, x.shape[1], 2):
        acc = add_pairs(acc, x[:, k, None] * w[None, :, k], x[:, k + 1, None] * w[None, :, k + 1], odd_first)
    return acc


def tree_sum16(lanes: np.ndarray) -> np.ndarray:
    """v_reduce_add over the last axis of 16 lanes: halves added (i and i + 8, i + 4, i + 2, the last two)."""
    s = lanes
    while s.shape[-1] > 1:
        half = s.shape[-1] // 2
        s = s[..., :half] + s[..., half:]
    return s[..., 0]


def exp_cephes(x: np.ndarray) -> np.ndarray:
    """v_exp: Cephes expf in separate multiplies and adds, 2^k applied as 2^(k/2) 2^(k - k/2)."""
    x = np.maximum(np.minimum(x, F32(88.0)), F32(-88.0))
    k = np.rint(x * F32(1.44269504088896341))
    r = x - k * F32(0.693359375)
    r = r - k * F32(-2.12194440e-4)
    y = np.full_like(x, F32(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * r + F32(c)
    y = y * (r * r) + (r + F32(1.0))
    return ldexp(y, k)


def exp_short(x: np.ndarray) -> np.ndarray:
    """v_exp_short (prefill's p): v_exp's reduction, a degree-4 polynomial, clamped below at NOT_SUBNORMAL (what it
    gives there is zeroed) and not above (x <= 0 there)."""
    x = np.maximum(x, NOT_SUBNORMAL)
    k = np.rint(x * F32(1.44269504088896341))
    r = x - k * F32(0.693359375)
    r = r - k * F32(-2.12194440e-4)
    y = np.full_like(x, F32(4.1666666667e-2))
    for c in (1.6666666667e-1, 0.5, 1.0, 1.0):
        y = y * r + F32(c)
    return ldexp(y, k)


def ldexp(y: np.ndarray, k: np.ndarray) -> np.ndarray:
    """v_ldexp: y * 2^(k/2) * 2^(k - k/2), each factor exact, for whole k in [-127, 127]."""
    ki = k.astype(np.int32)
    k1 = ki >> 1

    def pow2(n):
        return ((n + 127).astype(np.uint32) << 23).view(np.float32)
    return (y * pow2(k1)) * pow2(ki - k1)


def rms_norm(x_bits: np.ndarray, w_bits: np.ndarray, eps: float) -> np.ndarray:
    x = widen(x_bits)
    total = np.zeros(x.shape[0], dtype=F32)
    for i in range(x.shape[1]):
        total = total + x[:, i] * x[:, i]
    inv = F32(1.0) / np.sqrt(total / F32(x.shape[1]) + F32(eps))
    return to_bf16(widen(w_bits) * round_bf16(x * inv[:, None]))


def silu_mul(gate_up_bits: np.ndarray) -> np.ndarray:
    hidden = gate_up_bits.shape[1] // 2
    g, u = widen(gate_up_bits[:, :hidden]), widen(gate_up_bits[:, hidden:])
    silu = g / (F32(1.0) + exp_cephes(F32(0.0) - g))
    return to_bf16(round_bf16(silu) * u)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotary embedding of bf16 values (as float32) -> bf16 bits."""
    half = x.shape[-1] // 2
    other = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return to_bf16(x * cos + other * sin)


def key_dots(q: np.ndarray, keys: np.ndarray, odd_first: bool) -> np.ndarray:
    """q [D] . keys [n, D]: lane l sums elements 32c + 2l and 32c + 2l + 1 over chunks c, then the lanes' tree."""
    lanes = np.zeros((keys.shape[0], 16), dtype=F32)
    for c in range(0, q.shape[0], 32):
        even, odd = slice(c, c + 32, 2), slice(c + 1, c + 32, 2)
        lanes = add_pairs(lanes, keys[:, even] * q[even], keys[:, odd] * q[odd], odd_first)
    return tree_sum16(lanes)


SPLIT, MAX_SPLITS = 1024, 32  # cpu_kernels.c's splits of the cache: positions [SPLIT s, SPLIT (s + 1)), the last open


def split_of(pos: int) -> int:
    return min(pos // SPLIT, MAX_SPLITS - 1)


def split_end(split: int) -> float:
    return (split + 1) * SPLIT if split < MAX_SPLITS - 1 else np.inf


def attend_split(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first: int, lo: int, hi: int, odd_first: bool):
    """The online softmax of one query head over its keys at positions [lo, hi) (one split; key j sits at position
    first + j) -> (running maximum m, 16 lanes of sums, the weighted values acc) (attend_rows): the positions go in
    blocks of 16 aligned at multiples of 16, the keys outside [lo, hi) masked, the weights p rounded to 16 bits."""
    D = q.shape[0]
    scale = F32(1.0) / np.sqrt(F32(D))
    m, sums, acc = F32(-np.inf), np.zeros(16, dtype=F32), np.zeros(D, dtype=F32)
    for b0 in range(lo // 16 * 16, hi, 16):
        a, z = max(lo, b0) - b0, min(hi, b0 + 16) - b0
        scores = np.zeros(16, dtype=F32)
        scores[a:z] = key_dots(q, keys[b0 + a - first : b0 + z - first], odd_first) * scale
        new_max = max(m, scores[a:z].max())
        alpha = exp_cephes(np.array([m - new_max], dtype=F32))[0]  # exactly 1 when the maximum stays
        p = exp_cephes(scores - new_max)
        p[:a], p[z:] = 0, 0
        big = p * F32(257.0)
        p = big - (big - p)  # v_weight16: 16 significant bits, so that p_j v_j is exact
        sums = sums * alpha + p
        acc = acc * alpha
        for j in range(a, z):
            acc = acc + p[j] * values[b0 + j - first]
        m = new_max
    return m, sums, acc


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first: int, odd_first: bool) -> np.ndarray:
    """One query head over its keys and values (bf16 as float32) -> float32 [D] (attend_rows, merge_splits): key j
    sits at position first + j; each split of the positions is its own online softmax (attend_split), and the
    splits' states are merged in order: f = exp(m - the largest m), acc = acc + acc_s f and sums = sums + sums_s f."""
    end = first + len(keys)
    splits = [attend_split(q, keys, values, first, max(first, s * SPLIT), int(min(end, split_end(s))), odd_first)
              for s in range(split_of(first), split_of(end - 1) + 1)]
    top = max(m for m, _, _ in splits)
    sums, acc = np.zeros(16, dtype=F32), np.zeros(q.shape[0], dtype=F32)
    for m, split_sums, split_acc in splits:
        f = exp_cephes(np.array([m - top], dtype=F32))[0]  # exactly 1 when m is the top
        acc, sums = acc + split_acc * f, sums + split_sums * f
    return acc * (F32(1.0) / tree_sum16(sums))


def attention(qkv: np.ndarray, args, table, ancestors, cos_bits, sin_bits, k_cache, v_cache, odd_first) -> np.ndarray:
    """The attention of a packed step (cpu_kernels.c attention_f32) from its projections qkv (bf16 as float32 [n,
    (H + 2 Hk) D]) -> float32 [n, H, D]; writes the step's keys and values into k_cache / v_cache (bf16 bits [users,
    Hk, slots, D], in place). Table rows: (row, slot, pos, first, run_end, ancestor start, ancestor count)."""
    H, Hk, D = args.n_heads, args.n_kv_heads, args.head_dim
    n = qkv.shape[0]
    q_rot = np.zeros((n, H, D), dtype=np.uint16)
    for t, (row, slot, pos, *_) in enumerate(table):
        cos, sin = widen(cos_bits[pos]), widen(sin_bits[pos])
        heads = qkv[t].reshape(H + 2 * Hk, D)
        q_rot[t] = rotate(heads[:H], cos, sin)
        k_cache[row, :, slot] = rotate(heads[H : H + Hk], cos, sin)
        v_cache[row, :, slot] = to_bf16(heads[H + Hk :])
    out = np.zeros((n, H, D), dtype=F32)
    for t, (row, slot, pos, first, run_end, anc_start, anc_count) in enumerate(table):
        slots = list(range(first, run_end)) + list(ancestors[anc_start : anc_start + anc_count])
        for h in range(H):
            kv = h // (H // Hk)
            out[t, h] = attend(widen(q_rot[t, h]), widen(k_cache[row, kv, slots]), widen(v_cache[row, kv, slots]),
                               first, odd_first)
    return out


def decoder_layer(x_bits, args, weights, table, ancestors, cos_bits, sin_bits, k_cache, v_cache, odd_first):
    """One decoder layer of a packed step (cpu_kernels.c decoder_layer) on unpacked bf16 weights: returns the new
    residual stream's bits and writes the step's keys and values into k_cache / v_cache (as attention does).
    weights: attention norm, wqkv, wo, ffn norm, w_gate_up, w_down as [N, K] bits."""
    H, D = args.n_heads, args.head_dim
    attention_norm, wqkv, wo, ffn_norm, w_gate_up, w_down = weights
    n = x_bits.shape[0]
    qkv = widen(to_bf16(linear(rms_norm(x_bits, attention_norm, args.norm_eps), wqkv, odd_first)))
    attn = to_bf16(attention(qkv, args, table, ancestors, cos_bits, sin_bits, k_cache, v_cache, odd_first))
    x = to_bf16(widen(x_bits) + widen(to_bf16(linear(attn.reshape(n, H * D), wo, odd_first))))
    gate_up = to_bf16(linear(rms_norm(x, ffn_norm, args.norm_eps), w_gate_up, odd_first))
    down = to_bf16(linear(silu_mul(gate_up), w_down, odd_first))
    return to_bf16(widen(x) + widen(down))


KEY_BLOCK = 32  # prefill_attention's blocks of key positions


def prefill_attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, first: int, pos: int,
                   odd_first: bool) -> np.ndarray:
    """One query row of a prefill (cpu_kernels.c prefill_attention): q [D] and the user's keys / values [positions, D]
    (bf16 as float32) -> float32 [D]. Blocks of 32 positions aligned at multiples of 32 from the one holding `first`
    to the one holding `pos`, each taken by an online softmax over its visible keys [first, pos]: the scores as pairwise
    dot products in order, p = bf16(exp(s - m')) (0 where s - m' <= -87), the 16 lanes of sums the first 16 keys' p
    then the last 16's, and acc + p . v a key pair at a time."""
    D = q.shape[0]
    scale = F32(1.0) / np.sqrt(F32(D))
    m, sums, acc = F32(-np.inf), np.zeros(16, dtype=F32), np.zeros(D, dtype=F32)
    for k0 in range(first // KEY_BLOCK * KEY_BLOCK, pos + 1, KEY_BLOCK):
        k, v = np.zeros((KEY_BLOCK, D), dtype=F32), np.zeros((KEY_BLOCK, D), dtype=F32)
        n = min(KEY_BLOCK, pos + 1 - k0)  # keys past pos are masked (the kernel's zeros or another query's)
        k[:n], v[:n] = keys[k0 : k0 + n], values[k0 : k0 + n]
        dots = np.zeros(KEY_BLOCK, dtype=F32)
        for c in range(0, D, 2):
            dots = add_pairs(dots, k[:, c] * q[c], k[:, c + 1] * q[c + 1], odd_first)
        s = dots * scale
        visible = (np.arange(k0, k0 + KEY_BLOCK) >= first) & (np.arange(k0, k0 + KEY_BLOCK) <= pos)
        s[~visible] = -np.inf
        new_max = max(m, s.max())
        alpha = F32(1.0) if new_max == m else exp_cephes(np.array([m - new_max], dtype=F32))[0]
        with np.errstate(invalid="ignore"):
            x = s - new_max
            p = round_bf16(exp_short(x))
            p[~(x > NOT_SUBNORMAL)] = 0
        sums = ((sums * alpha) + p[:16]) + p[16:]
        acc = acc * alpha
        for j in range(0, KEY_BLOCK, 2):
            acc = add_pairs(acc, p[j] * v[j], p[j + 1] * v[j + 1], odd_first)
        m = new_max
    return acc * (F32(1.0) / tree_sum16(sums))


def prefill_attention(q_bits: np.ndarray, rows, positions, window: int, k_cache: np.ndarray, v_cache: np.ndarray,
                      odd_first: bool) -> np.ndarray:
    """A prefill's attention: q [B, T, H, D] bf16 bits, rows [B] cache rows, positions [B, T], window (0: none),
    caches [users, Hk, slots, D] bf16 bits -> float32 [B, T, H, D]."""
    B, T, H, D = q_bits.shape
    G = H // k_cache.shape[1]
    out = np.zeros((B, T, H, D), dtype=F32)
    for b in range(B):
        for t in range(T):
            pos = int(positions[b, t])
            first = max(0, pos + 1 - window) if window else 0
            for h in range(H):
                out[b, t, h] = prefill_attend(widen(q_bits[b, t, h]), widen(k_cache[rows[b], h // G]),
                                              widen(v_cache[rows[b], h // G]), first, pos, odd_first)
    return out
