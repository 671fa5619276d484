/* Hand-fused float32 ops for the CPU forward (see fused.py, which compiles and loads this).
 *
 * Each function is one pass over rows that torch runs as several dispatched ops. Between
 * the weight products every op runs with cold caches (a product streams megabytes of
 * weights through them), so a batch-1 layer's ~40 small ops cost 3-5x their warm time; one
 * call each for the norm (with the residual add before it), RoPE, the K/V write into the paged
 * cache and a decode's attention removes most of that. (A SiLU-gate here measured no faster
 * than torch's in a step.)
 * kv_decode_step, at the end, runs a small model's whole step on these in one call.
 * Plain C, float32 (a decode attention's K/V may also be float16); only a decode group's
 * attention is spread over threads. Reductions are vectorised with `omp simd`.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Threads a parallel region of the calling thread gets: torch's intra-op setting (torch's
 * set_num_threads sets this OpenMP value), 1 in a build without OpenMP. */
long kv_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static void norm_row(const float *x, const float *w, float *out, long n, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (long j = 0; j < n; j++) ss += x[j] * x[j];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (long j = 0; j < n; j++) out[j] = (x[j] * r) * w[j];
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w; x, out: [rows, n] contiguous. */
void kv_rms_norm(const float *x, const float *w, float *out, long rows, long n, float eps) {
    for (long r = 0; r < rows; r++) norm_row(x + r * n, w, out + r * n, n, eps);
}

/* h += y, then out = rms_norm(h) * w (the residual add and the next norm in one pass). */
void kv_add_rms_norm(float *h, const float *y, const float *w, float *out, long rows, long n, float eps) {
    for (long r = 0; r < rows; r++) {
        float *hr = h + r * n;
        const float *yr = y + r * n;
#pragma omp simd
        for (long j = 0; j < n; j++) hr[j] += yr[j];
        norm_row(hr, w, out + r * n, n, eps);
    }
}

/* RoPE in place on adjacent pairs: row r of qk (row stride `stride` floats) holds `heads`
 * heads of `half` (re, im) pairs; rot: [rows, half] (cos, sin) pairs. The complex product
 * (a + ib)(c + is) is written as torch's complex multiply writes it. */
void kv_rope(float *qk, long stride, const float *rot, long rows, long heads, long half) {
    for (long r = 0; r < rows; r++) {
        const float *c = rot + r * 2 * half;
        for (long h = 0; h < heads; h++) {
            float *p = qk + r * stride + h * 2 * half;
#pragma omp simd
            for (long i = 0; i < half; i++) {
                const float a = p[2 * i], b = p[2 * i + 1], cr = c[2 * i], ci = c[2 * i + 1];
                p[2 * i] = a * cr - b * ci;
                p[2 * i + 1] = a * ci + b * cr;
            }
        }
    }
}

/* e^x for x <= 0 (softmax's scores less their maximum) in plain arithmetic, so that a loop of
 * it vectorizes (libm's expf is a call per element: it was most of a c=32 decode's attention).
 * x = n ln2 + r with n = round(x / ln2) (the 1.5 * 2^23 trick rounds to nearest) and |r| <=
 * ln2 / 2, ln2 in two parts so that r is exact; e^r by its Taylor series to r^7 / 7! (the
 * remainder under 6e-9 there); 2^n put into the exponent bits. Below -87 the result is held
 * at e^-87 (1.6e-38, against the sum's >= 1) so that 2^n stays a normal float. */
static inline float exp_nonpositive(float x) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    x = x < -87.0f ? -87.0f : x;
    const float t = x * 1.44269504088896341f + magic;
    const float n = t - magic;
    float r = x - n * 0.693145751953125f; /* ln2's high part: n times it is exact */
    r = r - n * 1.42860682030941723e-6f;  /* its low part */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Scores p [len] -> e^(p - max p) in place; returns 1 / their sum (softmax's normaliser). */
static inline float exp_scores(float *p, long len) {
    float mx = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : mx) /* one chain of scalar max was a tenth of a decode's attention */
    for (long s = 0; s < len; s++) mx = p[s] > mx ? p[s] : mx;
#pragma omp simd reduction(+ : sum)
    for (long s = 0; s < len; s++) {
        p[s] = exp_nonpositive(p[s] - mx);
        sum += p[s];
    }
    return 1.0f / sum;
}

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#ifdef __AVX512F__
/* Lane j of the result: the sum of t[j]'s 16 lanes (16 horizontal sums in 45 instructions,
 * against about 8 each one at a time). Pairs first: unpack and add leave, per 128-bit lane,
 * partial sums of two vectors; a shuffle and add then the 128-bit lanes' sums of four vectors;
 * two rounds of 128-bit shuffles gather the four lanes of each. */
static inline __m512 sums16(const __m512 t[16]) {
    __m512 u[8], v[4];
    for (int i = 0; i < 8; i++)
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128-bit lane: the lane's sums of t[4i .. 4i + 3] */
        v[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    const __m512 x0 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
    const __m512 x1 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x88), _mm512_shuffle_f32x4(v[2], v[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
}
#endif

/* K and V are float32 or float16 (``half``: the KV cache of the reduced-precision CPU modes,
 * as llama.cpp keeps it). Each body below takes ``half`` as a constant and is inlined into a
 * float32 and a float16 entry, so the element type costs no branch in the loops; float16 is
 * widened to float32 as it is loaded (F16C / AVX-512's vcvtph2ps where the CPU has them) and
 * everything after the load is float32. */
typedef _Float16 kv_half;
/* The address of element i of p, p's elements float or float16. */
#define KV_PTR(p, i, half) ((half) ? (const void *)((const kv_half *)(p) + (i)) : (const void *)((const float *)(p) + (i)))

#ifdef __AVX512F__
static inline __m512 load16(const void *p, const int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)) : _mm512_loadu_ps((const float *)p);
}

/* The dot products of a 64-wide query with 16 keys (ks, s_stride elements apart), as a
 * vector: each key's 64 products in one register, then the 16 sums at once. */
__attribute__((always_inline)) static inline __m512 dots16(const float *qg, const void *ks, long s_stride,
                                                           const int half) {
    const __m512 q0 = _mm512_loadu_ps(qg), q1 = _mm512_loadu_ps(qg + 16), q2 = _mm512_loadu_ps(qg + 32),
                 q3 = _mm512_loadu_ps(qg + 48);
    __m512 t[16];
    for (int j = 0; j < 16; j++) {
        const void *k = KV_PTR(ks, j * s_stride, half);
        t[j] = _mm512_fmadd_ps(q3, load16(KV_PTR(k, 48, half), half),
                               _mm512_fmadd_ps(q2, load16(KV_PTR(k, 32, half), half),
                                               _mm512_fmadd_ps(q1, load16(KV_PTR(k, 16, half), half),
                                                               _mm512_mul_ps(q0, load16(k, half)))));
    }
    return sums16(t);
}
#endif

/* n (<= 64) float16 values into floats, with the vector conversion where the CPU has one:
 * GCC 12 converts _Float16 one value at a time even in a vectorised loop (a chain of scalar
 * conversions took a third of a float16 decode's attention). */
static inline void widen(const kv_half *src, float *dst, const long n) {
    long d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= n; d += 16) _mm512_storeu_ps(dst + d, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + d))));
