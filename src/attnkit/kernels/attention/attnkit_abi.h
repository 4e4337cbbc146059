/*
 * The native CPU kernels' ABI, in one place: every exported function's parameters (kind,
 * C type, name) and every error code.  The C definitions are generated from these lists,
 * and the library exports them as text (attnkit_abi_table, attnkit_abi_errors), from
 * which cpu_native.py builds its ctypes signatures and error names.  At load it also
 * checks that each Python wrapper passes the parameters in the library's order, so a
 * wrapper left behind by a change here fails to load instead of corrupting memory.
 *
 * Parameter lists are X-macros: F(kind, type, name) for the first parameter, P(kind,
 * type, name) for each further one.  kind is what crosses the boundary: i32 (C int), i64
 * (int64_t), f32 (float), ptr (any pointer).  An empty list is a function of no
 * parameters.  The return kind of each function is in ATTNKIT_FUNCTIONS.
 */
#ifndef ATTNKIT_ABI_H
#define ATTNKIT_ABI_H

#include <stdint.h>

/*
 * glibc's floor. A library linked against a newer glibc asks for the newest version of
 * each symbol it calls; expf and logf gained a version in glibc 2.27, which alone would
 * keep the prebuilt library off older systems. They are bound to their x86-64 base
 * version instead (glibc keeps it: on 2.27 and later it is the same function behind an
 * errno wrapper), so the library needs glibc 2.17 at most, manylinux2014's floor
 * (cpu_native_build.required_glibc checks a build). ATTNKIT_TEST_NO_GLIBC_PINS is the
 * tests' broken variant.
 */
#if defined(__x86_64__) && defined(__GLIBC__) && !defined(ATTNKIT_TEST_NO_GLIBC_PINS)
__asm__(".symver expf,expf@GLIBC_2.2.5");
__asm__(".symver logf,logf@GLIBC_2.2.5");
#endif

/* Bumped on any change below: a library and its sources name the same version. */
#define ATTNKIT_ABI_VERSION 8

/* X(code, NAME, meaning): what a kernel returns instead of reading out of bounds. */
#define ATTNKIT_ERRORS(X)                                                                   \
    X(1, ROW, "rows[i] outside [0, T)")                                                    \
    X(2, REQUEST, "requests[i] (a block_table row) outside [0, B)")                        \
    X(3, KEY_START, "key_start[i] < 0")                                                    \
    X(4, KEY_END, "a key range past W * block_size")                                       \
    X(5, RANGE, "key_end[i] < key_start[i]")                                               \
    X(6, BLOCK, "a physical block outside [0, R / block_size)")                            \
    X(7, NOMEM, "scratch allocation failed")                                               \
    X(8, ARGS, "a size argument the wrapper should have refused")                          \
    X(9, QSL, "query rows outside [0, T) (query_start_loc, or a dense reader's key rows)") \
    X(10, SEQ, "seq_lens[r] < 0, < the query length when causal, or != it when dense")

enum {
    ATTNKIT_OK = 0,
#define ATTNKIT_ERR_ENUM_(code, name, meaning) ATTNKIT_ERR_##name = code,
    ATTNKIT_ERRORS(ATTNKIT_ERR_ENUM_)
#undef ATTNKIT_ERR_ENUM_
};

/* The leading parameters every attention entry point shares: the query dtype code, the
 * planes' format (kv_dtype and static 8-bit scales), the query, K and V planes (pointer,
 * row stride, head stride) and the block table (pointer, row stride, B, W, R). */
#define ATTNKIT_LEAD_ARGS(F, P)                                                             \
    F(i32, int, dtype)                                                                     \
    P(i32, int, kv_dtype) P(ptr, const float *, k_scale) P(ptr, const float *, v_scale)    \
    P(ptr, const void *, query) P(i64, int64_t, q_st) P(i64, int64_t, q_sh)                \
    P(ptr, const void *, k_plane) P(i64, int64_t, k_sr) P(i64, int64_t, k_sh)              \
    P(ptr, const void *, v_plane) P(i64, int64_t, v_sr) P(i64, int64_t, v_sh)              \
    P(ptr, const int32_t *, block_table) P(i64, int64_t, bt_sb) P(i64, int64_t, B)         \
    P(i64, int64_t, W) P(i64, int64_t, R)

/* ... and the trailing ones: scale, soft-cap, ALiBi slopes, sinks, the lse output, the
 * output, the thread count and err (int64[3]: where an error was found). */
#define ATTNKIT_TAIL_ARGS(P)                                                                \
    P(f32, float, scale) P(f32, float, soft_cap) P(ptr, const float *, alibi)              \
    P(ptr, const float *, sinks) P(ptr, float *, lse) P(i64, int64_t, lse_st)              \
    P(i64, int64_t, lse_sh) P(ptr, void *, output) P(i64, int64_t, o_st)                   \
    P(i64, int64_t, o_sh) P(i32, int, num_threads) P(ptr, int64_t *, err)

