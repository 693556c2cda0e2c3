/* y = x W^T (+ bias) for a few rows of x: the projections of a decode step on a CPU.
 *
 * A decode step multiplies each weight matrix by one row per running sequence. BLAS libraries tune sgemm for large
 * M; at 4-12 rows MKL takes 1.6-2x this kernel's time (BENCHMARKS.md, "Small-batch projections on CPU"). Here
 * each weight row is read from memory once per call, into registers, and multiplied with every row of x while it
 * is there: for a block of OB weight rows, MB rows of x are done at a time (the block stays in L1 between row
 * groups), with OB x MB vector accumulators and a software prefetch PF floats ahead in each weight row; where a block
 * takes more than one group of x rows, every group also prefetches its share of the next block (see span()).
 *
 * Written with GCC vector extensions, so one source serves AVX-512 (16-float vectors), AVX2 (8) and plain SSE
 * builds; the block shapes follow the register count. The sum over k runs in vector lanes, then across lanes:
 * a different order from BLAS's, so results match torch's within float rounding, not bit for bit.
 */
#include <stddef.h>
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX512F__)
#define ISA 512
#define VW 16  /* floats per vector */
#define OB_WIDE 8
#define OB_NARROW 4
#else
#if defined(__AVX2__) && defined(__FMA__)
#define ISA 256
#else
#define ISA 0  /* no wide FMA: the compiler's plain vectors, slower than BLAS at every row count measured */
#endif
#define VW 8
#define OB_WIDE 4
#define OB_NARROW 2
#endif
#define PF 256 /* floats ahead in each weight row (1 KiB): measured best of 0/128/256/512 */

typedef float vec __attribute__((vector_size(VW * sizeof(float)), aligned(sizeof(float))));

/* an unaligned load: the type's alignment is a float's */
static inline vec vload(const float *p) { return *(const vec *)p; }

static inline float vsum(vec v) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

/* y[i, j] = x[i, :] . W[j, :] for i < MB, j < ob (ob <= OB weight rows from W; x rows are K apart, y rows ldy). */
#define DEFBLOCK(NAME, MB, OB)                                                                                \
static void NAME(const float *x, const float *W, int64_t K, float *y, int64_t ldy, int ob,               \
                 const char *pf, const char *pf_end, int64_t pf_step) {                                        \
    vec acc[MB][OB];                                                                                          \
    const float *w[OB];                                                                                       \
    _Pragma("GCC unroll 16") for (int j = 0; j < OB; j++) w[j] = W + (j < ob ? j : 0) * K; /* past ob: row 0 again, result unused */  \
    _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++)                                                                              \
        _Pragma("GCC unroll 16") for (int j = 0; j < OB; j++) acc[i][j] = (vec){0};                                                    \
    int64_t k = 0;                                                                                            \
    for (; k + VW <= K; k += VW) {                                                                            \
        vec wv[OB], xv[MB];                                                                                   \
        _Pragma("GCC unroll 16") for (int j = 0; j < OB; j++) {                                                                        \
            wv[j] = vload(w[j] + k);                                                                          \
            __builtin_prefetch(w[j] + k + PF);                                                                \
        }                                                                                                     \
        for (const char *e = pf + pf_step; pf < e && pf < pf_end; pf += 64) __builtin_prefetch(pf, 0, 2);      \
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++) xv[i] = vload(x + i * K + k);                                            \
        _Pragma("GCC unroll 16") for (int i = 0; i < MB; i++)                                                                          \
            _Pragma("GCC unroll 16") for (int j = 0; j < OB; j++) acc[i][j] += xv[i] * wv[j];                                          \
    }                                                                                                         \
    for (int i = 0; i < MB; i++)                                                                              \
        for (int j = 0; j < ob; j++) {                                                                        \
            float s = vsum(acc[i][j]);                                                                        \
            for (int64_t t = k; t < K; t++) s += x[i * K + t] * w[j][t];                                      \
            y[i * ldy + j] = s;                                                                               \
        }                                                                                                     \
}

DEFBLOCK(rows1_wide, 1, OB_WIDE)
DEFBLOCK(rows2_wide, 2, OB_WIDE)
DEFBLOCK(rows4, 4, OB_NARROW)
DEFBLOCK(rows2, 2, OB_NARROW)
DEFBLOCK(rows1, 1, OB_NARROW)

