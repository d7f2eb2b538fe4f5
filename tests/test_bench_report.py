"""The bench's reports from constructed results (no training): flags, rankings, and report.html in a real
headless browser (Chromium from the OS packages; .ci/run installs it and makes a missing browser an error)."""

import csv
import json
import math
import os
import shutil
import subprocess
import warnings

import pytest

from textgym import bench, bench_records
from textgym.bench_numbers import fmt, fmt_interval, fmt_p
from textgym.bench_results import write_outputs

DESIGNS = {
    "bench": {
        "seeds": [0, 1, 2],
        "eval_prompts": "copy-heldout",
        "eval_episodes": 16,
        "samples_in_report": 2,
    },
    "run": {"total_timesteps": 100},
    "env": {"id": "textgym/Copy-v0", "num_envs": 16, "prompts": "copy-train"},
    "agent": {"name": "lmppo", "policy": "tiny-char-llama"},
    "designs": [
        {"name": "proxy", "rewards": [{"name": "match", "partial": True}]},
        {
            "name": "gold",
            "rewards": [{"name": "match"}, {"name": "length_penalty", "weight": 0.5, "target": 3}],
        },
    ],
    "metrics": {"rewards": [{"name": "match", "label": "exact_copy", "range": [0, 1]}]},
}


def fake_bench(
    out,
    eval_prompts="copy-heldout",
    seeds=(0, 1, 2),
    designs=("proxy", "gold"),
    label="exact_copy",
    aggregate="sum",
    builtin=None,
):
    """A finished bench as the runs would leave it: the proxy design games its reward (its gold metric peaks
    at iteration 10 and falls while its reward keeps rising), the gold design improves steadily. ``label``:
    the gold metric's name; ``aggregate``: how the gold design sums its components."""
    d = json.loads(json.dumps(DESIGNS).replace('"exact_copy"', json.dumps(label)))
    gold = d["designs"][1]
    gold["rewards"] = {"aggregate": aggregate, "components": gold["rewards"]}
    d["designs"] = [design for design in d["designs"] if design["name"] in designs]
    d["bench"]["output_dir"] = str(out)
    d["bench"]["eval_prompts"] = eval_prompts
    d["bench"]["seeds"] = list(seeds)
    if builtin is not None:
        d["metrics"]["builtin"] = builtin
    spec = bench.load_designs(d)
    jobs = bench.plan(spec, out)
    for job in jobs:
        gaming = job.design["name"] == "proxy"
        s = 0.01 * job.seed if gaming else 0.015 * job.seed**2  # seeds vary, and not in step
        gold = [0.1, 0.3, 0.5, 0.3, 0.15] if gaming else [0.1, 0.2, 0.3, 0.4, 0.5]
        proxy = [0.1, 0.3, 0.5, 0.7, 0.9] if gaming else [0.1, 0.2, 0.3, 0.4, 0.5]
        rows = [
            {"iteration": 5 * i, "timesteps": 500 * i, "reward": p + s, "reward_se": 0.01, label: g + s,
             f"{label}_se": 0.01, "kl": 0.5 * i * i + s, "length": 3.0, "distinct_2": 0.9,
             "eos_rate": (max(0.0, 0.8 - 0.2 * i) + (0.09 * job.seed**2 if i == 4 else 0)) if gaming else 0.8}
            for i, (g, p) in enumerate(zip(gold, proxy))
        ]  # fmt: skip
        job.run_dir.mkdir(parents=True)
        bench_records.record_start(out, job)
        with (job.run_dir / "eval.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        with (job.run_dir / "metrics.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["iteration", "timesteps", "reward", "kl"])
            writer.writeheader()
            writer.writerows(
                {"iteration": i, "timesteps": 100 * i, "reward": 0.1 * i + s, "kl": 0.1 * i}
                for i in range(1, 21)
            )
        last = rows[-1]
        sample = {"prompt": "abc", "completion": "abc<&>" if gaming else "abc", "finish_reason": "stop",
                  "num_tokens": 4, "reward": last["reward"], "kl": last["kl"],
                  "components": {"match": 0.5, label: 0.0 if gaming else 1.0}}  # fmt: skip
        result = {
            "agent": job.agent["label"], "design": job.design["name"], "seed": job.seed,
            "config_hash": job.config_hash, "eval_hash": job.eval_hash,
            "metrics": {k: last[k] for k in ("reward", label, "kl", "length", "distinct_2", "eos_rate")},
            "errors": {"reward": 0.01, label: 0.01},
            "components": {"match": {"weight": 1.0, "mean": 0.5, "std": 0.2, "share": 0.95 if not gaming else 1.0},
                           "length_penalty": {"weight": 0.5, "mean": 0.0, "std": 0.01, "share": 0.05}}
            if not gaming else {"match": {"weight": 1.0, "mean": 0.5, "std": 0.2, "share": 1.0}},
            "samples": [sample, {**sample, "prompt": "xyz"}],
        }  # fmt: skip
        (job.run_dir / "eval.json").write_text(json.dumps(result))
    return spec, jobs


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "bench"
    spec, jobs = fake_bench(out)
    return out, write_outputs(out, spec, jobs)


