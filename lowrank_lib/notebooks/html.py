"""Reports a researcher opens anywhere: each executed notebook as ONE offline HTML file, an index, and the
checks that a committed report is the notebook's current code, cleanly run.

    python -m lowrank_lib.notebooks html            # reports/<nb>.html for every reports/<nb>.ipynb + index.html

**Offline.** nbconvert's ``lab`` template loads require.js, MathJax, mermaid and the widget manager from a
CDN; :func:`to_html` renders with a template that loads none of them (images are inline base64 already), so
a report opens from a file on a machine with no network. Widgets need no script either: every slider
panel writes its last view as ordinary output (:mod:`lowrank_lib.explore.ui`), so the controls are replaced
by a one-line note saying so, and any other widget output (progress bars: none after
:func:`lowrank_lib.notebooks.working`) is dropped.

**Fresh and clean** (:func:`report_problems`, run by ``tests/test_notebooks.py``): the report's cells are the
notebook's cells (papermill's ``injected-parameters`` cell aside); no error, stderr, warning, stray return
value (an ``execute_result`` that is only text: a ``PosixPath``, a dict, a matplotlib artist), ``<Figure
size ...>`` placeholder, ``-0.0000`` or U+FFFD in any output, the saved widget outputs included; no paragraph of
prose printed twice (markdown cells and Markdown outputs, :func:`repeated_paragraphs`); every figure and every
"**What this shows.**" under the numbered section heading it belongs to (:func:`heading_problems`); the HTML
beside it was rendered from exactly this ``.ipynb`` (its SHA-256 is in the HTML); and its ``metrics.json`` does
not say ``timings_meaningful: false`` (timings measured on a busy machine are never committed).
"""
from __future__ import annotations

import copy
import hashlib
import html
import json
import re
from pathlib import Path

#: the template: nbconvert's lab template without a single network script
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_css -%}
<meta name="lowrank-lib-report-sha256" content="{{ resources.report_sha256 }}">
{%- endblock html_head_css -%}
"""
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
STATE_MIME = "application/vnd.jupyter.widget-state+json"
PANEL_NOTE = ("[interactive controls: open the notebook in JupyterLab and run it to move them; "
              "the output below is the view of their last value]")
#: the meta tag as nbconvert writes it back (its HTML post-processing orders the attributes)
SHA_RE = re.compile(r'<meta (?:content="([0-9a-f]{64})" name="lowrank-lib-report-sha256"|'
                    r'name="lowrank-lib-report-sha256" content="([0-9a-f]{64})")\s*/?>')


def _widget_states(nb) -> dict:
    return nb.metadata.get("widgets", {}).get(STATE_MIME, {}).get("state", {})


def offline_notebook(nb):
    """A copy of ``nb`` with no widget outputs and no widget state: slider panels' controls become
    :data:`PANEL_NOTE`, other widget views (closed progress areas) and empty outputs are dropped."""
    nb = copy.deepcopy(nb)
    states = _widget_states(nb)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outs = []
        for o in cell.get("outputs", []):
            data = o.get("data", {})
            if WIDGET_MIME in data:
                model = states.get(data[WIDGET_MIME].get("model_id"), {})
                if model.get("model_name") == "VBoxModel":
                    outs.append({"output_type": "display_data", "metadata": {},
                                 "data": {"text/plain": PANEL_NOTE}})
                continue
            if o.get("output_type") == "display_data" and set(data) == {"text/plain"} and not data["text/plain"]:
                continue                    # a finished progress area (notebooks.working)
            outs.append(o)
        cell["outputs"] = outs
    nb.metadata.pop("widgets", None)
    return nb


def prune_widget_state(nb) -> int:
    """Drop the saved state of every widget model no output shows (directly or as a child, layout or style of
    one that does): closed progress bars and progress areas. Returns how many models were dropped."""
    states = _widget_states(nb)
    if not states:
        return 0
    todo = [o["data"][WIDGET_MIME].get("model_id") for c in nb.cells if c.cell_type == "code"
            for o in c.get("outputs", []) if WIDGET_MIME in o.get("data", {})]
    keep: set[str] = set()
    while todo:
        mid = todo.pop()
        if mid in keep or mid not in states:
            continue
        keep.add(mid)
        todo += re.findall(r"IPY_MODEL_([0-9a-f]+)", json.dumps(states[mid].get("state", {})))
    dropped = [m for m in states if m not in keep]
    for m in dropped:
        del states[m]
    return len(dropped)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def to_html(ipynb: str | Path, out: str | Path | None = None) -> Path:
    """Render the executed notebook ``ipynb`` to ``out`` (default: beside it, ``.html``) with no network script."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    ipynb = Path(ipynb)
    out = Path(out) if out else ipynb.with_suffix(".html")
    nb = offline_notebook(nbformat.read(ipynb, as_version=4))
    exporter = HTMLExporter(template_name="lab", extra_loaders=[jinja2.DictLoader({"offline.html.j2": OFFLINE_TEMPLATE})],
                            template_file="offline.html.j2")
    body, _ = exporter.from_notebook_node(nb, resources={"report_sha256": sha256(ipynb),
                                                         "metadata": {"name": title(nb) or ipynb.stem}})
    out.write_text(body, encoding="utf-8")
    return out


