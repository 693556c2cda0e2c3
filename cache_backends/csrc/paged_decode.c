/* kvload's paged decode kernel for CPUs: each sequence's one new query attends over its pages, read in place.
 *
 * Built by cache_backends/cpu_kernel_build.py (gcc -O3 -march=native -ffast-math -fopenmp, compiled to an object and
 * linked without -ffast-math: linking with it adds crtfastmath, which flushes subnormals to zero in the whole process
 * when the library loads), called by cache_backends/cpu_decode.py.
 * Layout read (cache_backends/pools.py): a layer's slots are rows of (2, kv_heads, head_dim) elements, K at 0 and V
 * at v_offset; token position p of sequence b lives at slot tables[b][p / T] * T + p % T. Keys [lo, lens[b]) are
 * visible, lo = lens[b] - window for a sliding layer (pages before lo are never read: they may be released).
 *
 * Work item = (sequence, a run of its KV heads): a span of at most SPAN tokens of one page at a time, each KV head's
 * K/V rows read once for its whole group of query heads (GQA): scores for the span, then an online softmax update
 * of the running (max, sum, accumulator) per query head. Accumulation is in float32 whatever the pool's dtype.
 * With fewer such items than threads (one long sequence over one or two KV heads), each sequence's keys are also cut
 * into ranges of at least MIN_SPLIT_KEYS attended apart and merged by their running max (split-KV, flash-decoding).
 * Head sizes 64 / 128 / 256 take the vectorized path (attend_vec: 16 tokens' dot products reduced together, V read
 * in tiles that stay in L1); any other size up to MAX_DIM the scalar one (attend_one, a head at a time).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 64  /* query heads per KV head */
#define MAX_DIM 512   /* head_dim */
#define SPAN 64       /* tokens scored before one softmax update */
#define MIN_SPLIT_KEYS 256  /* the fewest keys a split of one sequence's keys gets (split-KV, few items) */

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

/* The span starting at position pos: up to SPAN tokens of one page, ending by end. Sets *n and *first (the slot of
 * its first token); returns 0, or -2 when its page is missing from the table or the pool. */
static inline __attribute__((always_inline)) int span_at(int64_t pos, int64_t end, int T, const int64_t *table,
                                                         int64_t width, int64_t num_blocks, int *n, int64_t *first) {
    const int64_t j = pos / T;
    if (j >= width) return -2;
    const int64_t page = table[j];
    if (page < 0 || page >= num_blocks) return -2;
    const int64_t t0 = pos - j * T;
    int64_t t1 = end - j * T < T ? end - j * T : T;
    if (t1 - t0 > SPAN) t1 = t0 + SPAN;
    *n = (int)(t1 - t0);
    *first = page * T + t0;
    return 0;
}

/* One span's online-softmax step for one query head: scores s[0..n) become their exponentials against the new
 * running max, *m and *l are updated; returns the factor the accumulator must be rescaled by. */
static inline __attribute__((always_inline)) float softmax_span(float *s, int n, float *m, float *l) {
    float top = *m;
    for (int t = 0; t < n; t++) top = s[t] > top ? s[t] : top;
    const float alpha = *l > 0.f ? expf(*m - top) : 0.f;  /* nothing to rescale before the first span */
    float sum = 0.f;
    for (int t = 0; t < n; t++) {
        const float p = expf(s[t] - top);
        s[t] = p;
        sum += p;
    }
    *l = *l * alpha + sum;
    *m = top;
    return alpha;
}

