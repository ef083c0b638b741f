/* A whole decoder forward for a batch of decode tokens in one call, on CPUs, fp32: every layer
 * of a Llama-family model whose linears are packed (csrc/qmatmul.c formats), then the final norm.
 *
 * Why: at batch 1 a step is ~30 layers x 10 small calls, and from Python each call costs
 * 5-25 us of dispatch around well under a microsecond of work on the norms and rotary; summed,
 * that was as much time as the matmuls. Here the same calls run back to back in C.
 *
 * Same arithmetic as the Python path (services/worker/model/llama.py through kernels/cpu_ops.py),
 * call for call: the ops of csrc/cpu_ops.c (included below, built with the same flags), the
 * quantized matmul and paged decode attention through the function pointers of their own
 * libraries. So the hidden states equal the Python path's bit for bit (the tests check it).
 *
 * Descriptor (int64 words, built once by services/worker/model/cpu_step.py):
 *   g[G_*]: model geometry, tables and function pointers (see the enum);
 *   layers[l * L_WORDS + ...]: four linears (qkv, o, gate_up, down; each LIN_WORDS words:
 *   format, weight, row stride, scales, mins, scale stride, group, bias), the norm weights and
 *   the layer's K and V caches. f[0] = rms eps, f[1] = attention scale.
 */
#include <stdlib.h>

#include "cpu_ops.c"

enum { G_LAYERS, G_H, G_HQ, G_HK, G_D, G_I, G_ROT, G_MAX_POS, G_COS_SIN, G_QK_NORM, G_FINAL_NORM, G_QMM,
       G_DECODE, G_BLOCK, G_SLOTS, G_WORDS };
enum { LIN_FMT, LIN_W, LIN_WSTRIDE, LIN_SCALES, LIN_MINS, LIN_SSTRIDE, LIN_GROUP, LIN_BIAS, LIN_WORDS };
enum { L_QKV = 0, L_O = LIN_WORDS, L_GU = 2 * LIN_WORDS, L_DOWN = 3 * LIN_WORDS, L_IN_NORM = 4 * LIN_WORDS,
       L_POST_NORM, L_Q_NORM, L_K_NORM, L_K_CACHE, L_V_CACHE, L_WORDS };

typedef int (*qmm_fn)(int fmt, const uint8_t *w, int64_t w_stride, const float *scales, const float *mins,
                      int64_t s_stride, int group, const float *x, int64_t ldx, float *y, int64_t ldy, int T, int N,
                      int K, int threads);
typedef int (*decode_fn)(const float *q, const float *k_cache, const float *v_cache, const int32_t *bt,
                         int64_t bt_stride, const int32_t *seq_lens, float *out, int B, int Hq, int Hk, int D, int BS,
                         float scale, int threads);

#define PTR(T, v) ((T)(intptr_t)(v))

/* y[T, N] = x[T, K] @ W^T (+ bias), W the packed linear at lin. */
static int linear(const int64_t *g, const int64_t *lin, const float *x, float *y, int T, int N, int K, int threads) {
    const int rc = PTR(qmm_fn, g[G_QMM])((int)lin[LIN_FMT], PTR(const uint8_t *, lin[LIN_W]), lin[LIN_WSTRIDE],
                                         PTR(const float *, lin[LIN_SCALES]), PTR(const float *, lin[LIN_MINS]),
                                         lin[LIN_SSTRIDE], (int)lin[LIN_GROUP], x, K, y, N, T, N, K, threads);
    const float *b = PTR(const float *, lin[LIN_BIAS]);
    if (rc == 0 && b != NULL)
        for (int t = 0; t < T; t++)
            for (int n = 0; n < N; n++) y[(int64_t)t * N + n] += b[n];
    return rc;
}

/* hidden [T, H]: the token embeddings in, the final-normed hidden states out. One decode token
 * per request: request t has seq_lens[t] tokens after this one is written at slots[t]. */
