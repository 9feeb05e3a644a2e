"""Markdown to Qt rich-text segments in plain Python (markdown-it-py + Pygments), safe to run off the UI thread."""
from __future__ import annotations

import html
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

from markdown_it import MarkdownIt
from pygments.lexer import Lexer
from pygments.lexers import get_lexer_by_name
from pygments.token import Comment, Keyword, Name, Number, Operator, String, Token, _TokenType
from pygments.util import ClassNotFound

CODE_LINE_LIMIT = 4000  # lines highlighted per block; beyond it the rest is plain (a pasted log stays fast)

# Pygments token families -> the palette's "code" roles; the most specific family listed wins.
_ROLES: tuple[tuple[_TokenType, str], ...] = (
    (Comment, "comment"),
    (String, "string"),
    (Number, "number"),
    (Keyword, "keyword"),
    (Name.Decorator, "decorator"),
    (Name.Function, "function"),
    (Name.Class, "class"),
    (Name.Builtin, "builtin"),
    (Name.Exception, "class"),
    (Operator.Word, "keyword"),
    (Operator, "operator"),
)


@dataclass(frozen=True)
class TextSegment:
    """Prose between code blocks, as Qt rich text (headings, lists, tables, inline code)."""

    html: str  # for QTextDocument.setHtml


@dataclass(frozen=True)
class CodeSegment:
    """One fenced code block: shown in its own frame with its language and a Copy button."""

    language: str  # the fence's info word ("" when none)
    code: str  # the code exactly as written, for Copy
    html: str  # highlighted, for QTextDocument.setHtml


Segment = TextSegment | CodeSegment


@lru_cache(maxsize=1)
def _parser() -> MarkdownIt:
    # CommonMark plus tables and strikethrough; raw HTML off, so model output is shown, never interpreted.
    return MarkdownIt("commonmark", {"html": False, "linkify": False}).enable(["table", "strikethrough"])


@lru_cache(maxsize=64)
def _lexer(language: str) -> Lexer | None:
    if not language:
        return None
    try:
        return get_lexer_by_name(language, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return None


def _role(ttype: _TokenType) -> str | None:
    while ttype is not Token:
        for family, role in _ROLES:
            if ttype is family:
                return role
        ttype = ttype.parent
    return None


def highlight(code: str, language: str, colours: Mapping[str, str]) -> str:
    """Code as a <pre> of coloured spans; unknown languages stay plain (but still monospaced)."""
    lexer = _lexer(language.lower())
    lines = code.split("\n")
    head, tail = "\n".join(lines[:CODE_LINE_LIMIT]), "\n".join(lines[CODE_LINE_LIMIT:])
    parts: list[str] = []
    if lexer is None:
        parts.append(html.escape(head))
    else:
        for ttype, value in lexer.get_tokens(head):
            role = _role(ttype)
            text = html.escape(value)
            colour = colours.get(role) if role else None
            if colour == colours.get("text"):
                colour = None  # the <pre> colour already; fewer spans lay out faster
            parts.append(f'<span style="color:{colour}">{text}</span>' if colour else text)
    if tail:
        parts.append("\n" + html.escape(tail))
    body = "".join(parts)
    # pre-wrap: Qt's <pre> never wraps, and a long line would be cut off in a bubble that does not scroll.
    return f'<pre style="color:{colours.get("text", "#000")}; margin:0; white-space:pre-wrap">{body}</pre>'


_TABLE = re.compile(r"<table>")


def _qt_html(fragment: str, colours: Mapping[str, str]) -> str:
    # Qt's rich text draws no table borders and no inline-code background without being told.
    border = colours.get("border", "#d0d7de")
    fragment = _TABLE.sub(f'<table border="1" cellspacing="0" cellpadding="5" '
                          f'style="border-collapse:collapse; border-color:{border}">', fragment)
    inline = colours.get("inline", "#eff1f3")
    return fragment.replace("<code>", f'<code style="background-color:{inline}">')


def render_markdown(text: str, colours: Mapping[str, str]) -> tuple[Segment, ...]:
    """Splits `text` into prose and code blocks and renders each; `colours` is the palette's code table."""
    md = _parser()
    env: dict[str, object] = {}
    tokens = md.parse(text, env)
    segments: list[Segment] = []
    prose: list = []

    def flush() -> None:
        if prose:
            rendered = md.renderer.render(prose, md.options, env)
            if rendered.strip():
                segments.append(TextSegment(_qt_html(rendered, colours)))
            prose.clear()

    for token in tokens:
        # Only top-level fences get their own frame; a fence inside a list item stays in the prose.
        if token.type in ("fence", "code_block") and token.level == 0:
            flush()
            language = token.info.strip().split(" ")[0] if token.type == "fence" else ""
            code = token.content[:-1] if token.content.endswith("\n") else token.content
            segments.append(CodeSegment(language, code, highlight(code, language, colours)))
        else:
            prose.append(token)
    flush()
    return tuple(segments)
