/*
 * The blocked prefill on AMX tiles (AMX-BF16), included by paged_prefill.c after the
 * AVX512-BF16 copy of paged_prefill_body.h (whose packing and softmax it shares) in a
 * target region that adds amx-tile and amx-bf16; picked at run time only where the CPU
 * has the tiles and the OS grants them (attnkit_amx_granted, paged_decode.c).
 *
 * It serves the bf16 pairs layout only (bf16 query and cache, the K tiles packed as dim
 * pairs, V as key pairs: what the AVX512-BF16 copy packs); every other task goes to that
 * copy.  The head dimension is padded to a multiple of 32 (P->Dp), so one tile row holds
 * 32 dims of a query or 16 dim pairs of 16 keys, with zeros in the padding.
 *
 * A task's blocks are bq tokens x G heads, at most 16 rows where G divides 16 (one tile
 * of rows); each key tile of KT = 32 keys is, for each block:
 *   - scored as S = Q K^T: per 32-dim chunk one load of the block's query rows and two
 *     tdpbf16ps against the packed K tile's halves (16 keys each) into two float32 tiles;
 *   - softmaxed row by row by the AVX512-BF16 copy's softmax (scale, soft-cap, ALiBi,
 *     mask, running max and sum in float32), which rounds the weights to bf16 pairs: the
 *     rows of the P tile as they are;
 *   - accumulated as O += P V by tdpbf16ps into the rows' float32 accumulators, 16
 *     columns at a time (a row is rescaled first where its max grew).
 * A block's last tile of rows may be partial (G not a divisor of 16, or a short last
 * block): its tiles are computed and stored whole.  The rows past the block add their
 * weights' products to the next block's accumulators (or the scratch's padding), and
 * those weights are zeros: P's rows past a block's rows are never written (every block
 * of a call has the same rows but a task's last, whose next rows are padding), and the
 * scratch starts zeroed.
 */

#include "amx_tiles.h"

/* Tiles (all 16 rows x 64 bytes): S and O (float32, 16 rows x 16 keys or columns), Q (16
 * rows x 32 dims), K (16 dim pairs x 16 keys), P (16 rows x 32 keys), V (16 key pairs x
 * 16 columns); which tile holds what is in each product's helper below. */
#define PF_AMX_LOAD AMX_TILE_LOAD

#include "avx512_transpose.h"

/*
 * pack_chunk's layout for the pairs of this copy, by vectors: K [KC / KT][U][KT] (16
 * keys' 16 dim pairs per 16 x 16 transpose; dims past D and keys past c1 zero), V as key
 * pairs [(c1 - c0 + 1) / 2][Dp] (two keys' rows interleaved by a two-source permute into
 * column order; the partner of an odd last key zero).
 */
