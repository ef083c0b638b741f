/* A whole decoder forward for a batch of decode tokens in one call, on CPUs, fp32: every layer
 * of a Llama-family model whose linears are packed (csrc/qmatmul.c formats), then the final norm.
 *
 * Why: at batch 1 a step is ~30 layers x 10 small calls, and from Python each call costs
 * 5-25 us of dispatch around well under a microsecond of work on the norms and rotary; summed,
 * that was as much time as the matmuls. Here the same calls run back to back in C, and one
 * thread team serves the whole step: each matmul used to fork its own OpenMP team, and with
 * passive waiting (the worker's default, for cores shared with other processes) every fork
 * woke a sleeping thread. Between the phases of a step the team meets at a barrier that spins
 * (briefly, then yields), so it is hot while the step runs and asleep between steps.
 *
 * Same arithmetic as the Python path (services/worker/model/llama.py through kernels/cpu_ops.py),
 * call for call: the ops of csrc/cpu_ops.c (included below, built with the same flags), the
 * quantized matmul and paged decode attention through the function pointers of their own
 * libraries. So the hidden states equal the Python path's bit for bit (the tests check it).
 *
 * Descriptor (int64 words, built once by services/worker/model/cpu_step.py):
 *   g[G_*]: model geometry, tables and function pointers (see the enum; G_BF16: 1 when every
 *   linear runs in the bf16 regime, G_QMM_BF16 its kernel);
 *   layers[l * L_WORDS + ...]: four linears (qkv, o, gate_up, down; each LIN_WORDS words:
 *   format, weight, row stride, scales, mins, scale stride, group, bias), the norm weights and
 *   the layer's K and V caches. f[0] = rms eps, f[1] = attention scale.
 */
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_ops.c"

enum { G_LAYERS, G_H, G_HQ, G_HK, G_D, G_I, G_ROT, G_MAX_POS, G_COS_SIN, G_QK_NORM, G_FINAL_NORM, G_QMM,
       G_DECODE, G_BLOCK, G_SLOTS, G_QMM_BF16, G_BF16, G_WORDS };
enum { LIN_FMT, LIN_W, LIN_WSTRIDE, LIN_SCALES, LIN_MINS, LIN_SSTRIDE, LIN_GROUP, LIN_BIAS, LIN_WORDS };
enum { L_QKV = 0, L_O = LIN_WORDS, L_GU = 2 * LIN_WORDS, L_DOWN = 3 * LIN_WORDS, L_IN_NORM = 4 * LIN_WORDS,
       L_POST_NORM, L_Q_NORM, L_K_NORM, L_K_CACHE, L_V_CACHE, L_WORDS };

typedef int (*qmm_fn)(int fmt, const uint8_t *w, int64_t w_stride, const float *scales, const float *mins,
                      int64_t s_stride, int group, const float *x, int64_t ldx, float *y, int64_t ldy, int T, int N,
                      int K, int threads, int id);
typedef int (*decode_fn)(const float *q, const float *k_cache, const float *v_cache, const int32_t *bt,
                         int64_t bt_stride, const int32_t *seq_lens, float *out, int B, int Hq, int Hk, int D, int BS,
                         float scale, int threads, int id);

#define PTR(T, v) ((T)(intptr_t)(v))
#define SPINS 20000  /* barrier polls (~tens of us) before a waiting thread yields its core */

/* A sense-reversing barrier for the step's team. */
typedef struct {
    atomic_int count, sense;
    int n;
} barrier_t;

static void barrier(barrier_t *b, int *local_sense) {
    const int s = !*local_sense;
    *local_sense = s;
    if (b->n == 1) return;
    if (atomic_fetch_add(&b->count, 1) == b->n - 1) {
        atomic_store(&b->count, 0);
        atomic_store(&b->sense, s);
        return;
    }
    for (int i = 0; atomic_load(&b->sense) != s; i++) {
        if (i < SPINS) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else {
            sched_yield();  /* the other thread lost its core: give this one away too */
        }
    }
}

/* Rows [*t0, *t1) of T for thread id of cnt. */
static void share(int T, int id, int cnt, int *t0, int *t1) {
    *t0 = (int)((int64_t)T * id / cnt);
    *t1 = (int)((int64_t)T * (id + 1) / cnt);
}

/* Thread id's share of y[T, N] = x[T, K] @ W^T, W the packed linear at lin (its output rows): in
 * fp32, or (G_BF16) in the bf16 regime (csrc/qmatmul_bf16.c) at every T, as the model's numeric
 * mode says and the Python path's QuantizableWeight.matmul does. */
static int linear(const int64_t *g, const int64_t *lin, const float *x, float *y, int T, int N, int K, int cnt,
                  int id) {
    const qmm_fn f = g[G_BF16] && g[G_QMM_BF16] ? PTR(qmm_fn, g[G_QMM_BF16]) : PTR(qmm_fn, g[G_QMM]);
    return f((int)lin[LIN_FMT], PTR(const uint8_t *, lin[LIN_W]), lin[LIN_WSTRIDE],
                                 PTR(const float *, lin[LIN_SCALES]), PTR(const float *, lin[LIN_MINS]),
                                 lin[LIN_SSTRIDE], (int)lin[LIN_GROUP], x, K, y, N, T, N, K, cnt, id);
}