int zs_decode_step_f32(const int64_t *g, const float *f, const int64_t *layers, float *hidden, const int64_t *pos,
                       const int64_t *slots, const int32_t *bt, int64_t bt_stride, const int32_t *seq_lens, int T,
                       int threads) {
    const int L = (int)g[G_LAYERS], H = (int)g[G_H], Hq = (int)g[G_HQ], Hk = (int)g[G_HK], D = (int)g[G_D];
    const int I = (int)g[G_I], qs = Hq * D, kvs = Hk * D, nqkv = qs + 2 * kvs;
    const float eps = f[0], scale = f[1];
    if (T <= 0) return T == 0 ? 0 : -1;
    const int64_t per_tok = 3 * (int64_t)H + nqkv + 2 * (int64_t)qs + kvs + 3 * (int64_t)I + (g[G_QK_NORM] ? qs + kvs : 0);
    float *buf = malloc(sizeof(float) * per_tok * T);
    if (buf == NULL) return -3;
    float *res = buf, *h = res + (int64_t)T * H, *out = h + (int64_t)T * H, *qkv = out + (int64_t)T * H;
    float *qr = qkv + (int64_t)T * nqkv, *kr = qr + (int64_t)T * qs, *attn = kr + (int64_t)T * kvs;
    float *gu = attn + (int64_t)T * qs, *act = gu + 2 * (int64_t)T * I, *qn = act + (int64_t)T * I;
    float *kn = qn + (int64_t)T * qs;
    int rc = 0;
    const float *x = hidden;  /* the previous layer's MLP output (the embeddings before layer 0) */
    for (int l = 0; l < L && rc == 0; l++) {
        const int64_t *ly = layers + (int64_t)l * L_WORDS;
        if (l == 0) {
            memcpy(res, hidden, sizeof(float) * T * H);
            rc = zs_add_rms_norm_f32(res, H, NULL, 0, PTR(const float *, ly[L_IN_NORM]), h, H, NULL, 0, T, H, eps, threads);
        } else {
            rc = zs_add_rms_norm_f32(x, H, res, H, PTR(const float *, ly[L_IN_NORM]), h, H, res, H, T, H, eps, threads);
        }
        if (rc == 0) rc = linear(g, ly + L_QKV, h, qkv, T, nqkv, H, threads);
        if (rc != 0) break;
        const float *q = qkv, *k = qkv + qs, *v = qkv + qs + kvs;
        int64_t q_ld = nqkv, k_ld = nqkv;
        if (g[G_QK_NORM]) {  /* Qwen3: per-head RMSNorm of q and k before the rotary */
            for (int t = 0; t < T; t++) {
                zs_add_rms_norm_f32(qkv + (int64_t)t * nqkv, D, NULL, 0, PTR(const float *, ly[L_Q_NORM]),
                                    qn + (int64_t)t * qs, D, NULL, 0, Hq, D, eps, 1);
                zs_add_rms_norm_f32(qkv + (int64_t)t * nqkv + qs, D, NULL, 0, PTR(const float *, ly[L_K_NORM]),
                                    kn + (int64_t)t * kvs, D, NULL, 0, Hk, D, eps, 1);
            }
            q = qn, k = kn, q_ld = qs, k_ld = kvs;
        }
        rc = zs_rope_f32(pos, q, q_ld, D, Hq, k, k_ld, D, Hk, D, PTR(const float *, g[G_COS_SIN]), (int)g[G_ROT],
                         g[G_MAX_POS], qr, kr, T, threads);
        if (rc == 0)
            rc = zs_write_kv_f32(kr, kvs, D, v, nqkv, D, PTR(float *, ly[L_K_CACHE]), PTR(float *, ly[L_V_CACHE]),
                                 slots, g[G_SLOTS], T, Hk, D);
        if (rc == 0)
            rc = PTR(decode_fn, g[G_DECODE])(qr, PTR(const float *, ly[L_K_CACHE]), PTR(const float *, ly[L_V_CACHE]),
                                             bt, bt_stride, seq_lens, attn, T, Hq, Hk, D, (int)g[G_BLOCK], scale,
                                             threads);
        if (rc == 0) rc = linear(g, ly + L_O, attn, out, T, H, qs, threads);
        if (rc == 0)
            rc = zs_add_rms_norm_f32(out, H, res, H, PTR(const float *, ly[L_POST_NORM]), h, H, res, H, T, H, eps,
                                     threads);
        if (rc == 0) rc = linear(g, ly + L_GU, h, gu, T, 2 * I, H, threads);
        if (rc == 0) rc = zs_silu_and_mul_f32(gu, 2 * I, act, I, T, I, threads);
        if (rc == 0) rc = linear(g, ly + L_DOWN, act, out, T, H, I, threads);
        x = out;
    }
    if (rc == 0) {
        if (L == 0) rc = zs_add_rms_norm_f32(hidden, H, NULL, 0, PTR(const float *, g[G_FINAL_NORM]), h, H, NULL, 0, T, H, eps, threads);
        else rc = zs_add_rms_norm_f32(x, H, res, H, PTR(const float *, g[G_FINAL_NORM]), h, H, res, H, T, H, eps, threads);
    }
    if (rc == 0) memcpy(hidden, h, sizeof(float) * T * H);
    free(buf);
    return rc;
}
