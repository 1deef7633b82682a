"""README's text and its fenced code blocks: tests/deploy/test_readme.py runs them, and
the vLLM server tests (tests/vllm/test_vllm_serve.py, test_vllm_pd_serve.py) start the
commands README gives."""

from __future__ import annotations

from tests.support.paths import ROOT

README = (ROOT / "README.md").read_text()


def fenced(text: str) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of ``text``, in order."""
    found, lang, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                found.append((lang, "\n".join(body) + "\n"))
                lang = None
        elif lang is not None:
            body.append(line)
    return found


def blocks(lang: str, text: str = README) -> list[str]:
    return [code for found, code in fenced(text) if found == lang]