static void pack_chunk_amx(const pparams *P, const ptask *T, scratch_pf *S, int64_t c0, int64_t c1) {
    const int64_t D = P->D, Dp = P->Dp, U = T->units, n = c1 - c0, units = D / 2;
    /* each key's row: the step's own (dense) or its block's, walked block by block (no
     * division per key) */
    int64_t *rows = S->krows;
    const int dense = P->dense[T->i];
    if (dense) {
        for (int64_t x = 0; x < n; ++x) rows[x] = P->qs[T->i] + c0 + x;
    } else {
        const int32_t *table = P->bt + (int64_t)P->req[T->i] * P->bt_sb;
        for (int64_t x = 0; x < n;) {
            const int64_t pos = c0 + x, blk = pos / P->bs, off = pos - blk * P->bs;
            const int64_t run = P->bs - off < n - x ? P->bs - off : n - x;
            const int64_t first = (int64_t)table[blk] * P->bs + off;
            for (int64_t y = 0; y < run; ++y) rows[x + y] = first + y;
            x += run;
        }
    }
    const char *kbase = dense ? P->kd + (size_t)(T->h * P->kd_sh) * P->es : P->kp + (size_t)(T->h * P->k_sh) * P->kv_es;
    const char *vbase = dense ? P->vd + (size_t)(T->h * P->vd_sh) * P->es : P->vp + (size_t)(T->h * P->v_sh) * P->kv_es;
    const size_t kstr = (size_t)(dense ? P->kd_sr : P->k_sr) * 2, vstr = (size_t)(dense ? P->vd_sr : P->v_sr) * 2;
    for (int64_t x0 = 0; x0 < n; x0 += 16) {
        const char *k[16];
        for (int j = 0; j < 16; ++j) k[j] = x0 + j < n ? kbase + (size_t)rows[x0 + j] * kstr : NULL;
        uint32_t *kt = S->kt + (x0 / KT) * U * KT + x0 % KT;
        for (int64_t ch = 0; 16 * ch < U; ++ch) {
            const int64_t left = units - 16 * ch;
            const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF
                                 : left <= 0 ? (__mmask16)0
                                             : (__mmask16)((1u << left) - 1u);
            __m512i r[16];
            for (int j = 0; j < 16; ++j)
                r[j] = k[j] ? _mm512_maskz_loadu_epi32(mk, k[j] + 64 * ch) : _mm512_setzero_si512();
            avx512_transpose16(r);
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512((void *)(kt + (16 * ch + i) * KT), r[i]);
        }
    }
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                        39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t i = 0; 2 * i < n; ++i) {
        const char *va = vbase + (size_t)rows[2 * i] * vstr;
        const char *vb = 2 * i + 1 < n ? vbase + (size_t)rows[2 * i + 1] * vstr : NULL;
        uint32_t *dst = (uint32_t *)(void *)S->vt + i * Dp;
        for (int64_t c = 0; 32 * c < D; ++c) {
            const int64_t left = D - 32 * c;
            const __mmask32 mv = left >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << left) - 1u);
            const __m512i a = _mm512_maskz_loadu_epi16(mv, va + 64 * c);
            const __m512i b = vb ? _mm512_maskz_loadu_epi16(mv, vb + 64 * c) : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(dst + 32 * c), _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512((void *)(dst + 32 * c + 16), _mm512_permutex2var_epi16(a, hi, b));
        }
    }
}

/*
 * 2^y for 16 lanes, y <= 0 (scores minus their max, times log2 e): y = n + r with n
 * rounded to nearest (adding and subtracting 1.5 * 2^23, exact in round-to-nearest),
 * |r| <= 1/2, a degree-5 Taylor polynomial of 2^r = e^(r ln2) (truncation below
 * (ln2 / 2)^6 / 6! < 2.5e-6 relative: the weights are then rounded to bf16, 2^-9, and
 * their float32 sum is off by as little), and 2^n applied by vscalefps.  Below -126:
 * exactly 0 (-inf included); NaN stays NaN (the clamp's max returns a NaN operand).
 * With finite set (y known finite) the clamp is left out: vscalefps rounds p 2^n to 0
 * below the float range by itself.  Lanes outside vis are 0.
 */
INLINE __m512 amx_exp2(__m512 y, const int finite, __mmask16 vis) {
    const __m512 lo = _mm512_set1_ps(-126.0f), magic = _mm512_set1_ps(12582912.0f);
    const __mmask16 keep = finite ? vis : (__mmask16)(vis & _mm512_cmp_ps_mask(y, lo, _CMP_NLT_UQ));
    const __m512 yc = finite ? y : _mm512_max_ps(lo, y);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(yc, magic), magic);
    const __m512 r = _mm512_sub_ps(yc, n);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);                  /* ln2^5 / 5! */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076284772e-3f)); /* ln2^4 / 4! */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108664821580e-2f)); /* ln2^3 / 3! */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022650695910071f));   /* ln2^2 / 2 */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.69314718055994531f));   /* ln2 */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

/* The 16 lanes' maxima (op 0) or sums (op 1) of x[0..16): lane i of the result is x[i]'s
 * (one transpose, then 15 vertical operations: no per-row reduction chain). */
INLINE __m512 amx_lanes_reduce(__m512 x[16], const int op) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_castps_si512(x[i]);
    avx512_transpose16(r);
    __m512 a = _mm512_castsi512_ps(r[0]);
    for (int i = 1; i < 16; ++i)
        a = op ? _mm512_add_ps(a, _mm512_castsi512_ps(r[i])) : _mm512_max_ps(a, _mm512_castsi512_ps(r[i]));
    return a;
}

