"""megatron_fp4.corpus: a byte-level corpus from a small tree, read back through Megatron's
IndexedDataset and GPTDataset (sequence windows, EOD placement, NullTokenizer's EOD and vocabulary),
the same hash on a second build, and one-sentence errors; `megatron-fp4 corpus` end to end."""

import argparse
import hashlib
import json
from pathlib import Path

import numpy
import pytest

from megatron_fp4 import corpus

# Three documents of known bytes (one not UTF-8), an empty file and a file the glob leaves out.
FILES = {"b/two.py": b"print(2)\n", "a/one.py": b"x = 1\n" * 40, "c/three.py": bytes(range(200, 256)) * 3,
         "a/empty.py": b"", "a/notes.txt": b"not python\n"}
SEQUENCE = 16


@pytest.fixture
def tree(tmp_path):
    for name, data in FILES.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_bytes(data)
    return tmp_path / "src"


def _expected_documents(order):
    names = sorted(n for n, d in FILES.items() if n.endswith(".py") and d)
    if order == "hash":
        names.sort(key=lambda n: hashlib.sha256(f"src/{n}".encode()).hexdigest())
    return [list(FILES[n]) + [corpus.EOD] for n in names]


def _null_tokenizer():
    """Megatron's own tokenizer build for `tokenizer_type: NullTokenizer, vocab_size: VOCAB_SIZE`."""
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    args = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=corpus.VOCAB_SIZE, rank=0,
                              make_vocab_size_divisible_by=128, tensor_model_parallel_size=1, pad_vocab_size=True,
                              padded_vocab_size=None, null_tokenizer_eod_id=None, null_tokenizer_pad_id=None)
    return build_tokenizer(args), args


def test_nulltokenizer_puts_eod_past_every_byte():
    tokenizer, args = _null_tokenizer()
    assert tokenizer.eod == corpus.EOD == 256
    assert tokenizer.vocab_size == corpus.VOCAB_SIZE
    assert args.padded_vocab_size == 384 and args.padded_vocab_size > corpus.EOD  # the model's embedding rows


@pytest.mark.parametrize("order", corpus.ORDERS)
def test_documents_read_back_through_indexed_dataset(tree, tmp_path, order):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    record = corpus.build_corpus(tmp_path / "out" / "text", [tree], order=order, progress=lambda _: None)
    expected = _expected_documents(order)
    dataset = IndexedDataset(str(tmp_path / "out" / "text"))
    assert [dataset[i].tolist() for i in range(len(dataset))] == expected
    stream = numpy.concatenate([numpy.array(d, dtype="<u2") for d in expected])
    assert record["files"] == record["documents"] == len(expected) and record["tokens"] == stream.size
    assert record["sha256"] == hashlib.sha256(stream.tobytes()).hexdigest()
    assert json.loads((tmp_path / "out" / "text.json").read_text()) == record
    assert record["vocab_size"] == corpus.VOCAB_SIZE and record["eod"] == corpus.EOD


def test_gpt_dataset_windows_and_eod(tree, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    prefix = tmp_path / "text"
    corpus.build_corpus(prefix, [tree], progress=lambda _: None)
    tokenizer, _ = _null_tokenizer()
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQUENCE, blend=([str(prefix)], None), split="1,0,0",
                              path_to_cache=str(tmp_path / "cache"), tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [None, None, None], lambda: True, config).build()
    assert valid is None and test is None
    documents = _expected_documents("hash")
    stream = [t for d in documents for t in d]
    assert len(train) == (len(stream) - 1) // SEQUENCE  # one epoch of windows over the whole stream
    windows = [train[i] for i in range(len(train))]
    for sample in windows:
        tokens, labels = sample["tokens"].tolist(), sample["labels"].tolist()
        assert len(tokens) == SEQUENCE and tokens[1:] == labels[:-1]  # labels: the next token
        assert max(tokens + labels) <= corpus.EOD
    # The windows cover the stream's tokens (shuffled documents, in windows of SEQUENCE + 1).
    seen = sorted(t for s in windows for t in s["tokens"].tolist() + s["labels"].tolist()[-1:])
    assert len(seen) == len(windows) * (SEQUENCE + 1)
    assert sum(t == corpus.EOD for s in windows for t in s["tokens"].tolist() + s["labels"].tolist()[-1:]) >= \
        len(documents) - 1  # every document's EOD lands in some window (only the stream's tail can fall off)


