"""The studies' public data: where the corpus, the three tasks and the held-out texts come from, and how each becomes
the files reproduce.py reads (`python data.py fetch`). A reader of the recipe may skip this file.

DIR (`--out`, data/bio by default; reproduce.py's --data) holds:

    corpus/e3c_en_clinical_cases.jsonl, corpus/e3c_fr_clinical_cases.jsonl    {"id", "text", "source", "licence", "url"}
    heldout/pubmedqa_abstracts.jsonl        {"id", "text"}: texts no model trains on (CKA, the needle)
    tasks/ncbi_disease/{train,dev,test}.tsv     token<TAB>IOB2 tag a line, a blank line between sentences
    tasks/chemprot/{train,dev,test}.jsonl, tasks/pubmedqa/{train,dev,test}.jsonl    {"text", ["text_pair",] "label"}

What each comes from (at a pinned release or commit, so that the files are those the reports in docs/ were computed
from: each written file is checked against that file's sha256):
- the corpus: E3C 2.0.0 (github.com/hltfbk/E3C-Corpus), layer 3, the clinical cases whose licence is CC BY or
  CC BY 4.0 (the others, CC BY-NC and CC BY-SA among them, are left out), English and French;
- ncbi_disease: NCBI-disease as the MTL-Bioinformatics-2016 release has it in IOB2 (CC BY 4.0), its devel split as
  dev;
- chemprot: ChemProt as SciBERT's repository ships it (Apache-2.0), 13 relation labels;
- pubmedqa: PubMedQA's 1,000 expert-labelled questions (PQA-L, MIT): the 500 of its official test set, and the other
  500 split 450 / 50 into train and dev (a fixed draw); their abstracts are the held-out texts.

The downloads are kept in DIR/downloads under the names of DOWNLOADS: one already there is used without a network
(on a machine without one, copy them there by hand). A file already in DIR is kept as it is, never overwritten.
"""
import json
import os
import random
import re
import shutil
import sys
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

from machinery.cli import InputError, sha256_file

RAW = "https://raw.githubusercontent.com"
PUBMEDQA = f"{RAW}/pubmedqa/pubmedqa/1cbae8e92f72f20c8d3747cbb3bf5bc53554d997/data"
NCBI = f"{RAW}/cambridgeltl/MTL-Bioinformatics-2016/df0df02fae6dbb87d88ffcf323b9096528f06f84/data/NCBI-disease-IOB"
CHEMPROT = f"{RAW}/allenai/scibert/06793f77d7278898159ed50da30d173cdc8fdea9/data/text_classification/chemprot"
# The files downloaded, by the name each is kept under in DIR/downloads: 237 MB, nearly all of it E3C's archive of
# every language and layer (230 MB).
DOWNLOADS = {
    "E3C-Corpus-2.0.0.zip": "https://github.com/hltfbk/E3C-Corpus/archive/refs/tags/v2.0.0.zip",
    "pubmedqa-ori_pqal.json": f"{PUBMEDQA}/ori_pqal.json",
    "pubmedqa-test_ground_truth.json": f"{PUBMEDQA}/test_ground_truth.json",
    **{f"ncbi_disease-{split}.tsv": f"{NCBI}/{split}.tsv" for split in ("train", "devel", "test")},
    **{f"chemprot-{split}.txt": f"{CHEMPROT}/{split}.txt" for split in ("train", "dev", "test")},
}
SPLITS = ("train", "dev", "test")
WHERE = ("E3C's clinical cases (the corpus), NCBI-disease, ChemProt and PubMedQA (the tasks; PubMedQA's abstracts "
         "are the held-out texts)")


def jsonl(rows, ascii_only=True):
    """A JSON object a line, as the files the reports used were written: E3C's accents as UTF-8, the others'
    non-ASCII characters escaped (json's default)."""
    return "".join(json.dumps(row, ensure_ascii=ascii_only) + "\n" for row in rows)


def read_json(path):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not the JSON file its source serves ({str(e)[:120]}); delete it and fetch "
                         f"again") from None


# -----------------------------------------------------------------------------
# The conversions: the downloads (a dict of name -> path) to the text of one file of DIR.


E3C_LICENCES = ("CC BY", "CC BY 4.0")  # layer 3 also holds CC BY-NC, CC BY-SA and CC BY-NC-SA cases


