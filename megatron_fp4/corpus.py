"""Byte-level text corpora for training without a network: `megatron-fp4 corpus PREFIX`.

Walks text trees that every machine with this package has (by default this interpreter's standard
library and the installed torch package; `--source DIR` replaces them, `--glob PATTERN` picks the
files, `*.py` by default) and writes a Megatron indexed dataset PREFIX.bin / PREFIX.idx
(megatron.core.datasets.indexed_dataset) with one document per file: its bytes as tokens 0..255,
then the end-of-document token 256. Training reads it with

    data_path: PREFIX        tokenizer_type: NullTokenizer        vocab_size: 257

Megatron's NullTokenizer makes its end-of-document id `vocab_size - 1` (megatron-core 0.19:
megatron/core/tokenizers/text/libraries/null_tokenizer.py), so vocab_size 257 puts it at 256, past
every byte; the model pads the vocabulary to 384 (--make-vocab-size-divisible-by 128).

An existing PREFIX (any of the three files) is refused unless `--overwrite`.
PREFIX.json records what was built (files, documents, tokens, the SHA-256 of the token stream, the
sources and the settings), so that a run can record which corpus it trained on. Only the standard
library, numpy and megatron-core are imported (a GPU machine with the megatron-core wheel can build it).

Files are found in sorted relative-path order (the same on every machine with the same trees), then
written in the order of a hash of their path (`--order hash`, the default) or as found (`--order
path`): Megatron's --split cuts contiguous ranges of documents, so in path order the validation
split would be the last few directories of the last source; the hash order spreads every split
over all of them. Empty files are skipped.
"""

import argparse
import fnmatch
import hashlib
import importlib.util
import json
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable, List, Optional, Sequence

import numpy

from .console import fail

BYTE_VALUES = 256
EOD = BYTE_VALUES  # the end-of-document token: NullTokenizer's eod is vocab_size - 1
VOCAB_SIZE = EOD + 1  # tokenizer_type NullTokenizer with this vocab_size
TOKEN_DTYPE = numpy.uint16  # the indexed dataset's token type (Megatron's choice below 65500 tokens)
DEFAULT_GLOBS = ("*.py",)
OUTPUT_SUFFIXES = (".bin", ".idx", ".json")  # what PREFIX names
ORDERS = ("hash", "path")
# Never walked: caches, and the third-party packages inside a standard library tree.
SKIPPED_DIRS = frozenset({"__pycache__", "site-packages", "dist-packages"})
PROGRESS_EVERY_S = 2.0


class CorpusError(ValueError):
    """A corpus that cannot be built as asked (one sentence)."""


@dataclass(frozen=True)
class Document:
    name: str  # "<source's folder name>/<relative path>", what the order and the record use
    path: Path


def default_sources() -> List[Path]:
    """This interpreter's standard library and the installed torch package (found without importing it)."""
    sources = [Path(sysconfig.get_paths()["stdlib"])]
    torch_spec = importlib.util.find_spec("torch")
    if torch_spec is not None and torch_spec.submodule_search_locations:
        sources.append(Path(list(torch_spec.submodule_search_locations)[0]))
    return sources


def _matches(relative: str, globs: Sequence[str]) -> bool:
    """A pattern with a '/' matches the path relative to its source, one without the file name."""
    name = relative.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(relative if "/" in pattern else name, pattern) for pattern in globs)


def find_documents(sources: Sequence[Path], globs: Sequence[str] = DEFAULT_GLOBS, order: str = "hash") -> List[Document]:
    """Every nonempty file under `sources` matching `globs`, in the corpus's order (module docstring)."""
    if order not in ORDERS:
        raise CorpusError(f"unknown order {order!r}; use one of {', '.join(ORDERS)}")
    if not sources:
        raise CorpusError("no source directory given")
    documents = []
    for source in sources:
        source = Path(source)
        if not source.is_dir():
            raise CorpusError(f"source directory {source} does not exist or is not a directory")
        for root, dirs, files in os.walk(source):
            dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
            for file_name in sorted(files):
                path = Path(root) / file_name
                relative = path.relative_to(source).as_posix()
                if _matches(relative, globs) and path.is_file() and path.stat().st_size > 0:
                    documents.append(Document(f"{source.name}/{relative}", path))
    if not documents:
        raise CorpusError(f"no nonempty file matching {' '.join(globs)} under {' '.join(map(str, sources))}")
    if order == "hash":
        documents.sort(key=lambda d: hashlib.sha256(d.name.encode()).hexdigest())
    return documents


def document_tokens(data: bytes) -> numpy.ndarray:
    """One document's tokens: its bytes, then EOD."""
    tokens = numpy.empty(len(data) + 1, dtype=TOKEN_DTYPE)
    tokens[:-1] = numpy.frombuffer(data, dtype=numpy.uint8)
    tokens[-1] = EOD
    return tokens


def record_path(prefix) -> Path:
    return Path(f"{prefix}.json")


def _check_writable(prefix: Path) -> None:
    directory = prefix.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CorpusError(f"cannot create the output directory {directory}: {err.strerror}") from None
    if not os.access(directory, os.W_OK):
        raise CorpusError(f"cannot write to the output directory {directory}")


def existing_files(prefix) -> List[Path]:
    """Those of PREFIX.bin, PREFIX.idx and PREFIX.json that exist."""
    return [path for path in (Path(f"{prefix}{suffix}") for suffix in OUTPUT_SUFFIXES) if path.exists()]


