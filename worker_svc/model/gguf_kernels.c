/* Products of float32 activations with a GGUF file's own quantized blocks, the blocks read
 * where they lie (see gguf_quant.py, which builds and loads this).
 *
 * A weight [N, K] is N rows of K / 32 blocks, each row a run of bytes, in llama.cpp's block
 * layouts (K is a multiple of 32 in all three):
 *   Q8_0  34 bytes: fp16 d, int8 q[32]                 w_j = d q_j
 *   Q4_0  18 bytes: fp16 d, u8 nib[16]                 w_j = d (q_j - 8)
 *   Q4_1  20 bytes: fp16 d, fp16 m, u8 nib[16]         w_j = d q_j + m
 * where q_j (j < 16) is nib[j] & 15 and q_{j+16} is nib[j] >> 4; and the K formats, K a
 * multiple of 256 (layouts in kvfleet_models/gguf_blocks.py):
 *   Q4_K 144 bytes a 256: w_j = d sc_i q_j - dmin m_i, 6-bit sc_i, m_i per sub-block i of 32
 *   Q6_K 210 bytes a 256: w_j = d sc_g (q_j - 32), int8 sc_g per group g of 16, q_j 0..63
 *
 * Each call quantizes its activations per row and block of 32 (llama.cpp's Q8_1 for
 * activations: scale s = max|x| / 127, int8 a_j = rint(x_j / s), and the block's integer sum
 * A = sum a_j), so one block's product is integers times two scales:
 *   Q8_0  d s sum q_j a_j
 *   Q4_0  d s (sum q_j a_j - 8 A)
 *   Q4_1  d s sum q_j a_j + m s A
 *   Q4_K  (d sc_i) s sum q_j a_j - (dmin m_i) s A                 (sub-block i = the block)
 *   Q6_K  d s (sc_g (sum_g q_j a_j - 32 A_g) + sc_g' (...))      (its two groups of 16)
 * where A_g, a group's sum, comes from the product itself (sum 32 a_j: one more u8 x s8).
 * The integer sums are exact at every level (the nibbles are at most 15, so even a u8 x s8
 * pair sum in a 16-bit lane stays far from saturating, and Q6_K's 0..63 only reaches 2 * 63 *
 * 127; its sc_g times a group's sum, at most 128 * 16 * 32 * 127, fits int32); only the float32 order of adding up
 * the blocks differs between levels, which the tests allow for.
 *
 * Levels, chosen once by the caller (the q8 kernels' levels and KV_Q8_LEVELS):
 *   scalar  plain C, with its own fp16 conversion: the reference;
 *   avx2    vpmaddubsw: the nibbles (u8) against the activations (s8) for Q4_*, and for Q8_0
 *           |w| (u8, up to 128) against a * sign(w): a pair sums to at most 2 * 128 * 127;
 *   avx512  vpdpbusd (AVX-512 VNNI) on the same operands, two blocks per 512-bit register;
 *   amx     avx512, with the row groups' products of 16 or more activation rows on AMX tiles
 *           (KV_GGUF_AMX; see kv_gguf_gemm16_amx), the same floats as avx512.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KV_X86 1
#endif

#ifndef KV_Q8_LEVELS
#define KV_Q8_LEVELS 2
#endif
#define QK 32
#define QK_K 256

enum { KV_Q8_0 = 0, KV_Q4_0 = 1, KV_Q4_1 = 2, KV_Q4_K = 3, KV_Q6_K = 4 };
static const long BLOCK_BYTES[5] = {34, 18, 20, 144, 210};
static const long BLOCK_WEIGHTS[5] = {QK, QK, QK, QK_K, QK_K};
#define Q4K_BYTES 144
#define Q6K_BYTES 210

/* IEEE half -> float, subnormals included (the reference level's own; the SIMD levels use F16C). */
static float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float v;
    if (exp == 0) {
        v = ldexpf((float)man, -24);
    } else if (exp == 31) {
        v = man ? NAN : INFINITY;
    } else {
        v = ldexpf((float)(man | 0x400), (int)exp - 25);
    }
    uint32_t bits;
    memcpy(&bits, &v, 4);
    bits |= sign;
    memcpy(&v, &bits, 4);
    return v;
}

/* Q4_K's 12 bytes -> 8 scales and 8 mins, 6 bits each. */
static inline void q4k_scales(const uint8_t *p, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63;
        mn[j] = p[j + 4] & 63;
        sc[j + 4] = (uint8_t)((p[j + 8] & 15) | ((p[j] >> 6) << 4));
        mn[j + 4] = (uint8_t)((p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4));
    }
}

/* Q6_K's chunk c (0..7) of 32 weights: where its low four and high two bits lie, and the
 * shifts that take them out (see gguf_blocks.py). */
static inline const uint8_t *q6k_low(const uint8_t *blk, int c) { return blk + 64 * (c >> 2) + 32 * (c & 1); }
static inline const uint8_t *q6k_high(const uint8_t *blk, int c) { return blk + 128 + 32 * (c >> 2); }
static inline int q6k_low_shift(int c) { return 4 * ((c >> 1) & 1); }
static inline int q6k_high_shift(int c) { return 2 * (c & 3); }

/* x [M, K] float32 (row stride ldx, K a multiple of 32) -> a [M, K] int8, s [M, K / 32]
 * float32, sums [M, K / 32] int32. Rounds half to even (rintf). */
void kv_gguf_quantize(const float *x, long m, long k, long ldx, int8_t *a, float *s, int32_t *sums) {
    const long nb = k / QK;
#pragma omp parallel for schedule(static) if (m >= 8)
    for (long r = 0; r < m; r++) {
        for (long b = 0; b < nb; b++) {
            const float *xb = x + r * ldx + b * QK;
            int8_t *ab = a + r * k + b * QK;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(xb[j]));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t sum = 0;
            for (int j = 0; j < QK; j++) {
                ab[j] = (int8_t)rintf(xb[j] * inv);
                sum += ab[j];
            }
            s[r * nb + b] = d;
            sums[r * nb + b] = sum;
        }
    }
}

/* One weight row (nb blocks of format qtype) times one quantized activation row, read from
 * the blocks as they lie: the path of a single activation row (a batch-1 decode). */
typedef float (*dot_fn)(int qtype, const uint8_t *w, const int8_t *a, const float *s, const int32_t *sums, long nb);
/* Four weight rows (row_bytes apart) times one activation row: the tile shares each
 * activation block's load among the rows, and its four sums are independent chains. */
typedef void (*dot4_fn)(int qtype, const uint8_t *w, long row_bytes, const int8_t *a, const float *s,
                        const int32_t *sums, long nb, float out[4]);

/* With several activation rows, each weight row is first decoded once into a contiguous form
 * (``decode_row``) that every activation row then reads from L1: q [K] int8 (Q8_0's values,
 * or the Q4 nibbles 0..15), d [nb] its scales and, for Q4, mn [nb] the block's offset (Q4_1's
 * m, Q4_0's -8 d, Q4_K's -dmin m_i, its d being d sc_i), so that w = d q + mn. Q6_K's: q its
 * 0..63 and d [2 nb] per group of 16 (d sc_g), w = d (q - 32). The dots of a decoded row: */
typedef float (*dotd_fn)(int is_signed, const int8_t *q, const float *d, const float *mn, const int8_t *a,
                         const float *s, const int32_t *sums, long nb);
typedef float (*dotd6_fn)(const int8_t *q, const float *d16, const int8_t *a, const float *s, long nb);

/* Longest row decoded (on the stack); a longer one takes the single-row path for every row. */
#define KV_MAX_DECODED 16384

static void decode_k_row(int qtype, const uint8_t *row, long nb, float (*half)(const uint8_t *), int8_t *q, float *d,
                         float *mn) {
    for (long sb = 0; sb < nb / 8; sb++) {
        int8_t *qb = q + sb * QK_K;
        if (qtype == KV_Q4_K) {
            const uint8_t *blk = row + sb * Q4K_BYTES;
            const float dd = half(blk), dmin = half(blk + 2);
            uint8_t sc[8], mins[8];
            q4k_scales(blk + 4, sc, mins);
            for (int i = 0; i < 8; i++) {
                const uint8_t *nib = blk + 16 + 32 * (i >> 1);
                for (int l = 0; l < QK; l++) qb[i * QK + l] = (int8_t)((nib[l] >> (4 * (i & 1))) & 15);
                d[sb * 8 + i] = dd * (float)sc[i];
                mn[sb * 8 + i] = -dmin * (float)mins[i];
            }
        } else {
            const uint8_t *blk = row + sb * Q6K_BYTES;
            const float dd = half(blk + 208);
            for (int c = 0; c < 8; c++) {
                const uint8_t *lo = q6k_low(blk, c), *hi = q6k_high(blk, c);
                const int ls = q6k_low_shift(c), hs = q6k_high_shift(c);
                for (int l = 0; l < QK; l++) qb[c * QK + l] = (int8_t)(((lo[l] >> ls) & 15) | (((hi[l] >> hs) & 3) << 4));
            }
            for (int g = 0; g < 16; g++) d[sb * 16 + g] = dd * (float)((const int8_t *)(blk + 192))[g];
        }
    }
}

