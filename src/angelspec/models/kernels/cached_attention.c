/* Attention of a few new queries per row over that row's KV cache, fp32, AVX2 + FMA.
 *
 * Built at run time by angelspec.models.few_rows, into the same library as the few-rows product. Why it exists: a
 * decode or verify step attends 1-16 new queries per row over the row's committed slots. SDPA under a boolean
 * [B, 1, T, S] mask reads every row up to the longest one, runs its flash kernel's blocking for a single query, and
 * with grouped heads reads each kv head once per query head; on the 2-core CPUs this project is measured on that ran
 * at about a quarter of memory speed at 32 rows (`benchmarks/cached_attention.py`). Here one work item is one row
 * and one kv head: each key and value vector is read once, from the first slot to the last one any of the item's
 * queries sees, and used by every query head of its group and every new position.
 *
 * Query t of row b sees slots 0 .. min(start[b] + t, kv_len - 1) (the cache's causal rule: its own slot and every
 * earlier one). Every output element is the same sequence of operations whatever the batch, the number of new
 * positions or the other rows hold (8-wide partial sums over the head dimension, a horizontal sum, the scalar tail;
 * a softmax over the query's own slots in slot order), so a query's result depends only on its row's keys and
 * values up to its own slot (tested against SDPA, and across batch compositions).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* (hsum: few_rows.c's, which packed_op.cpp includes before this file) */

#define KB 8 /* keys per block of the scores: 8 independent FMA chains */
#define VB 4 /* 8-wide accumulators per chunk of the weighted sum (32 dims) */

/* s[c] = scale * <qi, key j + c> for the nb (<= KB) keys from row kj on (stride ks) */
static void attn_scores(const float *qi, const float *kj, int64_t ks, int nb, int64_t D, float scale, float *s) {
    __m256 acc[KB];
    const float *kr[KB];
    for (int c = 0; c < KB; c++) {
        acc[c] = _mm256_setzero_ps();
        kr[c] = kj + (c < nb ? c : 0) * ks; /* keys past nb: computed, never stored */
    }
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 qv = _mm256_loadu_ps(qi + d);
        for (int c = 0; c < KB; c++) acc[c] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[c] + d), acc[c]);
    }
    for (int c = 0; c < nb; c++) {
        float x = hsum(acc[c]);
        for (int64_t t = d; t < D; t++) x += qi[t] * kr[c][t];
        s[c] = x * scale;
    }
}

/* e^x lane by lane (x <= 0 here: a score minus its row's maximum): Cody-Waite reduction to 2^n e^r, |r| <= ln2 / 2,
 * and a degree-5 polynomial for e^r (the single-precision coefficients of the Cephes library), within 2 ulp */
static inline __m256 attn_exp(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
    __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* s[0:seen] <- exp(s - max s[0:seen]), and their sum. s has room for `seen` rounded up to 8: the lanes past `seen`
 * are read (whatever they hold) and stored as 0. */
static float attn_softmax(float *s, int64_t seen) {
    const __m256 none = _mm256_set1_ps(-INFINITY);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t full = seen & ~(int64_t)7;
    const __m256 tail = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)(seen - full)), lane));
    __m256 mv = none;
    for (int64_t j = 0; j < full; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + j));
    if (full < seen) mv = _mm256_max_ps(mv, _mm256_blendv_ps(none, _mm256_loadu_ps(s + full), tail));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(m4));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < seen; j += 8) {
        __m256 e = attn_exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        if (j == full) e = _mm256_and_ps(e, tail);
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum(sum);
}

/* o[0:D] = inv * sum_j p[j] v_j over the first `seen` value rows from vr on (stride vs), slot order */
static void attn_values(const float *p, int64_t seen, const float *vr, int64_t vs, int64_t D, float inv, float *o) {
    int64_t d0 = 0;
    for (; d0 + 8 * VB <= D; d0 += 8 * VB) {
        __m256 acc[VB];
        for (int c = 0; c < VB; c++) acc[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < seen; j++) {
            __m256 pv = _mm256_set1_ps(p[j]);
            const float *vj = vr + j * vs + d0;
            for (int c = 0; c < VB; c++) acc[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 8 * c), acc[c]);
        }
        __m256 iv = _mm256_set1_ps(inv);
        for (int c = 0; c < VB; c++) _mm256_storeu_ps(o + d0 + 8 * c, _mm256_mul_ps(acc[c], iv));
    }
    for (; d0 + 8 <= D; d0 += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < seen; j++)
            acc = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vr + j * vs + d0), acc);
        _mm256_storeu_ps(o + d0, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
    }
    for (; d0 < D; d0++) {
        float x = 0.0f;
        for (int64_t j = 0; j < seen; j++) x += p[j] * vr[j * vs + d0];
        o[d0] = x * inv;
    }
}

/* q: [B, H, T, D] with element strides (qb, qh, qt) and a contiguous last dimension; k, v: [B, Hkv, S, D] with
 * strides (kb, kh, ks) (the same for both), the last dimension contiguous; start [B]: each row's first new slot;
 * kv_len: the slots the call may read (<= S); out: [B, T, H, D] contiguous. H must be a multiple of Hkv (query head
 * h reads kv head h / (H / Hkv)). Returns 0, or -1 when a work buffer could not be allocated. */
int cached_attention(const float *q, int64_t B, int64_t H, int64_t T, int64_t D, int64_t qb, int64_t qh, int64_t qt,
                     const float *k, const float *v, int64_t Hkv, int64_t kb, int64_t kh, int64_t ks,
                     const int64_t *start, int64_t kv_len, float scale, float *out, int threads) {
    const int64_t G = H / Hkv, n = G * T, items = B * Hkv;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
    {
        float *buf = 0;
        int64_t have = 0;
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; it++) {
            const int64_t b = it / Hkv, h = it % Hkv;
            int64_t first = start[b] < 0 ? 0 : start[b];
            int64_t span = first + T < kv_len ? first + T : kv_len; /* the slots the item's last query sees */
            if (span < 1) span = 1;
            const int64_t row = (span + 7) & ~(int64_t)7; /* a query's scores, padded for the softmax */
            const int64_t need = n * row;
            if (need > have) {
                free(buf);
                buf = (float *)malloc((size_t)need * sizeof(float));
                have = buf ? need : 0;
                if (!buf) {
#pragma omp atomic write
                    failed = 1;
                    continue;
                }
            }
            float *scores = buf;
            const float *kr = k + b * kb + h * kh, *vr = v + b * kb + h * kh;
            /* query i = g * T + t (head h * G + g, new position t) sees the first seen(t) slots */
#define SEEN(t) (first + (t) + 1 < span ? first + (t) + 1 : span)
            for (int64_t j = 0; j < span; j += KB) { /* every query against each block of keys while it is in L1 */
                const int nb = span - j < KB ? (int)(span - j) : KB;
                for (int64_t g = 0; g < G; g++)
                    for (int64_t t = 0; t < T; t++)
                        attn_scores(q + b * qb + (h * G + g) * qh + t * qt, kr + j * ks, ks, nb, D, scale,
                                    scores + (g * T + t) * row + j);
            }
            for (int64_t g = 0; g < G; g++)
                for (int64_t t = 0; t < T; t++) {
                    float *s = scores + (g * T + t) * row;
                    const int64_t seen = SEEN(t);
                    const float sum = attn_softmax(s, seen);
                    attn_values(s, seen, vr, ks, D, 1.0f / sum, out + ((b * T + t) * H + h * G + g) * D);
                }
#undef SEEN
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
