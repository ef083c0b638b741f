/* Paged decode attention for CPUs, fp32: one query token per request against its cached keys
 * and values, read in place from the paged cache.
 *
 * Why a C kernel: on CPU the torch twin must first gather every request's blocks into a padded
 * [B, L, Hk, D] buffer and then run SDPA over it, so decode attention moves its bytes through
 * memory three times; here each cached key/value row is read once, straight from its block.
 *
 * Layout (the engine's): q [B, Hq, D]; caches [num_blocks, block_size, Hk, D];
 * block_tables [B, bt_stride] int32; seq_lens [B] int32; out [B, Hq, D]. Query head h reads kv
 * head h / (Hq / Hk) (GQA). Softmax is online (running max and sum per query head), in fp32.
 * Sliding window (zs_paged_decode_window_f32, window > 0): the query at position seq_len - 1
 * reads only keys j >= seq_len - window (HF's sliding mask: the last `window` positions);
 * softcap > 0 bends every scaled score to softcap * tanh(score / softcap) (Gemma 2).
 * A request with seq_len <= 0 gets zeros. With AVX2 + FMA and head_dim % 8 == 0, scores are
 * taken eight keys at a time (one reduction for eight dot products) and the weighted sum of V
 * keeps 64 output columns in registers over a chunk of keys; elsewhere plain C loops.
 * zs_paged_decode_f32 runs its own OpenMP team; zs_paged_decode_f32_part is one thread's share
 * for a caller with a team of its own (csrc/decode_step.c).
 *
 * Built on first use by kernels/cpu_native.py with the system C compiler; its torch twin is
 * kernels.torch_ops.paged_attention, and tests/kernels/test_cpu_native.py compares the two.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vexp.h"  /* zs_expf */

#define MAX_GROUP 32   /* query heads per kv head */
#define MAX_DIM 256    /* head_dim */
#define CHUNK 32       /* keys scored per pass: the scores stay in L1 */

int zs_limits(int *max_group, int *max_dim) {
    *max_group = MAX_GROUP;
    *max_dim = MAX_DIM;
    return 1;
}

static inline float dot(const float *restrict a, const float *restrict b, int d) {
    float s = 0.f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* Four keys against one query: four independent vector accumulators keep the FMA units busy
 * (one dot alone is a single dependency chain). */
static inline void dot4(const float *restrict q, const float *restrict k0, const float *restrict k1,
                        const float *restrict k2, const float *restrict k3, int d, float *restrict out) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
    for (int i = 0; i < d; i++) {
        s0 += q[i] * k0[i];
        s1 += q[i] * k1[i];
        s2 += q[i] * k2[i];
        s3 += q[i] * k3[i];
    }
    out[0] = s0;
    out[1] = s1;
    out[2] = s2;
    out[3] = s3;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC8 1
/* lane j = the horizontal sum of v[j] */
static inline __m256 hsum8(__m256 v0, __m256 v1, __m256 v2, __m256 v3, __m256 v4, __m256 v5, __m256 v6, __m256 v7) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v4, v5), _mm256_hadd_ps(v6, v7));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

/* s[i] = q . k[i] for i < n, eight keys at a time: each key row is loaded once per query, the
 * eight sums reduced together (one reduction per key was most of the cost). D % 8 == 0. */
static inline void scores8(const float *restrict q, const float *const *k, int n, int D, float *restrict s) {
    for (int i = 0; i < n; i += 8) {
        const float *kp[8];
        for (int j = 0; j < 8; j++) kp[j] = k[i + j < n ? i + j : n - 1];
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int d = 0; d < D; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(kp[0] + d), qv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(kp[1] + d), qv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(kp[2] + d), qv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(kp[3] + d), qv, a3);
            a4 = _mm256_fmadd_ps(_mm256_loadu_ps(kp[4] + d), qv, a4);
            a5 = _mm256_fmadd_ps(_mm256_loadu_ps(kp[5] + d), qv, a5);
            a6 = _mm256_fmadd_ps(_mm256_loadu_ps(kp[6] + d), qv, a6);
            a7 = _mm256_fmadd_ps(_mm256_loadu_ps(kp[7] + d), qv, a7);
        }
        float r[8];
        _mm256_storeu_ps(r, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
        for (int j = 0; j < 8 && i + j < n; j++) s[i + j] = r[j];
    }
}

