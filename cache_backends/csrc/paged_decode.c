/* kvload's paged decode kernel for CPUs: each sequence's one new query attends over its pages, read in place.
 *
 * Built by cache_backends/cpu_kernel_build.py (gcc -O3 -march=native -ffast-math -fopenmp, compiled to an object and
 * linked without -ffast-math: linking with it adds crtfastmath, which flushes subnormals to zero in the whole process
 * when the library loads), called by cache_backends/cpu_decode.py.
 * Layout read (cache_backends/pools.py): a layer's slots are rows of (2, kv_heads, head_dim) elements, K at 0 and V
 * at v_offset; token position p of sequence b lives at slot tables[b][p / T] * T + p % T. Keys [lo, lens[b]) are
 * visible, lo = lens[b] - window for a sliding layer (pages before lo are never read: they may be released).
 *
 * Work item = (sequence, KV head): the head's K/V rows are read once for its whole group of query heads (GQA), a
 * span of at most SPAN tokens at a time: scores for the span, then an online softmax update of the running
 * (max, sum, accumulator) per query head. Accumulation is in float32 whatever the pool's dtype.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 64  /* query heads per KV head */
#define MAX_DIM 512   /* head_dim */
#define SPAN 64       /* tokens scored before one softmax update */

enum { F32 = 0, BF16 = 1, F16 = 2, BYTE = 3 };

/* One K or V row of D elements as float32: in place for a float32 pool, else widened into buf. */
static inline __attribute__((always_inline)) const float *
row(const void *kv, int64_t off, int D, int kind, const float *lut, float *buf) {
    if (kind == F32) return (const float *)kv + off;
    if (kind == BF16) {
        const uint16_t *p = (const uint16_t *)kv + off;
        uint32_t *d = (uint32_t *)buf;
        for (int i = 0; i < D; i++) d[i] = (uint32_t)p[i] << 16;
    } else if (kind == F16) {
        const _Float16 *p = (const _Float16 *)kv + off;
        for (int i = 0; i < D; i++) buf[i] = (float)p[i];
    } else { /* float8: widened through the 256-entry table of its values */
        const uint8_t *p = (const uint8_t *)kv + off;
        for (int i = 0; i < D; i++) buf[i] = lut[p[i]];
    }
    return buf;
}

/* One (sequence, KV head). Returns 0, or -2 when a visible position has no page in the pool. */
static inline __attribute__((always_inline)) int
attend_one(const float *q, int64_t q_sh, const void *kv, const int64_t *table, int64_t width, int64_t end,
           int64_t lo, int G, int D, int T, int64_t row_stride, int64_t k_col, int64_t v_col, int64_t num_blocks,
           float scale, float softcap, int kind, const float *lut, float *out, int64_t o_sh) {
    float s[MAX_GROUP][SPAN];
    float acc[MAX_GROUP][MAX_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float kbuf[MAX_DIM], vbuf[MAX_DIM];
    for (int g = 0; g < G; g++) {
        m[g] = -FLT_MAX;  /* built with -ffast-math (finite math): no infinities anywhere */
        l[g] = 0.f;
        memset(acc[g], 0, (size_t)D * sizeof(float));
    }
    for (int64_t pos = lo; pos < end;) {
        const int64_t j = pos / T;
        if (j >= width) return -2;
        const int64_t page = table[j];
        if (page < 0 || page >= num_blocks) return -2;
        const int64_t t0 = pos - j * T;
        int64_t t1 = end - j * T < T ? end - j * T : T;
        if (t1 - t0 > SPAN) t1 = t0 + SPAN;
        const int n = (int)(t1 - t0);
        const int64_t base = (page * T + t0) * row_stride;
        for (int t = 0; t < n; t++) {
            const float *k = row(kv, base + t * row_stride + k_col, D, kind, lut, kbuf);
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * q_sh;
                float dot = 0.f;
                for (int d = 0; d < D; d++) dot += qg[d] * k[d];
                dot *= scale;
                if (softcap > 0.f) dot = softcap * tanhf(dot / softcap);
                s[g][t] = dot;
            }
        }
        for (int g = 0; g < G; g++) {
            float top = m[g];
            for (int t = 0; t < n; t++) top = s[g][t] > top ? s[g][t] : top;
            const float alpha = l[g] > 0.f ? expf(m[g] - top) : 0.f;  /* nothing to rescale before the first span */
            float sum = 0.f;
            for (int t = 0; t < n; t++) {
                const float p = expf(s[g][t] - top);
                s[g][t] = p;
                sum += p;
            }
            l[g] = l[g] * alpha + sum;
            m[g] = top;
            if (alpha != 1.f)
                for (int d = 0; d < D; d++) acc[g][d] *= alpha;
        }
        for (int t = 0; t < n; t++) {
            const float *v = row(kv, base + t * row_stride + v_col, D, kind, lut, vbuf);
            for (int g = 0; g < G; g++) {
                const float p = s[g][t];
                float *a = acc[g];
                for (int d = 0; d < D; d++) a[d] += p * v[d];
            }
        }
        pos += n;
    }
    for (int g = 0; g < G; g++) {
        float *o = out + g * o_sh;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int d = 0; d < D; d++) o[d] = acc[g][d] * inv;
    }
    return 0;
}

