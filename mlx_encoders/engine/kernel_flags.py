"""MLX's compiled CPU kernels built for this machine's vector units. `mx.compile` fuses element-wise ops into C++
kernels that MLX builds at run time with `g++ -std=c++17 -O3 ...`; its Linux wheel adds no target flag, so they are
built for the baseline x86-64 (SSE2: four floats a vector) whatever the processor has. `forwarding_popen(flags)` is
a popen that adds `flags` (AVX2's, from `runtime.NATIVE_FLAGS`) to that one command and runs every other as given;
`runtime.native_kernels` writes it into libmlx's popen slot, so that no other code in the process, and no child
process, sees a change. It is a few lines of C, compiled on first need (`helpers.build`).
"""

import ctypes

from .helpers import build

FLAGS_BYTES = 128  # the C source's flags buffer, its terminating zero included
SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FLAGS_BYTES @FLAGS_BYTES@

typedef FILE *(*popen_fn)(const char *, const char *);
static popen_fn real_popen;
static char flags[FLAGS_BYTES];
static const char compile[] = "g++ -std=c++17 ";
static volatile int rewritten;

void kernel_flags_init(popen_fn p, const char *f) {
  real_popen = p;
  strncpy(flags, f, sizeof flags - 1);
}

int kernel_flags_rewritten(void) { return rewritten; }

/* MLX's kernel build command with the flags after "g++", written into out (size bytes); 0 for any other command
   (or one too long for out): it runs as given */
int kernel_flags_command(const char *command, char *out, size_t size) {
  size_t n = sizeof compile - 1;
  if (strncmp(command, compile, n) != 0) return 0;
  int written = snprintf(out, size, "g++ %s %s", flags, command + 4);
  return written > 0 && (size_t)written < size;
}

FILE *kernel_flags_popen(const char *command, const char *mode) {
  size_t size = strlen(command) + strlen(flags) + 2;
  char *changed = (char *)malloc(size);
  if (changed == NULL || !kernel_flags_command(command, changed, size)) {
    free(changed);
    return real_popen(command, mode);
  }
  FILE *pipe = real_popen(changed, mode);
  free(changed);
  rewritten++;
  return pipe;
}
"""
SOURCE = SOURCE.replace("@FLAGS_BYTES@", str(FLAGS_BYTES))


def forwarding_popen(flags: str) -> int | None:
    """The address of a popen that adds `flags` to MLX's kernel build command (and leaves every other command as
    it is), or None without a compiler."""
    if len(flags.encode()) >= FLAGS_BYTES:
        raise ValueError(f"kernel flags {flags!r} are longer than the {FLAGS_BYTES - 1} bytes the helper holds")
    path = build(SOURCE, "kernel-flags")
    if path is None:
        return None
    try:
        library = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
        real = ctypes.cast(ctypes.CDLL(None).popen, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None
    library.kernel_flags_init.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    library.kernel_flags_init(real, flags.encode())  # copied into the library
    FORWARDING.append(library)  # kept loaded for as long as MLX calls it
    return ctypes.cast(library.kernel_flags_popen, ctypes.c_void_p).value


def command(text: str) -> str:
    """What the loaded forwarding popen runs for `text` (tests)."""
    library = FORWARDING[-1]
    library.kernel_flags_command.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    out = ctypes.create_string_buffer(len(text) + FLAGS_BYTES + 2)
    return out.value.decode() if library.kernel_flags_command(text.encode(), out, len(out)) else text


def rewritten() -> int:
    """How many of MLX's kernel builds ran with the flags."""
    return FORWARDING[-1].kernel_flags_rewritten() if FORWARDING else 0


FORWARDING: list[ctypes.CDLL] = []
