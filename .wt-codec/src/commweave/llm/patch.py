"""Turning a model's answer into a program: SEARCH/REPLACE diffs and full rewrites, both confined
to the EVOLVE-BLOCKs (lines containing "EVOLVE-BLOCK-START" / "EVOLVE-BLOCK-END" delimit them), and
the fenced code / JSON blocks of an answer.

Matching is exact and whitespace-sensitive: a SEARCH that matches only loosely is refused with the
nearest lines of the program, so the model's next attempt can copy them. Every refusal is a
PatchError whose `kind` classifies it and whose message is written for the model to act on.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass

START = "EVOLVE-BLOCK-START"
END = "EVOLVE-BLOCK-END"
KINDS = ("no_diff", "no_match", "ambiguous", "outside_block", "markers_removed", "no_code", "no_json", "bad_json")
DIFF_FORMAT = "<<<<<<< SEARCH\n<lines copied exactly from the program>\n=======\n<their replacement>\n>>>>>>> REPLACE"
LANG_ALIASES = {"python": {"python", "py", "python3"}}

_SEARCH = re.compile(r"^\s*<{5,}\s*SEARCH\s*$")
_DIVIDER = re.compile(r"^\s*={5,}\s*$")
_REPLACE = re.compile(r"^\s*>{5,}\s*REPLACE\s*$")
_FENCE_OPEN = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([^\s`]*)[^`]*$")


class PatchError(ValueError):
    """An answer that cannot become a program; `kind` is one of KINDS."""

    def __init__(self, kind: str, message: str):
        if kind not in KINDS:
            raise ValueError(f"PatchError kind {kind!r} is not one of {KINDS}")
        super().__init__(message)
        self.kind = kind
        self.message = message


def _lines(text: str) -> list[str]:
    """Lines with their '\\n' (only '\\n' ends a line, so offsets add up)."""
    return re.findall(r"[^\n]*\n|[^\n]+$", text)


def evolve_blocks(text: str) -> list[tuple[int, int]]:
    """Char spans of the editable regions: from after each START marker line to the start of its
    END marker line. Unbalanced or nested markers raise PatchError("markers_removed")."""
    spans: list[tuple[int, int]] = []
    open_at: int | None = None
    open_line = 0
    pos = 0
    for lineno, line in enumerate(_lines(text), 1):
        if START in line:
            if open_at is not None:
                raise PatchError("markers_removed", f"line {lineno}: {START} inside the EVOLVE-BLOCK opened at line "
                                                    f"{open_line}; every block needs its own {END}")
            open_at, open_line = pos + len(line), lineno
        elif END in line:
            if open_at is None:
                raise PatchError("markers_removed", f"line {lineno}: {END} without a {START} before it")
            spans.append((open_at, pos))
            open_at = None
        pos += len(line)
    if open_at is not None:
        raise PatchError("markers_removed", f"the {START} at line {open_line} has no {END}")
    return spans


def _parse_diff(response: str) -> list[tuple[str, str]]:
    """The (search, replace) pairs of an answer, ignoring any prose and fences around them."""
    pairs: list[tuple[str, str]] = []
    state, search, replace = "out", [], []
    for line in _lines(response.replace("\r\n", "\n")):
        stripped = line.rstrip("\n")
        if state == "out" and _SEARCH.match(stripped):
            state, search, replace = "search", [], []
        elif state == "search" and _DIVIDER.match(stripped):
            state = "replace"
        elif state == "replace" and _REPLACE.match(stripped):
            pairs.append(("".join(search), "".join(replace)))
            state = "out"
        elif state == "search":
            search.append(line if line.endswith("\n") else line + "\n")
        elif state == "replace":
            replace.append(line if line.endswith("\n") else line + "\n")
    if state != "out":
        missing = "=======" if state == "search" else ">>>>>>> REPLACE"
        raise PatchError("no_diff", f"edit {len(pairs) + 1} is not finished: no '{missing}' line after its "
                                    f"'<<<<<<< SEARCH' (was the answer cut off?). Write each edit as:\n{DIFF_FORMAT}")
    if not pairs:
        raise PatchError("no_diff", f"the answer has no SEARCH/REPLACE edit. Write each edit as:\n{DIFF_FORMAT}")
    return pairs


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _occurrences(text: str, search: str) -> list[int]:
    """Offsets where `search` matches whole lines of `text` (overlaps included)."""
    hits, pos = [], text.find(search)
    while pos >= 0:
        if pos == 0 or text[pos - 1] == "\n":
            hits.append(pos)
        pos = text.find(search, pos + 1)
    return hits


def _nearest(text: str, spans: list[tuple[int, int]], search: str) -> str:
    """The block lines most like `search`, numbered, for a model to copy: the window of as many
    lines sharing the most lines with it (whitespace aside), else the window starting at the line
    most like its first line."""
    want = [w.strip() for w in _lines(search)]
    windows: list[tuple[int, list[str]]] = []  # (first line number, lines)
    for a, b in spans:
        region = _lines(text[a:b])
        first = _line_of(text, a)
        windows += [(first + i, region[i:i + len(want)]) for i in range(max(1, len(region) - len(want) + 1))]
    windows = [w for w in windows if w[1]]
    if not windows:
        return "the EVOLVE-BLOCKs are empty"
    shared = [sum(x.strip() == y for x, y in zip(lines, want)) for _, lines in windows]
    if max(shared) == len(want):
        line = windows[shared.index(len(want))][0]
        return (f"lines {line}-{line + len(want) - 1} match it except for whitespace; "
                "copy their indentation and spacing exactly")
    if max(shared) > 0:
        line, lines = windows[shared.index(max(shared))]
    else:
        likeness = [difflib.SequenceMatcher(None, lines[0].strip(), want[0]).ratio() for _, lines in windows]
        line, lines = windows[likeness.index(max(likeness))]
    numbered = "".join(f"{line + k:5d}| {text_line}" for k, text_line in enumerate(lines))
    return f"the nearest lines in the EVOLVE-BLOCKs are {line}-{line + len(lines) - 1}:\n{numbered}"


def apply_diff(parent: str, response: str) -> str:
    """`parent` with the answer's SEARCH/REPLACE edits applied in order. Each SEARCH must match
    whole lines exactly once inside an EVOLVE-BLOCK (a match outside them does not count as a
    second one); the markers stay as they are."""
    pairs = _parse_diff(response)
    text = parent
    n = len(pairs)
    for i, (search, replace) in enumerate(pairs, 1):
        label = f"edit {i} of {n}"
        if not search.strip():
            raise PatchError("no_match", f"{label}: its SEARCH is empty; copy the lines to replace from the program")
        if START in search or END in search:
            raise PatchError("outside_block", f"{label}: its SEARCH contains an EVOLVE-BLOCK marker line; edits "
                                              "must lie strictly between the markers, so leave the marker lines out")
        if START in replace or END in replace:
            raise PatchError("markers_removed", f"{label}: its REPLACE contains an EVOLVE-BLOCK marker; "
                                                "the markers must stay exactly as they are")
        spans = evolve_blocks(text)
        hits = _occurrences(text, search)
        inside = [h for h in hits if any(a <= h and h + len(search) <= b for a, b in spans)]
        if len(inside) > 1:
            where = ", ".join(str(_line_of(text, h)) for h in inside)
            raise PatchError("ambiguous", f"{label}: its SEARCH matches {len(inside)} places (lines {where}); "
                                          "add neighbouring lines to the SEARCH so it matches one place only")
        if not inside and hits:
            where = ", ".join(str(_line_of(text, h)) for h in hits)
            raise PatchError("outside_block", f"{label}: its SEARCH matches only outside the EVOLVE-BLOCKs (line "
                                              f"{where}); only the code between the markers may change")
        if not inside:
            first = search.splitlines()[0]
            raise PatchError("no_match", f"{label}: its SEARCH (first line {first!r}) does not match the program "
                                         f"exactly{' after the edits before it' if i > 1 else ''}; "
                                         f"{_nearest(text, spans, search)}")
        text = text[:inside[0]] + replace + text[inside[0] + len(search):]
    return text


@dataclass(frozen=True)
class _Fenced:
    info: str  # the fence's language tag, lower case ("" when none)
    content: str
    closed: bool


def _fenced_blocks(response: str) -> list[_Fenced]:
    blocks: list[_Fenced] = []
    fence, info, body = "", "", []
    for line in _lines(response.replace("\r\n", "\n")):
        stripped = line.strip()
        if not fence:
            m = _FENCE_OPEN.match(line.rstrip("\n"))
            if m:
                fence, info, body = m.group(1), m.group(2).lower(), []
        elif stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            blocks.append(_Fenced(info, "".join(body), True))
            fence = ""
        else:
            body.append(line if line.endswith("\n") else line + "\n")
    if fence:
        blocks.append(_Fenced(info, "".join(body), False))
    return blocks


def extract_code(response: str, lang: str = "python") -> str:
    """The last fenced block tagged `lang` (or an alias such as `py`), else the last untagged one."""
    tags = LANG_ALIASES.get(lang, {lang})
    blocks = _fenced_blocks(response)
    for wanted in (tags, {""}):
        found = [b for b in blocks if b.closed and b.info in wanted]
        if found:
            return found[-1].content
    if any(not b.closed and b.info in tags for b in blocks):
        raise PatchError("no_code", f"the ```{lang} block is never closed (was the answer cut off at the token limit?)")
    raise PatchError("no_code", f"the answer has no ```{lang} fenced block; put the code in one")


def extract_json_block(response: str, tag: str = "json") -> dict:
    """The JSON object of the last fenced block tagged `tag`, else of the last untagged block that
    starts with '{'."""
    blocks = [b for b in _fenced_blocks(response) if b.closed]
    found = ([b for b in blocks if b.info == tag]
             or [b for b in blocks if not b.info and b.content.lstrip().startswith("{")])
    if not found:
        raise PatchError("no_json", f"the answer has no ```{tag} fenced block; put the JSON object in one")
    try:
        value = json.loads(found[-1].content)
    except json.JSONDecodeError as e:
        raise PatchError("bad_json", f"the ```{tag} block is not valid JSON: {e.msg} at line {e.lineno}, "
                                     f"column {e.colno}") from None
    if not isinstance(value, dict):
        raise PatchError("bad_json", f"the ```{tag} block must hold a JSON object {{...}}, got {type(value).__name__}")
    return value


def apply_rewrite(parent: str, response: str) -> str:
    """The answer's ```python block as the new program. Only the EVOLVE-BLOCKs' contents are taken
    from it: the text around them must equal the parent's (trailing whitespace at the end of the
    file aside) and is kept byte for byte from the parent."""
    code = extract_code(response, "python")
    parent_spans = evolve_blocks(parent)
    try:
        spans = evolve_blocks(code)
    except PatchError as e:
        raise PatchError("markers_removed", f"the rewrite's EVOLVE-BLOCK markers: {e.message}") from None
    if len(spans) != len(parent_spans):
        raise PatchError("markers_removed", f"the program has {len(parent_spans)} EVOLVE-BLOCK(s), the rewrite "
                                            f"{len(spans)}; keep every marker line as it is")
    outside_parent = _outside(parent, parent_spans)
    outside_code = _outside(code, spans)
    for k, (p, c) in enumerate(zip(outside_parent, outside_code)):
        last = k == len(outside_parent) - 1
        if (p.rstrip() != c.rstrip()) if last else (p != c):
            region = ("before the first EVOLVE-BLOCK" if k == 0 else "after the last EVOLVE-BLOCK" if last
                      else f"between EVOLVE-BLOCKs {k} and {k + 1}")
            raise PatchError("outside_block", f"the rewrite changes the text {region}: {_first_difference(p, c)}; "
                                              "only the code between the markers may change")
    pieces = [outside_parent[0]]
    for (a, b), rest in zip(spans, outside_parent[1:]):
        pieces += [code[a:b], rest]
    return "".join(pieces)


def _outside(text: str, spans: list[tuple[int, int]]) -> list[str]:
    """The text before, between and after the editable spans (marker lines included)."""
    bounds = [0] + [x for span in spans for x in span] + [len(text)]
    return [text[bounds[i]:bounds[i + 1]] for i in range(0, len(bounds), 2)]


def _first_difference(old: str, new: str) -> str:
    a, b = old.splitlines(), new.splitlines()
    for k, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"the program's line {x!r} became {y!r}"
    if len(a) > len(b):
        return f"the program's line {a[len(b)]!r} is missing"
    return f"the line {b[len(a)]!r} was added"
