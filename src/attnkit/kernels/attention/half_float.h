/* bf16 and fp16 <-> float32 element conversions, shared by paged_decode.c and
 * paged_prefill.c (included by both; the includer defines INLINE). bf16 rounds to
 * nearest even and keeps NaNs quiet; fp16 uses the compiler's _Float16 where it has
 * one, else bit-exact software conversions (also under ATTNKIT_SOFT_F16). The 8-bit
 * cache formats (fp8 e4m3fn, fp8 e5m2, int8) are read through a 256-entry table of
 * their exact float32 values (fill_byte_table). */

#ifndef ATTNKIT_HALF_FLOAT_H
#define ATTNKIT_HALF_FLOAT_H

/* ---- element conversions ---------------------------------------------------------- */

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x0040u); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

#if defined(__FLT16_MAX__) && !defined(ATTNKIT_SOFT_F16)
INLINE float f16_to_f32(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}

INLINE uint16_t f32_to_f16(float f) {
    _Float16 x = (_Float16)f; /* IEEE conversion: round to nearest, ties to even */
    uint16_t h;
    memcpy(&h, &x, sizeof h);
    return h;
}
#else
/* Bit-exact software conversions for compilers without _Float16. */
INLINE float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: value = man * 2^-24, exact in float */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

INLINE uint16_t f32_to_f16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t abs = bits & 0x7fffffffu;
    if (abs > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));
    if (abs >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
    if (abs < 0x38800000u) {                                    /* below 2^-14: subnormal */
        if (abs < 0x33000000u) return sign;                     /* below 2^-25: zero */
        uint32_t e = abs >> 23;
        uint32_t man = (abs & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14 .. 24 */
        uint32_t q = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (q & 1u))) q += 1u;
        return (uint16_t)(sign | q);
    }
    uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u); /* ties to even on the 13 dropped bits */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}
#endif

/* ---- 8-bit cache formats ----------------------------------------------------------- */

enum { KV_FP8_E4M3 = 3, KV_FP8_E5M2 = 4, KV_INT8 = 5 }; /* after DT_F32, DT_BF16, DT_F16 */

/* fp8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinity, S.1111.111
 * is NaN) -> float32, exactly: every e4m3 value is a float32 value. */
INLINE float fp8e4m3_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24;
    const uint32_t exp = (b >> 3) & 0xfu, man = b & 0x7u;
    uint32_t bits;
    if (exp == 0xfu && man == 0x7u) {
        bits = sign | 0x7fc00000u;
    } else if (exp != 0) {
        bits = sign | ((exp + 120u) << 23) | (man << 20); /* rebias 7 -> 127 */
    } else { /* zero or subnormal: man * 2^-9, exact */
        const float f = (float)man * 0.001953125f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* table[b] = the float32 value of byte b in kv format `fmt` (e5m2 is the top byte of an
 * IEEE fp16, so it widens through f16_to_f32). */
static void fill_byte_table(float table[256], int fmt) {
    for (int b = 0; b < 256; ++b) {
        if (fmt == KV_FP8_E4M3) table[b] = fp8e4m3_to_f32((uint8_t)b);
        else if (fmt == KV_FP8_E5M2) table[b] = f16_to_f32((uint16_t)(b << 8));
        else table[b] = (float)(int8_t)(uint8_t)b;
    }
}

/*
 * o[d] = the float32 value of byte b[d] in kv format `fmt`, times s, for d < D (table:
 * fill_byte_table's). int8 is widened directly (the compiler vectorises it); the fp8
 * formats go through the table: on an AMD EPYC (AVX-512) the table measured faster than
 * fp8 -> float32 bit manipulation the compiler did not vectorise well
 * (benchmarks/bench_cpu.py --fp8 only).
 */
INLINE void dequant_row(float *restrict o, const uint8_t *restrict b, int64_t D, int fmt, float s,
                        const float *restrict table) {
    if (fmt == KV_INT8) {
        for (int64_t d = 0; d < D; ++d) o[d] = (float)(int8_t)b[d] * s;
    } else {
        for (int64_t d = 0; d < D; ++d) o[d] = table[b[d]] * s;
    }
}

/*
 * A row of D fp16 values -> float32, times scale: eight at a time by F16C (vcvtph2ps,
 * exact as f16_to_f32) where the CPU has it (every x86-64-v3 CPU; the portable build's
 * baseline lacks it, so it is picked at run time), else element by element. The
 * element loop is not vectorised: a float16 32 x 2k decode took 3.6x the time with it
 * (163 ms against 45 ms, 1 thread, a Xeon with AVX-512).
 */
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx,f16c"))) static void f16_row_f16c(float *restrict dst, const uint16_t *s,
                                                               int64_t D, float scale) {
    const __m256 sc = _mm256_set1_ps(scale);
    int64_t d = 0;
    for (; d + 8 <= D; d += 8)
        _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(s + d))), sc));
    for (; d < D; ++d) dst[d] = f16_to_f32(s[d]) * scale;
}

static int have_f16c(void) {
    static int state = -1;
    int v = __atomic_load_n(&state, __ATOMIC_RELAXED);
    if (v < 0) {
        __builtin_cpu_init();
#ifdef ATTNKIT_TEST_NO_F16C /* the tests' other build: the element loop everywhere */
        v = 0;
#else
        v = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
        __atomic_store_n(&state, v, __ATOMIC_RELAXED);
    }
    return v;
}
#endif

static void f16_row_to_f32(float *restrict dst, const uint16_t *s, int64_t D, float scale) {
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
    if (have_f16c()) {
        f16_row_f16c(dst, s, D, scale);
        return;
    }
#endif
    for (int64_t d = 0; d < D; ++d) dst[d] = f16_to_f32(s[d]) * scale;
}

/* The float32 scale stored after a head's D values in a row-scaled cache (4 bytes). */
INLINE float row_scale(const char *head, int64_t D) {
    float s;
    memcpy(&s, head + D, sizeof s);
    return s;
}

#endif /* ATTNKIT_HALF_FLOAT_H */