/* Lanes [lo, hi) of the 16 positions from p0, as a mask. */
INLINE __mmask16 amx_lanes(int64_t p0, int64_t lo, int64_t hi) {
#ifdef ATTNKIT_TEST_AMX_MASK_PAST_END /* a broken variant for the tests: one key too many */
    ++hi;
#endif
    const int64_t a = lo - p0 < 0 ? 0 : lo - p0 > 16 ? 16 : lo - p0;
    const int64_t e = hi - p0 < 0 ? 0 : hi - p0 > 16 ? 16 : hi - p0;
    return e <= a ? (__mmask16)0 : (__mmask16)(((1u << e) - 1u) & ~((1u << a) - 1u));
}

/*
 * A block's online softmax over one chunk's scores at once: s [rows][KC] holds the
 * scores of keys [a0, a0 + span) (span: whole tiles of KT, the keys past c1 unused).
 * Each row's scale, soft-cap, ALiBi and mask as the AVX512-BF16 copy's softmax, then its
 * max over the span, so the rescale factor (corr), the running max m and sum l change
 * once per chunk, not per tile; the weights are rounded to bf16 pairs into pw
 * [rows][KC / 2], the P tiles' rows.
 *
 * Without soft-cap and ALiBi the scale is folded into the exponent, exp(scale s - m)
 * with m the max of scale s (scale s's max is scale times s's max, or its min for a
 * negative scale), and a row's mask is its visible keys [lo, hi): the vectors inside
 * them are taken whole, the one or two that straddle an end through a lane mask, the
 * rest are zero weights, so the scores are read but never rewritten.  With soft-cap or
 * ALiBi each score is transformed and masked in a first pass that stores it back.
 * Rows go 16 at a time: their maxima, rescale factors and sums are lanes of one vector
 * each (a row's share of the bookkeeping is a few vector operations, with no branch on
 * its values).
 */