def e3c(downloads, language):
    """The clinical cases of one language of E3C's layer 3 (one JSON file each in its archive) whose licence is
    CC BY or CC BY 4.0, sorted by id."""
    member = re.compile(rf"(^|/)data_collection/{language}/layer3/[^/]+\.json$")
    path = downloads["E3C-Corpus-2.0.0.zip"]
    rows = []
    try:
        with zipfile.ZipFile(path) as archive:
            for name in filter(member.search, archive.namelist()):
                case = json.loads(archive.read(name))
                if case.get("licence") in E3C_LICENCES:
                    rows.append({key: case[key] for key in ("id", "text", "source", "licence", "url")})
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise InputError(f"{path}: not E3C's archive as its release serves it ({type(e).__name__}: "
                         f"{str(e)[:120]}); delete it and fetch again") from None
    if not rows:
        raise InputError(f"{path}: no {language} case of layer 3 under {' or '.join(E3C_LICENCES)}; delete it and "
                         f"fetch again")
    return jsonl(sorted(rows, key=lambda row: row["id"]), ascii_only=False)


def pubmedqa_questions(downloads):
    """{split: [pmid, ...]}: the official test set's questions, and the others drawn into dev (one in ten, a fixed
    shuffle of their sorted ids with seed 0) and train, each sorted."""
    questions = read_json(downloads["pubmedqa-ori_pqal.json"])
    test = read_json(downloads["pubmedqa-test_ground_truth.json"])
    if not (isinstance(questions, dict) and isinstance(test, dict) and set(test) <= set(questions)):
        raise InputError(f"{downloads['pubmedqa-test_ground_truth.json']}: its ids are not all among "
                         f"{downloads['pubmedqa-ori_pqal.json']}'s; delete both and fetch again")
    rest = sorted(set(questions) - set(test))
    random.Random(0).shuffle(rest)
    dev = rest[:len(rest) // 10]
    return questions, {"train": sorted(set(rest) - set(dev)), "dev": sorted(dev), "test": sorted(test)}


def abstract(question):
    return " ".join(question["CONTEXTS"])


def pubmedqa(downloads, split):
    """A split of PubMedQA as a sequence task: the question, its abstract, and the experts' yes / no / maybe."""
    questions, ids = pubmedqa_questions(downloads)
    return jsonl({"id": pmid, "text": questions[pmid]["QUESTION"], "text_pair": abstract(questions[pmid]),
                  "label": questions[pmid]["final_decision"]} for pmid in ids[split])


def pubmedqa_abstracts(downloads):
    """The abstracts of PubMedQA's 1,000 questions, sorted by id: texts no model of the studies trains on."""
    questions = read_json(downloads["pubmedqa-ori_pqal.json"])
    return jsonl({"id": pmid, "text": abstract(questions[pmid])} for pmid in sorted(questions))


def ncbi_disease(downloads, split):
    """NCBI-disease as the release has it (token<TAB>tag lines), its devel split as dev."""
    path = downloads[f"ncbi_disease-{'devel' if split == 'dev' else split}.tsv"]
    return Path(path).read_text(encoding="utf-8")


def chemprot(downloads, split):
    """ChemProt's relations as SciBERT ships them (a JSON object a line), without their empty metadata."""
    path = downloads[f"chemprot-{split}.txt"]
    try:
        rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        return jsonl({"text": row["text"], "label": row["label"]} for row in rows)
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path}: not ChemProt as SciBERT ships it ({type(e).__name__}: {str(e)[:120]}); delete it "
                         f"and fetch again") from None


@dataclass(frozen=True)
class Output:
    """A file of DIR: what it is made from (names of DOWNLOADS) and how."""
    path: str
    needs: tuple
    make: object  # (downloads: {name: path}) -> its text


