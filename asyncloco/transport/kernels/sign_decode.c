/* Decoding of the sign codecs sgn{p}of{q} (asyncloco/transport/codecs_sign.py has the format and the reference
 * decoder in numpy; asyncloco/transport/native.py compiles this file at first use and calls it through ctypes).
 *
 * Whole 512-value blocks only: a block holds 512 / q whole groups and 512 · p / q sign bits, a whole number of
 * bytes for every (p, q) the registry has. The caller has checked the rotation and the scales (finite, >= 0) and
 * hands in the block scales widened to float32. A kept value is its block's scale with the sign bit set for a 1
 * bit (so a zero scale gives -0.0 for a 1 bit, exactly as the reference's (-1.0) * 0.0); dropped positions are
 * +0.0.
 *
 * The kept positions of a group are (r + t) mod q, t < p, and the bits run in ascending position. Seen from
 * position r on, that is "p kept, q - p dropped" repeated: a block's bits are the head = max(0, r + p - q) kept
 * positions before r (0 .. head - 1), then one run of p bits per group, starting at position r + g·q (the last
 * run cut at the block's end). So each run is one vector of q lanes (lane t: bit t of the run, or 0 for t >= p),
 * written at an aligned place of a frame in the cache; the block is then streamed from the frame to the output.
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 512

typedef uint32_t lanes8 __attribute__((vector_size(32)));

/* p == q: every byte of sign bits is 8 values */
static inline void expand(const uint8_t *bits, int nbytes, uint32_t magnitude, uint32_t *values) {
    const lanes8 shift = {0, 1, 2, 3, 4, 5, 6, 7};
    const lanes8 zero = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < nbytes; i++) {
        lanes8 lanes = ((((bits[i] + zero) >> shift) & 1u) << 31) | magnitude;
        memcpy(values + 8 * i, &lanes, sizeof lanes);
    }
}

/* AVX2 where the CPU has it (per-lane shifts), chosen when the library loads; plain x86-64 otherwise */
#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* the (at least 25) bits from bit offset at on: 4 bytes read from at's byte (the caller keeps them in bounds) */
static inline uint32_t run_bits(const uint8_t *bits, int at) {
    uint32_t word;
    memcpy(&word, bits + (at >> 3), 4);
    return word >> (at & 7);
}

/* a decoded block (in the cache) to the output: streaming stores where aligned, so that writing θ-sized output
 * does not first read it into the cache (the decoder is memory-bound at 2 threads) */
#if defined(__x86_64__)
#include <emmintrin.h>
static inline void store_block(uint32_t *o, const uint32_t *block) {
    if (((uintptr_t)o & 15) == 0) {
        for (int i = 0; i < BLOCK; i += 4) _mm_stream_si128((__m128i *)(o + i), _mm_loadu_si128((const __m128i *)(block + i)));
    } else {
        memcpy(o, block, BLOCK * 4);
    }
}
static inline void store_fence(void) { _mm_sfence(); }
#else
static inline void store_block(uint32_t *o, const uint32_t *block) { memcpy(o, block, BLOCK * 4); }
static inline void store_fence(void) {}
#endif

#define DEFINE_SHAPE(P, Q)                                                                                          \
    CLONES static void decode_##P##of##Q(const uint8_t *packed, uint32_t *out, const float *scales, int64_t blocks,  \
                                         int r, int groups) {                                                       \
        enum { BYTES = BLOCK / Q * P / 8 };                                                                         \
        const int head = r + P > Q ? r + P - Q : 0;                                                                 \
        uint8_t last[BYTES + 4];                                                                                    \
        /* the block is built in a frame whose runs start Q-aligned: frame + Q + g·Q is run g, frame + Q − r is     \
         * the block's first value (positions 0 .. r − 1: the head, then zeros), read back unaligned */             \
        uint32_t frame[BLOCK + 2 * Q] __attribute__((aligned(64)));                                                 \
        uint32_t *block = frame + Q - r;                                                                            \
        typedef uint32_t run_t __attribute__((vector_size(4 * Q)));                                                 \
        run_t zero, shift, keep;                                                                                    \
        for (int t = 0; t < Q; t++) {                                                                               \
            zero[t] = 0;                                                                                            \
            shift[t] = (uint32_t)t;                                                                                 \
            keep[t] = t < P ? 0xFFFFFFFFu : 0u;                                                                     \
        }                                                                                                           \
        for (int64_t b = 0; b < blocks; b++) {                                                                      \
            uint32_t magnitude;                                                                                     \
            memcpy(&magnitude, scales + b, 4);                                                                      \
            const uint8_t *bits = packed + b * BYTES; /* a 4-byte read may pass the block: into the next one */     \
            if (b + 1 == blocks) { /* the last block: its bits into a buffer with zero padding */                  \
                memset(last, 0, sizeof last);                                                                       \
                memcpy(last, bits, BYTES);                                                                          \
                bits = last;                                                                                        \
            }                                                                                                       \
            if (P == Q) {                                                                                           \
                expand(bits, BYTES, magnitude, frame);                                                              \
                store_block(out + b * BLOCK, frame);                                                                \
                continue;                                                                                           \
            }                                                                                                       \
            uint32_t first = run_bits(bits, 0);                                                                     \
            for (int j = 0; j < head; j++) block[j] = magnitude | (((first >> j) & 1u) << 31);                      \
            for (int j = head; j < r; j++) block[j] = 0;                                                            \
            /* every run whole: the last one's values past the block (r > 0) land past it in the frame, unread */   \
            for (int g = 0; g < groups; g++) { /* one vector of Q lanes per run: lane t < P is bit t, the rest 0 */ \
                uint32_t word = run_bits(bits, head + g * P);                                                       \
                run_t lanes = ((((word + zero) >> shift) & 1u) << 31 | magnitude) & keep;                           \
                memcpy(frame + Q + g * Q, &lanes, sizeof lanes);                                                    \
            }                                                                                                       \
            store_block(out + b * BLOCK, block);                                                                    \
        }                                                                                                           \
        store_fence();                                                                                              \
    }

DEFINE_SHAPE(1, 1)
DEFINE_SHAPE(15, 16)
DEFINE_SHAPE(7, 8)
DEFINE_SHAPE(3, 4)
DEFINE_SHAPE(5, 8)
DEFINE_SHAPE(1, 2)

int asyncloco_sign_decode(const uint8_t *packed, float *out, const float *scales, int64_t blocks, int p, int q,
                          int rotation) {
    if (rotation < 0 || rotation >= q) return -1;
    uint32_t *o = (uint32_t *)out;
#define SHAPE(P, Q)                                                                                                 \
    if (p == P && q == Q) {                                                                                         \
        decode_##P##of##Q(packed, o, scales, blocks, rotation, BLOCK / Q);                                         \
        return 0;                                                                                                   \
    }
    SHAPE(1, 1) SHAPE(15, 16) SHAPE(7, 8) SHAPE(3, 4) SHAPE(5, 8) SHAPE(1, 2)
#undef SHAPE
    return -1;
}
