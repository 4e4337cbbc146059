/*
 * The blocked prefill's compute, included by paged_prefill.c once per instruction set
 * (never compiled alone).  Before each inclusion paged_prefill.c opens a target region
 * for that set and defines:
 *   SFX      the name suffix of this copy's functions;
 *   QK_ROWS  query rows per score micro-kernel call (register budget of the set);
 *   PV_ROWS  query rows per value micro-kernel call;
 *   BF16DOT  1 where the set has native bf16 dot products (AVX512-BF16), else 0;
 *   PKEEP(x) keeps a loaded vector in a register (an empty asm where the set has
 *            registers of the vector's width, nothing otherwise).
 *
 * One task is (request, block of query tokens, K/V head): its rows are the block's
 * tokens times the G query heads of the K/V head (row t * G + g).  Keys are walked in
 * tiles of KT keys from the lowest key any row sees to the highest; each tile is packed
 * once (K transposed: column j is key j, V row-major), so the micro-kernels read
 * contiguous vectors whatever the cache layout or block size.  Scores, the online
 * softmax and the output accumulate in float32.  With BF16DOT and bf16 inputs, K is
 * packed as pairs of bf16 (dims 2i, 2i+1 of a key in one 32-bit lane) and the scores
 * are exact-product float32 sums of bf16 pairs (vdpbf16ps): the query and key values
 * are the inputs as given, never rounded again.  V is then packed as pairs of keys (one
 * column of keys 2i, 2i + 1 per 32-bit lane) and the weights are rounded to bf16 (round
 * to nearest even, vcvtne2ps2bf16) for the value products; the sum of the weights, the
 * running max and the accumulator stay float32.
 */

#define PF_CAT_(a, b) a##_##b
#define PF_CAT(a, b) PF_CAT_(a, b)
#define PF(name) PF_CAT(name, SFX)