#elif defined(__F16C__)
    for (; d + 8 <= n; d += 8) _mm256_storeu_ps(dst + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + d))));
#endif
    for (; d < n; d++) dst[d] = (float)src[d];
}

/* acc[d] += ps * v[d] over n elements (a float16 v widened 64 at a time). */
__attribute__((always_inline)) static inline void axpy_row(float *acc, const float ps, const void *v, const long n,
                                                           const int half) {
    if (!half) {
#pragma omp simd
        for (long d = 0; d < n; d++) acc[d] += ps * ((const float *)v)[d];
        return;
    }
    for (long c = 0; c < n; c += 64) {
        const long m = n - c < 64 ? n - c : 64;
        float w[64];
        widen((const kv_half *)v + c, w, m);
#pragma omp simd
        for (long d = 0; d < m; d++) acc[c + d] += ps * w[d];
    }
}

/* q . k over dim elements (a float16 k widened 64 at a time). */
__attribute__((always_inline)) static inline float dot_row(const float *q, const void *k, const long dim,
                                                           const int half) {
    float dot = 0.0f;
    if (!half) {
#pragma omp simd reduction(+ : dot)
        for (long d = 0; d < dim; d++) dot += q[d] * ((const float *)k)[d];
        return dot;
    }
    for (long c = 0; c < dim; c += 64) {
        const long n = dim - c < 64 ? dim - c : 64;
        float w[64];
        widen((const kv_half *)k + c, w, n);
#pragma omp simd reduction(+ : dot)
        for (long d = 0; d < n; d++) dot += q[c + d] * w[d];
    }
    return dot;
}

