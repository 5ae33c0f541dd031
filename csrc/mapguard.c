/* The SIGBUS handler and its registry of mapped ranges (see mapguard.h). The handler may run at any
 * instant on any thread, so it only reads the registry (each slot is written whole before it is published,
 * with release stores) and calls write(2) and _exit(2), which are async-signal-safe. */
#define _GNU_SOURCE
#include "mapguard.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#define MAX_RANGES 256
#define MAX_PATH 1024
#define EXIT_INTEGRITY 4

typedef struct {
    uintptr_t base;   /* 0: a free slot */
    size_t length;
    char path[MAX_PATH];
} mapped_range;

static mapped_range ranges[MAX_RANGES];
static int installed;

/* ---- the handler: no allocation, no stdio, no locks ------------------------------------------------ */

static size_t append(char *buf, size_t at, size_t cap, const char *s) {
    while (*s && at + 1 < cap) buf[at++] = *s++;
    return at;
}

static size_t append_number(char *buf, size_t at, size_t cap, uint64_t v, int base) {
    char digits[24];
    int n = 0;
    do {
        digits[n++] = "0123456789abcdef"[v % (uint64_t)base];
        v /= (uint64_t)base;
    } while (v);
    while (n && at + 1 < cap) buf[at++] = digits[--n];
    return at;
}

static struct sigaction previous; /* SIGBUS's action before ours */

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    (void)sig;
    (void)context;
    uintptr_t addr = (uintptr_t)info->si_addr;
    char line[MAX_PATH + 160];
    size_t n = append(line, 0, sizeof line, "moestream: error: ");
    int found = 0;
    for (int i = 0; i < MAX_RANGES && !found; i++) {
        uintptr_t base = __atomic_load_n(&ranges[i].base, __ATOMIC_ACQUIRE);
        if (base && addr >= base && addr - base < ranges[i].length) {
            n = append(line, n, sizeof line, ranges[i].path);
            n = append(line, n, sizeof line, " was truncated or changed while mapped (SIGBUS at offset ");
            n = append_number(line, n, sizeof line, addr - base, 10);
            found = 1;
        }
    }
    if (!found) {
        /* not a fault in a model file: the handler before ours (or the default, a core dump) takes it when
           the faulting instruction runs again, so a genuine crash is not reported as a changed file */
        sigaction(SIGBUS, &previous, NULL);
        return;
    }
    n = append(line, n, sizeof line, ")\n");
    ssize_t unused = write(STDERR_FILENO, line, n);
    (void)unused;
    _exit(EXIT_INTEGRITY);
}

/* ---- registration (with the GIL held, so never two at once) ---------------------------------------- */

int ms_mapguard_install(void) {
    if (installed) return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0) return -errno;
    installed = 1;
    return 0;
}

int ms_mapguard_add(uintptr_t base, size_t length, const char *path) {
    if (!base) return -1;
    int free_slot = -1;
    for (int i = 0; i < MAX_RANGES; i++) {
        uintptr_t b = __atomic_load_n(&ranges[i].base, __ATOMIC_ACQUIRE);
        if (b == base) __atomic_store_n(&ranges[i].base, 0, __ATOMIC_RELEASE); /* rewritten below */
        if ((b == 0 || b == base) && free_slot < 0) free_slot = i;
    }
    if (free_slot < 0) return -1;
    mapped_range *r = &ranges[free_slot];
    r->length = length;
    strncpy(r->path, path, MAX_PATH - 1);
    r->path[MAX_PATH - 1] = '\0';
    __atomic_store_n(&r->base, base, __ATOMIC_RELEASE);
    return 0;
}

void ms_mapguard_remove(uintptr_t base) {
    for (int i = 0; i < MAX_RANGES; i++)
        if (__atomic_load_n(&ranges[i].base, __ATOMIC_ACQUIRE) == base)
            __atomic_store_n(&ranges[i].base, 0, __ATOMIC_RELEASE);
}
