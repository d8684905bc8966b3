"""Files to attach in tests and benchmarks, made here rather than kept as binaries: PDFs
written object by object (their text in Helvetica, one page per string), Word documents by
python-docx, and the hostile ones (encrypted, damaged, a decompression bomb, too many
pages, a zip bomb in a .docx)."""

from __future__ import annotations

import io
import zipfile
import zlib


def pdf(pages: list[str], extra_objects: list[bytes] = ()) -> bytes:
    """A PDF whose pages show these lines of text (one string a page, `\\n` between
    lines)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", None,
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    kids = []
    for text in pages:
        lines = [line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
                 for line in text.split("\n")]
        body = "BT /F1 12 Tf 72 720 Td 14 TL " + " ".join(f"({line}) '" for line in lines) \
            + " ET"
        stream = body.encode("latin-1")
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream))
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>"
                       % len(objects))
        kids.append(len(objects))
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
        b" ".join(b"%d 0 R" % k for k in kids), len(kids))
    objects.extend(extra_objects)
    return _assembled(objects)


def _assembled(objects: list[bytes]) -> bytes:
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n%s\nendobj\n" % (number, body))
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for offset in offsets:
        out.write(b"%010d 00000 n \n" % offset)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n"
              % (len(objects) + 1, xref))
    return out.getvalue()


def encrypted_pdf(text: str) -> bytes:
    from pypdf import PdfReader, PdfWriter

    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf([text]))))
    writer.encrypt("secret", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


def many_pages_pdf(count: int) -> bytes:
    """`count` pages sharing one small content stream."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", None,
               b"<< /Length 0 >>\nstream\n\nendstream"]
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R >>"
    first = len(objects) + 1
    objects.extend([page] * count)
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (
        b" ".join(b"%d 0 R" % (first + i) for i in range(count)), count)
    return _assembled(objects)


def bomb_pdf(unpacked_mb: int = 1024) -> bytes:
    """One page whose content stream is `unpacked_mb` MB of spaces, deflated (about
    1/1000 of that)."""
    packer = zlib.compressobj(9)
    chunk = b" " * (1 << 20)
    packed = b"".join(packer.compress(chunk) for _ in range(unpacked_mb)) + packer.flush()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [4 0 R] /Count 1 >>",
               b"<< /Length %d /Filter /FlateDecode >>\nstream\n%s\nendstream"
               % (len(packed), packed),
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R >>"]
    return _assembled(objects)


def docx(paragraphs: list[str], table: list[list[str]] = ()) -> bytes:
    import docx as python_docx

    document = python_docx.Document()
    for text in paragraphs:
        document.add_paragraph(text)
    if table:
        grid = document.add_table(rows=len(table), cols=len(table[0]))
        for r, row in enumerate(table):
            for c, cell in enumerate(row):
                grid.cell(r, c).text = cell
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def zip_bomb_docx(unpacked_mb: int = 512) -> bytes:
    """A .docx whose one extra part unpacks to `unpacked_mb` MB of zeros."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(docx(["cover"]))) as source, \
            zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bomb:
        for info in source.infolist():
            bomb.writestr(info, source.read(info))
        with bomb.open("word/media/padding.bin", "w", force_zip64=True) as part:
            zeros = b"\0" * (1 << 20)
            for _ in range(unpacked_mb):
                part.write(zeros)
    return out.getvalue()
