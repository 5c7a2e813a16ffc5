/*
 * error.c -- status names and the thread-local "last error" message.
 *
 * Messages read "<func>: <text> (<file>:<line>)" with the file relative to the
 * repository, so that they are stable across checkouts and short enough to read.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

enum { GDP_ERROR_MSG_MAX = 2048 };

static _Thread_local char last_error[GDP_ERROR_MSG_MAX];

const char *gdp_status_name(gdp_status status) {
  switch (status) {
    case GDP_OK: return "GDP_OK";
    case GDP_ERR_INVALID_ARG: return "GDP_ERR_INVALID_ARG";
    case GDP_ERR_SHAPE: return "GDP_ERR_SHAPE";
    case GDP_ERR_DTYPE: return "GDP_ERR_DTYPE";
    case GDP_ERR_OOM: return "GDP_ERR_OOM";
    case GDP_ERR_CUDA: return "GDP_ERR_CUDA";
    case GDP_ERR_NCCL: return "GDP_ERR_NCCL";
    case GDP_ERR_MPI: return "GDP_ERR_MPI";
    case GDP_ERR_UNSUPPORTED: return "GDP_ERR_UNSUPPORTED";
    case GDP_ERR_IO: return "GDP_ERR_IO";
    case GDP_ERR_INTERNAL: return "GDP_ERR_INTERNAL";
    case GDP_ERR_INTERRUPTED: return "GDP_ERR_INTERRUPTED";
  }
  return "GDP_ERR_UNKNOWN";
}

const char *gdp_last_error(void) { return last_error; }

void gdp_clear_error(void) { last_error[0] = '\0'; }

/* __FILE__ is whatever path the build gave the compiler (often absolute).  Keep the
 * part from the last "core/" or "kernels/" directory on. */
static const char *repo_relative(const char *file) {
  if (!file) return "?";
  const char *best = NULL;
  static const char *const roots[] = {"core/", "kernels/"};
  for (size_t r = 0; r < sizeof roots / sizeof roots[0]; r++) {
    for (const char *p = strstr(file, roots[r]); p; p = strstr(p + 1, roots[r])) {
      /* only whole directory names: at the start or right after a '/' */
      if ((p == file || p[-1] == '/') && (!best || p > best)) best = p;
    }
  }
  return best ? best : file;
}

gdp_status gdp_set_error(gdp_status status, const char *func, const char *file, int line,
                         const char *fmt, ...) {
  /* Format into a local buffer first: the arguments may include gdp_last_error()
   * itself (a caller adding context to a callee's message). */
  char text[GDP_ERROR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(text, sizeof text, fmt ? fmt : "", ap);
  va_end(ap);
  int n = snprintf(last_error, sizeof last_error, "%s: %s (%s:%d)", func ? func : "gdp", text,
                   repo_relative(file), line);
  if (n >= (int)sizeof last_error) /* show that the message was cut */
    memcpy(last_error + sizeof last_error - 4, "...", 4);
  return status;
}

const char *gdp_shape_str(char *buf, size_t buflen, int ndim, const int64_t *shape) {
  if (!buf || buflen == 0) return "";
  size_t used = 0;
  int n = snprintf(buf, buflen, "[");
  used = n > 0 ? (size_t)n : 0;
  for (int i = 0; i < ndim && used < buflen; i++) {
    n = snprintf(buf + used, buflen - used, i ? "x%lld" : "%lld", (long long)shape[i]);
    if (n < 0) break;
    used += (size_t)n;
  }
  if (used < buflen) snprintf(buf + used, buflen - used, "]");
  return buf;
}
