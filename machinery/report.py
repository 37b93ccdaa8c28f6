"""Markdown tables and figures of comparisons: CKA against its seed-noise band, fine-tuned arms with their
intervals, the needle's heat map. A reader of the recipe may skip this file: the numbers come from eval.py (CKA,
`needle`) and machinery/compare.py (fine-tuned arms)."""
import math
from pathlib import Path

from machinery.cli import InputError
from machinery.compare import INFORMATIVE_RULE, by_chance, compared
from machinery.curves import new_figure, save


def write_figure(fig, path):
    """Write a figure whole (curves.save: a temporary file renamed) or stop with one line naming the file."""
    try:
        save(fig, path)
    except OSError as e:
        raise InputError(f"{path}: cannot write it ({e.strerror or e})") from None
    print(f"wrote {path}")
    return Path(path).name


def number(x, spec):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def span(low, high, spec, scale=1.0):
    return "-" if low is None or high is None else f"[{low * scale:{spec}}, {high * scale:{spec}}]"


# -----------------------------------------------------------------------------
# CKA


def cka_markdown(r):
    """A CKA result as a markdown table, with what 1 - CKA is, the counts it rests on and the band rule."""
    a, b = r["names"]
    c, band, m = r.get("controls"), r.get("band"), r["replicates"]
    runs = f"{m} replicate pair(s) ({a} and {b} trained alike but for the objective)"
    lines = [f"1 - linear CKA of {a} vs {b} per layer: 0 when they represent the same texts alike up to rotation "
             f"and scale, towards 1 when unrelated. {runs}; each the mean of {r['draws']} draws of "
             f"{r['args']['n']} held-out texts" + (f"; {c['k']} seed control(s) (two runs of {a}'s method that "
                                                   f"differ in their seeds)" if c else "") + ".", ""]
    head = (f"| layer | 1 - CKA, {a} vs {b}, mean over {m} | 95% t interval over replicates, clipped to [0, 1] | "
            f"moves between draws (sd) |")
    if not c:
        lines += [head, "|---|---|---|---|"]
        lines += [f"| {i} | {r['divergence'][i]:.3e} | {span(r['divergence_low'][i], r['divergence_high'][i], '.2e')} "
                  f"| {r['divergence_draw_sd'][i]:.1e} |" for i in r["layers"]]
        return "\n".join(lines) + "\n"
    own = r["ratio"].get("replicates", m)
    lines += [head[:-1] + f"| seed controls, mean ± sd (k = {c['k']}) | the pair's geometric mean | bound | outside "
              f"the band | ratio (95% interval) |",
              "|---" * 9 + "|"]
    for i in r["layers"]:
        outside = band["outside"][i]
        lines.append(
            f"| {i} | {r['divergence'][i]:.3e} | {span(r['divergence_low'][i], r['divergence_high'][i], '.2e')} | "
            f"{r['divergence_draw_sd'][i]:.1e} | {c['mean'][i]:.3e} ± {number(c['sd'][i], '.1e')} | "
            f"{number(band['level'][i], '.3e')} | {number(band['bound'][i], '.3e')} | "
            f"{'-' if outside is None else 'yes' if outside else 'no'} | "
            f"{number(r['ratio']['mean'][i], '.2f')} {span(r['ratio']['low'][i], r['ratio']['high'][i], '.2f')} |")
    note = ("" if band["bound"][0] is not None else
            f" With {c['k']} control(s) there is no spread to bound: the rule needs at least 2.")
    lines += ["", f"ratio: each replicate's 1 - CKA over its own seed control's (the control that shares its {a} "
                  f"run), the mean over those {own} replicates with a t interval (the controls' noise counted; "
                  f"clipped at 0, as the ratio cannot go below). 1 - CKA's interval, and the bound, are clipped to "
                  f"[0, 1], the range of 1 - CKA: with few runs t reaches past it. {band['rule']}.{note}"]
    if r.get("trend"):
        tr = r["trend"]

        def slope(x, spec):
            return (f"{x['slope']:{spec}} per block {span(x['low'], x['high'], spec)} (the replicates' slopes: "
                    f"{', '.join(f'{v:{spec}}' for v in x['each'])}): {x['verdict']}")

        lines += ["", f"**Trend with depth** (the paper's signature: lower blocks move most), per replicate the "
                      f"least-squares slope against the block index, their mean with a 95% t interval over "
                      f"replicates. Of the ratio (each replicate against its own control): "
                      f"{slope(tr['ratio'], '+.3f')}. Of the raw 1 - CKA: {slope(tr['raw'], '+.4f')}. Read only "
                      f"where both agree: **{tr['verdict']}**."]
    return "\n".join(lines) + "\n"


