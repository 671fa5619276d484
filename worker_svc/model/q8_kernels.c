/* Weight-only int8 products for the CPU (see q8.py, which builds and loads this).
 *
 * A weight matrix [N, K] is int8 in [-127, 127] with one float32 scale per row and block of 32
 * columns; the activations stay float32 (no input rounding: int8 weights with float inputs
 * measured 0.973 top-1 agreement with float32 on SmolLM2 where int8 inputs too gave 0.964).
 *
 * Layout (q8.py, Q8Weight): the rows in groups of 16 (N padded with zero rows to a multiple of
 * 16), and within a group, block by block, the 32 columns one after the other, each column the
 * 16 rows' bytes: wq [G][nb][32][16] int8, wd [G][nb][16] float32. So one column of a group is
 * one 16-byte load that widens to a vector of 16 floats (one lane per row), multiplied by a
 * broadcast input value: no horizontal sums, and the same converted column serves several
 * input rows. A block's partial sums are then scaled by its 16 scales at once:
 *     y[r][i] = sum_b wd[b][i] * sum_{c < 32} wq[b][c][i] * x[r][32 b + c].
 * K is padded to whole blocks with zero weights, but x is read only up to K.
 *
 * One function per instruction set, chosen once by the caller (q8.py):
 *   scalar   C over the same layout for any CPU (4-float vectors of the GCC / Clang vector
 *            extension): a block widened once into floats with its scales folded in, then
 *            multiplied by up to 64 input rows;
 *   avx2     8 rows a register (a group in two halves), up to 4 input rows a pass;
 *   avx512   16 rows a register, up to 8 input rows a pass.
 * The "avx512" level is the one the int8 and GGUF families share (AVX-512 with VNNI); these
 * products use AVX-512F alone.
 *
 * KV_Q8_LEVELS (0, 1 or 2; default 2) builds the levels up to scalar, avx2 or avx512: the
 * package builds one library per level (native.py), so a compiler that lacks a level's
 * instructions still builds the lower ones.
 */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KV_X86 1
#endif

#ifndef KV_Q8_LEVELS
#define KV_Q8_LEVELS 2
#endif
#define QK 32
#define GR 16 /* rows in a group */

/* y rows [r0, r0 + rows) of a group g's 16 outputs (only the first `live` are real rows):
 * one function per level, same arguments. */
typedef void (*group_fn)(const int8_t *gq, const float *gd, long nb, long k, const float *x, long ldx, long rows,
                         float *y, long ldy, long live, int accumulate);

static void store_rows(const float *s, float *y, long live, int accumulate) {
    for (long i = 0; i < live; i++) y[i] = accumulate ? y[i] + s[i] : s[i];
}

#define SCALAR_TILE 64
/* 4 floats as one value (GCC / Clang vector extension: SSE2 on any x86-64, NEON on ARM). */
typedef float v4f __attribute__((vector_size(16)));

/* Plain C for any CPU: each block of the group is widened once, its scales folded in, into a
 * float [32][16] table (2 KB, in L1) that every input row of the tile then multiplies, two
 * rows at a time so that each table load serves both and their sums are independent chains:
 * the widening is the costly part without SIMD. */
static void group_scalar(const int8_t *gq, const float *gd, long nb, long k, const float *x, long ldx, long rows,
                         float *y, long ldy, long live, int accumulate) {
    v4f acc[SCALAR_TILE][GR / 4], wf[QK][GR / 4];
    memset(acc, 0, sizeof(v4f) * (GR / 4) * (size_t)rows);
    for (long b = 0; b < nb; b++) {
        const long cols = k - b * QK < QK ? k - b * QK : QK;
        const int8_t *q = gq + b * QK * GR;
        for (long c = 0; c < cols; c++)
            for (int i = 0; i < GR; i++) wf[c][i / 4][i % 4] = (float)q[c * GR + i] * gd[b * GR + i];
        long r = 0;
        for (; r + 1 < rows; r += 2) {
            const float *x0 = x + r * ldx + b * QK, *x1 = x0 + ldx;
            v4f a0 = acc[r][0], a1 = acc[r][1], a2 = acc[r][2], a3 = acc[r][3];
            v4f b0 = acc[r + 1][0], b1 = acc[r + 1][1], b2 = acc[r + 1][2], b3 = acc[r + 1][3];
            for (long c = 0; c < cols; c++) {
                const v4f u = {x0[c], x0[c], x0[c], x0[c]}, v = {x1[c], x1[c], x1[c], x1[c]};
                a0 += wf[c][0] * u, a1 += wf[c][1] * u, a2 += wf[c][2] * u, a3 += wf[c][3] * u;
                b0 += wf[c][0] * v, b1 += wf[c][1] * v, b2 += wf[c][2] * v, b3 += wf[c][3] * v;
            }
            acc[r][0] = a0, acc[r][1] = a1, acc[r][2] = a2, acc[r][3] = a3;
            acc[r + 1][0] = b0, acc[r + 1][1] = b1, acc[r + 1][2] = b2, acc[r + 1][3] = b3;
        }
        if (r < rows) {
            const float *xr = x + r * ldx + b * QK;
            for (long c = 0; c < cols; c++) {
                const v4f u = {xr[c], xr[c], xr[c], xr[c]};
                for (int j = 0; j < GR / 4; j++) acc[r][j] += wf[c][j] * u;
            }
        }
    }
    for (long r = 0; r < rows; r++) {
        float s[GR];
        memcpy(s, acc[r], sizeof s);
        store_rows(s, y + r * ldy, live, accumulate);
    }
}

