/* Int8 weight products for the CPU, in blocks of 32 (see q8.py, which builds and loads this).
 *
 * A weight matrix [N, K] is stored as int8 values in [-127, 127] with one float32 scale per
 * row and block of 32 columns (K padded with zeros to a multiple of 32). Each call quantizes
 * its float32 input the same way (per row and block of 32: scale = max|x| / 127), so one
 * block's dot product is an exact integer sum of 32 int8 products, scaled by the two blocks'
 * scales and added up in float32. Fine-grained input scales keep the quiet channels of a row
 * their resolution next to the outlier channels of Llama's activations.
 *
 * One function per instruction set, chosen once by the caller (q8.py):
 *   scalar   plain C: any CPU, and the reference the others are tested against;
 *   avx2     vpmaddubsw on |x| (u8) and w * sign(x) (s8): both at most 127 in magnitude, so an
 *            adjacent pair's sum (at most 2 * 127 * 127 = 32258) never saturates its int16 lane
 *            (fbgemm's AVX2 path feeds u8 inputs up to 255 there and does saturate);
 *   avx512   vpdpbusd (AVX-512 VNNI): the same u8 x s8 products summed straight into int32,
 *            two blocks per 512-bit register.
 * The integer sums are exact at every level; only the float32 order of adding up the blocks
 * differs (tests compare the levels within float rounding).
 *
 * KV_Q8_LEVELS (0, 1 or 2; default 2) builds the levels up to scalar, avx2 or avx512: the
 * package builds one library per level (native.py), so a compiler that lacks a level's
 * instructions still builds the lower ones.
 */
#include <math.h>
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

/* x [M, K] float32 (row stride ldx) -> xq [M, Kp] int8, xd [M, Kp / 32] float32, Kp = K
 * rounded up to 32 (the padding is zero). Rounds half to even (rintf), as numpy's rint. */
void kv_q8_quantize(const float *x, long m, long k, long ldx, int8_t *xq, float *xd) {
    const long kp = (k + QK - 1) / QK * QK, nb = kp / QK;
    for (long r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        int8_t *qr = xq + r * kp;
        for (long b = 0; b < nb; b++) {
            const long lo = b * QK, hi = lo + QK < k ? lo + QK : k;
            float amax = 0.0f;
            for (long j = lo; j < hi; j++) amax = fmaxf(amax, fabsf(xr[j]));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            xd[r * nb + b] = d;
            for (long j = lo; j < hi; j++) qr[j] = (int8_t)rintf(xr[j] * inv);
            for (long j = hi; j < lo + QK; j++) qr[j] = 0;
        }
    }
}

/* One weight row times one input row (nb blocks), and four weight rows (kp bytes apart) times
 * one input row: the tile shares each input block's load and |x| among four rows. */
typedef float (*dot_fn)(const int8_t *w, const float *wd, const int8_t *x, const float *xd, long nb);
typedef void (*dot4_fn)(const int8_t *w, long kp, const float *wd, const int8_t *x, const float *xd, long nb,
                        float out[4]);

/* y [M, N] (row stride ldy) = (accumulate ? y : 0) + x w^T, x given quantized as above;
 * w: wq [N, Kp] int8, wd [N, Kp / 32]. Tiles of four weight rows are shared out among OpenMP
 * threads, each tile (4 * Kp bytes, kept in L1) multiplied with every input row. */
static void gemm(dot_fn dot, dot4_fn dot4, const int8_t *wq, const float *wd, long n, long kp,
                 const int8_t *xq, const float *xd, long m, float *y, long ldy, int accumulate) {
    const long nb = kp / QK, tiles = (n + 3) / 4;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < tiles; t++) {
        const long i0 = t * 4, rows = n - i0 < 4 ? n - i0 : 4;
        for (long r = 0; r < m; r++) {
            float s[4];
            if (rows == 4) {
                dot4(wq + i0 * kp, kp, wd + i0 * nb, xq + r * kp, xd + r * nb, nb, s);
            } else {
                for (long j = 0; j < rows; j++)
                    s[j] = dot(wq + (i0 + j) * kp, wd + (i0 + j) * nb, xq + r * kp, xd + r * nb, nb);
            }
            float *yr = y + r * ldy + i0;
            for (long j = 0; j < rows; j++) yr[j] = accumulate ? yr[j] + s[j] : s[j];
        }
    }
}

/* The whole product in one call (one ctypes call per product): x [M, K] float32 (row stride
 * ldx) is quantized into scratch (M * Kp bytes, then M * Kp / 32 floats, 4-byte aligned),
 * then multiplied with w (see gemm). */
#define KV_Q8_LINEAR(NAME, DOT, DOT4)                                                                    \
    void NAME(const float *x, long m, long k, long ldx, const int8_t *wq, const float *wd, long n, \
              float *y, long ldy, int accumulate, void *scratch) {                                \
        const long kp = (k + QK - 1) / QK * QK;                                                    \
        int8_t *xq = (int8_t *)scratch;                                                            \
        float *xd = (float *)(xq + m * kp);                                                        \
        kv_q8_quantize(x, m, k, ldx, xq, xd);                                                      \
        gemm(DOT, DOT4, wq, wd, n, kp, xq, xd, m, y, ldy, accumulate);                                \
    }

