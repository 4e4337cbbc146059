/*
 * The paged decode's 16-lane compute, included by paged_decode.c in an AVX512-BF16
 * target region (never compiled alone), with:
 *   SFX      the name suffix of this copy's functions;
 *   BF16DOT  1 where the set has native bf16 dot products (AVX512-BF16).
 *
 * It can serve float32 caches with D % 16 == 0 and, with BF16DOT, bf16 caches with
 * D % 32 == 0 (paged_decode.c's pick_task gives it bf16 only), reading K and V in place
 * with run_task's online softmax, 16 lanes wide, in tiles of up to FTILE keys of one
 * block, the next tile's rows prefetched meanwhile: scores of up to 4 query heads x 4 keys
 * at a time as 16 vector accumulators reduced together (one transpose-and-add tree
 * for all 16 sums); bf16 scores as vdpbf16ps over the query and key values as given
 * (exact products, float32 sums), bf16 values widened to float32 once per load.
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

/* Fold pairs of 16-lane vectors: lanes 0-7 of the result are x's two halves added, lanes
 * 8-15 y's (level 1 of the tree; the later levels fold 8 -> 4 -> 2 -> 1 the same way). */
INLINE __m512 FD(fold)(__m512 x, __m512 y, const int level) {
    __m512i a, b;
    if (level == 1) {
        a = _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0);
        b = _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
    } else if (level == 2) {
        a = _mm512_set_epi32(27, 26, 25, 24, 19, 18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
        b = _mm512_set_epi32(31, 30, 29, 28, 23, 22, 21, 20, 15, 14, 13, 12, 7, 6, 5, 4);
    } else if (level == 3) {
        a = _mm512_set_epi32(29, 28, 25, 24, 21, 20, 17, 16, 13, 12, 9, 8, 5, 4, 1, 0);
        b = _mm512_set_epi32(31, 30, 27, 26, 23, 22, 19, 18, 15, 14, 11, 10, 7, 6, 3, 2);
    } else {
        a = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        b = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    }
    return _mm512_add_ps(_mm512_permutex2var_ps(x, a, y), _mm512_permutex2var_ps(x, b, y));
}

/* r[i] = the sum of x[i]'s lanes, for 16 vectors. */
INLINE __m512 FD(reduce16)(const __m512 x[16]) {
    __m512 y[8], z[4], w[2];
    for (int i = 0; i < 8; ++i) y[i] = FD(fold)(x[2 * i], x[2 * i + 1], 1);
    for (int i = 0; i < 4; ++i) z[i] = FD(fold)(y[2 * i], y[2 * i + 1], 2);
    for (int i = 0; i < 2; ++i) w[i] = FD(fold)(z[2 * i], z[2 * i + 1], 3);
    return FD(fold)(w[0], w[1], 4);
}

/* 16 float32 values of a row: float32 as is, bf16 widened. */
INLINE __m512 FD(ld16)(const char *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)(const void *)p);
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/*
 * s[h * FTILE + j] = q[h] . k[j] for HB heads x KB keys (HB * KB <= 16): q rows of Dp
 * floats (float32; or bf16 pairs when bf16), k rows at byte stride ks.
 */
INLINE void FD(score_block)(const int HB, const int KB, const int bf16, const float *q,
                            int64_t Dp, const char *k, int64_t ks, int64_t D, float *s) {
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    if (bf16) {
#if BF16DOT
        for (int64_t d = 0; d < D; d += 32) {
            __m512i kv[4];
            for (int j = 0; j < KB; ++j)
                kv[j] = _mm512_loadu_si512((const void *)(k + j * ks + 2 * d));
            for (int h = 0; h < HB; ++h) {
                const __m512i qv =
                    _mm512_loadu_si512((const void *)((const uint16_t *)(const void *)(q + h * Dp) + d));
                for (int j = 0; j < KB; ++j)
                    a[h * KB + j] = _mm512_dpbf16_ps(a[h * KB + j], (__m512bh)kv[j], (__m512bh)qv);
            }
        }
#endif
    } else {
        for (int64_t d = 0; d < D; d += 16) {
            __m512 kv[4];
            for (int j = 0; j < KB; ++j) kv[j] = _mm512_loadu_ps((const float *)(const void *)(k + j * ks) + d);
            for (int h = 0; h < HB; ++h) {
                const __m512 qv = _mm512_loadu_ps(q + h * Dp + d);
                for (int j = 0; j < KB; ++j) a[h * KB + j] = _mm512_fmadd_ps(qv, kv[j], a[h * KB + j]);
            }
        }
    }
    float r[16];
    _mm512_storeu_ps(r, FD(reduce16)(a));
    for (int h = 0; h < HB; ++h)
        for (int j = 0; j < KB; ++j) s[h * FTILE + j] = r[h * KB + j];
}

