#!/usr/bin/env python3
"""The instruction mix of the main loops of a CUDA object's tensor-core kernels, read from its
machine code, so that a kernel's cost a turn can be counted before a GPU runs it (docs/PERF.md,
thirty-fifth session).

    scripts/sass_loops.py OBJECT [REGEX]

OBJECT is an object or binary built with nvcc (read with `cuobjdump -sass`: from .deps/bin, which
scripts/setup.sh fills, else PATH) or a listing `cuobjdump -sass` wrote (a file ending in .sass).
For each kernel whose name matches REGEX (default: every kernel) and that issues warpgroup MMAs
(HGMMA, QGMMA, ...), prints its identifiers and, for each innermost loop holding such MMAs, how many
instructions a warp issues in one turn of it: the MMAs (with their shapes), the promotions' FFMA and
FMUL, register moves to uniform registers (R2UR), local-memory traffic (LDL, STL: spills), and all.
"""
import os
import re
import subprocess
import sys

# /*0a40*/   @!P1 BRA 0xc60 ;   (address, optional predicate, opcode with its modifiers, operands)
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Za-z0-9_.]*)?\s*([^;]*);")
FUNCTION = re.compile(r"Function : (\S+)")
PROG = os.path.basename(sys.argv[0])  # the script that was run (sass_same.py reads through this one too)
# identifiers a kernel's description leaves out: namespaces and CUTLASS's and CuTe's plumbing
GENERIC = {"cutlass", "cute", "gemm", "kernel", "collective", "tuple", "device_kernel", "Params", "Layout",
           "Underscore", "identity", "epilogue", "fusion", "detail", "float_e4m3_t", "bfloat16_t", "half_t",
           "Swizzle", "ComposedLayout", "smem_ptr_flag_bits", "ScaleIn", "arch", "thread", "GMMA", "SM90"}


def listing(path):
    """The machine code of an object (through cuobjdump) or a saved listing, as text."""
    if not os.path.isfile(path):
        sys.exit(f"{PROG}: {path}: no such file (an object built with nvcc, or a .sass listing)")
    if path.endswith(".sass"):
        with open(path) as f:
            return f.read()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".deps", "bin")
    env = dict(os.environ, PATH=here + os.pathsep + os.environ.get("PATH", ""))
    try:
        return subprocess.run(["cuobjdump", "-sass", path], env=env, check=True, capture_output=True, text=True).stdout
    except FileNotFoundError:
        sys.exit(f"{PROG}: cuobjdump not found: run scripts/setup.sh (it puts NVIDIA's cuobjdump and "
                 "nvdisasm in .deps/bin when nvcc is installed), or put them on PATH")
    except subprocess.CalledProcessError as e:
        sys.exit(f"{PROG}: cuobjdump -sass {path} failed: {e.stderr.strip()}")


def identifiers(mangled):
    """The distinct, non-generic identifiers (length-prefixed source names) of a mangled name, in
    order; the digits of substitutions (S6_) and of literals (Li128E) are not lengths."""
    out, i = [], 0
    while i < len(mangled):
        m = re.match(r"\d+", mangled[i:])
        literal = i >= 2 and mangled[i - 2] == "L"
        if not m or (i and mangled[i - 1] == "S") or literal:
            i += len(m.group()) if m else 1
            continue
        n, start = int(m.group()), i + len(m.group())
        name = mangled[start:start + n]
        if len(name) > 1 and name not in GENERIC and name not in out and re.fullmatch(r"[A-Za-z_]\w*", name):
            out.append(name)
        i = start + n
    return out


def kernels(text):
    """(name, [(address, opcode, modifiers, operands)]) for each function of a listing."""
    name, body = None, []
    for line in text.splitlines():
        f = FUNCTION.search(line)
        if f:
            if name:
                yield name, body
            name, body = f.group(1), []
            continue
        m = INSTRUCTION.search(line)
        if m and name:
            body.append((int(m.group(1), 16), m.group(2), m.group(3) or "", m.group(4)))
    if name:
        yield name, body


def is_mma(ins):
    return ins[1].endswith("GMMA")


def innermost_mma_loops(body):
    """(first, last) index ranges of the bodies of backward branches that hold MMAs and no such loop."""
    at = {addr: i for i, (addr, _, _, _) in enumerate(body)}
    loops = []
    for i, (addr, op, _, operands) in enumerate(body):
        t = re.match(r"(0x[0-9a-f]+)", operands.strip())
        target = int(t.group(1), 16) if op == "BRA" and t else None
        if target is not None and target <= addr and target in at:
            first = at[target]
            if any(is_mma(x) for x in body[first:i + 1]):
                loops.append((first, i))
    # innermost: no other such loop's branch inside (an outer loop may start after an inner one)
    return [l for l in loops if not any(o != l and l[0] <= o[1] < l[1] for o in loops)]


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.split("\n\n")[1])
    pattern = re.compile(sys.argv[2] if len(sys.argv) == 3 else "")
    shown = 0
    for name, body in kernels(listing(sys.argv[1])):
        if not pattern.search(name) or not any(is_mma(x) for x in body):
            continue
        shown += 1
        print(" ".join(identifiers(name))[:300] or name[:300])
        for first, last in innermost_mma_loops(body):
            turn = body[first:last + 1]
            count = lambda op: sum(x[1] == op for x in turn)
            shapes = sorted({x[1] + x[2].split(".F32")[0] for x in turn if is_mma(x)})
            print(f"  loop {first}-{last}: {sum(is_mma(x) for x in turn)} {'/'.join(shapes)}, FFMA {count('FFMA')}, "
                  f"FMUL {count('FMUL')}, R2UR {count('R2UR')}, LDL {count('LDL')}, STL {count('STL')}, "
                  f"all {len(turn)}")
    if not shown:
        sys.exit(f"sass_loops.py: no kernel with warpgroup MMAs matches '{pattern.pattern}' in {sys.argv[1]}")


if __name__ == "__main__":
    main()
