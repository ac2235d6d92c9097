# SPDX-License-Identifier: Apache-2.0
"""bf16 CPU kernels (cpu_kernels.c) for the steps that decide decode speed: linear layers and the attention of
packed decode/verification steps; and for a prompt's prefill, its attention (flash-style: torch's CPU flash attention
converts bf16 to float32 on CPUs without AMX), rotary, cache writes, norms and SwiGLU.

They run where torch's own ops fall short on a small CPU: oneDNN streams bf16 weights at about half the
memory bandwidth for a few rows (and needs AVX-512; without it torch's bf16 matmul of several rows converts to
float32 first), and attention in a verification step takes one SDPA call per token. The kernels stream the weights
once per step at close to bandwidth, attend every token of a step in one call (a user's rows in one pass over its KV
cache, so a step of 1 + K rows reads the cache once), and keep each output's accumulation order independent of how
many tokens share a step, so verification stays bit-exact.

Built with the system C compiler (`CC`, default `cc`) on first use, for the path cpu_isa.py picks (AVX512-BF16,
AVX-512, AVX2, NEON or portable C: every CPU has one), and cached under TT_CACHE_PATH. Without a compiler, or with
TT_CPU_KERNELS=0, the model runs on torch ops.
"""
import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

import torch
from loguru import logger

from ..native_build import build_library
from .cpu_isa import BY_NAME, CpuPath, this_process_path

SOURCE = Path(__file__).with_name("cpu_kernels.c")
BLOCK = 16  # output rows per packed weight block (cpu_kernels.c)


def head_dim_fits(head_dim: int) -> bool:
    """Whether the kernels' attention takes this head_dim (a multiple of 32 up to 256)."""
    return head_dim % 32 == 0 and head_dim <= 256


def kernels_fit(args, dtype: torch.dtype) -> bool:
    """Whether the kernels handle a model of this shape and dtype (bf16; head_dim_fits)."""
    return (dtype == torch.bfloat16 and args.dim % 2 == 0 and args.hidden_dim % 16 == 0
            and head_dim_fits(args.head_dim))