static void decode_row(int qtype, const uint8_t *row, long nb, float (*half)(const uint8_t *), int8_t *q, float *d,
                       float *mn) {
    const long bb = BLOCK_BYTES[qtype];
    if (qtype >= KV_Q4_K) {
        decode_k_row(qtype, row, nb, half, q, d, mn);
        return;
    }
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        d[b] = half(blk);
        if (qtype == KV_Q8_0) {
            memcpy(q + b * QK, blk + 2, QK);
            mn[b] = 0.0f;
        } else {
            const uint8_t *nib = blk + (qtype == KV_Q4_0 ? 2 : 4);
            for (int j = 0; j < 16; j++) {
                q[b * QK + j] = (int8_t)(nib[j] & 15);
                q[b * QK + j + 16] = (int8_t)(nib[j] >> 4);
            }
            mn[b] = qtype == KV_Q4_0 ? -8.0f * d[b] : half(blk + 2);
        }
    }
}

/* y [M, N] (row stride ldy) = (accumulate ? y : 0) + (x w^T) * scale (scale [N], or NULL for
 * none: q's attention scale, kept beside the blocks rather than folded into their fp16).
 * Rows of w are shared out among OpenMP threads. */
static inline void put(float *y, long ldy, long r, long i, float v, const float *scale, int accumulate) {
    const float x = v * (scale ? scale[i] : 1.0f);
    float *yr = y + r * ldy + i;
    *yr = accumulate ? *yr + x : x;
}

/* Tiles of four weight rows are shared out among OpenMP threads; one activation row (a
 * batch-1 decode) reads the tile's blocks where they lie, several read each of its rows
 * decoded once. */
static void gemm(dot_fn dot, dot4_fn dot4, dotd_fn dotd, dotd6_fn dotd6, float (*half)(const uint8_t *), int qtype,
                 const uint8_t *w, long n, long k, const int8_t *a, const float *s, const int32_t *sums, long m,
                 const float *scale, float *y, long ldy, int accumulate) {
    const long nb = k / QK, row_bytes = k / BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype], tiles = (n + 3) / 4;
    const int decode = m > 1 && k <= KV_MAX_DECODED;
#pragma omp parallel
    {
        int8_t q[decode ? k : 1];
        float d[decode ? 2 * nb : 1], mn[decode ? nb : 1]; /* Q6_K's d: one per 16 */
#pragma omp for schedule(static)
        for (long t = 0; t < tiles; t++) {
            const long i0 = t * 4, rows = n - i0 < 4 ? n - i0 : 4;
            if (decode) {
                for (long i = i0; i < i0 + rows; i++) {
                    decode_row(qtype, w + i * row_bytes, nb, half, q, d, mn);
                    for (long r = 0; r < m; r++) {
                        const int8_t *ar = a + r * k;
                        const float v = qtype == KV_Q6_K
                                            ? dotd6(q, d, ar, s + r * nb, nb)
                                            : dotd(qtype == KV_Q8_0, q, d, mn, ar, s + r * nb, sums + r * nb, nb);
                        put(y, ldy, r, i, v, scale, accumulate);
                    }
                }
            } else if (rows == 4) {
                for (long r = 0; r < m; r++) {
                    float v[4];
                    dot4(qtype, w + i0 * row_bytes, row_bytes, a + r * k, s + r * nb, sums + r * nb, nb, v);
                    for (int j = 0; j < 4; j++) put(y, ldy, r, i0 + j, v[j], scale, accumulate);
                }
            } else {
                for (long i = i0; i < i0 + rows; i++)
                    for (long r = 0; r < m; r++)
                        put(y, ldy, r, i, dot(qtype, w + i * row_bytes, a + r * k, s + r * nb, sums + r * nb, nb), scale,
                            accumulate);
            }
        }
    }
}

#define KV_GGUF_GEMM(NAME, DOT, DOT4, DOTD, DOTD6, HALF)                                                     \
    void NAME(int qtype, const uint8_t *w, long n, long k, const int8_t *a, const float *s, const int32_t *sums, \
              long m, const float *scale, float *y, long ldy, int accumulate) {                              \
        gemm(DOT, DOT4, DOTD, DOTD6, HALF, qtype, w, n, k, a, s, sums, m, scale, y, ldy, accumulate);      \
    }


/* A whole product in one call: x [M, K] float32 (row stride ldx) quantized once (into this
 * thread's buffer, kept between calls), then times each of a weight's nparts parts (stacked
 * along N: codes, data, rows, grouped or not, scale or NULL), into y [M, N] (row stride ldy),
 * added to it where accumulate. The quantized rows are padded with zero rows up to a multiple
 * of pad (the AMX level's tiles read 16 rows at a time). Returns 0, or -1 where the buffer
 * cannot be had. */
typedef void (*gemm_fn)(int qtype, const uint8_t *w, long n, long k, const int8_t *a, const float *s,
                        const int32_t *sums, long m, const float *scale, float *y, long ldy, int accumulate);
typedef void (*quantize_fn)(const float *x, long m, long k, long ldx, int8_t *a, float *s, int32_t *sums);
static int linear(quantize_fn quantize, gemm_fn plain, gemm_fn grouped_fn, long pad, int nparts, const int *codes,
                  const uint8_t *const *data, const long *rows, const int *grouped, const float *const *scales, long k,
                  const float *x, long ldx, long m, float *y, long ldy, int accumulate) {
    static __thread int8_t *buf = NULL;
    static __thread size_t cap = 0;
    const long nb = k / QK, mp = (m + pad - 1) / pad * pad;
    const size_t need = (size_t)(mp * k) + (size_t)(mp * nb) * (sizeof(float) + sizeof(int32_t));
    if (need > cap) {
        free(buf);
        buf = malloc(need);
        cap = buf ? need : 0;
        if (!buf) return -1;
    }
    int8_t *a = buf; /* Mp K bytes, a multiple of 32: the scales after it stay aligned */
    float *s = (float *)(buf + mp * k);
    int32_t *sums = (int32_t *)(s + mp * nb);
    quantize(x, m, k, ldx, a, s, sums);
    if (mp > m) {
        memset(a + m * k, 0, (size_t)((mp - m) * k));
        memset(s + m * nb, 0, (size_t)((mp - m) * nb) * sizeof(float));
        memset(sums + m * nb, 0, (size_t)((mp - m) * nb) * sizeof(int32_t));
    }
    for (int p = 0, col = 0; p < nparts; col += (int)rows[p], p++)
        (grouped[p] ? grouped_fn : plain)(codes[p], data[p], rows[p], k, a, s, sums, m, scales[p], y + col, ldy,
                                          accumulate);
    return 0;
}
#define KV_GGUF_LINEAR(NAME, QUANTIZE, PLAIN, GROUPED, PAD)                                                  \
    int NAME(int nparts, const int *codes, const uint8_t *const *data, const long *rows, const int *grouped,  \
             const float *const *scales, long k, const float *x, long ldx, long m, float *y, long ldy,        \
             int accumulate) {                                                                                \
        return linear(QUANTIZE, PLAIN, GROUPED, PAD, nparts, codes, data, rows, grouped, scales, k, x, ldx, m, \
                      y, ldy, accumulate);                                                                    \
    }

/* Row groups (gguf_packed.py): Q8_0 / Q4_0 / Q4_1 at the SIMD levels keep each 16 rows' blocks
 * interleaved, block by block: the 16 fp16 d (then Q4_1's 16 fp16 m), then the payload in
 * chunks of 4 bytes a row (chunk c: bytes 4c..4c+3 of each row's block, 64 bytes). A chunk
 * is then one vector whose 32-bit lanes are the 16 rows, multiplied by the 4 activations it
 * pairs with broadcast (Q8_0's chunk i and a Q4 block's low nibbles of chunk i: activations
 * 4i..4i+3; its high nibbles: 16 + 4i..): the rows come out side by side, the scales load as
 * one vector, and nothing is summed across lanes. The last n % 16 rows follow in the file's
 * layout and take the row-at-a-time path. */
#define GROUP 16
#define GROUP_RMAX 4 /* activation rows one call of a group kernel takes */
/* out [R * 16]: R (<= GROUP_RMAX) activation rows (a, s, sums from the first, k / nb apart)
 * times the 16 rows of the group at g. */
typedef void (*group_fn)(int qtype, int R, const uint8_t *g, long nb, const int8_t *a, long k, const float *s,
                         const int32_t *sums, float *out);

