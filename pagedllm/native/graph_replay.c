// A CPU graph's kernel calls replayed in one call from Python (native/graph.py): the recorded calls, each a kernel's
// address and its arguments, are made here in order, so a replayed decode step pays ctypes' per-call cost (about
// 2 us: a few hundred calls a step) once instead of once a kernel.
//
// C cannot call a function of a signature known only at run time, but the psABI can. Every kernel's arguments
// are pointers, int, int64_t or float, and it returns int (a status) or nothing. Under the x86-64 System V and the
// AArch64 procedure-call standards, integer and pointer arguments go, in order, into the integer argument
// registers and then 8-byte stack slots, and float arguments, in order, into the vector registers, each class
// counted on its own; extra arguments are the caller's to place and remove, and the callee never sees them. So
// calling every kernel as AnyKernel below, its integer arguments first in their order (each widened to 64 bits:
// the callee reads an int from the low half, which on a little-endian stack slot is the slot's first 4 bytes),
// then its float arguments in their order (each a float's bits in the low 32 bits of a double's, which the
// register carries unchanged, where the callee reads a float), places each where the kernel's own prototype
// would. Apple's AArch64 ABI packs stack arguments by size, and Windows' x64 one counts both classes together:
// there graph_replay_available() says 0 and graphs replay call by call from Python.
#include <stdint.h>

#define GRAPH_INT_ARGS 24    // integer-class arguments a recorded call may have (the most a kernel takes: 21)
#define GRAPH_FLOAT_ARGS 8   // float arguments: one vector register each, never on the stack

typedef struct {
    void *kernel;
    int64_t returns_status;  // the kernel returns int: 0 on success, else replay stops at it
    int64_t ints[GRAPH_INT_ARGS];
    double floats[GRAPH_FLOAT_ARGS];
} GraphCall;

#if defined(__x86_64__) && !defined(_WIN32) || defined(__aarch64__) && !defined(__APPLE__)
#define GRAPH_REPLAY_ABI 1
#else
#define GRAPH_REPLAY_ABI 0
#endif

typedef int64_t (*AnyKernel)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                             double, double, double, double, double, double, double, double);

int graph_replay_available(void) { return GRAPH_REPLAY_ABI; }

// Makes calls[0..n) in order. Returns 0, or i + 1 for the first call i that returned a nonzero status, which
// *status then holds; the calls after it are not made.
int64_t graph_replay(const GraphCall *calls, int64_t n, int *status) {
#if GRAPH_REPLAY_ABI
    for (int64_t i = 0; i < n; i++) {
        const int64_t *a = calls[i].ints;
        const double *f = calls[i].floats;
        int result = (int)((AnyKernel)calls[i].kernel)(
            a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
            a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]);
        if (calls[i].returns_status && result != 0) {
            *status = result;
            return i + 1;
        }
    }
#else
    (void)calls, (void)n, (void)status;
#endif
    return 0;
}
