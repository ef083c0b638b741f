/* The small per-layer ops of a decoder step for CPUs, fp32: RMSNorm (with the residual add
 * fused), NeoX rotary embedding, SiLU-and-mul and the paged KV write.
 *
 * Why C: at decode each of these touches a few KiB, yet as torch twins each is 5-10 aten ops of
 * ~5 us dispatch apiece; 30 layers of them cost SmolLM2-135M about a third of its batch-1 step.
 * One call here does the same work in one pass.
 *
 * Numerics follow the torch twins (kernels/torch_ops.py) operation by operation, built with
 * -ffp-contract=off so nothing is fused or reordered: the add, the rotary products and
 * differences, the norm's scaling (w * (x * r)) and the cache copies give the twin's bits. Two
 * places may differ by rounding only: RMSNorm's sum of squares is taken in 8 lane sums (torch
 * has its own reduction order), and SiLU's exp is csrc/vexp.h's polynomial (~1 ulp; torch uses
 * its own vector exp).
 *
 * Rows may be strided (q, k, v are views of one qkv matmul output): every row pointer is
 * base + row * row_stride (+ head * head_stride), in elements. Built on first use by
 * kernels/cpu_native.py; tests/kernels/test_cpu_native.py compares every op with its twin.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vexp.h"  /* zs_expf: SiLU's exp, vectorizable */

#define LANES 8
#define PAR_MIN 65536  /* elements below which threads cost more than they save */

/* out = w * (x * rsqrt(mean(x^2) + eps)) for T rows of H; with residual != NULL, first
 * x = x + residual, written to new_res (the updated residual stream). */
int zs_add_rms_norm_f32(const float *x, int64_t ldx, const float *residual, int64_t ldr, const float *w,
                        float *out, int64_t ldo, float *new_res, int64_t ldn, int T, int H, float eps,
                        int threads) {
    if (T < 0 || H <= 0 || (residual != NULL && new_res == NULL)) return -1;
    const int nt = (int64_t)T * H >= PAR_MIN && threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *xr = x + t * ldx;
        if (residual != NULL) {
            const float *rr = residual + t * ldr;
            float *nr = new_res + t * ldn;
            for (int i = 0; i < H; i++) nr[i] = xr[i] + rr[i];
            xr = nr;
        }
        float acc[LANES] = {0};
        int i = 0;
        for (; i + LANES <= H; i += LANES)
            for (int l = 0; l < LANES; l++) {
                const float sq = xr[i + l] * xr[i + l];
                acc[l] += sq;
            }
        for (int l = 0; i < H; i++, l++) {
            const float sq = xr[i] * xr[i];
            acc[l] += sq;
        }
        const float s = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
        const float r = 1.0f / sqrtf(s / (float)H + eps);
        float *o = out + t * ldo;
        for (int j = 0; j < H; j++) {
            const float n = xr[j] * r;
            o[j] = w[j] * n;
        }
    }
    return 0;
}

/* One head's NeoX rotation: o[:half] = x1 cos - x2 sin, o[half:rot] = x2 cos + x1 sin, the rest
 * copied (partial rotary). */
static inline void rope_head(const float *x, float *o, const float *cs, int half, int rot, int D) {
    const float *c = cs, *s = cs + half;
    for (int i = 0; i < half; i++) {
        const float a = x[i] * c[i], b = x[half + i] * s[i];
        const float e = x[half + i] * c[i], f = x[i] * s[i];
        o[i] = a - b;
        o[half + i] = e + f;
    }
    if (rot < D) memcpy(o + rot, x + rot, sizeof(float) * (D - rot));
}

/* q_out[T, Hq, D], k_out[T, Hk, D] (contiguous) = NeoX rotary of q and k at positions;
 * cos_sin [max_pos, rot] rows [cos | sin]. Returns -2 for a position outside the table. */
