/*
 * The paged decode's 16-lane compute, included by paged_decode.c in an AVX512-BF16
 * target region (never compiled alone), with SFX the name suffix of this copy's
 * functions. It serves bf16 caches with D % 32 == 0 (paged_decode.c's pick_task).
 *
 * One task is a group of work items of one request (paged_decode.c's plan_groups: up to
 * GROUP_ROWS rows, the key ranges one interval together) and a range of kv heads. For
 * one kv head its M = rows x G query heads are one small matrix, and every tile of keys
 * (at most 16, inside one block and one aligned 16-position window, so a key's lane is
 * its position mod 16) is loaded once for all M rows:
 *   - K is transposed into kt[d/2][16 lanes] (bf16 pairs), then the M x 16 scores are
 *     register-blocked products (up to 16 rows x 16 keys per pass, vdpbf16ps with the
 *     row's query pair broadcast): no per-row reduction;
 *   - each row's online softmax (max, rescale, exp) runs on its 16-lane score vector,
 *     keys outside the row's own range masked to -inf; the row sums add the float32
 *     probabilities (so the lse keeps float32 accuracy), P x V takes them rounded to bf16;
 *   - V is interleaved into key pairs and P x V is register-blocked the same way (up to
 *     6 rows x 64 columns, vdpbf16ps with the row's probability pair broadcast), the
 *     accumulator columns in the unpack order (put back in order once, at the end).
 * A row's arithmetic depends only on its own keys, positions and query: the same bits
 * whether it is computed alone (a decode) or with others (a verify step, a chunk), since
 * a key's lane, the tiles and every lane's order of operations are fixed by position.
 * Keys of the group's range that a row does not see enter its sums as exact zeros (their
 * values are read: a non-finite value there reaches every row of the group).
 */

#define FD_CAT_(a, b) a##_##b
#define FD_CAT(a, b) FD_CAT_(a, b)
#define FD(name) FD_CAT(name, SFX)

INLINE __m512 FD(vexp)(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.0f);
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_mask_mov_ps(x, tiny, lo);
    const __m512 magic = _mm512_set1_ps(12582912.0f); /* 1.5 * 2^23 */
    const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic);
    const __m512 n = _mm512_sub_ps(t, magic);
    const __m512i ni = _mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(magic));
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 scale = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(ni, _mm512_set1_epi32(127)), 23));
    return _mm512_maskz_mul_ps((__mmask16)~tiny, p, scale); /* NaN stays NaN */
}

#include "avx512_transpose.h"

/* cap * tanh(x / cap) for 16 lanes (inv_cap = 1 / cap), by the C library's tanhf. */
INLINE __m512 FD(soft_cap)(__m512 x, float cap, float inv_cap) {
    float tmp[16];
    _mm512_storeu_ps(tmp, x);
    for (int j = 0; j < 16; ++j) tmp[j] = cap * tanhf(tmp[j] * inv_cap);
    return _mm512_loadu_ps(tmp);
}

/*
 * One kv head's K rows of a tile's lanes [lo, hi) (lane j's row at k + (j - lo) * ks
 * bytes, bf16) -> kt[p * 16 + j], the 32-bit pair of columns 2p, 2p + 1 of lane j's key;
 * the other lanes are zeros.
 */
static void FD(load_k_tile)(const char *k, int64_t ks, int lo, int hi, int64_t D, uint32_t *kt) {
    for (int64_t b = 0; b < D / 32; ++b) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
            r[j] = j >= lo && j < hi
                       ? _mm512_loadu_si512((const void *)(k + (j - lo) * ks + 64 * b))
                       : _mm512_setzero_si512();
        avx512_transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512((void *)(kt + (16 * b + i) * 16), r[i]);
    }
}

/*
 * One kv head's V rows of lanes [lo, hi) as 8 key pairs (lanes 2t, 2t + 1): for columns
 * [32c, 32c + 32) the vectors 2c (unpacklo) and 2c + 1 (unpackhi) of the two rows' bf16
 * values interleaved, at vp + (t * D / 16 + w) * 32 (uint16); other lanes are zeros.
 * Vector w = 2c + u, lane i holds column 32c + 8 (i / 4) + 4u + i % 4 (unpack order).
 */
