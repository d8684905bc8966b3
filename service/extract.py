"""The text of one attached file, read in a child process of its own (service/documents.py
starts it): the file's bytes on stdin, one JSON object on stdout, {"text": ...} or
{"refused": why}. Its limits are set before it reads a byte (address space, CPU seconds,
no file written), so a decompression bomb or a PDF built to loop costs this process, not the
app's event loop or memory. Run as a script with `python -P` (its folder not on the path):
it imports nothing of the app, only the standard library, pypdf and python-docx.

    python -P service/extract.py KIND MAX_CHARS MAX_PAGES MEMORY_MB CPU_S < file
"""

from __future__ import annotations

import codecs
import io
import json
import os
import resource
import sys
import zipfile
from html.parser import HTMLParser

# A DOCX is a zip of XML parts: more unpacked than this is a bomb, whatever its text.
DOCX_UNPACKED_BYTES = 200 << 20
# Control characters other than tab, newline, carriage return and form feed: a text file
# with more than this share of them is a binary one.
BINARY_SHARE = 0.01
BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"),
        (codecs.BOM_UTF8, "utf-8-sig"), (codecs.BOM_UTF16_LE, "utf-16"),
        (codecs.BOM_UTF16_BE, "utf-16"))


class Refused(Exception):
    """Why the file cannot be read, in words for its owner."""


def limit(memory_mb: int, cpu_s: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    os.nice(10)  # the app's sessions first


def plain(data: bytes, max_chars: int, _pages: int) -> str:
    """UTF-8 (with or without its byte-order mark), or UTF-16/32 with one."""
    encoding = next((name for bom, name in BOMS if data.startswith(bom)), "utf-8")
    if encoding == "utf-8" and b"\x00" in data:
        raise Refused("it is a binary file, not text")
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError:
        raise Refused("it is not UTF-8 text (nor UTF-16 with a byte-order mark); save it "
                      "as UTF-8 and attach it again") from None
    controls = sum(1 for c in text if c < " " and c not in "\t\n\r\f")
    if "\x00" in text or controls > BINARY_SHARE * max(len(text), 1):
        raise Refused("it is a binary file, not text")
    return _bounded(text, max_chars)


class _HtmlText(HTMLParser):
    """A page's text: what a reader sees, without scripts and styles; blocks on their own
    lines."""

    SKIPPED = {"script", "style", "template", "noscript"}
    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre",
              "section", "article", "table", "blockquote", "title", "hr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skipping = 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIPPED:
            self.skipping += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.SKIPPED:
            self.skipping = max(0, self.skipping - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skipping:
            self.parts.append(data)


def html(data: bytes, max_chars: int, pages: int) -> str:
    parser = _HtmlText()
    parser.feed(plain(data, max_chars * 4, pages))
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.parts).splitlines())
    return _bounded("\n".join(line for line in lines if line), max_chars)


def pdf(data: bytes, max_chars: int, max_pages: int) -> str:
    from pypdf import PdfReader
    from pypdf.errors import LimitReachedError

    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            raise Refused("the PDF is encrypted (password-protected); save a copy without "
                          "a password and attach that")
        count = len(reader.pages)
        if count > max_pages:
            raise Refused(f"the PDF has {count:,} pages; this chat reads at most "
                          f"{max_pages:,}: attach the part you need")
        parts, size = [], 0
        for number, page in enumerate(reader.pages, 1):
            # Unpacked here first: pypdf's text extraction reads a page whose stream is
            # over its limit as empty, where this raises LimitReachedError.
            contents = page.get_contents()
            if contents is not None:
                contents.get_data()
            text = (page.extract_text() or "").strip()
            parts.append(f"[Page {number}]\n{text}")
            size += len(parts[-1])
            if size > max_chars:
                raise Refused(f"its text is over this chat's {max_chars:,} characters a "
                              "document: attach the pages you need")
    except (Refused, MemoryError):
        raise
    except LimitReachedError:
        raise Refused("the PDF unpacks to more than this chat reads (a decompression "
                      "bomb?)") from None
    except Exception:  # pypdf's parser meets a damaged file in many ways; all mean this
        raise Refused("it could not be read as a PDF (damaged or not a PDF)") from None
    if not any(p.split("\n", 1)[1].strip() for p in parts):
        raise Refused("the PDF has no text to read (a scan? this chat reads text, not "
                      "images)")
    return "\n\n".join(parts)


def docx(data: bytes, max_chars: int, _pages: int) -> str:
    import docx as python_docx
    from docx.table import Table

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            if sum(info.file_size for info in archive.infolist()) > DOCX_UNPACKED_BYTES:
                raise Refused("the document unpacks to more than this chat reads (a "
                              "decompression bomb?)")
        document = python_docx.Document(io.BytesIO(data))
        parts = []
        for block in document.iter_inner_content():
            if isinstance(block, Table):
                parts.extend(" | ".join(cell.text.strip() for cell in row.cells)
                             for row in block.rows)
            else:
                parts.append(block.text)
    except (Refused, MemoryError):
        raise
    except Exception:  # not a zip, a part missing, XML that does not parse
        raise Refused("it could not be read as a Word document (.docx)") from None
    text = "\n".join(parts).strip()
    if not text:
        raise Refused("the document has no text to read")
    return _bounded(text, max_chars)


def _bounded(text: str, max_chars: int) -> str:
    if len(text) > max_chars:
        raise Refused(f"its text is {len(text):,} characters, over this chat's "
                      f"{max_chars:,} a document: attach the part you need")
    return text


READERS = {"text": plain, "html": html, "pdf": pdf, "docx": docx}


def main(argv: list[str]) -> dict:
    kind, max_chars, max_pages, memory_mb, cpu_s = argv[0], *map(int, argv[1:5])
    limit(memory_mb, cpu_s)
    data = sys.stdin.buffer.read()
    try:
        return {"text": READERS[kind](data, max_chars, max_pages)}
    except Refused as exc:
        return {"refused": str(exc)}
    except MemoryError:
        return {"refused": "it takes more memory to read than this chat allows (a "
                           "decompression bomb?)"}
    except ImportError as exc:  # a deployment without pypdf or python-docx
        return {"refused": f"this server cannot read {kind.upper()} files ({exc.name} is "
                           "not installed)"}


if __name__ == "__main__":
    result = main(sys.argv[1:])
    sys.stdout.write(json.dumps(result))
