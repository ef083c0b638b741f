/* LoRA deltas of a mixed-adapter batch on CPUs, fp32 (BGMV: each row names its adapter slot).
 *
 *   tmp[t, j] = sum_k a[s, j, k] * x[t, k]                    (shrink: j < P*R, s = slots[t])
 *   y[t, o]  += (sum_r b[s, o, r] * tmp[t, p(o)*R + r]) * scale[s]   (expand: p(o) the part of o)
 *
 * A merged linear (q|k|v, gate|up) has P parts, each with its own A (stacked: a[s] is [P*R, K])
 * and its own B rows (b[s] is [N, R], part p's rows [bounds[p], bounds[p+1])); rows with slot -1
 * (the base model) are left alone. Both sums run in LANES lane sums in index order, then the lanes
 * in a fixed tree, with -ffp-contract=off: a row's bits depend on its own x, its adapter and R (the
 * slot table's rank, fixed at start) only, never on which other rows or adapters share the step or
 * on the thread count. Built on first use by kernels/cpu_native.py; kernels/lora.py is its twin.
 */
#include <stdint.h>

#define LANES 8
#define PAR_MIN 32768 /* multiply-adds below which threads cost more than they save */

static inline float dot(const float *u, const float *v, int n) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float m = u[i + l] * v[i + l];
            acc[l] += m;
        }
    for (int l = 0; i < n; i++, l++) {
        const float m = u[i] * v[i];
        acc[l] += m;
    }
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* y: [T, N] (row stride ldy), x: [T, K] (row stride ldx), a: [S, P*R, K], b: [S, N, R],
 * scale: [S], slots: [T] int32 (-1 = none), bounds: [P+1] output offsets (bounds[P] = N),
 * tmp: [T, P*R] scratch. Returns -1 on a bad shape or a slot outside [-1, S). */
int zs_lora_f32(float *y, int64_t ldy, const float *x, int64_t ldx, const float *a, const float *b,
                const float *scale, const int32_t *slots, const int64_t *bounds, float *tmp, int P, int T,
                int K, int N, int R, int S, int threads) {
    if (T < 0 || K <= 0 || N <= 0 || R <= 0 || P <= 0 || S <= 0 || bounds[0] != 0 || bounds[P] != N) return -1;
    for (int p = 0; p < P; p++)
        if (bounds[p + 1] < bounds[p]) return -1;
    int active = 0;
    for (int t = 0; t < T; t++) {
        if (slots[t] < -1 || slots[t] >= S) return -1;
        active += slots[t] >= 0;
    }
    if (active == 0) return 0;
    const int PR = P * R;
    const int64_t work = (int64_t)active * PR * K + (int64_t)active * N * R;
    const int nt = work >= PAR_MIN && threads > 1 ? threads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for collapse(2) schedule(static)
        for (int t = 0; t < T; t++)
            for (int j = 0; j < PR; j++) {
                const int s = slots[t];
                if (s < 0) continue;
                tmp[(int64_t)t * PR + j] = dot(a + ((int64_t)s * PR + j) * K, x + t * ldx, K);
            }
#pragma omp for collapse(2) schedule(static)
        for (int t = 0; t < T; t++)
            for (int o = 0; o < N; o++) {
                const int s = slots[t];
                if (s < 0) continue;
                int p = 0;
                while (o >= bounds[p + 1]) p++;
                const float d = dot(b + ((int64_t)s * N + o) * R, tmp + (int64_t)t * PR + p * R, R);
                const float v = d * scale[s];
                y[t * ldy + o] += v;
            }
    }
    return 0;
}
