/* bf16 and fp16 <-> float32 element conversions, shared by paged_decode.c and
 * paged_prefill.c (included by both; the includer defines INLINE). bf16 rounds to
 * nearest even and keeps NaNs quiet; fp16 uses the compiler's _Float16 where it has
 * one, else bit-exact software conversions (also under ATTNKIT_SOFT_F16). */

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

#endif /* ATTNKIT_HALF_FLOAT_H */
