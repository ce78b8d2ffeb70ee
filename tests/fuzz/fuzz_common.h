/* Shared by the libFuzzer harnesses: put the input bytes in a file the library can open by path.
 * A memfd (reopened through /proc/self/fd/N: a regular file, no disk traffic) when the kernel has
 * them, else one temporary file per process under $TMPDIR; either is rewritten for every input. */
#ifndef GDN_FUZZ_COMMON_H
#define GDN_FUZZ_COMMON_H

#define _GNU_SOURCE 1
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static int fuzz_fd = -1;
static char fuzz_path[4096];

static void fuzz_cleanup(void) {
    if (fuzz_fd >= 0 && strncmp(fuzz_path, "/proc/", 6) != 0) unlink(fuzz_path);
}

/* Write data to the per-process file and return its path (NULL on failure: skip the input). */
static const char *fuzz_file(const uint8_t *data, size_t size) {
    if (fuzz_fd < 0) {
#ifdef MFD_CLOEXEC
        fuzz_fd = memfd_create("gdn_fuzz", MFD_CLOEXEC);
        if (fuzz_fd >= 0) {
            snprintf(fuzz_path, sizeof fuzz_path, "/proc/self/fd/%d", fuzz_fd);
            if (access(fuzz_path, R_OK) != 0) close(fuzz_fd), fuzz_fd = -1; /* no /proc */
        }
#endif
        if (fuzz_fd < 0) {
            const char *tmp = getenv("TMPDIR");
            snprintf(fuzz_path, sizeof fuzz_path, "%s/gdn_fuzz_XXXXXX.safetensors",
                     tmp && *tmp ? tmp : "/tmp");
            fuzz_fd = mkstemps(fuzz_path, 12);
            if (fuzz_fd < 0) return NULL;
            atexit(fuzz_cleanup);
        }
    }
    if (ftruncate(fuzz_fd, 0) != 0) return NULL;
    for (size_t done = 0; done < size;) {
        ssize_t w = pwrite(fuzz_fd, data + done, size - done, (off_t)done);
        if (w <= 0) return NULL;
        done += (size_t)w;
    }
    return fuzz_path;
}

#endif
