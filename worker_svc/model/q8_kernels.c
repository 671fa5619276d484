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
 *   avx2     8 rows a register (a group in two halves), up to 4 input rows a pass; from 24
 *            input rows, a group's weights widened once into a float panel (linear_panel);
 *   avx512   16 rows a register, up to 8 input rows a pass; from 24 input rows, two groups'
 *            weights widened once into a float panel.
 * The "avx512" level is the one the int8 and GGUF families share (AVX-512 with VNNI); these
 * products use AVX-512F alone.
 *
 * KV_Q8_LEVELS (0, 1 or 2; default 2) builds the levels up to scalar, avx2 or avx512: the
 * package builds one library per level (native.py), so a compiler that lacks a level's
 * instructions still builds the lower ones.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#define KV_THREADS() omp_get_max_threads()
#define KV_THREAD() omp_get_thread_num()
#else
#define KV_THREADS() 1
#define KV_THREAD() 0
#endif
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
/* Many input rows (a prefill chunk, a large decode batch): each panel's groups of weights are
 * widened once into floats [k][16 * per_panel] with their block scales folded in, and every input
 * row then multiplies that panel, a tile of rows a pass (a SIMD level's `tile`). In the row-tile
 * kernels below, the widening took two of every ten FMA-port slots; a panel's inner loop is only
 * loads and FMAs, and at avx512 each x value serves two groups' 32 outputs. From PANEL_MIN_ROWS
 * rows: below it the row-tile kernels measured as fast or faster on the Xeon (the widening is
 * spread over too few rows). The block scale multiplies each weight before the sum instead of
 * each block's partial sum: a rounding of its own, of the same size. Measured on the Xeon, 1
 * thread, 512 rows: avx512 120-137 -> 168-192 GFLOP/s (torch's float32 175-198), avx2 64-65 ->
 * 101-111. */
#define PANEL_MIN_ROWS 24
typedef void (*widen_fn)(const int8_t *wq, const float *wd, long nb, long k, long g, long count, float *panel);
typedef void (*tile_fn)(const float *panel, long k, const float *x, long ldx, long rows, long count, float *y,
                        long ldy, long live0, long live1, int accumulate);

/* Returns 0, or -1 when the panels' memory (one per thread, k * per_panel * 64 bytes) cannot be
 * had: the caller then runs its row-tile kernel instead. */
static int linear_panel(widen_fn widen, tile_fn tile, long per_panel, long tile_rows, const float *x, long m, long k,
                        long ldx, const int8_t *wq, const float *wd, long n, float *y, long ldy, int accumulate) {
    const long nb = (k + QK - 1) / QK, groups = (n + GR - 1) / GR, panels = (groups + per_panel - 1) / per_panel;
    const size_t floats = (size_t)k * per_panel * GR;
    float *all = aligned_alloc(64, (size_t)KV_THREADS() * floats * sizeof(float));
    if (all == NULL) return -1;
#pragma omp parallel
    {
        float *panel = all + (size_t)KV_THREAD() * floats;
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) {
            const long g = p * per_panel, count = groups - g < per_panel ? groups - g : per_panel;
            const long live0 = n - g * GR < GR ? n - g * GR : GR;
            const long live1 = count > 1 ? (n - (g + 1) * GR < GR ? n - (g + 1) * GR : GR) : 0;
            widen(wq, wd, nb, k, g, count, panel);
            for (long r = 0; r < m; r += tile_rows) {
                const long rows = m - r < tile_rows ? m - r : tile_rows;
                tile(panel, k, x + r * ldx, ldx, rows, count, y + r * ldy + g * GR, ldy, live0, live1, accumulate);
            }
        }
    }
    free(all);
    return 0;
}

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
/* avx2 panels: one group, its 16 outputs in two registers, 6 rows a pass (12 accumulators). */
#define AVX2_PANEL_TILE 6
__attribute__((target("avx2,fma"))) static void widen_avx2(const int8_t *wq, const float *wd, long nb, long k, long g,
                                                           long count, float *panel) {
    (void)count; /* one group a panel */
    const int8_t *gq = wq + g * nb * QK * GR;
    const float *gd = wd + g * nb * GR;
    for (long c = 0; c < k; c++)
        for (long h = 0; h < GR; h += 8) {
            const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(gq + c * GR + h))));
            _mm256_store_ps(panel + c * GR + h, _mm256_mul_ps(w, _mm256_loadu_ps(gd + (c / QK) * GR + h)));
        }
}
/* Rows of 8 outputs of which the first `live` are real: AVX2's masked load and store. */
__attribute__((target("avx2,fma"), always_inline)) static inline void out_avx2(float *y, __m256 v, __m256i mask,
                                                                               int accumulate) {
    _mm256_maskstore_ps(y, mask, accumulate ? _mm256_add_ps(_mm256_maskload_ps(y, mask), v) : v);
}
__attribute__((target("avx2,fma"))) static __m256i live_lanes(long live) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(live < 0 ? 0 : live)), lane);
}
/* Six rows with named accumulators: written as arrays indexed in loops (as the avx512 tile is),
 * GCC kept these twelve in memory, storing every one at every column (50 GFLOP/s on the Xeon,
 * slower than half_avx2's 65; named: 100-109). */