/* The G heads' scores against the n keys of one kv head's tile. */
static void FD(scores)(int64_t G, int bf16, const float *q, int64_t Dp, const char *k, int64_t ks,
                       int64_t n, int64_t D, float *s) {
    int64_t h = 0;
    for (; h + 4 <= G; h += 4) {
        int64_t j = 0;
        for (; j + 4 <= n; j += 4)
            FD(score_block)(4, 4, bf16, q + h * Dp, Dp, k + j * ks, ks, D, s + h * FTILE + j);
        for (; j < n; ++j)
            FD(score_block)(4, 1, bf16, q + h * Dp, Dp, k + j * ks, ks, D, s + h * FTILE + j);
    }
    for (; h < G; ++h) {
        int64_t j = 0;
        for (; j + 4 <= n; j += 4)
            FD(score_block)(1, 4, bf16, q + h * Dp, Dp, k + j * ks, ks, D, s + h * FTILE + j);
        for (; j < n; ++j)
            FD(score_block)(1, 1, bf16, q + h * Dp, Dp, k + j * ks, ks, D, s + h * FTILE + j);
    }
}

/* acc[h] = acc[h] * corr[h] + sum_j p[h * FTILE + j] v[j] for HB heads, 64 columns at a
 * time (HB x 4 accumulators), v rows at byte stride vs. */
INLINE void FD(vacc_heads)(const int HB, const int bf16, const float *p, const float *corr,
                           const char *v, int64_t vs, int64_t n, float *acc, int64_t Dp,
                           int64_t D) {
    const int64_t es = bf16 ? 2 : 4;
    for (int64_t d = 0; d < D; d += 64) {
        const int cw = D - d >= 64 ? 4 : (int)((D - d) / 16);
        __m512 a[4][4];
        for (int h = 0; h < HB; ++h) {
            const __m512 c = _mm512_set1_ps(corr[h]);
            for (int w = 0; w < cw; ++w) a[h][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * Dp + d + 16 * w), c);
        }
        for (int64_t j = 0; j < n; ++j) {
            __m512 vv[4];
            for (int w = 0; w < cw; ++w) vv[w] = FD(ld16)(v + j * vs + (d + 16 * w) * es, bf16);
            for (int h = 0; h < HB; ++h) {
                const __m512 b = _mm512_set1_ps(p[h * FTILE + j]);
                for (int w = 0; w < cw; ++w) a[h][w] = _mm512_fmadd_ps(b, vv[w], a[h][w]);
            }
        }
        for (int h = 0; h < HB; ++h)
            for (int w = 0; w < cw; ++w) _mm512_storeu_ps(acc + h * Dp + d + 16 * w, a[h][w]);
    }
}

static void FD(vacc)(int64_t G, int bf16, const float *p, const float *corr, const char *v,
                     int64_t vs, int64_t n, float *acc, int64_t Dp, int64_t D) {
    int64_t h = 0;
    for (; h + 4 <= G; h += 4) FD(vacc_heads)(4, bf16, p + h * FTILE, corr + h, v, vs, n, acc + h * Dp, Dp, D);
    for (; h < G; ++h) FD(vacc_heads)(1, bf16, p + h * FTILE, corr + h, v, vs, n, acc + h * Dp, Dp, D);
}