/* Where one row's keys (and its values, at the same offsets from v) lie: from element `at`,
 * s_stride elements apart, or, in a paged cache (`pages` not NULL), key s in block
 * pages[s / page] at offset s % page, blocks of `page` keys from `at` (the row's head). */
typedef struct {
    long at, s_stride;
    const long *pages;
    long page;
} key_rows;

/* The run of consecutive keys that starts at key s: its first element's offset, and how many
 * keys it holds (at most len - s; where paged, to the end of s's block). */
static inline long key_run(const key_rows *r, const long s, const long len, long *off) {
    if (!r->pages) {
        *off = r->at + s * r->s_stride;
        return len - s;
    }
    const long in_page = s % r->page;
    *off = r->at + (r->pages[s / r->page] * r->page + in_page) * r->s_stride;
    return len - s < r->page - in_page ? len - s : r->page - in_page;
}

#define KV_ATTEND_MAX_DIM 256
/* One (row, query head) of a decode attention: softmax over keys [first, len) of q.k, then
 * the probabilities times V, into o [dim]; p: len - first floats of scratch. Inlined with dim a
 * constant (64, 128), the output row is a local array the compiler keeps in registers across
 * the keys, instead of loading and storing o for every key. A head wider than the array is
 * done in slices of it. */
__attribute__((always_inline)) static inline void attend(const float *qg, const void *k, const void *v,
                                                         const key_rows *r, long first, long len, const long dim,
                                                         float *p, float *o, const int half) {
    const long ss = r->s_stride;
    for (long s0 = first, off, m; s0 < len; s0 += m) {
        m = key_run(r, s0, len, &off);
        const void *kr = KV_PTR(k, off, half);
        float *ps = p + (s0 - first);
        long s = 0;
#ifdef __AVX512F__
        if (dim == 64) { /* 16 keys at a time: each key's 64 products in one vector, then 16 sums at once */
            for (; s + 16 <= m; s += 16) _mm512_storeu_ps(ps + s, dots16(qg, KV_PTR(kr, s * ss, half), ss, half));
        }
#endif
        for (; s < m; s++) ps[s] = dot_row(qg, KV_PTR(kr, s * ss, half), dim, half);
    }
    const float inv = exp_scores(p, len - first);
    float acc[KV_ATTEND_MAX_DIM];
    for (long c = 0; c < dim; c += KV_ATTEND_MAX_DIM) {
        const long w = dim - c < KV_ATTEND_MAX_DIM ? dim - c : KV_ATTEND_MAX_DIM;
        for (long d = 0; d < w; d++) acc[d] = 0.0f;
        for (long s0 = first, off, m; s0 < len; s0 += m) {
            m = key_run(r, s0, len, &off);
            const void *vr = KV_PTR(v, off + c, half);
            for (long s = 0; s < m; s++) axpy_row(acc, p[s0 - first + s] * inv, KV_PTR(vr, s * ss, half), w, half);
        }
        for (long d = 0; d < w; d++) o[c + d] = acc[d];
    }
}

#ifdef __AVX512F__
/* A row's G query heads (G <= 4) at once, head size 64: each block of 16 keys is read once and
 * stays in L1 for the G dots, and each value row once for the G outputs (one (row, head) at a
 * time read every key and value G times). p: G * keys floats; o: G * 64. */
