#!/usr/bin/env python3
"""Prints a log with each glibc backtrace frame it holds resolved to function and line.

A crashed rank of the test harness (tests/support/multiprocess.cc) prints its frames with
backtrace_symbols_fd, as `/path/to/object(+0x1a2b)[0x7f...]` or `object(symbol+0x10)[0x...]`:
offsets inside a program or library that only the machine that built it can resolve. This
script runs there (scripts/gpu-check.sh does, on the GPU tests' log) and appends
`  -> function at file:line` under each frame that addr2line can place (line tables need -g1).

    python3 scripts/symbolize_backtraces.py LOG > LOG.symbolized
"""
import functools
import re
import subprocess
import sys

FRAME = re.compile(r"^(?P<object>[^\s(]+)\((?P<symbol>[^)+]*)\+0x(?P<offset>[0-9a-f]+)\)\s*\[0x[0-9a-f]+\]")


@functools.lru_cache(maxsize=None)
def symbol_address(path, symbol):
    """The address of a dynamic symbol in `path` (nm -D), or None."""
    try:
        out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == symbol:
            return int(parts[0], 16)
    return None


def resolve(path, symbol, offset, return_address=True):
    # A return address points after its call; the frame under the signal trampoline is the
    # faulting instruction itself.
    address = offset - 1 if return_address else offset
    if symbol:
        base = symbol_address(path, symbol)
        if base is None:
            return None
        address = base + offset
    try:
        out = subprocess.run(["addr2line", "-f", "-C", "-i", "-e", path, hex(address)],
                             capture_output=True, text=True, timeout=60).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired):
        return None
    pairs = [(out[i], out[i + 1]) for i in range(0, len(out) - 1, 2) if out[i]]
    places = [f"{function} at {where}" for function, where in pairs
              if not (function == "??" and where.startswith("??"))]
    return places or None


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: symbolize_backtraces.py LOG")
    after_trampoline = False
    with open(sys.argv[1], errors="replace") as log:
        for line in log:
            sys.stdout.write(line)
            match = FRAME.match(line.strip())
            if not match:
                continue
            places = resolve(match["object"], match["symbol"], int(match["offset"], 16),
                             return_address=not after_trampoline)
            for place in places or []:
                sys.stdout.write(f"      -> {place}\n")
            after_trampoline = any("sigaction" in p or "restore_rt" in p for p in places or [])


if __name__ == "__main__":
    main()