def title(nb) -> str:
    """The notebook's first markdown heading, without the ``#``."""
    for c in nb.cells:
        if c.cell_type == "markdown":
            for line in c.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return ""


def write_index(reports_dir: str | Path, names: list[str]) -> Path:
    """``reports_dir/index.html``: one row per notebook with its title, links, parameters, wall time and the
    headline numbers its ``metrics.json`` lists (``NotebookContext.write_metrics(headline=...)``)."""
    import nbformat

    reports_dir = Path(reports_dir)
    rows = []
    for n in names:
        ipynb = reports_dir / f"{n}.ipynb"
        if not ipynb.exists():
            continue
        nb = nbformat.read(ipynb, as_version=4)
        mpath = reports_dir / n / "metrics.json"
        m = json.loads(mpath.read_text()) if mpath.exists() else {}
        params = nb.metadata.get("papermill", {}).get("parameters", {})
        shown = {k: v for k, v in params.items() if k not in ("OUT_DIR", "FIG_DIR")}
        head = m.get("headline", {})
        heads = "".join(f"<li>{html.escape(k)}: <b>{html.escape(v)}</b></li>" for k, v in head.items())
        rows.append(f"<tr><td><a href='{n}.html'>{html.escape(title(nb) or n)}</a><br><small>{n} · "
                    f"<a href='{n}.ipynb'>.ipynb</a></small></td><td><ul>{heads or '<li>(no headline)</li>'}</ul></td>"
                    f"<td><small>{html.escape(json.dumps(shown) if shown else 'notebook defaults')}</small></td>"
                    f"<td>{m.get('wall_s', float('nan')):.0f} s</td></tr>")
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>lowrank_lib reports</title><style>"
            "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
            "table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ccc;padding:8px;"
            "vertical-align:top;text-align:left}ul{margin:0;padding-left:1.2em}</style></head><body>"
            "<h1>lowrank_lib: executed notebooks</h1><p>Each report is the notebook run headless by "
            "<code>make report</code> (<code>python -m lowrank_lib.notebooks run</code>); every page opens "
            "offline. Wall time: the notebook's own cells, from its first to its last.</p><table><tr>"
            "<th>notebook</th><th>headline numbers</th><th>parameters</th><th>wall</th></tr>"
            + "".join(rows) + "</table></body></html>\n")
    out = reports_dir / "index.html"
    out.write_text(page, encoding="utf-8")
    return out


# --------------------------------------------------------------------------- freshness and cleanliness
#: a Python warning as printed (``FutureWarning: ...``, ``UserWarning: ...``): a class name ending in Warning
WARNING_RE = re.compile(r"\b[A-Z][A-Za-z]*[a-z]Warning: ")
NEG_ZERO_RE = re.compile(r"(?<![\w.])-0\.0+(?![\d.eE]*[1-9])\b")


