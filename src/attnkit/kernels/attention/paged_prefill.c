/*
 * attnkit CPU blocked prefill (plain C; built with paged_decode.c into one library by
 * cpu_native.py).
 *
 * Runs of query tokens attend the keys of their request: from the paged K/V planes
 * through the block table (logical position p of a request lives at physical row
 * block_table[b, p / bs] * bs + p % bs of the planes [R, Hkv, D]), or, for a request
 * whose `dense` flag is set (a fresh prompt, encoder-only attention: seq == qlen), from
 * the step's own key / value rows [T, Hkv, D] (position p at row query_start + p).
 * Query t of a request sits at qp = seq - qlen + t and sees [lo, qp + 1) when causal
 * (lo: 0, max(qp - window + 1, 0), or qp's chunk start) and [0, seq) otherwise.
 *
 * The compute (paged_prefill_body.h) is compiled once per instruction set, each copy in
 * its own target region, and the copy to run is picked at run time from what the CPU
 * reports (__builtin_cpu_supports), never from the build machine: AVX512-BF16 (native
 * bf16 dot products for bf16 scores), AVX-512, AVX2 + FMA, and the compiler's baseline.
 * ATTNKIT_CPU_ISA (avx512bf16, avx512, avx2, generic) caps the choice, for tests and
 * comparisons; attnkit_prefill_isa() names the copy in use.
 *
 * A quantised cache (kv_dtype: fp8 e4m3fn, fp8 e5m2, int8, as paged_decode.c) is
 * dequantised into float32 when a chunk is packed, so the compute never sees it.
 *
 * Every index value is checked in a serial pass before anything is computed or
 * written (the ATTNKIT_ERR_* codes of paged_decode.c).
 */

/* 64-byte vectors pass between inlined helpers only: no ABI crosses a target region */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#define PF_X86 1
#include <immintrin.h>
#else
#define PF_X86 0
#endif

#include "attnkit_abi.h"
#define INLINE static inline __attribute__((always_inline))

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

#define KT 32  /* keys per tile: two 16-float vectors */
#define KC 256 /* keys per packed chunk (a multiple of KT) */

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#if defined(__clang__)
#define SHUF16(x, ...) __builtin_shufflevector((x), (x), __VA_ARGS__)
#else
#define SHUF16(x, ...) __builtin_shuffle((x), (v16i){__VA_ARGS__})
#endif

/* ---- element conversions ---------------------------------------------------------- */

#include "half_float.h"