def plot_cka(r, path):
    """Left: 1 - CKA per layer, the pair's mean with its interval over replicates, each seed control, the band's
    bound and the pair's geometric mean it is compared with, on a linear axis from 0; right (with controls): the
    ratio with its interval, against 1 (no more than seed noise). Layers outside the band are starred; the rule is
    written under the panels."""
    c, band = r.get("controls"), r.get("band")
    fig = new_figure((12 if c else 6.5, 5), 150, what="CKA figure (the JSON has every number)")
    if fig is None:
        return None
    a, b = r["names"]
    layers, m = r["layers"], r["replicates"]
    axes = fig.subplots(1, 2 if c else 1, squeeze=False)[0]
    ax = axes[0]
    low = [x if lo is None else x - lo for x, lo in zip(r["divergence"], r["divergence_low"])]
    high = [0 if hi is None else hi - x for x, hi in zip(r["divergence"], r["divergence_high"])]
    ax.errorbar(layers, r["divergence"], yerr=[low, high] if m > 1 else None, fmt="o-", color="C0", capsize=3,
                label=f"{a} vs {b}, mean of {m}" + (" (bars: 95% t interval over replicates, clipped to [0, 1])"
                                                     if m > 1 else ""))
    if c:
        for j, each in enumerate(c["divergence"]):
            ax.plot(layers, each, ".", color="grey", ms=5, label="each seed control" if j == 0 else None)
        if band["bound"][0] is not None:
            ax.plot(layers, band["bound"], "--", color="black", lw=1, label="the band's bound (one-sided 95%)")
            ax.plot(layers, band["level"], "x", color="C0", ms=6, ls="none",
                    label=f"{a} vs {b}, geometric mean (what the bound is for)")
            outside = [i for i in layers if band["outside"][i]]
            ax.plot(outside, [band["level"][i] for i in outside], "*", color="red", ms=12, ls="none",
                    label=f"outside the band ({len(outside)} of {len(layers)} layers)")
    ax.set_ylim(bottom=0)
    ax.set(xlabel="layer (block output)", ylabel="1 - linear CKA", title="representation divergence")
    if c:
        ax = axes[1]
        ratio = r["ratio"]
        mean = [math.nan if x is None else x for x in ratio["mean"]]
        err = [[0 if lo is None else x - lo for x, lo in zip(mean, ratio["low"])],
               [0 if hi is None else hi - x for x, hi in zip(mean, ratio["high"])]]
        own = ratio.get("replicates", m)
        ax.errorbar(layers, mean, yerr=err if own > 1 else None, fmt="o-", color="C0", capsize=3,
                    label=f"{a} vs {b}, each replicate over its own control" + (
                        " (bars: 95% t interval over replicates, clipped at 0)" if own > 1 else ""))
        ax.axhline(1, color="grey", ls=":", lw=1, label="the controls' mean (1)")
        if band["bound"][0] is not None:
            ax.plot(layers, [x / mu if mu else math.nan for x, mu in zip(band["bound"], c["mean"])], "--",
                    color="black", lw=1, label="the band's bound")
        ax.set_ylim(bottom=0)
        ax.set(xlabel="layer (block output)", ylabel="1 - CKA over the controls' mean",
               title="divergence in seed-noise units (ratio)")
    for ax in axes:
        ax.set_xticks(layers)
        ax.legend(fontsize=7)
    note = "1 - CKA: 0 = the same representation up to rotation and scale, 1 = unrelated."
    if band and band["bound"][0] is not None:
        note += (f" Outside the band: the geometric mean above the bound from {c['k']} controls (the rule and its "
                 f"measured error rate are in the JSON's band.rule).")
    fig.text(0.5, 0.01, note, ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return write_figure(fig, path)


# -----------------------------------------------------------------------------
# Fine-tuned arms (machinery/compare.py)


def points(x):
    return f"{100 * x:.1f}"


def finetune_markdown(comparison, names=None, settings="setting"):
    """A comparison (machinery.compare.compare) as one markdown table per task: scores x100, each arm's setting
    (chosen on other runs' dev scores where there were several), whether it is informative on dev, its test score
    and its difference to the reference with 95% intervals, its p value alone and over its family (Holm, where
    compare.family has read one), the difference it would detect with 80% power with the range its variance's
    uncertainty leaves (pooled, and its own), and the verdict. names: what to call each arm (default: its key);
    settings: what a setting is (e.g. "fine-tuning lr")."""
    names = names or {}
    name = lambda arm: names.get(arm, arm)  # noqa: E731
    lines = []
    for task, t in comparison["tasks"].items():
        ref, metric, base = t["reference"], t["metric"], t["baseline"]
        chosen = len(next(iter(t["arms"].values()))["dev"]) > 1
        runs = f"{t['replicates']} pretraining run(s) per arm x {len(t['seeds'][0])} fine-tuning seed(s)"
        if t.get("ner_mode"):  # how IOB2 tags are read as entities changes the score
            runs += f"; entities read as seqeval's {NER_WORDS[t['ner_mode']]}"
        split = t.get("dev_split") or {}
        dev = (f"{t['dev_examples']} dev examples" + (f" ({split['own']} of the task's own and "
               f"{split['carved_from_train']} moved from train: its dev set is smaller than {split['dev_min']})"
               if split.get("carved_from_train") else ""))
        lines += [f"**{task}** ({metric} and accuracy x100; {runs}; {t['test_examples']} test examples, {dev}; "
                  f"majority baseline: {metric} dev {points(base['dev'][metric])}, test {points(base['test'][metric])}"
                  + (f", test accuracy {points(base['test']['accuracy'])}" if "accuracy" in base["test"] else "")
                  + ")", ""]
        mixed = t.get("mixed_budgets")
        if mixed:  # a difference of arms fine-tuned differently is not their pretraining's alone
            lines += [f"**Fine-tuning budgets differ between the runs compared** ({budgets_text(mixed, name)}): each "
                      f"difference below, and its verdict, is that of the pretraining and of the fine-tuning budget "
                      f"together, not of the pretraining alone.", ""]
        how = ("fixed" if not chosen else "chosen on the other replicates' dev" if t["replicates"] > 1 else
               "chosen on the other seeds' dev" if len(t["seeds"][0]) > 1 else "chosen on its own dev: a single run")
        lines += [f"| arm | {settings} ({how}) | runs | dev "
                  f"{metric} | informative on dev | test {metric} (95% interval) | test accuracy | arm - {name(ref)} "
                  f"(95% interval) | p; family-wise (Holm) | detectable (80% power) [95% range]; own | verdict |",
                  "|---" * 11 + "|"]
        for arm, row in t["arms"].items():
            test, d, info = row["test"], row.get("difference"), row["informative"]
            lines.append(f"| {name(arm)} | {row['setting']} | {row['runs']} | {100 * row['dev_chosen']:.2f} | "
                         f"{'yes' if info['ok'] else 'no: ' + info['why']} | "
                         f"{100 * test['mean']:.2f} {span(test['low'], test['high'], '.2f', 100)} | "
                         f"{100 * row['accuracy']:.2f} | "
                         + (f"{100 * d['mean']:+.2f} {span(d['low'], d['high'], '+.2f', 100)} | {p_values(d)} | "
                            f"{detected(d)}; own {detected(d['own'])} | {d['verdict']}"
                            f"{' (budgets differ)' if mixed else ''} |" if d else
                            "(the reference) | - | - | - |"))
        found = [row["difference"]["detectable"] for row in t["arms"].values() if "difference" in row]
        if not t["ranked"]:
            lines += ["", f"No verdict on {task}: the reference ({name(ref)}) is not informative on dev, so this task "
                          f"cannot rank the arms at this fine-tuning budget." + pretraining_note(t)]
        elif found:
            least, most = points(min(found)), points(max(found))
            size = least if least == most else f"{least} to {most}"
            lines += ["", f"A true difference of {size} points or more would be found 80% of the time if the variance "
                          f"were as estimated (power, from the same variance components as each interval); the "
                          f"range beside each is the same at the 95% confidence bounds of its runs' variance. "
                          + pooled_note(t, name) + pretraining_note(t)]
        if t.get("unpaired"):
            lines += ["", f"Left out of {task}: " + "; ".join(f"seed(s) {', '.join(s)} of {path}" for path, s in
                                                             t["unpaired"].items())
                      + ", which not every arm ran on that replicate (a run pairs with the same seed of every arm)."]
        lines.append("")
    for task, files in comparison.get("left_out", {}).items():
        lines.append(f"Left out: {task}, which {', '.join(files)} lack(s).")
    return "\n".join(lines) + "\n" + INTERVAL_LEGEND + "\n"


def budgets_text(mixed, name):
    """The fine-tuning budgets of each arm's runs ({arm: [compare.budget of each replicate]}), in words."""
    def words(b):
        return (f"{b['steps'] if b['steps'] is not None else '?'} steps of {b['batch_size'] or '?'}, "
                f"{b['train_examples'] if b['train_examples'] is not None else '?'} train examples, max_len "
                f"{b['max_len'] or '?'}, " + (f"dev scored {b['evals']} times" if b["evals"] else
                                              "dev scored at finetune's default points")
                + (f", {b['pooling']} pooling" if b.get("pooling") not in (None, "cls") else ""))
    return "; ".join(f"{name(arm)}: {' | '.join(dict.fromkeys(map(words, runs)))}" for arm, runs in mixed.items())


def p_values(d):
    """A difference's p value, and its Holm-adjusted p over its family where one was read."""
    f = d.get("family")
    return f"{d['p']:.2g}" + (f"; {f['p']:.2g} of {f['size']}" if f else "")


def pooled_note(t, name):
    """Which arms' variance the intervals share, and on how many degrees of freedom."""
    pool = t.get("pooled") or []
    if not pool:
        return "Each interval rests on its own difference's variance components."
    c = t["arms"][pool[0]]["difference"]["components"]
    level = "replicate" if c["replicates"] > 1 else "seed"
    return (f"The intervals of {', '.join(name(a) for a in pool)} share one variance (the arms x {level}s "
            f"interaction, {c['top_df']} degrees of freedom, as a mixed model reads the table; each difference's own "
            f"is in report.json, its detectable difference beside the pooled one); an arm not informative on dev "
            f"keeps its own.")


NER_WORDS = {"default": "default mode (an I- tag that continues nothing starts an entity)",
             "strict": "strict IOB2 mode (an I- tag that continues nothing is dropped)"}


def pretraining_note(t):
    if t["replicates"] > 1:
        return ""
    if len(t["seeds"][0]) > 1:
        return " One pretraining run per arm: these intervals count fine-tuning seeds and test examples only, not " \
               "pretraining noise."
    return (" One pretraining run per arm and one fine-tuning seed: these intervals count the test examples only, not "
            "pretraining noise nor how much another fine-tuning seed would move the scores.")


INTERVAL_LEGEND = (
    "How to read it: a run is one fine-tuning seed of one pretraining run; where there were several settings, each "
    "run's test score is read at the one with the best mean dev score over the arm's other replicates (with one, its "
    "other seeds; never its own dev score but where it is the arm's only run), and within a run at the checkpoint "
    "with its best dev score. Intervals are 95%: the variance of the replicates' means (the seeds' spread is inside "
    "it; with one replicate, of its seeds), pooled over the arms that learned, plus a bootstrap of the "
    "test examples (2,000 draws, the metric recomputed from the predictions), with a t quantile on Satterthwaite's "
    "degrees of freedom; differences pair replicate r, seed s and every test example across arms. \"better\" or "
    "\"worse\" only when the interval excludes 0; p: the same t test's two-sided p value, and where the comparison "
    "belongs to a family (a study's fine-tuning comparisons) its Holm-adjusted p, which a verdict sentence reads. "
    "Detectable: the smallest true difference this design finds with 80% power (a two-sided 95% t test on the same "
    "standard error and degrees of freedom), if the variance is what was estimated, and in brackets the same at the "
    "95% confidence bounds of the runs' variance; the half-width of an interval is found only half the time. An arm "
    "is " + INFORMATIVE_RULE + "; a task whose reference is not informative gets no verdict for any arm.")


# -----------------------------------------------------------------------------
# Long context: the needle (eval.needle)


def needle_cell_text(cell, key):
    return f"{100 * cell[key]:.0f} {span(cell[f'{key}_low'], cell[f'{key}_high'], '.0f', 100)}"


def needle_markdown(r, names=None):
    """A needle result as two markdown tables, exact match and token accuracy (%, with 95% intervals): a row per
    model and length, a column per depth, then the two controls."""
    names, n = names or {}, r["args"]["n"]
    replicated = any(len(arm["models"]) > 1 for arm in r["arms"].values())
    lines = [f"Needle in a haystack: a made-up code ({r['value_pool']}) written into held-out text, then asked "
             f"for at the end with its tokens masked (\"{r['needle'][0].strip()} [MASK]...{r['needle'][1]}\"), "
             f"filled by the argmax of the MLM logits. {n} examples per cell, the same for every model. Depth: how "
             f"far back from the query the needle sits, as a share of the haystack (0% right before the query, "
             f"100% right after [CLS]). Controls: no needle (what the model guesses from priors) and the needle "
             f"right before the query with no haystack (its best case). % with a 95% interval over the examples "
             f"(exact match: Wilson; token accuracy: t)"
             + ("; for an arm of several replicates, their mean with an interval over the replicates (pretraining "
                "noise) and the examples (a bootstrap; exact match's also holds the Wilson interval of the examples' "
                "means over replicates, so that an arm that misses everything is not certain of 0)."
                if replicated else "."), ""]
    columns = r["columns"]
    head = "| model | length | " + " | ".join(f"{c}%" if c.isdigit() else c for c in columns) + " |"
    for key, what in (("exact", "exact match of the whole value"), ("token", "token accuracy")):
        lines += [f"**{what}**", "", head, "|---" * (len(columns) + 2) + "|"]
        for arm, a in r["arms"].items():
            for length in map(str, r["lengths"]):
                cells = [needle_cell_text(a["mean"][length][c], key) for c in columns]
                lines.append(f"| {names.get(arm, arm)} ({len(a['models'])}) | {length} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_needle(r, path, names=None):
    """The heat map: exact match (%) per length x depth, one panel per model (its replicates' mean), the two
    controls as the last columns beyond a white line; every cell written in it."""
    names, arms = names or {}, r["arms"]
    cols = min(3, len(arms))
    rows = -(-len(arms) // cols)
    fig = new_figure((cols * (1.5 + 0.75 * len(r["columns"])), rows * (1.6 + 0.45 * len(r["lengths"])) + 0.5), 120,
                     layout="constrained", what="needle heat map (the JSON has every number)")
    if fig is None:
        return None
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[len(arms):]:
        ax.set_visible(False)
    depths = [c for c in r["columns"] if c.isdigit()]
    for ax, (arm, a) in zip(axes, arms.items()):
        grid = [[100 * a["mean"][str(length)][c]["exact"] for c in r["columns"]] for length in r["lengths"]]
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="viridis", aspect="auto", origin="lower")
        for i, row in enumerate(grid):
            for j, x in enumerate(row):
                ax.text(j, i, f"{x:.0f}", ha="center", va="center", fontsize=8, color="white" if x < 60 else "black")
        ax.axvline(len(depths) - 0.5, color="white", lw=3)
        ax.set_xticks(range(len(r["columns"])), [f"{c}%" for c in depths] + ["no\nneedle", "next to\nquery"],
                      fontsize=8)
        ax.set_yticks(range(len(r["lengths"])), [str(x) for x in r["lengths"]])
        ax.set(xlabel="depth (0%: right before the query) | controls", ylabel="length (tokens)",
               title=f"{names.get(arm, arm)} ({len(a['models'])} replicate(s))")
    fig.colorbar(image, ax=list(axes[:len(arms)]), label="exact match %", shrink=0.8)
    fig.suptitle(f"Needle in a haystack: exact match of the value (%, the mean over a model's replicates), "
                 f"{r['args']['n']} examples per cell")
    return write_figure(fig, path)


# -----------------------------------------------------------------------------
# A study's report (reproduce.py): its markdown and its figure, from the numbers reproduce.py gathers in `rep`.
# spec: the study's title, method names, final models (the colours) and the models fine-tuned.


def replicate_of(run):
    """(method, replicate) of a run name such as clm-decay-r2; (run, None) for a run outside the replicates."""
    head, _, tail = run.rpartition("-r")
    return (head, int(tail)) if head and tail.isdigit() else (run, None)


def study_markdown(rep, spec):
    names, R = spec["names"], rep["replicates"]
    lines = [f"# {spec['title']}, scale `{rep['scale']}`", ""]
    if rep["scale"] == "smoke":
        lines += ["**Smoke scale: a tiny model trained for seconds. These numbers test the pipeline only; they say "
                  "nothing about the methods.**", ""]
    lines += ["## What was run", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rep["what"]), ""]
    lines += summary(rep, spec) + loss_tables(rep, spec)
    for when in ("before", "after") if "cka" in rep else ():
        lines += [f"## Layer-wise CKA {when} the decay", "", cka_markdown(rep["cka"][when]).strip(), "",
                  f"![CKA {when} the decay](cka-{when}.png)", ""]
    if "needle" in rep:
        lines += ["## Long context: the needle", "", needle_markdown(rep["needle"], names).strip(), "",
                  "![the needle](needle.png)", ""]
    for title, comparison in rep["finetune"].items():
        lines += [f"## Fine-tuning: {title}", "",
                  finetune_markdown(comparison, names, settings="fine-tuning lr").strip(), ""]
    lines += runs_table(rep, names) + settings_table(rep, names) + times(rep["time"])
    lines += [f"![{f}]({f})" for f in rep["figures"]]
    if R == 1:
        lines.insert(4, "**One pretraining run per arm: no interval below counts pretraining noise.**\n")
    return "\n".join(lines) + "\n"


def summary(rep, spec):
    """The verdicts in one list: per comparison and model, its loss differences and fine-tuning differences, a
    fine-tuning difference worded by its family's reading (Holm over the study's fine-tuning comparisons)."""
    names, R = spec["names"], rep["replicates"]
    lines = ["## The verdicts", "", f"Each difference is a model minus its reference with a 95% interval over {R} "
             f"pretraining run(s) per arm (fine-tuning: also over seeds and test examples); \"better\", \"worse\", "
             f"\"lower\" or \"higher\" only where the interval excludes 0, and for fine-tuning only where it does "
             f"over its family too (Holm over the study's fine-tuning comparisons). Losses in nats per token, scores "
             f"x100.", ""]
    for title, table in rep["losses"].items():
        ref = next(m for m, row in table.items() if "difference" not in row["val_mlm"])
        for m, row in table.items():
            if m == ref:
                continue
            parts = [f"validation {what} loss {d['mean']:+.3f} {span(d['low'], d['high'], '+.3f')} ({d['verdict']}"
                     + ("; differs by construction" if d.get("by_construction") else "") + ")"
                     for what, d in (("MLM", row["val_mlm"]["difference"]), ("CLM", row["val_clm"]["difference"]))]
            for task, t in rep["finetune"].get(title, {}).get("tasks", {}).items():
                d = t["arms"][m]["difference"]
                words = d["verdict"] if d["verdict"].startswith("no verdict") else (
                    family_words(d) + f"; detectable from {detected(d)}")
                parts.append(f"{task} {t['metric']} {100 * d['mean']:+.1f} {span(d['low'], d['high'], '+.1f', 100)} "
                             f"({words})")
            lines.append(f"- **{names.get(m, m)}** against {names.get(ref, ref)}: " + "; ".join(parts) + ".")
    return lines + [""] + chance_lines(rep) + [""]


def family_words(d):
    """A fine-tuning difference's verdict over its family, and its own where they differ."""
    f = d.get("family")
    if not f:
        return d["verdict"]
    alone = "" if f["verdict"] == d["verdict"] or d["verdict"].startswith("no detectable") else (
        f": {d['verdict']} alone, p = {d['p']:.2g}")
    return f"{f['verdict']}{alone}; Holm p = {f['p']:.2g} over {f['size']}"


def chance_lines(rep):
    """Per family, how many of its intervals exclude 0, against what chance alone gives; loss differences between
    models trained on different objectives differ by construction and are counted in no family."""
    losses = [d for table in rep["losses"].values() for row in table.values()
              for d in (row["val_mlm"].get("difference"), row["val_clm"].get("difference")) if d]
    families = [("fine-tuning", [d for c in rep["finetune"].values() for d in compared(c)]),
                ("validation losses of models trained on the same objectives",
                 [d for d in losses if not d.get("by_construction")])]
    lines = []
    for what, every in families:
        every = [d for d in every if d["verdict"] != "no interval"]  # one replicate: a loss difference has none
        if not every:
            continue
        c = by_chance(len(every), sum(not d["verdict"].startswith("no detectable") for d in every))
        line = (f"**{what.capitalize()}**: of the {c['compared']} differences compared above, {c['excluded']} "
                f"exclude 0 on their own; if no method differed from its reference, about {c['expected']:.1f} would "
                f"by chance")
        if c["excluded"]:
            line += (f", and {c['excluded']} or more with probability {c['p_as_many']:.2g} (binomial, as if the "
                     f"intervals were independent: they are not quite, since arms share their reference)")
        if all("family" in d for d in every):
            held = sum(d["family"]["verdict"] != "no family-wise difference" for d in every)
            line += f"; {held} of them family-wise (Holm over the {c['compared']})"
        lines.append(line + ".")
    apart = len(losses) - len(families[1][1])
    if apart:
        lines.append(f"The {apart} validation-loss differences between models trained on different objectives differ "
                     f"by construction and are in no count of what chance gives.")
    return lines


def detected(d):
    """The detectable difference of a fine-tuning difference in points, with its range; past 100 the scale cannot
    hold it."""
    def one(x):
        return "over 100" if x > 1 else points(x)
    if d["detectable"] > 1:
        return "more than the scale allows (over 100 points)"
    low, high = d.get("detectable_low"), d.get("detectable_high")
    return points(d["detectable"]) + ("" if low is None else f" [{one(low)}, {one(high)}]")


def loss_tables(rep, spec):
    names, R = spec["names"], rep["replicates"]
    lines = ["## Validation losses", "", f"At the end of each run, on the same held-out windows for every run (MLM "
             f"with 15% masked, CLM on every position; token-weighted means), mean over {R} replicate(s) with a 95% "
             f"t interval; differences paired replicate by replicate (lower is better), with the difference each "
             f"would detect with 80% power (t test over the {R} replicates).", ""]
    for title, table in rep["losses"].items():
        lines += [f"**{title}**", "", "| model | runs | MLM loss (95% interval) | minus reference | detectable | "
                  "verdict | CLM loss (95% interval) | minus reference | detectable | verdict |", "|---" * 10 + "|"]
        for m, row in table.items():
            cells = []
            for key in ("val_mlm", "val_clm"):
                x, d = row[key], row[key].get("difference")
                cells += [f"{x['mean']:.4f} {span(x['low'], x['high'], '.4f')}",
                          f"{d['mean']:+.4f} {span(d['low'], d['high'], '+.4f')}" if d else "(the reference)",
                          number(d and d.get("detectable"), ".4f"), d["verdict"] if d else "-"]
            lines.append(f"| {names.get(m, m)} | {len(row['val_mlm']['each'])} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def chain(runs, name):
    """The runs `name` continues, first to last, ending with `name` itself."""
    names = [name]
    while runs[names[-1]]["continues"]:
        names.append(runs[names[-1]]["continues"])
    return names[::-1]


def runs_table(rep, names):
    lines = ["## Appendix: every training run", "", "| run | method | objective, schedule | seed, data order | "
             "continues | tokens (with the runs it continues) | validation MLM loss | validation CLM loss |",
             "|---" * 8 + "|"]
    for name, r in rep["runs"].items():
        last = r["val"][-1] if r["val"] else [0, math.nan, math.nan]
        total = sum(rep["runs"][n]["tokens"] for n in chain(rep["runs"], name))
        lines.append(f"| {name} | {names.get(replicate_of(name)[0], '')} | {r['how']} | {r['seed']}, "
                     f"{r['data_seed']} | {r['continues'] or '-'} | {r['tokens']:,}"
                     + (f" ({total:,})" if r["continues"] else "") + f" | {last[1]:.4f} | {last[2]:.4f} |")
    return lines + [""]


def settings_table(rep, names):
    """Dev and test means at every fine-tuning lr: the appendix, never a comparison (a model's own test score
    counts only at the lr its dev score chose). A model whose dev mean is not above the majority baseline at some
    lr is marked there, and its spread across lrs is not given (it would read as stability)."""
    table = rep["per_setting"]
    lrs = list(next(iter(next(iter(table.values())).values())))
    if len(lrs) < 2:
        return []
    lines = ["## Appendix: every fine-tuning learning rate", "", "Mean dev / test score x100 over every run at each "
             "lr; `*`: dev not above the majority baseline there. The spread of test means across lrs is "
             "given for models that learned at every lr. Not used for any comparison: these test scores were not "
             "chosen on dev.", "", "| model | task | " + " | ".join(f"lr {lr}" for lr in lrs) + " | spread |",
             "|---" * (len(lrs) + 3) + "|"]
    for m, tasks in table.items():
        for task, by_lr in tasks.items():
            down = [x["dev"] <= x["dev_baseline"] for x in by_lr.values()]
            cells = [f"{100 * x['dev']:.2f} / {100 * x['test']:.2f}{' *' if d else ''}"
                     for x, d in zip(by_lr.values(), down)]
            tests = [100 * x["test"] for x in by_lr.values()]
            spread = "-" if any(down) else f"{max(tests) - min(tests):.2f}"
            lines.append(f"| {names.get(m, m)} | {task} | " + " | ".join(cells) + f" | {spread} |")
    return lines + [""]


def times(t):
    lines = ["## Time", "",
             f"Wall time: {t['wall']:.0f} s (while at least one stage ran; pauses between invocations left out). "
             f"Summed stage time: {t['summed']:.0f} s (each stage's own time, added up: stages ran side by side). "
             f"An interrupted attempt's time is in neither.", "", "| stage | seconds |", "|---|---|"]
    return lines + [f"| {n} | {v:.1f} |" for n, v in t["stages"].items()] + [""]


# The figure: validation losses and the learning rate against tokens (top), fine-tuning (bottom).

CURVES = [("val", 1, "validation MLM loss (15% masked)", "nats per token"),
          ("val", 2, "validation CLM loss", "nats per token"),
          ("lr", 1, "learning rate of each step", "learning rate")]


def curve_segments(runs, models):
    """Per model, its runs on one token axis (run, offset): the runs it continues come first, each drawn once, by
    the first model that has it, models of one objective first (the CLM-only model draws the CLM runs that CLM 25%
    and 50% then MLM branch off)."""
    drawn, segments = set(), {}
    one_objective = [m for m in models if len({runs[n]["objective"] for n in chain(runs, m)}) == 1]
    for m in one_objective + [m for m in models if m not in one_objective]:
        offset, parts = 0, []
        for name in chain(runs, m):
            if name not in drawn and (name == m or name not in models):
                parts.append((name, offset))
                drawn.add(name)
            offset += runs[name]["tokens"]
        segments[m] = parts
    return {m: segments[m] for m in models}


def study_figure(path, rep, spec, lrs):
    """report.png, one colour per final model in every panel; None without matplotlib (said once)."""
    tasks = list(next(iter(rep["finetune"].values()), {}).get("tasks", {}))
    fig = new_figure((18, 10), 100, layout="constrained", what="report.png")
    if fig is None:
        return None
    axes = fig.subplots(2, max(len(CURVES), len(tasks), 1), squeeze=False)
    colour = {m: f"C{i % 10}" for i, m in enumerate(spec["final"])}
    handles = draw_curves(axes[0], rep, spec, colour) + draw_finetuning(axes[1], rep, spec, tasks, colour)
    for ax in [*axes[0][len(CURVES):], *axes[1][len(tasks):]]:
        ax.set_visible(False)
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=9)
    fig.suptitle(f"{spec['title']}, scale {rep['scale']}, {rep['replicates']} replicate(s) per arm"
                 + (" (smoke: these numbers test the pipeline only)" if rep["scale"] == "smoke" else ""))
    save(fig, path)
    return Path(path).name


def draw_curves(axes, rep, spec, colour):
    """Every eval's validation losses and every step's lr of each final model along the runs it continues, one
    line per model and replicate (replicate 1 solid, the others dashed), branching off the last point of a run
    another model draws; a dotted line where a run continues another. Returns the legend's handles."""
    from matplotlib.lines import Line2D
    runs, switches = rep["runs"], set()
    for r in range(1, rep["replicates"] + 1):
        models = [f"{m}-r{r}" for m in spec["final"]]
        for i, (model, parts) in enumerate(curve_segments(runs, models).items()):
            switches |= {offset for _, offset in parts} - {0}
            first, start = parts[0]
            before = runs[first]["continues"]  # a run another model draws: this one branches off its last point
            for ax, (part, column, _, _) in zip(axes, CURVES):
                points = [(start, runs[before][part][-1][column])] if before and runs[before][part] else []
                points += [(p[0] + offset, p[column]) for name, offset in parts for p in runs[name][part]]
                if part == "lr" and points and not before:  # the first step's rate from the run's first token
                    points.insert(0, (start, points[0][1]))
                # a step's learning rate held over the tokens it trained (a one-step decay is one flat step, at
                # the rate 1-sqrt gives its first step: the peak); the lr lines nested, so where runs share a
                # schedule every one shows
                style = dict(lw=1.2, ms=3, marker="o") if part == "val" else dict(lw=3.5 - 0.3 * i,
                                                                                  drawstyle="steps-pre")
                if points:
                    ax.plot(*zip(*points), color=colour[spec["final"][i]], ls="-" if r == 1 else "--", **style)
    for ax, (_, _, title, unit) in zip(axes, CURVES):
        for x in switches:
            ax.axvline(x, color="grey", ls=":", lw=1)
        ax.set(title=f"{title} against tokens", ylabel=unit)
        tokens_axis(ax)
    handles = [Line2D([], [], color=colour[m], marker="o", ms=3, label=spec["names"][m]) for m in spec["final"]]
    if rep["replicates"] > 1:
        handles.append(Line2D([], [], color="grey", ls="--", label="replicates 2 and up (1: solid)"))
    if switches:
        handles.append(Line2D([], [], color="grey", ls=":", label="a run continues another here"))
    return handles


def tokens_axis(ax):
    from machinery.curves import tokens_axis as axis
    axis(ax)


def draw_finetuning(axes, rep, spec, tasks, colour):
    """Per task, each fine-tuned model's test score at its lr chosen on dev, with its 95% interval, the majority
    baseline, the axis from 0; a model not informative on dev hollow. Returns the legend's handles."""
    from matplotlib.lines import Line2D
    rows = {}
    for comparison in rep["finetune"].values():
        for task, t in comparison["tasks"].items():
            rows.setdefault(task, {}).update({m: (row, t) for m, row in t["arms"].items()})
    for ax, task in zip(axes, tasks):
        models = [m for m in spec["finetuned"] if m in rows[task]]
        for i, m in enumerate(models):
            row, t = rows[task][m]
            x = row["test"]
            ax.errorbar(i, 100 * x["mean"], yerr=[[100 * (x["mean"] - x["low"])], [100 * (x["high"] - x["mean"])]],
                        color=colour[m], marker="o", ms=7, capsize=4, ls="none",
                        mfc=colour[m] if row["informative"]["ok"] else "white")
        ax.axhline(100 * t["baseline"]["test"][t["metric"]], color="black", ls="--", lw=1)
        ax.set_ylim(bottom=0)
        ax.set_xticks(range(len(models)), [spec["names"][m] for m in models], rotation=30, ha="right", fontsize=8)
        ax.set(title=f"fine-tuning: {task}", ylabel=f"test {t['metric']} x100")
    R = rep["replicates"]
    return [Line2D([], [], color="black", ls="--", label="majority baseline (test split)"),
            Line2D([], [], color="grey", marker="o", ls="none", label=f"test score at the lr chosen on dev; bars: 95% "
                   f"interval over {R} pretraining run(s), seeds and test examples"),
            Line2D([], [], color="grey", marker="o", mfc="white", ls="none", label="not informative on dev")]