def _texts(nb):
    """(where, kind, text) of every output, the outputs saved in widget state included."""
    for i, c in enumerate(nb.cells):
        for o in c.get("outputs", []):
            t = o.get("output_type")
            if t == "stream":
                yield f"cell {i}", o.get("name", "stdout"), o.get("text", "")
            elif t in ("execute_result", "display_data"):
                for mime, v in o.get("data", {}).items():
                    if mime.startswith("text/"):
                        yield f"cell {i}", f"{t} {mime}", v if isinstance(v, str) else "".join(v)
            elif t == "error":
                yield f"cell {i}", "error", f"{o.get('ename')}: {o.get('evalue')}"
    for mid, w in _widget_states(nb).items():
        for o in w.get("state", {}).get("outputs", []) or []:
            text = o.get("text") or "".join(str(v) for k, v in o.get("data", {}).items() if k.startswith("text/"))
            yield f"widget {mid[:8]}", o.get("name", o.get("output_type", "?")), text


#: a paragraph shorter than this may repeat (a caption, "**Next:** ..."); a longer one printed twice is a mistake
MIN_PARAGRAPH = 80
#: a line of prose at least this long printed twice is a copy too (checked inside paragraphs as well)
MIN_LINE = 40
#: a numbered section heading: "## 3 · Title"
SECTION_RE = re.compile(r"^#{2,3} +(\d+) +· ", re.M)
CONCLUSION = "**What this shows.**"


def _prose(nb):
    """(where, text) of every markdown cell and every Markdown output."""
    for i, c in enumerate(nb.cells):
        if c.cell_type == "markdown":
            yield f"cell {i}", c.source
        for o in c.get("outputs", []):
            v = o.get("data", {}).get("text/markdown")
            if v is not None:
                yield f"cell {i}", v if isinstance(v, str) else "".join(v)


def repeated_paragraphs(nb) -> list[str]:
    """Every paragraph (blank-line separated, whitespace normalised, at least :data:`MIN_PARAGRAPH` characters)
    that the notebook prints more than once, in its markdown cells and Markdown outputs."""
    seen: dict[str, list[str]] = {}
    lines: dict[str, list[str]] = {}
    for where, text in _prose(nb):
        for para in re.split(r"\n\s*\n", text):
            norm = " ".join(para.split())
            if len(norm) >= MIN_PARAGRAPH:
                seen.setdefault(norm, []).append(where)
            for line in para.splitlines():      # a copy pasted inside one paragraph (table rows may repeat)
                norm = " ".join(line.split())
                if len(norm) >= MIN_LINE and not norm.startswith("|"):
                    lines.setdefault(norm, []).append(where)
    out = [f"a paragraph printed {len(w)} times ({', '.join(w)}): {p[:90]!r}" for p, w in seen.items() if len(w) > 1]
    return out + [f"a line printed {len(w)} times ({', '.join(w)}): {p[:90]!r}" for p, w in lines.items()
                  if len(w) > 1 and not any(p in q for q in seen if len(seen[q]) > 1)]


def _shows_result(c) -> bool:
    """A code cell whose outputs hold a figure or a computed conclusion."""
    for o in c.get("outputs", []):
        data = o.get("data", {})
        md = data.get("text/markdown", "")
        if any(k.startswith("image/") for k in data) or CONCLUSION in (md if isinstance(md, str) else "".join(md)):
            return True
    return False


def heading_problems(nb) -> list[str]:
    """Headings placed after the cell they describe. Once a notebook numbers its sections ("## 1 · ..."), every
    cell showing a figure or a conclusion must sit under a numbered heading (none between the setup and
    section 1, none under an unnumbered ``#`` / ``##`` heading; a ``###`` subsection stays in its section), the
    numbers count 1, 2, 3 ..., and every
    numbered section shows something before the next heading (an empty section is a heading placed after its
    cell, whose result then sits in the section before)."""
    heads = [(i, int(m.group(1))) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"
             for m in [SECTION_RE.search(c.source)] if m]
    if not heads:
        return []
    bad = []
    nums = [n for _, n in heads]
    if nums != list(range(1, len(nums) + 1)):
        bad.append(f"section numbers {nums}: they should count 1, 2, 3 ...")
    section, shown = None, {}
    for i, c in enumerate(nb.cells):
        if c.cell_type == "markdown" and c.source.lstrip().startswith("#"):
            m = SECTION_RE.search(c.source)
            if m:
                section = int(m.group(1))
                shown.setdefault(section, 0)
            elif c.source.lstrip().startswith("## ") or c.source.lstrip().startswith("# "):
                section = None              # an unnumbered section (a ### subsection stays in its section)
            continue
        if c.cell_type == "code" and _shows_result(c):
            if section is None:
                first = c.source.splitlines()[0][:60] if c.source else ""
                bad.append(f"cell {i} ({first!r}) shows a result under no numbered section heading: is its heading "
                           "placed after it?")
            else:
                shown[section] += 1
    bad += [f"section {n} shows no figure or conclusion before the next heading: is its heading placed after "
            "the cell it describes?" for n, k in shown.items() if k == 0]
    return bad


