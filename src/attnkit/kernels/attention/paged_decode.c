/*
 * attnkit CPU paged-decode kernel (plain C; prebuilt by setup.py or compiled at first use,
 * see cpu_native.py; the exported functions and error codes are in attnkit_abi.h).
 *
 * Each work item attends one query row (all Hq heads) over the keys at logical
 * positions [key_start, key_end) of one request, reading K and V in place through the
 * block table: logical position p of request b lives at physical row
 * block_table[b, p / bs] * bs + p % bs of the planes [R, Hkv, D].
 *
 * Work is split over (work item, kv head) pairs.  One pair loads its G = Hq / Hkv query
 * heads once (scaled, float32), walks the keys in tiles of at most TILE keys that never
 * cross a block (so a tile's rows are consecutive physical rows), computes the G x tile
 * scores, updates an online softmax (running max m, running sum l, rescale factor) and
 * accumulates V into a float32 G x D accumulator.
 *
 * Every index value (rows, requests, key ranges, the physical blocks a range touches) is
 * checked in a serial pass before anything is computed or written; a bad value returns a
 * nonzero code and fills err[] (see the ATTNKIT_ERR_* codes) instead of reading out of
 * bounds.
 *
 * A quantised cache (kv_dtype: fp8 e4m3fn, fp8 e5m2, int8; the query and output keep
 * dtype) is dequantised once per tile into the float32 tile buffers: each stored byte's
 * exact float32 value (a 256-entry table) times its scale, a static one per K/V head
 * (k_scale, v_scale [Hkv]) or the float32 written after each head's D values in its row
 * (per-token-head caches: rows of Hkv x (D + 4) bytes).
 *
 * Vectors are GCC/Clang vector extensions (8 x float), which the compiler lowers to AVX
 * on x86-64 and to pairs of NEON registers on AArch64.
 */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attnkit_abi.h"
#define INLINE static inline __attribute__((always_inline))

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };


#define TILE 16
/* keys per tile, at most (a tile never crosses a block) */
#define FTILE 64 /* the same for the 16-lane copies (paged_decode_body.h) */
/* Work items of one request with one interval of keys that a task may take together
 * (plan_groups; the 16-lane copy computes them as one matrix, run_task one by one). */
#define GROUP_ROWS 8
/* A group's keys: at most this many more than its shortest row sees. */
#define GROUP_SLACK 32

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));

INLINE v8f ld8(const float *p) {
    v8f r;
    memcpy(&r, p, sizeof r);
    return r;
}

INLINE void st8(float *p, v8f x) { memcpy(p, &x, sizeof x); }

/*
 * Keep a loaded vector in a register: without this GCC folds the load into every FMA that
 * uses it (one load per use), and the micro-kernels become bound by load ports instead of
 * FMA units.  An empty asm the value passes through is opaque to that folding.
 */
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define KEEP(x) __asm__("" : "+x"(x))
#elif defined(__GNUC__) && defined(__aarch64__)
#define KEEP(x) __asm__("" : "+w"(x))
#else
#define KEEP(x) ((void)0)
#endif
/* The same for the 8-lane copy, whose v8f needs one 32-byte register: none below AVX
 * (a portable x86-64 build lowers v8f to SSE pairs), so nothing to keep there. */
#if defined(__GNUC__) && defined(__x86_64__) && !defined(__AVX__)
#define KEEP8(x) ((void)0)
#else
#define KEEP8(x) KEEP(x)
#endif

INLINE v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

INLINE float hsum8(v8f x) {
    float a = (x[0] + x[4]) + (x[2] + x[6]);
    float b = (x[1] + x[5]) + (x[3] + x[7]);
    return a + b;
}

#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector((a), (b), __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle((a), (b), (v8i){__VA_ARGS__})
#endif

/*
 * The 8 horizontal sums of x[0..7] as one vector: r[i] = sum of x[i]'s lanes.  Pairwise
 * interleaves and adds (lanes 0..3 and 4..7 are reduced separately, then combined), so it
 * costs 14 shuffles and 7 adds for 8 sums instead of a full reduction each.
 */
INLINE v8f reduce8(const v8f x[8]) {
    v8f u[2];
    for (int g = 0; g < 2; ++g) {
        const v8f *a = x + 4 * g;
        /* t0 = [a0_02 a1_02 a0_13 a1_13 | a0_46 a1_46 a0_57 a1_57] */
        v8f t0 = SHUF(a[0], a[1], 0, 8, 1, 9, 4, 12, 5, 13) + SHUF(a[0], a[1], 2, 10, 3, 11, 6, 14, 7, 15);
        v8f t1 = SHUF(a[2], a[3], 0, 8, 1, 9, 4, 12, 5, 13) + SHUF(a[2], a[3], 2, 10, 3, 11, 6, 14, 7, 15);
        /* u = [a0 a1 a2 a3 (lanes 0..3) | a0 a1 a2 a3 (lanes 4..7)] */
        u[g] = SHUF(t0, t1, 0, 1, 8, 9, 4, 5, 12, 13) + SHUF(t0, t1, 2, 3, 10, 11, 6, 7, 14, 15);
    }
    return SHUF(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) + SHUF(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

INLINE float hmax8(v8f x) {
    float r = x[0];
    for (int i = 1; i < 8; ++i) r = x[i] > r ? x[i] : r;
    return r;
}

/*
 * exp(x) for 8 lanes, x <= 0 in our use (scores minus their running max).  Range
 * reduction x = n ln2 + r with |r| <= ln2 / 2, n rounded by adding and subtracting
 * 1.5 * 2^23 (exact in round-to-nearest, which this file never changes), ln2 split in a
 * high part with few significant bits and a low remainder so n * ln2_hi is exact, then a
 * degree-6 Taylor polynomial of exp(r) (truncation error below r^7 / 7! < 1.3e-7 for
 * |r| <= 0.347) and a scale by 2^n built in the exponent bits.  Inputs below -87 (where
 * exp underflows float's normal range) give exactly 0, -inf included; NaN stays NaN.
 * Inputs above 0 are not expected (no overflow handling).
 */
INLINE v8f vexp(v8f x) {
    const float lo_limit = -87.0f;
    v8i tiny = x < splat8(lo_limit);
    v8f xc = (v8f)(((v8i)x & ~tiny) | ((v8i)splat8(lo_limit) & tiny));
    const v8f magic = splat8(12582912.0f); /* 1.5 * 2^23 */
    v8f t = xc * splat8(1.44269504088896341f) + magic;
    v8f n = t - magic;
    v8i ni = (v8i)t - (v8i)magic; /* the integer n, from the low mantissa bits */
    v8f r = xc - n * splat8(0.693359375f);
    r = r - n * splat8(-2.12194440e-4f);
    v8f p = splat8(1.0f / 720.0f);
    p = p * r + splat8(1.0f / 120.0f);
    p = p * r + splat8(1.0f / 24.0f);
    p = p * r + splat8(1.0f / 6.0f);
    p = p * r + splat8(0.5f);
    p = p * r + splat8(1.0f);
    p = p * r + splat8(1.0f);
    v8f scale2n = (v8f)((ni + 127) << 23);
    v8f res = p * scale2n;
    return (v8f)((v8i)res & ~tiny);
}

/* ---- element conversions ---------------------------------------------------------- */

#include "half_float.h"


/* src row of D elements of `dtype` -> dst (float), scaled; pad columns untouched. */
static void load_row(float *restrict dst, const void *src, int dtype, int64_t D, float scale) {
    if (dtype == DT_F32) {
        const float *s = (const float *)src;
        for (int64_t d = 0; d < D; ++d) dst[d] = s[d] * scale;
    } else if (dtype == DT_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t d = 0; d < D; ++d) dst[d] = bf16_to_f32(s[d]) * scale;
    } else {
        f16_row_to_f32(dst, (const uint16_t *)src, D, scale);
    }
}

static void store_row(void *dst, const float *restrict src, int dtype, int64_t D, float mul) {
    if (dtype == DT_F32) {
        float *o = (float *)dst;
        for (int64_t d = 0; d < D; ++d) o[d] = src[d] * mul;
    } else if (dtype == DT_BF16) {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t d = 0; d < D; ++d) o[d] = f32_to_bf16(src[d] * mul);
    } else {
        uint16_t *o = (uint16_t *)dst;
        for (int64_t d = 0; d < D; ++d) o[d] = f32_to_f16(src[d] * mul);
    }
}