/* acc[d] += sum_i p[i] * v[i][d]: 64 columns at a time held in registers over all n keys. */
static inline void weighted_sum8(float *restrict acc, const float *const *v, const float *restrict p, int n, int D) {
    int d0 = 0;
    for (; d0 + 64 <= D; d0 += 64) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_loadu_ps(acc + d0 + 8 * j);
        for (int i = 0; i < n; i++) {
            const __m256 pi = _mm256_set1_ps(p[i]);
            const float *vi = v[i] + d0;
            for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(vi + 8 * j), pi, a[j]);
        }
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
    }
    for (; d0 < D; d0 += 8) {
        __m256 a = _mm256_loadu_ps(acc + d0);
        for (int i = 0; i < n; i++) a = _mm256_fmadd_ps(_mm256_loadu_ps(v[i] + d0), _mm256_set1_ps(p[i]), a);
        _mm256_storeu_ps(acc + d0, a);
    }
}
#endif

/* Attention of the `grp` query heads that share kv head `hk`, for one request. */
static void decode_one(const float *restrict q, const float *restrict kc, const float *restrict vc,
                       const int32_t *restrict table, int start, int seq_len, float *restrict out,
                       int hk, int Hk, int D, int BS, int grp, float scale, float softcap) {
    float m[MAX_GROUP], l[MAX_GROUP], s[MAX_GROUP][CHUNK];
    float acc[MAX_GROUP][MAX_DIM];
    const int64_t row = (int64_t)Hk * D;  /* floats between consecutive tokens of a block */
    for (int g = 0; g < grp; g++) {
        m[g] = -FLT_MAX;
        l[g] = 0.f;
        memset(acc[g], 0, sizeof(float) * D);
    }
    for (int t0 = start; t0 < seq_len; t0 += CHUNK) {  /* start: the window's first key (0 = all) */
        const int n = seq_len - t0 < CHUNK ? seq_len - t0 : CHUNK;
        const float *k[CHUNK];
        for (int i = 0; i < n; i++) {
            const int t = t0 + i;
            k[i] = kc + ((int64_t)table[t / BS] * BS + t % BS) * row + (int64_t)hk * D;
        }
        /* the next chunk's K and V rows, requested now: blocks are scattered, so the hardware
         * prefetcher loses the stream at every block edge (alone it measured within noise; it
         * is cheap next to the arithmetic, and the rows are needed next) */
        for (int t = t0 + CHUNK, te = t0 + 2 * CHUNK < seq_len ? t0 + 2 * CHUNK : seq_len; t < te; t++) {
            const int64_t off = ((int64_t)table[t / BS] * BS + t % BS) * row + (int64_t)hk * D;
            for (int d = 0; d < D; d += 16) {
                __builtin_prefetch(kc + off + d);
                __builtin_prefetch(vc + off + d);
            }
        }
        for (int g = 0; g < grp; g++) {
            const float *qg = q + (int64_t)g * D;
            int i = 0;
#ifdef VEC8
            if (D % 8 == 0) {
                scores8(qg, k, n, D, s[g]);
                i = n;
            }
#endif
            for (; i + 4 <= n; i += 4) dot4(qg, k[i], k[i + 1], k[i + 2], k[i + 3], D, &s[g][i]);
            for (; i < n; i++) s[g][i] = dot(qg, k[i], D);
            for (i = 0; i < n; i++) s[g][i] *= scale;
            if (softcap > 0.f)
                for (i = 0; i < n; i++) s[g][i] = tanhf(s[g][i] / softcap) * softcap;
        }
        for (int g = 0; g < grp; g++) {
            float mx = m[g];
            for (int i = 0; i < n; i++) mx = s[g][i] > mx ? s[g][i] : mx;
            const float corr = zs_expf(m[g] - mx);
            m[g] = mx;
            l[g] *= corr;
            for (int d = 0; d < D; d++) acc[g][d] *= corr;
            float sum = 0.f;
            for (int i = 0; i < n; i++) {
                s[g][i] = zs_expf(s[g][i] - mx);
                sum += s[g][i];
            }
            l[g] += sum;
        }
        const float *v[CHUNK];
        for (int i = 0; i < n; i++) v[i] = k[i] - kc + vc;  /* V sits where K sits, in its own cache */
#ifdef VEC8
        if (D % 8 == 0) {
            for (int g = 0; g < grp; g++) weighted_sum8(acc[g], v, s[g], n, D);
            continue;
        }
#endif
        for (int i = 0; i < n; i++)
            for (int g = 0; g < grp; g++) {
                const float p = s[g][i];
                float *restrict a = acc[g];
                for (int d = 0; d < D; d++) a[d] += p * v[i][d];
            }
    }
    for (int g = 0; g < grp; g++) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int d = 0; d < D; d++) out[(int64_t)g * D + d] = acc[g][d] * inv;
    }
}