def test_the_setup_says_held_out_only_where_the_evaluation_prompts_are(tmp_path):
    """Without bench.eval_prompts the runs are evaluated on their training prompts: not held out (the sample
    tables were headed "held-out prompts" all the same)."""
    for prompts, says, samples in [
        ("copy-heldout", "the same 16 held-out episodes (`copy-heldout`;", "the first held-out prompts)"),
        (None, "the same 16 episodes of the training prompts, not held out",
         "the first training prompts (none held out))"),
        # the training source named again: it was reported as held out
        ("copy-train", "16 episodes of the training prompts, not held out (eval_prompts `copy-train` is the "
         "source the runs train on", "the first training prompts (none held out))"),
    ]:  # fmt: skip
        out = tmp_path / str(prompts)
        write_outputs(out, *fake_bench(out, eval_prompts=prompts))
        report, page = (out / "report.md").read_text(), (out / "report.html").read_text()
        assert says in report and f"## Samples (seed 0, {samples}" in report
        assert f"Samples side by side (seed 0, {samples}" in page


def test_flags_rankings_and_clipped_intervals(report):
    out, results = report
    md = (out / "report.md").read_text()
    assert (
        "**proxy**: proxy rose while gold fell after iteration 10: reward 0.500 -> 0.900, exact_copy 0.500 -> "
        in md
    )
    assert "(3 of 3 seeds; shown: seed 0)" in md
    assert "EOS collapse: EOS rate 0.80 -> 0.00 (2 of 3 seeds; shown: seed 0)" in md
    assert "component 'match' makes 95% of the total's spread" in md  # the gold design's stack
    # beside the flags raised, the checks that raised none: a check that passed is said, not inferred
    assert "No flag from these checks, where they ran: length drift, diversity collapse." in md
    assert (
        "No flag from these checks, where they ran: length drift, diversity collapse."
        in (out / "report.html").read_text()
    )
    assert "**exact_copy** (higher is better): 1. gold (0.525), 2. proxy (0.160)" in md
    assert "| abc&lt;&amp;&gt; |" in md and "abc<&>" not in md  # a completion's text, not markup
    # `reward` is each design's own total: shown, not ranked between designs, and said under the table
    note = (
        "`reward`: each design's own training total on the held-out prompts: not comparable between designs"
    )
    assert (
        note in md
        and "<code>reward</code>: each design&#x27;s own training total" in (out / "report.html").read_text()
    )
    assert "**reward**" not in md.split("Rankings:")[1].split("Paired")[0]
    eos = results.cell("lmppo", "proxy", "eos_rate")  # 0, 0.09, 0.36: the t interval reaches below 0
    assert eos["ci_low"] == 0.0 and eos["mean"] == pytest.approx(0.15) and eos["ci_high"] <= 1
    assert {c["better"] for c in results.comparisons if c["metric"] == "exact_copy"} == {"gold"}
    # every paired comparison but `reward`'s between designs is in comparisons.csv: `length` too (it is not
    # ranked, so it has no "better"), as between agents
    designs = {
        c["metric"] for c in csv.DictReader((out / "comparisons.csv").open()) if c["scope"] == "designs"
    }
    assert designs == set(results.metrics) - {"reward"} and "length" in designs
    for c in results.comparisons:  # each difference's interval within what two values in the range differ by
        low, high = results.ranges.get(c["metric"], (-math.inf, math.inf))
        assert not c["ci_low"] < low - high and not c["ci_high"] > high - low, c
    for name in ("training_curves.png", "eval_curves.png", "overoptimization.png", "metric_bars.png",
                 "curves/proxy.png", "curves/gold.png"):  # fmt: skip
        assert (out / name).stat().st_size > 10_000


