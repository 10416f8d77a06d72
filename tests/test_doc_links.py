"""Every relative link in the repository's Markdown reaches a file, and every `#anchor` a heading there.

Sections move between pages (the README's history went to docs/benchmarks.md, pre-registrations went
next to their benchmark); a link left pointing at the old place is a dead end for the reader, so this
checks them all. Anchors follow GitHub's rule: the heading in lower case, punctuation other than `-`
and `_` dropped, spaces turned into `-`, and `-1`, `-2`, ... for repeated headings.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    p for p in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md"),
                *ROOT.glob("tuned_examples/*.md"), *ROOT.glob("examples/**/*.md")]
    if p.is_file()
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    text = re.sub(r"`|\*\*|\*", "", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: Counter[str] = Counter()
    out = set()
    in_code = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else HEADING.match(line)
        if match:
            base = slug(match.group(2))
            out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
            seen[base] += 1
    return out


def dead_links(page: Path) -> list[str]:
    dead = []
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{target} (no file {path})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            dead.append(f"{target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    return dead


def test_every_relative_link_reaches_its_file_and_heading() -> None:
    assert len(PAGES) >= 8, PAGES
    problems = {str(p.relative_to(ROOT)): dead for p in PAGES if (dead := dead_links(p))}
    assert not problems, f"dead links: {problems}"


def test_the_checker_finds_a_dead_anchor(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n## The `x` part: 2, done\n## Top\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#the-x-part-2-done) [ok](a.md#top-1) [bad](a.md#gone) [bad](c.md) [self](#here)\n# Here\n")
    assert slug("The `x` part: 2, done") == "the-x-part-2-done"
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert dead_links(page) == ["a.md#gone (no heading #gone in a.md)", "c.md (no file c.md)"]
    finally:
        ROOT = old
