"""Data sources: the files named by `DataConfig.path` and the documents inside them.

Formats (from the file name):
  text          .txt .text .md .rst .py   UTF-8 text, one document per file; a file over DOC_CHUNK_BYTES
                                          is cut at line boundaries into documents of at most that size
                                          (so one large book still has a held-out part)
  jsonl         .jsonl .ndjson (.gz)      one JSON object per non-blank line
  parquet       .parquet                  one row per document (pyarrow, read by batches of rows)
  array_record  .array_record .arrayrecord  one record per document (read through grain's
                                          ArrayRecordDataSource): a JSON object, read like a jsonl
                                          line, or else UTF-8 text
A record (jsonl line, parquet row, JSON ArrayRecord record) is a document through its `text_field` (a
string) or, when it has no such field, its `messages_field` (a list of {"role", "content", ...} chat
messages, rendered by the GLM chat template when tokenized: glm5_jax.data.chat).

A document's key is `<relpath>` (a text file that is one document) or `<relpath>#<i>` (record / chunk
i of the file): the held-out split hashes it (glm5_jax.data.corpus). `relpath` is relative to the
common directory of all the files, so moving a dataset keeps its split.

Every error names the file (and line / row / record) and what is allowed: a missing field, a value of
the wrong type, an empty file, invalid JSON or UTF-8.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
from typing import Iterator, List, Optional, Sequence, Tuple

from glm5_jax.config import ConfigError

DOC_CHUNK_BYTES = 1 << 20
_FORMATS = (
    (".jsonl.gz", "jsonl"), (".ndjson.gz", "jsonl"), (".jsonl", "jsonl"), (".ndjson", "jsonl"),
    (".parquet", "parquet"), (".array_record", "array_record"), (".arrayrecord", "array_record"),
    (".txt", "text"), (".text", "text"), (".md", "text"), (".rst", "text"), (".py", "text"),
)
EXTENSIONS = tuple(e for e, _ in _FORMATS)
_GLOB_CHARS = set("*?[")


class DataError(ConfigError):
    """A data file that cannot be read as documents (the message names the file and what is wrong). A
    ConfigError (a ValueError): the data settings point at bad data, and experiments.run reports it as
    one line with exit status 2, like any other bad setting."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: str      # absolute path
    relpath: str   # POSIX path relative to the corpus root (document keys start with it)
    format: str    # "text" | "jsonl" | "parquet" | "array_record"
    size: int
    mtime_ns: int


@dataclasses.dataclass(frozen=True)
class Document:
    key: str
    text: Optional[str] = None
    messages: Optional[list] = None

    def plain_text(self) -> str:
        """The text (for tokenizer training and byte counts); chat messages as `role: content` lines."""
        if self.text is not None:
            return self.text
        parts = []
        for m in self.messages:
            body = "\n".join(str(m[k]) for k in ("reasoning", "reasoning_content", "content") if m.get(k))
            parts.append(f"{m.get('role', '')}: {body}")
        return "\n".join(parts)


def format_of(path: str) -> Optional[str]:
    low = path.lower()
    for ext, fmt in _FORMATS:
        if low.endswith(ext):
            return fmt
    return None


def make_sources(paths: Sequence[str], root: str) -> List[SourceFile]:
    """SourceFiles for `paths` (deduplicated) with relpaths under `root`, sorted by relpath."""
    out = {}
    for p in paths:
        p = os.path.abspath(p)
        st = os.stat(p)
        rel = os.path.relpath(p, root).replace(os.sep, "/")
        out[p] = SourceFile(p, rel, format_of(p), st.st_size, st.st_mtime_ns)
    return sorted(out.values(), key=lambda f: f.relpath)


def document_key(f: SourceFile, i: int) -> str:
    """Key of document i of the file (hashed for the held-out split)."""
    if f.format == "text" and f.size <= DOC_CHUNK_BYTES:
        return f.relpath                  # one document per file (the stdlib corpus keys by file)
    return f"{f.relpath}#{i}"


def walk_files(root: str, exclude_dirs: Sequence[str], extensions: Sequence[str] = EXTENSIONS) -> List[str]:
    """Files under `root` whose names end with one of `extensions`, excluded directory names pruned."""
    excl = set(exclude_dirs)
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in excl)
        out += [os.path.join(dirpath, n) for n in filenames
                if n.lower().endswith(tuple(extensions)) and os.path.isfile(os.path.join(dirpath, n))]
    return out


