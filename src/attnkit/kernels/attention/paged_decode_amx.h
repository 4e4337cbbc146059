/*
 * The paged decode on AMX tiles (AMX-BF16), included by paged_decode.c after the 16-lane
 * copy (whose helpers it calls) in a target region that adds amx-tile and amx-bf16; chosen
 * at run time only where the CPU has the tiles and the OS grants them (amx_ready).
 *
 * A task is a group of work items of one request (plan_groups) over a range of kv heads,
 * as for task_avx512bf16. For one kv head its M = rows x G query heads are blocks of 16
 * matrix rows (the last one padded), and every tile of 16 keys (one block, one aligned
 * 16-position window: lane = position mod 16) is:
 *   - scored as S^T = K Q^T by tdpbf16ps: K's rows are read in place (a partial tile from
 *     a zero-padded copy), Q^T in bf16 pairs is built once per task;
 *   - softmaxed vertically: one 16-lane vector per key holds the 16 rows' scores, so the
 *     max, exp and sums of the online softmax need no horizontal reduction; the float32
 *     probabilities are transposed into rows and rounded to bf16;
 *   - accumulated as O += P V by tdpbf16ps into the rows' float32 accumulators (V in key
 *     pairs, load_v_tile_avx512bf16's unpack order), one product for the two tiles of an
 *     aligned 32-position window: the first tile's weights are multiplied by the second
 *     one's rescale factor before rounding, and a row's accumulator is rescaled once by
 *     both (where its max grew). Half the accumulator loads and stores of one product
 *     per tile: 0.80x the compute time of a 32 x 2k bf16 decode with its K/V in cache.
 * A row's arithmetic depends only on its own keys, positions and query, so it is the same
 * bits alone (a decode) or in a group (a verify step, a chunk): the windows sit at fixed
 * positions, and keys of the group's range a row does not see enter its sums as exact
 * zeros (their values are read), tiles of them leaving its state as it was.
 */

#include "amx_tiles.h"
#define AMX_LOAD AMX_TILE_LOAD

/* Tiles (amx_tiles_configure: all 16 rows x 64 bytes): 0 S^T (16 keys x 16 rows), 1 K
 * (16 keys x 32 columns), 2 Q^T (16 column pairs x 16 rows), 3 P (16 rows x 32 keys: a
 * window's two tiles), 4 V (16 key pairs x 16 columns), 5 O (16 rows x 16 columns). */