static void amx_softmax(const ptask *T, const pblock *b, scratch_pf *S, int64_t a0, int64_t span,
                        int64_t c1, float *m, float *l) {
    const int64_t G = T->G, nv = span / 16;
    const int simple = T->cap <= 0.0f && !T->alibi;
    const int neg = simple && T->scale < 0.0f; /* the max of scale s is at s's min */
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 scale = _mm512_set1_ps(T->scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512 pinf = _mm512_set1_ps(INFINITY);
    const float log2e = 1.44269504088896341f;
    /* what multiplies the stored scores on the way to the exponent (base 2) */
    const __m512 mul = _mm512_set1_ps((simple ? T->scale : 1.0f) * log2e);
    __mmask16 vmask[16][KC / 16]; /* each row's visible lanes of each vector */
    for (int64_t g0 = 0; g0 < b->rows; g0 += 16) {
        const int64_t ng = b->rows - g0 < 16 ? b->rows - g0 : 16;
        const __mmask16 lanes = (__mmask16)((1u << ng) - 1u);
        __m512 acc[16];
        for (int64_t i = 0; i < 16; ++i) acc[i] = ninf;
        for (int64_t i = 0; i < ng; ++i) { /* each row's lane-wise max over the span */
            const int64_t r = g0 + i, t = r / G;
            float *s = S->s + r * KC;
            const int64_t lo = b->lo[t] - a0, hi = (b->hi[t] < c1 ? b->hi[t] : c1) - a0;
            __mmask16 *vm = vmask[i];
            for (int64_t j = 0; j < nv; ++j) vm[j] = amx_lanes(16 * j, lo, hi);
            if (simple) {
                __m512 mx = neg ? pinf : ninf;
                if (neg)
                    for (int64_t j = 0; j < nv; ++j) mx = _mm512_mask_min_ps(mx, vm[j], mx, _mm512_loadu_ps(s + 16 * j));
                else
                    for (int64_t j = 0; j < nv; ++j) mx = _mm512_mask_max_ps(mx, vm[j], mx, _mm512_loadu_ps(s + 16 * j));
                acc[i] = _mm512_mul_ps(mx, scale);
                continue;
            }
            const float slope = T->alibi ? T->alibi[T->h0 + r % G] : 0.0f;
            const float base = (float)(a0 - (T->qp0 + b->t0 + t));
            __m512 mx = ninf;
            for (int64_t j = 0; j < nv; ++j) {
                __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * j), scale);
                if (T->cap > 0.0f) {
                    float tmp[16];
                    _mm512_storeu_ps(tmp, v);
                    for (int k = 0; k < 16; ++k) tmp[k] = T->cap * tanhf(tmp[k]);
                    v = _mm512_loadu_ps(tmp);
                }
                if (T->alibi) /* slope * (key position - query position) */
                    v = _mm512_fmadd_ps(_mm512_set1_ps(slope),
                                        _mm512_add_ps(_mm512_set1_ps(base + (float)(16 * j)),
                                                      _mm512_cvtepi32_ps(iota)), v);
                v = _mm512_mask_mov_ps(ninf, vm[j], v);
                _mm512_storeu_ps(s + 16 * j, v);
                mx = _mm512_max_ps(mx, v);
            }
            acc[i] = mx;
        }
        /* the 16 rows' maxima as lanes, then their new max and rescale factor */
        const __m512 mt = amx_lanes_reduce(acc, 0);
        const __m512 mold = _mm512_mask_loadu_ps(ninf, lanes, m + g0);
        const __m512 mnew = _mm512_max_ps(mold, mt);
        const __mmask16 none = _mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ); /* saw nothing yet */
        /* e^(mold - mnew): exactly 1 where the max stayed, 0 where it was -inf */
        __m512 corr = amx_exp2(_mm512_mul_ps(_mm512_sub_ps(mold, mnew), _mm512_set1_ps(log2e)), 0,
                               (__mmask16)0xFFFF);
        corr = _mm512_mask_mov_ps(corr, none, _mm512_set1_ps(1.0f));
        float mn[16];
        _mm512_storeu_ps(mn, mnew);
        _mm512_mask_storeu_ps(m + g0, lanes, mnew);
        _mm512_mask_storeu_ps(S->corr + g0, lanes, corr);
        for (int64_t i = 0; i < ng; ++i) { /* each row's weights and lane-wise sums */
            const float *s = S->s + (g0 + i) * KC;
            uint32_t *pw = S->pw + (g0 + i) * (KC / 2);
            if (none >> i & 1u) { /* nothing visible yet: no weight */
                memset(pw, 0, (size_t)(span / 2) * sizeof(uint32_t));
                acc[i] = _mm512_setzero_ps();
                continue;
            }
            /* (mul s - mnew log2 e) as one fused product: 2^y = e^(scale s - mnew) */
            const __m512 mv = _mm512_set1_ps(-mn[i] * log2e);
            /* finite scores (a finite max): no clamp; NaN and infinities take the
             * clamped path, so they come out as the masked path's */
            const int fin = simple && isfinite(mn[i]);
            const __mmask16 *vm = vmask[i];
            __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
#define PF_AMX_WEIGHTS(finite)                                                              \
    for (int64_t j = 0; j < nv; j += 2) {                                                   \
        const __m512 y0 = _mm512_fmadd_ps(_mm512_loadu_ps(s + 16 * j), mul, mv);            \
        const __m512 y1 = _mm512_fmadd_ps(_mm512_loadu_ps(s + 16 * j + 16), mul, mv);       \
        const __m512 p0 = amx_exp2(y0, finite, vm[j]), p1 = amx_exp2(y1, finite, vm[j + 1]); \
        sum0 = _mm512_add_ps(sum0, p0);                                                     \
        sum1 = _mm512_add_ps(sum1, p1);                                                     \
        const __m512bh pb = _mm512_cvtne2ps_pbh(p1, p0);                                    \
        memcpy(pw + 8 * j, &pb, sizeof pb);                                                 \
    }
            if (fin) {
                PF_AMX_WEIGHTS(1)
            } else {
                PF_AMX_WEIGHTS(0)
            }
#undef PF_AMX_WEIGHTS
            const __m512 sum = _mm512_add_ps(sum0, sum1);
            acc[i] = sum;
        }
        for (int64_t i = ng; i < 16; ++i) acc[i] = _mm512_setzero_ps();
        const __m512 sums = amx_lanes_reduce(acc, 1);
        const __m512 lold = _mm512_mask_loadu_ps(_mm512_setzero_ps(), lanes, l + g0);
        _mm512_mask_storeu_ps(l + g0, lanes, _mm512_fmadd_ps(lold, corr, sums));
    }
}

