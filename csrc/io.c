/* Reads for expert streaming (see io.h). Called with the GIL released, so several run in flight from
 * Python's I/O threads. */
#define _GNU_SOURCE
#include "io.h"

#include <errno.h>
#include <unistd.h>

int64_t ms_pread_full(int fd, void *buf, int64_t n, int64_t offset) {
    int64_t done = 0;
    while (done < n) {
        ssize_t r = pread(fd, (char *)buf + done, (size_t)(n - done), (off_t)(offset + done));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (r == 0) break; /* end of file */
        done += r;
    }
    return done;
}