def resolve_files(spec: str, exclude_dirs: Sequence[str] = (), root: Optional[str] = None,
                  extensions: Sequence[str] = EXTENSIONS) -> Tuple[str, List[SourceFile]]:
    """(root, files sorted by relpath) for a comma-separated list of globs, files and directories."""
    allowed = ", ".join(EXTENSIONS)
    paths: List[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        item = os.path.expanduser(item)
        if _GLOB_CHARS & set(item):
            hits = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not hits:
                raise DataError(f"data.path pattern {item!r} matches no file")
            paths += hits
        elif os.path.isdir(item):
            hits = walk_files(item, exclude_dirs, extensions)
            if not hits:
                raise DataError(f"data.path directory {item!r} holds no file with a known extension ({allowed})")
            paths += hits
        elif os.path.isfile(item):
            paths.append(item)
        else:
            raise DataError(f"data.path entry {item!r} does not exist (expected a file, directory or glob)")
    if not paths:
        raise DataError(f"data.path={spec!r} names no file")
    for p in paths:
        if format_of(p) is None:
            raise DataError(f"data file {p!r} has an unknown format; allowed extensions: {allowed}")
    if root is None:
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    return root, make_sources(paths, root)


# ----------------------------------------------------------------------------- text
def _read_text(f: SourceFile) -> str:
    with open(f.path, "rb") as fh:
        data = fh.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {f.path!r} is not valid UTF-8 text ({e})") from None


def _text_chunks(text: str) -> List[str]:
    if not text:
        return []
    if len(text) * 4 <= DOC_CHUNK_BYTES or len(text.encode("utf-8")) <= DOC_CHUNK_BYTES:
        return [text]
    chunks, buf, n = [], [], 0
    for line in text.splitlines(keepends=True):
        b = len(line.encode("utf-8"))
        if buf and n + b > DOC_CHUNK_BYTES:
            chunks.append("".join(buf))
            buf, n = [], 0
        buf.append(line)
        n += b
    if buf:
        chunks.append("".join(buf))
    return chunks


# ----------------------------------------------------------------------------- records
def record_document(obj, key: str, where: str, text_field: str, messages_field: str) -> Document:
    """A jsonl line / parquet row / JSON record -> Document, through text_field or messages_field."""
    if not isinstance(obj, dict):
        raise DataError(f"{where} is a JSON {type(obj).__name__}, not an object with a {text_field!r} field")
    if text_field in obj and obj[text_field] is not None:
        v = obj[text_field]
        if not isinstance(v, str):
            raise DataError(f"{where}: field {text_field!r} is a {type(v).__name__}; it must be a string")
        return Document(key, text=v)
    if messages_field in obj and obj[messages_field] is not None:
        v = obj[messages_field]
        if not (isinstance(v, (list, tuple)) and v and all(isinstance(m, dict) for m in v)):
            raise DataError(f"{where}: field {messages_field!r} must be a non-empty list of message objects "
                            f"({{'role': ..., 'content': ...}}), got {str(v)[:80]!r}")
        return Document(key, messages=[dict(m) for m in v])
    raise DataError(f"{where} has no {text_field!r} field (nor {messages_field!r} chat messages); fields present: "
                    f"{sorted(obj)[:20]}; choose the field with --set data.text_field=NAME")


def _open_lines(f: SourceFile):
    raw = open(f.path, "rb")
    return gzip.open(raw) if f.path.lower().endswith(".gz") else raw


def _jsonl_lines(f: SourceFile) -> Iterator[Tuple[int, bytes]]:
    """(line number, line) of the non-blank lines."""
    try:
        with _open_lines(f) as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    yield n, line
    except (OSError, EOFError) as e:   # gzip.BadGzipFile is an OSError
        raise DataError(f"data file {f.path!r} cannot be read ({e})") from None


def _parquet_column(f: SourceFile, text_field: str, messages_field: str):
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(f.path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError variants
        raise DataError(f"data file {f.path!r} is not a readable parquet file ({e})") from None
    names = pf.schema_arrow.names
    for col in (text_field, messages_field):
        if col in names:
            return pf, col
    raise DataError(f"data file {f.path!r} has no {text_field!r} column (nor {messages_field!r} chat messages); "
                    f"columns: {names[:20]}; choose the column with --set data.text_field=NAME")


def _array_record(f: SourceFile):
    import grain
    try:
        return grain.sources.ArrayRecordDataSource([f.path])
    except Exception as e:  # the reader raises RuntimeError / ValueError variants
        raise DataError(f"data file {f.path!r} is not a readable ArrayRecord file ({e})") from None


def _record_bytes_document(rec: bytes, key: str, where: str, text_field: str, messages_field: str) -> Document:
    try:
        text = rec.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where} is not UTF-8 ({e})") from None
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None                      # text that merely starts with "{"
        if isinstance(obj, dict):
            return record_document(obj, key, where, text_field, messages_field)
    return Document(key, text=text)


# ----------------------------------------------------------------------------- public
def count_documents(f: SourceFile, text_field: str = "text", messages_field: str = "messages") -> int:
    """Documents in the file, without tokenizing (text files are read; records are counted)."""
    if f.format == "text":
        if f.size <= DOC_CHUNK_BYTES:    # the size on disk is the UTF-8 byte count
            return 1 if f.size > 0 else 0
        return len(_text_chunks(_read_text(f)))
    if f.format == "jsonl":
        return sum(1 for _ in _jsonl_lines(f))
    if f.format == "parquet":
        return _parquet_column(f, text_field, messages_field)[0].metadata.num_rows
    if f.format == "array_record":
        return len(_array_record(f))
    raise DataError(f"data file {f.path!r}: unknown format {f.format!r}")


def iter_documents(f: SourceFile, text_field: str = "text", messages_field: str = "messages") -> Iterator[Document]:
    """The file's documents in order (count_documents of them)."""
    if f.format == "text":
        for i, c in enumerate(_text_chunks(_read_text(f))):
            yield Document(document_key(f, i), text=c)
    elif f.format == "jsonl":
        for i, (n, line) in enumerate(_jsonl_lines(f)):
            where = f"data file {f.path!r} line {n}"
            try:
                obj = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DataError(f"{where} is not valid JSON ({e})") from None
            yield record_document(obj, f"{f.relpath}#{i}", where, text_field, messages_field)
    elif f.format == "parquet":
        pf, col = _parquet_column(f, text_field, messages_field)
        i = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[col]):
            for v in batch.column(0).to_pylist():
                yield record_document({col: v}, f"{f.relpath}#{i}", f"data file {f.path!r} row {i}",
                                      text_field, messages_field)
                i += 1
    elif f.format == "array_record":
        src = _array_record(f)
        for i in range(len(src)):
            yield _record_bytes_document(src[i], f"{f.relpath}#{i}", f"data file {f.path!r} record {i}",
                                         text_field, messages_field)
    else:
        raise DataError(f"data file {f.path!r}: unknown format {f.format!r}")


