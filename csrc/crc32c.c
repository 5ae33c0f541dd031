/* CRC-32C (see crc32c.h). The hardware path runs three independent crc32 streams over three adjacent
 * stretches of each block (the instruction's latency is three times its issue interval, so one stream
 * would leave two thirds of the unit idle) and joins them with multiplications modulo the polynomial. The
 * portable path is slicing-by-8 over tables made at first use. */
#include "crc32c.h"

#include <pthread.h>
#include <string.h>

#if defined(__x86_64__) /* the 64-bit crc32 instruction: no such intrinsic on 32-bit x86 */
#define MS_CRC_X86 1
#include <immintrin.h>
#endif

#define POLY 0x82F63B78u /* the Castagnoli polynomial, bit-reflected */

/* ---- portable path: slicing-by-8 ------------------------------------------------------------------- */

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void make_tables(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t c = b;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][b] = c;
    }
    for (uint32_t b = 0; b < 256; b++)
        for (int s = 1; s < 8; s++) table[s][b] = (table[s - 1][b] >> 8) ^ table[0][table[s - 1][b] & 0xFF];
}

/* The CRC register (the complemented CRC) after n more bytes. */
static uint32_t portable_register(uint32_t reg, const uint8_t *p, size_t n) {
    pthread_once(&table_once, make_tables);
    while (n && ((uintptr_t)p & 7)) {
        reg = (reg >> 8) ^ table[0][(reg ^ *p++) & 0xFF];
        n--;
    }
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8); /* little-endian hosts only, as the rest of the kernels */
        v ^= reg;
        reg = table[7][v & 0xFF] ^ table[6][(v >> 8) & 0xFF] ^ table[5][(v >> 16) & 0xFF] ^
              table[4][(v >> 24) & 0xFF] ^ table[3][(v >> 32) & 0xFF] ^ table[2][(v >> 40) & 0xFF] ^
              table[1][(v >> 48) & 0xFF] ^ table[0][v >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) reg = (reg >> 8) ^ table[0][(reg ^ *p++) & 0xFF];
    return reg;
}

uint32_t ms_crc32c_portable(uint32_t crc, const void *p, size_t n) {
    return ~portable_register(~crc, (const uint8_t *)p, n);
}

#ifdef MS_CRC_X86
/* ---- hardware path: SSE4.2 crc32, three streams ---------------------------------------------------- */

/* bytes of each of the three streams of a block; the joins cost two multiplications a block */
#define STRIDE 4096

/* a * b modulo the polynomial, both bit-reflected (the bit for x^0 is the top bit) */
static uint32_t mul_mod_poly(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int i = 0; i < 32; i++) {
        if (a & (0x80000000u >> i)) product ^= b;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1; /* b * x */
    }
    return product;
}

/* x^(8 * n) modulo the polynomial: what a register is multiplied by when n zero bytes follow it */
static uint32_t x_to_8n(size_t n) {
    uint32_t result = 0x80000000u, square = 0x00800000u; /* x^0, x^8 */
    for (; n; n >>= 1) {
        if (n & 1) result = mul_mod_poly(result, square);
        square = mul_mod_poly(square, square);
    }
    return result;
}

static uint32_t shift_stride, shift_2stride; /* x^(8 STRIDE), x^(16 STRIDE) */
static int hardware = -1;
static pthread_once_t hardware_once = PTHREAD_ONCE_INIT;

static void detect(void) {
    __builtin_cpu_init();
    hardware = __builtin_cpu_supports("sse4.2") ? 1 : 0;
    shift_stride = x_to_8n(STRIDE);
    shift_2stride = x_to_8n(2 * STRIDE);
}

__attribute__((target("sse4.2"))) static uint32_t hardware_register(uint32_t reg, const uint8_t *p, size_t n) {
    while (n && ((uintptr_t)p & 7)) {
        reg = _mm_crc32_u8(reg, *p++);
        n--;
    }
    while (n >= 3 * STRIDE) {
        uint64_t a = reg, b = 0, c = 0;
        const uint8_t *end = p + STRIDE;
        for (; p < end; p += 8) {
            uint64_t va, vb, vc;
            memcpy(&va, p, 8);
            memcpy(&vb, p + STRIDE, 8);
            memcpy(&vc, p + 2 * STRIDE, 8);
            a = _mm_crc32_u64(a, va);
            b = _mm_crc32_u64(b, vb);
            c = _mm_crc32_u64(c, vc);
        }
        /* the register over a ‖ b ‖ c: a then 2 STRIDE zero bytes, b then STRIDE, c as it is */
        reg = mul_mod_poly((uint32_t)a, shift_2stride) ^ mul_mod_poly((uint32_t)b, shift_stride) ^ (uint32_t)c;
        p += 2 * STRIDE;
        n -= 3 * STRIDE;
    }
    uint64_t r = reg;
    for (; n >= 8; p += 8, n -= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        r = _mm_crc32_u64(r, v);
    }
    reg = (uint32_t)r;
    while (n--) reg = _mm_crc32_u8(reg, *p++);
    return reg;
}

int ms_crc32c_hardware(void) {
    pthread_once(&hardware_once, detect);
    return hardware;
}

uint32_t ms_crc32c(uint32_t crc, const void *p, size_t n) {
    if (ms_crc32c_hardware()) return ~hardware_register(~crc, (const uint8_t *)p, n);
    return ms_crc32c_portable(crc, p, n);
}
#else
int ms_crc32c_hardware(void) { return 0; }

uint32_t ms_crc32c(uint32_t crc, const void *p, size_t n) { return ms_crc32c_portable(crc, p, n); }
#endif