/* y [M, N] (row stride ldy) = (accumulate ? y : 0) + x w^T: the groups shared out among the
 * OpenMP threads; each group (nb * 576 bytes: 27 KB for K = 1536) stays in cache while every
 * input row passes over it. */
static void linear(group_fn fn, long row_tile, const float *x, long m, long k, long ldx, const int8_t *wq,
                   const float *wd, long n, float *y, long ldy, int accumulate) {
    const long nb = (k + QK - 1) / QK, groups = (n + GR - 1) / GR;
#pragma omp parallel for schedule(static)
    for (long g = 0; g < groups; g++) {
        const long live = n - g * GR < GR ? n - g * GR : GR;
        for (long r = 0; r < m; r += row_tile) {
            const long rows = m - r < row_tile ? m - r : row_tile;
            fn(wq + g * nb * QK * GR, wd + g * nb * GR, nb, k, x + r * ldx, ldx, rows, y + r * ldy + g * GR, ldy,
               live, accumulate);
        }
    }
}

void kv_q8_linear_scalar(const float *x, long m, long k, long ldx, const int8_t *wq, const float *wd, long n,
                         float *y, long ldy, int accumulate) {
    linear(group_scalar, SCALAR_TILE, x, m, k, ldx, wq, wd, n, y, ldy, accumulate);
}

#if defined(KV_X86) && KV_Q8_LEVELS >= 1
#define AVX2_TILE 4
/* One half of a group (8 rows, `half` 0 or 1) for R input rows; R is a constant in each
 * caller (group_avx2's switch), so the partial sums stay in registers; U = 4 / R chains a row
 * as in rows_avx512. */
__attribute__((target("avx2,fma"), always_inline)) static inline void half_avx2(
    const int8_t *gq, const float *gd, long nb, long k, const float *x, long ldx, const long R, int half, float *s) {
    const long U = R >= 4 ? 1 : 4 / R;
    __m256 acc[AVX2_TILE], part[AVX2_TILE][4];
    for (long r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const long cols = k - b * QK < QK ? k - b * QK : QK;
        const int8_t *q = gq + b * QK * GR + half * 8;
        const float *xb = x + b * QK;
        for (long r = 0; r < R; r++)
            for (long u = 0; u < U; u++) part[r][u] = _mm256_setzero_ps();
        long c = 0;
        for (; c + U <= cols; c += U)
            for (long u = 0; u < U; u++) {
                const __m128i raw = _mm_loadl_epi64((const __m128i *)(q + (c + u) * GR));
                const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
                for (long r = 0; r < R; r++)
                    part[r][u] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(xb + r * ldx + c + u), part[r][u]);
            }
        for (; c < cols; c++) {
            const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + c * GR))));
            for (long r = 0; r < R; r++) part[r][0] = _mm256_fmadd_ps(w, _mm256_broadcast_ss(xb + r * ldx + c), part[r][0]);
        }
        const __m256 d = _mm256_loadu_ps(gd + b * GR + half * 8);
        for (long r = 0; r < R; r++) {
            __m256 sum = part[r][0];
            for (long u = 1; u < U; u++) sum = _mm256_add_ps(sum, part[r][u]);
            acc[r] = _mm256_fmadd_ps(sum, d, acc[r]);
        }
    }
    for (long r = 0; r < R; r++) _mm256_storeu_ps(s + r * GR + half * 8, acc[r]);
}
__attribute__((target("avx2,fma"))) static void group_avx2(const int8_t *gq, const float *gd, long nb, long k,
                                                           const float *x, long ldx, long rows, float *y, long ldy,
                                                           long live, int accumulate) {
    float s[AVX2_TILE * GR];
    for (int half = 0; half < 2; half++) {
        switch (rows) {
        case 1: half_avx2(gq, gd, nb, k, x, ldx, 1, half, s); break;
        case 2: half_avx2(gq, gd, nb, k, x, ldx, 2, half, s); break;
        case 3: half_avx2(gq, gd, nb, k, x, ldx, 3, half, s); break;
        default: half_avx2(gq, gd, nb, k, x, ldx, 4, half, s); break;
        }
    }
    for (long r = 0; r < rows; r++) store_rows(s + r * GR, y + r * ldy, live, accumulate);
}
void kv_q8_linear_avx2(const float *x, long m, long k, long ldx, const int8_t *wq, const float *wd, long n,
                       float *y, long ldy, int accumulate) {
    linear(group_avx2, AVX2_TILE, x, m, k, ldx, wq, wd, n, y, ldy, accumulate);
}