/* ---- micro-kernels ----------------------------------------------------------------- */

/*
 * Scores of HB query heads (rows of q, stride Dp) against KB keys (rows of k, stride ks):
 * s[h * TILE + j] = q[h] . k[j].  HB x KB independent accumulators, Dp % 16 == 0.
 */
INLINE void score_kernel(const int HB, const int KB, const float *restrict q, int64_t Dp,
                         const float *restrict k, int64_t ks, float *restrict s) {
    v8f a[4][4]; /* fixed sizes (HB, KB <= 4) so the compiler keeps them in registers */
    for (int h = 0; h < HB; ++h)
        for (int j = 0; j < KB; ++j) a[h][j] = splat8(0.0f);
    for (int64_t d = 0; d < Dp; d += 8) {
        v8f kv[4];
        for (int j = 0; j < KB; ++j) {
            kv[j] = ld8(k + j * ks + d);
            KEEP8(kv[j]);
        }
        for (int h = 0; h < HB; ++h) {
            v8f qv = ld8(q + h * Dp + d);
            KEEP8(qv);
            for (int j = 0; j < KB; ++j) a[h][j] += qv * kv[j];
        }
    }
    v8f x[16];
    for (int i = 0; i < 16; ++i) x[i] = splat8(0.0f);
    for (int h = 0; h < HB; ++h)
        for (int j = 0; j < KB; ++j) x[h * KB + j] = a[h][j];
    v8f r[2];
    r[0] = reduce8(x);
    if (HB * KB > 8) r[1] = reduce8(x + 8);
    for (int h = 0; h < HB; ++h)
        for (int j = 0; j < KB; ++j) s[h * TILE + j] = r[(h * KB + j) / 8][(h * KB + j) % 8];
}

/* Scores of HB heads against the n keys of a tile. */
INLINE void score_heads(const int HB, const int KB, const float *restrict q, int64_t Dp,
                        const float *restrict k, int64_t ks, int64_t n, float *restrict s) {
    int64_t j = 0;
    for (; j + KB <= n; j += KB) score_kernel(HB, KB, q, Dp, k + j * ks, ks, s + j);
    for (; j < n; ++j) score_kernel(HB, 1, q, Dp, k + j * ks, ks, s + j);
}

/*
 * acc[h] = acc[h] * corr[h] + sum_j p[h * TILE + j] * v[j] for HB heads, 16 columns at a
 * time (HB x 2 accumulators live across the keys).
 */
INLINE void vacc_heads(const int HB, const float *restrict p, const float *restrict corr,
                       const float *restrict v, int64_t vs, int64_t n, float *restrict acc,
                       int64_t Dp) {
    for (int64_t d = 0; d < Dp; d += 16) {
        v8f a[4][2];
        for (int h = 0; h < HB; ++h) {
            v8f c = splat8(corr[h]);
            a[h][0] = ld8(acc + h * Dp + d) * c;
            a[h][1] = ld8(acc + h * Dp + d + 8) * c;
        }
        for (int64_t j = 0; j < n; ++j) {
            v8f v0 = ld8(v + j * vs + d);
            v8f v1 = ld8(v + j * vs + d + 8);
            KEEP8(v0);
            KEEP8(v1);
            for (int h = 0; h < HB; ++h) {
                v8f w = splat8(p[h * TILE + j]);
                a[h][0] += w * v0;
                a[h][1] += w * v1;
            }
        }
        for (int h = 0; h < HB; ++h) {
            st8(acc + h * Dp + d, a[h][0]);
            st8(acc + h * Dp + d + 8, a[h][1]);
        }
    }
}

static void vacc_tile(int64_t G, const float *restrict p, const float *restrict corr,
                      const float *restrict v, int64_t vs, int64_t n, float *restrict acc, int64_t Dp) {
    int64_t h = 0;
    for (; h + 4 <= G; h += 4) vacc_heads(4, p + h * TILE, corr + h, v, vs, n, acc + h * Dp, Dp);
    for (; h + 2 <= G; h += 2) vacc_heads(2, p + h * TILE, corr + h, v, vs, n, acc + h * Dp, Dp);
    for (; h < G; ++h) vacc_heads(1, p + h * TILE, corr + h, v, vs, n, acc + h * Dp, Dp);
}


/* ---- one work item over a range of kv heads --------------------------------------- */