/* Groups are shared out among OpenMP threads; a group's blocks (at most 26 KB for K = 1536 at
 * Q8_0) stay in L1 while the activation rows pass over them GROUP_RMAX at a time. */
__attribute__((unused)) static void gemm16(group_fn group, dot_fn dot, dot4_fn dot4, dotd_fn dotd, dotd6_fn dotd6,
                   float (*half)(const uint8_t *), int qtype, const uint8_t *w, long n, long k, const int8_t *a,
                   const float *s, const int32_t *sums, long m, const float *scale, float *y, long ldy,
                   int accumulate) {
    const long nb = k / QK, groups = n / GROUP, group_bytes = nb * GROUP * BLOCK_BYTES[qtype];
#pragma omp parallel for schedule(static)
    for (long g = 0; g < groups; g++) {
        float out[GROUP_RMAX * GROUP];
        for (long r0 = 0; r0 < m; r0 += GROUP_RMAX) {
            const int rows = m - r0 < GROUP_RMAX ? (int)(m - r0) : GROUP_RMAX;
            group(qtype, rows, w + g * group_bytes, nb, a + r0 * k, k, s + r0 * nb, sums + r0 * nb, out);
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < GROUP; j++)
                    put(y, ldy, r0 + r, g * GROUP + j, out[r * GROUP + j], scale, accumulate);
        }
    }
    if (n > groups * GROUP)
        gemm(dot, dot4, dotd, dotd6, half, qtype, w + groups * group_bytes, n - groups * GROUP, k, a, s, sums, m,
             scale ? scale + groups * GROUP : NULL, y + groups * GROUP, ldy, accumulate);
}

/* A block's head: fp16 d for the 16 rows, then Q4_1's fp16 m. */
#define GROUP_HEAD(qtype) ((qtype) == KV_Q4_1 ? 4 * GROUP : 2 * GROUP)
/* The multiple of the activations' block sum taken from a block's integer product to leave
 * it exact: 8 for Q4_0 (w = d (q - 8)), 128 for Q8_0 where it is read as u8 w + 128 (avx512);
 * Q4_1's m term is a float one. */
#define GROUP_OFFSET(qtype, biased) ((qtype) == KV_Q4_0 ? 8 : (qtype) == KV_Q8_0 && (biased) ? 128 : 0)
/* One copy of a group kernel per format and row count (constants, so their branches fold). */
#define GROUP_DISPATCH(T)                                                   \
    switch (qtype * 8 + R) {                                                \
    case KV_Q8_0 * 8 + 1: T(KV_Q8_0, 1, g, nb, a, k, s, sums, out); break; \
    case KV_Q8_0 * 8 + 2: T(KV_Q8_0, 2, g, nb, a, k, s, sums, out); break; \
    case KV_Q8_0 * 8 + 3: T(KV_Q8_0, 3, g, nb, a, k, s, sums, out); break; \
    case KV_Q8_0 * 8 + 4: T(KV_Q8_0, 4, g, nb, a, k, s, sums, out); break; \
    case KV_Q4_0 * 8 + 1: T(KV_Q4_0, 1, g, nb, a, k, s, sums, out); break; \
    case KV_Q4_0 * 8 + 2: T(KV_Q4_0, 2, g, nb, a, k, s, sums, out); break; \
    case KV_Q4_0 * 8 + 3: T(KV_Q4_0, 3, g, nb, a, k, s, sums, out); break; \
    case KV_Q4_0 * 8 + 4: T(KV_Q4_0, 4, g, nb, a, k, s, sums, out); break; \
    case KV_Q4_1 * 8 + 1: T(KV_Q4_1, 1, g, nb, a, k, s, sums, out); break; \
    case KV_Q4_1 * 8 + 2: T(KV_Q4_1, 2, g, nb, a, k, s, sums, out); break; \
    case KV_Q4_1 * 8 + 3: T(KV_Q4_1, 3, g, nb, a, k, s, sums, out); break; \
    default: T(KV_Q4_1, 4, g, nb, a, k, s, sums, out);                      \
    }

#define KV_GGUF_GEMM16(NAME, GROUPFN, DOT, DOT4, DOTD, DOTD6, HALF)                                         \
    void NAME(int qtype, const uint8_t *w, long n, long k, const int8_t *a, const float *s, const int32_t *sums, \
              long m, const float *scale, float *y, long ldy, int accumulate) {                               \
        gemm16(GROUPFN, DOT, DOT4, DOTD, DOTD6, HALF, qtype, w, n, k, a, s, sums, m, scale, y, ldy, accumulate); \
    }

static float dotd_scalar(int is_signed, const int8_t *q, const float *d, const float *mn, const int8_t *a,
                         const float *s, const int32_t *sums, long nb) {
    float acc = 0.0f;
    for (long b = 0; b < nb; b++) {
        int32_t p = 0;
        for (int j = 0; j < QK; j++) p += (int32_t)q[b * QK + j] * a[b * QK + j];
        acc += (float)p * (d[b] * s[b]);
        if (!is_signed) acc += mn[b] * (s[b] * (float)sums[b]);
    }
    return acc;
}

static float dotd6_scalar(const int8_t *q, const float *d16, const int8_t *a, const float *s, long nb) {
    float acc = 0.0f;
    for (long b = 0; b < nb; b++) {
        int32_t p[2] = {0, 0};
        for (int j = 0; j < QK; j++) p[j >> 4] += ((int32_t)q[b * QK + j] - 32) * a[b * QK + j];
        acc += (float)p[0] * (d16[2 * b] * s[b]) + (float)p[1] * (d16[2 * b + 1] * s[b]);
    }
    return acc;
}

/* The K formats on their super-blocks, one 32-weight block b at a time. */
static float dot_q4k_scalar(const uint8_t *w, const int8_t *a, const float *s, const int32_t *sums, long nb) {
    float acc = 0.0f;
    for (long sb = 0; sb < nb / 8; sb++) {
        const uint8_t *blk = w + sb * Q4K_BYTES;
        const float d = half_to_float(blk), dmin = half_to_float(blk + 2);
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        for (int i = 0; i < 8; i++) {
            const long b = sb * 8 + i;
            const uint8_t *nib = blk + 16 + 32 * (i >> 1);
            int32_t p = 0;
            for (int l = 0; l < QK; l++) p += (int32_t)((nib[l] >> (4 * (i & 1))) & 15) * a[b * QK + l];
            acc += (float)p * (d * (float)sc[i] * s[b]) - dmin * (float)mn[i] * (s[b] * (float)sums[b]);
        }
    }
    return acc;
}
static float dot_q6k_scalar(const uint8_t *w, const int8_t *a, const float *s, long nb) {
    float acc = 0.0f;
    for (long sb = 0; sb < nb / 8; sb++) {
        const uint8_t *blk = w + sb * Q6K_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = half_to_float(blk + 208);
        for (int c = 0; c < 8; c++) {
            const long b = sb * 8 + c;
            const uint8_t *lo = q6k_low(blk, c), *hi = q6k_high(blk, c);
            const int ls = q6k_low_shift(c), hs = q6k_high_shift(c);
            int32_t p[2] = {0, 0};
            for (int l = 0; l < QK; l++)
                p[l >> 4] += ((((lo[l] >> ls) & 15) | (((hi[l] >> hs) & 3) << 4)) - 32) * (int32_t)a[b * QK + l];
            acc += (float)(sc[2 * c] * p[0] + sc[2 * c + 1] * p[1]) * (d * s[b]);
        }
    }
    return acc;
}

static float dot_scalar(int qtype, const uint8_t *w, const int8_t *a, const float *s, const int32_t *sums,
                        long nb) {
    const long bb = BLOCK_BYTES[qtype];
    float acc = 0.0f;
    if (qtype == KV_Q4_K) return dot_q4k_scalar(w, a, s, sums, nb);
    if (qtype == KV_Q6_K) return dot_q6k_scalar(w, a, s, nb);
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        const int8_t *ab = a + b * QK;
        const float d = half_to_float(blk);
        int32_t p = 0;
        if (qtype == KV_Q8_0) {
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < QK; j++) p += (int32_t)q[j] * ab[j];
            acc += (float)p * (d * s[b]);
        } else {
            const uint8_t *nib = blk + (qtype == KV_Q4_0 ? 2 : 4);
            for (int j = 0; j < 16; j++) p += (int32_t)(nib[j] & 15) * ab[j] + (int32_t)(nib[j] >> 4) * ab[j + 16];
            if (qtype == KV_Q4_0) {
                acc += (float)(p - 8 * sums[b]) * (d * s[b]);
            } else {
                acc += (float)p * (d * s[b]) + half_to_float(blk + 2) * (s[b] * (float)sums[b]);
            }
        }
    }
    return acc;
}
static void dot4_scalar(int qtype, const uint8_t *w, long row_bytes, const int8_t *a, const float *s,
                        const int32_t *sums, long nb, float out[4]) {
    for (int j = 0; j < 4; j++) out[j] = dot_scalar(qtype, w + j * row_bytes, a, s, sums, nb);
}
KV_GGUF_GEMM(kv_gguf_gemm_scalar, dot_scalar, dot4_scalar, dotd_scalar, dotd6_scalar, half_to_float)
KV_GGUF_LINEAR(kv_gguf_linear_scalar, kv_gguf_quantize, kv_gguf_gemm_scalar, kv_gguf_gemm_scalar, 1)

