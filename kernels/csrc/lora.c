/* LoRA deltas of a mixed-adapter batch on CPUs, fp32 (BGMV: each row names its adapter slot).
 *
 *   h[t, j]   = sum_k x[t, k] * at[s, k, j]                 (shrink: j < P*R, s = slots[t])
 *   y[t, o]  += (sum_r h[t, p(o)*R + r] * bt[s, r, o]) * scale[s]   (expand: p(o) the part of o)
 *
 * A merged linear (q|k|v, gate|up) has P parts, each with its own A (at[s] = [A_0; A_1; ...]^T,
 * [K, P*R]) and its own rows of B (bt[s] = B^T, [R, N]; part p's outputs [bounds[p], bounds[p+1])).
 * Rows with slot -1 (the base model) are left alone.
 *
 * Both weights are stored transposed so the innermost loop runs along contiguous outputs (j, o),
 * one sum per output lane: it vectorizes without horizontal sums, and each output's sum runs in
 * index order k = 0..K-1 (r = 0..R-1), built with -ffp-contract=off. So a row's bits depend on its
 * own x, its adapter and R (the slot table's rank, fixed at start) only, never on the other rows,
 * their adapters or the thread count. Built on first use by kernels/cpu_native.py; kernels/lora.py
 * holds the torch twin.
 */
#include <stdint.h>
#include <string.h>

#define PAR_MIN 32768 /* multiply-adds below which threads cost more than they save */
#define OBLOCK 256    /* expand outputs per tile: its sums stay in L1 while B's rows stream */
#define MAX_PR 1024   /* P*R of a shrink (3 parts of rank 256 at most) */

/* y: [T, N] (row stride ldy), x: [T, K] (row stride ldx), at: [S, K, P*R], bt: [S, R, N],
 * scale: [S], slots: [T] int32 (-1 = none), bounds: [P+1] output offsets (bounds[P] = N),
 * h: [T, P*R] scratch. Returns -1 on a bad shape or a slot outside [-1, S). */
int zs_lora_f32(float *y, int64_t ldy, const float *x, int64_t ldx, const float *at, const float *bt,
                const float *scale, const int32_t *slots, const int64_t *bounds, float *h, int P, int T,
                int K, int N, int R, int S, int threads) {
    if (T < 0 || K <= 0 || N <= 0 || R <= 0 || P <= 0 || S <= 0 || P * R > MAX_PR || bounds[0] != 0 ||
        bounds[P] != N)
        return -1;
    for (int p = 0; p < P; p++)
        if (bounds[p + 1] < bounds[p]) return -1;
    int active = 0;
    for (int t = 0; t < T; t++) {
        if (slots[t] < -1 || slots[t] >= S) return -1;
        active += slots[t] >= 0;
    }
    if (active == 0) return 0;
    const int PR = P * R;
    const int nob = (N + OBLOCK - 1) / OBLOCK;
    const int64_t work = (int64_t)active * PR * K + (int64_t)active * N * R;
    const int nt = work >= PAR_MIN && threads > 1 ? threads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (int t = 0; t < T; t++) {
            const int s = slots[t];
            if (s < 0) continue;
            float acc[MAX_PR];
            memset(acc, 0, sizeof(float) * PR);
            const float *xt = x + t * ldx;
            const float *a = at + (int64_t)s * K * PR;
            for (int k = 0; k < K; k++) {
                const float xv = xt[k];
                const float *row = a + (int64_t)k * PR;
                for (int j = 0; j < PR; j++) {
                    const float m = xv * row[j];
                    acc[j] += m;
                }
            }
            memcpy(h + (int64_t)t * PR, acc, sizeof(float) * PR);
        }
#pragma omp for collapse(2) schedule(static)
        for (int t = 0; t < T; t++)
            for (int ob = 0; ob < nob; ob++) {
                const int s = slots[t];
                if (s < 0) continue;
                const int o0 = ob * OBLOCK, o1 = o0 + OBLOCK < N ? o0 + OBLOCK : N;
                float acc[OBLOCK];
                const float *ht = h + (int64_t)t * PR;
                const float *b = bt + (int64_t)s * R * N;
                float *yt = y + t * ldy;
                for (int p = 0; p < P; p++) { /* the part of the tile in part p */
                    const int lo = bounds[p] > o0 ? (int)bounds[p] : o0;
                    const int hi = bounds[p + 1] < o1 ? (int)bounds[p + 1] : o1;
                    if (lo >= hi) continue;
                    memset(acc, 0, sizeof(float) * (hi - lo));
                    for (int r = 0; r < R; r++) {
                        const float hv = ht[p * R + r];
                        const float *brow = b + (int64_t)r * N + lo;
                        for (int o = 0; o < hi - lo; o++) {
                            const float m = hv * brow[o];
                            acc[o] += m;
                        }
                    }
                    for (int o = 0; o < hi - lo; o++) {
                        const float v = acc[o] * scale[s];
                        yt[lo + o] += v;
                    }
                }
            }
    }
    return 0;
}
