/* Weight-only quantized matmul for CPUs: y[t, n] = sum_k x[t, k] * w[n, k], x and y fp32, w read
 * in its packed form (never dequantized to memory).
 *
 * Why: batch-1 decode is bound by the bytes of weights read per token; 4-bit weights are ~7x
 * fewer bytes than fp32. Each 32-element chunk of a weight row has its integer codes q turned
 * into fp32 in registers and applied to a tile of up to RMAX rows of x, so a batch of T rows
 * costs far less than T single-row passes.
 *
 * Formats (w rows are `w_stride` bytes apart; a row is K / block blocks back to back):
 *   Q8_0  block 32:  fp16 d, int8 q[32]                 w = d * q
 *   Q4_0  block 32:  fp16 d, u8 qs[16]                  w = d * (q - 8)
 *   Q4_1  block 32:  fp16 d, fp16 m, u8 qs[16]          w = d * q + m
 *         (Q4_0/Q4_1: element i < 16 is the low nibble of qs[i], element 16 + i the high one)
 *   Q4_K  block 256: fp16 d, fp16 dmin, u8 scales[12] (8 x 6-bit scale, 8 x 6-bit min),
 *         u8 qs[128]; sub-block j (32 elements) reads the (j & 1 ? high : low) nibbles of
 *         qs[32 * (j / 2) ...+32]; w = (d * sc[j]) * q - dmin * mn[j]
 *   INT8  group g:   int8 q[K], fp32 scale[ceil(K / g)]  w = s * q
 *   INT4  group g:   u8 qs[K / 2] packed like Q4_1 per 32-chunk, fp32 scale and min per group,
 *         w = s * q + m; g is 32 * 2^i, the last group may be short
 *   F32   block 32:  fp32 w[32] (a plain float weight, read in place: kernels/quant.py's "f32")
 *   BF16  block 32:  bf16 w[32] (a weight held in bf16: "bf16"), widened exactly
 * GGUF formats are llama.cpp's block layouts byte for byte.
 *
 * Arithmetic (fp32 throughout), one definition for every call: each weight is dequantized
 * exactly (w = d * q (+ m), one rounding, the torch twin's values), and per (t, n) one vector
 * of partial sums runs over K in order, acc = fma(x[k .. k + VW), w[k .. k + VW), acc), its
 * lanes summed at the end by vsum's fixed tree. Both code paths -- the packed tile for few rows
 * of x (weights decoded in registers) and the GEMM on dequantized panels for many -- do exactly
 * these operations in this order, so a row's result is the same bits for every T, tiling, row
 * slice and thread count: batch-invariant by construction (zeroserve's numeric modes rest on it;
 * GEMM_MIN_ROWS is a speed choice only). It differs from dequantize-then-matmul (BLAS) by
 * summation order only, and between the AVX-512, AVX2 and portable builds (vector width: VW).
 *
 * Built on first use by kernels/cpu_native.py (-O3 -march=native -fopenmp -ffp-contract=off:
 * the compiler may not fuse or reorder what is written here).
 */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum { F_Q8_0 = 0, F_Q4_0 = 1, F_Q4_1 = 2, F_Q4_K = 3, F_INT8 = 4, F_INT4 = 5, F_F32 = 6, F_BF16 = 7, F_COUNT };