def output_problems(nb) -> list[str]:
    """Everything a reader should not see in the executed notebook ``nb`` (see the module docstring)."""
    bad = repeated_paragraphs(nb) + heading_problems(nb)
    for i, c in enumerate(nb.cells):
        for o in c.get("outputs", []):
            data = o.get("data", {})
            if o.get("output_type") == "execute_result" and set(data) <= {"text/plain"}:
                text = data.get("text/plain", "")
                bad.append(f"cell {i}: a stray return value {text[:100]!r} (end the cell with a table or nothing)")
    for where, kind, text in _texts(nb):
        if kind == "error":
            bad.append(f"{where}: an error: {text[:200]}")
        elif kind == "stderr" and text.strip():
            bad.append(f"{where}: stderr: {text[:200]!r}")
        if WARNING_RE.search(text):
            bad.append(f"{where}: a warning in {kind}: {text[max(0, WARNING_RE.search(text).start() - 80):][:200]!r}")
        if "<Figure size" in text:
            bad.append(f"{where}: matplotlib's '<Figure size ...>' placeholder (show figures with ctx.show)")
        if "\ufffd" in text:
            bad.append(f"{where}: U+FFFD in {kind}")
        if NEG_ZERO_RE.search(text) and "image/" not in kind:
            m = NEG_ZERO_RE.search(text)
            bad.append(f"{where}: a negative zero {text[max(0, m.start() - 40):m.end() + 20]!r} in {kind}")
    return bad


def report_problems(report: str | Path, notebook: str | Path) -> list[str]:
    """Why the committed ``report`` (an executed ``.ipynb``) is not the current, clean run of ``notebook``,
    and whether its HTML is missing or rendered from another version; [] when it is fine."""
    import nbformat

    report, notebook = Path(report), Path(notebook)
    rep = nbformat.read(report, as_version=4)
    src = nbformat.read(notebook, as_version=4)
    bad = []
    cells = [c for c in rep.cells if "injected-parameters" not in c.metadata.get("tags", [])]
    if len(cells) != len(src.cells):
        bad.append(f"{len(cells)} cells, the notebook has {len(src.cells)}: regenerate the report")
    for i, (a, b) in enumerate(zip(cells, src.cells)):
        if (a.cell_type, a.source) != (b.cell_type, b.source):
            first = next((la for la, lb in zip(a.source.splitlines() + [""], b.source.splitlines() + [""]) if la != lb), "")
            bad.append(f"cell {i} ({b.cell_type}) differs from the notebook's (first differing report line: "
                       f"{first[:80]!r}): regenerate the report")
            break
    bad += output_problems(rep)
    metrics = report.with_suffix("") / "metrics.json"
    if metrics.exists() and json.loads(metrics.read_text()).get("timings_meaningful") is False:
        bad.append(f"{metrics.parent.name}/metrics.json says timings_meaningful=false: timings measured on a busy "
                   "machine; regenerate the report on an idle one")
    html_path = report.with_suffix(".html")
    if not html_path.exists():
        bad.append(f"no {html_path.name} beside the report (python -m lowrank_lib.notebooks html)")
    else:
        m = SHA_RE.search(html_path.read_text(encoding="utf-8", errors="replace"))
        if not m or (m.group(1) or m.group(2)) != sha256(report):
            bad.append(f"{html_path.name} was not rendered from this {report.name} "
                       f"(python -m lowrank_lib.notebooks html {report.stem})")
    return bad
