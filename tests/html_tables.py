"""The tables of an HTML page as text, read with the standard library's parser (independently of the template
that wrote them)."""

from __future__ import annotations

import html.parser


class _Tables(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._table: list[list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self._table = self.tables.setdefault(dict(attrs).get("class") or "", [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self._table[-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def table_rows(page: str, css_class: str) -> list[dict[str, str]]:
    """The rows of the table with this class, each as {header: cell}."""
    parser = _Tables()
    parser.feed(page)
    header, *rows = parser.tables[css_class]
    return [dict(zip(header, row, strict=True)) for row in rows]
