/*
 * A 16 x 16 transpose of 32-bit values in AVX-512 registers, for the copies that need it
 * (paged_decode_body.h, paged_prefill_amx.h); included inside a target region with
 * AVX-512F, once per translation unit.
 */
#ifndef ATTNKIT_AVX512_TRANSPOSE_H
#define ATTNKIT_AVX512_TRANSPOSE_H

/*
 * r[j] lane i -> r[i] lane j (16 x 16 32-bit values): in-lane unpacks of row pairs (32-,
 * then 64-bit), then two rounds of 128-bit lane shuffles. Measured against the same
 * transpose by four rounds of two-source permutes (vpermt2d: 64 of them, the same
 * count): 0.80x a bf16 32 x 2k decode's time, 0.89x a verify step's (paired rounds, 1
 * thread, 2-core AVX512-BF16 CPU).
 */
INLINE void avx512_transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    /* u[4g + c] 128-bit lane L: rows 4g..4g + 3 of column c + 4L */
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* t[8g + c] lanes: columns c, c + 8, c, c + 8 of rows 8g.., 8g.., 8g + 4.., 8g + 4..;
     * t[8g + 4 + c]: the same for columns c + 4, c + 12 */
    for (int g = 0; g < 2; ++g)
        for (int c = 0; c < 4; ++c) {
            const __m512i a = u[8 * g + c], b = u[8 * g + 4 + c];
            t[8 * g + c] = _mm512_shuffle_i32x4(a, b, 0x88);
            t[8 * g + 4 + c] = _mm512_shuffle_i32x4(a, b, 0xDD);
        }
    for (int c = 0; c < 8; ++c) {
        r[c] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0x88);
        r[c + 8] = _mm512_shuffle_i32x4(t[c], t[8 + c], 0xDD);
    }
}

#endif /* ATTNKIT_AVX512_TRANSPOSE_H */