int zs_rope_f32(const int64_t *pos, const float *q, int64_t q_ld, int64_t q_hs, int Hq, const float *k,
                int64_t k_ld, int64_t k_hs, int Hk, int D, const float *cos_sin, int rot, int64_t max_pos,
                float *q_out, float *k_out, int T, int threads) {
    if (T < 0 || D <= 0 || rot <= 0 || rot > D || rot % 2) return -1;
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return -2;
    const int half = rot / 2;
    const int nt = (int64_t)T * (Hq + Hk) * D >= PAR_MIN && threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *cs = cos_sin + pos[t] * rot;
        for (int h = 0; h < Hq; h++) rope_head(q + t * q_ld + h * q_hs, q_out + ((int64_t)t * Hq + h) * D, cs, half, rot, D);
        for (int h = 0; h < Hk; h++) rope_head(k + t * k_ld + h * k_hs, k_out + ((int64_t)t * Hk + h) * D, cs, half, rot, D);
    }
    return 0;
}

/* out[T, I] = silu(x[:, :I]) * x[:, I:], silu(a) = a / (1 + exp(-a)). */
int zs_silu_and_mul_f32(const float *x, int64_t ldx, float *out, int64_t ldo, int T, int I, int threads) {
    if (T < 0 || I < 0) return -1;
    const int nt = (int64_t)T * I >= PAR_MIN && threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int t = 0; t < T; t++) {
        const float *g = x + t * ldx, *u = g + I;
        float *o = out + t * ldo;
#pragma omp simd  /* g, u and o never overlap */
        for (int i = 0; i < I; i++) {
            const float s = g[i] / (1.0f + zs_expf(-g[i]));
            o[i] = s * u[i];
        }
    }
    return 0;
}

/* Rows t of k and v ([Hk, D] each, heads hs apart) copied to slot slots[t] of the caches
 * ([num_slots, Hk, D] contiguous); slot < 0 = padding, skipped. -2: a slot past the cache. */
int zs_write_kv_f32(const float *k, int64_t k_ld, int64_t k_hs, const float *v, int64_t v_ld, int64_t v_hs,
                    float *k_cache, float *v_cache, const int64_t *slots, int64_t num_slots, int T, int Hk, int D) {
    if (T < 0 || Hk <= 0 || D <= 0) return -1;
    for (int t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -2;
    const size_t row = sizeof(float) * D;
    for (int t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        float *kd = k_cache + slots[t] * Hk * D, *vd = v_cache + slots[t] * Hk * D;
        for (int h = 0; h < Hk; h++) {
            memcpy(kd + h * D, k + t * k_ld + h * k_hs, row);
            memcpy(vd + h * D, v + t * v_ld + h * v_hs, row);
        }
    }
    return 0;
}

/* Structured outputs: row rows[i] of x ([*, V], rows ld apart) keeps token t where bit t % 32
 * of mask[i * mask_ld + t / 32] is set and becomes -inf elsewhere, in place. dead[i] = 1 when
 * no allowed token is left above -inf (the caller then falls back). One pass, no allocation
 * (the torch twin unpacks the bits and selects: several passes over [R, V]). */
int zs_apply_token_bitmask_f32(float *x, int64_t ld, const int64_t *rows, const int32_t *mask, int64_t mask_ld,
                               int R, int V, uint8_t *dead, int threads) {
    if (R < 0 || V < 0) return -1;
    const int W = (V + 31) / 32;
    const int nt = (int64_t)R * V >= PAR_MIN && threads > 1 ? threads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int i = 0; i < R; i++) {
        float *row = x + rows[i] * ld;
        const uint32_t *m = (const uint32_t *)(mask + i * mask_ld);
        int alive = 0;
        for (int w = 0; w < W; w++) {
            const uint32_t bits = m[w];
            const int base = w * 32, n = V - base < 32 ? V - base : 32;
            for (int j = 0; j < n; j++) {
                if ((bits >> j) & 1u)
                    alive |= row[base + j] > -INFINITY;
                else
                    row[base + j] = -INFINITY;
            }
        }
        dead[i] = (uint8_t)!alive;
    }
    return 0;
}