def test_the_checks_said_to_raise_nothing_are_those_whose_metrics_the_curves_have(report):
    """A check whose metric `[metrics] builtin` left out did not run: it is not listed as passed."""
    import dataclasses

    from textgym.bench_flag_text import quiet_checks_text

    _, results = report

    def without(*metrics):
        curves = {
            k: [{m: v for m, v in row.items() if m not in metrics} for row in c]
            for k, c in results.curves.items()
        }
        return dataclasses.replace(results, curves=curves)

    assert (
        quiet_checks_text(without("length"))
        == "No flag from these checks, where they ran: diversity collapse."
    )
    assert quiet_checks_text(without("length", "distinct_2")) is None


def test_the_report_says_which_checks_did_not_run(tmp_path):
    """A run without a held-out curve, and a design whose proxy is not measured (normalize_then_sum), are not
    checked for what needs them: the report says so, and counts a flag over the seeds it was checked on."""
    out = tmp_path / "bench"
    spec, jobs = fake_bench(out)
    for job in jobs:
        if job.design["name"] == "proxy" and job.seed == 2:
            (job.run_dir / "eval.csv").unlink()
        if job.design["name"] == "gold" and job.seed == 1:  # an eval.csv without standard errors
            rows = list(csv.DictReader((job.run_dir / "eval.csv").open()))
            with (job.run_dir / "eval.csv").open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=[k for k in rows[0] if not k.endswith("_se")])
                writer.writeheader()
                writer.writerows({k: v for k, v in r.items() if not k.endswith("_se")} for r in rows)
        if job.design["name"] == "gold":  # a normalize_then_sum total: not measured, in the curves too
            rows = list(csv.DictReader((job.run_dir / "eval.csv").open()))
            with (job.run_dir / "eval.csv").open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows({**r, "reward": ""} for r in rows)
            result = json.loads((job.run_dir / "eval.json").read_text())
            result["metrics"]["reward"] = None
            result["metrics"]["kl"] = "inf" if job.seed == 0 else result["metrics"]["kl"]  # a KL that blew up
            result["samples"][0]["components"]["match"] = "inf"
            (job.run_dir / "eval.json").write_text(json.dumps(result))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        write_outputs(out, spec, jobs)
    assert not [
        w for w in caught if "Mean of empty slice" in str(w.message)
    ]  # (the gold's unmeasured reward)
    md = (out / "report.md").read_text()
    # seed 2 had no curve to check: the flag says so
    assert (
        "exact_copy 0.500 -> 0.150 (2 of 2 seeds (2 of 3 seeds had a held-out curve of exact_copy to check); "
        in md
    )
    assert "did not run on 1 of 6 runs: they have no held-out curve" in md
    assert "The gaming check did not run on gold: the held-out `reward` (the proxy) is not measured" in md
    html = (out / "report.html").read_text()
    assert "did not run on 1 of 6 runs" in html and "1 of 3 shared seeds have an infinite value" in html
    assert "No flags" not in md
    # an infinite KL is shown as one, not dropped as "not measured"
    assert "| gold | n/a | 0.525 [0.447, 0.603] | inf |" in md
    assert "match inf" in md
    # ... and a pair with it is not tested (the infinity made every difference 0: "not significant", p = 1)
    kl = [c for c in csv.DictReader((out / "comparisons.csv").open()) if c["metric"] == "kl"]
    assert [(c["infinite"], c["p"], c["better"]) for c in kl] == [("1", "", "")]
    assert "| 3 | not tested (1 of 3 shared seeds have an infinite value) |" in md
    assert "could not judge every evaluation of 1 of 5 runs: some have no standard error" in md


