"""The user docs (README.md, docs/*.md) answer a user, not a lab log: no commit hash in them (the rows
in benchmarks/results/ carry each figure's commit; dated work notes live in docs/history/), every
image and relative link leads to a file of the repository, and the pictures sit in docs/img/."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))  # not docs/history/
# A word of 7 to 40 lowercase hex digits, as `git log --oneline` and the rows write commits.
HEX_WORD = re.compile(r"(?<![0-9A-Za-z_])[0-9a-f]{7,40}(?![0-9A-Za-z_])")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMG_TAG = re.compile(r"<img\b[^>]*\bsrc=\"([^\"]+)\"", re.I)


def _git_knows_commits() -> bool:
    if shutil.which("git") is None:
        return False
    found = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD^{commit}"], cwd=ROOT, capture_output=True,
                           check=False)
    return found.returncode == 0


GIT = _git_knows_commits()


def _is_commit(word: str) -> bool:
    found = subprocess.run(["git", "cat-file", "-e", f"{word}^{{commit}}"], cwd=ROOT, capture_output=True,
                           check=False)
    return found.returncode == 0


def commit_hashes(text: str) -> list:
    """The words of `text` that name a commit: hex words with a digit and a letter (so neither
    "deadbeef" nor a number) that are commits of this repository; without its git history (a copy
    of the working tree), every such word, a commit of it or not."""
    candidates = {word for word in HEX_WORD.findall(text)
                  if re.search(r"[0-9]", word) and re.search(r"[a-f]", word)}
    return sorted(word for word in candidates if not GIT or _is_commit(word))


def _relative_targets(text: str) -> list:
    targets = LINK.findall(text) + IMG_TAG.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I) and not t.startswith("#")]


@pytest.mark.skipif(not GIT, reason="needs this repository's git history")
def test_the_check_finds_a_commit_and_passes_ordinary_text():
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert commit_hashes(f"measured at commit `{head}` on one H200") == [head]
    ordinary = ("E4M3 and E2M1 codes, 0x7FC0, fp8 1x128 blocks, deadbeef, 1234567 tokens, a SHA-256 that is not "
                "a commit: 0123456789abcdef0123456789abcdef01234567, seeds 1234 5678")
    assert commit_hashes(ordinary) == []


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_commit_hash_in_the_user_docs(doc):
    found = commit_hashes(doc.read_text())
    assert not found, (f"{doc.relative_to(ROOT)} names commits {', '.join(found)}: quote the rows' figures by "
                       "bench, GPU and date, and keep commit-keyed notes in docs/history/")


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_image_and_relative_link_exists(doc):
    missing = []
    for target in _relative_targets(doc.read_text()):
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            missing.append(target)
    assert not missing, f"{doc.relative_to(ROOT)} links to missing files: {', '.join(missing)}"


def test_the_link_check_sees_images_links_and_html():
    text = ('![plot](img/a.png) [doc](usage.md#flags "title") [web](https://example.org/x) [here](#top) '
            '<img src="img/b.png" width="50%">')
    assert _relative_targets(text) == ["img/a.png", "usage.md#flags", "img/b.png"]


def test_the_pictures_are_in_docs_img():
    assert not sorted((ROOT / "docs").glob("*.png")), "pictures belong in docs/img/"


DESIGN = ROOT / "docs" / "design.md"
CITED_SECTION = re.compile(r"docs/design\.md §(\d+(?:\.\d+)?)(?:-§(\d+(?:\.\d+)?))?")


def _cited_sections(text: str) -> list:
    return [number for pair in CITED_SECTION.findall(text) for number in pair if number]


def _cites_outside_design(text: str) -> bool:
    return re.search(r"\bDESIGN(\.md)? ?(§|section)", text) is not None


def test_the_code_cites_the_design_in_the_repository_by_sections_it_has():
    sections = set(re.findall(r"^#{2,3} §(\d+(?:\.\d+)?) ", DESIGN.read_text(), re.M))
    assert {"2", "3", "4", "7"} <= sections
    sources = [p for folder in ("megatron_fp4", "tests", "benchmarks", "configs") for p in (ROOT / folder).rglob("*")
               if p.suffix in {".py", ".yaml", ".cu", ".cuh", ".sh"} and p != Path(__file__).resolve()] + [
                   ROOT / "DEVELOPERS.md"] + USER_DOCS
    outside, missing = [], []
    for path in sources:
        text = path.read_text()
        if _cites_outside_design(text):
            outside.append(path.relative_to(ROOT))
        missing += [(path.relative_to(ROOT), n) for n in _cited_sections(text) if n not in sections]
    assert outside == [], f"these cite an outside design document; cite docs/design.md: {outside}"
    assert missing == [], f"citations of docs/design.md sections it does not have: {missing}"


def test_the_citation_checks_can_fail():
    assert _cites_outside_design("the wire format of DESIGN §3") and not _cites_outside_design("docs/design.md §2")
    assert _cited_sections("docs/design.md §2-§3 and docs/design.md §6.4") == ["2", "3", "6.4"]
