/* CRC-32 (zlib's: reflected polynomial 0xEDB88320, pre- and post-inverted), the same values
 * as zlib.crc32, at memory speed on x86-64 with PCLMULQDQ.
 *
 * The fast path folds the message 64 bytes at a time in four 128-bit lanes: a lane X followed
 * by D more bits of message is replaced by X * x^D reduced to < 97 bits (two carry-less
 * products with x^(D+63) mod P and x^(D-1) mod P), which leaves the message's residue mod P --
 * and so its CRC -- unchanged. The lanes then fold into one 16-byte block, whose bytes and the
 * tail's go through the byte table. The constants are computed at first use, not typed in.
 * Without PCLMULQDQ (or off x86-64) the byte table does everything (slicing by 8).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static uint32_t table[8][256];
static int use_clmul = 0;

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MSMP_CRC_CLMUL 1
#include <immintrin.h>
static uint64_t k512_low, k512_high, k128_low, k128_high;

/* x^n mod P in the normal (unreflected) order: bit i is the coefficient of x^i. */
static uint32_t xpow_mod(unsigned n) {
    uint64_t r = 1;
    while (n--) {
        r <<= 1;
        if (r & 0x100000000ull) r ^= 0x104C11DB7ull;
    }
    return (uint32_t)r;
}

/* A polynomial of degree < 32 as the low half of a 64-bit reflected value (bit 63 - i holds
 * the coefficient of x^i), the operand order of the reflected carry-less products. */
static uint64_t reflect64(uint32_t poly) {
    uint64_t out = 0;
    for (int i = 0; i < 32; ++i)
        if (poly >> i & 1u) out |= 1ull << (63 - i);
    return out;
}
#endif

int msmp_crc32_accelerated(void);

/* Fills the tables and constants: call once, before any thread calls msmp_crc32. */
void msmp_crc32_init(void) {
    for (uint32_t n = 0; n < 256; ++n) {
        uint32_t c = n;
        for (int k = 0; k < 8; ++k) c = c & 1u ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; ++n)
        for (int s = 1; s < 8; ++s)
            table[s][n] = table[0][table[s - 1][n] & 0xFFu] ^ (table[s - 1][n] >> 8);
#ifdef MSMP_CRC_CLMUL
    /* A lane's low qword holds the x^(64..127) part, its high qword the x^(0..63) part. */
    k512_low = reflect64(xpow_mod(512 + 63));
    k512_high = reflect64(xpow_mod(512 - 1));
    k128_low = reflect64(xpow_mod(128 + 63));
    k128_high = reflect64(xpow_mod(128 - 1));
#endif
    use_clmul = msmp_crc32_accelerated();
}

/* The uninverted register over `len` bytes, slicing by 8. */
static uint32_t crc_bytes(uint32_t c, const uint8_t *p, size_t len) {
    while (len && ((uintptr_t)p & 7u)) {
        c = table[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
        --len;
    }
    while (len >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= c;  /* little-endian hosts only: x86-64, aarch64 */
        c = table[7][lo & 0xFFu] ^ table[6][lo >> 8 & 0xFFu] ^ table[5][lo >> 16 & 0xFFu] ^
            table[4][lo >> 24] ^ table[3][hi & 0xFFu] ^ table[2][hi >> 8 & 0xFFu] ^
            table[1][hi >> 16 & 0xFFu] ^ table[0][hi >> 24];
        p += 8;
        len -= 8;
    }
    while (len--) c = table[0][(c ^ *p++) & 0xFFu] ^ (c >> 8);
    return c;
}

#ifdef MSMP_CRC_CLMUL
__attribute__((target("pclmul,sse4.1")))
static inline __m128i fold(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_clmul(uint32_t c, const uint8_t *p, size_t len) {
    const __m128i k512 = _mm_set_epi64x((long long)k512_high, (long long)k512_low);
    const __m128i k128 = _mm_set_epi64x((long long)k128_high, (long long)k128_low);
    __m128i x0 = _mm_loadu_si128((const __m128i *)p);
    __m128i x1 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x2 = _mm_loadu_si128((const __m128i *)(p + 32));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 48));
    x0 = _mm_xor_si128(x0, _mm_cvtsi32_si128((int)c));  /* the register enters the first word */
    p += 64;
    len -= 64;
    while (len >= 64) {
        x0 = _mm_xor_si128(fold(x0, k512), _mm_loadu_si128((const __m128i *)p));
        x1 = _mm_xor_si128(fold(x1, k512), _mm_loadu_si128((const __m128i *)(p + 16)));
        x2 = _mm_xor_si128(fold(x2, k512), _mm_loadu_si128((const __m128i *)(p + 32)));
        x3 = _mm_xor_si128(fold(x3, k512), _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        len -= 64;
    }
    __m128i x = _mm_xor_si128(fold(x0, k128), x1);
    x = _mm_xor_si128(fold(x, k128), x2);
    x = _mm_xor_si128(fold(x, k128), x3);
    while (len >= 16) {
        x = _mm_xor_si128(fold(x, k128), _mm_loadu_si128((const __m128i *)p));
        p += 16;
        len -= 16;
    }
    uint8_t block[16];
    _mm_storeu_si128((__m128i *)block, x);
    return crc_bytes(crc_bytes(0, block, 16), p, len);
}
#endif

/* 1 when the carry-less multiply path runs on this CPU. */
int msmp_crc32_accelerated(void) {
#ifdef MSMP_CRC_CLMUL
    return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#else
    return 0;
#endif
}

/* The portable path alone (tests compare it with the fast one). */
uint32_t msmp_crc32_table(uint32_t value, const uint8_t *data, size_t len) {
    return ~crc_bytes(~value, data, len);
}

/* zlib.crc32(data, value), after msmp_crc32_init; reentrant (ctypes releases the GIL). */
uint32_t msmp_crc32(uint32_t value, const uint8_t *data, size_t len) {
    uint32_t c = ~value;
#ifdef MSMP_CRC_CLMUL
    if (use_clmul && len >= 128) return ~crc_clmul(c, data, len);
#endif
    return ~crc_bytes(c, data, len);
}