def iter_document_range(f: SourceFile, start: int, stop: int, text_field: str = "text",
                        messages_field: str = "messages") -> Iterator[Tuple[int, Document]]:
    """(i, document i) for start <= i < stop, as iter_documents gives them; the documents before `start`
    are skipped without being parsed (jsonl lines unread as JSON, parquet batches and ArrayRecord
    records not converted), so a file cut into ranges is read about once in all."""
    if f.format == "jsonl":
        for i, (n, line) in enumerate(_jsonl_lines(f)):
            if i >= stop:
                return
            if i >= start:
                where = f"data file {f.path!r} line {n}"
                try:
                    obj = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DataError(f"{where} is not valid JSON ({e})") from None
                yield i, record_document(obj, f"{f.relpath}#{i}", where, text_field, messages_field)
    elif f.format == "parquet":
        pf, col = _parquet_column(f, text_field, messages_field)
        first = 0
        for batch in pf.iter_batches(batch_size=1024, columns=[col]):
            end = first + batch.num_rows
            if end > start and first < stop:
                for j, v in enumerate(batch.column(0).to_pylist()):
                    i = first + j
                    if start <= i < stop:
                        yield i, record_document({col: v}, f"{f.relpath}#{i}", f"data file {f.path!r} row {i}",
                                                 text_field, messages_field)
            if end >= stop:
                return
            first = end
    elif f.format == "array_record":
        src = _array_record(f)
        for i in range(start, min(stop, len(src))):
            yield i, _record_bytes_document(src[i], f"{f.relpath}#{i}", f"data file {f.path!r} record {i}",
                                            text_field, messages_field)
    else:
        for i, doc in enumerate(iter_documents(f, text_field, messages_field)):
            if i >= stop:
                return
            if i >= start:
                yield i, doc


def is_utf8_text(f: SourceFile) -> bool:
    try:
        _read_text(f)
        return True
    except (DataError, OSError):
        return False


__all__ = ["DOC_CHUNK_BYTES", "DataError", "Document", "EXTENSIONS", "SourceFile", "count_documents", "document_key",
           "format_of", "is_utf8_text", "iter_document_range", "iter_documents", "make_sources", "record_document",
           "resolve_files", "walk_files"]