#if KV_Q8_LEVELS >= 2
#define AVX512_TILE 8
/* A group for R input rows (R constant in each caller, as in half_avx2). With few rows one
 * chain of FMAs a row would wait on the FMA latency column after column, so the columns are
 * dealt to U = 4 / R chains (at least 1), added up at the block's end. */
__attribute__((target("avx512f,avx2,fma"), always_inline)) static inline void rows_avx512(
    const int8_t *gq, const float *gd, long nb, long k, const float *x, long ldx, const long R, float *y, long ldy,
    long live, int accumulate) {
    const long U = R >= 4 ? 1 : 4 / R;
    __m512 acc[AVX512_TILE], part[AVX512_TILE][4];
    for (long r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const long cols = k - b * QK < QK ? k - b * QK : QK;
        const int8_t *q = gq + b * QK * GR;
        const float *xb = x + b * QK;
        for (long r = 0; r < R; r++)
            for (long u = 0; u < U; u++) part[r][u] = _mm512_setzero_ps();
        long c = 0;
        for (; c + U <= cols; c += U)
            for (long u = 0; u < U; u++) {
                const __m128i raw = _mm_loadu_si128((const __m128i *)(q + (c + u) * GR));
                const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
                for (long r = 0; r < R; r++)
                    part[r][u] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[r * ldx + c + u]), part[r][u]);
            }
        for (; c < cols; c++) {
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + c * GR))));
            for (long r = 0; r < R; r++) part[r][0] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[r * ldx + c]), part[r][0]);
        }
        const __m512 d = _mm512_loadu_ps(gd + b * GR);
        for (long r = 0; r < R; r++) {
            __m512 sum = part[r][0];
            for (long u = 1; u < U; u++) sum = _mm512_add_ps(sum, part[r][u]);
            acc[r] = _mm512_fmadd_ps(sum, d, acc[r]);
        }
    }
    const __mmask16 mask = (__mmask16)((1u << live) - 1u);
    for (long r = 0; r < R; r++) {
        float *yr = y + r * ldy;
        const __m512 prev = accumulate ? _mm512_maskz_loadu_ps(mask, yr) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(yr, mask, _mm512_add_ps(prev, acc[r]));
    }
}
__attribute__((target("avx512f,avx2,fma"))) static void group_avx512(const int8_t *gq, const float *gd, long nb,
                                                                     long k, const float *x, long ldx, long rows,
                                                                     float *y, long ldy, long live, int accumulate) {
    switch (rows) {
#define ROWS_CASE(R) \
    case R: rows_avx512(gq, gd, nb, k, x, ldx, R, y, ldy, live, accumulate); break;
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
    default: rows_avx512(gq, gd, nb, k, x, ldx, 8, y, ldy, live, accumulate); break;
#undef ROWS_CASE
    }
}
void kv_q8_linear_avx512(const float *x, long m, long k, long ldx, const int8_t *wq, const float *wd, long n,
                         float *y, long ldy, int accumulate) {
    linear(group_avx512, AVX512_TILE, x, m, k, ldx, wq, wd, n, y, ldy, accumulate);
}
#endif /* KV_Q8_LEVELS >= 2 */
#endif /* KV_X86 && KV_Q8_LEVELS >= 1 */