def test_a_metric_not_measured_on_a_seed_is_said_and_leaves_its_pairs_untested(tmp_path):
    """exact_copy applied to none of proxy's seed-2 completions: the cell averaged the 2 others without
    saying so, and the paired test compared proxy's good runs only."""
    out = tmp_path / "bench"
    spec, jobs = fake_bench(out)
    for job in jobs:
        if job.design["name"] == "proxy" and job.seed == 2:
            result = json.loads((job.run_dir / "eval.json").read_text())
            result["metrics"]["exact_copy"] = None
            (job.run_dir / "eval.json").write_text(json.dumps(result))
    write_outputs(out, spec, jobs)
    md = (out / "report.md").read_text()
    assert "| proxy | 0.910 [0.885, 0.935] | 0.155 [0.091, 0.219] (2 of 3 seeds) |" in md
    assert "not tested (1 shared seed(s) measured for one and not the other" in md
    assert "**exact_copy** (higher is better): not ranked: gold (0.525), proxy (0.155) — not tested" in md
    summary = {(r["design"], r["metric"]): r for r in csv.DictReader((out / "summary.csv").open())}
    assert (summary["proxy", "exact_copy"]["n"], summary["proxy", "exact_copy"]["seeds"]) == ("2", "3")
    assert summary["proxy", "exact_copy"]["rank"] == ""
    rows = [c for c in csv.DictReader((out / "comparisons.csv").open()) if c["metric"] == "exact_copy"]
    assert [(c["unmeasured"], c["p"], c["better"]) for c in rows] == [("1", "", "")]


def test_without_gold_metrics_the_report_says_the_gaming_check_did_not_run(tmp_path):
    """A proxy that climbs with no `[metrics] rewards` to check it against read "No flags: no run gamed
    its proxy"."""
    out = tmp_path / "bench"
    spec, jobs = fake_bench(out)
    spec["metric_rewards"] = []
    write_outputs(out, spec, jobs)
    md = (out / "report.md").read_text()
    assert (
        "The gaming check did not run: it compares the proxy with gold metrics, and the bench names none"
        in md
    )
    assert "no run gamed its proxy" not in md


def test_a_bench_of_one_design_ranks_nothing(tmp_path):
    """One design was listed as "1. proxy" under every metric: a rank with nothing to rank against."""
    out = tmp_path / "bench"
    write_outputs(out, *fake_bench(out, designs=["proxy"]))
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "Rankings" not in md and "1. proxy" not in md and "Rankings" not in html
    assert "| proxy |" in md  # its results are reported


