"""Every pytest file in tests/python (test_*.py) is run somewhere: by ctest (the python.<suite> list in
tests/CMakeLists.txt, or its own add_test) or, for the GPU-only suites, by scripts/gpu_check.sh. A suite in
neither never runs, and its failures go unseen. Usage: check_python_suites.py <source root>."""

import pathlib
import re
import sys


def main(root):
    root = pathlib.Path(root)
    cmake = (root / "tests" / "CMakeLists.txt").read_text()
    loop = re.search(r"foreach\(_suite ([^)]*)\)", cmake)
    assert loop, "tests/CMakeLists.txt: no foreach(_suite ...) list of Python suites"
    run = set(loop.group(1).split())
    run |= set(re.findall(r"python/test_(\w+)\.py", cmake))  # suites with an add_test of their own
    gpu = re.search(r"for suite in ([^;]*);", (root / "scripts" / "gpu_check.sh").read_text())
    assert gpu, "scripts/gpu_check.sh: no `for suite in ...;` list of the GPU Python suites"
    run |= {entry.split(":")[0] for entry in gpu.group(1).split()}
    files = sorted(p.stem[len("test_"):] for p in (root / "tests" / "python").glob("test_*.py"))
    missing = [f"tests/python/test_{name}.py" for name in files if name not in run]
    if missing:
        print(f"never run: {missing}: add each to the python.<suite> list in tests/CMakeLists.txt (or, for a GPU-only "
              f"suite, to scripts/gpu_check.sh)")
        return 1
    print(f"{len(files)} Python suites, each run by ctest or scripts/gpu_check.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