__attribute__((always_inline)) static inline void attend_row64(const float *q, const long G, const void *k,
                                                               const void *v, const key_rows *r, long first,
                                                               long len, long keys, float *p, float *o,
                                                               const int half) {
    const long ss = r->s_stride, n = len - first;
    for (long s0 = first, off, m; s0 < len; s0 += m) {
        m = key_run(r, s0, len, &off);
        const void *kr = KV_PTR(k, off, half);
        float *ps = p + (s0 - first);
        long s = 0;
        for (; s + 16 <= m; s += 16) {
            const void *ks = KV_PTR(kr, s * ss, half);
            for (long g = 0; g < G; g++) _mm512_storeu_ps(ps + g * keys + s, dots16(q + g * 64, ks, ss, half));
        }
        for (; s < m; s++) {
            const void *ks = KV_PTR(kr, s * ss, half);
            for (long g = 0; g < G; g++) ps[g * keys + s] = dot_row(q + g * 64, ks, 64, half);
        }
    }
    for (long g = 0; g < G; g++) { /* softmax in place, normalised */
        float *pg = p + g * keys;
        const float inv = exp_scores(pg, n);
#pragma omp simd
        for (long t = 0; t < n; t++) pg[t] *= inv;
    }
    __m512 acc[4][4];
    for (long g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    for (long s0 = first, off, m; s0 < len; s0 += m) {
        m = key_run(r, s0, len, &off);
        const void *vr = KV_PTR(v, off, half);
        for (long s = 0; s < m; s++) {
            const void *vs = KV_PTR(vr, s * ss, half);
            const __m512 v0 = load16(vs, half), v1 = load16(KV_PTR(vs, 16, half), half),
                         v2 = load16(KV_PTR(vs, 32, half), half), v3 = load16(KV_PTR(vs, 48, half), half);
            for (long g = 0; g < G; g++) {
                const __m512 ps = _mm512_set1_ps(p[g * keys + s0 - first + s]);
                acc[g][0] = _mm512_fmadd_ps(ps, v0, acc[g][0]);
                acc[g][1] = _mm512_fmadd_ps(ps, v1, acc[g][1]);
                acc[g][2] = _mm512_fmadd_ps(ps, v2, acc[g][2]);
                acc[g][3] = _mm512_fmadd_ps(ps, v3, acc[g][3]);
            }
        }
    }
    for (long g = 0; g < G; g++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + g * 64 + 16 * c, acc[g][c]);
}
#endif

/* Attention of one query per item (a decode group), grouped-query heads sharing K/V.
 *   q: [N, G, D] contiguous (N = items x kv heads, q pre-scaled); out: [N, G, D].
 *   k, v: row n, key s at element n * n_stride + s * s_stride (D contiguous elements), float32,
 *   or float16 with half = 1.
 *   lens: [B] keys each item sees (its first lens[b] keys; the rest of the padded S are
 *   never read), or NULL for all `keys`; firsts: [B] the first of them each item sees (a
 *   sliding window hides the keys before it: they are never read), or NULL for 0. Item of row n: n / hkv ("bh" order, bh = 1) or
 *   n % items ("hb" order); its kv head the other factor. scratch: G * keys floats per thread
 *   (kv_max_threads). q_stride (bh order only; 0: q contiguous): item b's G * Hkv queries start
 *   at q + b * q_stride, so a step's q columns are read in place from its [T, (Hq + 2 Hkv) D]
 *   projection (no copy into [N, G, D], none out of it either: out [N, G, D] in bh order is
 *   [B, Hq * D]).
 *   item_rows: NULL, or (bh order) each item's row of a [rows, Hkv, S, D] slab: row n's keys
 *   then lie at element item_rows[item] * item_stride + head * head_stride (n_stride unused).
 *   pages: NULL, or each item's blocks of a paged cache [Hkv, slots, D] (page_width ids per
 *   item, `page` keys a block): row n's key s then lies in block pages[item * page_width +
 *   s / page] of its head, head * head_stride (n_stride unused), read where it lies (the
 *   gather of every item's blocks that torch's path needs, per layer, is not made).
 * softmax over the item's keys of q.k, then the probabilities times V: what torch's masked
 * path computes (a masked key's probability is exactly 0 there). The (row, query head) pairs
 * are shared among the threads of an OpenMP region from 4 up (a batch-1 decode has one row
 * per kv head, with G query heads each): built against the libgomp torch loaded (the
 * same soname), that region is torch's own pool, so no second pool spins against it. */
static inline key_rows row_keys(long n, long n_stride, long s_stride, long hkv, long items, int bh,
                                const long *item_rows, long item_stride, long head_stride, const long *pages,
                                long page_width, long page) {
    const long item = bh ? n / hkv : n % items, head = bh ? n % hkv : n / items;
    key_rows r = {n * n_stride, s_stride, NULL, page};
    if (item_rows)
        r.at = item_rows[item] * item_stride + head * head_stride;
    else if (pages) {
        r.at = head * head_stride;
        r.pages = pages + item * page_width;
    }
    return r;
}

/* Where row n's G queries start in q (see q_stride). */
static inline long q_row(long n, long row, long hkv, int bh, long q_stride) {
    return bh && q_stride ? (n / hkv) * q_stride + (n % hkv) * row : n * row;
}

__attribute__((always_inline)) static inline void decode_attention(
    const float *q, const void *k, const void *v, long n_stride, long s_stride, const long *lens, long rows,
    long groups, long keys, long dim, long hkv, long items, int bh, float *scratch, float *out,
    const long *item_rows, long item_stride, long head_stride, const long *pages, long page_width, long page,
    long q_stride, const long *firsts, const int half) {
#ifdef __AVX512F__
    /* Many rows: a row (its G heads together) per unit, each key and value read once. */
    if (dim == 64 && groups <= 4 && rows >= 8) {
#pragma omp parallel for schedule(static)
        for (long n = 0; n < rows; n++) {
#ifdef _OPENMP
            float *p = scratch + omp_get_thread_num() * groups * keys;
#else
            float *p = scratch;
#endif
            const key_rows r = row_keys(n, n_stride, s_stride, hkv, items, bh, item_rows, item_stride, head_stride,
                                        pages, page_width, page);
            const long item = bh ? n / hkv : n % items;
            const long len = lens ? lens[item] : keys, first = firsts ? firsts[item] : 0;
            const float *qn = q + q_row(n, groups * dim, hkv, bh, q_stride);
            float *on = out + n * groups * dim;
            switch (groups) { /* the head count as a constant: the accumulators stay in registers */
            case 1: attend_row64(qn, 1, k, v, &r, first, len, keys, p, on, half); break;
            case 2: attend_row64(qn, 2, k, v, &r, first, len, keys, p, on, half); break;
            case 3: attend_row64(qn, 3, k, v, &r, first, len, keys, p, on, half); break;
            default: attend_row64(qn, 4, k, v, &r, first, len, keys, p, on, half);
            }
        }
        return;
    }
#endif
    const long units = rows * groups;
#pragma omp parallel for schedule(static) if (units >= 4)
    for (long u = 0; u < units; u++) {
        const long n = u / groups;
#ifdef _OPENMP
        float *p = scratch + omp_get_thread_num() * keys;
#else
        float *p = scratch;
#endif
        const key_rows r = row_keys(n, n_stride, s_stride, hkv, items, bh, item_rows, item_stride, head_stride,
                                    pages, page_width, page);
        const float *qg = q + q_row(n, groups * dim, hkv, bh, q_stride) + (u % groups) * dim;
        const long item = bh ? n / hkv : n % items;
        const long len = lens ? lens[item] : keys, first = firsts ? firsts[item] : 0;
        float *o = out + u * dim;
        if (dim == 64) /* the usual head sizes as constants: see attend */
            attend(qg, k, v, &r, first, len, 64, p, o, half);
        else if (dim == 128)
            attend(qg, k, v, &r, first, len, 128, p, o, half);
        else
            attend(qg, k, v, &r, first, len, dim, p, o, half);
    }
}

/* The arguments of one decode attention, as one struct: the caller (fused.py) fills it once a
 * step and changes only q, k, v and out from layer to layer, so that a call passes one pointer
 * (ctypes took about 10 us a call to convert 23 arguments, more than a small batch's attention). */
typedef struct {
    const float *q;
    const void *k, *v;
    float *out, *scratch;
    const long *lens, *item_rows, *pages, *firsts;
    long n_stride, s_stride, rows, groups, keys, dim, hkv, items, bh, item_stride, head_stride, page_width,
        page, q_stride;
} kv_attention_args;

/* The two entries, kv_decode_attention (K/V float32) and kv_decode_attention_f16 (float16): one
 * body each, with the element type a constant (HALF). */
#define KV_DECODE_ENTRY(NAME, HALF)                                                                      \
    void NAME(const kv_attention_args *a) {                                                              \
        decode_attention(a->q, a->k, a->v, a->n_stride, a->s_stride, a->lens, a->rows,                   \
                         a->groups, a->keys, a->dim, a->hkv, a->items, (int)a->bh, a->scratch, a->out,   \
                         a->item_rows, a->item_stride, a->head_stride, a->pages, a->page_width, a->page, \
                         a->q_stride, a->firsts, HALF);                                                  \
    }
KV_DECODE_ENTRY(kv_decode_attention, 0)
KV_DECODE_ENTRY(kv_decode_attention_f16, 1)

/* n floats into float16, rounded to nearest even as torch's .to(float16) rounds, with the
 * vector conversion where the CPU has one (see widen). */
static inline void narrow(const float *src, kv_half *dst, const long n) {
    long d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= n; d += 16)
        _mm256_storeu_si256((__m256i *)(dst + d), _mm512_cvtps_ph(_mm512_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#elif defined(__F16C__)
    for (; d + 8 <= n; d += 8)
        _mm_storeu_si128((__m128i *)(dst + d), _mm256_cvtps_ph(_mm256_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; d < n; d++) dst[d] = (kv_half)src[d];
}

/* A step's new K and V into one layer of the paged cache, in one call (torch's path is a
 * view, a dtype conversion, a permute and an index_copy_: four dispatches a layer). Row r of
 * qkv (rows `stride` floats apart) holds, from column `col`, hkv heads of K and then hkv of V,
 * `dim` floats each; each head goes to slot slots[r] of cache [2, hkv, capacity, dim]
 * (contiguous; float32, or float16 with `half`). The caller has checked every slot against
 * the capacity. */
typedef struct {
    const float *qkv;
    void *cache;
    const long *slots;
    long stride, col, rows, hkv, dim, capacity, half;
} kv_store_args;

void kv_store(const kv_store_args *a) {
    const long heads = 2 * a->hkv, dim = a->dim;
    for (long r = 0; r < a->rows; r++) {
        const float *src = a->qkv + r * a->stride + a->col;
        for (long h = 0; h < heads; h++) { /* K's heads, then V's: [2, hkv] flattened */
            const long at = (h * a->capacity + a->slots[r]) * dim;
            if (a->half)
                narrow(src + h * dim, (kv_half *)a->cache + at, dim);
            else
                memcpy((float *)a->cache + at, src + h * dim, dim * sizeof(float));
        }
    }
}

/* ---- A whole step of a plain Llama stack in one call (``FusedOps.decode_step``) ----
 *
 * For a model whose layers are small (the spec's tiny Llama: hidden 32, six layers) a step is
 * its ~12 calls a layer, not their arithmetic: each product, norm or write costs a dispatch of
 * 5-15 us for well under a microsecond of work. This runs every layer of a step and the head
 * in one call, each token a row of its own (a prefill chunk's tokens and decodes alike, K/V in
 * the paged cache), with the same primitives as the per-op path: the norms, RoPE, the K/V
 * write and the decode attention above; the products are plain loops over the [in, out]
 * weights, which is where a large model would want a BLAS: ``llama.py`` sends only steps whose
 * products are small (WHOLE_STEP_MACS). */

static inline long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* out[r, :] = x[r, :] w for rows r; w [n_in, n_out] row-major (the host BLAS path's layout);
 * x and out rows x_stride and out_stride floats apart. Each output sums its n_in products in
 * order, whatever the rows: a row's result does not depend on the batch. */
static void linear_kn(const float *x, long x_stride, const float *w, long n_in, long n_out, float *out,
                      long out_stride, long rows) {
    for (long r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        for (long j = 0; j < n_out; j++) o[j] = 0.0f;
        for (long k = 0; k < n_in; k++) {
            const float xk = xr[k], *wk = w + k * n_out;
#pragma omp simd
            for (long j = 0; j < n_out; j++) o[j] += xk * wk[j];
        }
    }
}

/* One layer's weights: norms [hidden], products [in, out] (qkv's q rows pre-scaled and
 * pair-permuted as the per-op path holds them; gate_up [gate | up] rows). */
typedef struct {
    const float *input_norm, *qkv, *o, *post_norm, *gate_up, *down;
} kv_layer_weights;

/* A model's side of a whole step, set once (``fused.DecodeStack``), and a step's, set per call.
 * A step's T tokens are rows of their own: row r is token tokens[r] at position positions[r]
 * of its item, written to cache slot slots[r], attending to its item's keys up to its own
 * position (lens[r] = positions[r] + 1, filled here) through the blocks pages[r * page_width
 * ...]: a prefill's rows are causal, as every row's K/V is written before any attends. The
 * caller (fused.py) has checked every index against what it indexes. */
typedef struct {
    const kv_layer_weights *layers; /* [n_layers] */
    const float *final_norm, *head; /* [hidden], [hidden, vocab] */
    const float *embed;             /* the embedding's row t at embed + t * embed_row, columns embed_col apart */
    const float *rotary;            /* [positions, half] (cos, sin) pairs */
    long embed_row, embed_col;
    long hidden, qkv_out, q_width, inter, vocab, n_layers, heads, kv_heads, head_dim;
    float eps;
    /* the step */
    char *cache; /* the paged cache [L, 2, Hkv, capacity, D], float32 or (kv_half) float16 */
    long capacity, block_size, kv_half;
    const long *tokens, *positions, *slots, *pages; /* [T] each; pages [T, page_width] */
    long rows, page_width, keys;                    /* keys: the largest position + 1 */
    float *scratch; /* T (2 + 2 hidden + qkv_out + q_width + 2 inter + D) + groups keys threads floats */
    float *logits;  /* [T, vocab] out */
    long long kv_write_ns, attention_ns; /* out: time in the K/V writes and the attention */
} kv_step_args;

void kv_decode_step(kv_step_args *a) {
    const long T = a->rows, H = a->hidden, I = a->inter, D = a->head_dim, half = D / 2;
    long *lens = (long *)a->scratch; /* first: aligned as the buffer is */
    float *h = a->scratch + 2 * T, *x = h + T * H, *qkv = x + T * H, *attn = qkv + T * a->qkv_out;
    float *gate_up = attn + T * a->q_width, *rot = gate_up + T * 2 * I, *att_scratch = rot + T * D;
    for (long r = 0; r < T; r++) { /* the embedding rows, rotations and key counts of the step's tokens */
        lens[r] = a->positions[r] + 1;
        const float *e = a->embed + a->tokens[r] * a->embed_row;
        for (long j = 0; j < H; j++) h[r * H + j] = e[j * a->embed_col];
        memcpy(rot + r * D, a->rotary + a->positions[r] * D, D * sizeof(float));
    }
    const long elem = a->kv_half ? 2 : 4, v_bytes = a->kv_heads * a->capacity * D * elem;
    const long layer_bytes = 2 * v_bytes;
    kv_store_args store = {qkv, NULL, a->slots, a->qkv_out, a->q_width, T, a->kv_heads, D, a->capacity, a->kv_half};
    kv_attention_args at = {
        .q = qkv, .out = attn, .scratch = att_scratch, .lens = lens, .item_rows = NULL, .pages = a->pages,
        .firsts = NULL, .n_stride = 0, .s_stride = D, .rows = T * a->kv_heads, .groups = a->heads / a->kv_heads,
        .keys = a->keys, .dim = D, .hkv = a->kv_heads, .items = T, .bh = 1, .item_stride = 0,
        .head_stride = a->capacity * D, .page_width = a->page_width, .page = a->block_size, .q_stride = a->qkv_out};
    long long write_ns = 0, attn_ns = 0;
    kv_rms_norm(h, a->layers[0].input_norm, x, T, H, a->eps);
    for (long l = 0; l < a->n_layers; l++) {
        const kv_layer_weights *w = a->layers + l;
        linear_kn(x, H, w->qkv, H, a->qkv_out, qkv, a->qkv_out, T);
        kv_rope(qkv, a->qkv_out, rot, T, a->heads + a->kv_heads, half);
        char *layer = a->cache + l * layer_bytes;
        const long long t0 = now_ns();
        store.cache = layer;
        kv_store(&store);
        const long long t1 = now_ns();
        at.k = layer;
        at.v = layer + v_bytes;
        if (a->kv_half)
            kv_decode_attention_f16(&at);
        else
            kv_decode_attention(&at);
        const long long t2 = now_ns();
        write_ns += t1 - t0;
        attn_ns += t2 - t1;
        /* x is free once read: each product's output goes there, then into h with the next norm */
        linear_kn(attn, a->q_width, w->o, a->q_width, H, x, H, T);
        kv_add_rms_norm(h, x, w->post_norm, x, T, H, a->eps);
        linear_kn(x, H, w->gate_up, H, 2 * I, gate_up, 2 * I, T);
        for (long r = 0; r < T; r++) { /* silu(gate) * up, into the gate's columns */
            float *g = gate_up + r * 2 * I;
            for (long j = 0; j < I; j++) g[j] = g[j] / (1.0f + expf(-g[j])) * g[I + j];
        }
        linear_kn(gate_up, 2 * I, w->down, I, H, x, H, T);
        kv_add_rms_norm(h, x, l + 1 < a->n_layers ? a->layers[l + 1].input_norm : a->final_norm, x, T, H, a->eps);
    }
    linear_kn(x, H, a->head, H, a->vocab, a->logits, a->vocab, T);
    a->kv_write_ns = write_ns;
    a->attention_ns = attn_ns;
}
