"""The reference cannot drift from the code: every DdpConfig and DistributedOptimizerConfig field (the one
lists of them, plugin/ddp_config_fields.h and optimizer/optimizer_config_fields.h) has a row in
docs/reference/config.md, every MESHDDP_* environment variable the sources read has a row in
docs/reference/environment.md, and neither page lists a name the code does not have."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBRARY = ["common", "mesh", "grad_buffer", "optimizer", "tp", "checkpoint", "plugin", "include"]


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def fields_of(header):
    """The names in `field("name", ...)` of a config-fields header, in order."""
    return re.findall(r'\bfield\("([a-z0-9_]+)"', read(header))


def documented(page, section):
    """The backticked names in the first cell of the table rows under `## <section>` of a reference page."""
    text = read(page)
    start = re.search(rf"^## {re.escape(section)}\s*$", text, re.M)
    assert start, f"{page} has no '## {section}' section"
    end = re.search(r"^## ", text[start.end():], re.M)
    body = text[start.end(): start.end() + end.start() if end else len(text)]
    return re.findall(r"^\| `([A-Za-z0-9_]+)`", body, re.M)


def source_files(folders, suffixes):
    for folder in folders:
        for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d not in ("build", "__pycache__")]
            for name in files:
                if name.endswith(suffixes):
                    yield os.path.join(base, name)


def switches_read():
    """MESHDDP_* variables the sources read: a quoted name in the library (mesh/switches.h declares the
    runtime switches), a `${MESHDDP_X:-default}` or os.environ read in scripts/."""
    found = set()
    for path in source_files(LIBRARY + ["plugin/python"], (".h", ".cpp", ".cu", ".py")):
        found.update(re.findall(r'"(MESHDDP_[A-Z0-9_]+)"', open(path).read()))
    for path in source_files(["scripts"], (".sh", ".py")):
        text = open(path).read()
        found.update(re.findall(r"\$\{(MESHDDP_[A-Z0-9_]+):-", text))
        found.update(re.findall(r'environ(?:\.get)?[(\[]"(MESHDDP_[A-Z0-9_]+)"', text))
    return found


def compare(what, in_code, in_docs, page, where):
    missing = sorted(set(in_code) - set(in_docs))
    stale = sorted(set(in_docs) - set(in_code))
    problems = [f"{what} '{n}' ({where}) has no row in {page}: add one (default, meaning)" for n in missing]
    problems += [f"{page} lists {what} '{n}', which {where} does not have: remove or rename the row" for n in stale]
    problems += [f"{page} lists {what} '{n}' twice" for n in sorted({n for n in in_docs if in_docs.count(n) > 1})]
    return problems


def test_every_ddp_config_field_has_a_row_and_every_row_a_field():
    in_code = fields_of("plugin/ddp_config_fields.h")
    assert len(in_code) >= 10, f"only {len(in_code)} fields read from plugin/ddp_config_fields.h: has its syntax changed?"
    page = "docs/reference/config.md"
    problems = compare("DdpConfig field", in_code, documented(page, "DdpConfig"), page, "kDdpConfigFields")
    assert not problems, "\n".join(problems)


def test_every_optimizer_config_field_has_a_row_and_every_row_a_field():
    in_code = fields_of("optimizer/optimizer_config_fields.h")
    assert len(in_code) >= 10, f"only {len(in_code)} fields read from optimizer/optimizer_config_fields.h"
    page = "docs/reference/config.md"
    problems = compare("DistributedOptimizerConfig field", in_code, documented(page, "DistributedOptimizerConfig"),
                       page, "kOptimizerConfigFields")
    assert not problems, "\n".join(problems)


def test_every_meshddp_environment_variable_has_a_row_and_every_row_a_variable():
    in_code = switches_read()
    assert {"MESHDDP_DEBUG_SYNC", "MESHDDP_NCCL_SPLIT"} <= in_code, f"the scan found only {sorted(in_code)}"
    page = "docs/reference/environment.md"
    in_docs = documented(page, "Runtime switches") + documented(page, "Build and test scripts")
    problems = compare("environment variable", in_code, in_docs, page, "the sources")
    assert not problems, "\n".join(problems)