def build_corpus(prefix, sources: Optional[Sequence[Path]] = None, globs: Sequence[str] = DEFAULT_GLOBS,
                 order: str = "hash", progress: Callable[[str], None] = print, overwrite: bool = False) -> dict:
    """Write PREFIX.bin, PREFIX.idx and PREFIX.json; returns the record written to the JSON. Refuses a
    prefix of which any of the three files exists unless `overwrite`."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = Path(prefix).resolve()
    existing = existing_files(prefix)
    if existing and not overwrite:
        names = ", ".join(map(str, existing[:-1])) + " and " * (len(existing) > 1) + str(existing[-1])
        raise CorpusError(f"{names} already exist{'s' if len(existing) == 1 else ''}: pass --overwrite to replace "
                          "the corpus, or choose another prefix")
    sources = [Path(s).resolve() for s in (default_sources() if sources is None else sources)]
    start = time.monotonic()
    documents = find_documents(sources, globs, order)
    _check_writable(prefix)
    progress(f"corpus: {len(documents)} files under {', '.join(map(str, sources))}")
    digest = hashlib.sha256()
    try:
        builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=TOKEN_DTYPE)
    except OSError as err:
        raise CorpusError(f"cannot write {prefix}.bin: {err.strerror}") from None
    tokens_written, last_report = 0, start
    for count, document in enumerate(documents, 1):
        tokens = document_tokens(document.path.read_bytes())
        builder.add_document(tokens, [tokens.size])
        digest.update(tokens.astype("<u2", copy=False).tobytes())
        tokens_written += tokens.size
        if time.monotonic() - last_report >= PROGRESS_EVERY_S:
            last_report = time.monotonic()
            progress(f"corpus: {count}/{len(documents)} files, {tokens_written / 1e6:.1f}M tokens, "
                     f"{last_report - start:.0f} s")
    builder.finalize(f"{prefix}.idx")
    record = {
        "prefix": str(prefix), "files": len(documents), "documents": len(documents), "tokens": tokens_written,
        "sha256": digest.hexdigest(), "tokenizer_type": "NullTokenizer", "vocab_size": VOCAB_SIZE, "eod": EOD,
        "token_dtype": numpy.dtype(TOKEN_DTYPE).name, "sources": [str(s) for s in sources], "globs": list(globs),
        "order": order, "seconds": round(time.monotonic() - start, 1),
    }
    record_path(prefix).write_text(json.dumps(record, indent=1) + "\n")
    return record


def read_record(prefix) -> dict:
    """The PREFIX.json that build_corpus wrote."""
    path = record_path(prefix)
    try:
        return json.loads(path.read_text())
    except OSError:
        raise CorpusError(f"no corpus record {path}: build the corpus first (megatron-fp4 corpus {prefix})") from None


def split_tokens(prefix, split: str) -> List[int]:
    """Tokens in the train, validation and test splits of PREFIX under Megatron's --split string
    (contiguous document ranges, as Megatron's dataset builder cuts them)."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                          parse_and_normalize_split)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix), mmap=True)
    lengths = numpy.array(dataset.sequence_lengths, dtype=numpy.int64)  # a copy: the index's mmap closes with it
    del dataset
    cumulative = numpy.concatenate([[0], numpy.cumsum(lengths)])
    counts = []
    for bookends in convert_split_vector_to_split_matrix(parse_and_normalize_split(split)):
        if bookends is None:
            counts.append(0)
            continue
        begin, end = (int(round(b * float(len(lengths)))) for b in bookends)
        counts.append(int(cumulative[end] - cumulative[begin]))
    return counts


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "corpus", help="build a byte-level Megatron indexed dataset from local text trees",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prefix", help="output prefix: writes PREFIX.bin, PREFIX.idx and PREFIX.json (refused when "
                                       "any of them exists, unless --overwrite)")
    parser.add_argument("--source", action="append", type=Path, metavar="DIR",
                        help="a directory to walk (repeatable); default: this interpreter's standard library "
                             f"({sysconfig.get_paths()['stdlib']}) and the installed torch package")
    parser.add_argument("--glob", action="append", metavar="PATTERN",
                        help="file pattern (repeatable): with a '/' matched against the path relative to its "
                             f"source, else against the file name; default: {' '.join(DEFAULT_GLOBS)}")
    parser.add_argument("--order", choices=ORDERS, default="hash",
                        help="document order in the dataset: by a hash of each path (default), or the sorted paths")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing PREFIX.bin / .idx / .json (without it an existing one is refused)")
    parser.set_defaults(run=_run)


def _run(args) -> int:
    try:
        record = build_corpus(args.prefix, args.source, args.glob or DEFAULT_GLOBS, args.order,
                              overwrite=args.overwrite)
    except CorpusError as err:
        return fail(str(err))
    print(f"corpus: {record['files']} files, {record['documents']} documents, {record['tokens']} tokens "
          f"(vocab_size {record['vocab_size']}, EOD {record['eod']}), sha256 {record['sha256']}, "
          f"{record['seconds']} s")
    print(f"corpus: wrote {record['prefix']}.bin, .idx and {record_path(record['prefix'])}")
    return 0


__all__ = ["CorpusError", "EOD", "VOCAB_SIZE", "build_corpus", "default_sources", "document_tokens",
           "find_documents", "read_record", "split_tokens"]