#if defined(KV_X86) && KV_Q8_LEVELS >= 1
#define AVX2_TARGET "avx2,fma,f16c"
__attribute__((target(AVX2_TARGET))) static inline float hsum256(__m256 v) {
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    t = _mm_add_ss(t, _mm_movehdup_ps(t));
    return _mm_cvtss_f32(t);
}

__attribute__((target(AVX2_TARGET))) static inline float half_f16c(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 bytes of nibbles -> 32 u8 values in element order: the low nibbles, then the high ones. */
__attribute__((target(AVX2_TARGET))) static inline __m256i nibbles256(const uint8_t *nib) {
    const __m128i v = _mm_loadu_si128((const __m128i *)nib), mask = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* One block's 8 int32 partial sums of q * a (Q8_0: |w| against a * sign(w)); qtype is a
 * constant where this is inlined, so the format's branches fold away. */
__attribute__((target(AVX2_TARGET), always_inline)) static inline __m256i block_avx2(const int qtype, const uint8_t *blk,
                                                                                    const int8_t *a) {
    const __m256i av = _mm256_loadu_si256((const __m256i *)a);
    __m256i pairs;
    if (qtype == KV_Q8_0) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(av, q));
    } else {
        pairs = _mm256_maddubs_epi16(nibbles256(blk + (qtype == KV_Q4_0 ? 2 : 4)), av);
    }
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* A Q4 block's term in the activations' sum A (Q4_0: -8 d s A; Q4_1: m s A); 0 for Q8_0. */
__attribute__((target(AVX2_TARGET), always_inline)) static inline float offset_term(const int qtype, const uint8_t *blk,
                                                                                   float ds, float s, int32_t sum) {
    if (qtype == KV_Q4_0) return -8.0f * ds * (float)sum;
    if (qtype == KV_Q4_1) return half_f16c(blk + 2) * (s * (float)sum);
    return 0.0f;
}

/* Two accumulators (even and odd blocks): one alone makes a chain of dependent FMAs that
 * the block's few other instructions cannot hide. */
__attribute__((target(AVX2_TARGET), always_inline)) static inline float dot_avx2_t(const int qtype, const uint8_t *w,
                                                                                  const int8_t *a, const float *s,
                                                                                  const int32_t *sums, long nb) {
    const long bb = BLOCK_BYTES[qtype];
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float e0 = 0.0f, e1 = 0.0f;
    long b = 0;
    for (; b + 1 < nb; b += 2) {
        const uint8_t *b0 = w + b * bb, *b1 = b0 + bb;
        const float d0 = half_f16c(b0) * s[b], d1 = half_f16c(b1) * s[b + 1];
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_avx2(qtype, b0, a + b * QK)), _mm256_set1_ps(d0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_avx2(qtype, b1, a + (b + 1) * QK)), _mm256_set1_ps(d1), acc1);
        e0 += offset_term(qtype, b0, d0, s[b], sums[b]);
        e1 += offset_term(qtype, b1, d1, s[b + 1], sums[b + 1]);
    }
    if (b < nb) {
        const uint8_t *b0 = w + b * bb;
        const float d0 = half_f16c(b0) * s[b];
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_avx2(qtype, b0, a + b * QK)), _mm256_set1_ps(d0), acc0);
        e0 += offset_term(qtype, b0, d0, s[b], sums[b]);
    }
    return hsum256(_mm256_add_ps(acc0, acc1)) + (e0 + e1);
}

/* The K formats' products, written once for both SIMD levels: ``mul`` is 32 u8 times 32 s8
 * into 8 int32, each the sum of 4 adjacent products (lanes 0-3 the first 16 bytes, 4-7 the
 * last 16), vpmaddubsw + vpmaddwd at avx2, vpdpbusd at avx512; it is a constant where these
 * are inlined, so the call folds away. */
typedef __m256i (*mul32_fn)(__m256i u, __m256i v);
__attribute__((target(AVX2_TARGET))) static inline __m256i mul32_avx2(__m256i u, __m256i v) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), _mm256_set1_epi16(1));
}

/* Q4_K: a sub-block is one activation block; two at a time, from one 32-byte load. */
__attribute__((target(AVX2_TARGET), always_inline)) static inline float dot_q4k_t(mul32_fn mul, const uint8_t *w,
                                                                                 const int8_t *a, const float *s,
                                                                                 const int32_t *sums, long nb) {
    const __m256i mask = _mm256_set1_epi8(15);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float mins = 0.0f;
    for (long sb = 0; sb < nb / 8; sb++) {
        const uint8_t *blk = w + sb * Q4K_BYTES;
        const float d = half_f16c(blk), dmin = half_f16c(blk + 2);
        uint8_t sc[8], mn[8];
        q4k_scales(blk + 4, sc, mn);
        for (int i = 0; i < 8; i += 2) {
            const long b = sb * 8 + i;
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 16 * i));
            const __m256i p0 = mul(_mm256_and_si256(v, mask), _mm256_loadu_si256((const __m256i *)(a + b * QK)));
            const __m256i p1 =
                mul(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask), _mm256_loadu_si256((const __m256i *)(a + b * QK + QK)));
            acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(d * (float)sc[i] * s[b]), acc[0]);
            acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(d * (float)sc[i + 1] * s[b + 1]), acc[1]);
            mins += dmin * ((float)mn[i] * (s[b] * (float)sums[b]) + (float)mn[i + 1] * (s[b + 1] * (float)sums[b + 1]));
        }
    }
    return hsum256(_mm256_add_ps(acc[0], acc[1])) - mins;
}

/* Q6_K's 0..63 values (u8) against a, less 32 times each group's sum of a, in int32 lanes
 * 0-3 (the block's first group of 16) and 4-7 (its second). */
__attribute__((target(AVX2_TARGET), always_inline)) static inline __m256i q6k_product(mul32_fn mul, __m256i q,
                                                                                     __m256i av) {
    return _mm256_sub_epi32(mul(q, av), mul(_mm256_set1_epi8(32), av));
}

__attribute__((target(AVX2_TARGET), always_inline)) static inline float dot_q6k_t(mul32_fn mul, const uint8_t *w,
                                                                                 const int8_t *a, const float *s,
                                                                                 long nb) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long sb = 0; sb < nb / 8; sb++) {
        const uint8_t *blk = w + sb * Q6K_BYTES;
        const int8_t *sc = (const int8_t *)(blk + 192);
        const float d = half_f16c(blk + 208);
        for (int h = 0; h < 2; h++) {
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            for (int c = 0; c < 4; c++) { /* chunk 4 h + c: see q6k_low / q6k_high */
                const long b = sb * 8 + 4 * h + c;
                const __m256i low = _mm256_and_si256(_mm256_srli_epi16(c & 1 ? l1 : l0, 4 * (c >> 1)), m4);
                const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * c), m2), 4);
                const __m256i p = q6k_product(mul, _mm256_or_si256(low, high),
                                              _mm256_loadu_si256((const __m256i *)(a + b * QK)));
                const int g = 8 * h + 2 * c;
                const __m256i scv = _mm256_setr_m128i(_mm_set1_epi32(sc[g]), _mm_set1_epi32(sc[g + 1]));
                acc[c & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_mullo_epi32(p, scv)), _mm256_set1_ps(d * s[b]),
                                             acc[c & 1]);
            }
        }
    }
    return hsum256(_mm256_add_ps(acc[0], acc[1]));
}

/* Q6_K decoded (decode_row): q its 0..63, d16 per group of 16. */
__attribute__((target(AVX2_TARGET), always_inline)) static inline float dotd6_t(mul32_fn mul, const int8_t *q,
                                                                               const float *d16, const int8_t *a,
                                                                               const float *s, long nb) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long b = 0; b < nb; b++) {
        const __m256i p = q6k_product(mul, _mm256_loadu_si256((const __m256i *)(q + b * QK)),
                                      _mm256_loadu_si256((const __m256i *)(a + b * QK)));
        const __m256 sc = _mm256_setr_m128(_mm_set1_ps(d16[2 * b] * s[b]), _mm_set1_ps(d16[2 * b + 1] * s[b]));
        acc[b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), sc, acc[b & 1]);
    }
    return hsum256(_mm256_add_ps(acc[0], acc[1]));
}
__attribute__((target(AVX2_TARGET))) static float dotd6_avx2(const int8_t *q, const float *d16, const int8_t *a,
                                                             const float *s, long nb) {
    return dotd6_t(mul32_avx2, q, d16, a, s, nb);
}

