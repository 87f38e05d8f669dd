"""Patches from model answers: SEARCH/REPLACE diffs and rewrites confined to EVOLVE-BLOCKs, and the
fenced code / JSON blocks of an answer; every refusal has its kind and a message a model can use."""

from __future__ import annotations

import pytest
from llm_servers import ScriptedOpenAIServer

from commweave.llm import (Message, PatchError, apply_diff, apply_rewrite, client_for, evolve_blocks, extract_code,
                           extract_json_block)

PARENT = '''"""A candidate program."""
import torch

CHUNK = 4  # fixed by the harness

# EVOLVE-BLOCK-START
CONFIG = dict(comm_ctas=8, threads=512)


def run(ctx, state, inputs):
    assert ctx is not None
    out = inputs["a"] @ inputs["b"]
    out = out * 2
    return out
# EVOLVE-BLOCK-END

# EVOLVE-BLOCK-START
def setup(ctx, shape):
    assert ctx is not None
    return {"chunk": CHUNK}
# EVOLVE-BLOCK-END

out = out * 2
'''


def _diff(*edits: tuple[str, str]) -> str:
    return "".join(f"<<<<<<< SEARCH\n{s}=======\n{r}>>>>>>> REPLACE\n" for s, r in edits)


def test_evolve_blocks():
    spans = evolve_blocks(PARENT)
    assert len(spans) == 2
    assert PARENT[spans[0][0]:spans[0][1]].startswith("CONFIG = dict(")
    assert PARENT[spans[0][0]:spans[0][1]].endswith("    return out\n")
    assert PARENT[spans[1][0]:spans[1][1]] == ('def setup(ctx, shape):\n    assert ctx is not None\n'
                                               '    return {"chunk": CHUNK}\n')
    assert evolve_blocks("no blocks\n") == []
    with pytest.raises(PatchError, match="has no EVOLVE-BLOCK-END") as err:
        evolve_blocks("# EVOLVE-BLOCK-START\nx = 1\n")
    assert err.value.kind == "markers_removed"
    with pytest.raises(PatchError, match="line 2: EVOLVE-BLOCK-END without"):
        evolve_blocks("x = 1\n# EVOLVE-BLOCK-END\n")
    with pytest.raises(PatchError, match="inside the EVOLVE-BLOCK opened at line 1"):
        evolve_blocks("# EVOLVE-BLOCK-START\n# EVOLVE-BLOCK-START\n# EVOLVE-BLOCK-END\n")


def test_diff_applies_amid_prose_and_fences():
    answer = ("I will use more CTAs and drop the doubling.\n\n```python\n"
              + _diff(("CONFIG = dict(comm_ctas=8, threads=512)\n", "CONFIG = dict(comm_ctas=16, threads=512)\n"))
              + "```\n\nAnd in setup:\n```\n"
              + _diff(('    return {"chunk": CHUNK}\n', '    return {"chunk": CHUNK, "streams": 2}\n'))
              + "```\nDone.")
    child = apply_diff(PARENT, answer)
    assert "comm_ctas=16" in child and '"streams": 2' in child
    assert child.replace("comm_ctas=16", "comm_ctas=8").replace(', "streams": 2', "") == PARENT


def test_edits_apply_in_order():
    child = apply_diff(PARENT, _diff(("    out = out * 2\n", "    out = out * 3\n"),
                                     ("    out = out * 3\n    return out\n", "    return out + 1\n")))
    assert "    out = inputs[\"a\"] @ inputs[\"b\"]\n    return out + 1\n" in child
    assert child.endswith("out = out * 2\n")  # the same line outside the blocks is untouched


def test_no_diff():
    with pytest.raises(PatchError, match="no SEARCH/REPLACE edit") as err:
        apply_diff(PARENT, "I think CONFIG should use 16 CTAs.")
    assert err.value.kind == "no_diff"
    with pytest.raises(PatchError, match="edit 1 is not finished.*cut off") as err:
        apply_diff(PARENT, "<<<<<<< SEARCH\nCONFIG = dict(comm_ctas=8, threads=512)\n=======\nCONFIG = dict(")
    assert err.value.kind == "no_diff"


