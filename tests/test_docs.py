"""The documentation stays true to the repository: links resolve, every policy file is described
and every policy path the docs, notebooks, scripts and tests use exists, the CLI reference is the
parsers' own, the Python API page covers every public name, the README stays a front page, the
user docs speak of the product (not of how it was built), and no committed file holds a path of
the machine that made it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "policies" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONTRIBUTING = ROOT / "docs" / "contributing.md"
DEV_PAGES = sorted((ROOT / "dev").glob("*.md"))  # the development log, outside docs/: linked from CONTRIBUTING only
USER_PAGES = [page for page in PAGES if page != CONTRIBUTING]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
POLICY_PATH = re.compile(r"(?:\.\./)?policies/[\w./-]+\.json")
README_MAX_LINES = 250


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = page.read_text()
    explicit = set(re.findall(r'<a id="([^"]+)"></a>', text))
    headings = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}
    return explicit | headings


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("page", PAGES + DEV_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(_without_code_blocks(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target} (no such anchor)")
    assert not broken, f"{page.relative_to(ROOT)}: " + ", ".join(broken)


def test_readme_is_a_front_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    assert "## Layout" not in text  # the layout is a contributor's concern: docs/contributing.md
    assert "(docs/contributing.md)" in text


def test_on_your_cpu_follows_the_link_to_all_results() -> None:
    """The summary table lives on the results page alone; a user on another CPU finds what to
    expect right after the README's link to it."""
    text = (ROOT / "README.md").read_text()
    assert "<!-- results-table:start" not in text  # one place per table
    after = text[text.index("(docs/results.md#summary)") :].splitlines()[1:]
    assert next(line for line in after if line.startswith("## ")) == "## On your CPU"
    section = text[text.index("## On your CPU") :]
    section = section[: section.index("\n## ", 1)]
    for needed in ("lscpu", "--preset quick", "scripts/bench.py", "--prompts ../shared/data/spec_bench/question.jsonl"):
        assert needed in section, needed
    assert "https://github.com/hemingkx/Spec-Bench" in section and "Apache-2.0" in section


def test_contributing_page_keeps_the_layout() -> None:
    text = CONTRIBUTING.read_text()
    layout = text[text.index("## Layout") :]
    from test_layout import ORDER

    for package in ORDER:  # the layout test's order is the page's
        name = package.split(".")[-1]
        assert re.search(rf"\b{re.escape(name)}(/|\.py)", layout), f"{name} missing from the Layout"
    for path in (
        "layerskip/hf/adapters.py",
        "hf/lean.py",
        "tests/tiny_models.py",
        "drafts/base.py",
        "drafts/builder.py",
    ):
        assert path in text, path
    assert "(../dev/log.md)" in text


# What the user docs must not say: how the project was built (issues, sessions, rounds) is the log's.
PROCESS_WORDS = re.compile(r"issue \d+|#i\d+|\bsessions?\b|this round", re.IGNORECASE)


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_speak_of_the_product(page: Path) -> None:
    text = page.read_text()
    found = sorted({m.group(0) for m in PROCESS_WORDS.finditer(text)})
    assert not found, f"{page.relative_to(ROOT)} speaks of how it was built: {found}"
    into_log = [t for t in LINK.findall(text) if "dev/" in t or "history.md" in t]
    assert not into_log, f"{page.relative_to(ROOT)} links into the development log: {into_log}"


# An absolute path of the machine that made a file: /work/..., /root/..., /tmp/..., /home/...
MACHINE_PATH = re.compile(r"(?<![\w.~$}-])/(?:work|root|tmp|home|Users)/")


def test_committed_files_hold_no_absolute_paths_of_the_machine_that_made_them() -> None:
    files = [*PAGES, *DEV_PAGES, *(ROOT / "policies").rglob("*.json"), *(ROOT / "docs" / "results").rglob("*.json")]
    files += [*(ROOT / "docs" / "results").rglob("*.md")]
    assert len(files) > 20
    found = {
        str(path.relative_to(ROOT)): sorted(
            {line.strip()[:120] for line in path.read_text().splitlines() if MACHINE_PATH.search(line)}
        )
        for path in files
    }
    found = {path: lines for path, lines in found.items() if lines}
    assert not found, f"absolute paths (write them relative to the repository, ../shared/... or ~/.cache/...): {found}"
    assert MACHINE_PATH.search('"--prompts /work/shared/data/spec_bench/question.jsonl"')
    assert MACHINE_PATH.search("--storage sqlite:////work/runs/studies.db")
    assert not MACHINE_PATH.search("--prompts ../shared/data/x.jsonl --storage sqlite:///runs/s.db ~/.cache/x")