typedef struct {
    int dtype;
    size_t esize;
    int kv_dtype;    /* dtype, or a KV_* 8-bit format (half_float.h) */
    size_t kv_esize; /* bytes per K/V element */
    int kv8;         /* kv_dtype is an 8-bit format: read through lut, times a scale */
    const float *k_scale, *v_scale; /* [Hkv] static scales, or NULL: in each row */
    float lut[256];  /* kv8: each byte's float32 value */
    const char *q, *k, *v;
    char *o;
    int64_t q_st, q_sh, k_sr, k_sh, v_sr, v_sh, o_st, o_sh; /* element strides */
    const int32_t *bt;
    int64_t bt_sb;
    const int64_t *rows;
    const int32_t *req, *ks, *ke, *qp;
    int64_t Hq, Hkv, G, D, Dp, bs;
    int64_t kv_chunk; /* kv heads per task */
    int64_t pm, pa; /* ALiBi's key position of logical position p: p * pm + pa */
    float scale, cap;
    const float *alibi;
    const float *sinks; /* [Hq] sink logits, or NULL */
    float *lse;         /* log-sum-exp out, [row * lse_st + h * lse_sh], or NULL */
    int64_t lse_st, lse_sh;
    int direct; /* fp32 with D % 16 == 0: K is read in place */
} params;

typedef struct {
    float *q;    /* [C * G, Dp] scaled query heads (C = kv heads of the task) */
    float *acc;  /* [C * G, Dp] */
    float *s;    /* [C * G, TILE] scores, then probabilities */
    float *m, *l, *corr; /* [C * G] */
    float *kbuf; /* [C, TILE, Dp] K tile as float32 (only when not direct) */
    float *vbuf; /* [C, TILE, Dp] V tile as float32 (only when not direct) */
    /* the 16-lane copy's, for a group's rows (H counts every row's heads): */
    float *lv;    /* [H, 16] running sums per lane */
    uint16_t *pb; /* [H, 16] a tile's probabilities, bf16 */
    uint32_t *kt; /* [Dp / 2, 16] a K tile transposed, bf16 pairs */
    uint16_t *vp; /* [8, Dp, 2] a V tile in key pairs */
    void *mem;
} scratch;

/* Scratch for tasks of C kv heads and up to `rows` work items. */
static int scratch_alloc(scratch *S, int64_t C, int64_t G, int64_t Dp, int bufs, int64_t rows) {
    /* rows > 1: each kv head's rows padded to a multiple of 16 (the AMX copy's blocks) */
    const int64_t H = rows * C * G + (rows > 1 ? 16 * C : 0);
    size_t floats = (size_t)(2 * H * Dp + H * FTILE + 3 * H + (bufs ? 2 * C * TILE * Dp : 0)) +
                    (size_t)(rows > 1 ? 32 * H + 32 * Dp : 0) + 64;
    void *mem = NULL;
    if (posix_memalign(&mem, 64, floats * sizeof(float)) != 0) return 0;
    /* zeros: the pad columns [D, Dp) of q, kbuf and vbuf are never written after this */
    memset(mem, 0, floats * sizeof(float));
    float *f = (float *)mem;
    S->mem = mem;
    S->q = f; f += H * Dp;
    S->acc = f; f += H * Dp;
    S->s = f; f += H * FTILE;
    S->m = f; f += H;
    S->l = f; f += H;
    S->corr = f; f += H;
    S->lv = f; f += rows > 1 ? 16 * H : 0;
    S->pb = (uint16_t *)(void *)f; f += rows > 1 ? 16 * H : 0;  /* the AMX copy: 32 keys a row */
    S->kt = (uint32_t *)(void *)f; f += rows > 1 ? 16 * Dp : 0; /* two tiles of K rows */
    S->vp = (uint16_t *)(void *)f; f += rows > 1 ? 16 * Dp : 0; /* 16 key pairs */
    S->kbuf = f; f += C * TILE * Dp;
    S->vbuf = f;
    return 1;
}

/* Where the tile starting at logical position pos lives: its physical row and length
 * (at most lim keys, never past its block). */
INLINE int64_t tile_at_max(const params *P, const int32_t *table, int64_t pos, int64_t end,
                           int64_t *n, int64_t lim) {
    int64_t lb = pos / P->bs, off = pos - lb * P->bs;
    int64_t len = P->bs - off;
    if (len > end - pos) len = end - pos;
    if (len > lim) len = lim;
    *n = len;
    return (int64_t)table[lb] * P->bs + off;
}

INLINE int64_t tile_at(const params *P, const int32_t *table, int64_t pos, int64_t end, int64_t *n) {
    return tile_at_max(P, table, pos, end, n, TILE);
}

/*
 * Rows [0, n) of a tile, heads [kv0, kv0 + C) -> dst[c][j][0..D) (float32), read in
 * memory order (row by row, head by head) so the hardware prefetchers see a stream;
 * an 8-bit cache dequantised on the way (hscale: the static per-head scales, or NULL:
 * each row's own).
 */
static void gather_tile(const params *P, float *restrict dst, const char *src, int64_t row_stride,
                        int64_t head_stride, int64_t kv0, int64_t C, int64_t n,
                        const float *hscale) {
    const size_t es = P->kv_esize;
    const int64_t D = P->D;
    for (int64_t j = 0; j < n; ++j)
        for (int64_t c = 0; c < C; ++c) {
            const char *r = src + (size_t)(j * row_stride + (kv0 + c) * head_stride) * es;
            float *o = dst + (c * TILE + j) * P->Dp;
            if (P->kv8) {
                const float s = hscale ? hscale[kv0 + c] : row_scale(r, D);
                dequant_row(o, (const uint8_t *)r, D, P->kv_dtype, s, P->lut);
            } else {
                load_row(o, r, P->kv_dtype, D, 1.0f);
            }
        }
}

/*
 * Scores of the task's heads (R work items' G heads per kv head, rows (c * R + r) * G + g)
 * against the n keys of a tile (item r against its first nr[r] only; nr NULL: all n), 6 keys at a time and, for
 * those 6 keys, kv head by kv head: K is read in memory order (6 rows side by side).
 * Groups of 4 query heads take 3 keys per micro-kernel call (12 accumulators, 3 key and
 * 1 query registers: 7 loads per 12 FMAs); measured faster than 2 keys (8 accumulators)
 * here, in cache and out of it.
 */