def test_no_match_shows_the_nearest_lines():
    with pytest.raises(PatchError) as err:
        apply_diff(PARENT, _diff(("CONFIG = dict(comm_ctas=8, threads=256)\n", "CONFIG = dict(comm_ctas=8)\n")))
    assert err.value.kind == "no_match"
    assert "edit 1 of 1" in err.value.message and "threads=256" in err.value.message
    assert "nearest lines in the EVOLVE-BLOCKs are 7-7" in err.value.message
    assert "    7| CONFIG = dict(comm_ctas=8, threads=512)" in err.value.message
    wrong_middle = '    assert ctx is not None\n    out = inputs["a"] @ inputs["c"]\n    out = out * 2\n'
    with pytest.raises(PatchError, match="nearest lines in the EVOLVE-BLOCKs are 11-13:\n   11|     assert ctx"):
        apply_diff(PARENT, _diff((wrong_middle, "")))


def test_no_match_says_when_only_whitespace_differs():
    with pytest.raises(PatchError, match="lines 12-13 match it except for whitespace") as err:
        apply_diff(PARENT, _diff(('  out = inputs["a"] @ inputs["b"]\n  out = out * 2\n', "  pass\n")))
    assert err.value.kind == "no_match"


def test_second_edit_failing_is_named():
    with pytest.raises(PatchError, match="edit 2 of 2.*after the edits before it") as err:
        apply_diff(PARENT, _diff(("    out = out * 2\n", "    out = out * 3\n"),
                                 ("    out = out * 2\n", "    out = out * 4\n")))
    assert err.value.kind == "no_match"


def test_ambiguous():
    with pytest.raises(PatchError, match="matches 2 places \\(lines 11, 19\\)") as err:
        apply_diff(PARENT, _diff(("    assert ctx is not None\n", "")))
    assert err.value.kind == "ambiguous"


def test_outside_block():
    with pytest.raises(PatchError, match="only outside the EVOLVE-BLOCKs \\(line 4\\)") as err:
        apply_diff(PARENT, _diff(("CHUNK = 4  # fixed by the harness\n", "CHUNK = 8\n")))
    assert err.value.kind == "outside_block"
    with pytest.raises(PatchError, match="contains an EVOLVE-BLOCK marker line") as err:
        apply_diff(PARENT, _diff(("# EVOLVE-BLOCK-START\nCONFIG = dict(comm_ctas=8, threads=512)\n",
                                  "# EVOLVE-BLOCK-START\nCONFIG = dict(comm_ctas=4, threads=512)\n")))
    assert err.value.kind == "outside_block"


def test_markers_removed_by_a_diff():
    with pytest.raises(PatchError, match="REPLACE contains an EVOLVE-BLOCK marker") as err:
        apply_diff(PARENT, _diff(("    return out\n", "    return out\n# EVOLVE-BLOCK-END\n# EVOLVE-BLOCK-START\n")))
    assert err.value.kind == "markers_removed"


def _rewrite(code: str) -> str:
    return f"Here is the whole program:\n```python\n{code}```\nIt uses 16 CTAs."


def test_rewrite_accepted():
    new = PARENT.replace("comm_ctas=8", "comm_ctas=16").replace("    out = out * 2\n    return out\n",
                                                                  "    return out * 2\n")
    assert apply_rewrite(PARENT, _rewrite(new + "\n\n")) == new  # trailing blank lines are forgiven


def test_rewrite_rejected_outside_blocks():
    with pytest.raises(PatchError, match="before the first EVOLVE-BLOCK.*'CHUNK = 4  # fixed by the harness' "
                                         "became 'CHUNK = 8'") as err:
        apply_rewrite(PARENT, _rewrite(PARENT.replace("CHUNK = 4  # fixed by the harness", "CHUNK = 8")))
    assert err.value.kind == "outside_block"
    with pytest.raises(PatchError, match="after the last EVOLVE-BLOCK.*'out = out \\* 2' is missing"):
        apply_rewrite(PARENT, _rewrite(PARENT.replace("\nout = out * 2\n", "\n")))
    with pytest.raises(PatchError, match="between EVOLVE-BLOCKs 1 and 2"):
        apply_rewrite(PARENT, _rewrite(PARENT.replace("# EVOLVE-BLOCK-END\n\n#", "# EVOLVE-BLOCK-END\n#")))