/* y[T, N] += bias for thread id's rows (after a barrier: another thread may have written them). */
static void add_bias(const int64_t *lin, float *y, int T, int N, int cnt, int id) {
    const float *b = PTR(const float *, lin[LIN_BIAS]);
    if (b == NULL) return;
    int t0, t1;
    share(T, id, cnt, &t0, &t1);
    for (int t = t0; t < t1; t++)
        for (int n = 0; n < N; n++) y[(int64_t)t * N + n] += b[n];
}

typedef struct {  /* the step's activations, [T, ...] each */
    float *res, *h, *out, *qkv, *qr, *kr, *attn, *gu, *act, *qn, *kn;
} bufs_t;

/* One thread's part of the whole step. Every thread passes the same barriers; the first error
 * goes to *err, and from then on every thread skips its work. */
static void step_thread(const int64_t *g, const float *f, const int64_t *layers, float *hidden, const int64_t *pos,
                        const int64_t *slots, const int32_t *bt, int64_t bt_stride, const int32_t *seq_lens, int T,
                        const bufs_t *B, barrier_t *bar, atomic_int *err, int id, int cnt) {
    const int L = (int)g[G_LAYERS], H = (int)g[G_H], Hq = (int)g[G_HQ], Hk = (int)g[G_HK], D = (int)g[G_D];
    const int I = (int)g[G_I], qs = Hq * D, kvs = Hk * D, nqkv = qs + 2 * kvs;
    const float eps = f[0], scale = f[1];
    int sense = 0, t0, t1, rc = 0;
    share(T, id, cnt, &t0, &t1);
    const int nt = t1 - t0;
#define OK (atomic_load(err) == 0)
#define FAIL(e) do { if ((e) != 0) atomic_compare_exchange_strong(err, &(int){0}, (e)); } while (0)
#define SYNC barrier(bar, &sense)
    const float *x = hidden;  /* the previous layer's MLP output (the embeddings before layer 0) */
    for (int l = 0; l < L; l++) {
        const int64_t *ly = layers + (int64_t)l * L_WORDS;
        const float *in_norm = PTR(const float *, ly[L_IN_NORM]);
        if (OK && nt > 0) {
            if (l == 0) {
                memcpy(B->res + (int64_t)t0 * H, hidden + (int64_t)t0 * H, sizeof(float) * nt * H);
                rc = zs_add_rms_norm_f32(B->res + (int64_t)t0 * H, H, NULL, 0, in_norm, B->h + (int64_t)t0 * H, H,
                                         NULL, 0, nt, H, eps, 1);
            } else {
                rc = zs_add_rms_norm_f32(x + (int64_t)t0 * H, H, B->res + (int64_t)t0 * H, H, in_norm,
                                         B->h + (int64_t)t0 * H, H, B->res + (int64_t)t0 * H, H, nt, H, eps, 1);
            }
            FAIL(rc);
        }
        SYNC;
        if (OK) FAIL(linear(g, ly + L_QKV, B->h, B->qkv, T, nqkv, H, cnt, id));
        SYNC;
        if (OK && nt > 0) {
            add_bias(ly + L_QKV, B->qkv, T, nqkv, cnt, id);
            const float *q = B->qkv + (int64_t)t0 * nqkv, *k = q + qs;
            int64_t q_ld = nqkv, k_ld = nqkv;
            if (g[G_QK_NORM]) {  /* Qwen3: per-head RMSNorm of q and k before the rotary */
                for (int t = t0; t < t1; t++) {
                    FAIL(zs_add_rms_norm_f32(B->qkv + (int64_t)t * nqkv, D, NULL, 0, PTR(const float *, ly[L_Q_NORM]),
                                             B->qn + (int64_t)t * qs, D, NULL, 0, Hq, D, eps, 1));
                    FAIL(zs_add_rms_norm_f32(B->qkv + (int64_t)t * nqkv + qs, D, NULL, 0,
                                             PTR(const float *, ly[L_K_NORM]), B->kn + (int64_t)t * kvs, D, NULL, 0,
                                             Hk, D, eps, 1));
                }
                q = B->qn + (int64_t)t0 * qs, k = B->kn + (int64_t)t0 * kvs, q_ld = qs, k_ld = kvs;
            }
            rc = zs_rope_f32(pos + t0, q, q_ld, D, Hq, k, k_ld, D, Hk, D, PTR(const float *, g[G_COS_SIN]),
                             (int)g[G_ROT], g[G_MAX_POS], B->qr + (int64_t)t0 * qs, B->kr + (int64_t)t0 * kvs, nt, 1);
            if (rc == 0)
                rc = zs_write_kv_f32(B->kr + (int64_t)t0 * kvs, kvs, D, B->qkv + (int64_t)t0 * nqkv + qs + kvs, nqkv,
                                     D, PTR(float *, ly[L_K_CACHE]), PTR(float *, ly[L_V_CACHE]), slots + t0,
                                     g[G_SLOTS], nt, Hk, D);
            FAIL(rc);
        }
        SYNC;
        if (OK)
            FAIL(PTR(decode_fn, g[G_DECODE])(B->qr, PTR(const float *, ly[L_K_CACHE]),
                                             PTR(const float *, ly[L_V_CACHE]), bt, bt_stride, seq_lens, B->attn, T,
                                             Hq, Hk, D, (int)g[G_BLOCK], scale, cnt, id));
        SYNC;
        if (OK) FAIL(linear(g, ly + L_O, B->attn, B->out, T, H, qs, cnt, id));
        SYNC;
        if (OK && nt > 0) {
            add_bias(ly + L_O, B->out, T, H, cnt, id);
            FAIL(zs_add_rms_norm_f32(B->out + (int64_t)t0 * H, H, B->res + (int64_t)t0 * H, H,
                                     PTR(const float *, ly[L_POST_NORM]), B->h + (int64_t)t0 * H, H,
                                     B->res + (int64_t)t0 * H, H, nt, H, eps, 1));
        }
        SYNC;
        if (OK) FAIL(linear(g, ly + L_GU, B->h, B->gu, T, 2 * I, H, cnt, id));
        SYNC;
        if (OK && nt > 0)
            FAIL(zs_silu_and_mul_f32(B->gu + (int64_t)t0 * 2 * I, 2 * I, B->act + (int64_t)t0 * I, I, nt, I, 1));
        SYNC;
        if (OK) FAIL(linear(g, ly + L_DOWN, B->act, B->out, T, H, I, cnt, id));
        SYNC;
        x = B->out;
    }
    if (OK && nt > 0) {
        const float *fn = PTR(const float *, g[G_FINAL_NORM]);
        if (L == 0) rc = zs_add_rms_norm_f32(hidden + (int64_t)t0 * H, H, NULL, 0, fn, B->h + (int64_t)t0 * H, H,
                                             NULL, 0, nt, H, eps, 1);
        else rc = zs_add_rms_norm_f32(x + (int64_t)t0 * H, H, B->res + (int64_t)t0 * H, H, fn,
                                      B->h + (int64_t)t0 * H, H, B->res + (int64_t)t0 * H, H, nt, H, eps, 1);
        FAIL(rc);
    }
#undef OK
#undef FAIL
#undef SYNC
}