def test_numbers_keep_the_digits_that_tell_them_apart_and_user_labels_stay_text(tmp_path):
    # differences of 0.00714 and 0.00719 on two seeds printed as "0.007 [0.007, 0.007]", the interval of a
    # difference that does not vary; a p below 0.0005 as "0.000"
    assert fmt_interval(0.007165, 0.00703, 0.0073) == "0.00717 [0.00703, 0.00730]"
    assert fmt_interval(0.369, 0.252, 0.486) == "0.369 [0.252, 0.486]"
    assert fmt_interval(0.8, 0.8 - 3e-16, 0.8 + 4e-16) == "0.800 [0.800, 0.800]"  # one value on every seed
    assert (fmt(0.0004), fmt(77.7), fmt(-1e-12), fmt(0.0)) == ("0.00040", "77.700", "0.000", "0.000")
    assert (fmt_p(0.0004), fmt_p(0.0234), fmt_p(1.0)) == ("<0.001", "0.023", "1.000")
    # a metric's label with Markdown and HTML in it broke the tables' columns and rendered as markup
    out = tmp_path / "bench"
    write_outputs(out, *fake_bench(out, label="exact|copy <i>x</i> *y* `z`"))
    md = (out / "report.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| design |"))
    label = "exact\\|copy &lt;i&gt;x&lt;/i&gt; \\*y\\* \\`z\\`"
    assert label in header and "<i>" not in md
    # and in the flags, which name it too: it rendered as italics and code in both reports
    flag = next(line for line in md.splitlines() if line.startswith("- **proxy**: proxy rose"))
    assert "exact\\|copy &lt;i>x&lt;/i> \\*y\\* \\`z\\` 0.500 -> 0.150" in flag  # "->" stays readable
    page = (out / "report.html").read_text()
    assert "exact|copy &lt;i&gt;x&lt;/i&gt; *y* `z`" in page and "<code>z</code>" not in page
    assert (
        header.count(" | ")
        == next(line for line in md.splitlines() if line.startswith("|---")).count("|---") - 1
    )


def test_the_plots_draw_no_flat_standardised_reward_no_interval_of_one_seed_and_runs_of_one_point(tmp_path):
    import numpy as np
    from matplotlib.container import BarContainer

    from textgym import bench_plots

    out = tmp_path / "bench"
    results = write_outputs(out, *fake_bench(out, seeds=(0,), aggregate="normalize_then_sum"))
    # a normalize_then_sum total is ~0 in every batch: drawn, it read as a design that did not learn
    ax = bench_plots.training_curves(results).axes[0]
    assert [line.get_label() for line in ax.lines if not line.get_label().startswith("_")] == ["proxy"]
    assert "not drawn, standardised per batch (normalize_then_sum): gold" in ax.get_title()
    assert "not drawn" in bench_plots.design_curves(results, "gold").axes[0].get_title()
    # one seed has no interval: error bars of length 0 with caps read as intervals of width 0
    for ax in bench_plots.metric_bars(results).axes:
        for bars in (c for c in ax.containers if isinstance(c, BarContainer) and c.errorbar):
            for segment in bars.errorbar.lines[2][0].get_segments():
                assert len(segment) == 0 or np.isnan(segment).any()
    # a run of one iteration is one point: without a marker its line drew nothing
    _, ax = bench_plots.pyplot().subplots()
    bench_plots._seed_lines(ax, [([100], [0.5])], "C0", "-", "one")
    assert ax.lines and all(line.get_marker() == "o" for line in ax.lines)
    _, ax = bench_plots.pyplot().subplots()  # several such runs: the labelled point is their mean, not seed 0
    bench_plots._seed_lines(ax, [([100], [0.5]), ([100], [0.9]), ([100], [0.7])], "C0", "-", "three")
    (mean,) = [line for line in ax.lines if line.get_label() == "three"]
    assert list(mean.get_ydata()) == pytest.approx([0.7])
    # runs ending at different token counts: the mean ends at their final values (the tables' numbers), not
    # at the values interpolated where the shortest run ends
    _, ax = bench_plots.pyplot().subplots()
    bench_plots._seed_lines(
        ax, [([0, 100, 200], [0.0, 0.5, 0.6]), ([0, 100, 150], [0.0, 0.9, 1.0])], "C0", "-", "m"
    )
    (mean,) = [line for line in ax.lines if line.get_label() == "m"]
    assert (mean.get_xdata()[-1], mean.get_ydata()[-1]) == pytest.approx((175, 0.8))