/*
 * S = Q K^T for one row tile (q: 16 rows of U units) over nk key tiles (kt0: the first
 * packed tile), into srow [16][KC]: two key tiles at a time, four accumulators (each one
 * chain of products over the query's 32-dim chunks: four chains hide the latency).
 */
static void amx_scores1(const uint32_t *q, const uint32_t *kt0, int64_t nk, int64_t nch, int64_t U,
                        float *srow) {
    for (int64_t kk = 0; kk < nk; kk += 2) {
        const int two = kk + 1 < nk;
        const uint32_t *ka = kt0 + kk * U * KT, *kb = ka + U * KT;
        _tile_zero(0);
        _tile_zero(1);
        if (two) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t ch = 0; ch < nch; ++ch) {
            PF_AMX_LOAD(4, q + 16 * ch, U * 4);
            PF_AMX_LOAD(5, ka + 16 * ch * KT, KT * 4);
            _tile_dpbf16ps(0, 4, 5);
            PF_AMX_LOAD(6, ka + 16 * ch * KT + 16, KT * 4);
            _tile_dpbf16ps(1, 4, 6);
            if (two) {
                PF_AMX_LOAD(7, kb + 16 * ch * KT, KT * 4);
                _tile_dpbf16ps(2, 4, 7);
                PF_AMX_LOAD(5, kb + 16 * ch * KT + 16, KT * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, srow + KT * kk, KC * 4);
        _tile_stored(1, srow + KT * kk + 16, KC * 4);
        if (two) {
            _tile_stored(2, srow + KT * kk + KT, KC * 4);
            _tile_stored(3, srow + KT * kk + KT + 16, KC * 4);
        }
    }
}

/* The same for two row tiles (q, q + 16 rows; srow, srow + 16 rows) at once: each K tile
 * loaded once for both (2 x 2 accumulators), half the K traffic per row. */
static void amx_scores2(const uint32_t *q, const uint32_t *kt0, int64_t nk, int64_t nch, int64_t U,
                        float *srow) {
    const uint32_t *qb = q + 16 * U;
    float *sb = srow + 16 * KC;
    for (int64_t kk = 0; kk < nk; ++kk) {
        const uint32_t *ka = kt0 + kk * U * KT;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t ch = 0; ch < nch; ++ch) {
            PF_AMX_LOAD(6, ka + 16 * ch * KT, KT * 4);
            PF_AMX_LOAD(4, q + 16 * ch, U * 4);
            _tile_dpbf16ps(0, 4, 6);
            PF_AMX_LOAD(7, ka + 16 * ch * KT + 16, KT * 4);
            _tile_dpbf16ps(1, 4, 7);
            PF_AMX_LOAD(5, qb + 16 * ch, U * 4);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, srow + KT * kk, KC * 4);
        _tile_stored(1, srow + KT * kk + 16, KC * 4);
        _tile_stored(2, sb + KT * kk, KC * 4);
        _tile_stored(3, sb + KT * kk + 16, KC * 4);
    }
}

/*
 * O += P V for one row tile (o: 16 rows, Dp floats apart; pw: its weights, rows KC / 2
 * apart; fresh: the accumulators start from zero tiles, not from o) over nk key tiles of V pairs (v2): three 16-column strips
 * at a time (accumulators 0..2: three chains hide the latency), P loaded once for them.
 */
