/* LoRA deltas of a mixed-adapter batch on CPUs, fp32 (SGMV/BGMV: each row names its adapter slot).
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
 * index order k = 0..K-1 (r = 0..R-1), built with -ffp-contract=off. Rows of one adapter are taken
 * GROUP at a time (Punica's SGMV: each weight row read once for the group, not once per row); the
 * grouping changes which rows share a pass, never the order of a row's own sums. So a row's bits
 * depend on its own x, its adapter and R (the slot table's rank, fixed at start) only, never on the
 * other rows, their adapters or the thread count. Built on first use by kernels/cpu_native.py;
 * kernels/lora.py holds the torch twin. csrc/decode_step.c includes this file and calls
 * zs_lora_rows_f32 for its threads' rows inside the compiled decode step.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LORA_PAR_MIN 32768 /* multiply-adds below which threads cost more than they save */
#define OBLOCK 256    /* expand outputs per tile: its sums stay in L1 while B's rows stream */
#define MAX_PR 1024   /* P*R of a shrink (3 parts of rank 256 at most) */
#define GROUP 4       /* rows of one adapter per pass */

/* Rows [t0, t1) of the delta on the calling thread. y: [T, N] (row stride ldy), x: [T, K] (row
 * stride ldx), at: [S, K, P*R], bt: [S, R, N], scale: [S], slots: [T] int32 (-1 = none), bounds:
 * [P+1] output offsets (bounds[P] = N). Shapes and slots are the caller's to check (zs_lora_f32
 * does). Returns 0, or -2 out of memory. */
int zs_lora_rows_f32(float *y, int64_t ldy, const float *x, int64_t ldx, const float *at, const float *bt,
                     const float *scale, const int32_t *slots, const int64_t *bounds, int P, int t0, int t1, int K,
                     int N, int R, int S) {
    const int n_rows = t1 - t0;
    if (n_rows <= 0) return 0;
    /* the range's rows by slot (counting sort), then groups of up to GROUP rows of one slot */
    int *count = calloc((size_t)S + 1, sizeof(int));
    int *order = malloc(sizeof(int) * (size_t)n_rows);
    int *gstart = malloc(sizeof(int) * (size_t)(n_rows + 1));
    if (!count || !order || !gstart) {
        free(count), free(order), free(gstart);
        return -2;
    }
    for (int t = t0; t < t1; t++)
        if (slots[t] >= 0) count[slots[t] + 1]++;
    for (int s = 0; s < S; s++) count[s + 1] += count[s];
    const int active = count[S];
    for (int t = t0; t < t1; t++)
        if (slots[t] >= 0) order[count[slots[t]]++] = t;
    int ng = 0;
    for (int i = 0; i < active; i++)
        if (ng == 0 || i - gstart[ng - 1] == GROUP || slots[order[i]] != slots[order[gstart[ng - 1]]])
            gstart[ng++] = i;
    gstart[ng] = active;
    const int PR = P * R;
    for (int g = 0; g < ng; g++) {
        const int n = gstart[g + 1] - gstart[g];
        const int *rows = order + gstart[g];
        const int s = slots[rows[0]];
        /* shrink: hacc[i] = x[row i] @ at[s], one sum per column j in k order */
        const float *a = at + (int64_t)s * K * PR;
        float hacc[GROUP][MAX_PR];
        for (int i = 0; i < n; i++) memset(hacc[i], 0, sizeof(float) * PR);
        for (int k = 0; k < K; k++) {
            const float *row = a + (int64_t)k * PR;
            for (int i = 0; i < n; i++) {
                const float xv = x[rows[i] * ldx + k];
                for (int j = 0; j < PR; j++) {
                    const float m = xv * row[j];
                    hacc[i][j] += m;
                }
            }
        }
        /* expand: y[row, o] += (hacc[i][part] @ bt[s])[o] * scale, by tiles of OBLOCK outputs */
        const float *b = bt + (int64_t)s * R * N;
        for (int o0 = 0; o0 < N; o0 += OBLOCK) {
            const int o1 = o0 + OBLOCK < N ? o0 + OBLOCK : N;
            float acc[GROUP][OBLOCK];
            for (int p = 0; p < P; p++) { /* the part of the tile in part p */
                const int lo = bounds[p] > o0 ? (int)bounds[p] : o0;
                const int hi = bounds[p + 1] < o1 ? (int)bounds[p + 1] : o1;
                if (lo >= hi) continue;
                for (int i = 0; i < n; i++) memset(acc[i], 0, sizeof(float) * (hi - lo));
                for (int r = 0; r < R; r++) {
                    const float *brow = b + (int64_t)r * N + lo;
                    for (int i = 0; i < n; i++) {
                        const float hv = hacc[i][p * R + r];
                        for (int o = 0; o < hi - lo; o++) {
                            const float m = hv * brow[o];
                            acc[i][o] += m;
                        }
                    }
                }
                for (int i = 0; i < n; i++) {
                    float *yt = y + rows[i] * ldy + lo;
                    for (int o = 0; o < hi - lo; o++) {
                        const float v = acc[i][o] * scale[s];
                        yt[o] += v;
                    }
                }
            }
        }
    }
    free(count), free(order), free(gstart);
    return 0;
}

/* The whole batch: shapes and slots checked, rows shared among `threads` (each thread's rows
 * grouped by adapter on their own). Returns -1 on a bad shape or a slot outside [-1, S), -2 out
 * of memory. */
int zs_lora_f32(float *y, int64_t ldy, const float *x, int64_t ldx, const float *at, const float *bt,
                const float *scale, const int32_t *slots, const int64_t *bounds, int P, int T, int K, int N,
                int R, int S, int threads) {
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
    const int64_t work = (int64_t)active * P * R * K + (int64_t)active * N * R;
    const int nt = work >= LORA_PAR_MIN && threads > 1 ? (threads < T ? threads : T) : 1;
    int rc = 0;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static) reduction(min : rc)
    for (int i = 0; i < nt; i++) {
        const int t0 = (int)((int64_t)T * i / nt), t1 = (int)((int64_t)T * (i + 1) / nt);
        const int e = zs_lora_rows_f32(y, ldy, x, ldx, at, bt, scale, slots, bounds, P, t0, t1, K, N, R, S);
        rc = e < rc ? e : rc;
    }
    return rc;
}
