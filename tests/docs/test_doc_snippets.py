"""Every cpp, python and cmake code block of docs/ (its pages and those of docs/guide/ and
docs/reference/) is compiled or run by a test: the line before
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


def doc_pages():
    """The pages of docs/ and its folders, as paths relative to docs/."""
    pages = []
    for base, _, files in os.walk(DOCS):
        pages += [os.path.relpath(os.path.join(base, f), DOCS) for f in files if f.endswith(".md")]
    return sorted(pages)


def blocks():
    """(doc, line number, language, marker or None, code) of every fenced block of docs/**/*.md."""
    found = []
    for name in doc_pages():
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


def test_the_zero1_block_trains_saves_and_resumes_on_2_ranks():
    with tempfile.TemporaryDirectory() as scratch:
        assert torchrun("tests/docs/snippets/python_zero1.py", 2, scratch).count(" ok, losses") == 2


def test_the_dcp_block_restores_the_saved_params_on_2_ranks():
    with tempfile.TemporaryDirectory() as scratch:
        assert torchrun("tests/docs/snippets/dcp_checkpoint.py", 2, scratch).count(" ok") == 2


def size(path):
    return len(open(os.path.join(ROOT, path), encoding="utf-8").read().encode("utf-8"))


def test_each_guide_reads_in_ten_minutes_and_the_porting_path_stays_under_40k():
    guides = [os.path.join("docs", p) for p in doc_pages() if p.startswith("guide" + os.sep)]
    assert len(guides) >= 5, f"only {guides} in docs/guide/"
    too_long = [f"{g}: {size(g)} bytes" for g in guides if size(g) > 10_000]
    assert not too_long, f"a guide is a page read in under ten minutes (<= 10,000 bytes): {too_long}"
    porting = ["README.md"] + [g for g in guides if os.path.basename(g).startswith(("python", "pipeline"))]
    assert len(porting) == 3, f"the porting path is the README, the Python guide and the pipeline guide: {porting}"
    total = sum(size(p) for p in porting)
    assert total <= 40_000, f"README + the Python guide + the pipeline guide: {total} bytes, over 40,000 ({porting})"
    assert size("docs/benchmarks.md") <= 15_000, "docs/benchmarks.md is the summary: details go to bench/results/"


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_every_relative_link_of_the_readme_the_docs_and_the_results_names_a_file_that_exists():
    pages = ["README.md", "CHANGELOG.md"] + [os.path.join("docs", p) for p in doc_pages()]
    pages += [os.path.join("bench", "results", f) for f in sorted(os.listdir(os.path.join(ROOT, "bench", "results")))
              if f.endswith(".md")]
    pages += [os.path.join("examples", d, "README.md") for d in sorted(os.listdir(os.path.join(ROOT, "examples")))
              if os.path.isfile(os.path.join(ROOT, "examples", d, "README.md"))]
    broken = []
    for page in pages:
        text = open(os.path.join(ROOT, page), encoding="utf-8").read()
        for target, _ in LINK.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))):
                broken.append(f"{page}: ({target})")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