__attribute__((target(AVX2_TARGET))) static float dot_avx2(int qtype, const uint8_t *w, const int8_t *a,
                                                           const float *s, const int32_t *sums, long nb) {
    switch (qtype) {
    case KV_Q4_K: return dot_q4k_t(mul32_avx2, w, a, s, sums, nb);
    case KV_Q6_K: return dot_q6k_t(mul32_avx2, w, a, s, nb);
    case KV_Q8_0: return dot_avx2_t(KV_Q8_0, w, a, s, sums, nb);
    case KV_Q4_0: return dot_avx2_t(KV_Q4_0, w, a, s, sums, nb);
    default: return dot_avx2_t(KV_Q4_1, w, a, s, sums, nb);
    }
}
__attribute__((target(AVX2_TARGET))) static float dotd_avx2(int is_signed, const int8_t *q, const float *d,
                                                            const float *mn, const int8_t *a, const float *s,
                                                            const int32_t *sums, long nb) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}; /* even and odd blocks: see dot_avx2_t */
    float extra = 0.0f;
    for (long b = 0; b < nb; b++) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(q + b * QK));
        const __m256i av = _mm256_loadu_si256((const __m256i *)(a + b * QK));
        const __m256i pairs = is_signed ? _mm256_maddubs_epi16(_mm256_sign_epi8(qv, qv), _mm256_sign_epi8(av, qv))
                                        : _mm256_maddubs_epi16(qv, av);
        acc[b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), _mm256_set1_ps(d[b] * s[b]),
                                     acc[b & 1]);
        if (!is_signed) extra += mn[b] * (s[b] * (float)sums[b]);
    }
    return hsum256(_mm256_add_ps(acc[0], acc[1])) + extra;
}
__attribute__((target(AVX2_TARGET), always_inline)) static inline void dot4_avx2_t(const int qtype, const uint8_t *w,
                                                                                  long row_bytes, const int8_t *a,
                                                                                  const float *s, const int32_t *sums,
                                                                                  long nb, float out[4]) {
    const long bb = BLOCK_BYTES[qtype];
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (long b = 0; b < nb; b++) {
        const int8_t *ab = a + b * QK;
        for (int j = 0; j < 4; j++) {
            const uint8_t *blk = w + j * row_bytes + b * bb;
            const float d = half_f16c(blk) * s[b];
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_avx2(qtype, blk, ab)), _mm256_set1_ps(d), acc[j]);
            e[j] += offset_term(qtype, blk, d, s[b], sums[b]);
        }
    }
    /* the four sums at once: pairwise adds, then the two 128-bit halves */
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out, _mm_add_ps(r, _mm_loadu_ps(e)));
}
__attribute__((target(AVX2_TARGET))) static void dot4_avx2(int qtype, const uint8_t *w, long row_bytes,
                                                           const int8_t *a, const float *s, const int32_t *sums,
                                                           long nb, float out[4]) {
    switch (qtype) {
    case KV_Q4_K:
    case KV_Q6_K: /* a row at a time: the super-block's unpacking, not the activations' loads, is the cost */
        for (int j = 0; j < 4; j++) out[j] = dot_avx2(qtype, w + j * row_bytes, a, s, sums, nb);
        break;
    case KV_Q8_0: dot4_avx2_t(KV_Q8_0, w, row_bytes, a, s, sums, nb, out); break;
    case KV_Q4_0: dot4_avx2_t(KV_Q4_0, w, row_bytes, a, s, sums, nb, out); break;
    default: dot4_avx2_t(KV_Q4_1, w, row_bytes, a, s, sums, nb, out);
    }
}
KV_GGUF_GEMM(kv_gguf_gemm_avx2, dot_avx2, dot4_avx2, dotd_avx2, dotd6_avx2, half_f16c)

/* A group's 16 rows as two halves of 8 (the low and high 32 bytes of each chunk). Q4: the
 * nibbles (u8) against 4 activations broadcast, by vpmaddubsw, a block's 8 pair sums added in
 * int16 (16 products of at most 15 * 127: 30480) before vpmaddwd; Q8_0: |w| against
 * a * sign(w), each chunk widened to int32 at once (a pair reaches 2 * 128 * 127). */
__attribute__((target(AVX2_TARGET), always_inline)) static inline void group_avx2_t(
    const int qtype, const int R, const uint8_t *g, long nb, const int8_t *a, long k, const float *s,
    const int32_t *sums, float *out) {
    const long bs = GROUP * BLOCK_BYTES[qtype], head = GROUP_HEAD(qtype);
    const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++) {
        __m256 acc[GROUP_RMAX];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for (long b = 0; b < nb; b++) {
            const uint8_t *blk = g + b * bs, *pay = blk + head + 32 * h;
            __m256i p[GROUP_RMAX];
            if (qtype == KV_Q8_0) {
                for (int r = 0; r < R; r++) p[r] = _mm256_setzero_si256();
                for (int i = 0; i < 8; i++) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i *)(pay + 64 * i)), u = _mm256_abs_epi8(wv);
                    for (int r = 0; r < R; r++) {
                        int32_t a4;
                        memcpy(&a4, a + r * k + b * QK + 4 * i, 4);
                        const __m256i v = _mm256_sign_epi8(_mm256_set1_epi32(a4), wv);
                        p[r] = _mm256_add_epi32(p[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, v), ones));
                    }
                }
            } else {
                __m256i lo[GROUP_RMAX], hi[GROUP_RMAX];
                for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(pay + 64 * c));
                    const __m256i ql = _mm256_and_si256(v, m4), qh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                    for (int r = 0; r < R; r++) {
                        int32_t al, ah;
                        memcpy(&al, a + r * k + b * QK + 4 * c, 4);
                        memcpy(&ah, a + r * k + b * QK + 16 + 4 * c, 4);
                        lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(ql, _mm256_set1_epi32(al)));
                        hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(qh, _mm256_set1_epi32(ah)));
                    }
                }
                for (int r = 0; r < R; r++) p[r] = _mm256_madd_epi16(_mm256_add_epi16(lo[r], hi[r]), ones);
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
            for (int r = 0; r < R; r++) {
                const float sr = s[r * nb + b];
                const int32_t sum = sums[r * nb + b];
                __m256i pr = p[r];
                if (GROUP_OFFSET(qtype, 0)) pr = _mm256_sub_epi32(pr, _mm256_set1_epi32(GROUP_OFFSET(qtype, 0) * sum));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pr), _mm256_mul_ps(d, _mm256_set1_ps(sr)), acc[r]);
                if (qtype == KV_Q4_1)
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h))),
                                             _mm256_set1_ps(sr * (float)sum), acc[r]);
            }
        }
        for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * GROUP + 8 * h, acc[r]);
    }
}
__attribute__((target(AVX2_TARGET))) static void group_avx2(int qtype, int R, const uint8_t *g, long nb,
                                                            const int8_t *a, long k, const float *s,
                                                            const int32_t *sums, float *out) {
    GROUP_DISPATCH(group_avx2_t)
}
KV_GGUF_GEMM16(kv_gguf_gemm16_avx2, group_avx2, dot_avx2, dot4_avx2, dotd_avx2, dotd6_avx2, half_f16c)
KV_GGUF_LINEAR(kv_gguf_linear_avx2, kv_gguf_quantize, kv_gguf_gemm_avx2, kv_gguf_gemm16_avx2, 1)

#if KV_Q8_LEVELS >= 2
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"

/* kv_gguf_quantize with 512-bit vectors, the same values: the block's max |x| reduced exactly,
 * the same float d and 1 / d, x / d rounded half to even by vcvtps2dq (the default rounding
 * mode, as rintf), the int8 values and their sum exact. (The plain C one calls libm's rintf per
 * value: at 256 rows x 1536 that was 0.85 ms, as much as the product.) */
__attribute__((target(AVX512_TARGET))) void kv_gguf_quantize_avx512(const float *x, long m, long k, long ldx,
                                                                    int8_t *a, float *s, int32_t *sums) {
    const long nb = k / QK;
#pragma omp parallel for schedule(static) if (m >= 8)
    for (long r = 0; r < m; r++) {
        for (long b = 0; b < nb; b++) {
            const float *xb = x + r * ldx + b * QK;
            const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(a + r * k + b * QK), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(a + r * k + b * QK + 16), _mm512_cvtepi32_epi8(q1));
            s[r * nb + b] = d;
            sums[r * nb + b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        }
    }
}

/* Two blocks' 32 weights each as 64 u8 operands (Q8_0: |w|) and the 64 activations to pair
 * with them (Q8_0: a * sign(w)). */
