// as_avx2.so: an LD_PRELOAD library under which CPUID reports no AVX-512.
//
// Built and preloaded by tools/as_avx2.sh; see docs/development.md.
//
// x86-64 Linux only, on a CPU with CPUID faulting (`cpuid_fault` in
// /proc/cpuinfo). arch_prctl(ARCH_SET_CPUID, 0) makes every CPUID
// instruction of the process trap with SIGSEGV; threads and forked children
// inherit that, and an exec'd program gets it again through LD_PRELOAD. The
// handler runs the real CPUID with faulting off for that one instruction,
// clears the AVX-512 feature bits (and the AVX-512 state components of leaf
// 0xD), writes the answer into the trapped registers and steps over the
// 2-byte instruction. Code that picks its kernels from CPUID at run time
// (XLA:CPU's target detection, YNNPACK, XNNPACK, oneDNN, numpy) then picks
// those of an AVX2 CPU, and runs them natively, float16 conversions included.
//
// AS_AVX2_VERBOSE=1 prints at exit how many CPUID instructions were
// answered.
//
// Any other SIGSEGV goes to the handler the program installed (Python's
// faulthandler, for one) or kills the process as it would have: this
// library keeps its handler in place by wrapping sigaction() and signal()
// for SIGSEGV, and remembers the program's.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#ifndef ARCH_SET_CPUID
#define ARCH_SET_CPUID 0x1012
#endif

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
static sigaction_fn real_sigaction;
static struct sigaction program_segv;  // The program's SIGSEGV disposition.
static volatile long answered;

static long cpuid_faults(int on) {
  return syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1);
}

static void edit(uint32_t leaf, uint32_t sub, uint32_t r[4]) {
  if (leaf == 7 && sub == 0) {
    // EBX: AVX512F, DQ, IFMA, PF, ER, CD, BW, VL.
    r[1] &= ~(1u << 16 | 1u << 17 | 1u << 21 | 1u << 26 | 1u << 27 |
              1u << 28 | 1u << 30 | 1u << 31);
    // ECX: AVX512_VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ.
    r[2] &= ~(1u << 1 | 1u << 6 | 1u << 11 | 1u << 12 | 1u << 14);
    // EDX: AVX512_4VNNIW, 4FMAPS, VP2INTERSECT, FP16.
    r[3] &= ~(1u << 2 | 1u << 3 | 1u << 8 | 1u << 23);
  } else if (leaf == 7 && sub == 1) {
    r[0] &= ~(1u << 5);  // EAX: AVX512_BF16.
  } else if (leaf == 0xd && sub == 0) {
    r[0] &= ~(1u << 5 | 1u << 6 | 1u << 7);  // opmask, ZMM_Hi256, Hi16_ZMM.
  }
}

static void on_segv(int sig, siginfo_t *info, void *context) {
  greg_t *g = ((ucontext_t *)context)->uc_mcontext.gregs;
  const unsigned char *ip = (const unsigned char *)g[REG_RIP];
  if (info->si_code == SI_KERNEL && ip[0] == 0x0f && ip[1] == 0xa2) {
    uint32_t leaf = (uint32_t)g[REG_RAX], sub = (uint32_t)g[REG_RCX], r[4];
    cpuid_faults(0);
    __asm__ volatile("cpuid"
                     : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3])
                     : "a"(leaf), "c"(sub));
    cpuid_faults(1);
    edit(leaf, sub, r);
    g[REG_RAX] = r[0];
    g[REG_RBX] = r[1];
    g[REG_RCX] = r[2];
    g[REG_RDX] = r[3];
    g[REG_RIP] += 2;
    answered++;
    return;
  }
  // A real fault: the program's handler, else the default action (the
  // faulting instruction runs again on return, and the process dies).
  if (program_segv.sa_flags & SA_SIGINFO) {
    program_segv.sa_sigaction(sig, info, context);
  } else if (program_segv.sa_handler != SIG_DFL &&
             program_segv.sa_handler != SIG_IGN) {
    program_segv.sa_handler(sig);
  } else {
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    real_sigaction(SIGSEGV, &dfl, NULL);
  }
}

static void find_sigaction(void) {
  if (!real_sigaction) {
    real_sigaction = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
  }
}

int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
  find_sigaction();
  if (sig != SIGSEGV) return real_sigaction(sig, act, old);
  if (old) *old = program_segv;
  if (act) program_segv = *act;
  return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
  struct sigaction act, old;
  memset(&act, 0, sizeof act);
  act.sa_handler = handler;
  act.sa_flags = SA_RESTART;
  if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
  return old.sa_handler;
}

__attribute__((constructor)) static void as_avx2_start(void) {
  find_sigaction();
  program_segv.sa_handler = SIG_DFL;
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_segv;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
  if (real_sigaction(SIGSEGV, &sa, NULL) != 0 || cpuid_faults(1) != 0) {
    perror("as_avx2: no CPUID faulting (arch_prctl ARCH_SET_CPUID)");
    _exit(3);
  }
}

__attribute__((destructor)) static void as_avx2_end(void) {
  if (getenv("AS_AVX2_VERBOSE")) {
    fprintf(stderr, "as_avx2: %ld CPUID instructions answered\n", answered);
  }
}
