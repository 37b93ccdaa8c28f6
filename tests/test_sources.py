"""`data.py fetch` (machinery/sources.py): the studies' data converted from their sources' own formats, on small
stand-ins written here (made-up texts, no network): E3C's archive of JSON cases, PubMedQA's questions and official
test ids, NCBI-disease's IOB2 files, ChemProt as SciBERT ships it. What comes out is what eval.py's task reader and
reproduce.py's --data read; what is there already is kept; a download that fails is one line saying what to do."""
import hashlib
import json
import urllib.error
import zipfile

import pytest

import data
import reproduce
from machinery import sources
from machinery.cli import InputError
from machinery.tasks import read_task
from conftest import SHARED_DATA, need

WORDS = "the cell protein binds a receptor in mice while dose and risk of tumour rose".split()


def text(i, n=8):
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(n))


def case(i, licence, language="en"):
    return {"authors": [{"author": "A. Author"}], "doi": "", "id": f"{language.upper()}1{i:05d}",
            "url": f"https://example.org/{i}", "source": "Journal", "licence": licence, "language": language,
            "type": "journal", "description": "", "text": f"{text(i)} fièvre {i}."}


def stand_ins(downloads):
    """A small stand-in of every download, in its source's format. Returns what the conversion should keep."""
    downloads.mkdir(parents=True)
    licences = ["CC BY", "CC BY 4.0", "CC BY-NC", "CC BY-SA"]
    with zipfile.ZipFile(downloads / "E3C-Corpus-2.0.0.zip", "w") as z:
        for i in reversed(range(8)):  # the archive's order is not the output's
            for language, folder in (("en", "English"), ("fr", "French"), ("it", "Italian")):
                z.writestr(f"E3C-Corpus-2.0.0/data_collection/{folder}/layer3/{language}{i}.json",
                           json.dumps(case(i, licences[i % 4], language)))
        z.writestr("E3C-Corpus-2.0.0/data_collection/English/layer1/EN9.json", json.dumps(case(9, "CC BY")))
    questions = {str(1000 + 7 * i): {"QUESTION": f"Does {text(i, 3)}?", "CONTEXTS": [text(i), text(i + 1)],
                                     "LABELS": ["A", "B"], "final_decision": ["yes", "no", "maybe"][i // 2 % 3]}
                 for i in range(60)}
    test = {pmid: q["final_decision"] for pmid, q in list(questions.items())[::3]}
    (downloads / "pubmedqa-ori_pqal.json").write_text(json.dumps(questions))
    (downloads / "pubmedqa-test_ground_truth.json").write_text(json.dumps(test))
    for split in ("train", "devel", "test"):
        sentences = [[("Identification", "O"), ("of", "O"), ("colon", "B-Disease"), ("cancer", "I-Disease")],
                     [(f"{split}{i}", "O") for i in range(3)] + [("Ataxia", "B-Disease"), (".", "O")]]
        (downloads / f"ncbi_disease-{split}.tsv").write_text(
            "".join("".join(f"{t}\t{tag}\n" for t, tag in s) + "\n" for s in sentences))
    for split in ("train", "dev", "test"):
        (downloads / f"chemprot-{split}.txt").write_text("".join(json.dumps(
            {"text": f"<< {text(i, 2)} >> inhibits [[ {text(i + 3, 2)} ]] ≥ {i}",
             "label": ["INHIBITOR", "AGONIST"][i % 2], "metadata": []}) + "\n" for i in range(6)))
    return questions, test


def test_fetch_converts_each_source_to_what_eval_and_reproduce_read(tmp_path, capsys, monkeypatch):
    """No network: every download is in DIR/downloads. E3C keeps the CC BY and CC BY 4.0 cases of layer 3, by id, its
    accents as UTF-8; PubMedQA's official test ids are its test set, the others split 9 to 1 into train and dev; NCBI's
    files are kept byte for byte (devel as dev); ChemProt loses its metadata. eval.py's task reader takes each task,
    and a dry run of the detour reads the folder through --data."""
    def no_network(*args, **kwargs):
        raise AssertionError("fetch went to the network with every download there")
    monkeypatch.setattr(sources.urllib.request, "urlopen", no_network)
    bio = tmp_path / "bio"
    questions, test = stand_ins(bio / "downloads")
    data.main(["fetch", "--out", str(bio)])
    out, err = capsys.readouterr()
    assert f"{bio}: 12 file(s) written, 0 there already" in out and "--data=" in out
    assert err.count("differs from the file the reports in docs/ were computed from") == 12  # made-up stand-ins

    for language in ("en", "fr"):
        lines = (bio / "corpus" / f"e3c_{language}_clinical_cases.jsonl").read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines]
        assert [r["id"] for r in rows] == [f"{language.upper()}1{i:05d}" for i in (0, 1, 4, 5)]  # CC BY, CC BY 4.0
        assert all(r.keys() == {"id", "text", "source", "licence", "url"} for r in rows) and "fièvre" in lines[0]
    abstracts = [json.loads(line) for line in (bio / "heldout" / "pubmedqa_abstracts.jsonl").read_text().splitlines()]
    assert [a["id"] for a in abstracts] == sorted(questions)
    assert abstracts[0]["text"] == " ".join(questions[abstracts[0]["id"]]["CONTEXTS"])

    split = {s: [json.loads(line) for line in (bio / "tasks" / "pubmedqa" / f"{s}.jsonl").read_text().splitlines()]
             for s in ("train", "dev", "test")}
    ids = {s: [r["id"] for r in rows] for s, rows in split.items()}
    assert ids["test"] == sorted(test) and all(ids[s] == sorted(ids[s]) for s in ids)
    assert len(ids["dev"]) == (len(questions) - len(test)) // 10 and not set(ids["dev"]) & set(ids["train"])
    assert set(ids["train"]) | set(ids["dev"]) | set(ids["test"]) == set(questions)
    one = split["dev"][0]
    assert one == {"id": one["id"], "text": questions[one["id"]]["QUESTION"], "label": questions[one["id"]][
        "final_decision"], "text_pair": " ".join(questions[one["id"]]["CONTEXTS"])}
    for s, source in (("train", "train"), ("dev", "devel"), ("test", "test")):
        assert (bio / "tasks" / "ncbi_disease" / f"{s}.tsv").read_bytes() == \
            (bio / "downloads" / f"ncbi_disease-{source}.tsv").read_bytes()
    chem = [json.loads(line) for line in (bio / "tasks" / "chemprot" / "dev.jsonl").read_text().splitlines()]
    assert chem[1] == {"text": f"<< {text(1, 2)} >> inhibits [[ {text(4, 2)} ]] ≥ 1", "label": "AGONIST"}
    assert "\\u2265" in (bio / "tasks" / "chemprot" / "dev.jsonl").read_text()  # escaped, as the reports' files
    kinds = {name: read_task(bio / "tasks" / name)["kind"] for name in sources.TASKS}  # eval.py's reader: the oracle
    assert kinds == {"ncbi_disease": "token", "chemprot": "single", "pubmedqa": "single"}

    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # --data relative to where the command is typed; the stages run from the repository
    reproduce.main(["--scale=smoke", "--out=exp", "--data=bio", "--dry_run"])
    printed = capsys.readouterr().out
    assert printed.splitlines()[-1].endswith("inputs checked; nothing was run (--dry_run)")
    assert f"--task={bio / 'tasks' / 'pubmedqa'}" in printed and f"--texts={bio / 'heldout'}" in printed


def test_fetch_keeps_what_is_there_and_a_failed_download_says_what_to_do(tmp_path, capsys, monkeypatch):
    """A file of DIR that is there already is kept as it is (one matching its reports' sha256 is not warned about);
    a download that fails leaves nothing behind and is one line naming the address and where to put the file by
    hand; with the file there, the same command goes on without a network."""
    bio = tmp_path / "bio"
    stand_ins(tmp_path / "elsewhere")
    (bio / "tasks" / "chemprot").mkdir(parents=True)
    mine = bio / "tasks" / "chemprot" / "train.jsonl"
    mine.write_text('{"text": "mine", "label": "INHIBITOR"}\n{"text": "also mine", "label": "AGONIST"}\n')
    monkeypatch.setitem(sources.SHA256, "tasks/chemprot/train.jsonl", hashlib.sha256(mine.read_bytes()).hexdigest())

    def offline(url, timeout):
        raise urllib.error.URLError("Name or service not known")
    monkeypatch.setattr(sources.urllib.request, "urlopen", offline)
    with pytest.raises(InputError) as e:
        sources.fetch(bio)
    zip_path = bio / "downloads" / "E3C-Corpus-2.0.0.zip"
    assert str(e.value) == (f"cannot download {sources.DOWNLOADS['E3C-Corpus-2.0.0.zip']} (Name or service not "
                            f"known); on a machine with a network, run this again, or copy that file there by hand "
                            f"as {zip_path} and run it again here")
    assert list((bio / "downloads").iterdir()) == []
    for name in sources.DOWNLOADS:
        (bio / "downloads" / name).write_bytes((tmp_path / "elsewhere" / name).read_bytes())
    written = sources.fetch(bio)
    out, err = capsys.readouterr()
    assert len(written) == 11 and f"{mine}: there already, kept as it is" in out
    assert mine.read_text().startswith('{"text": "mine"') and err.count("differs") == 11
    assert f"warning: {mine} differs" not in err and "label" not in err


def test_a_download_that_is_not_its_source_is_one_line(tmp_path):
    bio = tmp_path / "bio"
    stand_ins(bio / "downloads")
    (bio / "downloads" / "pubmedqa-ori_pqal.json").write_text("<html>rate limited</html>")
    (bio / "downloads" / "E3C-Corpus-2.0.0.zip").write_text("not a zip")
    with pytest.raises(InputError, match="E3C-Corpus-2.0.0.zip: not E3C's archive as its release serves it"):
        sources.fetch(bio)
    (bio / "downloads" / "E3C-Corpus-2.0.0.zip").unlink()
    stand_ins(tmp_path / "again")
    (bio / "downloads" / "E3C-Corpus-2.0.0.zip").write_bytes((tmp_path / "again" / "E3C-Corpus-2.0.0.zip").read_bytes())
    with pytest.raises(InputError, match="pubmedqa-ori_pqal.json: not the JSON file its source serves"):
        sources.fetch(bio)


def test_pubmedqa_is_split_as_the_reports_files_are(tmp_path):
    """PubMedQA's questions rebuilt from the files the reports used (each question's abstract as one context): the
    conversion draws the same train / dev split and writes those files' bytes, and the held-out abstracts'."""
    folder = need(SHARED_DATA / "tasks" / "pubmedqa")
    rows = {s: [json.loads(line) for line in (folder / f"{s}.jsonl").open()] for s in sources.SPLITS}
    questions = {r["id"]: {"QUESTION": r["text"], "CONTEXTS": [r["text_pair"]], "final_decision": r["label"]}
                 for split in rows.values() for r in split}
    (tmp_path / "pubmedqa-ori_pqal.json").write_text(json.dumps(questions))
    (tmp_path / "pubmedqa-test_ground_truth.json").write_text(json.dumps({r["id"]: r["label"] for r in rows["test"]}))
    downloads = {name: tmp_path / name for name in ("pubmedqa-ori_pqal.json", "pubmedqa-test_ground_truth.json")}
    for s in sources.SPLITS:
        made = sources.pubmedqa(downloads, s)
        assert hashlib.sha256(made.encode()).hexdigest() == sources.SHA256[f"tasks/pubmedqa/{s}.jsonl"], s
    made = sources.pubmedqa_abstracts(downloads)
    assert hashlib.sha256(made.encode()).hexdigest() == sources.SHA256[sources.HELDOUT]
