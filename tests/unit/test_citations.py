"""Every file and docs section that the code and the docs cite exists.

Scanned: the text files under driver/, cdi/, scripts/, tests/, deploy/ and examples/, docs/*.md
and README.md. Line breaks and the comment markers that start a line (``#``, ``//``, ``*``) are
read as one space, so a citation wrapped over two comment lines is still one citation.

Forms checked (strictly; other forms are not read):

- A repository path: ``driver/``, ``cdi/``, ``scripts/``, ``tests/``, ``deploy/``, ``examples/``,
  ``docs/`` or ``proto/`` followed by a path, backticked or bare, names a file or folder of the
  repository. A path inside another path or a URL (``/var/run/cdi/...``, ``https://.../docs/x``)
  is not a citation; neither is a pattern (``tests/unit/<package>/...``, ``test_*.py``).
- A module by its path inside the packages (``claim/tenancy.py``, ``gpu/mps/model.py``: the first
  folder one of the project's own, not a top folder): some module's path ends with it, so a module
  that moved to another package is not cited where it was.
- A module by its bare name in docs/ and README.md (``sharingplan.py``): some module has that name;
  the benchmark log may name the modules it says are gone (``GONE_MODULES``).
- A markdown link ``[text](path)`` or ``[text](path#anchor)`` in docs/ and README.md: the path,
  relative to the linking file, exists, and the anchor is one of the target's headings by GitHub's
  rule (lowercase, punctuation dropped, spaces to ``-``).
- A docs section by title: ``docs/<file>.md, "Title"`` or ``<file>.md "Title"`` (``docs/``,
  the comma and a word ``section`` optional) where ``<file>.md`` is in docs/ or is README.md: the
  file has a heading that is the title, or starts with it, ignoring a leading "C. " or "1.4 ";
  a paragraph or list item that opens with a bold title (``**Whose MIG instance: ...**``) counts
  as a heading here (the docs use such run-in titles for sub-sections), but not for anchors.
- A section by letter or number: ``sharing.md, section D``, ``sharing.md, C.``,
  ``nvidia-gpu.md 6.6``, ``resource-api.md, 6.1``: the file has a heading that starts with it.
- The shared reference (``../shared/reference/*.md``: cdi, kubelet-contract, nvidia-gpu,
  resource-api, tenancy, landscape, structure-examples), cited by title or number as above: checked
  against the folder beside the clone, skipped with the reason when that folder is absent.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT.parent / "shared" / "reference"
SCANNED_DIRS = ("driver", "cdi", "scripts", "tests", "deploy", "examples")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".json", ".toml", ".txt", ".tpl", ""}
REFERENCE_FILES = (
    "cdi",
    "kubelet-contract",
    "nvidia-gpu",
    "resource-api",
    "tenancy",
    "landscape",
    "structure-examples",
)

_LINE_JOIN = re.compile(r"[ \t]*\n[ \t]*(?:#+|//|\*)?[ \t]*")
_PATH = re.compile(r"(?<![\w/.\-~$@:])((?:driver|cdi|scripts|tests|deploy|examples|docs|proto)/[^\s`'\"()\[\],;]*)")
_PATTERN_CHARS = set("{}*<>\\$")
_MD_LINK = re.compile(r"\]\(([^()\s]*?)(?:#([\w\-]+))?\)")
_BY_TITLE = re.compile(r"(?<![\w\-])((?:docs/|reference/)?[\w\-]+)\.md,?[ ](?:section[ ])?\"([^\"]+)\"")
_BY_NUMBER = re.compile(
    r"(?<![\w\-])((?:docs/|reference/)?[\w\-]+)\.md,?[ ]"
    r"(?:section[ ]([A-Z])\b|([A-Z])[.:][ ]|(?:section[ ]|§)?(\d+(?:\.\d+)*)(?![\d.]\d))"
)
_PACKAGE_PATH = re.compile(r"(?<![\w/.\-~$@:])((?:[a-z_]\w*/)+[a-z_]\w*\.py)\b")
_BARE_MODULE = re.compile(r"(?<![\w/.\-~$@:])([a-z_]\w*\.py)\b")
_TOP_FOLDERS = {"driver", "cdi", "scripts", "tests", "deploy", "examples", "docs", "proto"}
# Modules the benchmark log names as they were when it measured them, and says are gone since.
GONE_MODULES = {"docs/benchmarks.md": {"httpconn.py", "kubeconfig.py", "metrics.py", "settingvalues.py"}}
_HEADING = re.compile(r"#{1,6}\s+(.*?)\s*#*\s*$")
_BOLD_LEAD = re.compile(r"(?:[-*]\s+)?\*\*(.+?)\*\*")
_HEADING_NUMBER = re.compile(r"^(?:[A-Z]\.|\d+(?:\.\d+)*\.?)\s+")


def _scanned_files() -> Iterator[Path]:
    for top in SCANNED_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if (
                path.is_file()
                and path.suffix in TEXT_SUFFIXES
                and "__pycache__" not in path.parts
                and not path.name.endswith("_pb2.py")
                and path != Path(__file__).resolve()
            ):
                yield path
    yield from sorted((ROOT / "docs").glob("*.md"))
    yield ROOT / "README.md"


def _joined(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return ""
    return _LINE_JOIN.sub(" ", text.replace('\\"', '"'))


def _headings(path: Path, *, bold_leads: bool = False) -> list[str]:
    """The markdown headings of ``path``, outside fenced code blocks, backticks dropped.

    With ``bold_leads``, also each paragraph or list item that opens with a bold title.
    """
    found: list[str] = []
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        title = _HEADING.match(line) or (_BOLD_LEAD.match(line) if bold_leads else None)
        if title and not fenced:
            found.append(title.group(1).replace("`", ""))
    return found


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in _headings(path):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _has_section(path: Path, cited: str) -> bool:
    """Whether a heading of ``path`` is ``cited``: a title (or its start) or a letter/number."""
    want = cited.replace("`", "").strip().rstrip(".").lower()
    for heading in _headings(path, bold_leads=True):
        lowered = heading.lower().rstrip(".:")
        if re.match(rf"{re.escape(want)}(?:\.|\s|$)", lowered) and _HEADING_NUMBER.match(heading):
            return True
        for form in (lowered, _HEADING_NUMBER.sub("", lowered)):
            if form == want or form.startswith(want + " ") or form.startswith(want + ":"):
                return True
    return False


def _cited_doc(name: str) -> Path | None:
    """The file a ``<name>.md`` citation points at, or None where it is not a docs or reference file."""
    base = name.split("/")[-1]
    if name.startswith("reference/") or base in REFERENCE_FILES:
        return REFERENCE / f"{base}.md"
    if base == "README":
        return ROOT / "README.md"
    if name.startswith("docs/") or (ROOT / "docs" / f"{base}.md").exists():
        return ROOT / "docs" / f"{base}.md"
    return None


def _where(path: Path, text: str, index: int) -> str:
    return f"{path.relative_to(ROOT)} (near {text[max(0, index - 30) : index + 50]!r})"


def _section_citations() -> Iterator[tuple[Path, str, str]]:
    """(target file, cited section, where) for every docs or reference section cited."""
    for path in _scanned_files():
        text = _joined(path)
        for match in _BY_TITLE.finditer(text):
            target = _cited_doc(match.group(1))
            if target is not None:
                yield target, match.group(2), _where(path, text, match.start())
        for match in _BY_NUMBER.finditer(text):
            target = _cited_doc(match.group(1))
            section = match.group(2) or match.group(3) or match.group(4)
            if target is not None:
                yield target, section, _where(path, text, match.start())


def test_every_cited_repository_path_exists() -> None:
    missing = [
        f"{cited} in {_where(path, text, match.start())}"
        for path in _scanned_files()
        for text in [_joined(path)]
        for match in _PATH.finditer(text)
        for cited in [match.group(1).rstrip(".:")]
        if not _PATTERN_CHARS & set(cited) and not (ROOT / cited).exists()
    ]
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)


def _module_paths() -> list[str]:
    return [str(p.relative_to(ROOT)) for top in sorted(_TOP_FOLDERS) for p in sorted((ROOT / top).rglob("*.py"))
            if "__pycache__" not in p.parts]


def _unknown_modules(path: Path, text: str, modules: list[str], folders: set[str]) -> Iterator[str]:
    """The modules ``text`` (from ``path``) names by package path, or by bare name in the docs, that do not exist."""
    gone = GONE_MODULES.get(str(path.relative_to(ROOT)), set())
    names = {m.rsplit("/", 1)[-1] for m in modules}
    for match in _PACKAGE_PATH.finditer(text):
        cited = match.group(1)
        first = cited.split("/", 1)[0]
        if first in folders and first not in _TOP_FOLDERS and cited.rsplit("/", 1)[-1] not in gone \
                and not any(m.endswith("/" + cited) for m in modules):
            yield f"{cited} in {_where(path, text, match.start())}"
    if path.suffix == ".md":
        for match in _BARE_MODULE.finditer(text):
            if match.group(1) not in names and match.group(1) not in gone:
                yield f"{match.group(1)} in {_where(path, text, match.start())}"


def test_every_module_cited_by_package_path_or_bare_name_exists() -> None:
    modules = _module_paths()
    folders = {part for m in modules for part in m.split("/")[:-1]}
    missing = [found for path in _scanned_files() for found in _unknown_modules(path, _joined(path), modules, folders)]
    assert not missing, "cited modules that do not exist (moved to another package?):\n" + "\n".join(missing)


def test_the_module_check_sees_a_module_cited_where_it_was() -> None:
    modules = ["driver/gpu/claim/tenancy.py", "driver/gpu/mps/model.py"]
    folders = {"driver", "gpu", "claim", "mps"}
    text = "see ``claim/tenancy.py``, gpu/mps/model.py, gpu/tenancy.py, mps/tenancy.py, driver/x.py and ghost.py"
    found = [f.split(" in ")[0] for f in _unknown_modules(ROOT / "docs" / "x.md", text, modules, folders)]
    assert found == ["gpu/tenancy.py", "mps/tenancy.py", "ghost.py"]


def test_every_markdown_link_names_an_existing_file_and_heading() -> None:
    broken: list[str] = []
    for path in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        text = path.read_text(encoding="utf-8")
        for match in _MD_LINK.finditer(text):
            target_name, anchor = match.group(1), match.group(2)
            if "://" in target_name or target_name.startswith("mailto:"):
                continue
            target = (path.parent / target_name).resolve() if target_name else path
            if not target.exists():
                broken.append(f"{target_name} in {_where(path, text, match.start())}")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{target_name}#{anchor} in {_where(path, text, match.start())}")
    assert not broken, "links to missing files or headings:\n" + "\n".join(broken)


def test_every_cited_docs_section_exists() -> None:
    missing = [
        f"{target.relative_to(ROOT)}: {section!r} cited in {where}"
        for target, section, where in _section_citations()
        if target.parent != REFERENCE and not (target.exists() and _has_section(target, section))
    ]
    assert not missing, "cited docs sections that do not exist:\n" + "\n".join(missing)


def test_every_cited_reference_section_exists() -> None:
    if not REFERENCE.is_dir():
        pytest.skip(f"the shared reference is not beside the clone ({REFERENCE} is absent)")
    missing = [
        f"reference/{target.name}: {section!r} cited in {where}"
        for target, section, where in _section_citations()
        if target.parent == REFERENCE and not (target.exists() and _has_section(target, section))
    ]
    assert not missing, "cited reference sections that do not exist:\n" + "\n".join(missing)


def test_the_scanner_reads_each_citation_form() -> None:
    """The forms the docstring lists are found (so an empty scan cannot pass for a clean one)."""
    text = _LINE_JOIN.sub(
        " ",
        'see docs/sharing.md, "Limits are\n    # watched" and nvidia-gpu.md 6.6, sharing.md, section D,'
        " sharing.md, C. and `driver/gpu/mps/limits.py` but not /var/run/cdi/x.json",
    )
    assert [m.group(2) for m in _BY_TITLE.finditer(text)] == ["Limits are watched"]
    numbered = [m.group(2) or m.group(3) or m.group(4) for m in _BY_NUMBER.finditer(text)]
    assert numbered == ["6.6", "D", "C"]
    assert [m.group(1) for m in _PATH.finditer(text)] == ["docs/sharing.md", "driver/gpu/mps/limits.py"]
    assert _has_section(ROOT / "docs" / "sharing.md", "Limits are watched")
    assert _has_section(ROOT / "docs" / "sharing.md", "D")
    assert not _has_section(ROOT / "docs" / "sharing.md", "One Linux user per MPS server")
