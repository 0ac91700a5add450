"""Every cpp, python and cmake code block of docs/*.md is compiled or run by a test: the line before
its opening fence is `<!-- snippet: <path> -->`, naming a file (from the repository root) that a test
builds or runs, and every code line of the block appears in that file, in the block's order (a
line's trailing comment and runs of spaces aside; the file may have lines in between: the setup a
block leaves to the reader). The Python snippet files are run here under torchrun; the C++ ones are
tests/docs/doc_snippets_test.cpp (ctest: DocSnippets.*) and examples/04_cmake_consumer (ctest:
build.cmake_package_consumer_on_2_ranks)."""
import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(ROOT, "docs")
CHECKED = {"cpp", "c++", "python", "cmake"}
MARKER = re.compile(r"^<!-- snippet: (\S+) -->$")


def code_lines(text, language):
    """The block's or file's code lines, normalized: trailing comments and blank or comment-only lines
    dropped, runs of whitespace made one space."""
    out = []
    for line in text.splitlines():
        if language in ("cpp", "c++"):
            line = re.sub(r"\s//.*$", "", line) if not line.lstrip().startswith("//") else ""
        else:  # python, cmake: a '#' after whitespace starts a comment (not '#include', not in '<<')
            line = "" if line.lstrip().startswith("#") else re.sub(r"\s#\s.*$", "", line)
        line = " ".join(line.split())
        if line:
            out.append(line)
    return out


def blocks():
    """(doc, line number, language, marker or None, code) of every fenced block of docs/*.md."""
    found = []
    for name in sorted(os.listdir(DOCS)):
        if not name.endswith(".md"):
            continue
        lines = open(os.path.join(DOCS, name)).read().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^```(\S*)\s*$", lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(before.strip())
            found.append((name, i + 1, fence.group(1).lower(), marker.group(1) if marker else None,
                          "\n".join(lines[i + 1:end])))
            i = end + 1
    return found


def missing_lines(block, language, path):
    """The block's code lines that the file lacks in the block's order (empty: all there)."""
    have = code_lines(open(os.path.join(ROOT, path)).read(), language)
    at = 0
    for line in code_lines(block, language):
        try:
            at = have.index(line, at) + 1
        except ValueError:
            return [line]
    return []


def test_every_cpp_python_and_cmake_block_of_the_docs_is_in_a_file_a_test_builds_or_runs():
    problems = []
    checked = 0
    for doc, line, language, path, code in blocks():
        if language not in CHECKED:
            continue
        checked += 1
        where = f"docs/{doc}:{line} ({language})"
        if path is None:
            problems.append(f"{where}: no `<!-- snippet: <file> -->` line before the block; put the block in a "
                            "file a test builds or runs (tests/docs/) and name it there")
        elif not os.path.isfile(os.path.join(ROOT, path)):
            problems.append(f"{where}: the snippet file '{path}' does not exist")
        else:
            lacking = missing_lines(code, language, path)
            if lacking:
                problems.append(f"{where}: the line '{lacking[0]}' is not in '{path}' (after the block's earlier "
                                "lines); edit the two together")
    assert checked >= 10, f"only {checked} checked blocks found in docs/: has the fence syntax changed?"
    assert not problems, "\n".join(problems)


def torchrun(script, nproc, *args):
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_the_python_quickstart_trains_on_2_ranks():
    assert torchrun("tests/docs/snippets/python_quickstart.py", 2).count(" ok, dp 2 x tp 1") == 2


def test_the_dcp_block_restores_the_saved_params_on_2_ranks():
    with tempfile.TemporaryDirectory() as scratch:
        assert torchrun("tests/docs/snippets/dcp_checkpoint.py", 2, scratch).count(" ok") == 2