/* One (sequence, KV head). Returns 0, or -2 when a visible position has no page in the pool. */
static inline __attribute__((always_inline)) int
attend_one(const float *q, int64_t q_sh, const void *kv, const int64_t *table, int64_t width, int64_t end,
           int64_t lo, int G, int D, int T, int64_t row_stride, int64_t k_col, int64_t v_col, int64_t num_blocks,
           float scale, float softcap, int kind, const float *lut, float *out, int64_t o_sh, float *ml) {
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
        int n;
        int64_t first;
        if (span_at(pos, end, T, table, width, num_blocks, &n, &first)) return -2;
        const int64_t base = first * row_stride;
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
            const float alpha = softmax_span(s[g], n, &m[g], &l[g]);
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
        if (ml) {  /* a split of the keys: its running max and sum, the accumulator unnormalized (merged later) */
            ml[2 * g] = m[g], ml[2 * g + 1] = l[g];
            for (int d = 0; d < D; d++) o[d] = acc[g][d];
        } else {
            for (int d = 0; d < D; d++) o[d] = acc[g][d] * inv;
        }
    }
    return 0;
}


/* ---- the vectorized path (head_dim 64 / 128 / 256): GCC/clang vector extensions, lowered to the machine's SIMD ---- */
#define VW 16                /* lanes of one vector: the dot products of 16 tokens are reduced together */
#define MAX_ITEM_HEADS 64    /* query heads one work item holds state for */
#define BLK_DIM 256          /* widest head the vectorized path takes */
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));  /* an unaligned load or store */

