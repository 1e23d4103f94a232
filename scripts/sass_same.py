#!/usr/bin/env python3
"""Whether two builds of a CUDA object have the same machine code, kernel by kernel, without a GPU:
a change to CUDA sources whose kernels all come out the same (a refactor, comments) runs what was
already checked on a GPU; one whose kernels differ needs its GPU checks again.

    scripts/sass_same.py OLD NEW

OLD and NEW are objects or binaries built with nvcc, or listings `cuobjdump -sass` wrote (.sass),
read as scripts/sass_loops.py reads them. Prints, for each kernel (by mangled name), "same" or
"changed" (with both instruction counts), or that it is in one build only, then a summary line;
exits 0 when every kernel is the same, 1 otherwise. Instructions are compared whole (opcode,
modifiers, operands, and branch targets, which cuobjdump gives from the kernel's start).
"""
import sys

from sass_loops import kernels, listing


def instructions(path):
    """{kernel name: [(address, opcode, modifiers, operands), ...]} of an object or listing."""
    return dict(kernels(listing(path)))


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    old, new = instructions(sys.argv[1]), instructions(sys.argv[2])
    changed = 0
    for name in sorted(set(old) | set(new), key=lambda n: (n not in old, n)):
        if name not in new or name not in old:
            changed += 1
            print(f"only in {'OLD' if name in old else 'NEW'}: {name}")
        elif old[name] != new[name]:
            changed += 1
            print(f"changed ({len(old[name])} -> {len(new[name])} instructions): {name}")
        else:
            print(f"same: {name}")
    total = len(set(old) | set(new))
    print(f"{total - changed} of {total} kernels the same" + ("" if changed else ": the machine code is unchanged"))
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
