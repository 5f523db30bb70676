"""docs/ as reference (issue 60): each page says what holds now, and the dated history lives in one journal,
docs/journal.md. No page but the journal has a heading or a dateline that names a working period ("Session N") or a
GPU visit ("third visit"), nor a heading with a date; the journal's sections are dates, oldest first; and every pointer
to a section of a page (`docs/PERF.md, "Training step on a CPU"`) names a heading or a bold lead of that page."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
JOURNAL = DOCS / "journal.md"
REFERENCE = sorted(p for p in DOCS.glob("*.md") if p != JOURNAL)

SESSION_OR_VISIT = re.compile(r"\bsessions? \d+|\bvisit(?:s|ed)?\b", re.IGNORECASE)
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
LIST_MARK = re.compile(r"^(?:[-*+] |\d+\. )?\s*")


def prose_lines(text: str):
  """(line number, line, first line of its paragraph or list item?) for each line outside fenced code blocks."""
  fenced, previous = False, ""
  for number, line in enumerate(text.splitlines(), 1):
    if line.lstrip().startswith("```"):
      fenced, previous = not fenced, ""
      continue
    if fenced:
      continue
    starts = bool(line.strip()) and (not previous.strip() or previous.startswith("#")
                                     or bool(re.match(r"\s*(?:[-*+] |\d+\. )", line)))
    yield number, line, starts
    previous = line


def dated(line: str, starts: bool) -> str | None:
  """Why a line is a dated heading or a dateline, or None."""
  if line.startswith("#"):
    if SESSION_OR_VISIT.search(line) or DATE.search(line):
      return "heading"
    return None
  if not starts:
    return None
  lead = LIST_MARK.sub("", line, count=1)
  if SESSION_OR_VISIT.search(line):
    return "dateline"
  if DATE.match(lead.lstrip("*(")) or re.match(r"\*\*[^*]+\*\*:?\s*\(\s*" + DATE.pattern, lead):
    return "dateline"
  return None


def dated_lines(text: str) -> list[str]:
  return [f"{n}: {why}: {line.strip()}" for n, line, starts in prose_lines(text)
          if (why := dated(line, starts))]


@pytest.mark.parametrize("page", REFERENCE, ids=lambda p: p.name)
def test_reference_pages_have_no_session_or_visit_headings_or_datelines(page):
  found = dated_lines(page.read_text())
  assert not found, (f"docs/{page.name} reads as a lab notebook; move the dated entry to docs/journal.md and keep "
                     f"what holds now (figure, command, commit):\n" + "\n".join(found))


@pytest.mark.parametrize("inserted, why", [
    ("### Session" " 21", "heading"),
    ("### On an NVIDIA H100, fourth visit", "heading"),
    ("#### d20 on v5e-32 (issue 49, 2026-11-30)", "heading"),
    ("**Session" " 21** (the suite had grown): 930 passed.", "dateline"),
    ("- **Cuts** (2026-11-30, same libtpu): 170 GB.", "dateline"),
    ("2026-11-30: the suite in 650 s.", "dateline"),
])
def test_the_check_sees_an_inserted_dated_entry(inserted, why):
  """The check above, on a reference page with one dated entry put in; prose that names a date or a session in
  passing, and code blocks, stay allowed."""
  text = inserted + "\n\nFigures of that day.\n\n" + (DOCS / "PERF.md").read_text()
  assert dated_lines(text)[:1] == [f"1: {why}: {inserted}"], dated_lines(text)
  assert not dated_lines("Measured 2026-11-22 (commit 3ee5692) on one H100, as the next GPU session\nwill again.\n"
                         "\n```\n### session" " 3 visit\n```\n")


def test_the_journal_is_dated_oldest_first():
  """docs/journal.md's sections are ISO dates, oldest first, each with at least one entry."""
  text = JOURNAL.read_text()
  days = re.findall(r"^## (.+)$", text, re.MULTILINE)
  assert days and all(DATE.fullmatch(d) for d in days), days
  assert days == sorted(days) and len(set(days)) == len(days), days
  for day, body in zip(days, re.split(r"^## .+$", text, flags=re.MULTILINE)[1:]):
    assert re.search(r"^### ", body, re.MULTILINE), f"{day} has no entry"


