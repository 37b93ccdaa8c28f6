"""Preparing text at scale: inputs found (files, folders, globs; .gz and .zst), read in pieces by worker processes,
tokenized into one file, the shuffled splits written in blocks, all in a temporary folder under a lock, and the
checks and file writing around it. A reader of the recipe may skip this file: data.py's prepare calls it.

Why the output does not depend on the number of workers: a piece is a byte range of a file that starts and ends
on a document boundary (a line of .jsonl, a blank line of .txt), a run of Parquet row groups, or a whole compressed
file; its documents are the ones a single reader finds there, and the pieces' tokens are joined in input order.
"""
import ast
import contextlib
import glob
import gzip
import hashlib
import importlib.util
import itertools
import json
import math
import mmap
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import sysconfig
import tempfile
import zlib
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from machinery.cli import InputError, Stop, check_outputs, die_with, sha256_file, stop_on_sigterm, usable_cores
from machinery.rundir import hold_lock, release_lock
from machinery.stages import check_writable
from machinery.tokenizer import is_int

FORMATS = (".jsonl", ".txt", ".parquet")
COMPRESSIONS = (".gz", ".zst")  # of .jsonl and .txt
EXPECTED = ".jsonl, .txt or .parquet (.jsonl and .txt may be compressed: .gz, .zst)"
# Sizes that bound memory, whatever the corpus's size: a worker holds one batch of text and its ids (a Python
# int per id: about 10 MB for 1 MB of text) or one block of a split; the parent, tens of bytes per document
# (their lengths, then the shuffled order).
PIECE_BYTES = 64 << 20  # the most text a piece of a file holds; less where the corpus is small
PIECES_PER_WORKER = 16  # pieces (and blocks) per worker at least: the last to finish leave few workers idle
BATCH_BYTES = 1 << 20   # text tokenized before its ids are written
BLOCK_TOKENS = 1 << 23  # the most tokens of a split gathered and written by one task
READ_BYTES = 1 << 16    # read at a time: 64 KB of zstd decompresses to at most a few MB of text

# ----------------------------------------------------------------------------
# Inputs: files, folders and globs, each a source


@dataclass
class Source:
    name: str   # what --mix and meta.json call it
    path: Path  # as given: a file, or a folder
    files: list  # the files read, in order


def file_kind(path):
    """(name, format, compression) of a file we read, e.g. ("web", ".jsonl", ".gz"); None for any other file."""
    p = Path(path)
    compression = p.suffix if p.suffix in COMPRESSIONS else None
    p = p.with_suffix("") if compression else p
    if p.suffix not in FORMATS or (compression and p.suffix == ".parquet"):
        return None
    return p.stem, p.suffix, compression


def find_sources(inputs):
    """The sources of --input: a file is one, named by its file name without extensions; a folder is one, named
    by the folder, made of the files in it that we read, sorted by name; a glob is the files and folders it
    matches, each its own source, as the shell would expand it."""
    if not inputs:
        raise InputError("--input: expected one or more text files")
    sources = []
    for given in map(str, inputs):
        paths = [Path(given)]
        if not paths[0].exists() and re.search(r"[*?[]", given):
            paths = [Path(p) for p in sorted(glob.glob(given, recursive=True))]
            if not paths:
                raise InputError(f"{given}: no file matches this pattern")
        sources += [find_source(p) for p in paths]
    return sources


def find_source(path):
    if path.is_dir():
        # A hidden file is no shard: a download in progress (.part-3.jsonl), a copy's metadata (._part-3.jsonl).
        entries = sorted(path.iterdir(), key=lambda p: p.name)
        files = [p for p in entries if p.is_file() and file_kind(p) and not p.name.startswith(".")]
        if not files:
            raise InputError(f"{path}: a folder with no file to read in it; expected {EXPECTED} files"
                             + (" (hidden files, whose names start with '.', are not read)" * any(
                                 file_kind(p) for p in entries)))
        skipped = [p.name for p in entries if p not in files and (not p.name.startswith(".") or file_kind(p))]
        if skipped:  # a folder of shards beside a README is usual; a subfolder of shards is not read
            more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
            print(f"{path}: source {path.resolve().name} reads its {len(files)} files of text, not "
                  f"{', '.join(skipped[:5])}{more}")
        for p in files:
            check_readable(p)
        return Source(path.resolve().name, path, files)
    if not path.is_file():
        raise InputError(f"{path}: input file not found")
    check_readable(path)
    return Source(file_kind(path)[0], path, [path])