def test_one_seed_is_reported_as_not_tested(tmp_path):
    """With one seed no pair is tested: the ranking says so, not "no pair is significantly different"."""
    out = tmp_path / "bench"
    write_outputs(out, *fake_bench(out, seeds=[0]))
    md = (out / "report.md").read_text()
    assert "2. proxy" not in md and "no pair is significantly different" not in md
    assert (
        "not ranked: gold (0.500), proxy (0.150) — not tested: no pair has 2 shared seeds, each measured"
        in md
    )


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    if os.environ.get("TEXTGYM_REQUIRE_BROWSER"):
        pytest.fail("no Chromium found: .ci/run installs the OS package `chromium`")
    pytest.skip("no Chromium on this machine (apt-get install chromium)")


FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip

# Appended to a copy of the page: after load, it writes what rendered into the DOM that --dump-dom prints.
PROBE = """<script>
window.addEventListener("load", () => {
  const images = [...document.images].map(i => ({ok: i.complete && i.naturalWidth > 0,
    w: i.getBoundingClientRect().width, h: i.getBoundingClientRect().height, alt: i.alt}));
  const tables = [...document.querySelectorAll("table")].map(t => ({rows: t.rows.length,
    w: t.getBoundingClientRect().width}));
  const pre = document.createElement("pre"); pre.id = "probe";
  pre.textContent = JSON.stringify({images, tables, title: document.title});
  document.body.appendChild(pre);
});
</script>"""


