"""MkDocs hook: the docstrings' reStructuredText roles (``:func:`name```, ``:class:``, ``:mod:``, ...) as
links into the API reference.

mkdocstrings renders a role as ``:func:<code>name</code>``; this turns it into an optional
cross-reference that mkdocs-autorefs resolves to the object's entry where the API reference has one
(``name``, or ``moeyard.name``), and into plain code otherwise.
"""

from __future__ import annotations

import html
import re

_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):<code>([^<]+)</code>")


def _autoref(match: re.Match) -> str:
    text = match.group(1)
    name = html.unescape(text).strip().lstrip("~.").removesuffix("()")
    ident = name if name.startswith("moeyard") else f"moeyard.{name}"
    return f'<autoref identifier="{html.escape(ident)}" optional><code>{text}</code></autoref>'


def on_page_content(html_text: str, **kwargs) -> str:
    return _ROLE.sub(_autoref, html_text)