def check_readable(path):
    """A file we can read: a known format, with its optional package installed."""
    kind = file_kind(path)
    if kind is None:
        raise InputError(f"{path}: unsupported input format; expected {EXPECTED}")
    package = {".zst": "zstandard", ".parquet": "pyarrow"}.get(kind[2] or kind[1])
    if package and importlib.util.find_spec(package) is None:
        raise InputError(f"{path}: reading {kind[2] or kind[1]} needs {package} (pip install {package})")


def describe(source, digests, documents):
    """The source's record in meta.json. A folder's sha256 is that of the `sha256sum` lines of its files, in
    order: `cd FOLDER && sha256sum FILES | sha256sum` gives it."""
    if source.files == [source.path]:
        return dict(name=source.name, path=str(source.path), sha256=digests[0], documents=documents)
    lines = "".join(f"{d}  {f.name}\n" for f, d in zip(source.files, digests))
    return dict(name=source.name, path=str(source.path), sha256=hashlib.sha256(lines.encode()).hexdigest(),
                documents=documents, files=[dict(name=f.name, sha256=d) for f, d in zip(source.files, digests)])


# ----------------------------------------------------------------------------
# The demo's text: general English with no download; and the miniature's new domain, Python source


def stdlib_modules():
    """(path relative to the standard library, source, ast) of its .py files in a fixed order, the test suites
    and IDLE left out, read with ast (importing some modules has side effects). Parsing is the slow part."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "lib2to3"}
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(set(subfolders) - skip)
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                source = Path(folder, name).read_text(encoding="utf-8")
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            yield Path(folder, name).relative_to(root).as_posix(), source, tree


def stdlib_docstrings(max_bytes=1_000_000):
    """General English text with no download: the docstrings of the standard library's .py files."""
    total = 0
    for _, _, tree in stdlib_modules():
        for node in statements(tree):
            doc = ast.get_docstring(node) if isinstance(node, DOCUMENTED) else None
            if doc:
                yield doc
                total += len(doc.encode())
                if total >= max_bytes:
                    return


DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def statements(tree):
    """The nodes of tree that may hold statements, in ast.walk's order: an expression never holds
    a docstring, and skipping them saves a third of the time."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(c for c in ast.iter_child_nodes(node)
                    if isinstance(c, (ast.stmt, ast.excepthandler, ast.match_case)))
        yield node


def write_docstrings(path, max_bytes=1_000_000):
    """The standard library's docstrings as JSONL (the demo's text, and reproduce.py's stand-in for
    the general text a pretrained encoder saw). Returns the path."""
    check_max_bytes(max_bytes)
    path = Path(path)
    make_writable_dir(path.parent, path)
    check_outputs("--out", [path], [])  # never a file of a model (a run's log.jsonl)
    write_file(path, "".join(json.dumps({"text": d}) + "\n" for d in stdlib_docstrings(max_bytes)))
    return path


def check_max_bytes(max_bytes):
    if not is_int(max_bytes) or max_bytes < 1:
        raise InputError(f"--max_bytes={max_bytes}: expected a positive size")


# One module in HELD_OUT_EVERY, chosen by a hash of its path (the same on every machine and Python run), is
# held out: its functions and classes are texts the continued models never train on, for CKA.
HELD_OUT_EVERY = 5


def is_held_out(module):
    return zlib.crc32(module.encode()) % HELD_OUT_EVERY == 0


def stdlib_code():
    """(module, text) of every top-level function and class of the standard library's source (module_code): a
    kind of text the demo's start model, trained on those docstrings, has not seen."""
    for module, source, tree in stdlib_modules():
        yield from ((module, text) for text in module_code(source, tree))