static void amx_task(const params *P, int64_t i0, int64_t R, int64_t kv0, int64_t C, scratch *S) {
    const int64_t G = P->G, D = P->D, Dp = P->Dp, M = R * G, h0 = kv0 * G;
    const int64_t nblk = (M + 15) / 16, Mp = 16 * nblk, W = D / 16, nch = D / 32;
    const size_t es = P->esize;
    if (R == 1 && P->ke[i0] <= P->ks[i0]) { /* no visible key */
        empty_rows(P, P->rows[i0], h0, C * G);
        return;
    }
    int64_t us = P->ks[i0], ue = P->ke[i0];
    for (int64_t r = 1; r < R; ++r) {
        if (P->ks[i0 + r] < us) us = P->ks[i0 + r];
        if (P->ke[i0 + r] > ue) ue = P->ke[i0 + r];
    }
    const int32_t *table = P->bt + (int64_t)P->req[i0] * P->bt_sb;
    /* per matrix row m (padded to Mp): its key range, query position and head in group */
    int32_t *lane_ks = (int32_t *)(void *)S->lv, *lane_ke = lane_ks + Mp;
    float *lane_qp = (float *)(void *)(lane_ke + Mp);
    int32_t *lane_g = (int32_t *)(void *)(lane_qp + Mp);
    for (int64_t m = 0; m < Mp; ++m) {
        const int64_t r = m < M ? m / G : 0;
        lane_ks[m] = m < M ? P->ks[i0 + r] : 0;
        lane_ke[m] = m < M ? P->ke[i0 + r] : 0; /* padding rows see nothing */
        lane_qp[m] = (float)P->qp[i0 + r];
        lane_g[m] = (int32_t)(m % G);
    }
    /* Q^T in bf16 pairs: block (c, b, chunk) at qt + ((c * nblk + b) * nch + chunk) * 256 */
    uint32_t *qt = (uint32_t *)(void *)S->q;
    for (int64_t c = 0; c < C; ++c)
        for (int64_t b = 0; b < nblk; ++b)
            for (int64_t ch = 0; ch < nch; ++ch) {
                __m512i rr[16];
                for (int i = 0; i < 16; ++i) {
                    const int64_t m = 16 * b + i;
                    if (m < M) {
                        const int64_t r = m / G, g = m % G;
                        const char *q = P->q + (size_t)(P->rows[i0 + r] * P->q_st +
                                                        (h0 + c * G + g) * P->q_sh) * es;
                        rr[i] = _mm512_loadu_si512((const void *)(q + 64 * ch));
                    } else {
                        rr[i] = _mm512_setzero_si512();
                    }
                }
                avx512_transpose16(rr);
                uint32_t *dst = qt + ((c * nblk + b) * nch + ch) * 256;
                for (int i = 0; i < 16; ++i) _mm512_storeu_si512((void *)(dst + 16 * i), rr[i]);
            }
    for (int64_t m = 0; m < C * Mp; ++m) {
        memset(S->acc + m * Dp, 0, (size_t)Dp * sizeof(float));
        S->m[m] = -INFINITY;
        S->l[m] = 0.0f;
    }
    amx_tiles_configure();
    float *sbuf = S->s;                     /* S^T: 16 keys x 16 rows */
    uint16_t *pbuf = S->pb;                 /* P: 16 rows x 32 keys, bf16 */
    char *kbuf = (char *)(void *)S->kt;     /* partial tiles' K rows, zero-padded (two) */
    const size_t krow = (size_t)P->k_sr * es, vrow = (size_t)P->v_sr * es;
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const int has_cap = P->cap > 0.0f;
    const float inv_cap = has_cap ? 1.0f / P->cap : 0.0f;
    for (int64_t pos = us; pos < ue;) {
        /* the keys of one aligned 32-position window at a time: its two 16-key tiles (a
         * pair) share one product into the accumulators; a window the walk enters in its
         * second half, or leaves in its first, is one tile */
        key_tile tl[2];
        tl[0] = next_key_tile(P, table, pos, ue);
        int nt2 = 1;
        if (tl[0].base % 32 == 0 && tl[0].hi == 16 && tl[0].end < ue) {
            tl[1] = next_key_tile(P, table, tl[0].end, ue);
            nt2 = 2;
        }
        const int64_t nrow = tl[nt2 - 1].next_row, nn = tl[nt2 - 1].next_n;
        for (int64_t c = 0; c < C; ++c) {
            /* The next (head, tiles)' K and V lines, prefetched into L2 a few rows per
             * product step (a burst of them stalls the loads behind it): this window's for
             * the next head, the next tile's for the first head after the last */
            const char *kn[2] = {NULL, NULL}, *vn[2] = {NULL, NULL};
            int64_t nr_[2] = {0, 0};
            if (c + 1 < C) {
                for (int t = 0; t < nt2; ++t) {
                    kn[t] = P->k + (size_t)(tl[t].row * P->k_sr + (kv0 + c + 1) * P->k_sh) * es;
                    vn[t] = P->v + (size_t)(tl[t].row * P->v_sr + (kv0 + c + 1) * P->v_sh) * es;
                    nr_[t] = tl[t].hi - tl[t].lo;
                }
            } else if (nrow >= 0) {
                kn[0] = P->k + (size_t)(nrow * P->k_sr + kv0 * P->k_sh) * es;
                vn[0] = P->v + (size_t)(nrow * P->v_sr + kv0 * P->v_sh) * es;
                nr_[0] = nn;
            }
            /* rows of it per score step (nch of them, per tile) and per value step (W) */
            const int64_t rk0 = (nr_[0] + nch - 1) / nch, rk1 = (nr_[1] + nch - 1) / nch;
            const int64_t nv_ = nr_[0] + nr_[1], rv = (nv_ + W - 1) / W;
            const char *ka[2];
            size_t ks[2];
            for (int t = 0; t < nt2; ++t) {
                const int lo = tl[t].lo, hi = tl[t].hi;
                const char *kt = P->k + (size_t)(tl[t].row * P->k_sr + (kv0 + c) * P->k_sh) * es;
                const char *vt = P->v + (size_t)(tl[t].row * P->v_sr + (kv0 + c) * P->v_sh) * es;
                ka[t] = kt;
                ks[t] = krow;
                if (lo != 0 || hi != 16) { /* rows outside the tile are not read */
                    char *kb = kbuf + t * 32 * D;
                    memset(kb, 0, (size_t)(32 * D));
                    for (int j = lo; j < hi; ++j) memcpy(kb + j * 2 * D, kt + (j - lo) * krow, (size_t)(2 * D));
                    ka[t] = kb;
                    ks[t] = (size_t)(2 * D);
                }
                load_v_tile_avx512bf16(vt, (int64_t)vrow, lo, hi, D, S->vp + t * 8 * W * 32);
            }
            if (nt2 == 1) /* no second tile: zero values (beside zero weights) */
                memset(S->vp + 8 * W * 32, 0, (size_t)(8 * W * 64));
            for (int64_t b = 0; b < nblk; ++b) {
#ifdef ATTNKIT_TEST_DROP_PARTIAL_ROWS /* a broken variant for the tests: a padded block lost */
                if (M % 16 && b == nblk - 1) continue;
#endif
                const int64_t mb = c * Mp + 16 * b; /* the block's first row in the scratch */
                /* the block's rows as lanes */
                const __m512i vks = _mm512_loadu_si512((const void *)(lane_ks + 16 * b));
                const __m512i vke = _mm512_loadu_si512((const void *)(lane_ke + 16 * b));
                const __m512 vqp = _mm512_loadu_ps(lane_qp + 16 * b);
                __m512 slope = _mm512_setzero_ps();
                if (P->alibi) {
                    const __m512i gi = _mm512_loadu_si512((const void *)(lane_g + 16 * b));
                    slope = _mm512_i32gather_ps(gi, P->alibi + h0 + c * G, 4);
                }
                __m512 x[2][16];
                __m512 corr[2];
                for (int t = 0; t < nt2; ++t) {
                    const int lo = tl[t].lo, hi = tl[t].hi;
                    const int64_t base = tl[t].base;
                    _tile_zero(0);
                    for (int64_t ch = 0; ch < nch; ++ch) {
                        if (b == 0) { /* the next one's K rows of this step */
                            const int64_t rk = t ? rk1 : rk0, nr = nr_[t];
                            for (int64_t j = ch * rk; j < (ch + 1) * rk && j < nr; ++j)
                                for (int64_t y = 0; y < D * 2; y += 64)
                                    _mm_prefetch(kn[t] + j * krow + y, _MM_HINT_T1);
                        }
                        AMX_LOAD(1, ka[t] + 64 * ch, ks[t]);
                        AMX_LOAD(2, qt + ((c * nblk + b) * nch + ch) * 256, 64);
                        _tile_dpbf16ps(0, 1, 2);
                    }
                    _tile_stored(0, sbuf, 64);
                    __m512 mx = ninf;
                    for (int j = 0; j < 16; ++j) {
                        if (j < lo || j >= hi) {
                            x[t][j] = ninf;
                            continue;
                        }
                        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(sbuf + 16 * j), _mm512_set1_ps(P->scale));
                        if (has_cap) v = soft_cap_avx512bf16(v, P->cap, inv_cap);
                        const int64_t p = base + j;
                        if (P->alibi)
                            v = _mm512_fmadd_ps(slope,
                                                _mm512_sub_ps(_mm512_set1_ps((float)(p * P->pm + P->pa)), vqp), v);
                        const __m512i pv = _mm512_set1_epi32((int32_t)p);
                        const __mmask16 vis = _mm512_cmple_epi32_mask(vks, pv) & _mm512_cmplt_epi32_mask(pv, vke);
                        x[t][j] = _mm512_mask_mov_ps(ninf, vis, v);
                        mx = _mm512_max_ps(mx, x[t][j]);
                    }
                    const __m512 mold = _mm512_loadu_ps(S->m + mb);
                    const __m512 mnew = _mm512_max_ps(mold, mx);
                    /* rows that saw nothing yet: 0 as the max (their scores are all -inf) */
                    const __m512 msafe = _mm512_mask_mov_ps(mnew, _mm512_cmp_ps_mask(mnew, ninf, _CMP_EQ_OQ),
                                                            _mm512_setzero_ps());
                    corr[t] = vexp_avx512bf16(_mm512_sub_ps(mold, msafe));
                    __m512 sum = _mm512_setzero_ps();
                    for (int j = 0; j < 16; ++j) {
                        x[t][j] = vexp_avx512bf16(_mm512_sub_ps(x[t][j], msafe));
                        sum = _mm512_add_ps(sum, x[t][j]);
                    }
                    _mm512_storeu_ps(S->l + mb, _mm512_fmadd_ps(_mm512_loadu_ps(S->l + mb), corr[t], sum));
                    _mm512_storeu_ps(S->m + mb, mnew);
                }
                /* one product for the window: the first tile's weights carry the second
                 * tile's rescale, the accumulators both */
                __m512 ctot = corr[0];
                if (nt2 == 2) {
                    for (int j = 0; j < 16; ++j) x[0][j] = _mm512_mul_ps(x[0][j], corr[1]);
                    ctot = _mm512_mul_ps(corr[0], corr[1]);
                }
                float cr[16];
                _mm512_storeu_ps(cr, ctot);
                /* P's rows: each tile's 16 x 16 weights transposed, rounded to bf16 */
                for (int t = 0; t < 2; ++t) {
                    if (t == nt2) {
                        for (int i = 0; i < 16; ++i)
                            _mm256_storeu_si256((__m256i *)(void *)(pbuf + 32 * i + 16), _mm256_setzero_si256());
                        break;
                    }
                    __m512i pr[16];
                    for (int j = 0; j < 16; ++j) pr[j] = _mm512_castps_si512(x[t][j]);
                    avx512_transpose16(pr);
                    for (int i = 0; i < 16; ++i)
                        _mm256_storeu_si256((__m256i *)(void *)(pbuf + 32 * i + 16 * t),
                                            (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(pr[i])));
                }
                const int64_t nm = M - 16 * b < 16 ? M - 16 * b : 16;
                for (int64_t i = 0; i < nm; ++i)
                    if (cr[i] != 1.0f) {
                        float *a = S->acc + (mb + i) * Dp;
                        const __m512 cv = _mm512_set1_ps(cr[i]);
                        for (int64_t w = 0; w < W; ++w)
                            _mm512_storeu_ps(a + 16 * w, _mm512_mul_ps(_mm512_loadu_ps(a + 16 * w), cv));
                    }
                AMX_LOAD(3, pbuf, 64);
                for (int64_t w = 0; w < W; ++w) {
                    if (b == 0) /* the next one's V rows of this step */
                        for (int64_t j = w * rv; j < (w + 1) * rv && j < nv_; ++j) {
                            const int t = j >= nr_[0];
                            const char *vr = vn[t] + (j - (t ? nr_[0] : 0)) * vrow;
                            for (int64_t y = 0; y < D * 2; y += 64) _mm_prefetch(vr + y, _MM_HINT_T1);
                        }
                    float *a = S->acc + mb * Dp + 16 * w;
                    AMX_LOAD(5, a, Dp * 4);
                    AMX_LOAD(4, S->vp + 32 * w, W * 64);
                    _tile_dpbf16ps(5, 3, 4);
                    _tile_stored(5, a, Dp * 4);
                }
            }
        }
        pos = tl[nt2 - 1].end;
    }
    _tile_release();
    for (int64_t c = 0; c < C; ++c)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t m0 = c * Mp + r * G;
            scratch view = *S;
            view.acc = S->acc + m0 * Dp;
            view.m = S->m + m0;
            view.l = S->l + m0;
            for (int64_t g = 0; g < G; ++g) unpermute_avx512bf16(view.acc + g * Dp, D);
            finish_rows(P, P->rows[i0 + r], h0 + c * G, G, &view);
        }
}

#undef AMX_LOAD