def test_policies_readme_describes_every_policy_file() -> None:
    readme = (ROOT / "policies" / "README.md").read_text()
    files = sorted(p.relative_to(ROOT / "policies") for p in (ROOT / "policies").rglob("*.json"))
    assert files, "no policy files"
    missing = [str(f) for f in files if f"]({f})" not in readme]
    assert not missing, f"policies/README.md does not describe {missing}"


def _policy_paths_used() -> dict[str, set[str]]:
    """Policy files named as inputs anywhere users or tests read them, by where they are named.

    A path a document itself tells the user to write (``--out policies/x.json``) and placeholders
    (``policies/MODEL-...``) are not inputs."""
    sources = [*PAGES, *(ROOT / "notebooks").glob("*.ipynb"), *(ROOT / "scripts").glob("*.py")]
    sources += [*(ROOT / "tests").glob("*.py"), *(ROOT / "layerskip").rglob("*.py"), *(ROOT / "search").rglob("*.py")]
    used: dict[str, set[str]] = {}
    for source in sources:
        if source == Path(__file__):
            continue
        text = source.read_text()
        written = {m.removeprefix("../") for m in re.findall(r"--out[ =]+(\S*policies/[\w./-]+\.json)", text)}
        for match in POLICY_PATH.findall(text):
            path = match.removeprefix("../")
            if path in written or re.search(r"[A-Z]", Path(path).name):
                continue
            used.setdefault(path, set()).add(str(source.relative_to(ROOT)))
    return used


def test_every_policy_path_in_use_exists() -> None:
    used = _policy_paths_used()
    assert "policies/smollm2-135m-fp32-skip.json" in used  # the scan finds them
    missing = {path: sorted(where) for path, where in used.items() if not (ROOT / path).is_file()}
    assert not missing, f"policy paths that do not exist: {missing}"


def test_front_pages_and_notebooks_use_recommended_policies_only() -> None:
    recommended = {f"policies/{p.name}" for p in (ROOT / "policies").glob("*.json")}
    front = {"README.md", "docs/quickstart.md", "docs/python-api.md", "docs/plugin.md", "scripts/demo.py"}
    front |= {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    wrong = {path: sorted(where & front) for path, where in _policy_paths_used().items() if where & front}
    wrong = {path: where for path, where in wrong.items() if path not in recommended}
    assert not wrong, f"not a recommended policy (policies/*.json): {wrong}"


def test_cli_reference_is_the_parsers_own() -> None:
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    from layerskip.cli.reference import reference

    expected = reference(module.parsers())
    assert (ROOT / "docs" / "cli.md").read_text() == expected, (
        "docs/cli.md is stale; run: python scripts/cli_reference.py"
    )
    for parser in module.parsers().values():  # every flag is in the page
        for action in parser._actions:
            for flag in [] if action.dest == "help" else action.option_strings:
                assert f"`{flag}" in expected or f", {flag}" in expected, flag


def test_python_api_page_covers_every_public_name() -> None:
    import layerskip

    page = (ROOT / "docs" / "python-api.md").read_text()
    missing = [name for name in layerskip.__all__ if f"`{name}" not in page]
    assert not missing, f"docs/python-api.md does not mention {missing}"


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_are_valid_and_hold_no_errors(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    errors = [o for cell in notebook.cells for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_committed_notebook_outputs_hold_no_absolute_paths(path: Path) -> None:
    """What a committed notebook printed names no path of the machine that ran it (a scratch
    directory, a checkout): its outputs are read as figures, not as one machine's session."""
    notebook = nbformat.read(path, as_version=4)
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts.append(str(output.get("text", "")))
            texts += [str(value) for mime, value in output.get("data", {}).items() if mime.startswith("text/")]
    found = sorted({line.strip()[:120] for text in texts for line in text.splitlines() if MACHINE_PATH.search(line)})
    assert not found, f"{path.name}'s outputs name absolute paths (re-run it: make notebooks): {found}"


def test_the_package_description_names_what_the_speed_comes_from() -> None:
    """The one-line pitches (the package's description and docstring, the search command's) name
    the drafts the measured speed comes from, and do not sell bypassing sublayers as the mechanism."""
    import tomllib

    import layerskip
    from layerskip.search import cli as search_cli

    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    for pitch in (description, layerskip.__doc__ or "", search_cli.__doc__ or ""):
        assert "int4" in pitch and "lookup" in pitch, pitch
        assert "by bypassing" not in pitch, pitch


def test_the_log_cites_nothing_outside_the_repository() -> None:
    text = (ROOT / "dev" / "log.md").read_text()
    assert "DESIGN.md" not in text
    assert "docs/benchmarks.md" not in "".join(p.read_text() for p in PAGES)
