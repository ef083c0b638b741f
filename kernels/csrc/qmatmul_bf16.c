/* bf16 compute on packed weights (included by qmatmul.c, built with its flags):
 *   y[t, n] = sum_k bf16(x[t, k]) * bf16(w[n, k])   products exact, sums in fp32, y fp32
 * where w is the weight's exactly dequantized value and bf16() rounds to nearest even (torch's
 * .to(torch.bfloat16), bit for bit; the native path reads fp32 subnormals as zero).
 *
 * Why: a decode step of 8-64 rows is compute-bound in the fp32 GEMM path above (dequantize a
 * panel, 16 multiply-adds per vector instruction), while reading bf16 weight copies from memory
 * costs 2 bytes a weight against Q4_1's 0.6. Here the packed bytes are
 * read (as the fp32 path reads them), each panel is dequantized and rounded to bf16 in L1/L2, and
 * AVX-512 BF16's VDPBF16PS does 32 multiply-adds per instruction into fp32 accumulators.
 * Measured (SmolLM2's gate/up 3072x576 Q4_1, 16 rows, one EPYC core, cache-hot): 0.56 ms against
 * the fp32 packed GEMM's 1.45 (docs/results-log.md, 2026-12-03).
 *
 * Where the CPU has no AVX-512 BF16 the same values (x and the panel rounded to bf16, held as
 * fp32) go through the fp32 GEMM above: identical products, a different summation order, so
 * every machine computes (and tests) this regime; only the speed is native's.
 * Batch- and thread-invariant at every T (one code path per build): per (t, n) one chain over k in
 * order. Native and emulated sum in other orders: two numeric modes (services/worker/numerics.py).
 */

#if ISA == 2 && defined(__AVX512BF16__) && !defined(ZS_QM_NO_BF16)
#define BF16_NATIVE 1
#else
#define BF16_NATIVE 0
#endif

/* Whether this build multiplies bf16 natively (1) or through the fp32 GEMM on rounded values (0). */
int zs_qm_bf16_native(void) { return BF16_NATIVE; }

/* The bits of bf16(f), nearest even (NaN stays a quiet NaN): c10's round_to_nearest_even. */
INLINE uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

INLINE float bf16_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* n values rounded to bf16 in place (kept as fp32): the emulated regime's inputs. */
static void round_bf16(float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) v[i] = bf16_float(bf16_bits(v[i]));
}

#if BF16_NATIVE
typedef uint16_t bf16_t;
#define BMR 6    /* rows of x per micro-tile */
#define BNR 4    /* weight rows per micro-tile: BMR * BNR accumulators + BNR + 1 = 29 of 32 registers */
#define BNP 24   /* weight rows per panel */
#define BKC 1024 /* columns per panel (48 KiB of bf16) */
#define BTB 60   /* rows of x per pass (K > BKC: their accumulators, BTB * BNP vectors, 90 KiB) */
/* a panel row's stride: one cache line past BKC, so the BNR rows a micro-tile reads at the same
 * k fall in different L1 sets */
#define BLD (BKC + 32)

#define IN_ZMM(v) __asm__("" : "+v"(v))

/* n (a multiple of 32) fp32 values -> bf16, nearest even (VCVTNE2PS2BF16; the same bits as
 * bf16_bits for every value a weight or activation takes: it reads fp32 subnormals as zero). */
INLINE void to_bf16(const float *src, bf16_t *dst, int n) {
    for (int e = 0; e < n; e += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + e + 16), _mm512_loadu_ps(src + e));
        _mm512_storeu_si512((void *)(dst + e), (__m512i)v);
    }
}

/* The lane sums of a, b, c, d as one vector [sum a, sum b, sum c, sum d]: one fixed tree per
 * vector whichever vectors it is combined with (11 instructions for four sums, not 4 x 8). */
INLINE __m128 vsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Whether block_bf16 decodes `fmt` in registers. */
INLINE int reg_decoded(int fmt) { return fmt == F_Q4_1 || fmt == F_Q8_0 || fmt == F_Q4_0; }

/* Block b of a Q4_1 / Q8_0 / Q4_0 row as 32 bf16 values in one register: the exact fp32 values
 * (dequant_blocks's) rounded by VCVTNE2PS2BF16. The one decoding both the panels (panel_row)
 * and the one-row dot products (run_bdot) use, so both feed VDPBF16PS the same bits. */