#define ATTNKIT_PAGED_DECODE_ARGS(F, P)                                                     \
    ATTNKIT_LEAD_ARGS(F, P)                                                                \
    P(ptr, const int64_t *, rows) P(ptr, const int32_t *, requests)                        \
    P(ptr, const int32_t *, key_start) P(ptr, const int32_t *, key_end)                    \
    P(ptr, const int32_t *, query_pos) P(i64, int64_t, N) P(i64, int64_t, T)               \
    P(i64, int64_t, Hq) P(i64, int64_t, Hkv) P(i64, int64_t, D) P(i64, int64_t, block_size) \
    P(i64, int64_t, pos_mul) P(i64, int64_t, pos_add)                                      \
    ATTNKIT_TAIL_ARGS(P)

#define ATTNKIT_PAGED_DECODE_REQUESTS_ARGS(F, P)                                            \
    ATTNKIT_LEAD_ARGS(F, P)                                                                \
    P(ptr, const int32_t *, query_start_loc) P(ptr, const int32_t *, seq_lens)             \
    P(ptr, const int32_t *, requests) P(i64, int64_t, n) P(i64, int64_t, T)                \
    P(i64, int64_t, Hq) P(i64, int64_t, Hkv) P(i64, int64_t, D) P(i64, int64_t, block_size) \
    P(i32, int, causal) P(i64, int64_t, window) P(i64, int64_t, chunk)                     \
    ATTNKIT_TAIL_ARGS(P)

#define ATTNKIT_PAGED_PREFILL_ARGS(F, P)                                                    \
    ATTNKIT_LEAD_ARGS(F, P)                                                                \
    P(ptr, const void *, key) P(i64, int64_t, kd_sr) P(i64, int64_t, kd_sh)                \
    P(ptr, const void *, value) P(i64, int64_t, vd_sr) P(i64, int64_t, vd_sh)              \
    P(ptr, const int32_t *, requests) P(ptr, const int32_t *, query_start)                 \
    P(ptr, const int32_t *, query_len) P(ptr, const int32_t *, seq_len)                    \
    P(ptr, const int32_t *, dense) P(i64, int64_t, n) P(i64, int64_t, T)                   \
    P(i64, int64_t, Hq) P(i64, int64_t, Hkv) P(i64, int64_t, D) P(i64, int64_t, block_size) \
    P(i32, int, causal) P(i64, int64_t, window) P(i64, int64_t, chunk)                     \
    P(i64, int64_t, query_block) ATTNKIT_TAIL_ARGS(P)

#define ATTNKIT_DECODE_ISA_ARGS(F, P) F(i32, int, dtype) P(i64, int64_t, D)
#define ATTNKIT_NO_ARGS(F, P)

/* X(return kind, return type, name, parameter list): every exported function but
 * attnkit_abi_table itself (the loader's one fixed signature: no parameters, a string). */
#define ATTNKIT_FUNCTIONS(X)                                                                \
    X(i32, int, abi_version, ATTNKIT_NO_ARGS)                                              \
    X(str, const char *, abi_errors, ATTNKIT_NO_ARGS)                                      \
    X(str, const char *, source_hash, ATTNKIT_NO_ARGS)                                     \
    X(str, const char *, build_variant, ATTNKIT_NO_ARGS)                                   \
    X(i32, int, has_openmp, ATTNKIT_NO_ARGS)                                               \
    X(ptr, void *, openmp_entry, ATTNKIT_NO_ARGS)                                          \
    X(str, const char *, prefill_isa, ATTNKIT_NO_ARGS)                                     \
    X(str, const char *, decode_isa, ATTNKIT_DECODE_ISA_ARGS)                              \
    X(i32, int, paged_decode, ATTNKIT_PAGED_DECODE_ARGS)                                   \
    X(i32, int, paged_decode_requests, ATTNKIT_PAGED_DECODE_REQUESTS_ARGS)                 \
    X(i32, int, paged_prefill, ATTNKIT_PAGED_PREFILL_ARGS)

/* A definition's parameter list: ATTNKIT_PARAMS(ATTNKIT_PAGED_DECODE_ARGS). */
#define ATTNKIT_PARAM_FIRST_(kind, type, name) type name
#define ATTNKIT_PARAM_NEXT_(kind, type, name) , type name
#define ATTNKIT_PARAMS(list) list(ATTNKIT_PARAM_FIRST_, ATTNKIT_PARAM_NEXT_)

#define ATTNKIT_API __attribute__((visibility("default")))

#endif /* ATTNKIT_ABI_H */
