/* Hand-fused float32 ops for the CPU forward (see fused.py, which compiles and loads this).
 *
 * Each function is one pass over rows that torch runs as several dispatched ops. Between
 * the weight products every op runs with cold caches (a product streams megabytes of
 * weights through them), so a batch-1 layer's ~40 small ops cost 3-5x their warm time; one
 * call each for the norm, RoPE, SiLU-gate and a decode's attention removes most of that.
 * Plain C, float32, no threads: the inputs are a few rows. Reductions are vectorised with
 * `omp simd` (compiled with -fopenmp-simd: no OpenMP runtime is linked); exponentials are
 * libm's expf, one call per element, so SiLU over many rows stays with torch's vectorised
 * kernel (fused.py decides).
 */
#include <math.h>
#include <stddef.h>

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

static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o, long n) {
    for (long j = 0; j < n; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* out[r, j] = silu(gu[r, j]) * gu[r, inter + j]; gu: [rows, 2 * inter], out: [rows, inter]. */
void kv_silu_mul(const float *gu, float *out, long rows, long inter) {
    for (long r = 0; r < rows; r++) silu_mul_row(gu + r * 2 * inter, gu + r * 2 * inter + inter, out + r * inter, inter);
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

/* Attention of one query per item (a decode group), grouped-query heads sharing K/V.
 *   q: [N, G, D] contiguous (N = items x kv heads, q pre-scaled); out: [N, G, D].
 *   k, v: row n, key s at k + n * n_stride + s * s_stride (D contiguous floats).
 *   lens: [B] keys each item sees (its first lens[b] keys; the rest of the padded S are
 *   never read), or NULL for all `keys`. Item of row n: n / hkv ("bh" order, bh = 1) or
 *   n % items ("hb" order). scratch: G * keys floats.
 * softmax over the item's keys of q.k, then the probabilities times V: what torch's masked
 * path computes (a masked key's probability is exactly 0 there). */
void kv_decode_attention(const float *q, const float *k, const float *v, long n_stride, long s_stride,
                         const long *lens, long rows, long groups, long keys, long dim, long hkv, long items,
                         int bh, float *scratch, float *out) {
    for (long n = 0; n < rows; n++) {
        const float *kn = k + n * n_stride, *vn = v + n * n_stride;
        const float *qn = q + n * groups * dim;
        const long len = lens ? lens[bh ? n / hkv : n % items] : keys;
        for (long s = 0; s < len; s++) {
            const float *ks = kn + s * s_stride;
            for (long g = 0; g < groups; g++) {
                const float *qg = qn + g * dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (long d = 0; d < dim; d++) dot += qg[d] * ks[d];
                scratch[g * keys + s] = dot;
            }
        }
        for (long g = 0; g < groups; g++) {
            float *p = scratch + g * keys;
            float mx = -INFINITY, sum = 0.0f;
            for (long s = 0; s < len; s++) mx = p[s] > mx ? p[s] : mx;
            for (long s = 0; s < len; s++) {
                p[s] = expf(p[s] - mx);
                sum += p[s];
            }
            const float inv = 1.0f / sum;
            float *o = out + (n * groups + g) * dim;
            for (long d = 0; d < dim; d++) o[d] = 0.0f;
            for (long s = 0; s < len; s++) {
                const float ps = p[s] * inv;
                const float *vs = vn + s * s_stride;
#pragma omp simd
                for (long d = 0; d < dim; d++) o[d] += ps * vs[d];
            }
        }
    }
}