static void amx_values1(float *o, const uint32_t *pw, const uint32_t *v2, int64_t nk, int64_t W,
                        int64_t Dp, int fresh) {
    for (int64_t w = 0; w < W; w += 3) {
        const int64_t ns = W - w < 3 ? W - w : 3;
        if (fresh) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
        } else {
            PF_AMX_LOAD(0, o + 16 * w, Dp * 4);
            if (ns > 1) PF_AMX_LOAD(1, o + 16 * w + 16, Dp * 4);
            if (ns > 2) PF_AMX_LOAD(2, o + 16 * w + 32, Dp * 4);
        }
        for (int64_t kk = 0; kk < nk; ++kk) {
            const uint32_t *v = v2 + (KT / 2) * kk * Dp + 16 * w;
            PF_AMX_LOAD(3, pw + (KT / 2) * kk, KC * 2);
            PF_AMX_LOAD(4, v, Dp * 4);
            _tile_dpbf16ps(0, 3, 4);
            if (ns > 1) {
                PF_AMX_LOAD(5, v + 16, Dp * 4);
                _tile_dpbf16ps(1, 3, 5);
            }
            if (ns > 2) {
                PF_AMX_LOAD(6, v + 32, Dp * 4);
                _tile_dpbf16ps(2, 3, 6);
            }
        }
        _tile_stored(0, o + 16 * w, Dp * 4);
        if (ns > 1) _tile_stored(1, o + 16 * w + 16, Dp * 4);
        if (ns > 2) _tile_stored(2, o + 16 * w + 32, Dp * 4);
    }
}

/* The same for two row tiles (o, o + 16 rows; pw, pw + 16 rows): two strips x two row tiles of accumulators, each V tile loaded once for both. */
static void amx_values2(float *o, const uint32_t *pw, const uint32_t *v2, int64_t nk, int64_t W,
                        int64_t Dp, int fresh) {
    float *ob = o + 16 * Dp;
    const uint32_t *pb = pw + 16 * (KC / 2);
    for (int64_t w = 0; w < W; w += 2) {
        const int two = w + 1 < W;
        if (fresh) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        } else {
            PF_AMX_LOAD(0, o + 16 * w, Dp * 4);
            PF_AMX_LOAD(2, ob + 16 * w, Dp * 4);
            if (two) {
                PF_AMX_LOAD(1, o + 16 * w + 16, Dp * 4);
                PF_AMX_LOAD(3, ob + 16 * w + 16, Dp * 4);
            }
        }
        for (int64_t kk = 0; kk < nk; ++kk) {
            const uint32_t *v = v2 + (KT / 2) * kk * Dp + 16 * w;
            PF_AMX_LOAD(6, v, Dp * 4);
            PF_AMX_LOAD(4, pw + (KT / 2) * kk, KC * 2);
            _tile_dpbf16ps(0, 4, 6);
            PF_AMX_LOAD(5, pb + (KT / 2) * kk, KC * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (two) {
                PF_AMX_LOAD(7, v + 16, Dp * 4);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, o + 16 * w, Dp * 4);
        _tile_stored(2, ob + 16 * w, Dp * 4);
        if (two) {
            _tile_stored(1, o + 16 * w + 16, Dp * 4);
            _tile_stored(3, ob + 16 * w + 16, Dp * 4);
        }
    }
}


/* finish_task for bf16 rows: each row times its factor, rounded to bf16 (round to nearest
 * even, NaN kept quiet: vcvtneps2bf16, as f32_to_bf16) 16 values at a time. */
static void finish_task_amx(const pparams *P, const ptask *T, scratch_pf *S) {
    const int64_t D = P->D, Dp = P->Dp;
    for (int64_t r = 0; r < T->rows; ++r) {
        char *dst;
        const __m512 mul = _mm512_set1_ps(finish_factor(P, T, S, r, &dst));
        const float *acc = S->o + r * Dp;
        for (int64_t d = 0; d < D; d += 16) /* D % 16 == 0 in this copy */
            _mm256_storeu_si256((__m256i *)(void *)(dst + 2 * d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + d), mul)));
    }
}