static void FD(load_v_tile)(const char *v, int64_t vs, int lo, int hi, int64_t D, uint16_t *vp) {
    const int64_t nc = D / 32;
    for (int t = 0; t < 8; ++t) {
        const int j0 = 2 * t, j1 = 2 * t + 1;
        const int l0 = j0 >= lo && j0 < hi, l1 = j1 >= lo && j1 < hi;
        if (!l0 && !l1) {
            memset(vp + t * nc * 64, 0, (size_t)nc * 128);
            continue;
        }
        for (int64_t c = 0; c < nc; ++c) {
            const __m512i a = l0 ? _mm512_loadu_si512((const void *)(v + (j0 - lo) * vs + 64 * c))
                                 : _mm512_setzero_si512();
            const __m512i b = l1 ? _mm512_loadu_si512((const void *)(v + (j1 - lo) * vs + 64 * c))
                                 : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(vp + ((t * nc + c) * 2) * 32), _mm512_unpacklo_epi16(a, b));
            _mm512_storeu_si512((void *)(vp + ((t * nc + c) * 2 + 1) * 32), _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* s[m * 16 + j] = q[m] . k[j] for MB rows (q: bf16 rows as uint32 pairs, stride qs). */
INLINE void FD(qk_block)(const int MB, const uint32_t *q, int64_t qs, const uint32_t *kt,
                         int64_t np, float *s) {
    __m512 a[16];
    for (int m = 0; m < MB; ++m) a[m] = _mm512_setzero_ps();
    for (int64_t p = 0; p < np; ++p) {
        __m512i kv = _mm512_loadu_si512((const void *)(kt + p * 16));
        KEEP(kv);
        for (int m = 0; m < MB; ++m)
            a[m] = _mm512_dpbf16_ps(a[m], (__m512bh)kv, (__m512bh)_mm512_set1_epi32((int)q[m * qs + p]));
    }
    for (int m = 0; m < MB; ++m) _mm512_storeu_ps(s + m * 16, a[m]);
}

static void FD(qk_rows)(int64_t M, const uint32_t *q, int64_t qs, const uint32_t *kt, int64_t np,
                        float *s) {
    int64_t m = 0;
    for (; m + 16 <= M; m += 16) FD(qk_block)(16, q + m * qs, qs, kt, np, s + m * 16);
    if (M - m >= 8) { FD(qk_block)(8, q + m * qs, qs, kt, np, s + m * 16); m += 8; }
    if (M - m >= 4) { FD(qk_block)(4, q + m * qs, qs, kt, np, s + m * 16); m += 4; }
    if (M - m >= 2) { FD(qk_block)(2, q + m * qs, qs, kt, np, s + m * 16); m += 2; }
    if (M - m >= 1) FD(qk_block)(1, q + m * qs, qs, kt, np, s + m * 16);
}

/*
 * acc[m] = acc[m] * corr[m] + sum_t p[m][t] . vp[t] over the 8 key pairs, for MB rows and
 * the WB accumulator vectors from w0 (acc rows of Dp floats, unpack order).
 */
INLINE void FD(pv_block)(const int MB, const int WB, const uint32_t *p, const float *corr,
                         const uint16_t *vp, int64_t W, float *acc, int64_t Dp, int64_t w0) {
    __m512 a[6][4];
    for (int m = 0; m < MB; ++m) {
        const __m512 c = _mm512_set1_ps(corr[m]);
        for (int w = 0; w < WB; ++w) a[m][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + m * Dp + 16 * (w0 + w)), c);
    }
    for (int t = 0; t < 8; ++t) {
        __m512i vv[4];
        for (int w = 0; w < WB; ++w) {
            vv[w] = _mm512_loadu_si512((const void *)(vp + (t * W + w0 + w) * 32));
            KEEP(vv[w]);
        }
        for (int m = 0; m < MB; ++m) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32((int)p[m * 8 + t]);
            for (int w = 0; w < WB; ++w) a[m][w] = _mm512_dpbf16_ps(a[m][w], (__m512bh)vv[w], b);
        }
    }
    for (int m = 0; m < MB; ++m)
        for (int w = 0; w < WB; ++w) _mm512_storeu_ps(acc + m * Dp + 16 * (w0 + w), a[m][w]);
}

INLINE void FD(pv_cols)(const int WB, int64_t M, const uint32_t *p, const float *corr,
                        const uint16_t *vp, int64_t W, float *acc, int64_t Dp, int64_t w0) {
    int64_t m = 0;
    for (; m + 6 <= M; m += 6) FD(pv_block)(6, WB, p + m * 8, corr + m, vp, W, acc + m * Dp, Dp, w0);
#ifdef ATTNKIT_TEST_DROP_PARTIAL_ROWS /* a broken variant for the tests: rows past 6k lost */
    return;
#endif
    if (M - m >= 4) { FD(pv_block)(4, WB, p + m * 8, corr + m, vp, W, acc + m * Dp, Dp, w0); m += 4; }
    if (M - m >= 2) { FD(pv_block)(2, WB, p + m * 8, corr + m, vp, W, acc + m * Dp, Dp, w0); m += 2; }
    if (M - m >= 1) FD(pv_block)(1, WB, p + m * 8, corr + m, vp, W, acc + m * Dp, Dp, w0);
}

static void FD(pv_rows)(int64_t M, const uint32_t *p, const float *corr, const uint16_t *vp,
                        int64_t D, float *acc, int64_t Dp) {
    const int64_t W = D / 16;
    int64_t w0 = 0;
    for (; w0 + 4 <= W; w0 += 4) FD(pv_cols)(4, M, p, corr, vp, W, acc, Dp, w0);
    if (W - w0 >= 2) FD(pv_cols)(2, M, p, corr, vp, W, acc, Dp, w0);
}

/*
 * The online softmax of M rows (row m: group row m / G, query head h0 + m % G) over one
 * tile's scores s (16 lanes each; lane j is logical position base + j): scale, soft-cap,
 * ALiBi, the row's mask; then mrow, lv (16-lane running sums) and corr updated and the
 * probabilities written as bf16 to pb (16 per row).
 */
static void FD(softmax_rows)(const params *P, int64_t M, int64_t h0, const __mmask16 *live,
                             const float *rel0, const float *s, float *mrow, float *lv,
                             float *corr, uint16_t *pb) {
    const int64_t G = P->G;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 step = _mm512_mul_ps(iota, _mm512_set1_ps((float)P->pm));
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const int has_cap = P->cap > 0.0f;
    const float inv_cap = has_cap ? 1.0f / P->cap : 0.0f;
    for (int64_t m = 0; m < M; ++m) {
        const int64_t r = m / G;
        __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * m), _mm512_set1_ps(P->scale));
        if (has_cap) x = FD(soft_cap)(x, P->cap, inv_cap);
        if (P->alibi)
            x = _mm512_fmadd_ps(_mm512_set1_ps(P->alibi[h0 + m % G]),
                                _mm512_add_ps(step, _mm512_set1_ps(rel0[r])), x);
        x = _mm512_mask_mov_ps(ninf, live[r], x);
        const float mt = _mm512_reduce_max_ps(x);
        const float mold = mrow[m];
        const float mnew = mt > mold ? mt : mold;
        if (mnew == -INFINITY) { /* nothing visible yet: nothing to add */
            corr[m] = 1.0f;
            _mm256_storeu_si256((__m256i *)(void *)(pb + 16 * m), _mm256_setzero_si256());
            continue;
        }
        const float c = mnew == mold ? 1.0f : expf(mold - mnew);
        const __m512 p = FD(vexp)(_mm512_sub_ps(x, _mm512_set1_ps(mnew)));
        _mm256_storeu_si256((__m256i *)(void *)(pb + 16 * m), (__m256i)_mm512_cvtneps_pbh(p));
        _mm512_storeu_ps(lv + 16 * m, _mm512_fmadd_ps(_mm512_loadu_ps(lv + 16 * m), _mm512_set1_ps(c), p));
        mrow[m] = mnew;
        corr[m] = c;
    }
}