static void scores_tile(const params *P, int64_t R, const int64_t *nr, const float *restrict q,
                        const float *restrict k, int64_t k_row, int64_t k_head, int64_t C, int64_t n,
                        float *restrict s) {
    const int64_t G = P->G, Dp = P->Dp;
    for (int64_t j0 = 0; j0 < n; j0 += 6) {
        for (int64_t cr = 0; cr < C * R; ++cr) {
            const int64_t c = cr / R, rn = nr ? nr[cr % R] : n;
            if (rn <= j0) continue;
            const int64_t jn = rn - j0 < 6 ? rn - j0 : 6;
            const float *kj = k + c * k_head + j0 * k_row;
            const float *qc = q + cr * G * Dp;
            float *sj = s + cr * G * TILE + j0;
            int64_t h = 0;
            for (; h + 4 <= G; h += 4) score_heads(4, 3, qc + h * Dp, Dp, kj, k_row, jn, sj + h * TILE);
            for (; h + 2 <= G; h += 2) score_heads(2, 4, qc + h * Dp, Dp, kj, k_row, jn, sj + h * TILE);
            for (; h < G; ++h) score_heads(1, 4, qc + h * Dp, Dp, kj, k_row, jn, sj + h * TILE);
        }
    }
}

/* Rows of a work item that sees no key: zeros (a sink's weight has no value). */
static void empty_rows(const params *P, int64_t row, int64_t h0, int64_t H) {
    for (int64_t h = 0; h < H; ++h) {
        char *o = P->o + (size_t)(row * P->o_st + (h0 + h) * P->o_sh) * P->esize;
        memset(o, 0, (size_t)P->D * P->esize);
        if (P->lse)
            P->lse[row * P->lse_st + (h0 + h) * P->lse_sh] = P->sinks ? P->sinks[h0 + h] : -INFINITY;
    }
}

/* The accumulators divided by their sums (a sink logit joins the sum only), written. */
static void finish_rows(const params *P, int64_t row, int64_t h0, int64_t H, const scratch *S) {
    for (int64_t h = 0; h < H; ++h) {
        char *o = P->o + (size_t)(row * P->o_st + (h0 + h) * P->o_sh) * P->esize;
        float m = S->m[h], l = S->l[h], keep = 1.0f;
        if (P->sinks) {
            const float sink = P->sinks[h0 + h];
            const float mn = sink > m ? sink : m;
            keep = m == -INFINITY ? 0.0f : expf(m - mn);
            l = l * keep + expf(sink - mn);
            m = mn;
        }
        store_row(o, S->acc + h * P->Dp, P->dtype, P->D, l > 0.0f ? keep / l : 0.0f);
        if (P->lse) P->lse[row * P->lse_st + (h0 + h) * P->lse_sh] = l > 0.0f ? m + logf(l) : -INFINITY;
    }
}

/*
 * One head's online softmax over a tile's scores s (its first n keys at logical
 * positions pos..; the rest of the TILE lanes -inf): scale was applied to q; soft-cap,
 * ALiBi (head's slope, query position qpos), then the running max *m, sum *l and the
 * rescale *corr updated and s replaced by the probabilities.
 */
INLINE void tile_softmax(const params *P, float *s, int64_t n, int64_t pos, float qpos,
                         int64_t head, float *m, float *l, float *corr) {
    if (P->cap > 0.0f) {
        const float inv_cap = 1.0f / P->cap;
        for (int64_t j = 0; j < n; ++j) s[j] = P->cap * tanhf(s[j] * inv_cap);
    }
    if (P->alibi) {
        const float slope = P->alibi[head];
        for (int64_t j = 0; j < n; ++j) s[j] += slope * ((float)((pos + j) * P->pm + P->pa) - qpos);
    }
    for (int64_t j = n; j < TILE; ++j) s[j] = -INFINITY;
    v8f s0 = ld8(s), s1 = ld8(s + 8);
    v8i gt = s1 > s0;
    v8f mx = (v8f)(((v8i)s1 & gt) | ((v8i)s0 & ~gt));
    float mt = hmax8(mx);
    float mold = *m;
    float mnew = mt > mold ? mt : mold;
    if (mnew == -INFINITY) { /* every score so far is -inf: nothing to add */
        *corr = 1.0f;
        st8(s, splat8(0.0f));
        st8(s + 8, splat8(0.0f));
        return;
    }
    float c = expf(mold - mnew);
    v8f p0 = vexp(s0 - splat8(mnew)), p1 = vexp(s1 - splat8(mnew));
    st8(s, p0);
    st8(s + 8, p1);
    *l = *l * c + hsum8(p0 + p1);
    *m = mnew;
    *corr = c;
}

/*
 * One work item, kv heads [kv0, kv0 + C): the query heads [kv0 * G, (kv0 + C) * G).
 * Keys are walked tile by tile; every tile is read once for all the task's heads.
 */
static void run_task(const params *P, int64_t item, int64_t kv0, int64_t C, scratch *S) {
    const int64_t G = P->G, D = P->D, Dp = P->Dp, H = C * G, h0 = kv0 * G;
    const int64_t row = P->rows[item];
    const int32_t *table = P->bt + (int64_t)P->req[item] * P->bt_sb;
    const int64_t start = P->ks[item], end = P->ke[item];
    const size_t es = P->esize;

    if (end <= start) { /* no visible key */
        empty_rows(P, row, h0, H);
        return;
    }

    for (int64_t h = 0; h < H; ++h) {
        const char *q = P->q + (size_t)(row * P->q_st + (h0 + h) * P->q_sh) * es;
        load_row(S->q + h * Dp, q, P->dtype, D, P->scale);
        memset(S->acc + h * Dp, 0, (size_t)Dp * sizeof(float));
        S->m[h] = -INFINITY;
        S->l[h] = 0.0f;
    }

    const float qpos = (float)P->qp[item];

    for (int64_t pos = start; pos < end;) {
        int64_t n;
        const int64_t prow = tile_at(P, table, pos, end, &n);
        const char *kt = P->k + (size_t)(prow * P->k_sr) * P->kv_esize;
        const char *vt = P->v + (size_t)(prow * P->v_sr) * P->kv_esize;

        if (P->direct) { /* K in place, read in memory order */
            scores_tile(P, 1, NULL, S->q, (const float *)kt + kv0 * P->k_sh, P->k_sr, P->k_sh, C, n, S->s);
        } else {
            gather_tile(P, S->kbuf, kt, P->k_sr, P->k_sh, kv0, C, n, P->k_scale);
            scores_tile(P, 1, NULL, S->q, S->kbuf, Dp, TILE * Dp, C, n, S->s);
        }

        for (int64_t h = 0; h < H; ++h) {
            tile_softmax(P, S->s + h * TILE, n, pos, qpos, h0 + h, S->m + h, S->l + h, S->corr + h);
        }

        if (P->direct) { /* V in place: every 64-byte line of the tile is loaded once */
            for (int64_t c = 0; c < C; ++c)
                vacc_tile(G, S->s + c * G * TILE, S->corr + c * G,
                          (const float *)vt + (kv0 + c) * P->v_sh, P->v_sr, n, S->acc + c * G * Dp,
                          Dp);
        } else { /* V converted to float32 (and zero-padded to Dp columns) first */
            gather_tile(P, S->vbuf, vt, P->v_sr, P->v_sh, kv0, C, n, P->v_scale);
            for (int64_t c = 0; c < C; ++c)
                vacc_tile(G, S->s + c * G * TILE, S->corr + c * G, S->vbuf + c * TILE * Dp, Dp, n,
                          S->acc + c * G * Dp, Dp);
        }
        pos += n;
    }

    finish_rows(P, row, h0, H, S);
}