def test_the_html_report_renders_its_plots_and_tables_in_a_browser(report, tmp_path):
    out, _ = report
    browser = chromium()
    html = (out / "report.html").read_text()
    assert "<script" not in html and "http" not in html.split("<body>")[0]  # self-contained, nothing to fetch
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", PROBE + "</body>"))
    common = [browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,2000"]
    dom = subprocess.run(
        [*common, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    start = dom.index('<pre id="probe">') + len('<pre id="probe">')
    import html as html_lib

    found = json.loads(html_lib.unescape(dom[start : dom.index("</pre>", start)]))
    assert found["title"] == "Reward-design benchmark"
    assert len(found["images"]) == 6  # 4 plots + each design's curves
    assert all(i["ok"] and i["w"] > 300 and i["h"] > 100 for i in found["images"]), found["images"]
    assert len(found["tables"]) >= 3 and all(t["rows"] >= 2 and t["w"] > 100 for t in found["tables"])
    # and the page itself paints: a screenshot that is not blank
    shot = tmp_path / "shot.png"
    subprocess.run([*common, f"--screenshot={shot}", (out / "report.html").as_uri()],
                   capture_output=True, timeout=120, check=True)  # fmt: skip
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[0] > 1000 and pixels.std() > 0.05


def test_the_overoptimization_plot_draws_a_kl_estimate_below_zero_left_of_zero(report):
    """Mean log pi - log pi_ref over a few samples can be negative near the reference: drawn as -sqrt(-KL), and the
    axis says so, not clamped to a KL of exactly 0."""
    import dataclasses

    import matplotlib

    matplotlib.use("Agg")
    from textgym.bench_plots import overoptimization

    _, results = report
    run = next(iter(results.curves))
    curves = {k: [dict(r) for r in c] for k, c in results.curves.items()}
    curves[run][0]["kl"] = -0.25
    fig = overoptimization(dataclasses.replace(results, curves=curves))
    xs = [x for ax in fig.axes for line in ax.get_lines() for x in line.get_xdata()]
    assert min(xs) == pytest.approx(-0.5)
    assert "below 0" in fig.axes[0].get_xlabel()
    # each label fits under its own plot (one line of it ran into the neighbours' labels)
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        assert ax.xaxis.label.get_window_extent(renderer).width <= ax.get_window_extent(renderer).width
    fig_clean = overoptimization(results)
    assert "below 0" not in fig_clean.axes[0].get_xlabel()
    assert min(x for ax in fig_clean.axes for line in ax.get_lines() for x in line.get_xdata()) >= 0


def test_a_run_without_a_current_curve_leaves_its_designs_mean_line_in_the_overoptimization_plot(report):
    """A run with no curve (stale after an evaluation change, or never measured) made the shortest curve 0
    points long, and its design lost the thick mean line and its legend entry."""
    import dataclasses

    import matplotlib

    matplotlib.use("Agg")
    from textgym.bench_plots import overoptimization

    _, results = report

    def thick(fig):
        return sorted(line.get_label() for line in fig.axes[0].get_lines() if line.get_linewidth() > 2)

    every = thick(overoptimization(results))
    curves = {k: [dict(r) for r in c] for k, c in results.curves.items()}
    curves[next(iter(curves))] = []
    assert len(every) > 1 and thick(overoptimization(dataclasses.replace(results, curves=curves))) == every


def test_a_p_value_near_the_cut_shows_the_digits_that_put_it_on_its_side():
    """0.0496 ("better") and 0.05004 (not significant) both showed as "0.050"."""
    from textgym.bench_numbers import fmt_p

    assert (fmt_p(0.0496), fmt_p(0.05004), fmt_p(0.05), fmt_p(0.0512)) == (
        "0.0496",
        "0.05004",
        "0.050",
        "0.051",
    )
    assert (fmt_p(0.0004), fmt_p(0.3)) == ("<0.001", "0.300")


def test_values_outside_a_declared_range_are_warned_of(tmp_path, report):
    """A metric's intervals are clipped to its declared range: a wrong range went unseen."""
    assert "outside its declared range" not in (report[0] / "report.md").read_text()
    out = tmp_path / "bench"
    spec, jobs = fake_bench(out)
    spec["metric_rewards"][0]["range"] = [0.0, 0.2]  # the gold design's runs end at 0.5 to 0.56
    write_outputs(out, spec, jobs)
    warning = "`exact_copy` measured 0.500 to 0.560 on 3 runs, outside its declared range [0, 0.2]"
    assert warning in (out / "report.md").read_text()
    assert "<code>exact_copy</code> measured 0.500 to 0.560 on 3 runs" in (out / "report.html").read_text()


def test_a_final_value_over_few_episodes_is_said(tmp_path, report):
    """A metric applying to few completions (one that scores only the replies that stopped) gave a final value
    over 1 episode that read as one over every evaluation episode: eval.json did not keep the counts."""
    assert "rests on few episodes" not in (report[0] / "report.md").read_text()
    out = tmp_path / "bench"
    spec, jobs = fake_bench(out)
    for job in jobs:
        result = json.loads((job.run_dir / "eval.json").read_text())
        few = job.design["name"] == "proxy" and job.seed < 2
        result["counts"] = {"reward": 64, "exact_copy": 1 + 2 * job.seed if few else 64}
        (job.run_dir / "eval.json").write_text(json.dumps(result))
    write_outputs(out, spec, jobs)
    note = ("`exact_copy` of proxy rests on few episodes: on 2 of 3 runs its final value is a mean over fewer "
            "than 8 evaluation episodes (the ones it applied to; fewest: 1)")  # fmt: skip
    assert note in (out / "report.md").read_text()
    assert "<code>exact_copy</code> of proxy rests on few episodes" in (out / "report.html").read_text()


def test_the_curve_spacing_is_the_one_between_evaluations_not_to_a_runs_end():
    from textgym.bench_report import _curve_spacing

    def rows(*iterations):
        return [{"iteration": str(i)} for i in iterations]

    # a run shorter than eval_every has only its end: "every 3 or 5 iterations" was said beside the others'
    assert _curve_spacing({"a": rows(0, 3, 6, 7), "b": rows(0, 5)}) == ", during training every 3 iterations"
    assert _curve_spacing({"b": rows(0, 5)}) == ", during training every 5 iterations"
    assert (
        _curve_spacing({"c": rows(0, 0, 3, 4)}) == ", during training every 3 iterations"
    )  # (not "every 0")
    assert _curve_spacing({"d": rows(0)}) == ""


def test_a_flag_raised_on_the_only_seed_with_a_curve_says_the_others_were_not_checked(tmp_path):
    """After a rerun with another metric, only a new seed had a curve: the flag read "(seed 0; shown: seed
    0)", as if the other seeds had been checked and passed."""
    out = tmp_path / "bench"
    spec, jobs = fake_bench(out)
    for job in jobs:
        if job.design["name"] == "proxy" and job.seed != 0:
            (job.run_dir / "eval.csv").unlink()
    write_outputs(out, spec, jobs)
    md = (out / "report.md").read_text()
    assert (
        "(seed 0, the only one of 3 seeds with a held-out curve of exact_copy to check; shown: seed 0)" in md
    )


def test_adding_a_metric_keeps_the_finished_runs_curves_of_the_others_and_says_what_they_lack(tmp_path):
    """The curves' digest covered the whole metric list: one metric more dropped every run's curve, and with
    it every gaming flag, until the runs trained again."""
    out = tmp_path / "bench"
    spec, jobs = fake_bench(out)
    write_outputs(out, spec, jobs)
    before = (out / "report.md").read_text()
    assert "exact_copy 0.500 -> 0.150 (3 of 3 seeds; shown: seed 0)" in before
    d = json.loads(json.dumps(DESIGNS))
    d["bench"]["output_dir"] = str(out)
    gold = d["designs"][1]
    gold["rewards"] = {"aggregate": "sum", "components": gold["rewards"]}
    d["metrics"]["rewards"].append({"name": "length_penalty", "target": 3, "label": "short"})
    grown = bench.load_designs(d)
    regrown = bench.plan(grown, out)
    assert [j.curves_hash for j in regrown] != [j.curves_hash for j in jobs]  # the whole list changed
    write_outputs(out, grown, regrown)
    md = (out / "report.md").read_text()
    assert "exact_copy 0.500 -> 0.150 (3 of 3 seeds; shown: seed 0)" in md  # still checked on every seed
    assert "The held-out curves of" not in md  # none dropped
    assert "The curve checks that read `short` (on 6 runs) did not run there: those runs trained before" in md
    # a metric's range only clips intervals: changing it keeps its column
    d["metrics"]["rewards"][0]["range"] = [0, 2]
    ranged = bench.load_designs(d)
    write_outputs(out, ranged, bench.plan(ranged, out))
    assert "exact_copy 0.500 -> 0.150 (3 of 3 seeds; shown: seed 0)" in (out / "report.md").read_text()
    # other prompts change what every column measures: then the curves go, as before
    d["bench"]["eval_prompts"] = "copy-train"
    other = bench.load_designs(d)
    write_outputs(out, other, bench.plan(other, out))
    md = (out / "report.md").read_text()
    assert "The held-out curves of 6 runs are not shown" in md and "exact_copy 0.500 -> 0.150" not in md


def test_kl_added_is_not_named_as_a_curve_check_that_did_not_run(tmp_path):
    """No curve check reads kl: "the curve checks that read `kl` did not run" named checks that do not exist."""
    out = tmp_path / "bench"
    fake_bench(out, builtin=["length", "distinct_2", "eos_rate"])
    with_kl = bench.load_designs(
        {**json.loads(json.dumps(DESIGNS)), "bench": {**DESIGNS["bench"], "output_dir": str(out)}}
    )
    write_outputs(out, with_kl, bench.plan(with_kl, out))
    md = (out / "report.md").read_text()
    assert "exact_copy 0.500 -> 0.150 (3 of 3 seeds; shown: seed 0)" in md and "`kl`" not in md


def test_a_run_recorded_before_curve_parts_gets_them_where_its_curves_digest_matches(tmp_path):
    out = tmp_path / "bench"
    _, jobs = fake_bench(out)
    index = json.loads((out / bench_records.INDEX_FILE).read_text())
    for record in index["runs"].values():
        del record["curve_parts"]
    (out / bench_records.INDEX_FILE).write_text(json.dumps(index))
    bench_records.add_curve_parts(out, jobs)
    runs = json.loads((out / bench_records.INDEX_FILE).read_text())["runs"]
    assert all(runs[j.run_id]["curve_parts"] == j.curve_parts for j in jobs)
