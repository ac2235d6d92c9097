// SPDX-License-Identifier: Apache-2.0
// Runs one call of the CPU kernels (cpu_kernels.c, linked in) read from stdin and writes every buffer back to stdout
// after it: how tests/test_cpu_kernels_aarch64.py runs the NEON build under qemu-user, where no Python with torch can.
//
// Input, all little-endian int64 unless said: the call (0 linear_bf16, 1 decoder_layer, 2 argmax_topk_f32,
// 3 attention_f32, 4 prefill_attention), the number of scalars and the scalars, the number of buffers and each buffer
// as its byte count
// and its bytes. Output: the buffers' bytes, in order. The scratch memory a call needs is allocated here, as
// cpu_kernels.py does.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;
int64_t linear_workspace_floats(int64_t M, int64_t K);
void linear_bf16(const bf16 *x, const bf16 *w, void *y, int64_t M, int64_t K, int64_t N, int out_f32, float *xf);
int64_t decoder_layer_workspace_bytes(int64_t n, int64_t dim, int64_t hidden, int64_t H, int64_t Hk, int64_t D,
                                      int threads);
void decoder_layer(bf16 *x, int64_t n, int64_t dim, int64_t hidden, int64_t H, int64_t Hk, int64_t D, float eps,
                   const bf16 *attention_norm, const bf16 *wqkv, const bf16 *wo, const bf16 *ffn_norm,
                   const bf16 *w_gate_up, const bf16 *w_down, const int64_t *table, const int64_t *ancestors,
                   const bf16 *cos, const bf16 *sin, bf16 *k_cache, bf16 *v_cache, int64_t slots, void *workspace,
                   int threads);
void argmax_topk_f32(const float *logits, int64_t rows, int64_t V, int k, int64_t *ids, int64_t *top);
int64_t attention_workspace_bytes(int64_t n, int64_t H, int64_t D, int threads);
void attention_f32(const bf16 *qkv, int64_t n, int64_t H, int64_t Hk, int64_t D, const int64_t *table,
                   const int64_t *ancestors, const bf16 *cos, const bf16 *sin, bf16 *k_cache, bf16 *v_cache,
                   int64_t slots, float *out, void *workspace, int threads);
int64_t prefill_attention_workspace_bytes(int64_t B, int64_t H, int64_t Hk, int64_t D, int64_t kv_len, int threads);
void prefill_attention(const bf16 *q, int64_t token_stride, int64_t B, int64_t T, int64_t H, int64_t Hk, int64_t D,
                       const int64_t *rows, const int64_t *pos, int64_t window, int64_t kv_len, const bf16 *k_cache,
                       const bf16 *v_cache, int64_t slots, void *out, int out_f32, void *workspace, int threads);

static void read_exact(void *p, size_t n) {
    if (fread(p, 1, n, stdin) != n) {
        fprintf(stderr, "cpu_kernels_driver: short input\n");
        exit(2);
    }
}

static int64_t read_i64(void) {
    int64_t v;
    read_exact(&v, 8);
    return v;
}

int main(void) {
    enum { MAX = 16 };
    int64_t s[MAX], len[MAX];
    void *b[MAX];
    const int64_t call = read_i64(), n_scalars = read_i64();
    if (n_scalars > MAX) return 2;
    for (int64_t i = 0; i < n_scalars; i++) s[i] = read_i64();
    const int64_t n_buffers = read_i64();
    if (n_buffers > MAX) return 2;
    for (int64_t i = 0; i < n_buffers; i++) {
        len[i] = read_i64();
        b[i] = malloc(len[i] ? len[i] : 1);
        read_exact(b[i], len[i]);
    }
    if (call == 0) {  // scalars M, K, N, out_f32; buffers x, packed w, y
        float *xf = malloc((linear_workspace_floats(s[0], s[1]) + 1) * sizeof(float));
        linear_bf16(b[0], b[1], b[2], s[0], s[1], s[2], (int)s[3], xf);
    } else if (call == 1) {  // scalars n, dim, hidden, H, Hk, D, eps's float bits, slots, threads;
                             // buffers x, the 6 weights, table, ancestors, cos, sin, k_cache, v_cache
        float eps;
        const uint32_t eps_bits = (uint32_t)s[6];
        memcpy(&eps, &eps_bits, 4);
        void *workspace = malloc(decoder_layer_workspace_bytes(s[0], s[1], s[2], s[3], s[4], s[5], (int)s[8]));
        decoder_layer(b[0], s[0], s[1], s[2], s[3], s[4], s[5], eps, b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8],
                      b[9], b[10], b[11], b[12], s[7], workspace, (int)s[8]);
    } else if (call == 2) {  // scalars rows, V, k; buffers logits, ids, top
        argmax_topk_f32(b[0], s[0], s[1], (int)s[2], b[1], b[2]);
    } else if (call == 3) {  // scalars n, H, Hk, D, slots, threads; buffers qkv, table, ancestors, cos, sin, k_cache,
                             // v_cache, out
        void *workspace = malloc(attention_workspace_bytes(s[0], s[1], s[3], (int)s[5]));
        attention_f32(b[0], s[0], s[1], s[2], s[3], b[1], b[2], b[3], b[4], b[5], b[6], s[4], b[7], workspace,
                      (int)s[5]);
    } else if (call == 4) {  // scalars token_stride, B, T, H, Hk, D, window, kv_len, slots, threads;
                             // buffers q, rows, pos, k_cache, v_cache, out (float32)
        void *workspace = malloc(prefill_attention_workspace_bytes(s[1], s[3], s[4], s[5], s[7], (int)s[9]));
        prefill_attention(b[0], s[0], s[1], s[2], s[3], s[4], s[5], b[1], b[2], s[6], s[7], b[3], b[4], s[8], b[5], 1,
                          workspace, (int)s[9]);
    } else {
        return 2;
    }
    for (int64_t i = 0; i < n_buffers; i++) fwrite(b[i], 1, len[i], stdout);
    return 0;
}