/* ---- the 16-lane copies, chosen at run time ---------------------------------------- */

/* A task: the work items [i0, i0 + R) (one group) over kv heads [kv0, kv0 + C). */
typedef void (*task_fn)(const params *, int64_t i0, int64_t R, int64_t kv0, int64_t C, scratch *);

/*
 * The 8-lane copy's group: R work items of one request with one key_start (plan_groups
 * with same_start), kv heads [kv0, kv0 + C), each tile of K and V read once for all R
 * rows (a verify step's rows share their context: R decodes' arithmetic, one pass over
 * memory).  Row layout in the scratch: (c * R + r) * G + g; each row's G heads go
 * through run_task's micro-kernel blocking (its K and V tile rows stay in L1 from one row
 * to the next: the saving is memory traffic, not arithmetic).  The tiles are run_task's from the shared
 * start, each row scored and accumulated over its own part of each (its run_task tile),
 * so every row gets the bits of its own run_task.  R == 1 is run_task.
 */
static void run_rows(const params *P, int64_t i0, int64_t R, int64_t kv0, int64_t C, scratch *S) {
    if (R == 1) {
        run_task(P, i0, kv0, C, S);
        return;
    }
    const int64_t G = P->G, D = P->D, Dp = P->Dp, M = R * G, H = C * M, h0 = kv0 * G;
    const int32_t *table = P->bt + (int64_t)P->req[i0] * P->bt_sb;
    const size_t es = P->esize;
    const int64_t start = P->ks[i0];
    int64_t end = P->ke[i0];
    float qpos[GROUP_ROWS];
    int64_t rend[GROUP_ROWS];
    for (int64_t r = 0; r < R; ++r) {
        rend[r] = P->ke[i0 + r];
        if (rend[r] > end) end = rend[r];
        qpos[r] = (float)P->qp[i0 + r];
    }
    for (int64_t c = 0; c < C; ++c)
        for (int64_t r = 0; r < R; ++r)
            for (int64_t g = 0; g < G; ++g) {
                const int64_t h = (c * R + r) * G + g;
                const char *q = P->q + (size_t)(P->rows[i0 + r] * P->q_st + (h0 + c * G + g) * P->q_sh) * es;
                load_row(S->q + h * Dp, q, P->dtype, D, P->scale);
                memset(S->acc + h * Dp, 0, (size_t)Dp * sizeof(float));
                S->m[h] = -INFINITY;
                S->l[h] = 0.0f;
            }

    for (int64_t pos = start; pos < end;) {
        int64_t n;
        const int64_t prow = tile_at(P, table, pos, end, &n);
        const char *kt = P->k + (size_t)(prow * P->k_sr) * P->kv_esize;
        const char *vt = P->v + (size_t)(prow * P->v_sr) * P->kv_esize;
        int64_t rn[GROUP_ROWS]; /* the tile's keys each row sees: its run_task tile's */
        for (int64_t r = 0; r < R; ++r) {
            rn[r] = rend[r] - pos;
            if (rn[r] > n) rn[r] = n;
            if (rn[r] < 0) rn[r] = 0;
        }
        if (P->direct) {
            scores_tile(P, R, rn, S->q, (const float *)kt + kv0 * P->k_sh, P->k_sr, P->k_sh, C, n, S->s);
        } else {
            gather_tile(P, S->kbuf, kt, P->k_sr, P->k_sh, kv0, C, n, P->k_scale);
            scores_tile(P, R, rn, S->q, S->kbuf, Dp, TILE * Dp, C, n, S->s);
        }
        for (int64_t h = 0; h < H; ++h) {
            const int64_t r = (h % M) / G;
            float *s = S->s + h * TILE;
            /* keys [pos, pos + seen) are the row's; the rest of the tile scores -inf */
            const int64_t seen = rn[r];
            if (seen == 0) { /* past the row's end: its run_task is done */
                S->corr[h] = 1.0f;
                continue;
            }
            tile_softmax(P, S->s + h * TILE, seen, pos, qpos[r], h0 + (h / M) * G + h % G, S->m + h,
                         S->l + h, S->corr + h);
        }
        /* each row's G heads blocked as run_task blocks them (the same operations) */
        if (!P->direct) gather_tile(P, S->vbuf, vt, P->v_sr, P->v_sh, kv0, C, n, P->v_scale);
        for (int64_t cr = 0; cr < C * R; ++cr) {
            const int64_t c = cr / R, h = cr * G, r = cr % R;
            if (rn[r] == 0) continue; /* past the row's end: nothing to add, corr is 1 */
            if (P->direct)
                vacc_tile(G, S->s + h * TILE, S->corr + h, (const float *)vt + (kv0 + c) * P->v_sh,
                          P->v_sr, rn[r], S->acc + h * Dp, Dp);
            else
                vacc_tile(G, S->s + h * TILE, S->corr + h, S->vbuf + c * TILE * Dp, Dp, rn[r],
                          S->acc + h * Dp, Dp);
        }
        pos += n;
    }
    for (int64_t c = 0; c < C; ++c)
        for (int64_t r = 0; r < R; ++r) {
            const int64_t m0 = (c * R + r) * G;
            scratch view = *S;
            view.acc = S->acc + m0 * Dp;
            view.m = S->m + m0;
            view.l = S->l + m0;
            finish_rows(P, P->rows[i0 + r], h0 + c * G, G, &view);
        }
}

/*
 * Groups of consecutive work items a task takes together: at most maxr items of one
 * request, each seeing some key, whose key ranges stay one interval (every key of it is
 * one some item sees, so its blocks were checked) at most GROUP_SLACK keys longer than
 * the group's shortest range, and with same_start one key_start (run_rows' tiles start
 * there).  first[g] is group g's first item, first[groups] = N.
 */
