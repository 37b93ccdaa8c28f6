"""
Benchmarks (not tests): numbers to quote, medians of a few repeats.

    python bench.py data [--corpus PATH] [--tokenizer PATH] [--threads N] [--repeats R]

data: tokenizer throughput against Hugging Face `tokenizers` on the same threads (and whether the ids agree),
`prepare` end to end, and the loader's MLM batches of 8192-token sequences on one core.
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parent.parent / "shared"


def timed(fn, repeats):
    """(median seconds, last result) of fn() over `repeats` runs."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def bench_data(args):
    # the Rust thread pool reads these when `tokenizers` first runs: set them before importing it
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    import torch
    from tokenizers import Tokenizer as HFTokenizer  # a test oracle, never a dependency of data.py

    import data

    texts = [json.loads(line)["text"] for line in open(args.corpus, encoding="utf-8")]
    mb = sum(len(t.encode()) for t in texts) / 1e6
    print(f"corpus {args.corpus}: {len(texts):,} documents, {mb:.1f} MB of text; {args.threads} threads, "
          f"median of {args.repeats}")

    ours, hf = data.load_tokenizer(args.tokenizer), HFTokenizer.from_file(str(args.tokenizer))
    t_ours, ids_ours = timed(lambda: ours.encode_batch(texts, num_threads=args.threads), args.repeats)
    t_one, _ = timed(lambda: ours.encode_batch(texts, num_threads=1), args.repeats)
    t_hf, ids_hf = timed(lambda: [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)], args.repeats)
    same = sum(a == b for a, b in zip(ids_ours, ids_hf))
    print(f"encode_batch  data.py {mb / t_ours:6.2f} MB/s ({mb / t_one:.2f} on 1 thread) | HF tokenizers "
          f"{mb / t_hf:6.2f} MB/s | ratio {t_hf / t_ours:.2f}x | identical ids {same}/{len(texts)}")

    with tempfile.TemporaryDirectory() as tmp:
        t_prep, meta = timed(lambda: data.prepare([args.corpus], str(args.tokenizer), Path(tmp) / "d",
                                                  workers=args.threads), args.repeats)
        print(f"prepare       {mb / t_prep:6.2f} MB/s of text end to end ({meta['splits']['train']['tokens']:,} "
              f"train tokens)")

        # the loader on one core, as each training process has its own
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        torch.set_num_threads(1)
        loader = data.Loader(Path(tmp) / "d", seq_len=8192, batch_size=4, micro_batch_size=4, objective="mlm",
                             mask_rate=0.3)
        n = 20
        t_load, _ = timed(lambda: [loader.next() for _ in range(n)], args.repeats)
        print(f"Loader        {n * 4 * 8192 / t_load / 1e6:6.2f} M tokens/s (MLM 30%, 4 x 8192 per micro-batch, "
              f"{t_load / n * 1e3:.1f} ms each, one core)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("data", help="tokenizer, prepare and loader throughput")
    p.add_argument("--corpus", type=Path, default=SHARED / "data" / "corpus" / "e3c_en_clinical_cases.jsonl")
    p.add_argument("--tokenizer", type=Path, default=SHARED / "tokenizers" / "modernbert" / "tokenizer.json")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(run=bench_data)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