INLINE __m512bh block_bf16(int fmt, const row_t *r, int b) {
    __m512 lo, hi;
    /* as the fp32 tile does (PF_AHEAD): a weight streamed from memory (the LM head) is
     * bound by the bytes in flight; speed only, the values are the same */
    __builtin_prefetch(r->w + (int64_t)block_bytes(fmt) * b + PF_AHEAD);
    if (fmt == F_Q8_0) {
        const uint8_t *p = r->w + 34 * (int64_t)b;
        const __m512 d = _mm512_set1_ps(f16(p));
        lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)))));
        hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18)))));
    } else {
        const __m512i low = _mm512_set1_epi32(15);
        const int q41 = fmt == F_Q4_1;
        const uint8_t *p = r->w + (q41 ? 20 : 18) * (int64_t)b;
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + (q41 ? 4 : 2))));
        const __m512 d = _mm512_set1_ps(f16(p));
        const __m512 ql = _mm512_cvtepi32_ps(_mm512_and_si512(q, low));
        const __m512 qh = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
        if (q41) {  /* d * q + m, one rounding (d * q is exact), as dequant_blocks */
            const __m512 m = _mm512_set1_ps(f16(p + 2));
            lo = _mm512_fmadd_ps(d, ql, m);
            hi = _mm512_fmadd_ps(d, qh, m);
        } else {  /* d * (q - 8) */
            const __m512 e = _mm512_set1_ps(-8.f);
            lo = _mm512_mul_ps(d, _mm512_add_ps(ql, e));
            hi = _mm512_mul_ps(d, _mm512_add_ps(qh, e));
        }
    }
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* Blocks [b0, b1) of one row as bf16 into dst: the GGUF formats of 32-element blocks decoded in
 * registers (block_bf16; the generic dequant_blocks keeps its codes in memory: measured 2x the
 * GEMM's time at 16 rows), plain f32 / bf16 rows straight from the weight (49152x576 f32 at 1
 * row, one EPYC core: 23.0 -> 10.7 ms), the others through dequant_blocks. The same values as
 * dequant_blocks, then rounded. */
static void panel_row(const job_t *j, const row_t *r, int b0, int b1, float *tmp, bf16_t *dst) {
    const int fmt = j->fmt;
    if (fmt == F_F32) {  /* plain weights: rounded straight from the row (to_bf16's bits) */
        to_bf16((const float *)r->w + 32 * (int64_t)b0, dst, 32 * (b1 - b0));
        return;
    }
    if (fmt == F_BF16) {  /* already bf16: copied */
        memcpy(dst, r->w + 64 * (int64_t)b0, 64 * (size_t)(b1 - b0));
        return;
    }
    if (!reg_decoded(fmt)) {
        dequant_blocks(fmt, r, b0, b1, tmp);
        to_bf16(tmp, dst, (b1 - b0) * block_elems(fmt));
        return;
    }
    for (int b = b0; b < b1; b++, dst += 32) _mm512_storeu_si512((void *)dst, (__m512i)block_bf16(fmt, r, b));
}

/* One row of x (T = 1) against output rows [n0, n1) of a register-decoded format: per (row, n)
 * exactly run_bgemm's operations -- one VDPBF16PS chain over k in order from zero, on the same
 * bf16 values (block_bf16), its lanes summed by vsum4's per-vector tree -- without the panel:
 * at one row the panel's store and reload, not the multiply-adds, were the time (SmolLM2's
 * 3072x576 Q4_1: 0.31 ms against the fp32 tile's 0.11). Four weight rows interleave, so four
 * independent chains hide the decode's and VDPBF16PS's latency (as the fp32 tile_rows). */
INLINE void bdot_rows(int R, const job_t *j, const bf16_t *xb, int n, int nr) {
    const int nb = j->K / 32;
    row_t rs[4];
    __m512 a[4];
    for (int i = 0; i < 4; i++) {
        rs[i] = job_row(j, n + (i < nr ? i : 0));  /* a short group repeats row n: computed, not stored */
        a[i] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + 32 * (int64_t)b));
        for (int i = 0; i < R; i++) a[i] = _mm512_dpbf16_ps(a[i], xv, block_bf16(j->fmt, &rs[i], b));
    }
    float o[4];
    _mm_storeu_ps(o, vsum4(a[0], a[1], a[2], a[3]));
    memcpy(j->y + n, o, sizeof(float) * nr);
}