/* hidden [T, H]: the token embeddings in, the final-normed hidden states out. One decode token
 * per request: request t has seq_lens[t] tokens after this one is written at slots[t].
 * Returns 0; -2 for a position past the rotary table or a slot past the cache (checked before
 * anything is written); -3 out of memory; another negative value from a kernel. */
int zs_decode_step_f32(const int64_t *g, const float *f, const int64_t *layers, float *hidden, const int64_t *pos,
                       const int64_t *slots, const int32_t *bt, int64_t bt_stride, const int32_t *seq_lens, int T,
                       int threads) {
    const int H = (int)g[G_H], Hq = (int)g[G_HQ], Hk = (int)g[G_HK], D = (int)g[G_D], I = (int)g[G_I];
    const int qs = Hq * D, kvs = Hk * D, nqkv = qs + 2 * kvs;
    if (T <= 0) return T == 0 ? 0 : -1;
    for (int t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= g[G_MAX_POS] || slots[t] >= g[G_SLOTS]) return -2;
    const int64_t per_tok = 3 * (int64_t)H + nqkv + 2 * (int64_t)qs + kvs + 3 * (int64_t)I + (g[G_QK_NORM] ? qs + kvs : 0);
    float *buf = malloc(sizeof(float) * per_tok * T);
    if (buf == NULL) return -3;
    bufs_t B;
    B.res = buf, B.h = B.res + (int64_t)T * H, B.out = B.h + (int64_t)T * H, B.qkv = B.out + (int64_t)T * H;
    B.qr = B.qkv + (int64_t)T * nqkv, B.kr = B.qr + (int64_t)T * qs, B.attn = B.kr + (int64_t)T * kvs;
    B.gu = B.attn + (int64_t)T * qs, B.act = B.gu + 2 * (int64_t)T * I, B.qn = B.act + (int64_t)T * I;
    B.kn = B.qn + (int64_t)T * qs;
    atomic_int err = 0;
    barrier_t bar = {0, 0, 1};
    const int nt = threads < 1 ? 1 : threads;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#ifdef _OPENMP
        const int id = omp_get_thread_num(), cnt = omp_get_num_threads();
#else
        const int id = 0, cnt = 1;
#endif
#pragma omp single
        bar.n = cnt;  /* the team the runtime gave (the single's barrier publishes it) */
        step_thread(g, f, layers, hidden, pos, slots, bt, bt_stride, seq_lens, T, &B, &bar, &err, id, cnt);
    }
    const int rc = atomic_load(&err);
    if (rc == 0) memcpy(hidden, B.h, sizeof(float) * T * H);
    free(buf);
    return rc;
}
