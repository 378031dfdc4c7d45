"""The README and docs/ as a newcomer uses them (issue 36): the README's two commands are the ones CI and the demo
run, every relative link resolves, every page is in the site, and the site is built strictly by the test command.
One process, no launch: the demo recipe itself trains in tests/multiproc/test_trainer_cli.py (demo_run)."""

import re
from pathlib import Path

from multinode import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) and GitHub give a heading: lower case, punctuation dropped."""
    text = re.sub(r"[`*_\[\]()]", "", heading).strip().lower()
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", text))


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M)}


def relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"{path.name}: {target} (no {resolved.relative_to(REPO) if REPO in resolved.parents else resolved})")
        elif path.parent == DOCS and DOCS not in resolved.parents:
            broken.append(f"{path.name}: {target} (outside docs/: the site cannot hold it; name the file as code)")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{path.name}: {target} (no heading with that anchor)")
    return broken


def test_every_relative_link_in_the_readme_and_docs_resolves(tmp_path):
    problems = [problem for page in _pages() for problem in broken_links(page)]
    assert problems == [], "\n".join(problems)
    assert sum(len(relative_links(page)) for page in _pages()) > 40  # the check sees the links
    # It catches a missing page, a missing anchor and a link out of docs/.
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    (tmp_path / "other.md").write_text("# Other\n")
    page.write_text("# A page\n[a](nope.md) [b](page.md#no-such-heading) [c](page.md#a-page) [d](../other.md)\n")
    global DOCS
    saved, DOCS = DOCS, page.parent
    try:
        assert [p.split(" (")[0] for p in broken_links(page)] == ["page.md: nope.md", "page.md: page.md#no-such-heading",
                                                                  "page.md: ../other.md"]
    finally:
        DOCS = saved


def test_the_readme_is_short_and_its_two_commands_are_what_ci_and_the_demo_run():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move a topic to docs/"
    first_block = README.read_text().split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    # .ci/run is the test command; the test command builds the site strictly (a broken link fails CI).
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert "bash scripts/test.sh" in ci, ci
    test_sh = (REPO / "scripts" / "test.sh").read_text()
    assert re.search(r"^if ! mkdocs build --strict ", test_sh, flags=re.M) and "mkdocs build -q" not in test_sh
    # The demo command runs the demo recipe, the one tests/multiproc/test_trainer_cli.py trains through the CLI.
    demo = [line for line in (REPO / "scripts" / "demo.sh").read_text().splitlines() if line.startswith("twinkle-sft")]
    assert demo == ['twinkle-sft yaml/demo.yaml "$@"'], demo
    assert 'REPO / "yaml" / "demo.yaml"' in (REPO / "tests" / "multiproc" / "test_trainer_cli.py").read_text()


def test_every_docs_page_is_in_the_site_and_every_nav_entry_exists():
    import yaml

    site = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    nav = [next(iter(entry.values())) for entry in site["nav"]]
    assert sorted(nav) == sorted(p.name for p in DOCS.glob("*.md")), nav
    assert site["docs_dir"] == "docs" and site["validation"]["anchors"] == "warn"