static void run_bdot(const job_t *j, const bf16_t *xb, int n0, int n1) {
    /* 8-bit codes decode in fewer operations and stream from memory (the LM head): one chain
     * at a time, as the fp32 tile (tile_rows) does for them */
    const int R = j->fmt == F_Q8_0 ? 1 : 4;
    for (int n = n0; n < n1; n += R) {
        const int nr = n1 - n < R ? n1 - n : R;
        if (R == 1) bdot_rows(1, j, xb, n, nr); else bdot_rows(4, j, xb, n, nr);
    }
}

/* R rows of x times BNR panel rows over k in [0, kc): the pair sums start at zero (first) or
 * from acc, and end in acc, or (last) summed into y's first nc columns. */
INLINE void bgemm_tile(int R, const bf16_t *x, int64_t ldx, const bf16_t *w, int kc, __m512 *acc, int first,
                       int last, float *y, int64_t ldy, int nc) {
    __m512 a[BMR][BNR];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < BNR; c++) a[r][c] = first ? _mm512_setzero_ps() : acc[r * BNP + c];
    for (int k = 0; k < kc; k += 32) {
        __m512i wv[BNR];
        for (int c = 0; c < BNR; c++) {
            wv[c] = _mm512_loadu_si512((const void *)(w + c * BLD + k));
            IN_ZMM(wv[c]);
        }
        for (int r = 0; r < R; r++) {
            __m512i xv = _mm512_loadu_si512((const void *)(x + r * ldx + k));
            IN_ZMM(xv);
            for (int c = 0; c < BNR; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)xv, (__m512bh)wv[c]);
        }
    }
    if (!last) {
        for (int r = 0; r < R; r++)
            for (int c = 0; c < BNR; c++) acc[r * BNP + c] = a[r][c];
        return;
    }
    for (int r = 0; r < R; r++) {
        const __m128 v = vsum4(a[r][0], a[r][1], a[r][2], a[r][3]);
        if (nc == BNR) {
            _mm_storeu_ps(y + r * ldy, v);
        } else {
            float o[4];
            _mm_storeu_ps(o, v);
            memcpy(y + r * ldy, o, sizeof(float) * nc);
        }
    }
}

#define BGEMM_ARGS const bf16_t *x, int64_t ldx, const bf16_t *w, int kc, __m512 *acc, int first, int last, \
    float *y, int64_t ldy, int nc
#define BGEMM_TILE(R) static void bgemm_tile##R(BGEMM_ARGS) { bgemm_tile(R, x, ldx, w, kc, acc, first, last, y, ldy, nc); }
BGEMM_TILE(1) BGEMM_TILE(2) BGEMM_TILE(3) BGEMM_TILE(4) BGEMM_TILE(5) BGEMM_TILE(6)
static void (*const BGEMM_TILES[BMR + 1])(BGEMM_ARGS) = {NULL, bgemm_tile1, bgemm_tile2, bgemm_tile3, bgemm_tile4,
                                                         bgemm_tile5, bgemm_tile6};

/* Output rows [n0, n1) for every row of xb (x as bf16, ldx = K), panel by panel: each panel
 * decoded once per BTB rows of x; K up to BKC keeps every sum in registers, start to end. */
static void run_bgemm(const job_t *j, const bf16_t *xb, int n0, int n1) {
    const int be = block_elems(j->fmt);
    bf16_t panel[BNP * BLD] __attribute__((aligned(64)));
    float row[BKC] __attribute__((aligned(64)));
    __m512 acc[BTB * BNP];
    for (int t0 = 0; t0 < j->T; t0 += BTB) {
        const int t1 = t0 + BTB < j->T ? t0 + BTB : j->T;
        for (int p0 = n0; p0 < n1; p0 += BNP) {
            const int np = p0 + BNP < n1 ? BNP : n1 - p0;
            for (int k0 = 0; k0 < j->K; k0 += BKC) {
                const int kc = k0 + BKC < j->K ? BKC : j->K - k0;  /* a multiple of the block (32) */
                for (int i = 0; i < np; i++) {
                    const row_t r = job_row(j, p0 + i);
                    panel_row(j, &r, k0 / be, (k0 + kc) / be, row, panel + i * BLD);
                }
                for (int i = np; i < (np + BNR - 1) / BNR * BNR; i++)  /* a short tile's spare rows: */
                    memset(panel + i * BLD, 0, sizeof(bf16_t) * kc);  /* finite, computed, not stored */
                for (int t = t0; t < t1; t += BMR) {
                    const int R = t1 - t < BMR ? t1 - t : BMR;
                    for (int c = 0; c < np; c += BNR)
                        BGEMM_TILES[R](xb + (int64_t)t * j->K + k0, j->K, panel + c * BLD, kc, acc + (t - t0) * BNP + c,
                                       k0 == 0, k0 + kc == j->K, j->y + t * j->ldy + p0 + c, j->ldy,
                                       np - c < BNR ? np - c : BNR);
                }
            }
        }
    }
}
#endif