__attribute__((target(AVX512_TARGET))) static inline void operands512(int qtype, const uint8_t *b0, const uint8_t *b1,
                                                                     __m512i av, __m512i *u, __m512i *v) {
    if (qtype == KV_Q8_0) {
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b0 + 2))),
                                             _mm256_loadu_si256((const __m256i *)(b1 + 2)), 1);
        *u = _mm512_abs_epi8(q);
        *v = _mm512_mask_sub_epi8(av, _mm512_movepi8_mask(q), _mm512_setzero_si512(), av);
    } else {
        const int off = qtype == KV_Q4_0 ? 2 : 4;
        *u = _mm512_inserti64x4(_mm512_castsi256_si512(nibbles256(b0 + off)), nibbles256(b1 + off), 1);
        *v = av;
    }
}

__attribute__((target(AVX512_TARGET), always_inline)) static inline float dot_avx512_t(const int qtype,
                                                                                      const uint8_t *w,
                                                                                      const int8_t *a, const float *s,
                                                                                      const int32_t *sums, long nb) {
    const long bb = BLOCK_BYTES[qtype];
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}; /* alternate pairs: see dot_avx2_t */
    float extra = 0.0f;
    long b = 0;
    for (; b + 1 < nb; b += 2) { /* int32 lanes 0-7 the first block, 8-15 the second */
        const uint8_t *b0 = w + b * bb, *b1 = b0 + bb;
        __m512i u, v;
        operands512(qtype, b0, b1, _mm512_loadu_si512((const void *)(a + b * QK)), &u, &v);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, v);
        const float d0 = half_f16c(b0) * s[b], d1 = half_f16c(b1) * s[b + 1];
        const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
        acc[(b >> 1) & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[(b >> 1) & 1]);
        extra += offset_term(qtype, b0, d0, s[b], sums[b]) + offset_term(qtype, b1, d1, s[b + 1], sums[b + 1]);
    }
    float tail = 0.0f;
    if (b < nb) tail = dot_avx2_t(qtype, w + b * bb, a + b * QK, s + b, sums + b, 1); /* an odd last block */
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + extra + tail;
}

/* The K formats at this level: their avx2 layout (mul32_fn) with vpdpbusd. */
__attribute__((target(AVX512_TARGET))) static inline __m256i mul32_vnni(__m256i u, __m256i v) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, v);
}
__attribute__((target(AVX512_TARGET))) static float dotd6_avx512(const int8_t *q, const float *d16, const int8_t *a,
                                                                 const float *s, long nb) {
    return dotd6_t(mul32_vnni, q, d16, a, s, nb);
}

__attribute__((target(AVX512_TARGET))) static float dot_avx512(int qtype, const uint8_t *w, const int8_t *a,
                                                               const float *s, const int32_t *sums, long nb) {
    switch (qtype) {
    case KV_Q4_K: return dot_q4k_t(mul32_vnni, w, a, s, sums, nb);
    case KV_Q6_K: return dot_q6k_t(mul32_vnni, w, a, s, nb);
    case KV_Q8_0: return dot_avx512_t(KV_Q8_0, w, a, s, sums, nb);
    case KV_Q4_0: return dot_avx512_t(KV_Q4_0, w, a, s, sums, nb);
    default: return dot_avx512_t(KV_Q4_1, w, a, s, sums, nb);
    }
}
__attribute__((target(AVX512_TARGET))) static float dotd_avx512(int is_signed, const int8_t *q, const float *d,
                                                                const float *mn, const int8_t *a, const float *s,
                                                                const int32_t *sums, long nb) {
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    float extra = 0.0f;
    long b = 0;
    for (; b + 1 < nb; b += 2) { /* int32 lanes 0-7 the first block, 8-15 the second */
        const __m512i qv = _mm512_loadu_si512((const void *)(q + b * QK));
        const __m512i av = _mm512_loadu_si512((const void *)(a + b * QK));
        __m512i p;
        if (is_signed) {
            const __m512i sa = _mm512_mask_sub_epi8(av, _mm512_movepi8_mask(qv), zero, av);
            p = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(qv), sa);
        } else {
            p = _mm512_dpbusd_epi32(zero, qv, av);
            extra += mn[b] * (s[b] * (float)sums[b]) + mn[b + 1] * (s[b + 1] * (float)sums[b + 1]);
        }
        const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d[b] * s[b]), _mm512_set1_ps(d[b + 1] * s[b + 1]));
        acc[(b >> 1) & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[(b >> 1) & 1]);
    }
    float tail = 0.0f;
    if (b < nb) tail = dotd_avx2(is_signed, q + b * QK, d + b, mn + b, a + b * QK, s + b, sums + b, 1);
    return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + extra + tail;
}
__attribute__((target(AVX512_TARGET), always_inline)) static inline void dot4_avx512_t(
    const int qtype, const uint8_t *w, long row_bytes, const int8_t *a, const float *s, const int32_t *sums, long nb,
    float out[4]) {
    const long bb = BLOCK_BYTES[qtype];
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    long b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m512i av = _mm512_loadu_si512((const void *)(a + b * QK));
        for (int j = 0; j < 4; j++) {
            const uint8_t *b0 = w + j * row_bytes + b * bb, *b1 = b0 + bb;
            __m512i u, v;
            operands512(qtype, b0, b1, av, &u, &v);
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, v);
            const float d0 = half_f16c(b0) * s[b], d1 = half_f16c(b1) * s[b + 1];
            const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(d0), _mm512_set1_ps(d1));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[j]);
            e[j] += offset_term(qtype, b0, d0, s[b], sums[b]) + offset_term(qtype, b1, d1, s[b + 1], sums[b + 1]);
        }
    }
    for (int j = 0; j < 4; j++) {
        out[j] = _mm512_reduce_add_ps(acc[j]) + e[j];
        if (b < nb) out[j] += dot_avx2_t(qtype, w + j * row_bytes + b * bb, a + b * QK, s + b, sums + b, 1);
    }
}
/* The Q4 formats one block per 256-bit register: assembling two blocks' nibbles into one
 * 512-bit register cost more than the wider vpdpbusd saved (measured, 3072 x 576 Q4_1 at one
 * row: 76 us against 56 us for the avx2 level), so at this level they take the avx2 layout with
 * vpdpbusd in place of vpmaddubsw + vpmaddwd. */
__attribute__((target(AVX512_TARGET), always_inline)) static inline void dot4_vnni256_t(
    const int qtype, const uint8_t *w, long row_bytes, const int8_t *a, const float *s, const int32_t *sums, long nb,
    float out[4]) {
    const long bb = BLOCK_BYTES[qtype], off = qtype == KV_Q4_0 ? 2 : 4;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (long b = 0; b < nb; b++) {
        const __m256i av = _mm256_loadu_si256((const __m256i *)(a + b * QK));
        for (int j = 0; j < 4; j++) {
            const uint8_t *blk = w + j * row_bytes + b * bb;
            const float d = half_f16c(blk) * s[b];
            const __m256i p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), nibbles256(blk + off), av);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d), acc[j]);
            e[j] += offset_term(qtype, blk, d, s[b], sums[b]);
        }
    }
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out, _mm_add_ps(r, _mm_loadu_ps(e)));
}

__attribute__((target(AVX512_TARGET))) static void dot4_avx512(int qtype, const uint8_t *w, long row_bytes,
                                                               const int8_t *a, const float *s, const int32_t *sums,
                                                               long nb, float out[4]) {
    switch (qtype) {
    case KV_Q4_K:
    case KV_Q6_K: /* as at avx2 */
        for (int j = 0; j < 4; j++) out[j] = dot_avx512(qtype, w + j * row_bytes, a, s, sums, nb);
        break;
    case KV_Q8_0: dot4_avx512_t(KV_Q8_0, w, row_bytes, a, s, sums, nb, out); break;
    case KV_Q4_0: dot4_vnni256_t(KV_Q4_0, w, row_bytes, a, s, sums, nb, out); break;
    default: dot4_vnni256_t(KV_Q4_1, w, row_bytes, a, s, sums, nb, out);
    }
}
KV_GGUF_GEMM(kv_gguf_gemm_avx512, dot_avx512, dot4_avx512, dotd_avx512, dotd6_avx512, half_f16c)

/* A group's 16 rows in one register: vpdpbusd of a chunk against 4 activations broadcast,
 * two chains of int32 sums a block (even and odd chunks). Q8_0's values are read as u8
 * (w + 128, one xor), the 128 A it adds taken off in int32. */
