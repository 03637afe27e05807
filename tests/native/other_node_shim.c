/* LD_PRELOAD shim: a process as if on another node of a cluster sharing one filesystem, at the
 * system-call boundary (no privileges needed).
 *   NODE_SHIM_HOSTNAME=<name>  gethostname() answers <name>, and uname() too (its nodename:
 *                              Python's os.uname(), which megatron's rerun state machine reads)
 *   NODE_SHIM_NODENAME=<name>  uname() only: a name that need not resolve, where gethostname()
 *                              must (torchrun --standalone's rendezvous resolves it)
 *   LOCK_SHIM=enolck           every record-lock call fails with ENOLCK (NFS mounted nolock, a
 *                              lock manager gone)
 *   LOCK_SHIM=grant            every record-lock call succeeds without locking (locks each node
 *                              grants on its own: Lustre localflock, NFS local_lock=posix)
 * Everything else goes to the C library. Built by the tests that use it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/utsname.h>
#include <unistd.h>

static int is_record_lock(int cmd) {
    return cmd == F_SETLK || cmd == F_SETLKW || cmd == F_GETLK
#ifdef F_OFD_SETLK
        || cmd == F_OFD_SETLK || cmd == F_OFD_SETLKW || cmd == F_OFD_GETLK
#endif
        ;
}

static int answered(int cmd, void *arg, int *result) {
    const char *mode = getenv("LOCK_SHIM");
    if (!mode || !is_record_lock(cmd))
        return 0;
    if (strcmp(mode, "enolck") == 0) {
        errno = ENOLCK;
        *result = -1;
        return 1;
    }
    if (strcmp(mode, "grant") == 0) {
        if (cmd == F_GETLK)
            ((struct flock *)arg)->l_type = F_UNLCK;
        *result = 0;
        return 1;
    }
    return 0;
}

#define PASS_THROUGH(name)                                               \
    int name(int fd, int cmd, ...) {                                     \
        va_list ap;                                                      \
        va_start(ap, cmd);                                               \
        void *arg = va_arg(ap, void *);                                  \
        va_end(ap);                                                      \
        int result;                                                      \
        if (answered(cmd, arg, &result))                                 \
            return result;                                               \
        int (*real)(int, int, ...) = dlsym(RTLD_NEXT, #name);            \
        return real(fd, cmd, arg);                                       \
    }

PASS_THROUGH(fcntl)
PASS_THROUGH(fcntl64)

int gethostname(char *name, size_t len) {
    const char *host = getenv("NODE_SHIM_HOSTNAME");
    if (!host) {
        int (*real)(char *, size_t) = dlsym(RTLD_NEXT, "gethostname");
        return real(name, len);
    }
    size_t n = strlen(host);
    if (n + 1 > len) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(name, host, n + 1);
    return 0;
}

int uname(struct utsname *buf) {
    int (*real)(struct utsname *) = dlsym(RTLD_NEXT, "uname");
    int result = real(buf);
    const char *host = getenv("NODE_SHIM_HOSTNAME");
    if (!host)
        host = getenv("NODE_SHIM_NODENAME");
    if (result == 0 && host) {
        strncpy(buf->nodename, host, sizeof(buf->nodename) - 1);
        buf->nodename[sizeof(buf->nodename) - 1] = '\0';
    }
    return result;
}