INLINE v16f PF(splat)(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

INLINE v16f PF(ld)(const float *p) {
    v16f r;
    memcpy(&r, p, sizeof r);
    return r;
}

INLINE void PF(st)(float *p, v16f x) { memcpy(p, &x, sizeof x); }

/* exp for 16 lanes, x <= 0 (scores minus their running max), by the method of vexp in
 * paged_decode.c (x = n ln2 + r, a degree-6 polynomial of r, 2^n in the exponent bits).
 * Below -87: exactly 0 (-inf included); NaN stays NaN. */
INLINE v16f PF(vexp)(v16f x) {
    const v16f lo = PF(splat)(-87.0f);
    v16i tiny = x < lo;
    v16f xc = (v16f)(((v16i)x & ~tiny) | ((v16i)lo & tiny));
    const v16f magic = PF(splat)(12582912.0f); /* 1.5 * 2^23: rounds to an integer */
    v16f t = xc * PF(splat)(1.44269504088896341f) + magic;
    v16f n = t - magic;
    v16i ni = (v16i)t - (v16i)magic;
    v16f r = xc - n * PF(splat)(0.693359375f);
    r = r - n * PF(splat)(-2.12194440e-4f);
    v16f p = PF(splat)(1.0f / 720.0f);
    p = p * r + PF(splat)(1.0f / 120.0f);
    p = p * r + PF(splat)(1.0f / 24.0f);
    p = p * r + PF(splat)(1.0f / 6.0f);
    p = p * r + PF(splat)(0.5f);
    p = p * r + PF(splat)(1.0f);
    p = p * r + PF(splat)(1.0f);
    v16f res = p * (v16f)((ni + 127) << 23);
    return (v16f)((v16i)res & ~tiny);
}

INLINE v16f PF(vmax)(v16f a, v16f b) {
    const v16i gt = b > a;
    return (v16f)(((v16i)b & gt) | ((v16i)a & ~gt));
}

/* Horizontal max and sum: halves folded onto each other, 4 steps. */
INLINE float PF(hmax)(v16f x) {
    x = PF(vmax)(x, SHUF16(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = PF(vmax)(x, SHUF16(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = PF(vmax)(x, SHUF16(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x = PF(vmax)(x, SHUF16(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return x[0];
}

INLINE float PF(hsum)(v16f x) {
    x += SHUF16(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    x += SHUF16(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    x += SHUF16(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    x += SHUF16(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return x[0];
}

/*
 * s[r][0 .. KT) = q[r] . kt[:, j] for RB rows: q rows of U 32-bit units (stride qs), kt
 * [U][KT].  Float units: one FMA per unit; bf16 pairs (BF16DOT): one dot of two
 * products per unit.
 */
INLINE void PF(qk_kernel)(const int RB, const int pairs, const uint32_t *restrict q, int64_t qs,
                          const uint32_t *restrict kt, int64_t U, float *restrict s) {
    v16f a[QK_ROWS][2];
    for (int r = 0; r < RB; ++r) a[r][0] = a[r][1] = PF(splat)(0.0f);
    for (int64_t u = 0; u < U; ++u) {
        v16f k0 = PF(ld)((const float *)kt + u * KT);
        v16f k1 = PF(ld)((const float *)kt + u * KT + 16);
        PKEEP(k0);
        PKEEP(k1);
        for (int r = 0; r < RB; ++r) {
#if BF16DOT
            if (pairs) {
                const __m512i b = _mm512_set1_epi32((int)q[r * qs + u]);
                a[r][0] = (v16f)_mm512_dpbf16_ps((__m512)a[r][0], (__m512bh)(__m512i)k0, (__m512bh)b);
                a[r][1] = (v16f)_mm512_dpbf16_ps((__m512)a[r][1], (__m512bh)(__m512i)k1, (__m512bh)b);
                continue;
            }
#else
            (void)pairs;
#endif
            float x;
            memcpy(&x, q + r * qs + u, sizeof x);
            const v16f b = PF(splat)(x);
            a[r][0] += b * k0;
            a[r][1] += b * k1;
        }
    }
    for (int r = 0; r < RB; ++r) {
        PF(st)(s + r * KT, a[r][0]);
        PF(st)(s + r * KT + 16, a[r][1]);
    }
}

/* o[r][0 .. 16 CW) = o[r] * corr[r] + sum_j p[r][j] v[j] over n keys, RB rows. */
INLINE void PF(pv_kernel)(const int RB, const int CW, const float *restrict p,
                          const float *restrict corr, const float *restrict v, int64_t vs,
                          int64_t n, float *restrict o, int64_t os) {
    v16f a[PV_ROWS][4];
    for (int r = 0; r < RB; ++r) {
        const v16f c = PF(splat)(corr[r]);
        for (int w = 0; w < CW; ++w) a[r][w] = PF(ld)(o + r * os + 16 * w) * c;
    }
    for (int64_t j = 0; j < n; ++j) {
        v16f vv[4];
        for (int w = 0; w < CW; ++w) {
            vv[w] = PF(ld)(v + j * vs + 16 * w);
            PKEEP(vv[w]);
        }
        for (int r = 0; r < RB; ++r) {
            const v16f b = PF(splat)(p[r * KT + j]);
            for (int w = 0; w < CW; ++w) a[r][w] += b * vv[w];
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int w = 0; w < CW; ++w) PF(st)(o + r * os + 16 * w, a[r][w]);
}

/* Scores of rows q[0 .. rows) (stride U units) against the tile kt: s [rows][KT]. */
static void PF(scores)(int pairs, const uint32_t *q, int64_t U, const uint32_t *kt, int64_t rows,
                       float *s) {
    int64_t r = 0;
    if (pairs) { /* the literal 1 / 0 specialises the inlined kernel */
        for (; r + QK_ROWS <= rows; r += QK_ROWS)
            PF(qk_kernel)(QK_ROWS, 1, q + r * U, U, kt, U, s + r * KT);
        for (; r < rows; ++r) PF(qk_kernel)(1, 1, q + r * U, U, kt, U, s + r * KT);
    } else {
        for (; r + QK_ROWS <= rows; r += QK_ROWS)
            PF(qk_kernel)(QK_ROWS, 0, q + r * U, U, kt, U, s + r * KT);
        for (; r < rows; ++r) PF(qk_kernel)(1, 0, q + r * U, U, kt, U, s + r * KT);
    }
}

/* o[rows][Dp] = o * corr + p [rows][KT] . v [n][Dp]. */
#if BF16DOT
/* o[r][0 .. 16 CW) = o[r] * corr[r] + sum_i (p, v) pairs over np key pairs: pw [RB][KT / 2]
 * bf16 weight pairs, v2 [np][vs] bf16 value pairs (keys 2i, 2i + 1 of one column). */
INLINE void PF(pv_pairs)(const int RB, const int CW, const uint32_t *restrict pw,
                         const float *restrict corr, const uint32_t *restrict v2, int64_t vs,
                         int64_t np, float *restrict o, int64_t os) {
    v16f a[PV_ROWS][4];
    for (int r = 0; r < RB; ++r) {
        const v16f c = PF(splat)(corr[r]);
        for (int w = 0; w < CW; ++w) a[r][w] = PF(ld)(o + r * os + 16 * w) * c;
    }
    for (int64_t i = 0; i < np; ++i) {
        v16f vv[4];
        for (int w = 0; w < CW; ++w) {
            vv[w] = PF(ld)((const float *)v2 + i * vs + 16 * w);
            PKEEP(vv[w]);
        }
        for (int r = 0; r < RB; ++r) {
            const __m512i b = _mm512_set1_epi32((int)pw[r * (KT / 2) + i]);
            for (int w = 0; w < CW; ++w)
                a[r][w] = (v16f)_mm512_dpbf16_ps((__m512)a[r][w], (__m512bh)(__m512i)vv[w],
                                                 (__m512bh)b);
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int w = 0; w < CW; ++w) PF(st)(o + r * os + 16 * w, a[r][w]);
}

/* values() with bf16 pairs: pw [rows][KT / 2], v2 [n / 2 rounded up][Dp]. */
static void PF(values_pairs)(const uint32_t *pw, const float *corr, const uint32_t *v2,
                             int64_t n, int64_t rows, float *o, int64_t Dp) {
    const int64_t np = (n + 1) / 2;
    for (int64_t d = 0; d < Dp; d += 64) {
        const int64_t left = (Dp - d) / 16;
        const int cw = left >= 4 ? 4 : (int)left;
        int64_t r = 0;
#define PF_PV2(RB)                                                                            \
    do {                                                                                      \
        const uint32_t *p_ = pw + r * (KT / 2), *v_ = v2 + d;                                 \
        const float *c_ = corr + r;                                                           \
        float *o_ = o + r * Dp + d;                                                           \
        if (cw == 4) PF(pv_pairs)(RB, 4, p_, c_, v_, Dp, np, o_, Dp);                         \
        else if (cw == 3) PF(pv_pairs)(RB, 3, p_, c_, v_, Dp, np, o_, Dp);                    \
        else if (cw == 2) PF(pv_pairs)(RB, 2, p_, c_, v_, Dp, np, o_, Dp);                    \
        else PF(pv_pairs)(RB, 1, p_, c_, v_, Dp, np, o_, Dp);                                 \
    } while (0)
        for (; r + PV_ROWS <= rows; r += PV_ROWS) PF_PV2(PV_ROWS);
        for (; r < rows; ++r) PF_PV2(1);
#undef PF_PV2
    }
}
#endif

/* o[rows][Dp] = o * corr + p [rows][KT] . v [n rows, vs floats apart]. */
static void PF(values)(const float *p, const float *corr, const float *v, int64_t vs, int64_t n,
                       int64_t rows, float *o, int64_t Dp) {
    for (int64_t d = 0; d < Dp; d += 64) {
        const int64_t left = (Dp - d) / 16;
        const int cw = left >= 4 ? 4 : (int)left;
        int64_t r = 0;
#define PF_PV(RB)                                                                             \
    do {                                                                                      \
        const float *p_ = p + r * KT, *c_ = corr + r, *v_ = v + d;                            \
        float *o_ = o + r * Dp + d;                                                           \
        if (cw == 4) PF(pv_kernel)(RB, 4, p_, c_, v_, vs, n, o_, Dp);                         \
        else if (cw == 3) PF(pv_kernel)(RB, 3, p_, c_, v_, vs, n, o_, Dp);                    \
        else if (cw == 2) PF(pv_kernel)(RB, 2, p_, c_, v_, vs, n, o_, Dp);                    \
        else PF(pv_kernel)(RB, 1, p_, c_, v_, vs, n, o_, Dp);                                 \
    } while (0)
        for (; r + PV_ROWS <= rows; r += PV_ROWS) PF_PV(PV_ROWS);
        for (; r < rows; ++r) PF_PV(1);
#undef PF_PV
    }
}

/*
 * One block's tile of scores s [rows][KT] (keys a .. a + n): the scale, soft-cap, ALiBi
 * and mask, then the online softmax: s becomes the weights, corr the factor on each
 * row's accumulator, m and l the running max and sum.
 */
static void PF(softmax)(const ptask *T, const pblock *b, float *s_all, uint32_t *pw, float *m,
                        float *l, float *corr, int64_t a, int64_t n, int masked) {
    const int64_t G = T->G;
    const v16i iota0 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16i iota1 = iota0 + 16;
    const v16f fiota0 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16f fiota1 = fiota0 + PF(splat)(16.0f);
    const v16f scale = PF(splat)(T->scale), ninf = PF(splat)(-INFINITY);
    const v16i nv = (v16i){0} + (int32_t)n;
    for (int64_t r = 0; r < b->rows; ++r) {
        float *s = s_all + r * KT;
        const int64_t t = r / G;
        v16f s0 = PF(ld)(s) * scale, s1 = PF(ld)(s + 16) * scale;
        if (T->cap > 0.0f) {
            PF(st)(s, s0);
            PF(st)(s + 16, s1);
            for (int64_t j = 0; j < KT; ++j) s[j] = T->cap * tanhf(s[j]);
            s0 = PF(ld)(s);
            s1 = PF(ld)(s + 16);
        }
        if (T->alibi) { /* slope * (key position - query position) */
            const float slope = T->alibi[T->h0 + r % G];
            const v16f base = PF(splat)((float)(a - (T->qp0 + b->t0 + t)));
            s0 += PF(splat)(slope) * (base + fiota0);
            s1 += PF(splat)(slope) * (base + fiota1);
        }
        if (masked) { /* keys outside [lo, hi) of the row's token, and past the tile */
            const v16i lo = (v16i){0} + (int32_t)(b->lo[t] - a);
            const v16i hi = (v16i){0} + (int32_t)(b->hi[t] - a);
            const v16i hid0 = (iota0 < lo) | (iota0 >= hi) | (iota0 >= nv);
            const v16i hid1 = (iota1 < lo) | (iota1 >= hi) | (iota1 >= nv);
            s0 = (v16f)(((v16i)s0 & ~hid0) | ((v16i)ninf & hid0));
            s1 = (v16f)(((v16i)s1 & ~hid1) | ((v16i)ninf & hid1));
        }
        const float mt = PF(hmax)(PF(vmax)(s0, s1));
        const float mold = m[r];
        const float mnew = mt > mold ? mt : mold;
        if (mnew == -INFINITY) { /* nothing visible yet: no weight, nothing to rescale */
            corr[r] = 1.0f;
            PF(st)(s, PF(splat)(0.0f));
            PF(st)(s + 16, PF(splat)(0.0f));
            if (pw) memset(pw + r * (KT / 2), 0, (KT / 2) * sizeof(uint32_t));
            continue;
        }
        const float c = mnew == mold ? 1.0f : mold == -INFINITY ? 0.0f : expf(mold - mnew);
        const v16f p0 = PF(vexp)(s0 - PF(splat)(mnew)), p1 = PF(vexp)(s1 - PF(splat)(mnew));
#if BF16DOT
        if (T->pairs) { /* the weights as bf16 pairs, keys in order */
            const __m512bh pb = _mm512_cvtne2ps_pbh((__m512)p1, (__m512)p0);
            memcpy(pw + r * (KT / 2), &pb, sizeof pb);
        } else
#else
        (void)pw;
#endif
        {
            PF(st)(s, p0);
            PF(st)(s + 16, p1);
        }
        l[r] = l[r] * c + PF(hsum)(p0 + p1);
        m[r] = mnew;
        corr[r] = c;
    }
}

/*
 * One task: its query rows once, then its keys chunk by chunk (each chunk packed once
 * for all the task's blocks), every block walking the chunk's tiles it sees.
 */
static void PF(run)(const pparams *P, ptask *T, scratch_pf *S) {
    const int64_t rows = T->rows, U = T->units, Dp = T->Dp;
    load_query(P, T, S);
    for (int64_t r = 0; r < rows; ++r) {
        S->m[r] = -INFINITY;
        S->l[r] = 0.0f;
    }
    memset(S->o, 0, (size_t)(rows * Dp) * sizeof(float));
    for (int64_t c0 = T->k_lo; c0 < T->k_hi; c0 += KC) {
        const int64_t c1 = T->k_hi - c0 < KC ? T->k_hi : c0 + KC;
        pack_chunk(P, T, S, c0, c1);
        for (int64_t bi = 0; bi < T->nblocks; ++bi) {
            const pblock *b = &S->blocks[bi];
            const int64_t lo = b->k_lo > c0 ? b->k_lo : c0, hi = b->k_hi < c1 ? b->k_hi : c1;
            if (lo >= hi) continue;
            const int64_t r0 = b->r0;
            for (int64_t a = c0 + (lo - c0) / KT * KT; a < hi; a += KT) {
                const int64_t n = c1 - a < KT ? c1 - a : KT;
                /* every row sees every key of the tile: no mask to apply */
                const int masked = n < KT || !(a >= b->lo_max && a + n <= b->hi_min);
                const int64_t tile = (a - c0) / KT;
                /* the value products stop at the block's last visible key */
                const int64_t nv = b->k_hi - a < n ? b->k_hi - a : n;
                PF(scores)(T->pairs, S->q + r0 * U, U, S->kt + tile * U * KT, b->rows, S->s);
#if BF16DOT
                if (T->pairs) {
                    PF(softmax)(T, b, S->s, S->pw, S->m + r0, S->l + r0, S->corr, a, n, masked);
                    PF(values_pairs)(S->pw, S->corr, (const uint32_t *)(void *)S->vt + (a - c0) / 2 * Dp,
                                     nv, b->rows, S->o + r0 * Dp, Dp);
                    continue;
                }
#endif
                PF(softmax)(T, b, S->s, NULL, S->m + r0, S->l + r0, S->corr, a, n, masked);
                if (tile_direct(P, T, a, n)) {
                    const int dense = P->dense[T->i];
                    PF(values)(S->s, S->corr, (const float *)(const void *)key_row(P, T, a, 1),
                               dense ? P->vd_sr : P->v_sr, nv, b->rows, S->o + r0 * Dp, Dp);
                } else {
                    PF(values)(S->s, S->corr, S->vt + (a - c0) * Dp, Dp, nv, b->rows,
                               S->o + r0 * Dp, Dp);
                }
            }
        }
    }
    finish_task(P, T, S);
}

#undef PF
#undef PF_CAT
#undef PF_CAT_