/* A row's accumulator from the unpack order (load_v_tile) back to column order. */
static void FD(unpermute)(float *acc, int64_t D) {
    const __m512i ia = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    const __m512i ib = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
    for (int64_t c = 0; c < D / 32; ++c) {
        const __m512 lo = _mm512_loadu_ps(acc + 32 * c), hi = _mm512_loadu_ps(acc + 32 * c + 16);
        _mm512_storeu_ps(acc + 32 * c, _mm512_permutex2var_ps(lo, ia, hi));
        _mm512_storeu_ps(acc + 32 * c + 16, _mm512_permutex2var_ps(lo, ib, hi));
    }
}

/*
 * Prefetches every 64-byte line of a tile's rows [lo, hi) for the task's C kv heads in
 * memory order, K and V row by row, before the heads' loads (which walk a head's slice of
 * each row, 2 * D bytes at the row stride; the next tile's lines are also prefetched,
 * head by head, while this one is computed). Measured on a 2-core AVX512-BF16 CPU (32 x
 * 2k decode, bf16, 1 thread, paired rounds): reading the lines in this order (demand
 * loads) took 0.84-0.86x the decode's time without it and 0.92-0.95x a verify step's;
 * prefetching them instead, 0.79x that again and 0.94x (_MM_HINT_T0: 1.2x; dropping the
 * next tile's per-head prefetch: 1.5x; one pass over K and then V, or the next tile in
 * memory order at the tile's start: no better).
 */