def packed_shape(n_out: int, k: int) -> tuple[int, int, int, int]:
    """Shape of an [n_out, k] weight packed for the kernels: blocks of 16 rows x k pairs x 16 x 2."""
    return (-(-n_out // BLOCK), k // 2, BLOCK, 2)


@dataclass(frozen=True)
class StepTable:
    """Each token's cache row, slot, position, first key, end of its run of keys and its ancestors' slots
    (attention.ExactToken) as the kernel reads them ([n, 7] and a flat list), checked once when it is made: the
    kernels index the cache with these numbers directly, so a bad one must never reach them."""

    tensor: torch.Tensor
    ancestors: torch.Tensor
    rows_needed: int  # largest row + 1: the cache must have at least this many rows
    slots_needed: int  # largest slot written or read + 1

    @classmethod
    def of(cls, tokens) -> "StepTable":
        entries, ancestors = [], []
        for t in tokens:
            if min(t.row, t.slot, t.pos, t.first, *t.ancestors) < 0 or not t.first <= t.run_end:
                raise IndexError(f"bad kernel step entry {t}: rows, slots and positions must be >= 0 and the first "
                                 "key at most the end of its run")
            entries.append((t.row, t.slot, t.pos, t.first, t.run_end, len(ancestors), len(t.ancestors)))
            ancestors.extend(t.ancestors)
        slots = max(max(t.slot, t.run_end - 1, *t.ancestors) for t in tokens) + 1
        return cls(torch.tensor(entries, dtype=torch.int64).view(-1, 7), torch.tensor(ancestors or [0], dtype=torch.int64),
                   1 + max(t.row for t in tokens), max(slots, 1 + max(t.pos for t in tokens)))


@dataclass(frozen=True)
class PrefillTable:
    """A prefill's tokens as prefill_rotate and prefill_attention read them: each batch entry's cache row [B], each
    token's cache slot (its rotary position) and the position it attends from [B, T] (int64), the sliding window (0:
    none), kv_len (the largest position attended from + 1) and slots_needed (the largest slot + 1), checked once a
    step: the kernels index the cache with them directly."""

    rows: torch.Tensor
    positions: torch.Tensor
    window: int
    kv_len: int
    slots: Optional[torch.Tensor] = None
    slots_needed: int = 0

    @classmethod
    def of(cls, rows: torch.Tensor, positions: torch.Tensor, window: Optional[int],
           slots: Optional[torch.Tensor] = None) -> "PrefillTable":
        rows = rows.to(device="cpu", dtype=torch.int64).contiguous().view(-1)
        positions = positions.to(device="cpu", dtype=torch.int64).contiguous()
        slots = positions if slots is None else slots.to(device="cpu", dtype=torch.int64).contiguous()
        if (positions.dim() != 2 or rows.shape[0] != positions.shape[0] or slots.shape != positions.shape
                or min(rows.min(), positions.min(), slots.min()) < 0):
            raise IndexError(f"bad kernel prefill: rows {tuple(rows.shape)}, positions {tuple(positions.shape)} and "
                             f"slots {tuple(slots.shape)} must be [B], [B, T] and [B, T], all >= 0")
        return cls(rows, positions, window or 0, int(positions.max()) + 1, slots, int(slots.max()) + 1)


class CpuKernels:
    """The loaded library. Every call checks what the C code would otherwise trust (shapes, dtypes, devices,
    contiguity, cache bounds) and raises one clear error; tensor addresses are taken at the call, never stored, and
    the scratch memory is one buffer that grows to the largest step seen."""

    def __init__(self, lib: ctypes.CDLL, path: CpuPath):
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.linear_bf16.argtypes = [ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ptr]
        lib.linear_workspace_floats.argtypes = [i64, i64]
        lib.linear_workspace_floats.restype = i64
        lib.decoder_layer.argtypes = ([ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float] + [ptr] * 12 +
                                      [i64, ptr, ctypes.c_int])
        lib.decoder_layer_workspace_bytes.argtypes = [i64] * 6 + [ctypes.c_int]
        lib.decoder_layer_workspace_bytes.restype = i64
        lib.argmax_topk_f32.argtypes = [ptr, i64, i64, ctypes.c_int, ptr, ptr]
        lib.prefill_attention.argtypes = [ptr] + [i64] * 6 + [ptr, ptr] + [i64] * 2 + [ptr, ptr, i64, ptr,
                                                                                   ctypes.c_int, ptr, ctypes.c_int]
        lib.prefill_attention_workspace_bytes.argtypes = [i64] * 5 + [ctypes.c_int]
        lib.prefill_attention_workspace_bytes.restype = i64
        lib.rms_norm_bf16.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float]
        lib.prefill_rotate.argtypes = [ptr] + [i64] * 5 + [ptr] * 6 + [i64, ptr, ctypes.c_int]
        lib.silu_mul_bf16.argtypes = [ptr, ptr, i64, i64]
        lib.attention_f32.argtypes = [ptr, i64, i64, i64, i64] + [ptr] * 6 + [i64, ptr, ptr, ctypes.c_int]
        lib.attention_workspace_bytes.argtypes = [i64, i64, i64, ctypes.c_int]
        lib.attention_workspace_bytes.restype = i64
        self.lib, self.path = lib, path
        self.workspace = torch.empty(0, dtype=torch.uint8)

    def __deepcopy__(self, memo):
        return self  # the loaded library is shared, like a module

    @staticmethod
    def pack_weight(weight: torch.Tensor) -> torch.Tensor:
        """[N, K] bf16 -> blocks of 16 output rows with k pairs interleaved (the layout of cpu_kernels.c)."""
        packed = torch.empty(packed_shape(*weight.shape), dtype=torch.bfloat16)
        CpuKernels.pack_rows_into(packed, 0, weight.detach())
        return packed

    @staticmethod
    def pack_rows_into(packed: torch.Tensor, row0: int, rows: torch.Tensor) -> None:
        """Pack rows [row0, row0 + len(rows)) of a weight into `packed`, so a checkpoint can be packed a chunk at a
        time as it is read. row0 must start a block; a chunk that ends inside a block must be the weight's last."""
        n, k = rows.shape
        if rows.dtype != torch.bfloat16 or rows.device.type != "cpu" or k % 2 or row0 % BLOCK:
            raise ValueError(f"the CPU kernels pack bf16 CPU weights with an even K from a 16-row boundary, got "
                             f"{rows.dtype} on {rows.device}, K={k}, first row {row0}")
        if n % BLOCK:
            if row0 + n != packed.shape[0] * BLOCK - (BLOCK - n % BLOCK):
                raise ValueError(f"rows {row0}-{row0 + n} end inside a 16-row block before the weight's end")
            rows = torch.cat([rows, rows.new_zeros(BLOCK - n % BLOCK, k)])
        b0 = row0 // BLOCK
        packed[b0 : b0 + rows.shape[0] // BLOCK] = rows.view(-1, BLOCK, k // 2, 2).permute(0, 2, 1, 3)

    @staticmethod
    def unpack_weight(packed: torch.Tensor, n_out: int) -> torch.Tensor:
        """The [n_out, K] matrix of a packed weight, as one strided copy (a gather of its rows, packed_rows, took
        about 5 times as long: 1.9 ms for the embedded model's wqkv on one core)."""
        return packed.permute(0, 2, 1, 3).reshape(-1, packed.shape[1] * 2)[:n_out]

    @staticmethod
    def packed_rows(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows of the unpacked [N, K] matrix (an embedding lookup in a tied LM head's packed weight)."""
        picked = packed[rows // BLOCK, :, rows % BLOCK, :]  # [*rows.shape, K / 2, 2]
        return picked.reshape(*rows.shape, -1)

    @staticmethod
    def _check(name: str, t: torch.Tensor, shape: Optional[tuple] = None) -> None:
        if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"CPU kernels: {name} must be a contiguous bf16 CPU tensor, got {t.dtype} on {t.device}"
                             f"{'' if t.is_contiguous() else ' (not contiguous)'}; a model on the kernels cannot be "
                             "moved or cast, load it again instead")
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"CPU kernels: {name} has shape {tuple(t.shape)}, expected {shape}")

    @classmethod
    def _check_caches_and_rotary(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, cos: torch.Tensor,
                                 sin: torch.Tensor) -> None:
        """K and V caches [users, Hk, slots, D] alike and whole rotary tables [positions, D], as the kernels that
        rotate and write a step's keys read them."""
        users, Hk, slots, D = k_cache.shape
        for name, t, shape in (("k cache", k_cache, (users, Hk, slots, D)), ("v cache", v_cache, (users, Hk, slots, D)),
                               ("rotary cos", cos, (cos.shape[0], D)), ("rotary sin", sin, (cos.shape[0], D))):
            cls._check(name, t, shape)

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n_out: int, out_dtype: torch.dtype) -> torch.Tensor:
        """x [..., K] bf16 -> [..., n_out] in out_dtype (bf16 or float32)."""
        x = x.contiguous()
        k = x.shape[-1]
        self._check("linear input", x)
        self._check("packed weight", packed, packed_shape(n_out, k))
        y = torch.empty(*x.shape[:-1], n_out, dtype=out_dtype)
        rows = x.numel() // k
        workspace = self._workspace(4 * self.lib.linear_workspace_floats(rows, k))
        self.lib.linear_bf16(x.data_ptr(), packed.data_ptr(), y.data_ptr(), rows, k, n_out,
                             int(out_dtype == torch.float32), workspace.data_ptr())
        return y

    def _workspace(self, size: int) -> torch.Tensor:
        """The one scratch buffer, grown to `size` bytes when a step needs more."""
        if self.workspace.numel() < size:
            self.workspace = torch.empty(size, dtype=torch.uint8)
        return self.workspace

    MAX_TOP_K = 16

    def argmax_topk(self, logits: torch.Tensor, k: int) -> tuple[list[int], Optional[list[list[int]]]]:
        """For logits [rows, V] (float32): each row's argmax, the first index on ties as torch.argmax, and (k > 0)
        its k largest ids in descending order, ties by lower index; in one pass over the logits instead of torch's
        argmax and topk (two separate ops). Rows with a NaN go to torch."""
        logits = logits.contiguous()
        if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu" or not 0 <= k <= min(
                self.MAX_TOP_K, logits.shape[1]):
            raise ValueError(f"argmax_topk needs float32 CPU logits [rows, V] and 0 <= k <= {self.MAX_TOP_K}, got "
                             f"{logits.dtype} {tuple(logits.shape)} on {logits.device}, k={k}")
        rows = logits.shape[0]
        ids, top = torch.empty(rows, dtype=torch.int64), torch.empty(rows, max(k, 1), dtype=torch.int64)
        self.lib.argmax_topk_f32(logits.data_ptr(), rows, logits.shape[1], k, ids.data_ptr(), top.data_ptr())
        ids, top = ids.tolist(), top[:, :k].tolist() if k else None
        for r in [r for r, i in enumerate(ids) if i < 0]:
            ids[r] = int(logits[r].argmax())
            if top is not None:
                top[r] = logits[r].topk(k).indices.tolist()
        return ids, top

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: PrefillTable,
                          out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The attention of a prefill (cpu_kernels.c prefill_attention): q [B, T, H, D] bf16, rotated (a view of the
        projections: tokens may be strided), the step's K and V already in the caches [users, Hk, slots, D] ->
        [B, T, H, D] in out_dtype (bf16, or float32 for the tests)."""
        B, T = table.positions.shape
        H, D = q.shape[2], q.shape[3]
        users, Hk, slots = k_cache.shape[:3]
        if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16 and q.shape[:2] == (B, T)
                and q.device.type == "cpu" and q.stride(3) == 1 and q.stride(2) == D and q.stride(0) == T * q.stride(1)
                and k_cache.shape == v_cache.shape == (users, Hk, slots, D) and k_cache.is_contiguous()
                and v_cache.is_contiguous() and k_cache.device.type == "cpu" and H % Hk == 0
                and out_dtype in (torch.bfloat16, torch.float32)):
            raise ValueError(f"CPU kernels: a prefill's attention needs bf16 CPU queries [{B}, {T}, H, D] (heads "
                             f"contiguous) and caches [users, Hk, slots, D] with Hk dividing H, got q "
                             f"{tuple(q.shape)} {q.dtype} strides {q.stride()}, caches {tuple(k_cache.shape)} "
                             f"{k_cache.dtype}, out {out_dtype}")
        if int(table.rows.max()) >= users or table.kv_len > slots:
            raise IndexError(f"kernel prefill reaches cache row {int(table.rows.max())} / slot {table.kv_len - 1}, but "
                             f"the cache has {users} rows x {slots} slots")
        threads = torch.get_num_threads()
        workspace = self._workspace(self.lib.prefill_attention_workspace_bytes(B, H, Hk, D, table.kv_len, threads))
        out = torch.empty(B, T, H, D, dtype=out_dtype)
        self.lib.prefill_attention(q.data_ptr(), q.stride(1), B, T, H, Hk, D, table.rows.data_ptr(),
                                   table.positions.data_ptr(), table.window, table.kv_len, k_cache.data_ptr(),
                                   v_cache.data_ptr(), slots, out.data_ptr(), int(out_dtype == torch.float32),
                                   workspace.data_ptr(), threads)
        return out

    def prefill_rotate(self, qkv: torch.Tensor, n_heads: int, table: PrefillTable, cos: torch.Tensor,
                       sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """A prefill's projections qkv [B, T, (H + 2 Hk) D] bf16 -> its rotated queries [B, T, H, D]; the rotated keys
        and the values go into the caches [users, Hk, slots, D] at each token's slot (cos / sin: the whole rotary
        tables [slots, D]), as a decode step's are."""
        B, T = table.positions.shape
        H, Hk, D = n_heads, k_cache.shape[1], k_cache.shape[3]
        qkv = qkv.contiguous()
        users, slots = k_cache.shape[0], k_cache.shape[2]
        self._check("projections", qkv, (B, T, (H + 2 * Hk) * D))
        self._check_caches_and_rotary(k_cache, v_cache, cos, sin)
        if int(table.rows.max()) >= users or table.slots_needed > min(slots, cos.shape[0]):
            raise IndexError(f"kernel prefill writes cache row {int(table.rows.max())} / slot "
                             f"{table.slots_needed - 1}, but the cache has {users} rows x {slots} slots")
        q_rot = torch.empty(B, T, H, D, dtype=torch.bfloat16)
        self.lib.prefill_rotate(qkv.data_ptr(), B, T, H, Hk, D, table.rows.data_ptr(), table.slots.data_ptr(),
                                cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots,
                                q_rot.data_ptr(), torch.get_num_threads())
        return q_rot

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x [..., dim] bf16 as decoder_layer computes it, each row by one thread: a prefill's norms (a
        third of the time of the torch ops' float32 round trip: 3.5 against 10.5 ms for 4,000 rows of 576 on a core)."""
        x = x.contiguous()
        self._check("norm input", x)
        self._check("norm weight", weight, (x.shape[-1],))
        out = torch.empty_like(x)
        self.lib.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], x.shape[-1],
                               eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[..., 2 hidden] (gate | up) -> silu(gate) * up [..., hidden] bf16 as decoder_layer computes it: a prefill's
        SwiGLU (7.3 against 11.4 ms for 4,000 rows of 1,536 on a core)."""
        gate_up = gate_up.contiguous()
        self._check("SwiGLU input", gate_up)
        hidden = gate_up.shape[-1] // 2
        if gate_up.shape[-1] % 32:
            raise ValueError(f"CPU kernels: SwiGLU needs a hidden size that is a multiple of 16, got {hidden}")
        out = torch.empty(*gate_up.shape[:-1], hidden, dtype=torch.bfloat16)
        self.lib.silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // gate_up.shape[-1], hidden)
        return out

    def check_layer_weights(self, args, weights: tuple) -> None:
        """Once, when a block moves onto the kernels (its modules then refuse .to() and casts): the weights
        decoder_layer will read, in its order (attention norm, packed wqkv, packed wo, ffn norm, packed gate_up,
        packed down)."""
        dim, hidden, H, Hk, D = args.dim, args.hidden_dim, args.n_heads, args.n_kv_heads, args.head_dim
        shapes = ((dim,), packed_shape((H + 2 * Hk) * D, dim), packed_shape(dim, H * D), (dim,),
                  packed_shape(2 * hidden, dim), packed_shape(dim, hidden))
        for name, w, shape in zip(("attention_norm", "wqkv", "wo", "ffn_norm", "w_gate_up", "w_down"), weights, shapes):
            self._check(name, w, shape)

    def step_attention(self, qkv: torch.Tensor, n_heads: int, table: StepTable, cos: torch.Tensor, sin: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """A packed step's attention alone (decoder_layer's, attention_f32): its tokens' projections qkv [n, (H + 2 Hk)
        D] bf16, in the table's order -> float32 [n, H, D]; each token's q and k are rotated at its position (cos /
        sin: the whole rotary tables [positions, D]) and its k and v written at its slot, then it attends to the keys
        the table gives it. A draft head's layer, whose attention is not a TransformerBlock's, runs it."""
        n = len(table.tensor)
        H, Hk, D = n_heads, k_cache.shape[1], k_cache.shape[3]
        users, slots = k_cache.shape[0], k_cache.shape[2]
        if not (n > 0 and head_dim_fits(D) and Hk > 0 and H % Hk == 0):
            raise ValueError(f"CPU kernels: a step's attention needs tokens, head_dim a multiple of 32 up to 256 and "
                             f"query heads a multiple of the key/value heads, got {n} tokens, head_dim {D}, {H} query "
                             f"and {Hk} key/value heads")
        qkv = qkv.contiguous()
        self._check("projections", qkv, (n, (H + 2 * Hk) * D))
        self._check_caches_and_rotary(k_cache, v_cache, cos, sin)
        if table.rows_needed > users or table.slots_needed > slots or int(table.tensor[:, 2].max()) >= cos.shape[0]:
            raise IndexError(f"kernel step reaches cache row {table.rows_needed - 1} / slot {table.slots_needed - 1} / "
                             f"position {int(table.tensor[:, 2].max())}, but the cache has {users} rows x {slots} "
                             f"slots and the rotary tables {cos.shape[0]} positions")
        threads = torch.get_num_threads()
        workspace = self._workspace(self.lib.attention_workspace_bytes(n, H, D, threads))
        out = torch.empty(n, H, D)
        self.lib.attention_f32(qkv.data_ptr(), n, H, Hk, D, table.tensor.data_ptr(), table.ancestors.data_ptr(),
                               cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots,
                               out.data_ptr(), workspace.data_ptr(), threads)
        return out

    def decoder_layer(self, x: torch.Tensor, args, weights: tuple, table: StepTable, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """One TransformerBlock over a packed step x [1, n, dim]: returns the new residual stream.

        args: the model's ModelArgs; weights: the block's, as check_layer_weights saw them; table: each token's
        row, slot, position and keys.
        """
        n, D = x.shape[1], args.head_dim
        users, slots = k_cache.shape[0], k_cache.shape[2]
        shape = (users, args.n_kv_heads, slots, D)
        if not (x.dtype == k_cache.dtype == v_cache.dtype == cos.dtype == sin.dtype == torch.bfloat16
                and x.shape == (1, len(table.tensor), args.dim) and k_cache.shape == v_cache.shape == shape
                and cos.shape == sin.shape and cos.shape[1] == D and k_cache.is_contiguous() and v_cache.is_contiguous()
                and cos.is_contiguous() and sin.is_contiguous() and k_cache.device.type == "cpu"):
            raise ValueError(f"CPU kernels: a decoder-layer step needs bf16 CPU tensors x [1, {len(table.tensor)}, "
                             f"{args.dim}], caches {shape} and rotary tables [slots, {D}], got x {tuple(x.shape)} "
                             f"{x.dtype}, k/v cache {tuple(k_cache.shape)} {k_cache.dtype}, cos {tuple(cos.shape)}")
        if table.rows_needed > users or table.slots_needed > min(slots, cos.shape[0]):
            raise IndexError(f"kernel step reaches cache row {table.rows_needed - 1} / slot {table.slots_needed - 1}, "
                             f"but the cache has {users} rows x {slots} slots")
        threads = torch.get_num_threads()
        size = self.lib.decoder_layer_workspace_bytes(n, args.dim, args.hidden_dim, args.n_heads, args.n_kv_heads, D,
                                                      threads)
        workspace = self._workspace(size)
        x = x.contiguous().clone()
        self.lib.decoder_layer(x.data_ptr(), n, args.dim, args.hidden_dim, args.n_heads, args.n_kv_heads, D,
                               args.norm_eps, *(w.data_ptr() for w in weights), table.tensor.data_ptr(),
                               table.ancestors.data_ptr(), cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), slots, workspace.data_ptr(), threads)
        return x


def load_cpu_kernels(build_dir: Path, path: Optional[str] = None) -> Optional[CpuKernels]:
    """The kernels for `path` (default: the one this CPU and TT_CPU_ISA choose), built the first time on this
    compiler; None where they cannot be built (no compiler) or TT_CPU_KERNELS=0. Loaded once per process."""
    if os.environ.get("TT_CPU_KERNELS", "1") == "0":
        return None
    return _load(build_dir, path or this_process_path()[0].name)


@lru_cache(maxsize=None)
def _load(build_dir: Path, name: str) -> Optional[CpuKernels]:
    path = BY_NAME[name]
    lib = build_library(SOURCE, build_dir, ["-O3", "-ffp-contract=off", "-fopenmp", *path.cc_flags], ("-lm",),
                        depends_on=name, fallback="using torch ops")
    if lib is None:
        return None
    chosen, why = this_process_path()
    logger.info(f"CPU kernels: {name} ({path.describe}; {why if chosen is path else 'asked for by the caller'})")
    # Loaded after torch, the library's libgomp.so.1 is torch's own, so both share one OpenMP thread pool.
    return CpuKernels(ctypes.CDLL(str(lib)), path)