static int64_t plan_groups(const params *P, int64_t N, int64_t maxr, int same_start, int64_t *first) {
    int64_t groups = 0;
    for (int64_t i = 0; i < N;) {
        int64_t j = i + 1;
        int64_t us = P->ks[i], ue = P->ke[i], shortest = ue - us;
        if (ue > us)
            for (; j < N && j - i < maxr; ++j) {
#ifndef ATTNKIT_TEST_GROUP_ANY_REQUEST /* a broken variant for the tests: mixes requests */
                if (P->req[j] != P->req[i]) break;
#endif
                const int64_t s = P->ks[j], e = P->ke[j];
                if (e <= s || s > ue || e < us) break;
#ifndef ATTNKIT_TEST_GROUP_ANY_START /* a broken variant for the tests: run_rows' tiles move */
                if (same_start && s != P->ks[i]) break;
#endif
                const int64_t nus = s < us ? s : us, nue = e > ue ? e : ue;
                const int64_t ns = e - s < shortest ? e - s : shortest;
                if (nue - nus > ns + GROUP_SLACK) break;
                us = nus;
                ue = nue;
                shortest = ns;
            }
        first[groups++] = i;
        i = j;
    }
    first[groups] = N;
    return groups;
}

/*
 * One step of the grouped copies' walk over keys [pos, ue): the tile [pos, *end) inside
 * one block and one aligned 16-position window from base (a key's lane is its position
 * mod 16), its first plane row, its lanes lo..hi, and the next tile's first row and row count
 * (-1, 0 at the last), prefetched while this one is scored.
 */
typedef struct {
    int64_t base, end, row, next_row, next_n;
    int lo, hi;
} key_tile;

static inline key_tile next_key_tile(const params *P, const int32_t *table, int64_t pos, int64_t ue) {
    key_tile t;
    const int64_t base = pos - pos % 16, lb = pos / P->bs;
    t.base = base;
    t.end = base + 16;
    if (t.end > (lb + 1) * P->bs) t.end = (lb + 1) * P->bs;
    if (t.end > ue) t.end = ue;
    t.row = (int64_t)table[lb] * P->bs + (pos - lb * P->bs);
    t.lo = (int)(pos - base);
    t.hi = (int)(t.end - base);
    t.next_row = -1;
    t.next_n = 0;
    if (t.end < ue) {
        const int64_t nb = t.end / P->bs;
        t.next_n = P->bs - (t.end - nb * P->bs);
        if (t.next_n > 16) t.next_n = 16;
        if (t.next_n > ue - t.end) t.next_n = ue - t.end;
        t.next_row = (int64_t)table[nb] * P->bs + (t.end - nb * P->bs);
    }
    return t;
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define FD_X86 1
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#include <immintrin.h>
#define FD_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define FD_TARGET_BEGIN(t) FD_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define FD_TARGET_END FD_PRAGMA(clang attribute pop)
#else
#define FD_TARGET_BEGIN(t) FD_PRAGMA(GCC push_options) FD_PRAGMA(GCC target(t))
#define FD_TARGET_END FD_PRAGMA(GCC pop_options)
#endif

FD_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#define SFX avx512bf16
#include "paged_decode_body.h"
#undef SFX
FD_TARGET_END

#if defined(__x86_64__)
#define FD_AMX 1
FD_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
#include "paged_decode_amx.h"
FD_TARGET_END
#else
#define FD_AMX 0
#endif

#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

/*
 * Whether AMX-BF16 tiles can be used: the CPU reports AMX-TILE and AMX-BF16 (CPUID 7.0
 * EDX bits 24 and 22), the OS enables their state (XCR0 bits 17 and 18) and, on Linux,
 * grants this process the tile data (arch_prctl ARCH_REQ_XCOMP_PERM); asked once.
 */
static int amx_ready(void) {
    static int state = -1;
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s >= 0) return s;
    int ok = 0;
#if FD_AMX && defined(__linux__) && defined(SYS_arch_prctl)
    unsigned a, b, c, d;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1u) && (d >> 22 & 1u) &&
        __get_cpuid(1, &a, &b, &c, &d) && (c >> 27 & 1u)) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        (void)hi;
        if ((lo >> 17 & 3u) == 3u) ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
    }
#endif
    __atomic_store_n(&state, ok, __ATOMIC_RELEASE);
    return ok;
}

/* The same for paged_prefill.c's tiles copy (one library: not exported). */
__attribute__((visibility("hidden"))) int attnkit_amx_granted(void);
int attnkit_amx_granted(void) { return amx_ready(); }
#else
#define FD_X86 0
#endif

/* The instruction set paged_prefill.c picked (the CPU's best, ATTNKIT_CPU_ISA's cap). */
const char *attnkit_prefill_isa(void);

/*
 * The 16-lane copy for this call, or run_rows (8 lanes, every dtype and head size; the
 * rows of a group with one key start share each tile's reads).  The 16-lane copy serves
 * bf16 only: on float32 caches out of the CPU's caches run_task measured
 * 5-10% faster here (32 x 2k, 35-38 ms against 37-40 ms), in cache 1.2x slower.
 */
static task_fn pick_task(int dtype, int kv_dtype, int64_t D) {
#if FD_X86
    const char *pf = attnkit_prefill_isa();
    if (dtype == DT_BF16 && kv_dtype == dtype && D % 32 == 0 &&
        (!strcmp(pf, "amxbf16") || !strcmp(pf, "avx512bf16"))) {
        /* the AMX copy unless ATTNKIT_CPU_ISA names a set below it */
        const char *cap = getenv("ATTNKIT_CPU_ISA");
#if FD_AMX
        if ((cap == NULL || !*cap || !strcmp(cap, "amxbf16")) && amx_ready()) return amx_task;
#else
        (void)cap;
#endif
        return task_avx512bf16;
    }
#else
    (void)dtype;
    (void)kv_dtype;
    (void)D;
#endif
    return run_rows;
}

/* The instruction set the decode's copy for (dtype, D) uses: "amxbf16", "avx512bf16" or
 * "vector8" (run_task: 8-lane vectors as the build flags lower them). */
ATTNKIT_API const char *attnkit_decode_isa(ATTNKIT_PARAMS(ATTNKIT_DECODE_ISA_ARGS)) {
    task_fn f = pick_task(dtype, dtype, D);
#if FD_X86
#if FD_AMX
    if (f == amx_task) return "amxbf16";
#endif
    if (f == task_avx512bf16) return "avx512bf16";
#endif
    (void)f;
    return "vector8";
}

/* ---- entry points ------------------------------------------------------------------ */

ATTNKIT_API int attnkit_has_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

ATTNKIT_API int attnkit_abi_version(void) { return ATTNKIT_ABI_VERSION; }