E3C_ZIP, QUESTIONS = ("E3C-Corpus-2.0.0.zip",), ("pubmedqa-ori_pqal.json", "pubmedqa-test_ground_truth.json")
OUTPUTS = [
    Output("corpus/e3c_en_clinical_cases.jsonl", E3C_ZIP, lambda d: e3c(d, "English")),
    Output("corpus/e3c_fr_clinical_cases.jsonl", E3C_ZIP, lambda d: e3c(d, "French")),
    Output("heldout/pubmedqa_abstracts.jsonl", QUESTIONS[:1], pubmedqa_abstracts),
    *(Output(f"tasks/ncbi_disease/{s}.tsv", (f"ncbi_disease-{'devel' if s == 'dev' else s}.tsv",),
             lambda d, s=s: ncbi_disease(d, s)) for s in SPLITS),
    *(Output(f"tasks/chemprot/{s}.jsonl", (f"chemprot-{s}.txt",), lambda d, s=s: chemprot(d, s)) for s in SPLITS),
    *(Output(f"tasks/pubmedqa/{s}.jsonl", QUESTIONS, lambda d, s=s: pubmedqa(d, s)) for s in SPLITS),
]
# The sha256 of each file as the reports in docs/ were computed from it.
SHA256 = {
    "corpus/e3c_en_clinical_cases.jsonl": "11fcce23a1891d5f30becf8aa0bbbbe197f0f6d223e24489a9b6a90b0a57b0b7",
    "corpus/e3c_fr_clinical_cases.jsonl": "8ddafafdcd22d9de6fac91f637479b6b8a316d5dc076abc5c1063ed5e0b2e3c4",
    "heldout/pubmedqa_abstracts.jsonl": "0623df083a4c6b15e4eeb9ef5756df13b5efd98331fba8c7119b632043afa219",
    "tasks/ncbi_disease/train.tsv": "58379baf4614b8d757d93dd7a21b202849ca99f9b9d71b49185523ff5443300c",
    "tasks/ncbi_disease/dev.tsv": "b4e1e7efcc2a35047bf2f3d281648357470e674f555d4a26a0049ac37d59cc61",
    "tasks/ncbi_disease/test.tsv": "8f088ce45dc4746592188f9e69de3d89d87f3bb8f0ed8c4a287d018123fa148d",
    "tasks/chemprot/train.jsonl": "30b1a2fcb073a86554823019fa9d6da41a7462f8b1765152a299e32abbeee20c",
    "tasks/chemprot/dev.jsonl": "6f6aee57c266afbe42289d203784590e697122993562a213de6f3ec01b190e04",
    "tasks/chemprot/test.jsonl": "dce8753915bf9cb15d602d809a72aa339d2bb36f3ebce53de58949464c8b4755",
    "tasks/pubmedqa/train.jsonl": "22b78d2b60eb18a4e2c78d4a924b3817587c1e0d9a3178ffd9293e9a17aceee7",
    "tasks/pubmedqa/dev.jsonl": "4feea16b7db8a676072aa0f15099442eca6ddc172be6fad0b578f1b2c48c366d",
    "tasks/pubmedqa/test.jsonl": "34197784ef551e20f6d6d5eb8677b998a1accb9f6ea65b703a3528c99e99eff0",
}
TASKS = ("ncbi_disease", "chemprot", "pubmedqa")
CORPUS, HELDOUT = "corpus/e3c_en_clinical_cases.jsonl", "heldout/pubmedqa_abstracts.jsonl"


# -----------------------------------------------------------------------------
# Fetching: the downloads that are not there yet, then every file of DIR that is not there yet.


def how_to_get(data_dir):
    """What a command that needs the studies' data says where DIR lacks them: what they are and the command that
    fetches them."""
    return (f"they are public: {WHERE}; `python data.py fetch --out={data_dir}` downloads them (about 240 MB) and "
            f"writes them there, in the format reproduce.py and eval.py read")


def download(url, path):
    """url into path, through a temporary name: a download cut short leaves no file behind."""
    tmp = path.with_name(f".{path.name}.part")
    print(f"downloading {url} ...", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f, 1 << 20)
        os.replace(tmp, path)
    except (OSError, ValueError) as e:  # urllib's URLError and HTTPError are OSErrors
        tmp.unlink(missing_ok=True)
        raise InputError(f"cannot download {url} ({getattr(e, 'reason', None) or e}); on a machine with a network, "
                         f"run this again, or copy that file there by hand as {path} and run it again here") from None
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")


def fetch(data_dir):
    """Every file of OUTPUTS that DIR lacks, made from the downloads (fetched into DIR/downloads where missing);
    each file checked against the sha256 of the one the reports used (a difference is a warning: a source changed
    since). Returns the files written."""
    from machinery.prepare import make_writable_dir, write_file
    from machinery.tasks import read_task
    data_dir = Path(data_dir)
    todo = [o for o in OUTPUTS if not (data_dir / o.path).is_file()]
    for o in (o for o in OUTPUTS if o not in todo):
        print(f"{data_dir / o.path}: there already, kept as it is")
    downloads = data_dir / "downloads"
    needed = list(dict.fromkeys(name for o in todo for name in o.needs))
    make_writable_dir(downloads, data_dir)
    for name in needed:
        if not (downloads / name).is_file():
            download(DOWNLOADS[name], downloads / name)
    for o in todo:
        path = data_dir / o.path
        make_writable_dir(path.parent, data_dir)
        write_file(path, o.make({name: downloads / name for name in o.needs}))
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    for task in TASKS:
        read_task(data_dir / "tasks" / task)  # as eval.py will read it: an error now, not hours into a study
    for o in OUTPUTS:
        if sha256_file(data_dir / o.path) != SHA256[o.path]:
            print(f"warning: {data_dir / o.path} differs from the file the reports in docs/ were computed from "
                  f"(sha256 {SHA256[o.path][:16]}...): its source changed since, or the file was edited; results "
                  f"made with it may differ", file=sys.stderr)
    return [data_dir / o.path for o in todo]