/* Weight rows [o0, o1) against every row of x.
 *
 * With more than one group of x rows (M = 3 or M > 4), a block's weight rows come from memory in the first group's
 * pass only; the later passes find them in L1 and leave the memory idle, which made 8 rows cost ~1.5x one row. So
 * each pass also prefetches (into L2) a share of the next block in proportion to its rows, spread over its
 * iterations: the memory streams the next block while the core multiplies this one (8 mixed prompts of SmolLM2-135M
 * end to end: 0.92x the time; BENCHMARKS.md, "The small-batch kernel's idle memory"). */
static void span(const float *x, const float *W, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                 int64_t o0, int64_t o1, int ob_max) {
    int64_t passes = M <= 2 ? 1 : M / 4 + (M % 4 >= 2) + (M % 2);
    int64_t iters = K / VW > 0 ? K / VW : 1;
    for (int64_t o = o0; o < o1; o += ob_max) {
        int ob = o1 - o < ob_max ? (int)(o1 - o) : ob_max;
        const float *wo = W + o * K;
        /* the next block's bytes, and the share each pass prefetches (none with one pass, or after the last block) */
        const char *nb = (const char *)(W + (o + ob) * K);
        int64_t n_bytes = passes > 1 ? (int64_t)((o + ob + ob_max < o1 ? ob_max : o1 - o - ob) * K * 4) : 0;
        /* a pass over r rows of x prefetches r / M of the next block: the prefetches keep pace with the multiplies */
        int64_t per_row = (n_bytes / M + 63) / 64 * 64, step = (per_row / iters + 63) / 64 * 64;
        const char *pf = nb, *pf_end = n_bytes > 0 ? nb + n_bytes : nb;
#define NEXT_SHARE(r) pf, (pf + (r) * per_row < pf_end ? pf + (r) * per_row : pf_end), (r) * step
        if (M == 1) {
            rows1_wide(x, wo, K, y + o, N, ob, NEXT_SHARE(1));
        } else if (M == 2) {
            rows2_wide(x, wo, K, y + o, N, ob, NEXT_SHARE(2));
        } else {
            int64_t m = 0;
            for (; m + 4 <= M; m += 4, pf += 4 * per_row) rows4(x + m * K, wo, K, y + m * N + o, N, ob, NEXT_SHARE(4));
            if (M - m >= 2) {
                rows2(x + m * K, wo, K, y + m * N + o, N, ob, NEXT_SHARE(2));
                m += 2;
                pf += 2 * per_row;
            }
            if (m < M) rows1(x + m * K, wo, K, y + m * N + o, N, ob, NEXT_SHARE(1));
        }
#undef NEXT_SHARE
        if (bias)
            for (int64_t i = 0; i < M; i++)
                for (int j = 0; j < ob; j++) y[i * N + o + j] += bias[o + j];
    }
}

/* y[M, N] = x[M, K] W[N, K]^T + bias[N] (bias may be NULL); all row-major and contiguous. Weight rows are split
 * over nthreads (OpenMP) in whole blocks. Returns 0. */
int kvload_small_linear(const float *x, const float *W, const float *bias, float *y, int64_t M, int64_t N,
                        int64_t K, int64_t nthreads) {
    if (M <= 0 || N <= 0) return 0;  /* nothing to compute (and span() divides by M) */
    int ob_max = M <= 2 ? OB_WIDE : OB_NARROW;
    if (nthreads <= 1 || N < 2 * ob_max) {
        span(x, W, bias, y, M, N, K, 0, N, ob_max);  /* no parallel region: one costs ~1 us even when off */
        return 0;
    }
    int64_t blocks = (N + ob_max - 1) / ob_max;
#pragma omp parallel num_threads((int)nthreads)
    {
#ifdef _OPENMP
        int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        int64_t t = 0, nt = 1;
#endif
        int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
        int64_t o0 = b0 * ob_max, o1 = b1 * ob_max < N ? b1 * ob_max : N;
        if (o0 < o1) span(x, W, bias, y, M, N, K, o0, o1, ob_max);
    }
    return 0;
}

/* The vector unit this build uses: 512 (AVX-512), 256 (AVX2 with FMA) or 0 (neither). */
int kvload_small_linear_isa(void) { return ISA; }