/* The ABI as text (attnkit_abi.h): one line per function, "name return-kind" and then
 * its parameters as kind:name separated by commas (none: nothing). */
#define AK_SIG_FIRST_(kind, type, name) " " #kind ":" #name
#define AK_SIG_NEXT_(kind, type, name) "," #kind ":" #name
#define AK_ROW_(rkind, rtype, name, list) #name " " #rkind list(AK_SIG_FIRST_, AK_SIG_NEXT_) "\n"
ATTNKIT_API const char *attnkit_abi_table(void) { return ATTNKIT_FUNCTIONS(AK_ROW_); }

/* The error codes as text: one line per code, "code NAME meaning". */
#define AK_ERR_ROW_(code, name, meaning) #code " " #name " " meaning "\n"
ATTNKIT_API const char *attnkit_abi_errors(void) { return ATTNKIT_ERRORS(AK_ERR_ROW_); }

/* The hash of the sources this library was built from (cpu_native.py passes it; a
 * prebuilt library whose hash is not the installed sources' is stale and not loaded). */
#ifndef ATTNKIT_SOURCE_HASH
#define ATTNKIT_SOURCE_HASH "unknown"
#endif
ATTNKIT_API const char *attnkit_source_hash(void) { return ATTNKIT_SOURCE_HASH; }

/* The build's name: a prebuilt variant (x86-64-v3, ...) or "native" (-march=native). */
#ifndef ATTNKIT_BUILD_VARIANT
#define ATTNKIT_BUILD_VARIANT "unknown"
#endif
ATTNKIT_API const char *attnkit_build_variant(void) { return ATTNKIT_BUILD_VARIANT; }

/* Where this library's OpenMP calls resolved: the address of omp_get_max_threads as
 * bound (the library links no runtime: the loader makes torch's global first, and names
 * the file this address lies in), or NULL without OpenMP. */
ATTNKIT_API void *attnkit_openmp_entry(void) {
#ifdef _OPENMP
    return (void *)&omp_get_max_threads;
#else
    return NULL;
#endif
}

/*
 * Returns ATTNKIT_OK or an ATTNKIT_ERR_* code; on an index error err[0] is the work
 * item, err[1] the offending value and err[2] a position (the block_table column for
 * ATTNKIT_ERR_BLOCK).  Strides are in elements.  ALiBi sees logical key position p at
 * p * pos_mul + pos_add (a context-parallel shard: p * world_size + rank; else 1, 0).  soft_cap <= 0 means none; alibi and
 * sinks (float32 [Hq]: one logit per head added to every softmax denominator) may be NULL;
 * lse (float32, element strides lse_st, lse_sh) receives each written row's natural-log
 * sum of exp (-inf where nothing is visible), or is NULL.  Nothing is written when an
 * error is returned.  kv_dtype is the planes' format: dtype, or an 8-bit KV_* format
 * with k_scale / v_scale (float32 [Hkv]) its static per-head scales, or both NULL: each
 * head's D bytes are followed by its float32 scale (the head stride then covers D + 4
 * bytes).
 */
ATTNKIT_API int attnkit_paged_decode(ATTNKIT_PARAMS(ATTNKIT_PAGED_DECODE_ARGS)) {
    err[0] = err[1] = err[2] = -1;
    if (dtype < DT_F32 || dtype > DT_F16 || Hkv <= 0 || Hq <= 0 || Hq % Hkv != 0 || D <= 0 ||
        block_size <= 0 || N < 0 || B < 0 || W < 0 || R < 0 || T < 0)
        return ATTNKIT_ERR_ARGS;
    const int kv8 = kv_dtype >= KV_FP8_E4M3 && kv_dtype <= KV_INT8;
    if ((kv_dtype != dtype && !kv8) || (!kv8 && (k_scale || v_scale)) ||
        (k_scale == NULL) != (v_scale == NULL))
        return ATTNKIT_ERR_ARGS;

    const int64_t num_blocks = R / block_size;
    const int64_t width = W * block_size;
    for (int64_t i = 0; i < N; ++i) {
        err[0] = i;
        const int64_t row = rows[i], b = requests[i], s = key_start[i], e = key_end[i];
        if (row < 0 || row >= T) { err[1] = row; return ATTNKIT_ERR_ROW; }
        if (b < 0 || b >= B) { err[1] = b; return ATTNKIT_ERR_REQUEST; }
        if (s < 0) { err[1] = s; return ATTNKIT_ERR_KEY_START; }
        if (e > width) { err[1] = e; return ATTNKIT_ERR_KEY_END; }
        if (e < s) { err[1] = e; err[2] = s; return ATTNKIT_ERR_RANGE; }
        if (e > s) {
            const int32_t *table = block_table + b * bt_sb;
            for (int64_t c = s / block_size; c <= (e - 1) / block_size; ++c) {
                const int64_t blk = table[c];
                if (blk < 0 || blk >= num_blocks) {
                    err[1] = blk;
                    err[2] = c;
                    return ATTNKIT_ERR_BLOCK;
                }
            }
        }
    }
    err[0] = err[1] = err[2] = -1;
    if (N == 0) return ATTNKIT_OK;

    params P;
    P.dtype = dtype;
    P.esize = dtype == DT_F32 ? 4 : 2;
    P.kv_dtype = kv_dtype;
    P.kv8 = kv8;
    P.kv_esize = kv8 ? 1 : P.esize;
    P.k_scale = k_scale;
    P.v_scale = v_scale;
    if (kv8) fill_byte_table(P.lut, kv_dtype);
    P.q = (const char *)query;
    P.k = (const char *)k_plane;
    P.v = (const char *)v_plane;
    P.o = (char *)output;
    P.q_st = q_st; P.q_sh = q_sh;
    P.k_sr = k_sr; P.k_sh = k_sh;
    P.v_sr = v_sr; P.v_sh = v_sh;
    P.o_st = o_st; P.o_sh = o_sh;
    P.bt = block_table; P.bt_sb = bt_sb;
    P.rows = rows; P.req = requests; P.ks = key_start; P.ke = key_end; P.qp = query_pos;
    P.pm = pos_mul; P.pa = pos_add;
    P.Hq = Hq; P.Hkv = Hkv; P.G = Hq / Hkv; P.D = D; P.bs = block_size;
    P.Dp = (D + 15) / 16 * 16;
    P.direct = dtype == DT_F32 && kv_dtype == dtype && D % 16 == 0;
    /*
     * Tasks: (a group of work items, a chunk of kv heads).  One thread takes every head of
     * a group in one pass (each tile of K and V is then read front to back, whole); with
     * more threads the heads are split until there are about 4 tasks per thread.
     */
    const task_fn task = pick_task(dtype, kv_dtype, D);
    const int64_t maxr = GROUP_ROWS;
    int64_t *first = (int64_t *)malloc((size_t)(N + 1) * sizeof(int64_t));
    if (!first) return ATTNKIT_ERR_NOMEM;
    const int64_t groups = plan_groups(&P, N, maxr, task == run_rows, first);
    int64_t splits = 1;
    if (num_threads > 1) {
        splits = (4 * (int64_t)num_threads + groups - 1) / groups;
        if (splits > Hkv) splits = Hkv;
    }
    P.kv_chunk = (Hkv + splits - 1) / splits;
    const int64_t chunks = (Hkv + P.kv_chunk - 1) / P.kv_chunk;
    P.scale = scale;
    P.cap = soft_cap > 0.0f ? soft_cap : 0.0f;
    P.alibi = alibi;
    P.sinks = sinks;
    P.lse = lse;
    P.lse_st = lse_st;
    P.lse_sh = lse_sh;

    const int64_t tasks = groups * chunks;
    int failed = 0;
#define RUN_TASK(t)                                                                       \
    do {                                                                                  \
        const int64_t kv0_ = ((t) % chunks) * P.kv_chunk;                                 \
        const int64_t c_ = Hkv - kv0_ < P.kv_chunk ? Hkv - kv0_ : P.kv_chunk;             \
        const int64_t g_ = (t) / chunks;                                                  \
        task(&P, first[g_], first[g_ + 1] - first[g_], kv0_, c_, &S);                    \
    } while (0)
    if (num_threads <= 1 || tasks == 1) {
        scratch S;
        if (!scratch_alloc(&S, P.kv_chunk, P.G, P.Dp, !P.direct, maxr)) {
            free(first);
            return ATTNKIT_ERR_NOMEM;
        }
        for (int64_t t = 0; t < tasks; ++t) RUN_TASK(t);
        free(S.mem);
        free(first);
        return ATTNKIT_OK;
    }
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        scratch S;
        int ok = scratch_alloc(&S, P.kv_chunk, P.G, P.Dp, !P.direct, maxr);
        if (!ok) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; ++t)
            if (ok) RUN_TASK(t);
        if (ok) free(S.mem);
    }
    /* A thread without scratch skipped its tasks: redo everything on this thread. */
    if (failed) {
        scratch S;
        if (!scratch_alloc(&S, P.kv_chunk, P.G, P.Dp, !P.direct, maxr)) {
            free(first);
            return ATTNKIT_ERR_NOMEM;
        }
        for (int64_t t = 0; t < tasks; ++t) RUN_TASK(t);
        free(S.mem);
    }
