/* Reads for expert streaming: whole aligned ranges with pread, looping over short reads. */
#ifndef MOESTREAM_IO_H
#define MOESTREAM_IO_H
#include <stdint.h>

/* Reads n bytes at offset into buf (for O_DIRECT: buf, offset and n aligned to the device block).
 * Returns the number of bytes read (< n only at end of file), or -errno. */
int64_t ms_pread_full(int fd, void *buf, int64_t n, int64_t offset);
#endif