static int shape_ok(int Hq, int Hk, int D, int BS) {
    return Hk > 0 && Hq % Hk == 0 && Hq / Hk <= MAX_GROUP && D <= MAX_DIM && BS > 0;
}

/* Task `task` of B * Hk: request task / Hk, kv head task % Hk, with its query heads. */
static inline void run_task(int64_t task, const float *q, const float *k_cache, const float *v_cache,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, float *out,
                            int Hq, int Hk, int D, int BS, float scale, int window, float softcap) {
    const int grp = Hq / Hk, b = (int)(task / Hk), hk = (int)(task % Hk);
    const int64_t off = ((int64_t)b * Hq + (int64_t)hk * grp) * D;
    const int start = window > 0 && seq_lens[b] > window ? seq_lens[b] - window : 0;
    decode_one(q + off, k_cache, v_cache, block_tables + b * bt_stride, start, seq_lens[b], out + off, hk, Hk, D, BS,
               grp, scale, softcap);
}

/* Returns 0 on success, -1 when a shape is outside the compiled limits. */
int zs_paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                        const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                        float *out, int B, int Hq, int Hk, int D, int BS, float scale, int threads) {
    if (!shape_ok(Hq, Hk, D, BS)) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < (int64_t)B * Hk; task++)
        run_task(task, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, Hq, Hk, D, BS, scale, 0, 0.f);
    return 0;
}

/* As zs_paged_decode_f32, each request attending to its last `window` keys only (window <= 0:
 * all), scores soft-capped when softcap > 0. */
int zs_paged_decode_window_f32(const float *q, const float *k_cache, const float *v_cache,
                               const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                               float *out, int B, int Hq, int Hk, int D, int BS, float scale, int threads,
                               int window, float softcap) {
    if (!shape_ok(Hq, Hk, D, BS)) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < (int64_t)B * Hk; task++)
        run_task(task, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, Hq, Hk, D, BS, scale, window, softcap);
    return 0;
}

/* Thread `id`'s share of the (request, kv head) tasks for a caller that runs its own team of
 * `threads` (csrc/decode_step.c); every task is computed the same way whichever thread runs it. */
int zs_paged_decode_f32_part(const float *q, const float *k_cache, const float *v_cache,
                             const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                             float *out, int B, int Hq, int Hk, int D, int BS, float scale, int threads, int id) {
    if (!shape_ok(Hq, Hk, D, BS)) return -1;
    for (int64_t task = id; task < (int64_t)B * Hk; task += threads)
        run_task(task, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, Hq, Hk, D, BS, scale, 0, 0.f);
    return 0;
}