#undef RUN_TASK
    free(first);
    return ATTNKIT_OK;
}

/*
 * The same attention for whole requests, planned here from the batch metadata as the
 * runtime hands it over (no per-token arrays built by the caller): every query token of
 * the served requests (`requests`, n of them; NULL: all B) is one work item; query t of
 * request r sits at position qp = seq - qlen + t (qlen = query_start_loc[r + 1] -
 * query_start_loc[r]) and sees the keys [lo, qp + 1) when causal (lo = 0, or
 * max(qp - window + 1, 0), or qp's chunk start; window / chunk <= 0: none) and [0, seq)
 * otherwise.  Error codes as above; err[0] is then the request (not the work item), and
 * for ATTNKIT_ERR_BLOCK err[2] is the block_table column.
 */
ATTNKIT_API int attnkit_paged_decode_requests(ATTNKIT_PARAMS(ATTNKIT_PAGED_DECODE_REQUESTS_ARGS)) {
    err[0] = err[1] = err[2] = -1;
    if (requests == NULL) n = B;
    if (n < 0 || B < 0 || T < 0) return ATTNKIT_ERR_ARGS;
    int64_t items = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = requests ? requests[i] : i;
        err[0] = r;
        if (r < 0 || r >= B) { err[0] = i; err[1] = r; return ATTNKIT_ERR_REQUEST; }
        const int64_t qs = query_start_loc[r], qe = query_start_loc[r + 1], seq = seq_lens[r];
        if (qs < 0 || qe < qs || qe > T) { err[1] = qs; err[2] = qe; return ATTNKIT_ERR_QSL; }
        if (seq < 0 || (causal && seq < qe - qs)) { err[1] = seq; err[2] = qe - qs; return ATTNKIT_ERR_SEQ; }
        items += qe - qs;
    }
    err[0] = err[1] = err[2] = -1;
    if (items == 0) return ATTNKIT_OK;
    int64_t *rows = (int64_t *)malloc((size_t)items * sizeof(int64_t));
    int32_t *ints = (int32_t *)malloc((size_t)items * 4 * sizeof(int32_t));
    if (!rows || !ints) { free(rows); free(ints); return ATTNKIT_ERR_NOMEM; }
    int32_t *req = ints, *ks = ints + items, *ke = ints + 2 * items, *qp = ints + 3 * items;
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t r = requests ? requests[i] : i;
        const int64_t qs = query_start_loc[r], qlen = query_start_loc[r + 1] - qs, seq = seq_lens[r];
        for (int64_t t = 0; t < qlen; ++t, ++m) {
            const int64_t pos = seq - qlen + t;
            rows[m] = qs + t;
            req[m] = (int32_t)r;
            qp[m] = (int32_t)pos;
            if (causal) {
                int64_t lo = 0;
                if (window > 0) lo = pos - window + 1 > 0 ? pos - window + 1 : 0;
                else if (chunk > 0) lo = pos / chunk * chunk; /* pos >= 0 when causal */
                ks[m] = (int32_t)lo;
                ke[m] = (int32_t)(pos + 1);
            } else {
                ks[m] = 0;
                ke[m] = (int32_t)seq;
            }
        }
    }
    const int code = attnkit_paged_decode(
        dtype, kv_dtype, k_scale, v_scale, query, q_st, q_sh, k_plane, k_sr, k_sh, v_plane, v_sr, v_sh, block_table, bt_sb,
        B, W, R, rows, req, ks, ke, qp, items, T, Hq, Hkv, D, block_size, 1, 0, scale, soft_cap, alibi,
        sinks, lse, lse_st, lse_sh, output, o_st, o_sh, num_threads, err);
    if (code != ATTNKIT_OK && err[0] >= 0 && err[0] < items) err[0] = req[err[0]];
    free(rows);
    free(ints);
    return code;
}
