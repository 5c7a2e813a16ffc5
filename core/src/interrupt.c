/*
 * interrupt.c -- cancellation of long CPU work (gdp.h, "interrupts"): the flag the CPU
 * kernels poll, and the SIGINT handler the REPL installs to set it.
 *
 * The flag is a lock-free atomic, so that the signal handler may set it and every
 * worker thread of a kernel may read it.  The handler passes the signal on to the one
 * it replaced only outside a deferred window: inside one (a gdp call whose outputs
 * the caller does not own yet) an error raised by that handler -- LuaJIT's turns
 * SIGINT into a Lua error at the next instruction -- would lose the outputs.
 *
 * The kernels' OpenMP workers outlive their parallel regions, and the kernel may give
 * a process-directed SIGINT to any thread: one that lands on another thread than the
 * one that installed the handler is sent on to that thread (the REPL's: its blocking
 * read must return EINTR, and LuaJIT's handler must run there).
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

static atomic_int requested;
static atomic_int defer_depth;
static atomic_llong countdown; /* test hook: polls left before the flag is set; 0 = off */

static struct sigaction replaced; /* what the first install replaced */
static atomic_int installed;
static pthread_t owner; /* the thread of the latest install */

void gdp_interrupt_request(void) { atomic_store(&requested, 1); }
int gdp_interrupt_requested(void) { return atomic_load(&requested) != 0; }
void gdp_interrupt_clear(void) {
  atomic_store(&requested, 0);
  atomic_store(&countdown, 0);
}
void gdp_interrupt_defer(int delta) { atomic_fetch_add(&defer_depth, delta); }

void gdp_interrupt_request_after(int64_t polls) { atomic_store(&countdown, polls > 0 ? polls : 0); }

int gdp_interrupt_poll(void) {
  if (atomic_load_explicit(&requested, memory_order_relaxed)) return 1;
  if (atomic_load_explicit(&countdown, memory_order_relaxed) > 0 &&
      atomic_fetch_sub(&countdown, 1) == 1)
    atomic_store(&requested, 1);
  return atomic_load_explicit(&requested, memory_order_relaxed) != 0;
}

static void on_sigint(int sig) {
  atomic_store(&requested, 1);
  if (!pthread_equal(pthread_self(), owner)) {
    pthread_kill(owner, sig);
    return;
  }
  if (atomic_load(&defer_depth) > 0) return;
  if (replaced.sa_flags & SA_SIGINFO) return; /* not a plain handler: nothing to chain to */
  if (replaced.sa_handler == SIG_IGN) return;
  if (replaced.sa_handler == SIG_DFL) { /* what Ctrl-C did before: end the process */
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  replaced.sa_handler(sig);
}

gdp_status gdp_interrupt_install(void) {
  struct sigaction sa, old;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0; /* no SA_RESTART: a prompt blocked in read() sees EINTR */
  owner = pthread_self();
  if (sigaction(SIGINT, &sa, &old) != 0)
    return GDP_ERROR(GDP_ERR_INVALID_ARG, "sigaction(SIGINT) failed");
  if (!atomic_exchange(&installed, 1)) replaced = old;
  return GDP_OK;
}