def test_split_tokens_follow_megatrons_document_ranges(tree, tmp_path):
    corpus.build_corpus(tmp_path / "text", [tree], progress=lambda _: None)
    lengths = [len(d) for d in _expected_documents("hash")]
    assert corpus.split_tokens(tmp_path / "text", "2,1,0") == [sum(lengths[:2]), lengths[2], 0]


def test_two_builds_hash_alike_and_a_change_shows(tree, tmp_path):
    first = corpus.build_corpus(tmp_path / "one", [tree], progress=lambda _: None)
    second = corpus.build_corpus(tmp_path / "two", [tree], progress=lambda _: None)
    assert first["sha256"] == second["sha256"]
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "two.bin").read_bytes()
    (tree / "b" / "two.py").write_bytes(b"print(3)\n")
    assert corpus.build_corpus(tmp_path / "three", [tree], progress=lambda _: None)["sha256"] != first["sha256"]


def test_globs_pick_files(tree):
    by_name = corpus.find_documents([tree], ["*.txt"])
    by_path = corpus.find_documents([tree], ["a/*"])
    assert [d.name for d in by_name] == ["src/a/notes.txt"]
    assert sorted(d.name for d in by_path) == ["src/a/notes.txt", "src/a/one.py"]  # the empty file is skipped


def test_clear_errors(tree, tmp_path):
    with pytest.raises(corpus.CorpusError, match=r"^source directory .*missing does not exist"):
        corpus.find_documents([tmp_path / "missing"])
    with pytest.raises(corpus.CorpusError, match=r"^no nonempty file matching \*\.rs under "):
        corpus.find_documents([tree], ["*.rs"])
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(corpus.CorpusError, match="^cannot create the output directory"):
        corpus.build_corpus(blocker / "sub" / "text", [tree], progress=lambda _: None)


def test_default_sources_are_the_stdlib_and_torch():
    import sysconfig

    import torch

    assert corpus.default_sources() == [Path(sysconfig.get_paths()["stdlib"]), Path(torch.__file__).parent]


def test_the_command(tree, tmp_path, capsys):
    from megatron_fp4 import cli

    assert cli.main(["corpus", str(tmp_path / "text"), "--source", str(tree)]) == 0
    record = json.loads((tmp_path / "text.json").read_text())
    out = capsys.readouterr().out
    assert f"{record['tokens']} tokens" in out and record["sha256"] in out
    assert cli.main(["corpus", str(tmp_path / "x"), "--source", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err == \
        f"error: source directory {tmp_path / 'nowhere'} does not exist or is not a directory\n"


def test_an_existing_prefix_is_refused_unless_overwrite(tree, tmp_path, capsys):
    """Any one of PREFIX.bin / .idx / .json refuses the command (exit 2, one line, nothing touched);
    --overwrite rebuilds it."""
    from megatron_fp4 import cli

    prefix = tmp_path / "text"
    assert cli.main(["corpus", str(prefix), "--source", str(tree)]) == 0
    built = {suffix: Path(f"{prefix}{suffix}").read_bytes() for suffix in (".bin", ".idx", ".json")}
    capsys.readouterr()
    for suffix in (".bin", ".idx", ".json"):
        others = tmp_path / "alone"
        Path(f"{others}{suffix}").write_bytes(b"mine")
        assert cli.main(["corpus", str(others), "--source", str(tree)]) == 2
        assert capsys.readouterr().err == (f"error: {others}{suffix} already exists: pass --overwrite to replace "
                                           "the corpus, or choose another prefix\n")
        assert Path(f"{others}{suffix}").read_bytes() == b"mine"
        Path(f"{others}{suffix}").unlink()
    assert cli.main(["corpus", str(prefix), "--source", str(tree)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {prefix}.bin, {prefix}.idx and {prefix}.json already exist: ")
    (tree / "b" / "two.py").write_bytes(b"print(3)\n")
    assert cli.main(["corpus", str(prefix), "--source", str(tree), "--overwrite"]) == 0
    assert json.loads(Path(f"{prefix}.json").read_text())["sha256"] != json.loads(built[".json"])["sha256"]
    with pytest.raises(corpus.CorpusError, match="already exist"):
        corpus.build_corpus(prefix, [tree], progress=lambda _: None)
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["corpus"].format_help()
    assert "--overwrite" in help_text
