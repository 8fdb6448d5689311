"""llama.cpp's tokenizer test vectors and pre-tokenizer tables, read from the llama-cpp-python sdist.

`vendored_llama_cpp` fetches the (pinned) sdist once with pip into `$NANOSERVE_CACHE/llama-cpp-python/` and
extracts only what the tests read (`models/ggml-vocab-*`, `src/llama-vocab.cpp`), or skips the
calling test with the reason when the package registry cannot be reached. `vocab_cases` reads a
vocabulary's `.inp`/`.out` pair as llama.cpp's `tests/test-tokenizer-0.cpp` does. `pre_tokenizer_table`
reads from `llama-vocab.cpp` each `tokenizer.ggml.pre` name of a BPE vocabulary with the regexes
and defaults llama.cpp gives it (string literals of C++ decoded, comments skipped).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import NamedTuple

import pytest

from nanoserve.cache import cache_root

# Pinned so that a run judges against known vectors and names; a newer llama.cpp is taken in on purpose.
PACKAGE = "llama-cpp-python==0.3.36"
_SEPARATOR = "\n__ggml_vocab_test__\n"
_WANTED = re.compile(r"^[^/]+/vendor/llama\.cpp/(models/ggml-vocab-[^/]+|src/llama-vocab\.cpp)$")


def vendored_llama_cpp() -> Path:
    """The extracted llama.cpp tree of the PACKAGE sdist (downloaded on first use)."""
    root = cache_root() / "llama-cpp-python"
    done = root / "extracted"
    if done.is_file():
        return root / done.read_text().strip()
    root.mkdir(parents=True, exist_ok=True)
    sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        run = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
             "--disable-pip-version-check", PACKAGE, "-d", str(root)],
            capture_output=True, text=True, timeout=900,
        )
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
        if run.returncode != 0 or not sdists:
            pytest.skip(f"cannot download the {PACKAGE} sdist from the package registry: "
                        f"{(run.stderr.strip().splitlines() or ['pip failed'])[-1]}")
    with tarfile.open(sdists[-1]) as archive:
        members = [m for m in archive.getmembers() if m.isfile() and _WANTED.match(m.name)]
        archive.extractall(root, members=members, filter="data")
    tree = Path(members[0].name.split("/vendor/")[0]) / "vendor" / "llama.cpp"
    done.write_text(str(tree))
    return root / tree


class VocabCase(NamedTuple):
    text: str
    ids: list[int]


def vocab_cases(vocab: Path) -> list[VocabCase]:
    """The test texts of `vocab` (its `.inp`: texts separated by a marker line) with their ids (its
    `.out`: one line of space-separated ids per text)."""
    texts = vocab.with_name(vocab.name + ".inp").read_text(encoding="utf-8").split(_SEPARATOR)
    lines = vocab.with_name(vocab.name + ".out").read_text(encoding="utf-8").split("\n")
    if texts[-1] == "":
        texts.pop()
    if lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines), f"{vocab.name}: {len(texts)} texts, {len(lines)} id lines"
    return [VocabCase(t, [int(i) for i in line.split()]) for t, line in zip(texts, lines, strict=True)]


class LlamaCppPre(NamedTuple):
    """What llama.cpp's vocabulary loader does for one `tokenizer.ggml.pre` name of a BPE vocabulary."""

    pre_type: str
    regexes: tuple[str, ...]
    byte_encode: bool
    ignore_merges: bool
    add_bos: bool
    has_bos: bool


_LITERAL = re.compile(r'"((?:[^"\\]|\\.)*)"')
_ESCAPES = {"\\": "\\", "n": "\n", "r": "\r", "t": "\t", '"': '"', "'": "'"}


def _decode(literal: str) -> str:
    return re.sub(r"\\(.)", lambda m: _ESCAPES[m.group(1)], literal)


def _code(text: str) -> str:
    """`text` without its comment lines."""
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith("//"))


def _regexes_by_type(source: str) -> tuple[dict[str, tuple[tuple[str, ...], bool]], tuple[tuple[str, ...], bool]]:
    """pre type -> (regexes, byte_encode) from `llm_tokenizer_bpe`'s switch, and the default's."""
    body = source[source.index("struct llm_tokenizer_bpe : llm_tokenizer"):]
    body = body[body.index("switch (vocab.get_pre_type())"):body.index("std::vector<std::string> regex_exprs;")]
    by_type: dict[str, tuple[tuple[str, ...], bool]] = {}
    default: tuple[tuple[str, ...], bool] = ((), True)
    for chunk in _code(body).split("break;"):
        labels = re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", chunk)
        if "regex_exprs" not in chunk:
            continue
        exprs = chunk[chunk.index("regex_exprs"):]
        exprs = exprs[exprs.index("{") + 1:exprs.index("};")]
        rule = (tuple(_decode(s) for s in _LITERAL.findall(exprs)), "byte_encode = false" not in chunk)
        for label in labels:
            by_type[label] = rule
        if "default:" in chunk:
            default = rule
    return by_type, default


def pre_tokenizer_table(llama_cpp: Path) -> dict[str, LlamaCppPre]:
    """Every `tokenizer.ggml.pre` name llama.cpp accepts for a BPE vocabulary, as it loads it."""
    source = (llama_cpp / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    by_type, default = _regexes_by_type(source)
    block = source[source.index("if (type == LLAMA_VOCAB_TYPE_BPE) {"):]
    block = _code(block[:block.index("} else if (type == LLAMA_VOCAB_TYPE_SPM)")])
    table: dict[str, LlamaCppPre] = {}
    for branch in block.split("} else if (")[1:]:
        names = re.findall(r'tokenizer_pre == "([^"]+)"', branch)
        found = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", branch)
        if not names or found is None:
            continue
        pre_type = found.group(1)
        regexes, byte_encode = by_type.get(pre_type, default)
        for name in names:
            table[name] = LlamaCppPre(
                pre_type, regexes, byte_encode,
                ignore_merges="ignore_merges = true" in branch,
                add_bos="add_bos = true" in branch,
                has_bos="special_bos_id = LLAMA_TOKEN_NULL" not in branch,
            )
    return table