POINTER = re.compile(r"\b(?:docs/)?([A-Z]+|journal)\.md(?:'s)?,?\s+\"([^\"\n]+)\"")


def _pointers():
  files = [ROOT / "README.md", ROOT / "pyproject.toml", *DOCS.glob("*.md"), *ROOT.glob("configs/**/*.yaml"),
           *ROOT.glob("sinkjax/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("launch/*")]
  for f in files:
    if f.is_file() and f.name != "test_docs_reference.py":
      for m in POINTER.finditer(f.read_text(errors="ignore")):
        yield f.relative_to(ROOT), m.group(1), m.group(2)


def test_section_pointers_name_a_section_of_their_page():
  """A pointer `PAGE.md, "Name"` (in the docs, the README, configs, code and tests) names the start of a heading or a
  bold lead of that page, so a section that moves takes its pointers with it."""
  bad, seen = [], 0
  for where, page, name in _pointers():
    path = ROOT / "README.md" if page == "README" else DOCS / f"{page}.md"
    if not path.is_file():
      bad.append(f"{where}: no {path.name}")
      continue
    text = path.read_text()
    heads = [h.lstrip("#").strip().lower() for h in text.splitlines() if h.startswith("#")]
    bolds = [b.lower() for b in re.findall(r"\*\*([^*]+)\*\*", text)]
    seen += 1
    if not any(name.lower() in h for h in heads) and not any(b.startswith(name.lower()) for b in bolds):
      bad.append(f"{where}: {path.name}, {name!r}")
  assert seen > 20 and not bad, bad


# The repository speaks of the project: a measurement names its date, commit, machine and stack, never how the work
# around it was organised (the tool a GPU came through, its hand-outs, a numbered working period).
# Words may break across lines (prose wrapped at 120 columns, or a comment's "# " continuing them).
_GAP = r"\s+(?:[#>]\s*)?"
ORGANISATION = re.compile(rf"\bdevice`?{_GAP}tool\b|\bloans?\b|\blent\b|\bsessions?{_GAP}\d+", re.IGNORECASE)


def tracked_text_files():
  import subprocess  # pylint: disable=import-outside-toplevel
  try:
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True,
                           timeout=60).stdout.decode().split("\0")
  except (OSError, subprocess.SubprocessError):
    pytest.skip("not a git checkout: the tracked files are unknown")
  for name in filter(None, names):
    path = ROOT / name
    if path.is_file() and path.stat().st_size < 4_000_000:
      try:
        yield name, path.read_text()
      except UnicodeDecodeError:
        continue


def organisation_words(text: str) -> list[str]:
  lines = text.splitlines()
  found = []
  for m in ORGANISATION.finditer(text):
    n = text.count("\n", 0, m.start()) + 1
    found.append(f"{n}: {m.group(0)!r}: {lines[n - 1].strip()[:120]}")
  return found


def test_no_tracked_file_speaks_of_how_the_work_was_organised():
  found = [f"{name}:{hit}" for name, text in tracked_text_files() for hit in organisation_words(text)]
  assert not found, "say the date, commit, machine and stack instead:\n" + "\n".join(found)


def test_the_organisation_check_finds_each_word():
  for line in ("one H200 le" "nt through it", "the `device`" " tool's bundle", "the H100 lo" "ans", "measured in sess" "ion 23",
               "through the `device`\n" "tool (228 s", "# the device\n" "# tool's bundle"):
    assert organisation_words(line), line
  assert not organisation_words("the test session's 8 CPU devices; an SSH session; a lenticular loaner")
