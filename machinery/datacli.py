"""data.py's command line, its demo corpus (the standard library's docstrings and a BPE learned from them), the
miniature's new domain (the standard library's code) and the BPE trainer's command: how the lesson's steps are
called, not what they teach. A reader of the recipe may skip this file; data.py hands it its prepare()."""
import argparse
import sys
import tempfile
import time
from pathlib import Path

from machinery.cli import InputError, Parser, check_outputs, importing, run, usable_cores
from machinery.prepare import (HELD_OUT_EVERY, find_sources, make_writable_dir, read_documents, write_code,
                               write_docstrings, write_file)
from machinery.tokenfiles import SPLITS, load_meta, split_tokens
from machinery.tokenizer import MAX_VOCAB, MIN_LEARNED, is_int, learn_bpe

# The demo's text is every docstring of the standard library (1.6 MB on CPython 3.11), and its
# tokenizer a BPE of 2,048 ids learned from it: 71% of its words are one token (fill-mask answers
# words), 3.1 bytes a token. 4,096 ids: 84% and 3.6, with a larger embedding to train.
DEMO_BYTES, DEMO_VOCAB = 4_000_000, 2048


def prepare_demo(prepare, out_dir="data/demo", vocab_size=DEMO_VOCAB):
    """The demo corpus, with no download and no text in the repository: the standard library's
    docstrings, tokenized by a BPE of vocab_size ids learned from them (None: by the byte
    tokenizer), written by `prepare` (data.py's). A demo made with another tokenizer is built
    again."""
    out = Path(out_dir)
    wanted = "bytes" if vocab_size is None else str((out / "tokenizer.json").resolve())
    try:
        meta = load_meta(out)
        for split in SPLITS:  # a demo cut short by a kill or a full disk is built again
            split_tokens(out, meta, split)
    except InputError:
        meta = None
    if meta and meta["tokenizer"] == wanted and meta["vocab_size"] == (vocab_size or 260):
        print(f"{out} is already prepared: {meta['splits']['train']['tokens']:,} train tokens")
        return meta
    if meta:
        print(f"{out} holds a demo made with tokenizer {meta['tokenizer']}: building it again")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_docstrings(Path(tmp) / "stdlib_docstrings.jsonl", DEMO_BYTES)
        tokenizer = "bytes" if vocab_size is None else train_tokenizer([corpus], vocab_size, wanted)
        return prepare([corpus], tokenizer, out, val_fraction=0.01)


def ensure_demo(prepare, data_dir):
    """train.py's demo corpus: built in data_dir when missing (no download); an error names --data."""
    if Path(data_dir, "meta.json").exists():
        return
    print(f"{data_dir} is missing: building the embedded demo corpus")
    try:
        prepare_demo(prepare, data_dir)
    except InputError as e:  # its message names data.py's flags, not train.py's
        raise InputError(f"--data={data_dir}: cannot build the demo corpus there ({e})") from None


def train_tokenizer(inputs, vocab_size, out, field="text"):
    """Learn a byte-level BPE of vocab_size ids from the documents of inputs and write it to out,
    a tokenizer.json that Hugging Face's AutoTokenizer loads too."""
    t0, out = time.time(), Path(out)
    files = [f for source in find_sources(inputs) for f in source.files]
    if not is_int(vocab_size) or not MIN_LEARNED <= vocab_size <= MAX_VOCAB:
        raise InputError(f"--vocab_size={vocab_size}: expected an integer in [{MIN_LEARNED}, "
                         f"{MAX_VOCAB}] (256 bytes, 4 special tokens and at least one merge)")
    if out.suffix != ".json" or out.is_dir():
        raise InputError(f"--out={out}: expected the path of a .json file to write")
    make_writable_dir(out.parent, out)
    check_outputs("--out", [out], files)  # never an input, nor a file of a model
    texts = (text for f in files for text in read_documents(f, field))
    tokenizer, counts = learn_bpe(texts, vocab_size, out)
    write_file(out, tokenizer.hf_files["tokenizer.json"])
    print(f"{out}: {tokenizer.vocab_size:,} ids learned from {sum(counts.values()):,} words "
          f"({len(counts):,} distinct) in {time.time() - t0:.1f} s")
    if tokenizer.vocab_size < vocab_size:
        print(f"warning: the corpus allows only {tokenizer.vocab_size - MIN_LEARNED + 1:,} merges, "
              f"so the vocabulary has {tokenizer.vocab_size:,} ids, not --vocab_size="
              f"{vocab_size:,}", file=sys.stderr)
    return tokenizer