static float dot_scalar(const int8_t *w, const float *wd, const int8_t *x, const float *xd, long nb) {
    float acc = 0.0f;
    for (long b = 0; b < nb; b++) {
        int32_t s = 0;
        for (int j = 0; j < QK; j++) s += (int32_t)w[b * QK + j] * (int32_t)x[b * QK + j];
        acc += (float)s * (wd[b] * xd[b]);
    }
    return acc;
}
static void dot4_scalar(const int8_t *w, long kp, const float *wd, const int8_t *x, const float *xd, long nb,
                        float out[4]) {
    for (int j = 0; j < 4; j++) out[j] = dot_scalar(w + j * kp, wd + j * nb, x, xd, nb);
}
KV_Q8_LINEAR(kv_q8_linear_scalar, dot_scalar, dot4_scalar)

#if defined(KV_X86) && KV_Q8_LEVELS >= 1
__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) static float dot_avx2(const int8_t *w, const float *wd, const int8_t *x,
                                                          const float *xd, long nb) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + b * QK));
        const __m256i ax = _mm256_sign_epi8(xv, xv); /* |x| as u8 */
        const __m256i sw = _mm256_sign_epi8(wv, xv); /* w * sign(x) */
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), ones); /* 8 x int32 */
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(wd[b] * xd[b]), acc);
    }
    return hsum256(acc);
}
__attribute__((target("avx2,fma"))) static void dot4_avx2(const int8_t *w, long kp, const float *wd,
                                                           const int8_t *x, const float *xd, long nb,
                                                           float out[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long b = 0; b < nb; b++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + b * QK));
        const __m256i ax = _mm256_sign_epi8(xv, xv);
        for (int j = 0; j < 4; j++) {
            const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + j * kp + b * QK));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv)), ones);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(wd[j * nb + b] * xd[b]), acc[j]);
        }
    }
    /* the four sums at once: pairwise adds, then the two 128-bit halves */
    const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 s = _mm256_hadd_ps(s01, s23);
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
KV_Q8_LINEAR(kv_q8_linear_avx2, dot_avx2, dot4_avx2)

#if KV_Q8_LEVELS >= 2

#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"
__attribute__((target(AVX512_TARGET))) static float dot_avx512(const int8_t *w, const float *wd, const int8_t *x,
                                                               const float *xd, long nb) {
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc = _mm512_setzero_ps();
    long b = 0;
    for (; b + 1 < nb; b += 2) { /* two blocks: int32 lanes 0-7 the first, 8-15 the second */
        const __m512i wv = _mm512_loadu_si512((const void *)(w + b * QK));
        const __m512i xv = _mm512_loadu_si512((const void *)(x + b * QK));
        const __mmask64 neg = _mm512_movepi8_mask(xv);
        const __m512i ax = _mm512_abs_epi8(xv);
        const __m512i sw = _mm512_mask_sub_epi8(wv, neg, zero, wv);
        const __m512i p = _mm512_dpbusd_epi32(zero, ax, sw);
        const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(wd[b] * xd[b]), _mm512_set1_ps(wd[b + 1] * xd[b + 1]));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc);
    }
    float tail = 0.0f;
    if (b < nb) { /* an odd last block */
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + b * QK));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + b * QK));
        const __mmask32 neg = _mm256_movepi8_mask(xv);
        const __m256i ax = _mm256_abs_epi8(xv);
        const __m256i sw = _mm256_mask_sub_epi8(wv, neg, _mm256_setzero_si256(), wv);
        const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sw);
        tail = hsum256(_mm256_mul_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(wd[b] * xd[b])));
    }
    return _mm512_reduce_add_ps(acc) + tail;
}
__attribute__((target(AVX512_TARGET))) static void dot4_avx512(const int8_t *w, long kp, const float *wd,
                                                               const int8_t *x, const float *xd, long nb,
                                                               float out[4]) {
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    long b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m512i xv = _mm512_loadu_si512((const void *)(x + b * QK));
        const __mmask64 neg = _mm512_movepi8_mask(xv);
        const __m512i ax = _mm512_abs_epi8(xv);
        for (int j = 0; j < 4; j++) {
            const __m512i wv = _mm512_loadu_si512((const void *)(w + j * kp + b * QK));
            const __m512i p = _mm512_dpbusd_epi32(zero, ax, _mm512_mask_sub_epi8(wv, neg, zero, wv));
            const float *d = wd + j * nb + b;
            const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[0] * xd[b]), _mm512_set1_ps(d[1] * xd[b + 1]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[j]);
        }
    }
    for (int j = 0; j < 4; j++) {
        out[j] = _mm512_reduce_add_ps(acc[j]);
        if (b < nb) out[j] += dot_avx512(w + j * kp + b * QK, wd + j * nb + b, x + b * QK, xd + b, 1);
    }
}
KV_Q8_LINEAR(kv_q8_linear_avx512, dot_avx512, dot4_avx512)
#endif /* KV_Q8_LEVELS >= 2 */
#endif /* KV_X86 && KV_Q8_LEVELS >= 1 */