INLINE float elem_f32(const char *p, int64_t i, int dtype) {
    if (dtype == DT_F32) {
        float f;
        memcpy(&f, p + 4 * i, sizeof f);
        return f;
    }
    uint16_t h;
    memcpy(&h, p + 2 * i, sizeof h);
    return dtype == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* ---- parameters, tasks, scratch ---------------------------------------------------- */

typedef struct {
    int dtype;
    size_t es;
    int kv_dtype;    /* the planes' format: dtype, or an 8-bit KV_* one (half_float.h) */
    size_t kv_es;    /* bytes per plane element */
    int kv8;         /* 8-bit planes: read through lut, times a scale */
    const float *k_scale, *v_scale; /* [Hkv] static scales, or NULL: in each row */
    float lut[256];
    const char *q, *kp, *vp, *kd, *vd;
    char *o;
    int64_t q_st, q_sh, k_sr, k_sh, v_sr, v_sh, kd_sr, kd_sh, vd_sr, vd_sh, o_st, o_sh;
    const int32_t *bt;
    int64_t bt_sb, bs;
    const int32_t *req, *qs, *ql, *sl, *dense;
    int64_t Hq, Hkv, G, D, Dp, bq, sb; /* tokens per block, per task */
    int causal;
    int64_t window, chunk;
    float scale, cap;
    const float *alibi, *sinks;
    float *lse;
    int64_t lse_st, lse_sh;
    int pairs; /* bf16 scores as native bf16 dot products */
    int amx;   /* pairs on AMX tiles (paged_prefill_amx.h) */
} pparams;

typedef struct { /* one block of query tokens inside a task */
    int64_t t0, nb, rows, r0; /* first token (in the request), tokens, rows, first row */
    int64_t k_lo, k_hi;       /* keys some row sees: [k_lo, k_hi) */
    int64_t lo_max, hi_min;   /* keys every row sees: [lo_max, hi_min) */
    const int64_t *lo, *hi;   /* each token's visible keys */
    int ready;                /* the tiles' copy: its accumulators hold a product */
} pblock;

typedef struct { /* (request, K/V head, tokens [t0, t0 + nb)): blocks of bq tokens */
    int64_t i, h, h0, t0, nb, rows, nblocks;
    int64_t G, Dp, units, qp0; /* qp0: the request's first query position */
    int64_t k_lo, k_hi;
    int pairs;
    float scale, cap;
    const float *alibi;
} ptask;

typedef struct {
    uint32_t *q;  /* [rows][units]: float32 bits, or bf16 pairs */
    uint32_t *kt; /* [KC / KT][units][KT]: the chunk's K tiles, transposed */
    float *vt;    /* [KC][Dp] */
    float *s;     /* [bq * G][KT] ([KC] in the tiles' copy) */
    uint32_t *pw; /* [bq * G][KT / 2] ([KC / 2]): the weights as bf16 pairs (pairs only) */
    float *o;     /* [rows][Dp] */
    float *m, *l; /* [rows] */
    float *corr;  /* [bq * G] */
    int64_t *lo, *hi; /* [task tokens] */
    int64_t *krows;   /* [KC]: a chunk's key rows (the tiles' copy) */
    pblock *blocks;
    void *mem;
} scratch_pf;

static int scratch_pf_alloc(scratch_pf *S, const pparams *P) {
    /* rows rounded up to whole tiles of 16, plus one: the tiles' copy reads and computes
     * a block's last tile of rows whole */
    const int64_t rows = (P->sb * P->G + 15) / 16 * 16 + 16;
    const int64_t brows = (P->bq * P->G + 15) / 16 * 16, Dp = P->Dp, U = Dp;
    const int64_t nblk = (P->sb + P->bq - 1) / P->bq;
    size_t bytes = (size_t)(rows * U + KC * U + KC * Dp + brows * KC + brows * KC / 2 +
                            rows * Dp + 2 * rows + brows) * 4 +
                   (size_t)(2 * P->sb + KC) * 8 + (size_t)nblk * sizeof(pblock) + 16 * 64;
    void *mem = NULL;
    if (posix_memalign(&mem, 64, bytes) != 0) return 0;
    memset(mem, 0, bytes); /* pad columns stay zero */
    char *c = (char *)mem;
#define TAKE(ptr, type, count)                                              \
    do {                                                                    \
        (ptr) = (type *)c;                                                  \
        c += (((size_t)(count) * sizeof(type) + 63) / 64) * 64;             \
    } while (0)
    TAKE(S->q, uint32_t, rows * U);
    TAKE(S->kt, uint32_t, KC * U);
    TAKE(S->vt, float, KC * Dp);
    TAKE(S->s, float, brows * KC); /* the tiles' copy: a chunk's scores at once */
    TAKE(S->pw, uint32_t, brows * KC / 2);
    TAKE(S->o, float, rows * Dp);
    TAKE(S->m, float, rows);
    TAKE(S->l, float, rows);
    TAKE(S->corr, float, brows);
    TAKE(S->lo, int64_t, P->sb);
    TAKE(S->hi, int64_t, P->sb);
    TAKE(S->krows, int64_t, KC);
    TAKE(S->blocks, pblock, nblk);
#undef TAKE
    S->mem = mem;
    return 1;
}

/* The visible keys of query position qp of a request of length seq. */
INLINE void visible(const pparams *P, int64_t qp, int64_t seq, int64_t *lo, int64_t *hi) {
    if (!P->causal) {
        *lo = 0;
        *hi = seq;
        return;
    }
    int64_t l = 0;
    if (P->window > 0) l = qp - P->window + 1 > 0 ? qp - P->window + 1 : 0;
    else if (P->chunk > 0) l = qp / P->chunk * P->chunk;
    *lo = l;
    *hi = qp + 1;
}

/* Where key position pos of the task's request starts (K or V, in bytes). */
INLINE const char *key_row(const pparams *P, const ptask *T, int64_t pos, int value) {
    const int64_t h = T->h;
    if (P->dense[T->i]) {
        const int64_t row = P->qs[T->i] + pos;
        return value ? P->vd + (size_t)(row * P->vd_sr + h * P->vd_sh) * P->es
                     : P->kd + (size_t)(row * P->kd_sr + h * P->kd_sh) * P->es;
    }
    const int32_t *table = P->bt + (int64_t)P->req[T->i] * P->bt_sb;
    const int64_t row = (int64_t)table[pos / P->bs] * P->bs + pos % P->bs;
    return value ? P->vp + (size_t)(row * P->v_sr + h * P->v_sh) * P->kv_es
                 : P->kp + (size_t)(row * P->k_sr + h * P->k_sh) * P->kv_es;
}

/*
 * Prefetch (for reading, or writing: write 1) the G heads' rows of token t of the task in
 * the query-shaped tensor base (strides st, sh, element size es).  A task's tokens are
 * rows Hq heads apart, each in its own page: the hardware prefetchers do not follow
 * them, so load_query and finish_task ask PF_AHEAD tokens ahead.
 */
#define PF_AHEAD 4
INLINE void prefetch_token(const pparams *P, const ptask *T, const char *base, int64_t st,
                           int64_t sh, size_t es, int64_t t, int write) {
    if (t >= T->nb) return;
    const int64_t row = P->qs[T->i] + T->t0 + t;
    for (int64_t g = 0; g < P->G; ++g) {
        const char *p = base + (size_t)(row * st + (T->h0 + g) * sh) * es;
        for (size_t b = 0; b < (size_t)P->D * es; b += 64) {
            if (write) __builtin_prefetch(p + b, 1, 3);
            else __builtin_prefetch(p + b, 0, 3);
        }
    }
}

/* The task's query rows: float32 values, or the bf16 inputs' pairs as they are. */
static void load_query(const pparams *P, const ptask *T, scratch_pf *S) {
    const int64_t G = P->G, D = P->D, U = T->units;
    for (int64_t t = 0; t < PF_AHEAD; ++t) prefetch_token(P, T, P->q, P->q_st, P->q_sh, P->es, t, 0);
    for (int64_t t = 0; t < T->nb; ++t) {
        prefetch_token(P, T, P->q, P->q_st, P->q_sh, P->es, t + PF_AHEAD, 0);
        for (int64_t g = 0; g < G; ++g) {
            const int64_t row = P->qs[T->i] + T->t0 + t;
            const char *src = P->q + (size_t)(row * P->q_st + (T->h0 + g) * P->q_sh) * P->es;
            uint32_t *dst = S->q + (t * G + g) * U;
            if (T->pairs) {
                memcpy(dst, src, (size_t)D * 2);
            } else if (P->dtype == DT_F32) {
                memcpy(dst, src, (size_t)D * 4);
            } else {
                float *f = (float *)(void *)dst;
                if (P->dtype == DT_BF16)
                    for (int64_t d = 0; d < D; ++d) f[d] = elem_f32(src, d, DT_BF16);
                else
                    f16_row_to_f32(f, (const uint16_t *)(const void *)src, D, 1.0f);
            }
        }
    }
}

/*
 * Whether the value micro-kernel reads the tile of keys [a, a + n) in place: float32
 * rows of a whole number of vectors, consecutive (the step's own rows, or one block).
 */
INLINE int tile_direct(const pparams *P, const ptask *T, int64_t a, int64_t n) {
    return P->dtype == DT_F32 && P->D % 16 == 0 &&
           (P->dense[T->i] || (P->kv_dtype == DT_F32 && a / P->bs == (a + n - 1) / P->bs));
}

/* Keys [c0, c1) of the task: K transposed into tiles of KT columns, V row-major (but for
 * the tiles read in place); 8-bit plane rows dequantised. */
static void pack_chunk(const pparams *P, const ptask *T, scratch_pf *S, int64_t c0, int64_t c1) {
    const int64_t D = P->D, Dp = P->Dp, U = T->units;
    const int q8 = P->kv8 && !P->dense[T->i];
    for (int64_t x = 0; x < c1 - c0; ++x) {
        const char *k = key_row(P, T, c0 + x, 0);
        const char *v = key_row(P, T, c0 + x, 1);
        const int64_t a = c0 + x / KT * KT, n = c1 - a < KT ? c1 - a : KT;
        const int direct = tile_direct(P, T, a, n);
        uint32_t *kt = S->kt + (x / KT) * U * KT + x % KT;
        if (q8) {
            const float sk = P->k_scale ? P->k_scale[T->h] : row_scale(k, D);
            const float sv = P->v_scale ? P->v_scale[T->h] : row_scale(v, D);
            const uint8_t *kb = (const uint8_t *)k, *vb = (const uint8_t *)v;
            for (int64_t d = 0; d < D; ++d) {
                const float f = P->lut[kb[d]] * sk;
                memcpy(kt + d * KT, &f, sizeof f);
            }
            dequant_row(S->vt + x * Dp, vb, D, P->kv_dtype, sv, P->lut);
            continue;
        }
        if (T->pairs) {
            uint32_t w[256];
            for (int64_t u0 = 0; u0 < D / 2; u0 += 256) {
                const int64_t m = D / 2 - u0 < 256 ? D / 2 - u0 : 256;
                memcpy(w, k + 4 * u0, (size_t)m * 4);
                for (int64_t u = 0; u < m; ++u) kt[(u0 + u) * KT] = w[u];
            }
        } else if (P->dtype == DT_F32) {
            const uint32_t *w = (const uint32_t *)(const void *)k;
            for (int64_t d = 0; d < D; ++d) kt[d * KT] = w[d];
        } else if (P->dtype == DT_F16) { /* converted as a row, then transposed */
            float f[512];
            for (int64_t d0 = 0; d0 < D; d0 += 512) {
                const int64_t m = D - d0 < 512 ? D - d0 : 512;
                f16_row_to_f32(f, (const uint16_t *)(const void *)k + d0, m, 1.0f);
                for (int64_t d = 0; d < m; ++d) memcpy(kt + (d0 + d) * KT, f + d, sizeof(float));
            }
        } else {
            for (int64_t d = 0; d < D; ++d) {
                const float f = elem_f32(k, d, P->dtype);
                memcpy(kt + d * KT, &f, sizeof f);
            }
        }
        if (T->pairs) { /* V as pairs of keys: x even fills the low halves, x odd the high */
            uint16_t *v2 = (uint16_t *)(void *)S->vt + (x / 2) * Dp * 2 + (x % 2);
            const uint16_t *vs = (const uint16_t *)(const void *)v;
            for (int64_t d = 0; d < D; ++d) v2[2 * d] = vs[d];
            if (x % 2 == 0 && c0 + x + 1 == c1) /* no partner key: a zero weight's value */
                for (int64_t d = 0; d < D; ++d) v2[2 * d + 1] = 0;
            continue;
        }
        float *vr = S->vt + x * Dp;
        if (direct) continue;
        if (P->dtype == DT_F32) memcpy(vr, v, (size_t)D * 4);
        else if (P->dtype == DT_BF16)
            for (int64_t d = 0; d < D; ++d) vr[d] = elem_f32(v, d, DT_BF16);
        else
            f16_row_to_f32(vr, (const uint16_t *)(const void *)v, D, 1.0f);
    }
}

/*
 * Row r of the task: the factor its accumulator is multiplied by on the way out (1 / its
 * sum, a sink logit joining the sum), its lse written when asked; *dst: where its D
 * values go.  Rows are asked in order: the output rows of later tokens are prefetched.
 */
INLINE float finish_factor(const pparams *P, const ptask *T, const scratch_pf *S, int64_t r,
                           char **dst) {
    const int64_t t = r / P->G, head = T->h0 + r % P->G;
    if (r == 0) /* the output rows of the first tokens, then one token ahead at each */
        for (int64_t x = 0; x < PF_AHEAD; ++x) prefetch_token(P, T, P->o, P->o_st, P->o_sh, P->es, x, 1);
    if (r % P->G == 0) prefetch_token(P, T, P->o, P->o_st, P->o_sh, P->es, t + PF_AHEAD, 1);
    const int64_t row = P->qs[T->i] + T->t0 + t;
    float m = S->m[r], l = S->l[r], keep = 1.0f;
    if (P->sinks) {
        const float sink = P->sinks[head];
        const float mn = sink > m ? sink : m;
        keep = m == -INFINITY ? 0.0f : expf(m - mn);
        l = l * keep + expf(sink - mn);
        m = mn;
    }
    if (P->lse) P->lse[row * P->lse_st + head * P->lse_sh] = l > 0.0f ? m + logf(l) : -INFINITY;
    *dst = P->o + (size_t)(row * P->o_st + head * P->o_sh) * P->es;
    return l > 0.0f ? keep / l : 0.0f;
}

/* The accumulators divided by their sums (a sink logit joins the sum), written out. */
static void finish_task(const pparams *P, const ptask *T, scratch_pf *S) {
    const int64_t D = P->D, Dp = P->Dp;
    for (int64_t r = 0; r < T->rows; ++r) {
        char *dst;
        const float mul = finish_factor(P, T, S, r, &dst);
        const float *acc = S->o + r * Dp;
        if (P->dtype == DT_F32) {
            float *o = (float *)dst;
            for (int64_t d = 0; d < D; ++d) o[d] = acc[d] * mul;
        } else if (P->dtype == DT_BF16) { /* one loop per dtype: the compiler vectorises it */
            uint16_t *o = (uint16_t *)dst;
            for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(acc[d] * mul);
        } else {
            uint16_t *o = (uint16_t *)dst;
            for (int64_t d = 0; d < D; ++d) o[d] = f32_to_f16(acc[d] * mul);
        }
    }
}

/* The task's blocks and key ranges, from its request and first token. */
static void setup_task(const pparams *P, ptask *T, scratch_pf *S) {
    const int64_t ql = P->ql[T->i], seq = P->sl[T->i];
    T->nb = ql - T->t0 < P->sb ? ql - T->t0 : P->sb;
    T->G = P->G;
    T->h0 = T->h * P->G;
    T->rows = T->nb * P->G;
    T->Dp = P->Dp;
    T->pairs = P->pairs;
    T->units = P->pairs ? P->Dp / 2 : P->Dp;
    T->qp0 = seq - ql;
    T->scale = P->scale;
    T->cap = P->cap;
    T->alibi = P->alibi;
    T->k_lo = INT64_MAX;
    T->k_hi = 0;
    T->nblocks = (T->nb + P->bq - 1) / P->bq;
    for (int64_t bi = 0; bi < T->nblocks; ++bi) {
        pblock *b = &S->blocks[bi];
        b->t0 = T->t0 + bi * P->bq;
        b->nb = T->nb - bi * P->bq < P->bq ? T->nb - bi * P->bq : P->bq;
        b->rows = b->nb * P->G;
        b->r0 = bi * P->bq * P->G;
        b->lo = S->lo + bi * P->bq;
        b->hi = S->hi + bi * P->bq;
        b->k_lo = INT64_MAX;
        b->k_hi = 0;
        b->lo_max = 0;
        b->hi_min = INT64_MAX;
        for (int64_t x = 0; x < b->nb; ++x) {
            int64_t lo, hi;
            visible(P, T->qp0 + b->t0 + x, seq, &lo, &hi);
            S->lo[bi * P->bq + x] = lo;
            S->hi[bi * P->bq + x] = hi;
            if (lo < b->k_lo) b->k_lo = lo;
            if (hi > b->k_hi) b->k_hi = hi;
            if (lo > b->lo_max) b->lo_max = lo;
            if (hi < b->hi_min) b->hi_min = hi;
        }
        if (b->k_lo > b->k_hi) b->k_lo = b->k_hi;
        if (b->k_lo < T->k_lo) T->k_lo = b->k_lo;
        if (b->k_hi > T->k_hi) T->k_hi = b->k_hi;
    }
    if (T->k_lo > T->k_hi) T->k_lo = T->k_hi;
}

/* ---- the compute, once per instruction set ------------------------------------------ */

#define PF_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define PF_TARGET_BEGIN(t) PF_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define PF_TARGET_END PF_PRAGMA(clang attribute pop)
#else
#define PF_TARGET_BEGIN(t) PF_PRAGMA(GCC push_options) PF_PRAGMA(GCC target(t))
#define PF_TARGET_END PF_PRAGMA(GCC pop_options)
#endif

typedef void (*pf_run_fn)(const pparams *, ptask *, scratch_pf *);

#define SFX generic
#define QK_ROWS 2
#define PV_ROWS 1
#define BF16DOT 0
#define PKEEP(x) ((void)0)
#include "paged_prefill_body.h"
#undef SFX
#undef QK_ROWS
#undef PV_ROWS
#undef BF16DOT
#undef PKEEP

#if PF_X86
PF_TARGET_BEGIN("avx2,fma,f16c")
#define SFX avx2
#define QK_ROWS 3
#define PV_ROWS 1
#define BF16DOT 0
#define PKEEP(x) ((void)0)
#include "paged_prefill_body.h"
#undef SFX
#undef QK_ROWS
#undef PV_ROWS
#undef BF16DOT
#undef PKEEP
PF_TARGET_END

PF_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define SFX avx512
#define QK_ROWS 12
#define PV_ROWS 6
#define BF16DOT 0
#define PKEEP(x) __asm__("" : "+v"(x))
#include "paged_prefill_body.h"
#undef SFX
#undef QK_ROWS
#undef PV_ROWS
#undef BF16DOT
#undef PKEEP
PF_TARGET_END

PF_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#define SFX avx512bf16
#define QK_ROWS 12
#define PV_ROWS 6
#define BF16DOT 1
#define PKEEP(x) __asm__("" : "+v"(x))
#include "paged_prefill_body.h"
#undef SFX
#undef QK_ROWS
#undef PV_ROWS
#undef BF16DOT
#undef PKEEP
PF_TARGET_END

#if defined(__x86_64__)
#define PF_AMX 1
PF_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
#include "paged_prefill_amx.h"
PF_TARGET_END
#else
#define PF_AMX 0
#endif
#else
#define PF_AMX 0
#endif

/* Whether AMX-BF16 tiles are usable in this process (paged_decode.c asks the CPU and the
 * OS once). */
__attribute__((visibility("hidden"))) int attnkit_amx_granted(void);

/* ---- run-time choice of the copy --------------------------------------------------- */

typedef struct {
    const char *name;
    pf_run_fn run;
    int bf16dot;
} pf_isa;

static const pf_isa PF_ISAS[] = {
#if PF_AMX
    {"amxbf16", run_amxbf16, 1},
#endif
#if PF_X86
    {"avx512bf16", run_avx512bf16, 1},
    {"avx512", run_avx512, 0},
    {"avx2", run_avx2, 0},
#endif
    {"generic", run_generic, 0},
};
#define PF_NUM_ISAS ((int)(sizeof PF_ISAS / sizeof PF_ISAS[0]))

static int pf_supported(const char *name) {
#if PF_X86
    __builtin_cpu_init();
    if (!strcmp(name, "amxbf16")) return pf_supported("avx512bf16") && attnkit_amx_granted();
    if (!strcmp(name, "avx512bf16"))
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma");
    if (!strcmp(name, "avx512"))
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("fma");
    if (!strcmp(name, "avx2"))
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
#endif
    return !strcmp(name, "generic");
}

/* The best copy this CPU runs, no better than ATTNKIT_CPU_ISA when that names one. */
static const pf_isa *pf_pick(void) {
    const char *cap = getenv("ATTNKIT_CPU_ISA");
    int first = 0;
    if (cap && *cap)
        for (int i = 0; i < PF_NUM_ISAS; ++i)
            if (!strcmp(cap, PF_ISAS[i].name)) first = i;
    for (int i = first; i < PF_NUM_ISAS; ++i)
        if (pf_supported(PF_ISAS[i].name)) return &PF_ISAS[i];
    return &PF_ISAS[PF_NUM_ISAS - 1];
}

/* The copy in use (read at each call: ATTNKIT_CPU_ISA may change between calls). */
ATTNKIT_API const char *attnkit_prefill_isa(void) { return pf_pick()->name; }

/* ---- entry point ------------------------------------------------------------------- */

/*
 * Returns 0 or an error code; on an error err[0] is the request (its index in the
 * request arrays), err[1] the offending value and err[2] a position (the block_table
 * column for ATTNKIT_ERR_BLOCK).  Strides are in elements.  key / value (the dense readers'
 * rows) may be NULL when no request is dense; k_plane, v_plane and block_table may be
 * NULL when every request is.  query_block: tokens per task (<= 0: chosen here).
 * kv_dtype, k_scale, v_scale: the planes' format, as attnkit_paged_decode's (the dense
 * readers' key / value rows always have dtype).
 */
ATTNKIT_API int attnkit_paged_prefill(ATTNKIT_PARAMS(ATTNKIT_PAGED_PREFILL_ARGS)) {
    err[0] = err[1] = err[2] = -1;
    if (dtype < DT_F32 || dtype > DT_F16 || Hkv <= 0 || Hq <= 0 || Hq % Hkv != 0 || D <= 0 ||
        block_size <= 0 || n < 0 || B < 0 || W < 0 || R < 0 || T < 0)
        return ATTNKIT_ERR_ARGS;
    const int kv8 = kv_dtype >= KV_FP8_E4M3 && kv_dtype <= KV_INT8;
    if ((kv_dtype != dtype && !kv8) || (!kv8 && (k_scale || v_scale)) ||
        (k_scale == NULL) != (v_scale == NULL))
        return ATTNKIT_ERR_ARGS;
    const int64_t num_blocks = R / block_size;
    pparams P;
    P.causal = causal;
    P.window = window;
    P.chunk = chunk;
    for (int64_t i = 0; i < n; ++i) {
        err[0] = i;
        const int64_t qs = query_start[i], ql = query_len[i], seq = seq_len[i];
        if (qs < 0 || ql < 0 || qs + ql > T) { err[1] = qs; err[2] = ql; return ATTNKIT_ERR_QSL; }
        if (seq < 0 || (causal && seq < ql)) { err[1] = seq; err[2] = ql; return ATTNKIT_ERR_SEQ; }
        if (ql == 0 || seq == 0) continue;
        int64_t lo, hi;
        visible(&P, seq - ql, seq, &lo, &hi);
        if (dense[i]) {
            if (seq != ql || key == NULL || value == NULL) { err[1] = seq; err[2] = ql; return ATTNKIT_ERR_SEQ; }
            continue;
        }
        const int64_t b = requests[i];
        if (block_table == NULL || b < 0 || b >= B) { err[1] = b; return ATTNKIT_ERR_REQUEST; }
        if (seq > W * block_size) { err[1] = seq; return ATTNKIT_ERR_KEY_END; }
        const int32_t *table = block_table + b * bt_sb;
        for (int64_t c = lo / block_size; c <= (seq - 1) / block_size; ++c) {
            const int64_t blk = table[c];
            if (blk < 0 || blk >= num_blocks) { err[1] = blk; err[2] = c; return ATTNKIT_ERR_BLOCK; }
        }
    }
    err[0] = err[1] = err[2] = -1;

    const pf_isa *isa = pf_pick();
    P.dtype = dtype;
    P.es = dtype == DT_F32 ? 4 : 2;
    P.kv_dtype = kv_dtype;
    P.kv8 = kv8;
    P.kv_es = kv8 ? 1 : P.es;
    P.k_scale = k_scale;
    P.v_scale = v_scale;
    if (kv8) fill_byte_table(P.lut, kv_dtype);
    P.q = (const char *)query;
    P.kp = (const char *)k_plane;
    P.vp = (const char *)v_plane;
    P.kd = (const char *)key;
    P.vd = (const char *)value;
    P.o = (char *)output;
    P.q_st = q_st; P.q_sh = q_sh;
    P.k_sr = k_sr; P.k_sh = k_sh; P.v_sr = v_sr; P.v_sh = v_sh;
    P.kd_sr = kd_sr; P.kd_sh = kd_sh; P.vd_sr = vd_sr; P.vd_sh = vd_sh;
    P.o_st = o_st; P.o_sh = o_sh;
    P.bt = block_table; P.bt_sb = bt_sb; P.bs = block_size;
    P.req = requests; P.qs = query_start; P.ql = query_len; P.sl = seq_len; P.dense = dense;
    P.Hq = Hq; P.Hkv = Hkv; P.G = Hq / Hkv; P.D = D;
    P.pairs = isa->bf16dot && dtype == DT_BF16 && kv_dtype == dtype && D % 2 == 0;
#if PF_AMX
    /* the tiles' copy: bf16 pairs of whole 16-column strips, dims padded to 32 */
    P.amx = P.pairs && isa->run == run_amxbf16 && D % 16 == 0;
#else
    P.amx = 0;
#endif
    P.Dp = P.amx ? (D + 31) / 32 * 32 : (D + 15) / 16 * 16;
    /* about 48 rows (tokens x grouped heads) per block: the micro-kernels' row blocks
     * (the tiles' copy: lcm(G, 32) rows, whole pairs of 16-row tiles, where that takes
     * at most 128, else 16 at most); about 256 rows per task (the tiles' copy: 1024),
     * whose key chunks are packed once for all its blocks */
    int64_t bq = (48 + P.G - 1) / P.G;
    if (P.amx) {
        int64_t g = P.G, t = 16;
        while (t) { const int64_t x = g % t; g = t; t = x; } /* gcd(G, 16) */
        bq = 32 / g; /* two tiles of rows: the products take them in pairs */
        if (bq * P.G > 128) bq = P.G < 16 ? 16 / P.G : 1;
    }
    if (query_block > 0) bq = query_block;
    if (bq < 1) bq = 1;
    /* the tiles' copy computes so fast that packing a chunk pays off over more rows */
    const int64_t task_rows = P.amx ? 1024 : 256;
    int64_t sb = (task_rows / P.G + bq - 1) / bq * bq;
    if (sb < bq) sb = bq;
    P.bq = bq;
    P.sb = sb;
    P.cap = soft_cap > 0.0f ? soft_cap : 0.0f;
    P.scale = P.cap > 0.0f ? scale / P.cap : scale;
    P.alibi = alibi;
    P.sinks = sinks;
    P.lse = lse;
    P.lse_st = lse_st;
    P.lse_sh = lse_sh;

    /* Tasks: (request, K/V head, sb tokens), each request's last tokens first so the
     * longest causal rows start first. */
    int64_t groups = 0;
    for (int64_t i = 0; i < n; ++i) groups += (query_len[i] + sb - 1) / sb;
    if (groups == 0) return ATTNKIT_OK;
    int64_t *tl = (int64_t *)malloc((size_t)groups * 2 * sizeof(int64_t));
    if (!tl) return ATTNKIT_ERR_NOMEM;
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t b = (query_len[i] + sb - 1) / sb - 1; b >= 0; --b, ++m) {
            tl[2 * m] = i;
            tl[2 * m + 1] = b * sb;
        }
    const int64_t tasks = groups * Hkv;
    int failed = 0;

#define PF_TASK(task, S)                                                                     \
    do {                                                                                     \
        ptask t_;                                                                            \
        const int64_t grp_ = (task) / Hkv;                                                   \
        t_.i = tl[2 * grp_];                                                                 \
        t_.t0 = tl[2 * grp_ + 1];                                                            \
        t_.h = (task) % Hkv;                                                                 \
        setup_task(&P, &t_, &(S));                                                           \
        isa->run(&P, &t_, &(S));                                                             \
    } while (0)

    if (num_threads <= 1 || tasks == 1) {
        scratch_pf S;
        if (!scratch_pf_alloc(&S, &P)) { free(tl); return ATTNKIT_ERR_NOMEM; }
        for (int64_t t = 0; t < tasks; ++t) PF_TASK(t, S);
        free(S.mem);
        free(tl);
        return ATTNKIT_OK;
    }
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        scratch_pf S;
        const int ok = scratch_pf_alloc(&S, &P);
        if (!ok) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t)
            if (ok) PF_TASK(t, S);
        if (ok) free(S.mem);
    }
    if (failed) { /* a thread without scratch skipped its tasks: redo all on this one */
        scratch_pf S;
        if (!scratch_pf_alloc(&S, &P)) { free(tl); return ATTNKIT_ERR_NOMEM; }
        for (int64_t t = 0; t < tasks; ++t) PF_TASK(t, S);
        free(S.mem);
    }
#undef PF_TASK
    free(tl);
    return ATTNKIT_OK;
}