/* attend_one with the pool kind and (for the common sizes) the head size as constants, so the compiler unrolls and
 * vectorizes each; the parallel loop below calls one of these (an OpenMP region would hide constants from it). */
typedef int (*one_fn)(const float *, int64_t, const void *, const int64_t *, int64_t, int64_t, int64_t, int, int,
                      int, int64_t, int64_t, int64_t, int64_t, float, float, const float *, float *, int64_t);
#define SPECIAL(NAME, KIND, DIM)                                                                                 \
    static int NAME(const float *q, int64_t q_sh, const void *kv, const int64_t *table, int64_t width,            \
                    int64_t end, int64_t lo, int G, int D, int T, int64_t row_stride, int64_t k_col,              \
                    int64_t v_col, int64_t num_blocks, float scale, float softcap, const float *lut, float *out,  \
                    int64_t o_sh) {                                                                               \
        (void)D;                                                                                                 \
        return attend_one(q, q_sh, kv, table, width, end, lo, G, DIM, T, row_stride, k_col, v_col, num_blocks,   \
                          scale, softcap, KIND, lut, out, o_sh);                                                 \
    }
#define KIND_SPECIALS(KIND) SPECIAL(one_##KIND##_64, KIND, 64) SPECIAL(one_##KIND##_128, KIND, 128)               \
    SPECIAL(one_##KIND##_256, KIND, 256) SPECIAL(one_##KIND##_any, KIND, D)
KIND_SPECIALS(F32)
KIND_SPECIALS(BF16)
KIND_SPECIALS(F16)
KIND_SPECIALS(BYTE)
#define PICK(KIND)                                                                                               \
    (D == 64 ? one_##KIND##_64 : D == 128 ? one_##KIND##_128 : D == 256 ? one_##KIND##_256 : one_##KIND##_any)

/* The entry point: float32 queries (rows strided q_sb, q_sh; elements contiguous), float32 out (B, H, D).
 * kind: 0 float32, 1 bfloat16, 2 float16, 3 one byte (float8, widened through lut). Returns 0; -1 for shapes the
 * kernel does not take (checked by the caller first); -2 for a visible position with no page in the pool. */
int kvload_paged_decode(const float *q, int64_t q_sb, int64_t q_sh, const void *kv, const int64_t *tables,
                        int64_t table_stride, int64_t table_width, const int64_t *lens, int B, int H, int Hkv,
                        int D, int T, int64_t row_stride, int64_t v_offset, int64_t num_blocks, int64_t window,
                        float scale, float softcap, int kind, const float *lut, float *out, int nthreads) {
    if (Hkv < 1 || H % Hkv || H / Hkv > MAX_GROUP || D < 1 || D > MAX_DIM || T < 1) return -1;
    one_fn one;
    switch (kind) {
    case F32: one = PICK(F32); break;
    case BF16: one = PICK(BF16); break;
    case F16: one = PICK(F16); break;
    case BYTE: one = PICK(BYTE); break;
    default: return -1;
    }
    const int G = H / Hkv;
    int status = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (nthreads > 1) reduction(min : status)
    for (int item = 0; item < B * Hkv; item++) {
        const int b = item / Hkv, h = item % Hkv;
        const int64_t end = lens[b];
        const int64_t lo = window > 0 && end > window ? end - window : 0;
        const int rc = one(q + b * q_sb + (int64_t)h * G * q_sh, q_sh, kv, tables + b * table_stride, table_width,
                           end, lo, G, D, T, row_stride, (int64_t)h * D, v_offset + (int64_t)h * D, num_blocks, scale,
                           softcap, lut, out + ((int64_t)b * H + (int64_t)h * G) * D, D);
        status = rc < status ? rc : status;
    }
    return status;
}