/* run_task's work (paged_decode.c) for the caches this copy serves. */
static void FD(task)(const params *P, int64_t item, int64_t kv0, int64_t C, scratch *S) {
    const int64_t G = P->G, D = P->D, Dp = P->Dp, H = C * G, h0 = kv0 * G;
    const int64_t row = P->rows[item];
    const int32_t *table = P->bt + (int64_t)P->req[item] * P->bt_sb;
    const int64_t start = P->ks[item], end = P->ke[item];
    const size_t es = P->esize;
    const int bf16 = P->dtype == DT_BF16;
    /* bf16: the query as given (its pairs feed vdpbf16ps), the scale on the scores */
    const float qscale = bf16 ? 1.0f : P->scale, sscale = bf16 ? P->scale : 1.0f;
    for (int64_t h = 0; h < H; ++h) {
        const char *q = P->q + (size_t)(row * P->q_st + (h0 + h) * P->q_sh) * es;
        if (bf16) memcpy(S->q + h * Dp, q, (size_t)D * 2);
        else load_row(S->q + h * Dp, q, P->dtype, D, qscale);
        memset(S->acc + h * Dp, 0, (size_t)Dp * sizeof(float));
        S->m[h] = -INFINITY;
        S->l[h] = 0.0f;
    }
    if (end <= start) { /* no visible key */
        empty_rows(P, row, h0, H);
        return;
    }
    const float qpos = (float)P->qp[item];
    const int has_cap = P->cap > 0.0f;
    const float inv_cap = has_cap ? 1.0f / P->cap : 0.0f;
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int64_t pos = start; pos < end;) {
        int64_t n;
        const int64_t prow = tile_at_max(P, table, pos, end, &n, FTILE);
        /* The next tile's rows (another block) are prefetched into L2 while this one is
         * computed, a quarter of them per group of 4 keys. */
        int64_t n2 = 0, prow2 = 0;
        if (pos + n < end) prow2 = tile_at_max(P, table, pos + n, end, &n2, FTILE);
        const size_t span = (size_t)(C * P->k_sh) * es;
        /* K in memory order: 4 keys (rows) at a time, all the task's kv heads of them */
        const int64_t kst = (int64_t)(P->k_sr * es);
        for (int64_t j0 = 0; j0 < n; j0 += 4) {
            const int64_t jn = n - j0 < 4 ? n - j0 : 4;
            for (int64_t j = j0 * n2 / n; j < (j0 + jn) * n2 / n; ++j) {
                const char *kr = P->k + (size_t)((prow2 + j) * P->k_sr + kv0 * P->k_sh) * es;
                const char *vr = P->v + (size_t)((prow2 + j) * P->v_sr + kv0 * P->v_sh) * es;
                for (size_t b = 0; b < span; b += 64) {
                    _mm_prefetch(kr + b, _MM_HINT_T1);
                    _mm_prefetch(vr + b, _MM_HINT_T1);
                }
            }
            for (int64_t c = 0; c < C; ++c) {
                const char *kt = P->k + (size_t)((prow + j0) * P->k_sr + (kv0 + c) * P->k_sh) * es;
                FD(scores)(G, bf16, S->q + c * G * Dp, Dp, kt, kst, jn, D,
                           S->s + c * G * FTILE + j0);
            }
        }
        for (int64_t h = 0; h < H; ++h) {
            float *s = S->s + h * FTILE;
            __m512 x[FTILE / 16];
            const int nvec = (int)((n + 15) / 16);
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int w = 0; w < nvec; ++w) {
                const int64_t left = n - 16 * w;
                const __mmask16 live = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
                x[w] = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + 16 * w), _mm512_set1_ps(sscale));
                if (has_cap) {
                    float tmp[16];
                    _mm512_storeu_ps(tmp, x[w]);
                    for (int j = 0; j < 16; ++j) tmp[j] = P->cap * tanhf(tmp[j] * inv_cap);
                    x[w] = _mm512_loadu_ps(tmp);
                }
                if (P->alibi) {
                    const __m512 rel = _mm512_add_ps(
                        _mm512_mul_ps(iota, _mm512_set1_ps((float)P->pm)),
                        _mm512_set1_ps((float)((pos + 16 * w) * P->pm + P->pa) - qpos));
                    x[w] = _mm512_fmadd_ps(_mm512_set1_ps(P->alibi[h0 + h]), rel, x[w]);
                }
                x[w] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live, x[w]);
                mx = _mm512_max_ps(mx, x[w]);
            }
            const float mt = _mm512_reduce_max_ps(mx);
            const float mold = S->m[h];
            const float mnew = mt > mold ? mt : mold;
            if (mnew == -INFINITY) {
                S->corr[h] = 1.0f;
                for (int w = 0; w < nvec; ++w) _mm512_storeu_ps(s + 16 * w, _mm512_setzero_ps());
                continue;
            }
            const float corr = mnew == mold ? 1.0f : expf(mold - mnew);
            __m512 sum = _mm512_setzero_ps();
            for (int w = 0; w < nvec; ++w) {
                const __m512 p = FD(vexp)(_mm512_sub_ps(x[w], _mm512_set1_ps(mnew)));
                _mm512_storeu_ps(s + 16 * w, p);
                sum = _mm512_add_ps(sum, p);
            }
            S->l[h] = S->l[h] * corr + _mm512_reduce_add_ps(sum);
            S->m[h] = mnew;
            S->corr[h] = corr;
        }
        for (int64_t c = 0; c < C; ++c) {
            const char *vt = P->v + (size_t)(prow * P->v_sr + (kv0 + c) * P->v_sh) * es;
            FD(vacc)(G, bf16, S->s + c * G * FTILE, S->corr + c * G, vt, (int64_t)(P->v_sr * es), n,
                     S->acc + c * G * Dp, Dp, D);
        }
        pos += n;
    }
    finish_rows(P, row, h0, H, S);
}

#undef FD
#undef FD_CAT
#undef FD_CAT_
