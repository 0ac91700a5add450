"""Runs a README snippet on 2 ranks under torchrun, as a reader would, and fails with its output if
it fails (or takes over 120 s).

  check_readme_snippets.py cpp <binary>               the C++ snippet, built from README.md
  check_readme_snippets.py python <README.md> <work>  the Python snippet, extracted here
torchrun: the one beside this Python (the venv's).
"""
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from extract_snippets import readme_blocks  # noqa: E402


def run_on_2_ranks(args, what):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        sys.exit(f"the README's {what} snippet did not finish on 2 ranks in 120 s: {' '.join(cmd)}")
    if done.returncode != 0:
        sys.exit(f"the README's {what} snippet failed on 2 ranks (exit {done.returncode}): {' '.join(cmd)}\n"
                 f"{done.stdout}\n{done.stderr}")
    print(f"the README's {what} snippet ran on 2 ranks")


def main(argv):
    if len(argv) == 3 and argv[1] == "cpp":
        run_on_2_ranks(["--no-python", argv[2]], "C++")
    elif len(argv) == 4 and argv[1] == "python":
        readme, work = pathlib.Path(argv[2]), pathlib.Path(argv[3])
        work.mkdir(parents=True, exist_ok=True)
        script = work / "readme_snippet.py"
        script.write_text(readme_blocks(readme.read_text(), str(readme))["python"][0][1])
        run_on_2_ranks([str(script)], "Python")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