#define AVX2_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
__attribute__((target("avx2,fma"))) static void panel_six_avx2(const float *panel, long k, const float *x, long ldx,
                                                               float *y, long ldy, __m256i m0, __m256i m1,
                                                               int accumulate) {
#define DECL(r) __m256 p##r = _mm256_setzero_ps(), q##r = _mm256_setzero_ps();
    AVX2_ROWS(DECL)
#undef DECL
    for (long c = 0; c < k; c++) {
        const __m256 w0 = _mm256_load_ps(panel + c * GR), w1 = _mm256_load_ps(panel + c * GR + 8);
#define STEP(r)                                                 \
    {                                                           \
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + c); \
        p##r = _mm256_fmadd_ps(w0, xv, p##r);                   \
        q##r = _mm256_fmadd_ps(w1, xv, q##r);                   \
    }
        AVX2_ROWS(STEP)
#undef STEP
    }
#define OUT(r)                                            \
    out_avx2(y + r * ldy, p##r, m0, accumulate);          \
    out_avx2(y + r * ldy + 8, q##r, m1, accumulate);
    AVX2_ROWS(OUT)
#undef OUT
}
/* One row (the rows a pass of six leaves). */
__attribute__((target("avx2,fma"))) static void panel_one_avx2(const float *panel, long k, const float *x, float *y,
                                                               __m256i m0, __m256i m1, int accumulate) {
    __m256 p = _mm256_setzero_ps(), q = _mm256_setzero_ps();
    for (long c = 0; c < k; c++) {
        const __m256 xv = _mm256_broadcast_ss(x + c);
        p = _mm256_fmadd_ps(_mm256_load_ps(panel + c * GR), xv, p);
        q = _mm256_fmadd_ps(_mm256_load_ps(panel + c * GR + 8), xv, q);
    }
    out_avx2(y, p, m0, accumulate);
    out_avx2(y + 8, q, m1, accumulate);
}
__attribute__((target("avx2,fma"))) static void tile_avx2(const float *panel, long k, const float *x, long ldx,
                                                          long rows, long count, float *y, long ldy, long live0,
                                                          long live1, int accumulate) {
    (void)count, (void)live1; /* one group a panel */
    const __m256i m0 = live_lanes(live0), m1 = live_lanes(live0 - 8);
    if (rows == AVX2_PANEL_TILE) {
        panel_six_avx2(panel, k, x, ldx, y, ldy, m0, m1, accumulate);
        return;
    }
    for (long r = 0; r < rows; r++) panel_one_avx2(panel, k, x + r * ldx, y + r * ldy, m0, m1, accumulate);
}
void kv_q8_linear_avx2(const float *x, long m, long k, long ldx, const int8_t *wq, const float *wd, long n,
                       float *y, long ldy, int accumulate) {
    if (m < PANEL_MIN_ROWS ||
        linear_panel(widen_avx2, tile_avx2, 1, AVX2_PANEL_TILE, x, m, k, ldx, wq, wd, n, y, ldy, accumulate))
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
/* avx512 panels: two groups (32 outputs) in two registers, 12 rows a pass (24 accumulators). */
static __mmask16 live_mask(long live) {
    return live >= GR ? (__mmask16)0xFFFF : live <= 0 ? (__mmask16)0 : (__mmask16)((1u << live) - 1u);
}
__attribute__((target("avx512f,avx2,fma"), always_inline)) static inline void out_avx512(float *y, __m512 v,
                                                                                         __mmask16 mask,
                                                                                         int accumulate) {
    _mm512_mask_storeu_ps(y, mask, accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), v) : v);
}
#define AVX512_PANEL_TILE 12
__attribute__((target("avx512f,avx2,fma"))) static void widen_avx512(const int8_t *wq, const float *wd, long nb,
                                                                     long k, long g, long count, float *panel) {
    for (long j = 0; j < count; j++) {
        const int8_t *gq = wq + (g + j) * nb * QK * GR;
        const float *gd = wd + (g + j) * nb * GR;
        for (long c = 0; c < k; c++) {
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(gq + c * GR))));
            _mm512_store_ps(panel + (c * 2 + j) * GR, _mm512_mul_ps(w, _mm512_loadu_ps(gd + (c / QK) * GR)));
        }
    }
}
__attribute__((target("avx512f,avx2,fma"), always_inline)) static inline void panel_rows_avx512(
    const float *panel, long k, const float *x, long ldx, const long R, const long two, float *y, long ldy,
    __mmask16 m0, __mmask16 m1, int accumulate) {
    __m512 a0[AVX512_PANEL_TILE], a1[AVX512_PANEL_TILE];
    for (long r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (long c = 0; c < k; c++) {
        const __m512 w0 = _mm512_load_ps(panel + c * 2 * GR), w1 = _mm512_load_ps(panel + c * 2 * GR + GR);
        for (long r = 0; r < R; r++) {
            const __m512 xv = _mm512_set1_ps(x[r * ldx + c]);
            a0[r] = _mm512_fmadd_ps(w0, xv, a0[r]);
            if (two) a1[r] = _mm512_fmadd_ps(w1, xv, a1[r]);
        }
    }
    for (long r = 0; r < R; r++) {
        out_avx512(y + r * ldy, a0[r], m0, accumulate);
        if (two) out_avx512(y + r * ldy + GR, a1[r], m1, accumulate);
    }
}
__attribute__((target("avx512f,avx2,fma"))) static void tile_avx512(const float *panel, long k, const float *x,
                                                                    long ldx, long rows, long count, float *y,
                                                                    long ldy, long live0, long live1, int accumulate) {
    const __mmask16 m0 = live_mask(live0), m1 = live_mask(live1);
    switch (rows * 2 + (count > 1)) {
#define PANEL_CASE(R)                                                                         \
    case 2 * R: panel_rows_avx512(panel, k, x, ldx, R, 0, y, ldy, m0, m1, accumulate); break; \
    case 2 * R + 1: panel_rows_avx512(panel, k, x, ldx, R, 1, y, ldy, m0, m1, accumulate); break;
        PANEL_CASE(1) PANEL_CASE(2) PANEL_CASE(3) PANEL_CASE(4) PANEL_CASE(5) PANEL_CASE(6) PANEL_CASE(7)
        PANEL_CASE(8) PANEL_CASE(9) PANEL_CASE(10) PANEL_CASE(11) PANEL_CASE(12)
#undef PANEL_CASE
    }
}
void kv_q8_linear_avx512(const float *x, long m, long k, long ldx, const int8_t *wq, const float *wd, long n,
                         float *y, long ldy, int accumulate) {
    if (m < PANEL_MIN_ROWS ||
        linear_panel(widen_avx512, tile_avx512, 2, AVX512_PANEL_TILE, x, m, k, ldx, wq, wd, n, y, ldy, accumulate))
        linear(group_avx512, AVX512_TILE, x, m, k, ldx, wq, wd, n, y, ldy, accumulate);
}
#endif /* KV_Q8_LEVELS >= 2 */
#endif /* KV_X86 && KV_Q8_LEVELS >= 1 */