def test_rewrite_markers_removed():
    one_block = PARENT.replace("# EVOLVE-BLOCK-END\n\n# EVOLVE-BLOCK-START\n", "\n")
    with pytest.raises(PatchError, match="has 2 EVOLVE-BLOCK\\(s\\), the rewrite 1") as err:
        apply_rewrite(PARENT, _rewrite(one_block))
    assert err.value.kind == "markers_removed"
    with pytest.raises(PatchError, match="rewrite's EVOLVE-BLOCK markers: the EVOLVE-BLOCK-START at line 17 has no"
                       ) as err:
        apply_rewrite(PARENT, _rewrite(PARENT.replace('CHUNK}\n# EVOLVE-BLOCK-END\n', 'CHUNK}\n')))
    assert err.value.kind == "markers_removed"
    with pytest.raises(PatchError) as err:
        apply_rewrite(PARENT, "Use 16 CTAs in CONFIG.")
    assert err.value.kind == "no_code"


def test_extract_code():
    answer = "```python\nfirst = 1\n```\ntext\n```py\nsecond = 2\n```\n```cuda\n__global__ void k() {}\n```\n"
    assert extract_code(answer) == "second = 2\n"
    assert extract_code(answer, "cuda") == "__global__ void k() {}\n"
    assert extract_code("prose\n```\nuntagged = 3\n```") == "untagged = 3\n"
    assert extract_code("~~~~python\nx = '```'\n~~~~\n") == "x = '```'\n"
    with pytest.raises(PatchError, match="never closed.*cut off") as err:
        extract_code("```python\ndef run(ctx):\n    return")
    assert err.value.kind == "no_code"
    with pytest.raises(PatchError, match="no ```python fenced block") as err:
        extract_code("```cuda\nint x;\n```")
    assert err.value.kind == "no_code"


def test_extract_json_block():
    answer = ('Targets:\n```json\n{"backend": "lsa"}\n```\nthen\n'
              '```json\n{"backend": "gin", "chunk_bytes": 1048576}\n```\n```python\nx = 1\n```')
    assert extract_json_block(answer) == {"backend": "gin", "chunk_bytes": 1048576}
    assert extract_json_block('```\n{"issuer": "cta"}\n```\n```\nnot json\n```') == {"issuer": "cta"}
    assert extract_json_block('```directives\n{"a": 1}\n```', tag="directives") == {"a": 1}
    for answer, kind, message in [
        ("no json here", "no_json", "no ```json fenced block"),
        ('```json\n{"backend": "lsa",}\n```', "bad_json", "not valid JSON: .* at line 1, column 19"),
        ('```json\n["lsa"]\n```', "bad_json", "must hold a JSON object"),
    ]:
        with pytest.raises(PatchError, match=message) as err:
            extract_json_block(answer)
        assert err.value.kind == kind


def test_a_served_diff_becomes_a_program():
    """The path the proposer takes: a model's answer, over HTTP, applied to the parent."""
    answer = ("```json\n{\"comm_ctas\": 16}\n```\n"
              + _diff(("CONFIG = dict(comm_ctas=8, threads=512)\n", "CONFIG = dict(comm_ctas=16, threads=512)\n")))
    with ScriptedOpenAIServer([answer]) as srv:
        done = client_for(srv.model()).complete([Message("user", f"Improve:\n{PARENT}")])
        assert "CHUNK = 4" in srv.prompt(0)
    assert extract_json_block(done.text) == {"comm_ctas": 16}
    assert "comm_ctas=16" in apply_diff(PARENT, done.text)


def test_patch_error_kinds_are_checked():
    with pytest.raises(ValueError, match="kind 'oops'"):
        PatchError("oops", "message")
