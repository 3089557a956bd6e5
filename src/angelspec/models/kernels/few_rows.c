/* y[M, N] = x[M, K] @ w[N, K]^T (+ b[N]) for a few rows of x, fp32, AVX2 + FMA.
 *
 * Built at run time by angelspec.models.few_rows (the C compiler of the machine, flags there). Why it exists: on
 * CPUs whose BLAS runs a few rows far below memory speed, a product over 2-12 rows (a verify forward over K + 1
 * positions, a decode step of a few requests) costs 1.5-2.5x a one-row pass although it reads the same weights.
 * Here every block of NB weight rows is read from memory once, into L1, and multiplied there by every row of x,
 * three rows of x at a time (12 accumulators + 3 inputs + 1 weight vector = the 16 AVX2 registers).
 *
 * Every output element is the same sequence of operations whatever M is and whichever block its row falls in
 * (8-wide partial sums over k, one horizontal sum, the scalar tail of k, then the bias), so a row's result does not
 * depend on how many other rows share the call.
 */
#include <immintrin.h>
#include <stdint.h>

#define NB 4 /* weight rows per block */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* MB rows of x against the nb (<= NB) weight rows at w; pf: the next block's weights to prefetch (or 0). */
#define BLOCK(MB)                                                                                          \
    static void block##MB(const float *x, int64_t K, const float *w, int nb, const float *pf, float *y,   \
                          int64_t N, const float *b) {                                                    \
        __m256 acc[MB][NB];                                                                               \
        const float *wr[NB];                                                                              \
        for (int j = 0; j < NB; j++) wr[j] = w + (j < nb ? j : 0) * K; /* rows past nb: never stored */  \
        for (int m = 0; m < MB; m++)                                                                      \
            for (int j = 0; j < NB; j++) acc[m][j] = _mm256_setzero_ps();                                 \
        int64_t k = 0;                                                                                    \
        for (; k + 8 <= K; k += 8) {                                                                      \
            __m256 xv[MB];                                                                                \
            for (int m = 0; m < MB; m++) xv[m] = _mm256_loadu_ps(x + m * K + k);                          \
            if (pf && (k & 15) == 0)                                                                      \
                for (int j = 0; j < NB; j++) _mm_prefetch((const char *)(pf + j * K + k), _MM_HINT_T0);   \
            for (int j = 0; j < NB; j++) {                                                                \
                __m256 wv = _mm256_loadu_ps(wr[j] + k);                                                   \
                for (int m = 0; m < MB; m++) acc[m][j] = _mm256_fmadd_ps(xv[m], wv, acc[m][j]);           \
            }                                                                                             \
        }                                                                                                 \
        for (int m = 0; m < MB; m++)                                                                      \
            for (int j = 0; j < nb; j++) {                                                                \
                float s = hsum(acc[m][j]);                                                                \
                for (int64_t t = k; t < K; t++) s += x[m * K + t] * wr[j][t];                             \
                y[m * N + j] = b ? s + b[j] : s;                                                          \
            }                                                                                             \
    }

BLOCK(1)
BLOCK(2)
BLOCK(3)

/* x [M, K], w [N, K], y [M, N] contiguous; b [N] or 0; the weight blocks are shared out over `threads`. */
void few_rows_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N, const float *b, float *y,
                     int threads) {
    int64_t blocks = (N + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < blocks; i++) {
        int64_t n = i * NB;
        int nb = N - n < NB ? (int)(N - n) : NB;
        const float *wn = w + n * K;
        const float *pf = n + 2 * NB <= N ? wn + NB * K : 0;
        const float *bn = b ? b + n : 0;
        for (int64_t m = 0, left = M; left > 0;) {
            int mb = left == 4 ? 2 : left >= 3 ? 3 : (int)left; /* 4 = 2 + 2, else threes first */
            const float *p = m == 0 ? pf : 0;                  /* later row blocks find the weights in L1 */
            if (mb == 3) block3(x + m * K, K, wn, nb, p, y + m * N + n, N, bn);
            else if (mb == 2) block2(x + m * K, K, wn, nb, p, y + m * N + n, N, bn);
            else block1(x + m * K, K, wn, nb, p, y + m * N + n, N, bn);
            m += mb;
            left -= mb;
        }
    }
}