def module_code(source, tree):
    """The text of each top-level function and class of a module (`tree`: its ast), decorators included and
    docstrings cut out. Comments stay: they are part of how code reads."""
    lines = source.splitlines()
    for node in tree.body:
        if isinstance(node, DOCUMENTED):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            cut = docstring_lines(node, lines)
            yield "\n".join(lines[i] for i in range(first - 1, node.end_lineno) if i not in cut)


def docstring_lines(node, lines):
    """The 0-based lines that node's docstrings and those of the functions and classes inside it fill alone (a
    docstring that shares a line with code stays)."""
    cut = set()
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, DOCUMENTED) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            doc = body[0]
            alone = not lines[doc.lineno - 1][:doc.col_offset].strip() and \
                not lines[doc.end_lineno - 1][doc.end_col_offset:].strip()
            if alone:
                cut.update(range(doc.lineno - 1, doc.end_lineno))
    return cut


def write_code(path, heldout, max_bytes=2_000_000):
    """The standard library's functions and classes without their docstrings as two JSONL files, a document a
    line: `path` from the modules trained on, up to max_bytes of text; `heldout` from the held-out modules
    (is_held_out) met on the way, never in `path`. Returns (path, heldout, documents in each)."""
    check_max_bytes(max_bytes)
    path, heldout = Path(path), Path(heldout)
    if path.resolve() == heldout.resolve():
        raise InputError(f"--out={path} and --heldout={heldout}: the held-out texts need a file of their own")
    make_writable_dir(path.parent, path)
    make_writable_dir(heldout.parent, heldout, "--heldout")
    check_outputs("--out", [path], [])  # never a file of a model (a run's log.jsonl)
    check_outputs("--heldout", [heldout], [])
    texts, total = {path: [], heldout: []}, 0
    for module, text in stdlib_code():
        if total >= max_bytes:
            break
        texts[heldout if is_held_out(module) else path].append(json.dumps({"text": text}) + "\n")
        total += 0 if is_held_out(module) else len(text.encode())
    for where, lines in texts.items():
        write_file(where, "".join(lines))
    return path, heldout, len(texts[path]), len(texts[heldout])


# ----------------------------------------------------------------------------
# Reading: documents of a piece of a file


@dataclass(frozen=True)
class Piece:
    path: str
    start: int  # a byte offset; a row group for .parquet
    stop: int
    size: int   # bytes of the file it stands for (the progress bar's unit)


def plan(path, piece_bytes, field):
    """The pieces of a file, in order, each about piece_bytes of it."""
    size, (_, fmt, compression) = os.path.getsize(path), file_kind(path)
    if compression:  # a compressed stream can only be read from its start
        return [Piece(str(path), 0, size, size)]
    if fmt == ".parquet":
        return parquet_pieces(path, size, piece_bytes, field)
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] + piece_bytes < size:
            f.seek(cuts[-1] + piece_bytes - 1)
            f.readline()  # to the start of a line
            while fmt == ".txt" and not is_blank(f.readline()):  # a .txt document ends at a blank line
                pass
            if f.tell() >= size:
                break
            cuts.append(f.tell())
    return [Piece(str(path), a, b, b - a) for a, b in zip(cuts, cuts[1:] + [size])]


def is_blank(raw):
    """Whether a line ends a .txt document, as read_documents decides (the end of the file does too)."""
    try:
        return not raw or not raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False