#define XB_STACK 16384  /* x's bf16 (or rounded fp32) copy kept on the stack up to this many values */

/* Thread `id` of `cnt` of the bf16 regime, x's rounded copy made by each thread itself (cheaper
 * than a barrier; the same values). Returns 0 or -2 (out of memory). */
static int run_bf16(const job_t *j, int id, int cnt) {
    const int n0 = (int)((int64_t)j->N * id / cnt), n1 = (int)((int64_t)j->N * (id + 1) / cnt);
    const int64_t nx = (int64_t)j->T * j->K;
#if BF16_NATIVE
    bf16_t stack[XB_STACK];
    bf16_t *xb = nx <= XB_STACK ? stack : malloc(sizeof(bf16_t) * nx);
    if (xb == NULL) return -2;
    for (int t = 0; t < j->T; t++) to_bf16(j->x + t * j->ldx, xb + (int64_t)t * j->K, j->K);
    if (j->T == 1 && reg_decoded(j->fmt))
        run_bdot(j, xb, n0, n1);
    else
        run_bgemm(j, xb, n0, n1);
#else
    float stack[XB_STACK];
    float *xb = nx <= XB_STACK ? stack : malloc(sizeof(float) * nx);
    if (xb == NULL) return -2;
    for (int t = 0; t < j->T; t++) memcpy(xb + (int64_t)t * j->K, j->x + t * j->ldx, sizeof(float) * j->K);
    round_bf16(xb, nx);
    job_t r = *j;
    r.x = xb, r.ldx = j->K, r.round_bf16 = 1;
    run_gemm(&r, n0, n1);
#endif
    if (xb != stack) free(xb);
    return 0;
}

#define BF16_ARGS int fmt, const uint8_t *w, int64_t w_stride, const float *scales, const float *mins, \
    int64_t s_stride, int group, const float *x, int64_t ldx, float *y, int64_t ldy, int T, int N, int K, int threads

/* The job of a bf16 call and its team size (0: nothing to compute), or -1 for bad arguments. */
static int bf16_job(job_t *job, BF16_ARGS) {
    const int gshift = check_args(fmt, scales, mins, group, T, N, K);
    if (gshift < 0) return -1;
    *job = make_job(fmt, gshift, w, w_stride, scales, mins, s_stride, x, ldx, y, ldy, T, N, K);
    return T == 0 || N == 0 ? 0 : team_size(T, N, K, threads);
}

/* zs_qmatmul_f32's arguments, computed in the bf16 regime above; thread id's share of a team of
 * `threads` (csrc/decode_step.c's teams), the shares of ids 0 .. threads-1 giving the whole. */
int zs_qmatmul_bf16_part(BF16_ARGS, int id) {
    job_t job;
    const int nt = bf16_job(&job, fmt, w, w_stride, scales, mins, s_stride, group, x, ldx, y, ldy, T, N, K, threads);
    return nt < 0 ? -1 : id < nt ? run_bf16(&job, id, nt) : 0;
}

/* y = x @ W.T in the bf16 regime (see the top of this file); arguments as zs_qmatmul_f32's. */
int zs_qmatmul_bf16(BF16_ARGS) {
    job_t job;
    const int nt = bf16_job(&job, fmt, w, w_stride, scales, mins, s_stride, group, x, ldx, y, ldy, T, N, K, threads);
    if (nt <= 0) return nt;
    if (nt == 1) return run_bf16(&job, 0, 1);
    atomic_int err = 0;
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
        const int rc = run_bf16(&job, omp_get_thread_num(), omp_get_num_threads());
#else
        const int rc = run_bf16(&job, 0, 1);
#endif
        if (rc != 0) atomic_store(&err, rc);
    }
    return atomic_load(&err);
}