__attribute__((target(AVX512_TARGET), always_inline)) static inline void group_avx512_t(
    const int qtype, const int R, const uint8_t *g, long nb, const int8_t *a, long k, const float *s,
    const int32_t *sums, float *out) {
    const long bs = GROUP * BLOCK_BYTES[qtype], head = GROUP_HEAD(qtype);
    const __m512i m4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[GROUP_RMAX];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long b = 0; b < nb; b++) {
        const uint8_t *blk = g + b * bs, *pay = blk + head;
        __m512i p0[GROUP_RMAX], p1[GROUP_RMAX];
        for (int r = 0; r < R; r++) p0[r] = p1[r] = _mm512_setzero_si512();
        for (int c = 0; c < (qtype == KV_Q8_0 ? 8 : 4); c += 2) {
            __m512i w0, w1, w2, w3; /* chunks i0, i1 and (Q4) their high nibbles, activations 4i apart */
            int i0, i1, i2, i3;
            const __m512i v0 = _mm512_loadu_si512((const void *)(pay + 64 * c));
            const __m512i v1 = _mm512_loadu_si512((const void *)(pay + 64 * (c + 1)));
            if (qtype == KV_Q8_0) {
                w0 = _mm512_xor_si512(v0, flip), w1 = _mm512_xor_si512(v1, flip);
                i0 = c, i1 = c + 1;
                for (int r = 0; r < R; r++) {
                    int32_t x0, x1;
                    memcpy(&x0, a + r * k + b * QK + 4 * i0, 4);
                    memcpy(&x1, a + r * k + b * QK + 4 * i1, 4);
                    p0[r] = _mm512_dpbusd_epi32(p0[r], w0, _mm512_set1_epi32(x0));
                    p1[r] = _mm512_dpbusd_epi32(p1[r], w1, _mm512_set1_epi32(x1));
                }
            } else {
                w0 = _mm512_and_si512(v0, m4), w1 = _mm512_and_si512(v1, m4);
                w2 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4), w3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
                i0 = c, i1 = c + 1, i2 = c + 4, i3 = c + 5;
                for (int r = 0; r < R; r++) {
                    int32_t x0, x1, x2, x3;
                    memcpy(&x0, a + r * k + b * QK + 4 * i0, 4);
                    memcpy(&x1, a + r * k + b * QK + 4 * i1, 4);
                    memcpy(&x2, a + r * k + b * QK + 4 * i2, 4);
                    memcpy(&x3, a + r * k + b * QK + 4 * i3, 4);
                    p0[r] = _mm512_dpbusd_epi32(p0[r], w0, _mm512_set1_epi32(x0));
                    p1[r] = _mm512_dpbusd_epi32(p1[r], w1, _mm512_set1_epi32(x1));
                    p0[r] = _mm512_dpbusd_epi32(p0[r], w2, _mm512_set1_epi32(x2));
                    p1[r] = _mm512_dpbusd_epi32(p1[r], w3, _mm512_set1_epi32(x3));
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        for (int r = 0; r < R; r++) {
            const float sr = s[r * nb + b];
            const int32_t sum = sums[r * nb + b];
            __m512i pr = _mm512_add_epi32(p0[r], p1[r]);
            if (GROUP_OFFSET(qtype, 1)) pr = _mm512_sub_epi32(pr, _mm512_set1_epi32(GROUP_OFFSET(qtype, 1) * sum));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pr), _mm512_mul_ps(d, _mm512_set1_ps(sr)), acc[r]);
            if (qtype == KV_Q4_1)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))),
                                         _mm512_set1_ps(sr * (float)sum), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + r * GROUP, acc[r]);
}
__attribute__((target(AVX512_TARGET))) static void group_avx512(int qtype, int R, const uint8_t *g, long nb,
                                                                const int8_t *a, long k, const float *s,
                                                                const int32_t *sums, float *out) {
    GROUP_DISPATCH(group_avx512_t)
}
KV_GGUF_GEMM16(kv_gguf_gemm16_avx512, group_avx512, dot_avx512, dot4_avx512, dotd_avx512, dotd6_avx512, half_f16c)
KV_GGUF_LINEAR(kv_gguf_linear_avx512, kv_gguf_quantize_avx512, kv_gguf_gemm_avx512, kv_gguf_gemm16_avx512, 1)

#ifdef KV_GGUF_AMX
/* The AMX level: the avx512 level, with the row groups' products for 16 or more activation rows
 * on the tile unit. A group block's payload, 4-byte chunks of the 16 rows (64 bytes a chunk),
 * is exactly a B tile of TDPBSSD in its VNNI layout: B row c holds weights 4c..4c+3 of each of
 * the 16 weight rows. So one block of 16 activation rows x 16 weight rows is
 *   A  the activations' block, 16 rows of 32 s8 (straight from a, row stride k),
 *   B  the block's weights as s8, 8 rows of 64 bytes: Q8_0's payload as it lies; the Q4
 *      nibbles unpacked once per group (low nibbles of chunk c to row c, high to row 4 + c),
 *      Q4_0's as q - 8 (-8..7), which takes its -8 A term into the integer sum,
 *   C  = A B, 16 x 16 int32: each activation row's 16 weight-row sums side by side, as the
 * avx512 kernel's vector of a row; then the same float steps as there (C row times d s, and
 * Q4_1's m s A), so the two levels' results are the same floats. K is one block (32) a
 * product: each block has its own scales. The unit does a block in a few ns; what bounds it
 * is converting and scaling C (3 vector ops a row and block, 4 for Q4_1). */
#define AMX_TARGET AVX512_TARGET ",amx-tile,amx-int8"
#define AMX_ROWS 16 /* activation rows a tile (linear pads the quantized rows to a multiple) */
#define AMX_MIN_ROWS 16 /* fewer activation rows take the avx512 groups (measured: bench/README.md) */
#define AMX_TAIL 5 /* the last m % 16 rows, when fewer, too: one avx512 pass (measured: a tile costs 5-7 rows) */
#define AMX_KC 64 /* blocks of a group unpacked at once (32 KB); a longer row unpacks per tile */
#define AMX_BLOCK (8 * 64) /* a block's B tile: 8 rows of 64 bytes */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;
/* Palette 1. tmm0, tmm1: C (16 rows of 16 int32); tmm2, tmm3: A (16 rows of 32 bytes);
 * tmm4, tmm5: B (8 rows of 64 bytes). Two of each: two blocks in flight. */
static const amx_config AMX_CONFIG __attribute__((aligned(64))) = {
    1, 0, {0}, {64, 64, 32, 32, 64, 64}, {16, 16, 16, 16, 8, 8}};
/* gcc's tile intrinsics are asm statements that name no memory: this barrier keeps the
 * compiler's stores that a tile load reads before it, and its loads of a tile store after. */
#define AMX_FENCE() __asm__ volatile("" ::: "memory")

/* Blocks b0..b0+kb-1 of a Q4 group's payload as B tiles (AMX_BLOCK bytes a block) at out. */
__attribute__((target(AMX_TARGET), always_inline)) static inline void amx_unpack_t(const int qtype,
                                                                                 const uint8_t *g, long b0, long kb,
                                                                                 int8_t *out) {
    const long bs = GROUP * BLOCK_BYTES[qtype];
    const __m512i m4 = _mm512_set1_epi8(15), eight = _mm512_set1_epi8(8);
    for (long b = 0; b < kb; b++) {
        const uint8_t *pay = g + (b0 + b) * bs + GROUP_HEAD(qtype);
        int8_t *o = out + b * AMX_BLOCK;
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_loadu_si512((const void *)(pay + 64 * c));
            __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            if (qtype == KV_Q4_0) lo = _mm512_sub_epi8(lo, eight), hi = _mm512_sub_epi8(hi, eight);
            _mm512_storeu_si512((void *)(o + 64 * c), lo);
            _mm512_storeu_si512((void *)(o + 64 * (4 + c)), hi);
        }
    }
    AMX_FENCE();
}

/* One block's C (16 activation rows x 16 weight rows, int32) into acc, as group_avx512_t;
 * sa [rows, nb]: Q4_1's s A per activation row and block, made once a product (the same float
 * as group_avx512_t's), so that each step here is one vector op with its operand broadcast
 * from memory: these 3 (Q4_1: 4) ops a row run on one port of this CPU, and bound the level. */
__attribute__((target(AMX_TARGET), always_inline)) static inline void amx_scale_t(const int qtype, const int32_t *c,
                                                                                const uint8_t *blk, long b, long nb,
                                                                                const float *s, const float *sa,
                                                                                __m512 acc[AMX_ROWS]) {
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    const __m512 mn = qtype == KV_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : d;
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + r * GROUP))),
                                 _mm512_mul_ps(d, _mm512_set1_ps(s[r * nb + b])), acc[r]);
        if (qtype == KV_Q4_1) acc[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sa[r * nb + b]), acc[r]);
    }
}

