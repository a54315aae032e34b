/* An AVX2-only x86 CPU, as the processes of one benchmark run see it, on a CPU that has more.
 *
 * Loaded with LD_PRELOAD. It turns on Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID):
 * every CPUID instruction then traps, and the handler answers with the CPU's own answer less
 * the AVX-512, AVX-VNNI, AVX10 and AMX bits. Runtimes pick their kernels from CPUID (ONNX
 * Runtime's MLAS, oneDNN in OpenVINO, numpy), so they pick the AVX2 kernels an AVX2-only CPU
 * runs; those then run natively, at full speed. /proc/cpuinfo, which parity records and reads
 * for its int8 choices, is served with the same flags removed.
 * The mode is per thread, inherited by threads and forks and reset by exec (where the preload
 * installs it again). A SIGSEGV handler the program installs still gets every other fault. */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
static sigaction_fn real_sigaction;
static struct sigaction program_segv; /* the SIGSEGV handler the program asked for */

static int cpuid_faulting(int on) { return (int)syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1); }

static void cpuid(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

#define BIT(n) (1u << (n))
static void mask(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
    if (leaf == 7 && sub == 0) {
        /* EBX: avx512 f dq ifma pf er cd bw vl; ECX: vbmi vbmi2 vnni bitalg vpopcntdq;
         * EDX: 4vnniw 4fmaps vp2intersect amx-bf16 avx512fp16 amx-tile amx-int8 */
        r[1] &= ~(BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31));
        r[2] &= ~(BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14));
        r[3] &= ~(BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25));
    } else if (leaf == 7 && sub == 1) {
        /* EAX: avx-vnni avx512-bf16 amx-fp16 avx-ifma; EDX: avx-vnni-int8 avx-ne-convert avx-vnni-int16 avx10 */
        r[0] &= ~(BIT(4) | BIT(5) | BIT(21) | BIT(23));
        r[3] &= ~(BIT(4) | BIT(5) | BIT(10) | BIT(19));
    }
}

static void restore_program_handler(int sig, siginfo_t *info, void *context) {
    if ((program_segv.sa_flags & SA_SIGINFO) && program_segv.sa_sigaction) {
        program_segv.sa_sigaction(sig, info, context);
    } else if (program_segv.sa_handler != SIG_DFL && program_segv.sa_handler != SIG_IGN) {
        program_segv.sa_handler(sig);
    } else { /* the fault repeats on return and ends the process as it would have */
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        real_sigaction(SIGSEGV, &dfl, 0);
    }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
    greg_t *g = ((ucontext_t *)context)->uc_mcontext.gregs;
    const uint8_t *ip = (const uint8_t *)g[REG_RIP];
    if (info->si_code != SI_KERNEL || ip[0] != 0x0f || ip[1] != 0xa2) {
        restore_program_handler(sig, info, context);
        return;
    }
    uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX], r[4];
    cpuid_faulting(0);
    cpuid(leaf, sub, r);
    cpuid_faulting(1);
    mask(leaf, sub, r);
    g[REG_RAX] = r[0];
    g[REG_RBX] = r[1];
    g[REG_RCX] = r[2];
    g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (sig != SIGSEGV) return real_sigaction(sig, act, old);
    if (old) *old = program_segv;
    if (act) program_segv = *act;
    return 0;
}

/* glibc's signal() reaches its sigaction internally, past the one above */
sighandler_t signal(int sig, sighandler_t handler) {
    struct sigaction act, old;
    memset(&act, 0, sizeof act);
    act.sa_handler = handler;
    act.sa_flags = SA_RESTART;
    sigemptyset(&act.sa_mask);
    sigaddset(&act.sa_mask, sig);
    return sigaction(sig, &act, &old) == 0 ? old.sa_handler : SIG_ERR;
}

static int masked_flag(const char *flag, size_t n) {
    static const char *prefixes[] = {"avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10"};
    for (size_t i = 0; i < sizeof prefixes / sizeof *prefixes; i++)
        if (n >= strlen(prefixes[i]) && strncmp(flag, prefixes[i], strlen(prefixes[i])) == 0) return 1;
    return 0;
}

/* /proc/cpuinfo with the masked flags left out, as a file in memory */
static int masked_cpuinfo(void) {
    int in = (int)syscall(SYS_openat, AT_FDCWD, "/proc/cpuinfo", O_RDONLY | O_CLOEXEC);
    int out = memfd_create("cpuinfo", MFD_CLOEXEC);
    if (in < 0 || out < 0) return -1;
    FILE *src = fdopen(in, "r"), *dst = fdopen(dup(out), "w");
    char line[8192];
    while (fgets(line, sizeof line, src)) {
        if (strncmp(line, "flags", 5) != 0) { fputs(line, dst); continue; }
        char *colon = strchr(line, ':');
        if (!colon) { fputs(line, dst); continue; }
        fwrite(line, 1, (size_t)(colon + 1 - line), dst);
        for (char *word = strtok(colon + 1, " \n"); word; word = strtok(NULL, " \n"))
            if (!masked_flag(word, strlen(word))) fprintf(dst, " %s", word);
        fputc('\n', dst);
    }
    fclose(src);
    fclose(dst);
    lseek(out, 0, SEEK_SET);
    return out;
}

static int opened(int dirfd, const char *path, int flags, mode_t mode) {
    if (strcmp(path, "/proc/cpuinfo") == 0) return masked_cpuinfo();
    return (int)syscall(SYS_openat, dirfd, path, flags, mode);
}

static mode_t mode_of(int flags, va_list args) {
    return (flags & O_CREAT) || (flags & __O_TMPFILE) == __O_TMPFILE ? va_arg(args, mode_t) : 0;
}

int open(const char *path, int flags, ...) {
    va_list args; va_start(args, flags); mode_t mode = mode_of(flags, args); va_end(args);
    return opened(AT_FDCWD, path, flags, mode);
}
int open64(const char *path, int flags, ...) {
    va_list args; va_start(args, flags); mode_t mode = mode_of(flags, args); va_end(args);
    return opened(AT_FDCWD, path, flags, mode);
}
int openat(int dirfd, const char *path, int flags, ...) {
    va_list args; va_start(args, flags); mode_t mode = mode_of(flags, args); va_end(args);
    return opened(dirfd, path, flags, mode);
}
int openat64(int dirfd, const char *path, int flags, ...) {
    va_list args; va_start(args, flags); mode_t mode = mode_of(flags, args); va_end(args);
    return opened(dirfd, path, flags, mode);
}

__attribute__((constructor)) static void install(void) {
    real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    program_segv.sa_handler = SIG_DFL;
    struct sigaction handler;
    memset(&handler, 0, sizeof handler);
    handler.sa_sigaction = on_segv;
    handler.sa_flags = SA_SIGINFO | SA_NODEFER;
    real_sigaction(SIGSEGV, &handler, 0);
    cpuid_faulting(1);
}