static void run_amxbf16(const pparams *P, ptask *T, scratch_pf *S) {
    if (!P->amx) {
        run_avx512bf16(P, T, S);
        return;
    }
    const int64_t rows = T->rows, U = T->units, Dp = T->Dp, W = P->D / 16, nch = Dp / 32;
    load_query(P, T, S); /* the pairs: rows copied as they are */
    for (int64_t r = 0; r < rows; ++r) {
        S->m[r] = -INFINITY;
        S->l[r] = 0.0f;
    }
    /* no zeroing of the accumulators: a block's first product starts from zero tiles
     * (ready marks the blocks past it), and a block that sees no key is zeroed before
     * its output */
    for (int64_t bi = 0; bi < T->nblocks; ++bi) S->blocks[bi].ready = 0;
    amx_tiles_configure();
    for (int64_t c0 = T->k_lo; c0 < T->k_hi; c0 += KC) {
        const int64_t c1 = T->k_hi - c0 < KC ? T->k_hi : c0 + KC;
        pack_chunk_amx(P, T, S, c0, c1);
        /* the last tile's key pairs past the chunk: zero (their weights are zero too) */
        const int64_t np = (c1 - c0 + 1) / 2, npad = (c1 - c0 + KT - 1) / KT * (KT / 2);
        for (int64_t i = np; i < npad; ++i) memset(S->vt + i * Dp, 0, (size_t)Dp * sizeof(float));
        for (int64_t bi = 0; bi < T->nblocks; ++bi) {
            pblock *b = &S->blocks[bi];
            const int64_t lo = b->k_lo > c0 ? b->k_lo : c0, hi = b->k_hi < c1 ? b->k_hi : c1;
            if (lo >= hi) continue;
            const int64_t r0 = b->r0, nt = (b->rows + 15) / 16;
            const int64_t a0 = c0 + (lo - c0) / KT * KT, nk = (hi - a0 + KT - 1) / KT;
            const uint32_t *kt0 = S->kt + (a0 - c0) / KT * U * KT;
            /* S = Q K^T for the block's rows over the chunk's tiles it sees, two row
             * tiles at a time */
            for (int64_t rt = 0; rt < nt; rt += 2) {
                const uint32_t *q = S->q + (r0 + 16 * rt) * U;
                if (rt + 1 < nt) amx_scores2(q, kt0, nk, nch, U, S->s + 16 * rt * KC);
                else amx_scores1(q, kt0, nk, nch, U, S->s + 16 * rt * KC);
            }
            __asm__ volatile("" ::: "memory");
            amx_softmax(T, b, S, a0, nk * KT, c1, S->m + r0, S->l + r0);
            const int fresh = !b->ready; /* the block's first product: nothing to rescale */
            b->ready = 1;
            for (int64_t i = 0; i < b->rows && !fresh; ++i) { /* rows whose max grew: rescaled */
                const float c = S->corr[i];
#ifdef ATTNKIT_TEST_AMX_NO_RESCALE /* a broken variant for the tests: no rescale */
                continue;
#endif
                if (c == 1.0f) continue;
                float *o = S->o + (r0 + i) * Dp;
                const __m512 cv = _mm512_set1_ps(c);
                for (int64_t w = 0; w < W; ++w)
                    _mm512_storeu_ps(o + 16 * w, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * w), cv));
            }
            /* O += P V over the chunk, two row tiles at a time */
            const uint32_t *v2 = (const uint32_t *)(void *)S->vt + (a0 - c0) / 2 * Dp;
            for (int64_t rt = 0; rt < nt; rt += 2) {
                const int64_t m0 = 16 * rt;
                float *o = S->o + (r0 + m0) * Dp;
                const uint32_t *pw = S->pw + m0 * (KC / 2);
                if (rt + 1 < nt) amx_values2(o, pw, v2, nk, W, Dp, fresh);
                else amx_values1(o, pw, v2, nk, W, Dp, fresh);
            }
        }
    }
    _tile_release();
    __asm__ volatile("" ::: "memory");
    for (int64_t bi = 0; bi < T->nblocks; ++bi) /* blocks that saw no key: zeros */
        if (!S->blocks[bi].ready)
            memset(S->o + S->blocks[bi].r0 * Dp, 0, (size_t)(S->blocks[bi].rows * Dp) * sizeof(float));
    finish_task_amx(P, T, S);
}

#undef PF_AMX_LOAD