def parse_mix(text):
    try:
        pairs = [(k.strip(), float(v)) for k, v in (item.split("=") for item in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected name=weight,name=weight") from None
    names = [k for k, _ in pairs]
    twice = sorted({k for k in names if names.count(k) > 1})
    if twice:  # a dict would keep the last weight alone
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(twice)} given more than once")
    return dict(pairs)


def make_parser(description):
    parser = Parser(prog="data.py", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    inputs = (".jsonl (one object a line), .txt (blank-line separated) or .parquet files (these need "
              "pip install pyarrow), .jsonl and .txt also as .gz or .zst; a folder is one source of the files "
              "in it; a quoted glob is the files it matches")
    field = "the text field of .jsonl objects and the text column of .parquet files"
    def command(name, what):
        return sub.add_parser(name, help=what, description=what[0].upper() + what[1:] + ".")
    p = command("prepare", "tokenize text files into train.bin, val.bin and meta.json")
    p.add_argument("--input", nargs="+", required=True, help=inputs)
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json path, a hub id, or 'bytes'")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument("--field", default="text", help=field)
    p.add_argument("--mix", type=parse_mix, help="target shares of the train tokens per source (a "
                   "file's name without extensions, a folder's name), e.g. en=0.6,fr=0.4; reached "
                   "by repeating or dropping documents")
    p.add_argument("--val_fraction", type=float, default=0.005,
                   help="share of each source's documents held out for validation (at least one)")
    p.add_argument("--seed", type=int, default=1337,
                   help="seeds the validation draw, the document order and the mixing")
    p.add_argument("--workers", type=int, default=usable_cores(),
                   help="processes that read, tokenize and write; by default one per core this "
                        "process may use, and never more than the cores or the input's pieces. The "
                        "output is the same for any number")
    t = command("tokenizer", "learn a small byte-level BPE tokenizer.json from text files")
    t.add_argument("--input", nargs="+", required=True, help=inputs)
    t.add_argument("--vocab_size", type=int, required=True,
                   help="number of ids, the 4 special tokens included")
    t.add_argument("--out", required=True, help="the tokenizer.json to write")
    t.add_argument("--field", default="text", help=field)
    d = command("docstrings", "write the standard library's docstrings as JSONL (general text)")
    d.add_argument("--out", required=True, help="the .jsonl to write")
    d.add_argument("--max_bytes", type=int, default=1_000_000, help="stop after this much text")
    c = command("code", "write the standard library's functions and classes, docstrings cut out, as JSONL (the "
                        "miniature's new domain), with the modules held out for evaluation in a file of their own")
    c.add_argument("--out", required=True, help="the .jsonl to train on")
    c.add_argument("--heldout", required=True, help=f"the .jsonl of held-out texts: the functions and classes of "
                   f"one module in {HELD_OUT_EVERY}, never in --out")
    c.add_argument("--max_bytes", type=int, default=2_000_000, help="stop after this much text in --out")
    f = command("fetch", "download the studies' corpus, tasks and held-out texts from their public sources and "
                         "convert them to the files reproduce.py and eval.py read (about 240 MB)")
    f.add_argument("--out", default="data/bio", help="the directory to write (reproduce.py's --data); the "
                   "downloads are kept in OUT/downloads, where a file already there is used without a network")
    e = command("demo", "build the demo corpus: docstrings and a BPE learned from them "
                        "(what `python data.py` does)")
    e.add_argument("--out", default="data/demo", help="the directory to write")
    e.add_argument("--vocab_size", type=int, default=DEMO_VOCAB,
                   help="ids of the BPE learned from the demo's text; 0: the byte tokenizer")
    return parser


def check_command_line(description):
    """data.py's flags checked before it imports torch (seconds on an idle machine, more on a busy one): a mistyped
    one is answered at once, in one line (exit status 2); --help is printed. main parses them again."""
    if sys.argv[1:]:
        run(lambda _: make_parser(description).parse_args(sys.argv[1:]))
    importing()  # Ctrl-C during the imports: one line


def main(data, argv=None):
    """Run the data.py (the module `data`) subcommand argv names; none: the demo corpus."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if not argv:
        return prepare_demo(data.prepare)
    a = make_parser(data.__doc__).parse_args(argv)
    if a.command == "tokenizer":
        train_tokenizer(a.input, a.vocab_size, a.out, a.field)
    elif a.command == "docstrings":
        path = write_docstrings(a.out, a.max_bytes)
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB of docstrings")
    elif a.command == "code":
        path, heldout, trained, held = write_code(a.out, a.heldout, a.max_bytes)
        print(f"{path}: {trained:,} functions and classes, {path.stat().st_size / 1e6:.1f} MB\n{heldout}: {held:,} "
              f"texts of held-out modules, {heldout.stat().st_size / 1e6:.1f} MB (texts for eval.py cka and needle --texts)\n"
              f"to prepare it with the demo's tokenizer (python train.py builds data/demo): python data.py prepare "
              f"--input {path} --tokenizer data/demo/tokenizer.json --out {path.with_suffix('')} --val_fraction 0.02")
    elif a.command == "fetch":
        from machinery import sources
        written = sources.fetch(a.out)
        print(f"{a.out}: {len(written)} file(s) written, {len(sources.OUTPUTS) - len(written)} there already; the "
              f"studies read them with: python reproduce.py --data={a.out} ...")
    elif a.command == "demo":
        prepare_demo(data.prepare, a.out, a.vocab_size or None)
    else:
        data.prepare(a.input, a.tokenizer, a.out, a.field, a.mix, a.val_fraction, a.seed, a.workers)