static void FD(prefetch_tile)(const char *k, int64_t krow, const char *v, int64_t vrow,
                              int64_t kspan, int64_t vspan, int n) {
    for (int j = 0; j < n; ++j) {
        for (int64_t b = 0; b < kspan; b += 64) _mm_prefetch(k + j * krow + b, _MM_HINT_T1);
        for (int64_t b = 0; b < vspan; b += 64) _mm_prefetch(v + j * vrow + b, _MM_HINT_T1);
    }
}

/*
 * The group of R work items from i0 (one request; paged_decode.c's plan_groups), kv heads
 * [kv0, kv0 + C). Row layout in the scratch: (c * R + r) * G + g for kv head kv0 + c,
 * item i0 + r, query head (kv0 + c) * G + g.
 */
static void FD(task)(const params *P, int64_t i0, int64_t R, int64_t kv0, int64_t C, scratch *S) {
    const int64_t G = P->G, D = P->D, Dp = P->Dp, M = R * G, h0 = kv0 * G;
    const size_t es = P->esize;
    if (R == 1 && P->ke[i0] <= P->ks[i0]) { /* no visible key */
        empty_rows(P, P->rows[i0], h0, C * G);
        return;
    }
    int64_t us = P->ks[i0], ue = P->ke[i0];
    float qpos[GROUP_ROWS];
    for (int64_t r = 0; r < R; ++r) {
        if (P->ks[i0 + r] < us) us = P->ks[i0 + r];
        if (P->ke[i0 + r] > ue) ue = P->ke[i0 + r];
        qpos[r] = (float)P->qp[i0 + r];
    }
    const int32_t *table = P->bt + (int64_t)P->req[i0] * P->bt_sb;
    uint16_t *qb = (uint16_t *)(void *)S->q; /* bf16 rows of D values (uint32 stride D / 2) */
    for (int64_t c = 0; c < C; ++c)
        for (int64_t r = 0; r < R; ++r)
            for (int64_t g = 0; g < G; ++g) {
                const int64_t m = (c * R + r) * G + g;
                const char *q = P->q + (size_t)(P->rows[i0 + r] * P->q_st + (h0 + c * G + g) * P->q_sh) * es;
                memcpy(qb + m * D, q, (size_t)D * 2);
                memset(S->acc + m * Dp, 0, (size_t)Dp * sizeof(float));
                memset(S->lv + m * 16, 0, 16 * sizeof(float));
                S->m[m] = -INFINITY;
            }
    const size_t krow = (size_t)P->k_sr * es, vrow = (size_t)P->v_sr * es;
    /* a row's bytes from head kv0's first value to head kv0 + C - 1's last, in K and V */
    const int64_t kspan = (int64_t)((size_t)((C - 1) * P->k_sh + D) * es);
    const int64_t vspan = (int64_t)((size_t)((C - 1) * P->v_sh + D) * es);
    for (int64_t pos = us; pos < ue;) {
        /* the tile [pos, end) and the next tile's rows, prefetched head by head below */
        const key_tile kt_ = next_key_tile(P, table, pos, ue);
        const int64_t base = kt_.base, end = kt_.end, prow = kt_.row;
        const int64_t nrow = kt_.next_row, nn = kt_.next_n;
        const int lo = kt_.lo, hi = kt_.hi;
        __mmask16 live[GROUP_ROWS];
        float rel0[GROUP_ROWS];
        for (int64_t r = 0; r < R; ++r) {
            int64_t a = P->ks[i0 + r], b = P->ke[i0 + r];
            a = a > pos ? a : pos;
            b = b < end ? b : end;
            live[r] = b > a ? (__mmask16)(((1u << (b - base)) - 1u) & ~((1u << (a - base)) - 1u)) : 0;
            rel0[r] = (float)(base * P->pm + P->pa) - qpos[r];
        }
        FD(prefetch_tile)(P->k + (size_t)(prow * P->k_sr + kv0 * P->k_sh) * es, (int64_t)krow,
                          P->v + (size_t)(prow * P->v_sr + kv0 * P->v_sh) * es, (int64_t)vrow,
                          kspan, vspan, hi - lo);
        for (int64_t c = 0; c < C; ++c) {
            if (nrow >= 0) {
                const char *kn = P->k + (size_t)(nrow * P->k_sr + (kv0 + c) * P->k_sh) * es;
                const char *vn = P->v + (size_t)(nrow * P->v_sr + (kv0 + c) * P->v_sh) * es;
                for (int64_t j = 0; j < nn; ++j)
                    for (int64_t b = 0; b < D * 2; b += 64) {
                        _mm_prefetch(kn + j * krow + b, _MM_HINT_T1);
                        _mm_prefetch(vn + j * vrow + b, _MM_HINT_T1);
                    }
            }
            const int64_t m0 = c * M;
            const char *kt = P->k + (size_t)(prow * P->k_sr + (kv0 + c) * P->k_sh) * es;
            const char *vt = P->v + (size_t)(prow * P->v_sr + (kv0 + c) * P->v_sh) * es;
            FD(load_k_tile)(kt, (int64_t)krow, lo, hi, D, S->kt);
            FD(qk_rows)(M, (const uint32_t *)(const void *)(qb + m0 * D), D / 2, S->kt, D / 2, S->s);
            FD(softmax_rows)(P, M, h0 + c * G, live, rel0, S->s, S->m + m0, S->lv + m0 * 16,
                             S->corr + m0, S->pb);
            FD(load_v_tile)(vt, (int64_t)vrow, lo, hi, D, S->vp);
            FD(pv_rows)(M, (const uint32_t *)(const void *)S->pb, S->corr + m0, S->vp, D,
                        S->acc + m0 * Dp, Dp);
        }
        pos = end;
    }
    for (int64_t c = 0; c < C; ++c)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t m0 = (c * R + r) * G;
            scratch view = *S;
            view.acc = S->acc + m0 * Dp;
            view.m = S->m + m0;
            view.l = S->l + m0;
            for (int64_t g = 0; g < G; ++g) {
                FD(unpermute)(view.acc + g * Dp, D);
                view.l[g] = _mm512_reduce_add_ps(_mm512_loadu_ps(S->lv + (m0 + g) * 16));
            }
            finish_rows(P, P->rows[i0 + r], h0 + c * G, G, &view);
        }
}

#undef FD
#undef FD_CAT
#undef FD_CAT_