#define RMAX 8          /* rows of x per tile: one decoded chunk is reused RMAX times */
#define PANEL 64        /* weight rows that stay in L2 while a block of x passes over them */
#define TBLOCK 64       /* rows of x per pass over the weights */
#define MIN_WORK 65536  /* multiply-adds per thread below which more threads cost more than they save */
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && !defined(ZS_QM_PORTABLE)
#include <immintrin.h>
#define ISA 2
#define VW 16
typedef __m512 vf;
#define VSET1 _mm512_set1_ps
#define VZERO _mm512_setzero_ps
#define VLOAD _mm512_loadu_ps
#define VMUL _mm512_mul_ps
#define VADD _mm512_add_ps
#define VFMA _mm512_fmadd_ps  /* a * b + c */
INLINE float vsum(vf v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
/* 16 bytes -> their 16 low nibbles and 16 high nibbles as floats */
INLINE void u4x16(const uint8_t *p, vf *lo, vf *hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    lo[0] = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi[0] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
INLINE void i8x16(const uint8_t *p, vf *o) {
    o[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
/* 16 bf16 values (32 bytes) -> fp32, exact: each one's bits moved to the top half of a lane */
INLINE void bf16x16(const uint8_t *p, vf *o) {
    o[0] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#elif defined(__AVX2__) && defined(__FMA__) && !defined(ZS_QM_PORTABLE)
#include <immintrin.h>
#define ISA 1
#define VW 8
typedef __m256 vf;
#define VSET1 _mm256_set1_ps
#define VZERO _mm256_setzero_ps
#define VLOAD _mm256_loadu_ps
#define VMUL _mm256_mul_ps
#define VADD _mm256_add_ps
#define VFMA _mm256_fmadd_ps
INLINE float vsum(vf v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
/* the 16 bytes in both 128-bit lanes, spread one byte per 32-bit lane by pshufb: fewer
 * shuffles than pmovzx of each 8-byte half, and the nibbles split in 32-bit lanes */
INLINE void u4x16(const uint8_t *p, vf *lo, vf *hi) {
    const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
    const __m256i s0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                        4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i s1 = _mm256_add_epi32(s0, _mm256_set1_epi32(8));
    const __m256i v0 = _mm256_shuffle_epi8(b, s0), v1 = _mm256_shuffle_epi8(b, s1);
    const __m256i m = _mm256_set1_epi32(15);
    lo[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v0, m));
    lo[1] = _mm256_cvtepi32_ps(_mm256_and_si256(v1, m));
    hi[0] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v0, 4));
    hi[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v1, 4));
}
INLINE void i8x16(const uint8_t *p, vf *o) {
    o[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    o[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}
INLINE void bf16x16(const uint8_t *p, vf *o) {
    o[0] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    o[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16))), 16));
}
#else
/* Portable: 8-float structs the compiler vectorizes for whatever the target has. */
#define ISA 0
#define VW 8
typedef struct { float v[8]; } vf;
INLINE vf VSET1(float a) { vf r; for (int i = 0; i < 8; i++) r.v[i] = a; return r; }
INLINE vf VZERO(void) { return VSET1(0.f); }
INLINE vf VLOAD(const float *p) { vf r; memcpy(r.v, p, sizeof r.v); return r; }
INLINE vf VMUL(vf a, vf b) { for (int i = 0; i < 8; i++) a.v[i] *= b.v[i]; return a; }
INLINE vf VADD(vf a, vf b) { for (int i = 0; i < 8; i++) a.v[i] += b.v[i]; return a; }
INLINE vf VFMA(vf a, vf b, vf c) { for (int i = 0; i < 8; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
INLINE float vsum(vf a) {
    float s[4];
    for (int i = 0; i < 4; i++) s[i] = a.v[i] + a.v[i + 4];
    return (s[0] + s[2]) + (s[1] + s[3]);
}
INLINE void u4x16(const uint8_t *p, vf *lo, vf *hi) {
    for (int i = 0; i < 16; i++) {
        lo[i / 8].v[i % 8] = (float)(p[i] & 0x0F);
        hi[i / 8].v[i % 8] = (float)(p[i] >> 4);
    }
}
INLINE void i8x16(const uint8_t *p, vf *o) {
    for (int i = 0; i < 16; i++) o[i / 8].v[i % 8] = (float)(int8_t)p[i];
}
INLINE void bf16x16(const uint8_t *p, vf *o) {
    for (int i = 0; i < 16; i++) {
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        const uint32_t u = (uint32_t)h << 16;
        memcpy(&o[i / 8].v[i % 8], &u, 4);
    }
}
#endif

#define NV (32 / VW)   /* vectors per 32-element chunk */
#define NH (16 / VW)

/* IEEE half -> float, exact (subnormals, inf, nan included). */
INLINE float f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__) && !defined(ZS_QM_PORTABLE)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF, bits;
    if (e == 0x1F) {
        bits = sign | 0x7F800000u | (m << 13);
    } else if (e != 0) {
        bits = sign | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {
        bits = sign;
    } else {  /* subnormal: normalize */
        e = 113;
        while (!(m & 0x400)) { m <<= 1; e--; }
        bits = sign | (e << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Sum of the 32 products of one chunk: a fixed tree, so every row sees the same order. */
INLINE vf dot32(const vf *w, const float *x) {
#if NV == 2
    return VFMA(VLOAD(x + 16), w[1], VMUL(VLOAD(x), w[0]));
#else
    return VADD(VFMA(VLOAD(x + 8), w[1], VMUL(VLOAD(x), w[0])),
                VFMA(VLOAD(x + 24), w[3], VMUL(VLOAD(x + 16), w[2])));
#endif
}

typedef struct {
    const uint8_t *w;      /* this row's packed bytes */
    const float *sc, *mn;  /* this row's group scales / mins (INT8, INT4) */
    int gshift, K;         /* group = 32 << gshift */
} row_t;

/* Per-block constants: returns the block's chunk count; fills d[j], m[j] per chunk for Q4_K,
 * d[0], m[0] (shared by the block's chunks) otherwise. */
INLINE int block_prep(int fmt, const row_t *r, int b, float *d, float *m) {
    switch (fmt) {
    case F_Q8_0: d[0] = f16(r->w + 34 * b); return 1;
    case F_Q4_0: d[0] = f16(r->w + 18 * b); return 1;
    case F_Q4_1: d[0] = f16(r->w + 20 * b); m[0] = f16(r->w + 20 * b + 2); return 1;
    case F_Q4_K: {
        /* llama.cpp's 6-bit unpacking on 32-bit words: bytes 0..7 = scales, 8..15 = mins */
        const uint8_t *p = r->w + 144 * b;
        uint32_t u[4];
        uint8_t sm[16];
        memcpy(u, p + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
        u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        u[2] = mins_lo;
        u[0] &= 0x3f3f3f3f;
        memcpy(sm, u, 16);
        vf v[NH];  /* the 16 small integers to floats with the vector conversion */
        float f[16];
        i8x16(sm, v);
        memcpy(f, v, sizeof f);
        const float dd = f16(p), dm = -f16(p + 2);
        for (int j = 0; j < 8; j++) {
            d[j] = dd * f[j];  /* exact: 11-bit mantissa times a 6-bit integer */
            m[j] = dm * f[8 + j];
        }
        return 8;
    }
    case F_F32:
    case F_BF16: d[0] = 1.f; return 1;  /* plain weights: no scale (dq() uses the values as they are) */
    default:  /* INT8 / INT4: a block is one chunk of 32; its group is chunk >> gshift */
        d[0] = r->sc[b >> r->gshift];
        if (fmt == F_INT4) m[0] = r->mn[b >> r->gshift];
        return 1;
    }
}

INLINE int asym(int fmt) { return fmt == F_Q4_1 || fmt == F_Q4_K || fmt == F_INT4; }

/* The integer codes q of chunk j of block b (and for Q4_K of chunk j + 1, which shares its
 * bytes) as floats; returns how many chunks it decoded. */
INLINE int decode(int fmt, const row_t *r, int b, int j, vf w[2][NV]) {
    switch (fmt) {
    case F_Q8_0: i8x16(r->w + 34 * b + 2, w[0]); i8x16(r->w + 34 * b + 18, w[0] + NH); return 1;
    case F_Q4_0:  /* signed codes q - 8, exact in fp32 */
        u4x16(r->w + 18 * b + 2, w[0], w[0] + NH);
        for (int i = 0; i < NV; i++) w[0][i] = VADD(w[0][i], VSET1(-8.f));
        return 1;
    case F_Q4_1: u4x16(r->w + 20 * b + 4, w[0], w[0] + NH); return 1;
    case F_Q4_K: {
        const uint8_t *q = r->w + 144 * b + 16 + 32 * (j >> 1);
        u4x16(q, w[0], w[1]);
        u4x16(q + 16, w[0] + NH, w[1] + NH);
        return 2;
    }
    case F_INT8: i8x16(r->w + 32 * (int64_t)b, w[0]); i8x16(r->w + 32 * (int64_t)b + 16, w[0] + NH); return 1;
    case F_F32:
        for (int i = 0; i < NV; i++) w[0][i] = VLOAD((const float *)(r->w + 128 * (int64_t)b) + i * VW);
        return 1;
    case F_BF16: bf16x16(r->w + 64 * (int64_t)b, w[0]); bf16x16(r->w + 64 * (int64_t)b + 32, w[0] + NH); return 1;
    default: u4x16(r->w + 16 * (int64_t)b, w[0], w[0] + NH); return 1;  /* INT4 */
    }
}

INLINE int block_elems(int fmt) { return fmt == F_Q4_K ? 256 : 32; }

/* Bytes of one block in a row; rows of a weight lie back to back, so prefetching PF_AHEAD bytes
 * past the block in use runs ahead into the next rows (measured: the 30 MB Q8_0 LM head of
 * SmolLM2 at T = 1 on 2 threads, 2.1-2.7 ms -> 1.4-1.7 ms; cache-resident weights unchanged). */
#define PF_AHEAD 2048
INLINE int block_bytes(int fmt) {
    switch (fmt) {
    case F_Q8_0: return 34;
    case F_Q4_0: return 18;
    case F_Q4_1: return 20;
    case F_Q4_K: return 144;
    case F_F32: return 128;
    case F_BF16: return 64;
    default: return 32;  /* INT8 codes (INT4: 16; the distance only needs to be about right) */
    }
}

/* Chunk vector q (the codes decode() gave) as the weight's exact fp32 values: the bits
 * dequant_blocks stores and the torch twin computes. GGUF scales have 11 (Q4_K: 17) significant
 * bits, codes 4-8: d * q is exact in fp32, so one FMA rounds as the twin's multiply-then-add. */
INLINE vf dq(int fmt, vf vd, vf vm, vf q) {
    if (fmt == F_F32 || fmt == F_BF16) return q;
    return !asym(fmt) ? VMUL(vd, q) : fmt == F_INT4 ? VADD(VMUL(vd, q), vm) : VFMA(vd, q, vm);
}

/* One chunk's step of an accumulator chain: acc = fma(x_c[i], w_c[i], acc) for its NV vectors
 * in order, w_c the dequantized values -- exactly gemm_tile's operations on the same k, so the
 * packed tile, tile_rows and the GEMM compute the same bits for a row. */
INLINE vf chunk_acc(const vf *w, const float *xc, vf a) {
    for (int i = 0; i < NV; i++) a = VFMA(VLOAD(xc + i * VW), w[i], a);
    return a;
}

/* The weights of decoded chunk u of block b's chunk jj as fp32 values into wd. */
INLINE void chunk_values(int fmt, const float *d, const float *m, int jj, const vf *q, vf *wd) {
    const vf vd = VSET1(d[jj]), vm = asym(fmt) ? VSET1(m[jj]) : VZERO();
    for (int i = 0; i < NV; i++) wd[i] = dq(fmt, vd, vm, q[i]);
}

/* Blocks [b0, b1) of one weight row against R rows of x (at the row starts), accumulated into
 * acc[r]: one vector chain per (row of x, row of w) over K in order, so how K is sliced and
 * rows are tiled does not change the result. */
INLINE void tile(int fmt, int R, const row_t *row, int b0, int b1, const float *x, int64_t ldx, vf *acc) {
    vf a[RMAX];
    for (int r = 0; r < R; r++) a[r] = acc[r];
    const int cpb = block_elems(fmt) / 32;
    int64_t c = (int64_t)b0 * cpb;
    for (int b = b0; b < b1; b++) {
        float d[8], m[8];
        __builtin_prefetch(row->w + (int64_t)block_bytes(fmt) * b + PF_AHEAD);
        const int nc = block_prep(fmt, row, b, d, m);
        for (int j = 0; j < nc;) {
            vf w[2][NV];
            const int got = decode(fmt, row, b, j, w);
            for (int u = 0; u < got; u++, j++, c++) {
                vf wd[NV];
                chunk_values(fmt, d, m, fmt == F_Q4_K ? j : 0, w[u], wd);
                for (int r = 0; r < R; r++) a[r] = chunk_acc(wd, x + r * ldx + c * 32, a[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) acc[r] = a[r];
}

/* One row of x against NW weight rows: per (x row, weight row) exactly tile(fmt, 1, ...)'s
 * operations in the same order, but NW independent accumulator chains interleave. Why: one row
 * of x gives tile() a single dependent chain, so FMA latency, not throughput, bounded batch-1
 * decode (SmolLM2's Q4_1 linears ran at ~17 cycles per chunk on AVX2); with four chains the
 * core overlaps them: 0.158 -> 0.111 ms for a 1536x576 Q4_1 linear on one core
 * (benchmarks/quant_matmul.py --tokens 1 --threads 1). Only for the 4-bit formats: 8-bit codes
 * decode in fewer operations, their loop is bound by memory, and interleaving four rows made the
 * Q8_0 LM head slower (2.4 -> 3.6 ms). acc[i * acc_stride] is weight row i's sum. */
#define NW 4
INLINE void tile_rows(int fmt, const row_t *rows, int b0, int b1, const float *x, vf *acc, int acc_stride) {
    vf a[NW];
    for (int i = 0; i < NW; i++) a[i] = acc[i * acc_stride];
    const int cpb = block_elems(fmt) / 32;
    for (int b = b0; b < b1; b++) {
        for (int i = 0; i < NW; i++) {
            float d[8], m[8];
            __builtin_prefetch(rows[i].w + (int64_t)block_bytes(fmt) * b + PF_AHEAD);
            const int nc = block_prep(fmt, &rows[i], b, d, m);
            int64_t c = (int64_t)b * cpb;
            for (int j = 0; j < nc;) {
                vf w[2][NV];
                const int got = decode(fmt, &rows[i], b, j, w);
                for (int u = 0; u < got; u++, j++, c++) {
                    vf wd[NV];
                    chunk_values(fmt, d, m, fmt == F_Q4_K ? j : 0, w[u], wd);
                    a[i] = chunk_acc(wd, x + c * 32, a[i]);
                }
            }
        }
    }
    for (int i = 0; i < NW; i++) acc[i * acc_stride] = a[i];
}

#define ROWS_ARGS const row_t *w, int b0, int b1, const float *x, vf *acc, int as
typedef void (*rows_fn)(ROWS_ARGS);
#define ROWS1(F, NAME) static void NAME##_rows(ROWS_ARGS) { tile_rows(F, w, b0, b1, x, acc, as); }
ROWS1(F_Q4_0, q4_0)
ROWS1(F_Q4_1, q4_1)
ROWS1(F_Q4_K, q4_k)
ROWS1(F_INT4, int4)
static const rows_fn ROWS_FNS[F_COUNT] = {NULL, q4_0_rows, q4_1_rows, q4_k_rows, NULL, int4_rows, NULL, NULL};

/* One specialization per (format, R = 1, 2, 4, 8): R accumulators in registers. Other R are
 * split into these (each row's arithmetic is the same whatever its tile). */
#define TILE_ARGS const row_t *w, int b0, int b1, const float *x, int64_t l, vf *acc
#define TILE1(F, NAME, R) static void NAME##_##R(TILE_ARGS) { tile(F, R, w, b0, b1, x, l, acc); }
#define TILES(F, NAME) TILE1(F, NAME, 1) TILE1(F, NAME, 2) TILE1(F, NAME, 4) TILE1(F, NAME, 8)
typedef void (*tile_fn)(TILE_ARGS);
#define TILE_ROW(NAME) {NAME##_1, NAME##_2, NAME##_4, NAME##_8}

TILES(F_Q8_0, q8_0)
TILES(F_Q4_0, q4_0)
TILES(F_Q4_1, q4_1)
TILES(F_Q4_K, q4_k)
TILES(F_INT8, int8)
TILES(F_INT4, int4)
TILES(F_F32, f32)
TILES(F_BF16, bf16)

static const tile_fn TILE_FNS[F_COUNT][4] = {TILE_ROW(q8_0), TILE_ROW(q4_0), TILE_ROW(q4_1), TILE_ROW(q4_k),
                                                TILE_ROW(int8), TILE_ROW(int4), TILE_ROW(f32), TILE_ROW(bf16)};

/* Which code path this build took: 2 = AVX-512, 1 = AVX2 + FMA, 0 = portable C. */
int zs_qm_isa(void) { return ISA; }

typedef struct {
    int fmt, gshift, T, N, K;
    const uint8_t *w;
    int64_t w_stride, s_stride, ldx, ldy;
    const float *scales, *mins, *x;
    float *y;
    int round_bf16;  /* the GEMM path rounds each dequantized panel to bf16 (qmatmul_bf16.c, emulated) */
} job_t;

/* Row n of the job's weight. */
INLINE row_t job_row(const job_t *j, int n) {
    return (row_t){j->w + n * j->w_stride, j->scales ? j->scales + n * j->s_stride : NULL,
                   j->mins ? j->mins + n * j->s_stride : NULL, j->gshift, j->K};
}

/* Blocks [b0, b1) of one weight row as fp32, exactly the torch twin's values (QuantizedWeight.
 * dequantize): d * q (+ m), one rounding each; block b0's first element goes to out[0]. */
INLINE void dequant_blocks(int fmt, const row_t *r, int b0, int b1, float *out) {
    const int be = block_elems(fmt);
    for (int b = b0; b < b1; b++) {
        float d[8], m[8];
        const int nc = block_prep(fmt, r, b, d, m);
        for (int j = 0; j < nc;) {
            vf q[2][NV];
            const int got = decode(fmt, r, b, j, q);
            for (int u = 0; u < got; u++, j++) {
                vf v[NV];
                chunk_values(fmt, d, m, fmt == F_Q4_K ? j : 0, q[u], v);
                memcpy(out + (int64_t)(b - b0) * be + 32 * j, v, sizeof v);
            }
        }
    }
}

/* Many rows of x (T >= GEMM_MIN_ROWS): dequantizing a panel of NP weight rows x KC columns into
 * an L1/L2-sized buffer once and running a register-blocked float GEMM on it decodes each weight
 * once per panel instead of once per RMAX rows of x (measured 1.3-1.5x the packed tile at 32
 * rows before the tile computed these same bits). Per (t, n): one vector of partial sums over k
 * in order (lane l: k = l mod VW), lanes summed at the end -- the packed tile's operations
 * exactly, so which path a call takes never changes a bit. */
#define GEMM_MIN_ROWS 16  /* a speed crossover only (SmolLM2's shapes, AVX2) */
#define NR 3
#define NP (4 * NR)  /* weight rows per panel: NP / NR micro-tiles of NR */
#define MR 4    /* rows of x per micro-tile: MR * NR accumulators + MR x vectors + 1 = 16 registers */
#define KC 1024 /* columns per panel (48 KiB of fp32, L1/L2): K up to KC keeps the sums in registers */
#define TB 96   /* rows of x per pass (their accumulators: TB * NP vectors, 36 KiB AVX2, 72 KiB AVX-512) */

/* Keeps a loaded vector in a register: left alone, gcc folds the load into each FMA that uses
 * it, MR loads instead of one (load-port bound). */
#if ISA > 0
#define IN_REG(v) __asm__("" : "+x"(v))
#else
#define IN_REG(v) (void)0
#endif

/* acc[r * NP + c] += x[r, 0:kc] . w[c, 0:kc] (vector partial sums) for r < R, c < NR. */
INLINE void gemm_tile(int R, const float *x, int64_t ldx, const float *w, int kc, vf *acc) {
    vf a[MR][NR];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NR; c++) a[r][c] = acc[r * NP + c];
    for (int k = 0; k < kc; k += VW) {
        vf wv[NR];
        for (int c = 0; c < NR; c++) {
            wv[c] = VLOAD(w + c * KC + k);
            IN_REG(wv[c]);
        }
        for (int r = 0; r < R; r++) {
            vf xv = VLOAD(x + r * ldx + k);
            IN_REG(xv);
            for (int c = 0; c < NR; c++) a[r][c] = VFMA(xv, wv[c], a[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < NR; c++) acc[r * NP + c] = a[r][c];
}

#define GEMM_ARGS const float *x, int64_t ldx, const float *w, int kc, vf *acc
static void gemm_tile1(GEMM_ARGS) { gemm_tile(1, x, ldx, w, kc, acc); }
static void gemm_tile2(GEMM_ARGS) { gemm_tile(2, x, ldx, w, kc, acc); }
static void gemm_tile3(GEMM_ARGS) { gemm_tile(3, x, ldx, w, kc, acc); }
static void gemm_tile4(GEMM_ARGS) { gemm_tile(4, x, ldx, w, kc, acc); }
static void (*const GEMM_TILES[MR + 1])(GEMM_ARGS) = {NULL, gemm_tile1, gemm_tile2, gemm_tile3, gemm_tile4};

static void round_bf16(float *v, int64_t n);  /* qmatmul_bf16.c */

/* Rows of x from which the GEMM path runs (tests check each regime's invariance). */
int zs_qm_gemm_rows(void) { return GEMM_MIN_ROWS; }

/* Output rows [n0, n1) for every row of x, panel by panel (see above). */
static void run_gemm(const job_t *j, int n0, int n1) {
    const int be = block_elems(j->fmt);
    float buf[NP * KC] __attribute__((aligned(64)));
    vf acc[TB * NP];
    memset(buf, 0, sizeof buf);  /* finite values in the rows past a short last panel (zeros or an
                                  * earlier panel's weights): their columns are computed, not stored */
    for (int t0 = 0; t0 < j->T; t0 += TB) {
        const int t1 = t0 + TB < j->T ? t0 + TB : j->T;
        for (int p0 = n0; p0 < n1; p0 += NP) {
            const int np = p0 + NP < n1 ? NP : n1 - p0;
            for (int i = 0; i < (t1 - t0) * NP; i++) acc[i] = VZERO();
            for (int k0 = 0; k0 < j->K; k0 += KC) {
                const int kc = k0 + KC < j->K ? KC : j->K - k0;  /* a multiple of the block */
                for (int i = 0; i < np; i++) {
                    const row_t r = job_row(j, p0 + i);
                    dequant_blocks(j->fmt, &r, k0 / be, (k0 + kc) / be, buf + i * KC);
                    if (j->round_bf16) round_bf16(buf + i * KC, kc);
                }
                for (int t = t0; t < t1; t += MR) {
                    const int R = t1 - t < MR ? t1 - t : MR;
                    const float *xt = j->x + t * j->ldx + k0;
                    for (int c = 0; c < NP; c += NR) GEMM_TILES[R](xt, j->ldx, buf + c * KC, kc, acc + (t - t0) * NP + c);
                }
            }
            for (int t = t0; t < t1; t++)
                for (int i = 0; i < np; i++) j->y[t * j->ldy + p0 + i] = vsum(acc[(t - t0) * NP + i]);
        }
    }
}

/* Thread `id` of `cnt`: its contiguous share of the output rows (no cache line of y is shared
 * but at the edges), in panels of PANEL rows, for blocks of TBLOCK rows of x. */
static void run(const job_t *j, int id, int cnt) {
    const tile_fn *fns = TILE_FNS[j->fmt];
    const int n0 = (int)((int64_t)j->N * id / cnt), n1 = (int)((int64_t)j->N * (id + 1) / cnt);
    if (j->T >= GEMM_MIN_ROWS) {
        run_gemm(j, n0, n1);
        return;
    }
    const int be = block_elems(j->fmt), nb = j->K / be;
    vf acc[PANEL][RMAX];
    for (int t0 = 0; t0 < j->T; t0 += TBLOCK) {
        const int t1 = t0 + TBLOCK < j->T ? t0 + TBLOCK : j->T;
        for (int p0 = n0; p0 < n1; p0 += PANEL) {
            const int p1 = p0 + PANEL < n1 ? p0 + PANEL : n1;
            for (int t = t0; t < t1; t += RMAX) {
                const int R = t1 - t < RMAX ? t1 - t : RMAX;
                /* K slice: R rows of x times the slice stay within ~16 KiB of L1 */
                const int bps = (4096 / R) / be > 1 ? (4096 / R) / be : 1;
                const float *xt = j->x + t * j->ldx;
                for (int n = p0; n < p1; n++)
                    for (int r = 0; r < R; r++) acc[n - p0][r] = VZERO();
                for (int b = 0; b < nb; b += bps) {
                    const int b1 = b + bps < nb ? b + bps : nb;
                    int n = p0;
                    if (R == 1 && ROWS_FNS[j->fmt])  /* the 4-bit formats: see tile_rows */
                        for (; n + NW <= p1; n += NW) {
                            row_t rs[NW];
                            for (int i = 0; i < NW; i++) rs[i] = job_row(j, n + i);
                            ROWS_FNS[j->fmt](rs, b, b1, xt, acc[n - p0], RMAX);
                        }
                    for (; n < p1; n++) {
                        const row_t r = job_row(j, n);
                        for (int i = 3, r0 = 0; i >= 0; i--)  /* R as 8 + 4 + 2 + 1 */
                            if (R & (1 << i)) {
                                fns[i](&r, b, b1, xt + r0 * j->ldx, j->ldx, acc[n - p0] + r0);
                                r0 += 1 << i;
                            }
                    }
                }
                for (int n = p0; n < p1; n++)
                    for (int r = 0; r < R; r++) j->y[(t + r) * j->ldy + n] = vsum(acc[n - p0][r]);
            }
        }
    }
}

/* Checks the arguments; returns the group shift (group = 32 << shift) or -1. */
static int check_args(int fmt, const float *scales, const float *mins, int group, int T, int N, int K) {
    if (fmt < 0 || fmt >= F_COUNT || T < 0 || N < 0 || K < 0 || K % 32 != 0) return -1;
    if (fmt == F_Q4_K && K % 256 != 0) return -1;
    int gshift = 0;
    while (gshift < 24 && (32 << gshift) < group) gshift++;
    if ((fmt == F_INT8 || fmt == F_INT4) && ((32 << gshift) != group || scales == NULL)) return -1;
    if (fmt == F_INT4 && mins == NULL) return -1;
    return gshift;
}

/* Threads worth using: at most `threads`, one per output row, MIN_WORK multiply-adds each. */
static int team_size(int T, int N, int K, int threads) {
    const int64_t work = (int64_t)T * N * K;
    int nt = threads < 1 ? 1 : threads;
    if (nt > N) nt = N;
    if (work / MIN_WORK < nt) nt = (int)(work / MIN_WORK) > 1 ? (int)(work / MIN_WORK) : 1;
    return nt;
}

/* out[n * ldo + k] = the weight's values as fp32 for rows [0, N). For large T a float matmul
 * (MKL) on these beats the packed kernel; see kernels/quant.py. */
int zs_dequantize_f32(int fmt, const uint8_t *w, int64_t w_stride, const float *scales, const float *mins,
                      int64_t s_stride, int group, float *out, int64_t ldo, int N, int K, int threads) {
    const int gshift = check_args(fmt, scales, mins, group, 1, N, K);
    if (gshift < 0) return -1;
    const int nb = K / block_elems(fmt);
    const int nt = (int64_t)N * K >= 4 * MIN_WORK && threads > 1 ? threads : 1;
    const job_t j = {.fmt = fmt, .gshift = gshift, .N = N, .K = K, .w = w, .w_stride = w_stride,
                     .s_stride = s_stride, .scales = scales, .mins = mins};
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int n = 0; n < N; n++) {
        const row_t r = job_row(&j, n);
        dequant_blocks(fmt, &r, 0, nb, out + n * ldo);
    }
    return 0;
}

/* The job of one call (arguments checked by check_args). */
INLINE job_t make_job(int fmt, int gshift, const uint8_t *w, int64_t w_stride, const float *scales,
                      const float *mins, int64_t s_stride, const float *x, int64_t ldx, float *y, int64_t ldy,
                      int T, int N, int K) {
    return (job_t){.fmt = fmt, .gshift = gshift, .T = T, .N = N, .K = K, .w = w, .w_stride = w_stride,
                   .s_stride = s_stride, .ldx = ldx, .ldy = ldy, .scales = scales, .mins = mins, .x = x, .y = y};
}

/* One thread's share (thread `id` of a team of `threads`) of the matmul below, for callers that
 * run their own team (csrc/decode_step.c: one team per step, not one per matmul). The shares of
 * ids 0 .. threads-1 together give exactly the result of zs_qmatmul_f32 with `threads`. */
int zs_qmatmul_f32_part(int fmt, const uint8_t *w, int64_t w_stride, const float *scales, const float *mins,
                        int64_t s_stride, int group, const float *x, int64_t ldx, float *y, int64_t ldy,
                        int T, int N, int K, int threads, int id) {
    const int gshift = check_args(fmt, scales, mins, group, T, N, K);
    if (gshift < 0) return -1;
    if (T == 0 || N == 0) return 0;
    const int nt = team_size(T, N, K, threads);
    if (id >= nt) return 0;
    const job_t job = make_job(fmt, gshift, w, w_stride, scales, mins, s_stride, x, ldx, y, ldy, T, N, K);
    run(&job, id, nt);  /* K == 0: no blocks, zeros */
    return 0;
}

/* y[t * ldy + n] = sum_k x[t * ldx + k] * w[n, k] for t < T, n < N.
 * w: row n at w + n * w_stride bytes; scales / mins (INT8, INT4): row n at + n * s_stride floats.
 * Returns 0, or -1 for arguments the format does not allow. */
int zs_qmatmul_f32(int fmt, const uint8_t *w, int64_t w_stride, const float *scales, const float *mins,
                   int64_t s_stride, int group, const float *x, int64_t ldx, float *y, int64_t ldy,
                   int T, int N, int K, int threads) {
    const int gshift = check_args(fmt, scales, mins, group, T, N, K);
    if (gshift < 0) return -1;
    if (T == 0 || N == 0) return 0;
    const int nt = team_size(T, N, K, threads);
    const job_t job = make_job(fmt, gshift, w, w_stride, scales, mins, s_stride, x, ldx, y, ldy, T, N, K);
    if (nt == 1) {
        run(&job, 0, 1);  /* no team for small matmuls: a fork costs microseconds */
    } else {
#pragma omp parallel num_threads(nt)
        {
#ifdef _OPENMP
            run(&job, omp_get_thread_num(), omp_get_num_threads());
#else
            run(&job, 0, 1);
#endif
        }
    }
    return 0;
}

#include "qmatmul_bf16.c"  /* the bf16 regime: the same job, panels rounded to bf16 */
