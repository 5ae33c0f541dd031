/* A file truncated while it is memory-mapped makes the next touch of a page past its new end raise SIGBUS,
 * which would kill the process without a word. The handler here names the file (from a registry of the
 * mapped ranges) in one line on stderr and exits with the integrity code, 4. */
#ifndef MOESTREAM_MAPGUARD_H
#define MOESTREAM_MAPGUARD_H
#include <stddef.h>
#include <stdint.h>

/* Installs the SIGBUS handler (once; later calls do nothing). Returns 0, or -errno. */
int ms_mapguard_install(void);

/* Remembers [base, base + length) as a map of path (replacing a range at the same base). Returns 0, or -1
 * when the registry is full (the handler then prints its generic line for that range). */
int ms_mapguard_add(uintptr_t base, size_t length, const char *path);

/* Forgets the range at base (its map is closed). */
void ms_mapguard_remove(uintptr_t base);
#endif