/* Lane i of the result is the sum of x[i]'s lanes: 16 horizontal sums in 30 shuffles (one each costs 8). */
static inline __attribute__((always_inline)) vf reduce16(const vf *x) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SH __builtin_shufflevector
    vf a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = SH(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SH(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        b[i] = SH(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SH(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        c[i] = SH(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SH(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SH(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SH(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#undef SH
#else
    vf r;
    for (int i = 0; i < VW; i++) {
        float s = 0.f;
        for (int j = 0; j < VW; j++) s += x[i][j];
        r[i] = s;
    }
    return r;
#endif
}

static const float ZERO_ROW[BLK_DIM] __attribute__((aligned(64)));

/* One sequence, KV heads [h0, h0 + nh): each span's rows are read once for all of them (a row holds every head's K
 * and V: reading one head's columns at a time let the prefetcher fetch the others' and read them again later).
 * NC = D / VW, a constant in each specialization. */
static inline __attribute__((always_inline)) int
attend_vec(const float *q, int64_t q_sh, const void *kv, const int64_t *table, int64_t width, int64_t end,
           int64_t lo, int G, int nh, int h0, const int NC, int T, int64_t row_stride, int64_t v_offset,
           int64_t num_blocks, float scale, float softcap, int kind, const float *lut, float *out, int64_t o_sh,
           float *ml) {
    const int D = NC * VW;
    /* on the stack: up to ~220 KB at head_dim 256 over a half or byte pool (fine for glibc's and libomp's thread
     * stacks, and macOS's 512 KB; more than musl's 128 KB default) */
    vf qv[MAX_ITEM_HEADS][NC];
    vf acc[MAX_ITEM_HEADS][NC];
    float s[MAX_GROUP][SPAN] __attribute__((aligned(64)));
    float m[MAX_ITEM_HEADS], l[MAX_ITEM_HEADS];
    float blk[SPAN * BLK_DIM] __attribute__((aligned(64)));  /* a span's rows widened from a half or byte pool */
    const float *rows[SPAN + VW];
    for (int i = 0; i < nh * G; i++) {
        for (int c = 0; c < NC; c++) {
            qv[i][c] = *(const vfu *)(q + i * q_sh + c * VW) * scale;
            acc[i][c] = (vf){0};
        }
        m[i] = -FLT_MAX;  /* built with -ffast-math (finite math): no infinities anywhere */
        l[i] = 0.f;
    }
    for (int t = 0; t < SPAN + VW; t++) rows[t] = ZERO_ROW;  /* past a span's end: dot products of 0, unused */
    for (int64_t pos = lo; pos < end;) {
        int n;
        int64_t first;
        if (span_at(pos, end, T, table, width, num_blocks, &n, &first)) return -2;
        const int64_t base = first * row_stride;
        for (int hh = 0; hh < nh; hh++) {
            const int64_t k_col = (int64_t)(h0 + hh) * D, v_col = v_offset + k_col;
            vf(*qh)[NC] = qv + hh * G;
            vf(*ah)[NC] = acc + hh * G;
            float *mh = m + hh * G, *lh = l + hh * G;
            for (int t = 0; t < n; t++) rows[t] = row(kv, base + t * row_stride + k_col, D, kind, lut, blk + t * D);
            for (int tb = 0; tb < n; tb += VW) {
                for (int g = 0; g < G; g++) {
                    vf x[VW];
                    for (int i = 0; i < VW; i++) {
                        const float *k = rows[tb + i];
                        vf a = qh[g][0] * *(const vfu *)k;
                        for (int c = 1; c < NC; c++) a += qh[g][c] * *(const vfu *)(k + c * VW);
                        x[i] = a;
                    }
                    *(vf *)(s[g] + tb) = reduce16(x);
                }
            }
            for (int g = 0; g < G; g++) {
                if (softcap > 0.f)
                    for (int t = 0; t < n; t++) s[g][t] = softcap * tanhf(s[g][t] / softcap);
                const float alpha = softmax_span(s[g], n, &mh[g], &lh[g]);
                if (alpha != 1.f)
                    for (int c = 0; c < NC; c++) ah[g][c] *= alpha;
            }
            for (int t = 0; t < n; t++) rows[t] = row(kv, base + t * row_stride + v_col, D, kind, lut, blk + t * D);
            /* V in tiles of VW rows: a tile stays in L1 while every query head of the group reads it (rows a power
             * of two apart share few cache sets: a whole span of them would not) */
            for (int tb = 0; tb < n; tb += VW) {
                const int te = tb + VW < n ? tb + VW : n;
                for (int g = 0; g < G; g++) {  /* two accumulators per lane, in registers over the tile */
                    vf a0[NC], a1[NC];
                    for (int c = 0; c < NC; c++) a0[c] = ah[g][c], a1[c] = (vf){0};
                    const float *p = s[g];
                    int t = tb;
                    for (; t + 1 < te; t += 2) {
                        const float *v0 = rows[t], *v1 = rows[t + 1];
                        for (int c = 0; c < NC; c++) {
                            a0[c] += p[t] * *(const vfu *)(v0 + c * VW);
                            a1[c] += p[t + 1] * *(const vfu *)(v1 + c * VW);
                        }
                    }
                    if (t < te)
                        for (int c = 0; c < NC; c++) a0[c] += p[t] * *(const vfu *)(rows[t] + c * VW);
                    for (int c = 0; c < NC; c++) ah[g][c] = a0[c] + a1[c];
                }
            }
            for (int t = 0; t < n; t++) rows[t] = ZERO_ROW;
        }
        pos += n;
    }
    for (int i = 0; i < nh * G; i++) {
        float *o = out + i * o_sh;
        if (ml) {  /* a split of the keys: unnormalized, with its running max and sum (merged later) */
            ml[2 * i] = m[i], ml[2 * i + 1] = l[i];
            for (int c = 0; c < NC; c++) *(vfu *)(o + c * VW) = acc[i][c];
            continue;
        }
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        for (int c = 0; c < NC; c++) *(vfu *)(o + c * VW) = acc[i][c] * inv;
    }
    return 0;
}

/* The kernels the entry point picks from: pool kind and (vectorized) head size as constants, so the compiler unrolls
 * each; the parallel loop calls one of these (an OpenMP region would hide constants from it). The general one
 * (any head size up to MAX_DIM) runs attend_one per head. */
typedef int (*seq_fn)(const float *, int64_t, const void *, const int64_t *, int64_t, int64_t, int64_t, int, int, int,
                      int, int, int64_t, int64_t, int64_t, float, float, const float *, float *, int64_t, float *);
#define VEC(NAME, KIND, NCV)                                                                                     \
    static int NAME(const float *q, int64_t q_sh, const void *kv, const int64_t *table, int64_t width,            \
                    int64_t end, int64_t lo, int G, int nh, int h0, int D, int T, int64_t row_stride,             \
                    int64_t v_offset, int64_t num_blocks, float scale, float softcap, const float *lut,           \
                    float *out, int64_t o_sh, float *ml) {                                                        \
        (void)D;                                                                                                 \
        return attend_vec(q, q_sh, kv, table, width, end, lo, G, nh, h0, NCV, T, row_stride, v_offset,           \
                          num_blocks, scale, softcap, KIND, lut, out, o_sh, ml);                                 \
    }
#define ANY(NAME, KIND)                                                                                          \
    static int NAME(const float *q, int64_t q_sh, const void *kv, const int64_t *table, int64_t width,            \
                    int64_t end, int64_t lo, int G, int nh, int h0, int D, int T, int64_t row_stride,             \
                    int64_t v_offset, int64_t num_blocks, float scale, float softcap, const float *lut,           \
                    float *out, int64_t o_sh, float *ml) {                                                        \
        for (int hh = 0; hh < nh; hh++) {                                                                        \
            const int64_t h = h0 + hh;                                                                           \
            const int rc = attend_one(q + hh * G * q_sh, q_sh, kv, table, width, end, lo, G, D, T, row_stride,   \
                                      h * D, v_offset + h * D, num_blocks, scale, softcap, KIND, lut,            \
                                      out + hh * G * o_sh, o_sh, ml ? ml + 2 * hh * G : NULL);                   \
            if (rc) return rc;                                                                                   \
        }                                                                                                        \
        return 0;                                                                                                \
    }
#define KIND_SPECIALS(KIND) VEC(seq_##KIND##_64, KIND, 4) VEC(seq_##KIND##_128, KIND, 8)                          \
    VEC(seq_##KIND##_256, KIND, 16) ANY(seq_##KIND##_any, KIND)
KIND_SPECIALS(F32)
KIND_SPECIALS(BF16)
KIND_SPECIALS(F16)
KIND_SPECIALS(BYTE)
#define PICK(KIND)                                                                                               \
    (D == 64 ? seq_##KIND##_64 : D == 128 ? seq_##KIND##_128 : D == 256 ? seq_##KIND##_256 : seq_##KIND##_any)

/* Store sequence b's new K and V rows (heads h0 .. h0 + nh) at position lens[b] - 1 before attending: the caller's
 * index_copy per layer, folded into the call. Elements are copied as they are (the caller passes K/V already in the
 * pool's dtype). Returns 0, or -2 when that position has no page. */
static int write_new(const void *k_new, const void *v_new, int64_t kn_sb, int64_t kn_sh, int64_t vn_sb,
                     int64_t vn_sh, int b, int h0, int nh, void *kv, const int64_t *table, int64_t width, int64_t end,
                     int D, int T, int64_t row_stride, int64_t v_offset, int64_t num_blocks, int kind) {
    const int64_t pos = end - 1, j = pos / T;
    if (pos < 0 || j >= width) return -2;
    const int64_t page = table[j];
    if (page < 0 || page >= num_blocks) return -2;
    const size_t es = kind == F32 ? 4 : kind == BYTE ? 1 : 2;
    char *dst = (char *)kv + (size_t)((page * T + pos - j * T) * row_stride) * es;
    for (int hh = 0; hh < nh; hh++) {
        const int64_t h = h0 + hh;
        memcpy(dst + (size_t)(h * D) * es, (const char *)k_new + (size_t)(b * kn_sb + h * kn_sh) * es, (size_t)D * es);
        memcpy(dst + (size_t)(v_offset + h * D) * es, (const char *)v_new + (size_t)(b * vn_sb + h * vn_sh) * es,
               (size_t)D * es);
    }
    return 0;
}

/* The entry point's arguments in one record, filled by cache_backends/cpu_decode.py (its _DecodeArgs lists the
 * same fields in the same order): a call through ctypes converts each argument it is given, ~0.2 us apiece, and a
 * model makes this call once per layer per step. Queries: float32 (rows strided q_sb, q_sh; elements contiguous);
 * out: float32 (B, H, D). kind: 0 float32, 1 bfloat16, 2 float16, 3 one byte (float8, widened through lut).
 * k_new / v_new: NULL, or the step's new K and V (B, Hkv, D) in the pool's dtype (strides in elements; a row's D
 * elements contiguous), stored at each sequence's last position first. */
typedef struct {
    const float *q;
    int64_t q_sb, q_sh;
    void *kv;
    const int64_t *tables;
    int64_t table_stride, table_width;
    const int64_t *lens;
    int64_t B, H, Hkv, D, T, row_stride, v_offset, num_blocks, window;
    double scale, softcap;
    int64_t kind;
    const float *lut;
    float *out;
    int64_t nthreads;
    const void *k_new, *v_new;
    int64_t kn_sb, kn_sh, vn_sb, vn_sh;
} decode_args;

/* How a call's work is cut: run KV heads per item, per items per sequence, S key ranges per sequence (S > 1:
 * split-KV, partials in part / ml). */
typedef struct {
    seq_fn one;
    int G, run, per, S;
    float *part, *ml;
} decode_plan;

/* One work item: item = (sequence, run of KV heads, key range); returns 0 or -2. */
static int run_item(const decode_args *a, const decode_plan *p, int item) {
    const int S = p->S, G = p->G, D = (int)a->D, T = (int)a->T, H = (int)a->H, B = (int)a->B;
    const int s = item % S, b = item / S / p->per, h0 = (item / S % p->per) * p->run;
    const int nh = (int)a->Hkv - h0 < p->run ? (int)a->Hkv - h0 : p->run;
    const int64_t end = a->lens[b];
    const int64_t lo = a->window > 0 && end > a->window ? end - a->window : 0;
    /* split s: keys [lo + keys * s / S, lo + keys * (s + 1) / S); the last one holds the new token's row, so it
     * alone stores it (no other split reads that row) */
    const int64_t first = lo + (end - lo) * s / S, stop = lo + (end - lo) * (s + 1) / S;
    const int64_t *table = a->tables + b * a->table_stride;
    if (a->k_new && s == S - 1) {
        const int rc = write_new(a->k_new, a->v_new, a->kn_sb, a->kn_sh, a->vn_sb, a->vn_sh, b, h0, nh, a->kv, table,
                                 a->table_width, end, D, T, a->row_stride, a->v_offset, a->num_blocks, (int)a->kind);
        if (rc) return rc;
    }
    const size_t row0 = (size_t)b * H + (size_t)h0 * G;  /* the item's first query head, in (B, H) order */
    return p->one(a->q + b * a->q_sb + (int64_t)h0 * G * a->q_sh, a->q_sh, a->kv, table, a->table_width, stop, first,
                  G, nh, h0, D, T, a->row_stride, a->v_offset, a->num_blocks, (float)a->scale, (float)a->softcap,
                  a->lut, S > 1 ? p->part + ((size_t)s * B * H + row0) * D : a->out + row0 * D, D,
                  S > 1 ? p->ml + ((size_t)s * B * H + row0) * 2 : NULL);
}

/* Merge the S splits of output row r (a sequence's query head): each rescaled to the largest running max. */
static void merge_splits(const decode_args *a, const decode_plan *p, int r) {
    const int S = p->S, D = (int)a->D;
    const size_t BH = (size_t)a->B * a->H;
    float top = -FLT_MAX, sum = 0.f;
    for (int s = 0; s < S; s++) {
        const float *x = p->ml + (s * BH + r) * 2;
        if (x[1] > 0.f && x[0] > top) top = x[0];
    }
    float *o = a->out + (size_t)r * D;
    for (int d = 0; d < D; d++) o[d] = 0.f;
    for (int s = 0; s < S; s++) {
        const float *x = p->ml + (s * BH + r) * 2;
        if (!(x[1] > 0.f)) continue;  /* an empty split */
        const float w = expf(x[0] - top);
        const float *part = p->part + (s * BH + r) * D;
        sum += w * x[1];
        for (int d = 0; d < D; d++) o[d] += w * part[d];
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int d = 0; d < D; d++) o[d] *= inv;
}

/* The entry point. Returns 0; -1 for shapes the kernel does not take (checked by the caller first); -2 for a
 * visible position with no page in the pool.
 * Work item = (sequence, a run of KV heads): all of a sequence's heads where that leaves every thread an item.
 * One thread runs the items in a plain loop: an OpenMP region, even one its if clause turns off, costs ~1 us. */
int kvload_paged_decode(const decode_args *a) {
    const int64_t B = a->B, H = a->H, Hkv = a->Hkv, D = a->D, nthreads = a->nthreads;
    if (Hkv < 1 || H % Hkv || H / Hkv > MAX_GROUP || D < 1 || D > MAX_DIM || a->T < 1 || B < 0 || B > INT32_MAX / H)
        return -1;
    decode_plan p = {.G = (int)(H / Hkv), .S = 1};
    switch (a->kind) {
    case F32: p.one = PICK(F32); break;
    case BF16: p.one = PICK(BF16); break;
    case F16: p.one = PICK(F16); break;
    case BYTE: p.one = PICK(BYTE); break;
    default: return -1;
    }
    int run = MAX_ITEM_HEADS / p.G < Hkv ? MAX_ITEM_HEADS / p.G : (int)Hkv;  /* KV heads per item */
    while (run > 1 && B * ((Hkv + run - 1) / run) < nthreads) run = (run + 1) / 2;
    p.run = run;
    p.per = (int)((Hkv + run - 1) / run);  /* items per sequence */
    /* Split-KV: fewer (sequence, head run) items than threads (one long sequence over few KV heads) cuts each
     * sequence's keys into S ranges of at least MIN_SPLIT_KEYS, attended apart and merged (flash-decoding) */
    if (B * p.per < nthreads) {
        int64_t most = 0;
        for (int64_t b = 0; b < B; b++) {
            const int64_t keys = a->window > 0 && a->lens[b] > a->window ? a->window : a->lens[b];
            most = keys > most ? keys : most;
        }
        int64_t S = (nthreads + B * p.per - 1) / (B * p.per);
        if (S > most / MIN_SPLIT_KEYS) S = most / MIN_SPLIT_KEYS;
        p.S = S < 1 ? 1 : (int)S;
    }
    if (p.S > 1) {  /* per split: unnormalized outputs (B, H, D), then (max, sum) per (B, H) */
        p.part = malloc(sizeof(float) * (size_t)p.S * B * H * (D + 2));
        if (!p.part) p.S = 1;
        else p.ml = p.part + (size_t)p.S * B * H * D;
    }
    const int items = (int)B * p.per * p.S, threads = (int)nthreads;
    int status = 0;
    if (threads <= 1) {
        for (int item = 0; item < items && status == 0; item++) status = run_item(a, &p, item);
    } else {
#pragma omp parallel for num_threads(threads) schedule(static) reduction(min : status)
        for (int item = 0; item < items; item++) {
            const int rc = run_item(a, &p, item);
            status = rc < status ? rc : status;
        }
    }
    if (p.S > 1) {
        if (status == 0) {
#pragma omp parallel for num_threads(threads) schedule(static)
            for (int r = 0; r < (int)(B * H); r++) merge_splits(a, &p, r);
        }
        free(p.part);
    }
    return status;
}
