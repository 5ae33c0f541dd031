/* CRC-32C (Castagnoli), as iSCSI, ext4 and SSE4.2's crc32 instruction compute it: the checksum of every
 * entry and expert blob of a packed store. */
#ifndef MOESTREAM_CRC32C_H
#define MOESTREAM_CRC32C_H
#include <stddef.h>
#include <stdint.h>

/* The CRC-32C of n bytes at p continuing crc (0 to start; the result of an earlier call to go on), with the
 * SSE4.2 instruction when the CPU has it, else the table-driven path. Thread-safe; call with the GIL
 * released. */
uint32_t ms_crc32c(uint32_t crc, const void *p, size_t n);

/* The same with the portable table-driven path only (tests compare the two). */
uint32_t ms_crc32c_portable(uint32_t crc, const void *p, size_t n);

/* Whether ms_crc32c uses the SSE4.2 instruction on this CPU. */
int ms_crc32c_hardware(void);
#endif
