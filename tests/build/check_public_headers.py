"""The public surface: what <meshddp/meshddp.h> reaches, what `cmake --install` ships, and a consumer
built against the installed headers only.

1. The compiler's own list of the headers a file including <meshddp/meshddp.h> reads (`c++ -M`, with
   the build's flags): the project headers among them (this source tree's and the build's generated
   <meshddp/version.h>; meshddp.h itself not counted) are at most MAX_PROJECT_HEADERS.
2. `cmake --install` into a fresh prefix: the project headers installed under include/meshddp/ are
   exactly those (every one reached is installed, nothing else is: the rest is internal).
3. tests/build/public_consumer.cpp (the front end used as a trainer uses it: DDP and its config, the
   optimizer and OptimizerConfig, mesh, TP plan, pipeline controls, checkpoints, LR schedule) compiled
   to an object with the prefix's include/ and torch's headers only on its include path: a public
   header that needs an internal one fails here, naming it.
Linking and running an installed consumer on 2 ranks: build.cmake_package_consumer_on_2_ranks.

Usage: check_public_headers.py <source dir> <build dir> <work dir>
Measured: 19 project headers (37 before the front end was cut down); the whole check takes ~3 min on
a loaded 2-core machine (the consumer's compile of torch/torch.h dominates).
Seen failing: with `#include "../grad_buffer/grad_buffer.h"` added to plugin/distributed_data_parallel.h,
step 1 counted 29 headers (> 20); with `#include <meshddp/grad_buffer/grad_buffer.h>` added to the
consumer, step 3 failed: "meshddp/grad_buffer/grad_buffer.h: No such file or directory".
"""

import json
import os
import shlex
import shutil
import subprocess
import sys

MAX_PROJECT_HEADERS = 20


def build_flags(build):
    """The compiler and the system include dirs and definitions the engine is built with (torch's,
    NCCL's, CUDA's), from compile_commands.json; no project include dir."""
    with open(os.path.join(build, "compile_commands.json")) as f:
        commands = json.load(f)
    entry = next(c for c in commands if c["file"].endswith("plugin/distributed_data_parallel.cpp"))
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    args = [a for a in args if os.path.basename(a) != "ccache"]
    compiler, flags, i = args[0], [], 1
    while i < len(args):
        a = args[i]
        if a == "-isystem":
            flags += [a, args[i + 1]]
            i += 2
            continue
        if a.startswith("-D") or a.startswith("-std="):
            flags.append(a)
        i += 1
    return compiler, flags


def project_headers(src, build, compiler, flags, work):
    probe = os.path.join(work, "includes_meshddp.cpp")
    with open(probe, "w") as f:
        f.write("#include <meshddp/meshddp.h>\n")
    cmd = [compiler, *flags, "-I", src, "-I", os.path.join(src, "include"), "-I", os.path.join(build, "include"),
           "-M", probe]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    deps = [d for d in out.replace("\\\n", " ").split()[1:] if d.endswith((".h", ".hpp"))]
    generated = os.path.realpath(os.path.join(build, "include", "meshddp"))
    public = os.path.realpath(os.path.join(src, "include", "meshddp"))
    found = set()
    for d in deps:
        real = os.path.realpath(d)
        for root in (generated, public):  # <meshddp/version.h>, <meshddp/meshddp.h>
            if real.startswith(root + os.sep):
                found.add(os.path.relpath(real, root))
                break
        else:
            rel = os.path.relpath(real, os.path.realpath(src))
            if not rel.startswith((os.pardir, ".venv", "third_party", "build")):
                found.add(rel)
    found.discard("meshddp.h")
    return sorted(found)


def main(src, build, work):
    src, build = os.path.abspath(src), os.path.abspath(build)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    compiler, flags = build_flags(build)
    for i, a in enumerate(flags):
        if a == "-isystem" and os.path.realpath(flags[i + 1]) in {os.path.realpath(p) for p in (
                src, os.path.join(src, "include"), os.path.join(build, "include"))}:
            print(f"the build's system include dirs hold a project dir ({flags[i + 1]}): the check would see internals")
            return 1

    # 1. The closure of meshddp.h, as the compiler reads it.
    reached = project_headers(src, build, compiler, flags, work)
    print(f"<meshddp/meshddp.h> reaches {len(reached)} project headers (at most {MAX_PROJECT_HEADERS}):")
    for h in reached:
        print("  " + h)
    if len(reached) > MAX_PROJECT_HEADERS:
        print(f"too many: {len(reached)} > {MAX_PROJECT_HEADERS}. A public header reaches an internal one: declare "
              "what it needs (class X;), move the definition out of line, or split the small public part into a "
              "header of its own")
        return 1

    # 2. The installed headers: exactly the reached ones.
    prefix = os.path.join(work, "prefix")
    subprocess.run(["cmake", "--install", build, "--prefix", prefix], check=True, capture_output=True)
    inc = os.path.join(prefix, "include", "meshddp")
    installed = set()
    for root, dirs, files in os.walk(inc):
        dirs[:] = [d for d in dirs if not (root == inc and d == "third_party")]
        for name in files:
            if name.endswith((".h", ".hpp")):
                installed.add(os.path.relpath(os.path.join(root, name), inc))
    installed.discard("meshddp.h")
    missing, extra = sorted(set(reached) - installed), sorted(installed - set(reached))
    if missing or extra:
        print(f"installed headers differ from those meshddp.h reaches (cmake/Install.cmake, MESHDDP_PUBLIC_HEADERS): "
              f"not installed {missing}; installed but internal {extra}")
        return 1
    print(f"cmake --install ships exactly those {len(installed)} headers (+ meshddp.h)")

    # 3. A consumer against the installed headers only.
    consumer = os.path.join(src, "tests", "build", "public_consumer.cpp")
    obj = os.path.join(work, "public_consumer.o")
    cmd = [compiler, *flags, "-I", os.path.join(prefix, "include"), "-c", consumer, "-o", obj]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print("the consumer does not compile against the installed headers only:\n" + done.stderr[-4000:])
        return 1
    print(f"{os.path.relpath(consumer, src)} compiles against {os.path.relpath(prefix, work)}/include and torch only")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