def parquet_pieces(path, size, piece_bytes, field):
    """Runs of row groups of about piece_bytes (uncompressed)."""
    import pyarrow.parquet as pq
    meta = pq.ParquetFile(path)
    names = meta.schema_arrow.names
    if field not in names:
        raise InputError(f"{path}: no column {field!r} (columns: {', '.join(names)})")
    groups = [meta.metadata.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
    ends = np.cumsum(groups or [0])
    cuts = [0] + [i + 1 for i in range(len(groups) - 1) if ends[i] // piece_bytes != ends[i + 1] // piece_bytes]
    bounds = list(zip(cuts, cuts[1:] + [len(groups)]))
    # the file's bytes shared out by the pieces' shares of its rows' bytes
    shares = [size * int(ends[b - 1] - (ends[a - 1] if a else 0)) // max(1, int(ends[-1])) for a, b in bounds]
    shares[-1] += size - sum(shares)
    return [Piece(str(path), a, b, s) for (a, b), s in zip(bounds, shares)]


def read_documents(path, field="text"):
    """The documents of a whole file, in order: .jsonl (one object a line), .txt (documents separated by a blank
    line), .parquet (a string column); .jsonl and .txt may be compressed (.gz, .zst)."""
    check_readable(path)
    read = parquet_documents if file_kind(path)[1] == ".parquet" else piece_documents
    return itertools.chain.from_iterable(read(p, field) for p in plan(path, 1 << 62, field))


def piece_documents(piece, field):
    """The documents of a piece of a .jsonl or .txt file. A bad line is named by its line in the file: the lines
    before the piece are counted only then."""
    fmt = file_kind(piece.path)[1]
    try:
        yield from documents(lines(byte_chunks(piece)), fmt, field, piece.start == 0)
    except BadLine as e:
        raise InputError(f"{piece.path}:{lines_before(piece) + e.number}: {e.reason}") from None


class BadLine(Exception):
    def __init__(self, number, reason):
        super().__init__(number, reason)
        self.number, self.reason = number, reason


def documents(raws, fmt, field, at_start):
    """Documents of lines: a .jsonl line's field, or a .txt run of non-blank lines."""
    block = []
    for number, raw in enumerate(raws, 1):
        line = decode_line(raw, number, at_start)
        if fmt == ".jsonl":
            if line.strip():
                yield json_text(line, number, field)
        elif line.strip():
            block.append(line)
        elif block:
            yield "".join(block).rstrip("\r\n")
            block = []
    if block:
        yield "".join(block).rstrip("\r\n")


def decode_line(raw, number, at_start):
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLine(number, f"invalid UTF-8 ({e.reason} at byte {e.start} of the line)") from None
    return line.removeprefix("\ufeff") if at_start and number == 1 else line  # a byte order mark is no text


def json_text(line, number, field):
    """The string `field` of a JSONL line. JSON can spell a lone surrogate ("\\ud800"), which no UTF-8 text
    holds: refused here, with its line, not deep inside the tokenizer."""
    try:
        text = json.loads(line)[field]
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: [[[[[[...
        raise BadLine(number, f"expected a JSON object with a string field {field!r}") from None
    if not isinstance(text, str):
        raise BadLine(number, f"field {field!r} is {type(text).__name__}, expected a string")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadLine(number, f"field {field!r} holds a lone surrogate ({text[e.start]!r} at character "
                              f"{e.start}), which is not text") from None
    return text


def lines_before(piece):
    if piece.start == 0:
        return 0
    with open(piece.path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(min(1 << 24, piece.start - f.tell())), b""))


def lines(chunks):
    """The lines of a stream given in chunks, each with its b"\\n" (the last may have none), as iterating a
    binary file gives them."""
    parts = []
    for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            parts.append(chunk[start:end + 1])
            yield b"".join(parts)
            parts, start = [], end + 1
        parts.append(chunk[start:])
    if any(parts):
        yield b"".join(parts)


def byte_chunks(piece):
    """The bytes of a piece, decompressed. A file that cannot be read, or a compressed file that is corrupt or cut
    short, is one InputError naming it."""
    compression = file_kind(piece.path)[2]
    errors = (OSError, EOFError, zlib.error)
    if compression == ".zst":
        import zstandard
        errors += (zstandard.ZstdError,)
    try:
        with open(piece.path, "rb") as f:
            if compression == ".gz":
                with gzip.GzipFile(fileobj=f) as g:
                    yield from iter(lambda: g.read(READ_BYTES), b"")
            elif compression == ".zst":
                yield from zstd_chunks(f)
            else:
                f.seek(piece.start)
                for left in range(piece.stop - piece.start, 0, -(1 << 24)):
                    yield f.read(min(left, 1 << 24))
    except errors as e:
        what = f"not a readable {compression} file: corrupt or cut short" if compression else "cannot read it"
        raise InputError(f"{piece.path}: {what} ({getattr(e, 'strerror', None) or e})") from None


def zstd_chunks(f):
    """The frames of a .zst one after another. zstandard's stream_reader ends quietly where a file is cut short;
    a frame that never reached its end is an EOFError here."""
    import zstandard
    zstd = zstandard.ZstdDecompressor()
    frame, fed = zstd.decompressobj(), False
    for data in iter(lambda: f.read(READ_BYTES), b""):
        while data:
            out, fed, data = frame.decompress(data), True, b""
            if out:
                yield out
            if frame.eof:  # the next frame starts in what is left
                frame, fed, data = zstd.decompressobj(), False, frame.unused_data
    if fed and not frame.eof:
        raise EOFError("the file ends inside a frame")


def parquet_documents(piece, field):
    import pyarrow.parquet as pq
    rows = pq.ParquetFile(piece.path)
    groups = range(piece.start, min(piece.stop, rows.num_row_groups))
    for batch in rows.iter_batches(columns=[field], row_groups=groups):
        for text in batch.column(0).to_pylist():
            if not isinstance(text, str):
                raise InputError(f"{piece.path}: column {field!r} holds {type(text).__name__}, expected strings")
            yield text


# ----------------------------------------------------------------------------
# Workers: processes that each hold the tokenizer


_tokenizer = None  # the tokenizer of this process's tasks, set once per worker: a task would carry megabytes


def use_tokenizer(tokenizer):
    global _tokenizer
    _tokenizer = tokenizer


def start_worker(tokenizer, parent, lock_fd):
    """A worker's first act. It dies with the parent, even a parent killed by SIGKILL, and lets go of the output's
    lock, which a forked child shares with the parent: else a killed prepare's workers would go on holding it, and
    every later prepare into that folder would be refused."""
    die_with(parent)
    if lock_fd is not None:
        os.close(lock_fd)  # this copy only: the parent's descriptor keeps the lock
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's, which ends its workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's stop: its terminate() ends a worker at once
    use_tokenizer(tokenizer)


class Later:
    """A task of a single worker, run in this process when its result is asked for: pieces are tokenized and
    joined one at a time."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def result(self):
        return self.fn(*self.args)


class Workers:
    """n processes running tasks (n = 1: this process). Forked where the system can (a worker then imports
    nothing; a spawned one imports data.py, torch with it). A worker that dies (killed for memory) is an
    InputError, never a wait for a result that will not come. `lock`: the open lock file of the output, which
    no worker keeps."""

    def __init__(self, n, tokenizer, lock=None):
        self.n, self.tokenizer, self.lock, self.pool = n, tokenizer, lock, None

    def __enter__(self):
        if self.n == 1:
            use_tokenizer(self.tokenizer)
        else:
            fork = "fork" in multiprocessing.get_all_start_methods()
            lock_fd = self.lock.fileno() if fork and self.lock is not None else None  # a spawned one has none
            self.pool = ProcessPoolExecutor(self.n, multiprocessing.get_context("fork" if fork else "spawn"),
                                            initializer=start_worker, initargs=(self.tokenizer, os.getpid(), lock_fd))
        return self

    def submit(self, fn, *args):
        return Later(fn, args) if self.pool is None else self.pool.submit(fn, *args)

    def __exit__(self, kind, error, traceback):
        use_tokenizer(None)
        if self.pool is None:
            return
        if kind is not None:  # a failure or Ctrl-C here: the pieces the workers hold are of no use
            for process in list((self.pool._processes or {}).values()):  # shutdown() would wait for them
                process.kill()  # SIGKILL: a worker just forked has no handler of its own yet for a gentler signal
        self.pool.shutdown(wait=True, cancel_futures=True)
        if kind is not None and issubclass(kind, BrokenProcessPool):
            raise InputError(f"a worker process of data.py prepare died ({error}); if the system ran out of "
                             f"memory, lower --workers") from None


# ----------------------------------------------------------------------------
# Tokenizing: every document as [CLS] ids [SEP], end to end, in input order


def pieces_of(sources, field, n):
    """The pieces of every file of every source, sized for n workers: [source][file][piece]."""
    total = sum(os.path.getsize(f) for s in sources for f in s.files)
    piece_bytes = max(1, min(PIECE_BYTES, total // (PIECES_PER_WORKER * n)))
    return [[plan(f, piece_bytes, field) for f in s.files] for s in sources]


def worker_count(requested, sources, field):
    """The worker processes a prepare starts: `requested`, but no more than the cores this process may use nor
    the pieces its inputs make (a worker beyond either would only wait: a compressed file is one piece), said in
    one line when it is fewer. Checked before any process is started."""
    cores = usable_cores()
    bound = min(requested, cores)
    pieces = sum(len(file) for source in pieces_of(sources, field, bound) for file in source) if bound > 1 else 1
    n = min(requested, cores, pieces)
    if n < requested:
        why = f"this process may use {cores} cores" if n == cores else f"the input makes {pieces} pieces"
        print(f"--workers={requested}: {n} worker process{'es' * (n > 1)} ({why})", flush=True)
    return n


def tokenize(sources, field, dtype, dst, workers, desc):
    """Every document of every source as [CLS] ids [SEP] in dst, in input order: pieces tokenized by the workers,
    joined here in order as they finish. Returns (document lengths per source, a digest of each document's text per
    source (uint64), bytes of text, sha256 of each source's files); a source without a document is an InputError."""
    total = sum(os.path.getsize(f) for s in sources for f in s.files)
    pieces = pieces_of(sources, field, workers.n)
    digests = [[workers.submit(sha256_file, f) for f in s.files] for s in sources]  # first: a whole file each
    tasks = [[[workers.submit(tokenize_piece, p, field, dtype.name, dst.with_name(f"piece-{i}-{j}-{k}.tokens"))
               for k, p in enumerate(file)] for j, file in enumerate(source)] for i, source in enumerate(pieces)]
    bar, lengths, keys, text_bytes = progress(total, desc), [], [], 0
    try:
        with open(dst, "wb") as out:
            for source, files in zip(sources, tasks):
                found, found_keys = [], []
                for task in itertools.chain.from_iterable(files):
                    piece_lengths, piece_keys, piece_text, piece, chunk = task.result()
                    found.append(piece_lengths)
                    found_keys.append(piece_keys)
                    text_bytes += piece_text
                    with open(chunk, "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 24)  # a full disk: OSError(ENOSPC), named
                    os.unlink(chunk)
                    bar.update(piece.size)
                lengths.append(np.concatenate(found))
                keys.append(np.concatenate(found_keys))
                if not len(lengths[-1]):
                    what = "the file is empty" if source.files == [source.path] else "its files are empty"
                    raise InputError(f"{source.path}: no documents ({what} or every {field!r} is empty)")
    finally:
        bar.close()
    return lengths, keys, text_bytes, [[d.result() for d in source] for source in digests]


def tokenize_piece(piece, field, dtype, dst):
    """Tokenize a piece into the file dst, a batch at a time; returns (document lengths, a digest of each document's
    text, bytes of text, the piece, dst). Blank documents are skipped: they would only add [CLS][SEP]."""
    parquet = file_kind(piece.path)[1] == ".parquet"
    texts = (parquet_documents if parquet else piece_documents)(piece, field)
    lengths, keys, text_bytes, batch, size = [], [], 0, [], 0
    with open(dst, "wb") as f:
        for text in itertools.chain(texts, [None]):
            if text is not None and text.strip():
                batch.append(text)
                encoded = text.encode()
                size += len(encoded)
                keys.append(hashlib.blake2b(encoded, digest_size=8).digest())  # copies of one text: one key
            if batch and (size >= BATCH_BYTES or text is None):
                ids, batch_lengths = frame(_tokenizer, batch, np.dtype(dtype))
                f.write(ids.data)  # a full disk: OSError(ENOSPC), named
                lengths.append(batch_lengths)
                text_bytes, batch, size = text_bytes + size, [], 0
    return (np.concatenate(lengths or [np.zeros(0, np.int64)]), np.frombuffer(b"".join(keys), np.uint64), text_bytes,
            piece, dst)


def frame(tokenizer, texts, dtype):
    """(ids, lengths): [CLS] ids [SEP] of each text, end to end, filled by NumPy (not a Python list per token)."""
    ids = [tokenizer.encode(t) for t in texts]
    lengths = np.fromiter(map(len, ids), np.int64, len(ids)) + 2
    ends = np.cumsum(lengths)
    out = np.empty(int(ends[-1]), dtype)
    body = np.ones(len(out), bool)
    body[ends - lengths] = body[ends - 1] = False
    out[ends - lengths], out[ends - 1] = tokenizer.cls_id, tokenizer.sep_id
    out[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype, len(out) - 2 * len(ids))
    return out, lengths


# ----------------------------------------------------------------------------
# Writing a split: documents gathered in a given order, in blocks written where they belong


def write_documents(dst, tokens, dtype, starts, lengths, workers):
    """Write the documents at starts (lengths tokens each) of the token file `tokens` to dst, in that order; the
    workers write blocks of at most about BLOCK_TOKENS at their own offsets of dst."""
    ends = np.cumsum(lengths)
    total = int(ends[-1]) if len(ends) else 0
    with open(dst, "wb") as f:
        f.truncate(total * dtype.itemsize)
    block = max(1, min(BLOCK_TOKENS, total // (PIECES_PER_WORKER * workers.n)))
    cuts = np.unique(np.searchsorted(ends, np.arange(block, total, block), side="right"))
    bounds = zip([0, *cuts], [*cuts, len(lengths)])
    tasks = [workers.submit(write_block, tokens, dtype.name, starts[a:b], lengths[a:b], dst,
                            int(ends[a - 1]) if a else 0) for a, b in bounds if b > a]
    for task in tasks:
        task.result()


def write_block(tokens, dtype, starts, lengths, dst, offset):
    """Gather the documents into one array and write it at token `offset` of dst."""
    dtype = np.dtype(dtype)
    out, at = np.empty(int(lengths.sum()), dtype), 0
    with open(tokens, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        source = np.frombuffer(m, dtype)  # a plain array on the mapping: slicing a np.memmap costs 10x more
        for start, n in zip(starts.tolist(), lengths.tolist()):
            out[at:at + n] = source[start:start + n]
            at += n
        del source  # the mapping closes only once no array holds it
    with open(dst, "r+b") as f:
        f.seek(offset * dtype.itemsize)
        f.write(out.data)  # a full disk: OSError(ENOSPC), named


# ----------------------------------------------------------------------------
# Checks and files: each input checked before any work, each output written whole or not at all


def check_prepare_args(names, out, mix, val_fraction, seed, workers):
    """Every argument of `prepare` checked before any tokenizing (and before the tokenizer is fetched): out, or the
    folder it would be made in, must take a new folder. Nothing is made yet: workspace makes out."""
    weights = list((mix or {}).values())
    for ok, message in [
            (len(set(names)) == len(names),
             f"--input needs distinct file names (a source is named by its file name without extensions, a "
             f"folder by its name), got {names}"),
            (mix is None or set(mix) == set(names),
             f"--mix names {sorted(mix or [])} must be exactly the sources {sorted(names)}"),
            (all(math.isfinite(w) and w >= 0 for w in weights) and (not mix or sum(weights) > 0),
             f"--mix weights must be finite, >= 0 and not all 0, got {weights}"),
            (math.isfinite(val_fraction) and 0 < val_fraction < 1,
             f"--val_fraction={val_fraction}: expected a number in (0, 1); the validation split cannot be empty"),
            (is_int(seed) and seed >= 0, f"--seed={seed}: expected an integer >= 0"),
            (is_int(workers) and workers >= 1, f"--workers={workers}: expected an integer >= 1"),
            (not out.exists() or out.is_dir(), f"--out={out}: is a file, expected a directory")]:
        if not ok:
            raise InputError(message)
    check_writable(out)


def make_writable_dir(folder, out, flag="--out"):
    """Create folder; a probe file proves it writable (permission bits do not stop root, a read-only mount
    does)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise InputError(f"{flag}={out}: cannot write there ({e.strerror or e})") from None


def write_file(path, text):
    """Write text through a temporary file renamed into place: a reader, or a full disk, never leaves half a
    file; the name is this process's own, so two writers never share it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise InputError(f"{path}: cannot write ({e.strerror or e}); nothing was written") from None


TEMP_FOLDER = re.compile(r"\.prepare-\d+-[0-9a-f]{8}")  # where one prepare writes: pid and random


@contextlib.contextmanager
def workspace(out):
    """(a folder of this process's own inside out, the lock): the work happens under out/.lock, so that a failure
    (a full disk) leaves nothing half-written and a second prepare into the same folder while this one runs is
    refused. Ctrl-C or SIGTERM stops it the same way: one line, and out as it was before (absent if it was)."""
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # deepest first
    make_writable_dir(out, out)
    lock = hold_lock(out / ".lock", f"--out={out}: another data.py prepare is writing there (it holds "
                                    f"{out / '.lock'}); wait for it or choose another --out")
    tmp = out / f".prepare-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with stop_on_sigterm():
            for stale in out.iterdir():  # left by a prepare that was killed: the lock says none runs
                if TEMP_FOLDER.fullmatch(stale.name):
                    remove_temp_folder(stale)
            tmp.mkdir()
            yield tmp, lock
    except OSError as e:
        raise InputError(f"{e.filename or out}: {e.strerror or e}; nothing half-written is left in {out}") from None
    except KeyboardInterrupt as e:
        raise Stop(f"data.py prepare left no half-written file in {out}", getattr(e, "signum", signal.SIGINT)) \
            from None
    finally:
        remove_temp_folder(tmp)
        release_lock(lock)
        for folder in made:  # what a failure leaves of them is empty: a folder that looks prepared and is not
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def publish(tmp, out, files):
    """Move the files from tmp into out. meta.json goes first and comes back last: a directory with a meta.json
    always holds the .bin files it describes. Ctrl-C and SIGTERM wait for the renames (a kill cannot: it leaves
    no meta.json)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        (out / "meta.json").unlink(missing_ok=True)
        for name in files:
            os.replace(tmp / name, out / name)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def remove_temp_folder(folder):
    """A prepare's own folder: the files it writes there, then the folder if nothing else is there."""
    if folder.is_dir() and not folder.is_symlink():
        for path in folder.iterdir():
            if path.suffix in (".tokens", ".bin") or path.name == "meta.json":
                path.unlink(missing_ok=True)
        if not any(folder.iterdir()):
            folder.rmdir()



def progress(total, desc):
    """tqdm when installed (it is optional); otherwise a printed line per update."""
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)
    except ImportError:
        class Plain:  # one line per piece
            def update(self, n):
                print(f"{desc}: {n / 1e6:.1f} MB more of {total / 1e6:.1f} MB", flush=True)

            def close(self):
                pass
        return Plain()