/* The tile products of blocks j and (where two) j + 1 of an activation tile into c[0], c[1]. */
#define AMX_PAIR(j, two, c)                                                   \
    do {                                                                      \
        _tile_loadd(2, a + (b0 + (j)) * QK, k);                               \
        _tile_loadd(4, bt + (j) * bstride, 64);                               \
        _tile_zero(0);                                                        \
        _tile_dpbssd(0, 2, 4);                                                \
        if (two) {                                                            \
            _tile_loadd(3, a + (b0 + (j) + 1) * QK, k);                       \
            _tile_loadd(5, bt + ((j) + 1) * bstride, 64);                     \
            _tile_zero(1);                                                    \
            _tile_dpbssd(1, 3, 5);                                            \
        }                                                                     \
        _tile_stored(0, (c)[0], 64);                                          \
        if (two) _tile_stored(1, (c)[1], 64);                                 \
        AMX_FENCE();                                                          \
    } while (0)

/* acc += one activation tile (a, s, sa at its first row) times blocks b0..b0+kb-1 of the
 * group at g, their B tiles at bt, bstride bytes apart. A pair of blocks' tiles is stored
 * ahead of the scaling of the pair before it (measured: 5 % faster than in turn). */
__attribute__((target(AMX_TARGET), always_inline)) static inline void amx_blocks_t(
    const int qtype, const uint8_t *g, const int8_t *bt, long bstride, long b0, long kb, const int8_t *a, long k,
    const float *s, const float *sa, long nb, __m512 acc[AMX_ROWS]) {
    const long bs = GROUP * BLOCK_BYTES[qtype];
    int32_t c[2][2][AMX_ROWS * GROUP] __attribute__((aligned(64)));
    AMX_PAIR(0, kb > 1, c[0]);
    for (long j = 0; j < kb; j += 2) {
        const int p = (int)(j >> 1) & 1;
        if (j + 2 < kb) AMX_PAIR(j + 2, j + 3 < kb, c[p ^ 1]);
        amx_scale_t(qtype, c[p][0], g + (b0 + j) * bs, b0 + j, nb, s, sa, acc);
        if (j + 1 < kb) amx_scale_t(qtype, c[p][1], g + (b0 + j + 1) * bs, b0 + j + 1, nb, s, sa, acc);
    }
}

/* One group of 16 weight rows times every activation tile: out columns col..col+15. The Q4
 * nibbles are unpacked once (rows up to AMX_KC blocks) into unpacked, then read by each tile. */
__attribute__((target(AMX_TARGET), always_inline)) static inline void amx_group_t(
    const int qtype, const uint8_t *g, long nb, const int8_t *a, long k, const float *s, const int32_t *sums,
    const float *sa, long m, const float *scale, float *y, long ldy, int accumulate, int8_t *unpacked) {
    const long bs = GROUP * BLOCK_BYTES[qtype];
    const int once = nb <= AMX_KC;
    /* a last tile of fewer than AMX_TAIL rows costs more than the avx512 group kernel on them */
    const long tiled = m % AMX_ROWS >= AMX_TAIL ? m : m / AMX_ROWS * AMX_ROWS;
    if (qtype != KV_Q8_0 && once) amx_unpack_t(qtype, g, 0, nb, unpacked);
    for (long r0 = tiled; r0 < m; r0 += GROUP_RMAX) {
        float out[GROUP_RMAX * GROUP];
        const int rows = m - r0 < GROUP_RMAX ? (int)(m - r0) : GROUP_RMAX;
        group_avx512(qtype, rows, g, nb, a + r0 * k, k, s + r0 * nb, sums + r0 * nb, out);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < GROUP; j++) put(y, ldy, r0 + r, j, out[r * GROUP + j], scale, accumulate);
    }
    for (long r0 = 0; r0 < tiled; r0 += AMX_ROWS) {
        __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
        for (long b0 = 0; b0 < nb; b0 += AMX_KC) {
            const long kb = nb - b0 < AMX_KC ? nb - b0 : AMX_KC;
            if (qtype == KV_Q8_0) {
                amx_blocks_t(qtype, g, (const int8_t *)(g + b0 * bs + GROUP_HEAD(qtype)), bs, b0, kb, a + r0 * k, k,
                             s + r0 * nb, sa + r0 * nb, nb, acc);
            } else {
                if (!once) amx_unpack_t(qtype, g, b0, kb, unpacked);
                amx_blocks_t(qtype, g, unpacked, AMX_BLOCK, b0, kb, a + r0 * k, k, s + r0 * nb, sa + r0 * nb, nb,
                             acc);
            }
        }
        const long rows = tiled - r0 < AMX_ROWS ? tiled - r0 : AMX_ROWS; /* the padding rows are dropped */
        const __m512 sc = scale ? _mm512_loadu_ps(scale) : _mm512_set1_ps(1.0f);
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) { /* put()'s steps, 16 columns at once (constant r: acc in registers) */
            if (r >= rows) break;
            float *yr = y + (r0 + r) * ldy;
            __m512 v = scale ? _mm512_mul_ps(acc[r], sc) : acc[r];
            if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(yr), v);
            _mm512_storeu_ps(yr, v);
        }
    }
}
__attribute__((target(AMX_TARGET))) static void amx_group(int qtype, const uint8_t *g, long nb, const int8_t *a,
                                                          long k, const float *s, const int32_t *sums,
                                                          const float *sa, long m, const float *scale, float *y,
                                                          long ldy, int accumulate, int8_t *unpacked) {
    switch (qtype) {
    case KV_Q8_0: amx_group_t(KV_Q8_0, g, nb, a, k, s, sums, sa, m, scale, y, ldy, accumulate, unpacked); break;
    case KV_Q4_0: amx_group_t(KV_Q4_0, g, nb, a, k, s, sums, sa, m, scale, y, ldy, accumulate, unpacked); break;
    default: amx_group_t(KV_Q4_1, g, nb, a, k, s, sums, sa, m, scale, y, ldy, accumulate, unpacked);
    }
}

/* As kv_gguf_gemm16_avx512, with the groups on the tiles from AMX_MIN_ROWS activation rows
 * (a, s and sums padded with zero rows to a multiple of 16: linear's pad). Each OpenMP thread
 * loads the tile configuration for itself and releases the tiles after (a thread holding
 * tile state costs every context switch its 8 KB). The caller has had the process's
 * permission to use the tiles (arch_prctl, cpu_features.amx_usable). */
__attribute__((target(AMX_TARGET))) void kv_gguf_gemm16_amx(int qtype, const uint8_t *w, long n, long k,
                                                            const int8_t *a, const float *s, const int32_t *sums,
                                                            long m, const float *scale, float *y, long ldy,
                                                            int accumulate) {
    static __thread float *sa_buf = NULL; /* this (the calling) thread's: the team reads it through sa */
    static __thread size_t cap = 0;
    const long nb = k / QK, groups = n / GROUP, group_bytes = nb * GROUP * BLOCK_BYTES[qtype];
    const long mp = (m + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    if (qtype == KV_Q4_1 && m >= AMX_MIN_ROWS && (size_t)(mp * nb) > cap) {
        free(sa_buf);
        sa_buf = malloc((size_t)(mp * nb) * sizeof(float));
        cap = sa_buf ? (size_t)(mp * nb) : 0;
    }
    float *const sa = sa_buf;
    if (m < AMX_MIN_ROWS || (qtype == KV_Q4_1 && !sa)) { /* (no memory for sa: the avx512 groups) */
        kv_gguf_gemm16_avx512(qtype, w, n, k, a, s, sums, m, scale, y, ldy, accumulate);
        return;
    }
    if (qtype == KV_Q4_1)
        for (long i = 0; i < mp * nb; i++) sa[i] = s[i] * (float)sums[i];
#pragma omp parallel
    {
        int8_t unpacked[qtype == KV_Q8_0 ? 64 : AMX_KC * AMX_BLOCK] __attribute__((aligned(64)));
        _tile_loadconfig(&AMX_CONFIG);
#pragma omp for schedule(static)
        for (long g = 0; g < groups; g++)
            amx_group(qtype, w + g * group_bytes, nb, a, k, s, sums, sa, m, scale ? scale + g * GROUP : NULL,
                      y + g * GROUP, ldy, accumulate, unpacked);
        _tile_release();
    }
    if (n > groups * GROUP)
        kv_gguf_gemm_avx512(qtype, w + groups * group_bytes, n - groups * GROUP, k, a, s, sums, m,
                            scale ? scale + groups * GROUP : NULL, y + groups * GROUP, ldy, accumulate);
}
KV_GGUF_LINEAR(kv_gguf_linear_amx, kv_gguf_quantize_avx512, kv_gguf_gemm_avx512, kv_gguf_gemm16_amx, AMX_ROWS)
#endif /* KV_GGUF_AMX */
#endif /* KV_Q8_LEVELS >= 2 */
#endif /* KV_X86 && KV_Q8_LEVELS >= 1 */
